"""pagoda.lora."""
