"""pagoda.engine."""
