"""Checkpoint formats: compressed-tensors (pack-quantized write/read, naive read), legacy GPTQ."""
