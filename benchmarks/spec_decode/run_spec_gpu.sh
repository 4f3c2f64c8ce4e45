#!/usr/bin/env bash
# Speculative decoding on one GPU: the spec-decode GPU tests, the verify cost of
# k = 0..8 with a per-kernel profile, and the known-acceptance end-to-end run (random weights of
# the real Qwen2.5-3B shape). Usage: OUT=out RUN_COMMIT=<hash> bash
# benchmarks/spec_decode/run_spec_gpu.sh [tests] [w4a16] [bf16] [e2e] [draft] [vl]
# (e2e: E2E_BATCHES, E2E_TIMEOUT and PROFILE_HOST="B,C", the run whose host work is profiled)
set -u
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit ${RUN_COMMIT:-unknown} $(date -u +%FT%TZ)" | tee "$OUT/commit.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
cfg=config:benchmarks/configs/qwen2.5-3b.json
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(tests w4a16 e2e)
for run in "${runs[@]}"; do
  case "$run" in
  tests)
    timeout 240 python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider \
      tests/entrypoints/test_spec_decode.py tests/entrypoints/test_spec_decode_draft.py \
      tests/models/test_qwen2_5_vl_spec.py > "$OUT/spec_gpu_tests.log" 2>&1
    grep -E "passed|failed|Error|assert" "$OUT/spec_gpu_tests.log" | tail -25
    # the fused decode / verify attention, every case compiled (not only the gpu-marked ones)
    timeout 240 python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
      tests/kernels/test_fused_decode_attention.py tests/kernels/test_fp8_kv_cache.py \
      > "$OUT/attention_gpu_tests.log" 2>&1
    grep -E "passed|failed|Error|assert" "$OUT/attention_gpu_tests.log" | tail -25
    ;;
  w4a16 | bf16)
    m=$cfg; [ "$run" = w4a16 ] && m=$cfg:w4a16
    timeout 200 python3 benchmarks/spec_decode/bench_verify_cost.py --models "$m" \
      --batches 1,8,32,128 --ks 0,1,2,4,8 --profile-batches 1 --profile-ks 0,1,4 --profile-launch \
      --commit "${RUN_COMMIT:-unknown}" --out "$OUT/$run" 2>&1 | grep -v -i warn | tee "$OUT/$run.log"
    ;;
  e2e)
    timeout "${E2E_TIMEOUT:-240}" python3 benchmarks/spec_decode/bench_verify_cost.py \
      --models "$cfg:w4a16" --skip-costs --e2e-model "$cfg:w4a16" --e2e-batches "${E2E_BATCHES:-1,8,32,128}" \
      --e2e-corruptions 0,0.3,0.6,1.0 --profile-host "${PROFILE_HOST:-8,0.3}" --commit "${RUN_COMMIT:-unknown}" --out "$OUT/e2e" 2>&1 \
      | grep -v -i warn | tee "$OUT/e2e.log"
    ;;
  vl)
    timeout 240 python3 benchmarks/spec_decode/bench_verify_cost.py --models x --skip-costs \
      --vl-model config:benchmarks/configs/qwen2.5-vl-3b.json --e2e-corruptions 0,0.3,1.0 \
      --commit "${RUN_COMMIT:-unknown}" --out "$OUT/vl" 2>&1 | grep -v -i warn | tee "$OUT/vl.log"
    ;;
  draft)
    timeout 300 python3 benchmarks/spec_decode/bench_verify_cost.py --models "$cfg:w4a16" \
      --skip-costs --draft-models config:benchmarks/configs/qwen2.5-0.5b.json \
      config:benchmarks/configs/qwen2.5-0.5b.json:w4a16 --e2e-batches 1,4 \
      --commit "${RUN_COMMIT:-unknown}" --out "$OUT/draft" 2>&1 | grep -v -i warn \
      | tee "$OUT/draft.log"
    ;;
  esac
done
