"""pagoda.quant: the quantized checkpoint FORMAT — what a loaded model needs.

Weight descriptions (`weights.py`), their meaning (`dequant.py`), int32 packing (`packing.py`),
schemes and `quantization_config` parsing (`scheme.py`, `schemes.py`) and the checkpoint
formats (`formats/`: compressed-tensors, legacy GPTQ, AutoAWQ GEMM). It knows no model and no
quantizer; the quantizer (`pagoda.quantizer`) sits above the models and writes these formats.
"""
