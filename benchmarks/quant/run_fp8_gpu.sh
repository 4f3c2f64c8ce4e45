#!/usr/bin/env bash
# FP8 on one GPU (issue 43): the FP8 kernels' GPU tests, then `pagoda compare` of bf16 vs FP8 W8A8
# (dummy weights of the real Qwen2.5 shapes, FP8_DYNAMIC layout), each engine in its own process:
# decode at batch 1 / 64 / 128 and the throughput protocol (256 requests), ratios from one run.
# Usage: OUT=out RUN_COMMIT=<hash> bash benchmarks/quant/run_fp8_gpu.sh [tests] [7b] [3b] [kv8k]
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit ${RUN_COMMIT:-unknown} $(date -u +%FT%TZ)" | tee "$OUT/commit.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/gpu.txt"
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(tests 7b)
for run in "${runs[@]}"; do
  case "$run" in
  tests)
    timeout 75 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider \
      tests/kernels/test_triton_fp8.py tests/layers/test_fp8_linear_gpu.py \
      tests/kernels/test_fp8_kv_cache.py > "$OUT/fp8_gpu_tests.log" 2>&1
    grep -E "passed|failed|Error|assert" "$OUT/fp8_gpu_tests.log" | tail -25
    ;;
  3b | 7b)
    cfg="config:benchmarks/configs/qwen2.5-$run.json"
    name="Qwen2.5-$(echo "$run" | tr a-z A-Z)"
    timeout 120 python3 -m pagoda.cli compare "$cfg" "$cfg:fp8" \
      --labels "$name bf16,$name FP8" --dtype bfloat16 --max-model-len 4096 \
      --prompt-len 512 --output-len 128 --batch-sizes 1,64,128 --iters 2 \
      --gpu-memory-utilization 0.85 --throughput-requests 256 --timeout 60 \
      --out "$OUT/compare_fp8_qwen2.5-$run" 2>&1 | grep -v -i "warn" | tail -40 \
      | tee "$OUT/compare_fp8_qwen2.5-$run.log"
    # one archive: the device returns a limited number of files
    tar czf "$OUT/compare_fp8_qwen2.5-$run.tgz" -C "$OUT" "compare_fp8_qwen2.5-$run" \
      && rm -rf "${OUT:?}/compare_fp8_qwen2.5-$run"
    ;;
  kv8k)
    cfg="config:benchmarks/configs/qwen2.5-7b.json"
    for kv in auto fp8; do
      timeout 45 python3 -m pagoda.cli bench latency "$cfg" --dtype bfloat16 \
        --kv-cache-dtype "$kv" --batch-size 16 --prompt-len 8192 --output-len 64 --iters 2 \
        --max-model-len 8448 --gpu-memory-utilization 0.85 --baseline none \
        --out "$OUT/latency_kv_${kv}_7b_8k.json" 2>&1 | tail -8 | tee "$OUT/latency_kv_${kv}.log"
    done
    ;;
  esac
done
