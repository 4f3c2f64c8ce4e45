"""pagoda.kernels."""
