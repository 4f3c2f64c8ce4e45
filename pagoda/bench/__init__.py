"""pagoda.bench."""
