"""pagoda.entrypoints."""
