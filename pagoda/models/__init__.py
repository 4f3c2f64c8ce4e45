"""pagoda.models."""
