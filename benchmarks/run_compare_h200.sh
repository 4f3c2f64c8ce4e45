#!/usr/bin/env bash
# `pagoda compare` on one H200 (issue 7): dummy-weight Qwen2.5-3B (the first user's size) and
# Qwen2.5-7B, bf16 vs W4A16, with transformers (same shape, bf16) as the baseline column.
# Usage: OUT=out bash benchmarks/run_compare_h200.sh [3b] [7b] [3b-12gib]   (default: 3b 7b)
# Each run is < 300 s, so "3b 7b" fits one device call; "3b-12gib" repeats 3B on a 12 GiB
# budget (utilization 0.0858 of 139.8 GiB: an RTX 4070-sized card, as in the seed). Copy
# $OUT/compare_* to benchmarks/results/. Without matplotlib on the GPU machine the plots are
# skipped; draw them afterwards with `python -m pagoda.bench.compare_report DIR`.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(3b 7b)
for run in "${runs[@]}"; do
  size=${run%%-*}
  cfg="config:benchmarks/configs/qwen2.5-$size.json"
  name="Qwen2.5-$(echo "$size" | tr a-z A-Z)"
  extra=(--gpu-memory-utilization 0.85 --throughput-requests 256 --baseline transformers)
  if [ "$run" = "3b-12gib" ]; then
    extra=(--gpu-memory-utilization 0.0858 --throughput-requests 256)
  fi
  timeout 295 python3 -m pagoda.cli compare "$cfg" "$cfg:w4a16" \
    --labels "$name bf16,$name W4A16" --dtype bfloat16 --max-model-len 4096 \
    --prompt-len 512 --output-len 256 --batch-sizes 1,8,64 --iters 2 "${extra[@]}" \
    --timeout 120 --out "$OUT/compare_qwen2.5-${run}_h200" \
    2>&1 | grep -v -i "warn" | tail -70 | tee "$OUT/compare_qwen2.5-${run}_h200.log"
done
