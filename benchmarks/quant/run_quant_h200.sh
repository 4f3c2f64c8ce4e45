#!/usr/bin/env bash
# Issue 4 on the H200 (acceptance 3 and 4), one device call: GPU tests of the W4A16 kernels,
# the GEMM table (Qwen2.5-7B shapes, M = 1..512), batch-1 decode of dummy Qwen2.5-7B W4A16 vs
# bf16 (same run), and the time to GPTQ-quantize dummy Qwen2.5-7B (256 x 2048 random tokens).
# Results land in $OUT; copy them to benchmarks/results/.
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
CFG=benchmarks/configs/qwen2.5-7b.json
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_triton_w4a16.py \
  2>&1 | tail -15 | tee "$OUT/w4a16_gpu_tests.log"
timeout 240 python3 benchmarks/quant/bench_w4a16_gemm.py --out "$OUT/w4a16_gemm_h200.json" \
  2>&1 | tail -60 | tee "$OUT/w4a16_gemm.log"
for spec in "$CFG" "$CFG:w4a16"; do
  tag=$([[ $spec == *w4a16 ]] && echo w4a16 || echo bf16)
  timeout 150 python3 -m pagoda.cli bench latency "config:$spec" --dtype bfloat16 \
    --prompt-len 512 --output-len 256 --iters 3 --baseline none \
    --out "$OUT/latency_qwen2.5-7b_$tag.json" 2>&1 | grep -v Warning | tail -8 | tee -a "$OUT/latency.log"
done
timeout 900 python3 -m pagoda.cli quantize "config:$CFG" --out /tmp/q7b --dataset random \
  --num-samples 256 --max-seq-len 2048 --group-size 128 --report "$OUT/quantize_qwen2.5-7b_h200.json" \
  --no-progress 2>&1 | tail -40 | tee "$OUT/quantize_7b.log"
