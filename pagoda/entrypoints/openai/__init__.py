"""pagoda.entrypoints.openai."""
