#!/usr/bin/env bash
# One device call: GPU correctness tests, then the latency and throughput benchmarks.
# Results land in $OUT (fetched by the device tool) and are copied to benchmarks/results/.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/entrypoints/test_gpu_engine.py \
  2>&1 | tail -25 | tee "$OUT/gpu_engine_tests.log"
timeout 120 python3 -m pagoda.cli bench latency config:benchmarks/configs/qwen2.5-7b.json \
  --dtype bfloat16 --prompt-len 512 --output-len 256 --iters 3 --out "$OUT/latency_qwen2.5-7b.json" \
  2>&1 | grep -v Warning | tail -15 | tee "$OUT/latency.log"
timeout 130 python3 -m pagoda.cli bench throughput config:benchmarks/configs/qwen2.5-3b.json \
  --dtype bfloat16 --gpu-memory-utilization 0.5 --baseline-requests ${HF_REQS:-32} --out "$OUT/throughput_qwen2.5-3b.json" \
  2>&1 | grep -v -i "warn\|it/s\]" | tail -15 | tee "$OUT/throughput.log"
