#!/usr/bin/env bash
# One device call for Qwen2.5-VL: the GPU tests (CUDA graphs vs eager vs transformers), then the
# 1280x720-image TTFT / decode benchmark (bf16, W4A16, transformers in the same run).
# Results land in $OUT; copy them to benchmarks/results/ and summarize in BENCHMARKS.md.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_qwen2_5_vl.py \
  2>&1 | tail -25 | tee "$OUT/vl_gpu_tests.log"
timeout 360 python3 benchmarks/vl/bench_vl.py --iters 5 --warmup 2 --output-len 128 \
  --out "$OUT/vl_qwen2.5-vl-3b_h200.json" 2>&1 | grep -v -i "warn" | tail -15 | tee "$OUT/vl_bench.log"
