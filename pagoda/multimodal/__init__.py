"""Image inputs for vision-language models (Qwen2-VL / Qwen2.5-VL), engine side.

Loading (data URLs, local paths, PIL images, opt-in http(s)), resizing to the model's pixel
bounds, content hashing, placeholder expansion and M-RoPE positions. Everything here is PIL and
NumPy only (no torch), so the engine stays importable without the model side; the runner turns
the resized pixels into patches on the device.
"""
