"""pagoda.worker."""
