"""pagoda.layers."""
