#!/usr/bin/env bash
# One device call, one or two GPUs: named steps in lanes, one lane per GPU (all on GPU 0 when
# there is one), each step under its own time limit and a global deadline, so one failing step
# never costs the others. Everything a step writes lands in $OUT/results.tar.gz (the device tool
# fetches at most 8 files); unpack it into benchmarks/results/ and read the logs.
#
#   RUN_COMMIT=<hash> OUT=out bash benchmarks/h200_lanes.sh "gpu_tests profile latency" "throughput vl"
#
# Steps (session 11): check11 gemv11 cfg11 last11 structured (the last call: host-side changes)
#   (next: serve_ab to name what still compiles mid-serving after a rotary / LM-head warm-up;
#   profile3b after any per-layer fusion; mma_sweep at M = 8 on 7B before adopting (8, 1, 4))
# Session 22 (an H100; its step s22a ran typed-in variants): PDL on the wgmma GEMMs and the
#   dequantization measured slower on 3B at 128 rows and was not merged (BENCHMARKS.md)
# Next GPU session, in this order: s21b (the TMA band on 7B o / qkv; a one-slab heuristic),
#   then s21a's tuned_small again on an H200 (--verify for session 21's table entries), ncu17
#   (why the TMA GEMM runs compute-bound M at ~80 % of cuBLAS bf16), prof18 (where a batch-64 /
#   128 decode step goes), vl18, check18, ab18.
# Steps (session 21): s21a (the TMA table's new small-layer entries; bf16 vs W4A16 through
#   `LLM`; it ran on an H100), s21b (queued). Session 20's fmlp20 / fmlp20b / fmlp20c
#   ran in session 21; the fused MLP measured slower and was deleted with them
# Steps (session 19): s19a (engine GPU tests, the TMA GEMM sweep incl. slot order, which
#   measured slower and was deleted), s19b (GPU tests after deleting session 18's batch-1
#   prologues and L2 weight prefetch, with their steps pro17, pf18 and pf18b; the tuned TMA
#   table vs the heuristic per layer), s19c (bf16 vs W4A16 through `LLM`, 3B and 7B)
# Steps (session 18): check18 ab18 vl18 prof18 (the decode attention prefetches its first KV
#   blocks into the L2), then session 17's
# Steps (session 17): pro17b (the decode attention's split-KV factor, 3B bf16 vs W4A16), tma17
#   (the TMA GEMM's one-round-trip split finish), ncu17 (Nsight Compute on the TMA GEMM; ncu
#   reads counters on Firecracker machines only)
# Steps (session 16): tma16 tma16b tma16c tma16d tma16e
# Steps (session 15): tma15 tma15b e2e15 chk15
# Steps (session 14): mwg14 mwg14b e2e14
# Steps (session 13): mwg13 (its kernel deleted) e2e13 gpu13
# Steps (session 12): mwg12 mwg12b e2e12 e2e12s
# Steps (session 10): serve_ab structured check10
# Steps (session 9): mistral_gpu shutdown_gpu gpu9 generic_tests tc_sweep no_triton_vl bw edge startup7b generic_e2e structured
# Steps (session 8): e2e7b gpu8 offload kernel_table two_engines
# Steps: gpu_tests gpu_tests_core profile profile_w4a16 latency latency_ab gemm lora serve
#        serve_offline64 throughput throughput_async vl quant7b compare3b compare7b
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
R=/tmp/res
mkdir -p "$OUT" "$R"
START=$(date +%s)
DEADLINE=${DEADLINE:-560} # seconds after START by which every step must have ended
CFG3=benchmarks/configs/qwen2.5-3b.json
CFG7=benchmarks/configs/qwen2.5-7b.json

left() { echo $((DEADLINE - ($(date +%s) - START))); }

# run NAME LIMIT CMD...: under min(LIMIT, time left), output to $R/NAME.log
run() {
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  ((l < limit)) && limit=$l
  if ((limit < 20)); then
    echo "[$name] skipped: no time left" | tee -a "$R/summary.txt"
    return
  fi
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$R/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc in $(($(date +%s) - t0)) s (limit $limit)" | tee -a "$R/summary.txt"
}

step_gpu_tests() {
  run gpu_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests -rfE
}
step_profile() {
  run profile 150 python3 benchmarks/profile_decode.py "config:$CFG7" --out "$R/profile"
}
step_profile_w4a16() {
  run profile_w4a16 150 python3 benchmarks/profile_decode.py "config:$CFG7:w4a16" --out "$R/profile_w4a16"
}
# session 4: the new decode kernels' GPU tests (dense GEMV, GEMV bias + PDL chain, fused decode
# attention, W4A16 dequant + cuBLAS, quantized lm_head) and engine-vs-transformers greedy checks
step_new_kernels() {
  run new_kernels 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_triton_gemv.py tests/kernels/test_wna16_gemv_bias_pdl.py \
    tests/kernels/test_fused_decode_attention.py tests/kernels/test_triton_w4a16.py \
    tests/quant/test_lm_head.py tests/entrypoints/test_gpu_engine.py tests/kernels/test_fused_ops.py
}
step_dense_gemv() {
  run dense_gemv 120 python3 benchmarks/bench_dense_gemv.py --out "$R/dense_gemv_h200.json"
}
# one batch-1 latency run (with MBU) of SPEC, env overrides after the spec:
#   latrun NAME SPEC [VAR=VALUE ...]  ->  $R/lat_NAME.json, $R/ab_NAME.log
latrun() {
  local name=$1 spec=$2
  shift 2
  run "ab_$name" 90 env "$@" python3 -m pagoda.cli bench latency "$spec" \
    --dtype bfloat16 --prompt-len 512 --output-len 256 --iters 3 --baseline none \
    --out "$R/lat_$name.json"
}
# batch-1 decode A/B in one run: every new piece on (the default), then each one off
step_latency() {
  run latency 170 python3 -m pagoda.cli bench latency "config:$CFG7" \
    --dtype bfloat16 --prompt-len 512 --output-len 256 --iters 3 \
    --out "$R/latency_qwen2.5-7b_h200.json" ${LATENCY_ARGS:-}
}
step_gpu_tests_core() {
  run gpu_tests_core 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/entrypoints/test_gpu_engine.py tests/kernels/test_triton_w4a16.py \
    tests/kernels/test_triton_lora.py tests/lora tests/models/test_qwen2_5_vl.py
}
# batch-1 decode, async scheduling (the default) vs in-order, same script run
step_latency_ab() {
  step_latency
  run latency_sync 120 python3 -m pagoda.cli bench latency "config:$CFG7" \
    --dtype bfloat16 --prompt-len 512 --output-len 256 --iters 3 --baseline none \
    --no-async-scheduling --out "$R/latency_qwen2.5-7b_h200_sync.json"
}
# issue 4: batch-1 decode of Qwen2.5-7B W4A16 vs bf16 in the same run (GEMV and tinygemm);
# only a failed W4A16 run with the default GEMV switches the compare steps to tinygemm
# W4A16 kernel GPU tests, verbose (names of failures)
step_w4a16_tests() {
  run w4a16_tests 150 python3 -m pytest -v -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_triton_w4a16.py
}
step_lora_kernels() {
  run lora_kernels 90 python3 benchmarks/lora/bench_lora_kernels.py --out "$R/lora_kernels_h200.json"
}
step_lora_fused() {
  PAGODA_LORA_FUSED=1 run lora_fused 120 python3 benchmarks/lora/bench_lora.py \
    --out "$R/lora_qwen2.5-3b_fused_h200.json"
}
step_throughput_async() {
  run throughput_async 120 python3 -m pagoda.cli bench throughput "config:$CFG3" \
    --dtype bfloat16 --gpu-memory-utilization 0.5 --baseline none \
    --out "$R/throughput_qwen2.5-3b_h200_async.json"
}
# the server's reference: offline LLM.generate on the same prompts at the same concurrency
step_serve_offline64() {
  run serve_offline64 120 python3 benchmarks/serve/offline_same_prompts.py "config:$CFG3" \
    --token-prompts --num-prompts 512 --input-len 512 --output-len 128 \
    --llm-kwargs '{"max_model_len": 4096, "gpu_memory_utilization": 0.5, "max_num_seqs": 64}' \
    --out "$R/serve_offline64_h200.json"
}
step_gemm() {
  run gemm 150 python3 benchmarks/quant/bench_w4a16_gemm.py --out "$R/w4a16_gemm_h200.json" ${GEMM_ARGS:-}
}
step_lora() {
  run lora 150 python3 benchmarks/lora/bench_lora.py --out "$R/lora_qwen2.5-3b_h200.json"
}
step_throughput() {
  run throughput 420 python3 -m pagoda.cli bench throughput "config:$CFG3" \
    --dtype bfloat16 --gpu-memory-utilization 0.5 --out "$R/throughput_qwen2.5-3b_h200.json"
}
step_vl() {
  run vl 300 python3 benchmarks/vl/bench_vl.py --iters 3 --warmup 1 --output-len 128 \
    --out "$R/vl_qwen2.5-vl-3b_h200.json"
}
step_serve() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$R/serve_install.log" 2>&1 || {
    echo "[serve] wheel install failed" | tee -a "$R/summary.txt"
    return
  }
  local port=$((8100 + ${CUDA_VISIBLE_DEVICES:-0}))
  local serve_args=(--max-model-len 4096 --gpu-memory-utilization 0.5 --max-num-seqs 256)
  PYTHONPATH=/tmp/site:$PYTHONPATH python3 -m pagoda.cli serve "config:$CFG3" \
    --port "$port" --no-access-log "${serve_args[@]}" >"$R/serve_server.log" 2>&1 &
  local pid=$!
  local ok=0
  for _ in $(seq 1 120); do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
      ok=1
      break
    fi
    sleep 1
  done
  if ((ok == 0)); then
    echo "[serve] server did not come up" | tee -a "$R/summary.txt"
    kill "$pid" 2>/dev/null
    return
  fi
  local bench=(--token-prompts --num-prompts 512 --input-len 512 --output-len 128)
  for c in 1 64; do
    local n=512
    ((c == 1)) && n=16
    PYTHONPATH=/tmp/site:$PYTHONPATH run "serve_c$c" 150 python3 -m pagoda.cli \
      bench serve --url "http://127.0.0.1:$port" --concurrency "$c" \
      --token-prompts --num-prompts "$n" --input-len 512 --output-len 128 \
      --out "$R/serve_c${c}_h200.json"
  done
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/v1/memory').read().decode())" \
    >"$R/serve_memory_after.json" 2>&1
  kill -INT "$pid"
  wait "$pid"
  # The same prompts offline at the same concurrency (64): the server's same-run reference.
  step_serve_offline64
}
step_quant7b() {
  run quant7b 560 python3 -m pagoda.cli quantize "config:$CFG7" --out /tmp/q7b \
    --dataset random --num-samples 256 --max-seq-len 2048 --group-size 128 \
    --report "$R/quantize_qwen2.5-7b_h200.json" --no-progress
}
compare() {
  local size=$1
  local name
  name="Qwen2.5-$(echo "$size" | tr a-z A-Z)"
  run "compare$size" 285 python3 -m pagoda.cli compare \
    "config:benchmarks/configs/qwen2.5-$size.json" "config:benchmarks/configs/qwen2.5-$size.json:w4a16" \
    --labels "$name bf16,$name W4A16" --dtype bfloat16 --max-model-len 4096 \
    --prompt-len 512 --output-len 256 --batch-sizes 1,8,64 --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests 256 --baseline transformers \
    --timeout 130 --out "$R/compare_qwen2.5-${size}_h200"
}
step_compare3b() { compare 3b; }
# Qwen2.5-7B bf16 vs W4A16 vs W4A16 with the lm_head quantized too, transformers as baseline
step_compare7b_lm() {
  run compare7b_lm 420 python3 -m pagoda.cli compare \
    "config:$CFG7" "config:$CFG7:w4a16" "config:$CFG7:w4a16-lm_head" \
    --labels "Qwen2.5-7B bf16,Qwen2.5-7B W4A16,Qwen2.5-7B W4A16 + lm_head" --dtype bfloat16 \
    --max-model-len 4096 --prompt-len 512 --output-len 256 --batch-sizes 1,8,64 --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests 256 --baseline transformers \
    --timeout 130 --out "$R/compare_qwen2.5-7b_h200"
}
step_final_tests() {
  run final_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_fused_decode_attention.py tests/kernels/test_triton_gemv.py \
    tests/entrypoints/test_gpu_engine.py
}
step_final_lat() {
  latrun bf16 "config:$CFG7"
  latrun w4a16 "config:$CFG7:w4a16"
}
step_confirm_a() {
  latrun bf16_final_gpu0 "config:$CFG7"
  latrun w4a16_final "config:$CFG7:w4a16"
}
step_confirm_b() {
  latrun bf16_final_gpu1 "config:$CFG7"
  latrun w4a16_lm_head_final "config:$CFG7:w4a16-lm_head"
}
# the final batch-1 figures: defaults vs PDL, dense GEMV and fused decode attention off, W4A16 with and without lm_head
step_ab7b_final() {
  latrun bf16 "config:$CFG7"
  latrun bf16_old "config:$CFG7" PAGODA_PDL=0 PAGODA_DISABLED_KERNELS=dense_gemv,fused_decode_attn
  latrun w4a16 "config:$CFG7:w4a16"
  latrun w4a16_lm_head "config:$CFG7:w4a16-lm_head"
}
step_compare7b() { compare 7b; }
# session 5: the tensor-core W4A16 GEMV (pagoda/kernels/wna16/triton_w4a16_mma.py)
batchrun() {
  local name=$1 spec=$2 b=$3
  shift 3
  run "b${b}_$name" 90 env "$@" python3 -m pagoda.cli bench latency "$spec" \
    --dtype bfloat16 --prompt-len 512 --output-len 128 --batch-size "$b" --iters 2 \
    --baseline none --out "$R/lat_b${b}_$name.json"
}

# session 8: W4A16 with zero points (AWQ) and the tensor-core GEMM, Mistral, offload
step_gpu8() {
  run gpu8 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/layers/test_wna16_kernels.py tests/quant/test_autoawq_load.py tests/models/test_models.py \
    tests/entrypoints/test_gpu_engine.py tests/kernels/test_fused_decode_attention.py \
    tests/kernels/test_triton_paged_attention.py tests/worker
}
step_e2e7b() {
  run e2e7b 240 python3 -m pagoda.cli compare \
    "config:$CFG7" "config:$CFG7:w4a16" "config:$CFG7:awq" \
    --labels "Qwen2.5-7B bf16,Qwen2.5-7B W4A16 (GPTQ sym),Qwen2.5-7B AWQ (zero points)" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,64 --iters 2 --gpu-memory-utilization 0.85 --throughput-requests 0 \
    --baseline none --timeout 100 --out "$R/compare_7b_awq"
}
step_kernel_table() {
  run kernel_table 110 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 1,0 \
    --out "$R/kernel_table"
}
step_offload() {
  run offload 120 python3 benchmarks/deploy/offload_7b.py --out "$R/offload_7b_h200.json"
}
step_two_engines() {
  run two_engines 120 python3 benchmarks/deploy/two_engines.py --out "$R/two_engines_h200.json"
}

# session 9: Mistral / shutdown / registry GPU tests, the generic dispatch forced, the tc GEMM
# pipeliner sweep, deployment runs (issue 19), bf16 copy-bandwidth fractions (issue 16, acc. 3)
step_gpu9() {
  run gpu9 230 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_sliding_window_attention.py tests/entrypoints/test_mistral_vs_hf.py \
    tests/models/test_models.py tests/kernels/test_fused_decode_attention.py \
    tests/kernels/test_triton_paged_attention.py tests/worker/test_shutdown.py \
    tests/layers/test_wna16_kernels.py tests/kernels/test_triton_w4a16_mma.py
}
# issue 17, acc. 3 on the GPU (verbose, with durations: run 1's gpu9 ran out of time in here)
step_mistral_gpu() {
  run mistral_gpu 190 python3 -m pytest -v -p no:cacheprovider -m gpu -rfE --durations=15 \
    tests/entrypoints/test_mistral_vs_hf.py tests/kernels/test_sliding_window_attention.py
}
step_shutdown_gpu() {
  run shutdown_gpu 90 python3 -m pytest -v -p no:cacheprovider -m gpu -rfE tests/worker
}
step_generic_tests() {
  PAGODA_DISABLED_KERNELS=mma_wgmma_tma,mma_wgmma,mma_gemv,mma_gemm,mma_dequant run generic_tests 120 python3 -m pytest \
    -q -p no:cacheprovider -m gpu -rfE tests/entrypoints/test_gpu_engine.py \
    tests/quant/test_autoawq_load.py tests/models/test_models.py
}
step_tc_sweep() {
  run tc_sweep 150 python3 benchmarks/quant/bench_w4a16_tc.py --sweep --models 7b,3b \
    --layers gate_up,down --ms 64,128,256 --zp 0 --out "$R/tc_sweep"
}
step_no_triton_vl() {
  run no_triton_vl 120 python3 benchmarks/deploy/no_triton_vl.py --out "$R/no_triton_vl_h200.json"
}
step_bw() {
  run lat3b_bf16 80 python3 -m pagoda.cli bench latency "config:$CFG3" \
    --dtype bfloat16 --prompt-len 512 --output-len 256 --iters 2 --baseline none \
    --out "$R/lat_3b_bf16.json"
  run lat7b_bf16 80 python3 -m pagoda.cli bench latency "config:$CFG7" \
    --dtype bfloat16 --prompt-len 512 --output-len 256 --iters 2 --baseline none \
    --out "$R/lat_7b_bf16.json"
}
step_edge() {
  run edge 300 python3 -m pagoda bench edge --memory-cap-gib 12 --emulate-capability 8.9 \
    --out "$R/edge_4070"
}
step_startup7b() {
  run startup7b 150 python3 benchmarks/deploy/startup_7b.py --checkpoint /tmp/qwen7b-ckpt \
    --out "$R/startup_7b_h200.json"
}
# the generic (non-Hopper) dispatch forced on the H200: a table row (issue 16, acc. 4)
step_generic_e2e() {
  PAGODA_DISABLED_KERNELS=mma_wgmma_tma,mma_wgmma,mma_gemv,mma_gemm,mma_dequant run generic_e2e 150 python3 -m \
    pagoda.cli compare "config:$CFG7:w4a16" --labels "Qwen2.5-7B W4A16 generic" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,64 --iters 2 --gpu-memory-utilization 0.85 --throughput-requests 0 \
    --baseline none --timeout 100 --out "$R/compare_7b_generic"
}
# session 10: issue 18 acc. 5, pagoda serve at 64 streams vs offline LLM.generate on the same
# prompts, engine core in its own process and in a thread, one run (wheels from .whl/)
whl_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$R/whl_install.log" 2>&1
}
step_serve_ab() {
  whl_install || { echo "[serve_ab] wheel install failed" | tee -a "$R/summary.txt"; return; }
  PYTHONPATH=/tmp/site:$PYTHONPATH run serve_ab 240 python3 -m pagoda bench serve \
    --launch "config:$CFG3 --load-format dummy --max-num-seqs 64 --max-model-len 1024" \
    --offline-baseline --token-prompts --num-prompts 256 --concurrency 64 --input-len 128 \
    --output-len 512 --engine-modes ${SERVE_MODES:-process,thread} --out "$R/serve_ab_h200.json"
}
step_engine_process_gpu() {
  whl_install || { echo "[engine_process_gpu] wheel install failed" | tee -a "$R/summary.txt"; return; }
  PYTHONPATH=/tmp/site:$PYTHONPATH run engine_process_gpu 90 python3 -m pytest -q \
    -p no:cacheprovider -m gpu -rfE tests/entrypoints/openai/test_engine_process.py
}
# session 10, check: serve vs offline with the per-step counts unspecialized, structured outputs
# without the async fill, 3B bf16 batch-1 latency (no regression from the unspecialized counts)
step_check10() {
  step_serve_ab
  step_structured
  run lat3b_bf16 80 python3 -m pagoda.cli bench latency "config:$CFG3" \
    --dtype bfloat16 --prompt-len 512 --output-len 256 --iters 2 --baseline none \
    --out "$R/lat_3b_bf16.json"
}
# session 11, first call: serve vs offline with the mixed-step warm-up (process engine only),
# structured outputs with padded grammar rows, the GPU tests of the kernels changed since they
# last ran on the device, and where the 3B batch-1 step goes (bf16 and W4A16, issue 16 point 5)
step_check11() {
  SERVE_MODES=process step_serve_ab
  step_structured
  run gpu_kernels11 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_triton_paged_attention.py tests/kernels/test_fused_decode_attention.py \
    tests/kernels/test_fused_ops.py tests/entrypoints/test_gpu_engine.py
  run profile3b 100 python3 benchmarks/profile_decode.py "config:$CFG3" --out "$R/profile3b"
  run profile3b_w4a16 100 python3 benchmarks/profile_decode.py "config:$CFG3:w4a16" \
    --out "$R/profile3b_w4a16"
}
# session 11, second call: the dense GEMV's weight prefetch before gdc_wait (GPU tests, the 3B
# batch-1 step; no faster, reverted), the tensor-core GEMV's configs on the Qwen2.5-3B shapes (M = 1, 8)
step_gemv11() {
  run gemv_tests 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_triton_gemv.py tests/entrypoints/test_gpu_engine.py
  run compare3b_11 200 python3 -m pagoda.cli compare \
    "config:$CFG3" "config:$CFG3:w4a16" --labels "Qwen2.5-3B bf16,Qwen2.5-3B W4A16" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,64 --iters 2 --gpu-memory-utilization 0.85 --throughput-requests 0 \
    --baseline none --timeout 100 --out "$R/compare_3b"
  run mma_sweep3b 200 python3 benchmarks/quant/bench_w4a16_mma.py --models 3b --ms 1,8 \
    --sweep-ms 1,8 --out "$R/mma_sweep3b.json"
}
# session 11, third call: the GEMV configs from gemv11's sweep (GPU tests, both models bf16 vs
# W4A16 at batch 1 / 8 / 64 in one run each), structured outputs again (a second sample)
step_cfg11() {
  run mma_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_triton_w4a16_mma.py tests/layers/test_wna16_kernels.py \
    tests/kernels/test_wna16_gemv_bias_pdl.py
  run compare3b_cfg 160 python3 -m pagoda.cli compare \
    "config:$CFG3" "config:$CFG3:w4a16" --labels "Qwen2.5-3B bf16,Qwen2.5-3B W4A16" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,64 --iters 2 --gpu-memory-utilization 0.85 --throughput-requests 0 \
    --baseline none --timeout 100 --out "$R/compare_3b"
  run compare7b_cfg 200 python3 -m pagoda.cli compare \
    "config:$CFG7" "config:$CFG7:w4a16" --labels "Qwen2.5-7B bf16,Qwen2.5-7B W4A16" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,64 --iters 2 --gpu-memory-utilization 0.85 --throughput-requests 0 \
    --baseline none --timeout 120 --out "$R/compare_7b"
  step_structured
}
# session 11, last call: the tensor-core GEMV's GPU tests that cfg11 cut off (the new configs
# among them), then the structured-output benchmark under cProfile (where a constrained step's
# host time goes)
step_last11() {
  run mma_gpu 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_triton_w4a16_mma.py -k "configs_gpu or qwen7b_gpu or quantized_layer"
  whl_install || { echo "[structured_prof] wheel install failed" | tee -a "$R/summary.txt"; return; }
  PYTHONPATH=/tmp/site:$PYTHONPATH run structured_prof 150 python3 -m cProfile \
    -o "$R/structured.prof" benchmarks/structured/bench_structured.py --out "$R/structured_prof"
  python3 -c "import pstats; pstats.Stats('$R/structured.prof').sort_stats('tottime').print_stats(40)" \
    >"$R/structured_prof.txt" 2>&1
}
# session 12, first call: the wgmma GEMM on the MMA layout (GPU tests; per-layer table and its
# config sweep against bf16 and the tl.dot GEMM; 3B end to end)
step_mwg12() {
  run mwg_tests 130 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_mma_wgmma.py
  run mwg_table 250 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 1,8,16,24,32,48,64,96,128,192,256 --sweep mwg --out "$R/mwg_table"
  run compare3b_12 160 python3 -m pagoda.cli compare \
    "config:$CFG3" "config:$CFG3:w4a16" --labels "Qwen2.5-3B bf16,Qwen2.5-3B W4A16" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,64 --iters 2 --gpu-memory-utilization 0.85 --throughput-requests 0 \
    --baseline none --timeout 100 --out "$R/compare_3b"
}
# session 12, second call: the wgmma GEMM's configs (slot vs natural K order, ring depth 4 / 8,
# split-K, BLOCK_M) on both models' shapes, its GPU tests (split-K graph test within rounding)
step_mwg12b() {
  run mwg_tests 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_mma_wgmma.py tests/layers/test_wna16_kernels.py
  run mwg_sweep 455 python3 benchmarks/quant/bench_w4a16_tc.py --models 3b,7b --zp 0 \
    --ms 1,8,16,24,32,48,64,96,128,256 --sweep mwg --sweep-ms 16,32,64,128 \
    --out "$R/mwg_sweep"
}
# session 12, last call: end to end with the wgmma GEMM in the registry, bf16 vs W4A16 (GPTQ
# symmetric) vs AWQ (zero points), decode at batch 1-64 and the nano-vllm throughput protocol
step_e2e12() {
  run compare3b_e2e 200 python3 -m pagoda.cli compare \
    "config:$CFG3" "config:$CFG3:w4a16" "config:$CFG3:awq" \
    --labels "Qwen2.5-3B bf16,Qwen2.5-3B W4A16,Qwen2.5-3B AWQ" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,16,32,64 --iters 2 --gpu-memory-utilization 0.85 \
    --throughput-requests 256 --baseline none --timeout 120 --out "$R/compare_3b"
  run compare7b_e2e 160 python3 -m pagoda.cli compare \
    "config:$CFG7" "config:$CFG7:w4a16" --labels "Qwen2.5-7B bf16,Qwen2.5-7B W4A16" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,32,64 --iters 2 --gpu-memory-utilization 0.85 \
    --throughput-requests 256 --baseline none --timeout 120 --out "$R/compare_7b"
  run w4a16_table 100 python3 benchmarks/quant/bench_w4a16_tc.py --models 3b,7b --zp 0 \
    --ms 1,8,16,24,32,48,64,96,128,256 --sweep none --out "$R/w4a16_table"
  local NCU
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] && run ncu_mwg 80 "$NCU" --clock-control none --launch-skip 3 --launch-count 1 \
    -k regex:kernel --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/quant/profile_mwg.py --m 64
}
# session 15, first call: the TMA-fed warp-specialized wgmma GEMM (`gluon_wgmma_tma`): its GPU
# tests, then its config sweep per layer at M = 16-256 against the session-14 wgmma GEMM, the
# GEMV, dequant + cuBLAS and bf16 in the same run (7B and 3B shapes, symmetric), and the
# defaults with zero points
step_tma15() {
  run tma_tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_wgmma_tma.py
  run tma_sweep 300 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 16,32,64,96,128,192,256,512 --sweep tma --sweep-ms 16,32,64,128,256 --out "$R/tma_sweep"
  run tma_zp 80 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 1 \
    --ms 16,64,128,256 --sweep none --out "$R/tma_zp"
}
# session 15, second call (run 1 found every wgmma of the TMA kernel serialized by ptxas,
# C7515: the loop's zero-trip path re-defined the accumulators; fixed): the sweep again, without
# the tl.dot GEMM and the GEMV, then the defaults with zero points
step_tma15b() {
  run tma_sweep 300 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 16,32,48,64,96,128,192,256,512 --sweep tma --sweep-ms 16,32,64,128,256 --skip tc,gemv \
    --out "$R/tma_sweep"
  run tma_zp 80 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 1 \
    --ms 16,64,128,256 --sweep none --skip tc,gemv --out "$R/tma_zp"
  run tma_tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_wgmma_tma.py -k "qwen"
}
# session 15, last call (the TMA GEMM in the registry for 65-512 / 65-256 rows on the MLP
# layers): end to end bf16 / W4A16 / AWQ on 3B and 7B at batch 1-128 and the nano-vllm
# protocol, the GPU equality tests (an AWQ checkpoint through the engine against transformers,
# every band of the registry's tables), then the sm_80-89 dispatch (capability 8.9 emulated)
step_e2e15() {
  compare15 compare3b_e2e 215 "$CFG3" Qwen2.5-3B 120 compare_3b
  compare15 compare7b_e2e 215 "$CFG7" Qwen2.5-7B 120 compare_7b
  run gpu15 130 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/entrypoints/test_gpu_engine_w4a16.py tests/layers/test_wna16_kernels.py \
    tests/kernels/test_gluon_wgmma_tma.py -k "qwen or engine or cuda_path"
  sm89_3b sm89_e2e 70
}
# sm89_3b NAME LIMIT: 3B W4A16 at batch 1 / 8 / 64 with the sm_80-89 table (capability 8.9)
sm89_3b() {
  PAGODA_EMULATE_CAPABILITY=8.9 run "$1" "$2" python3 -m pagoda.cli compare \
    "config:$CFG3:w4a16" --labels "Qwen2.5-3B W4A16 sm_89 dispatch" --dtype bfloat16 \
    --max-model-len 4096 --prompt-len 512 --output-len 256 --batch-sizes 1,8,64 --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests 0 --baseline none --timeout 60 \
    --out "$R/compare_3b_sm89"
}
# session 15, check: 3B W4A16 ran 0.68x bf16 at batch 128 in e2e15, where the per-layer table
# says ~0.8x; the one default config the sweep never timed there was 3B down's split-K 16 on
# 128-row tiles (now capped by the partials' bytes) — and run 2 had timed 3B gate_up's split 2
# (the rule's pick at 65-128 rows): 53 against 30 us. Its layers' configs at 96-256 rows, then
# 3B bf16 vs W4A16 at batch 64 / 128 and the nano-vllm protocol with the new rule
step_chk15() {
  run chk_layers 60 python3 benchmarks/quant/bench_w4a16_tc.py --models 3b --zp 0 \
    --ms 96,128,192,256 --sweep tma --sweep-ms 128,256 --skip tc,gemv --out "$R/chk_layers"
  run chk_e2e 200 python3 -m pagoda.cli compare "config:$CFG3" "config:$CFG3:w4a16" \
    --labels "Qwen2.5-3B bf16,Qwen2.5-3B W4A16" --dtype bfloat16 --max-model-len 4096 \
    --prompt-len 512 --output-len 256 --batch-sizes 64,128 --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests 256 --baseline none --timeout 90 \
    --out "$R/chk_e2e"
}
# compare15 NAME LIMIT CONFIG LABEL TIMEOUT OUTDIR: compare3 at batch 1-128
compare15() {
  run "$1" "$2" python3 -m pagoda.cli compare "config:$3" "config:$3:w4a16" \
    "config:$3:awq" --labels "$4 bf16,$4 W4A16,$4 AWQ" --dtype bfloat16 --max-model-len 4096 \
    --prompt-len 512 --output-len 256 --batch-sizes 1,8,64,128 --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests 256 --baseline none --timeout "$5" \
    --out "$R/$6"
}
# session 14, first call: the wgmma GEMM's scale-ahead and staged-epilogue variants and a
# split-K sweep (the tail wave; split-K at 64+ rows lost occupancy to its epilogue's registers),
# then Nsight Compute on the 7B gate_up / down kernels at M = 64 (stall reasons, occupancy)
ncu_mwg() {  # NAME ARGS...: one profiled launch of profile_mwg.py
  local NCU name=$1
  shift
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] && run "$name" 70 "$NCU" --clock-control none --launch-skip 3 --launch-count 1 \
    -k 'regex:^kernel$' --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    python3 benchmarks/quant/profile_mwg.py "$@"
}
step_mwg14() {
  run mwg_x 330 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 16,32,48,64,96,128 --sweep mwgx --sweep-ms 16,32,48,64,96,128 --out "$R/mwg_x"
  ncu_mwg ncu_gate_up64 --m 64
  ncu_mwg ncu_gate_up64_staged --m 64 --config 64,2,1,4,1,0,1
  ncu_mwg ncu_down64_staged --n 3584 --k 18944 --m 64 --config 64,2,9,4,1,0,1
}
# session 14, second call (scales ahead in slot order and the staged epilogue from 64 rows are
# the defaults now): one warpgroup a program and deeper rings, the per-layer table with zero
# points, Nsight Compute on the right kernel this time (run 1's filter matched torch's own
# "...kernel" launches), the wgmma GPU tests
step_mwg14b() {
  run mwg_w 200 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0,1 \
    --ms 1,8,16,32,48,64,96,128,256 --sweep mwgw --sweep-ms 16,32,48,64,128 --out "$R/mwg_w"
  ncu_mwg ncu_gate_up64 --m 64
  ncu_mwg ncu_down64 --n 3584 --k 18944 --m 64
  ncu_mwg ncu_gate_up16 --m 16
  run mwg_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_gluon_mma_wgmma.py -rfE
}
# session 14, third call (one warpgroup a program on gate_up and 3B qkv / o, the split cap,
# the wgmma GEMM to 128 rows on down projections): end to end bf16 / W4A16 / AWQ on 3B and 7B
# with the nano-vllm protocol, the per-layer table with zero points, and the generic
# (non-Hopper) dispatch forced on the H200, timed (3B W4A16, batch 1 / 8 / 64)
step_e2e14() {
  compare3 compare3b_e2e 185 "$CFG3" Qwen2.5-3B 110 compare_3b
  compare3 compare7b_e2e 185 "$CFG7" Qwen2.5-7B 100 compare_7b
  run w4a16_table 100 python3 benchmarks/quant/bench_w4a16_tc.py --models 3b,7b --zp 0,1 \
    --ms 1,8,16,32,48,64,96,128,256 --sweep none --out "$R/w4a16_table"
  PAGODA_DISABLED_KERNELS=mma_wgmma_tma,mma_wgmma,mma_gemv,mma_gemm,mma_dequant run generic_e2e 100 python3 -m \
    pagoda.cli compare "config:$CFG3:w4a16" --labels "Qwen2.5-3B W4A16 generic" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,64 --iters 2 --gpu-memory-utilization 0.85 --throughput-requests 0 \
    --baseline none --timeout 90 --out "$R/compare_3b_generic"
}
# session 13, second call (the kernel of session 12 again: the first call's variant measured
# slower): end to end bf16 / W4A16 / AWQ on 3B and 7B, the nano-vllm protocol, the per-layer
# table with zero points, then the GPU tests of the engine against transformers
# compare3 NAME LIMIT CONFIG LABEL TIMEOUT OUTDIR: bf16 vs W4A16 (GPTQ sym) vs AWQ (zero points)
compare3() {
  run "$1" "$2" python3 -m pagoda.cli compare "config:$3" "config:$3:w4a16" \
    "config:$3:awq" --labels "$4 bf16,$4 W4A16,$4 AWQ" --dtype bfloat16 --max-model-len 4096 \
    --prompt-len 512 --output-len 256 --batch-sizes 1,8,64 --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests 256 --baseline none --timeout "$5" \
    --out "$R/$6"
}
step_e2e13() {
  compare3 compare3b_e2e 190 "$CFG3" Qwen2.5-3B 110 compare_3b
  compare3 compare7b_e2e 170 "$CFG7" Qwen2.5-7B 100 compare_7b
  run w4a16_table 150 python3 benchmarks/quant/bench_w4a16_tc.py --models 3b,7b --zp 0,1 \
    --ms 1,8,16,32,48,64,96,128,256 --sweep none --out "$R/w4a16_table"
}
# session 13, last call: the GPU equality tests with the registry's Hopper dispatch (wgmma GEMM
# included), then the same engine tests with the generic dispatch forced
step_gpu13() {
  run gpu13 220 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/entrypoints/test_gpu_engine.py tests/quant/test_autoawq_load.py \
    tests/layers/test_wna16_kernels.py tests/kernels/test_gluon_mma_wgmma.py \
    tests/kernels/test_triton_w4a16_mma.py
  PAGODA_DISABLED_KERNELS=mma_wgmma_tma,mma_wgmma,mma_gemv,mma_gemm,mma_dequant run generic13 150 \
    python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/entrypoints/test_gpu_engine.py \
    tests/quant/test_autoawq_load.py tests/layers/test_wna16_kernels.py
}
# the same, shortest: Qwen2.5-3B bf16 vs W4A16 only (little device time left)
step_e2e12s() {
  run compare3b_e2e 190 python3 -m pagoda.cli compare \
    "config:$CFG3" "config:$CFG3:w4a16" --labels "Qwen2.5-3B bf16,Qwen2.5-3B W4A16" \
    --dtype bfloat16 --max-model-len 4096 --prompt-len 512 --output-len 256 \
    --batch-sizes 1,8,16,32,64 --iters 2 --gpu-memory-utilization 0.85 \
    --throughput-requests 0 --baseline none --timeout 90 --out "$R/compare_3b"
}
step_structured() {
  OUT=$R/structured run structured 150 bash benchmarks/structured/run_h200.sh
}

# session 16, first call: the TMA GEMM schedules whole waves of tiles, then splits the last
# wave's tiles over K (a wave model picks the split), M-tiles of a column tile adjacent: its GPU
# tests (7B gate_up added: whole and split tiles in one launch), the per-layer sweep of the
# split (bf16, the wgmma GEMM and dequant + cuBLAS timed beside it), zero points
step_tma16() {
  run tma_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_wgmma_tma.py
  run tma_sweep 300 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 16,32,48,64,96,128,192,256,512 --sweep tma --sweep-ms 64,128,256 --skip tc,gemv \
    --out "$R/tma_sweep"
  run tma_zp 70 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 1 \
    --ms 16,64,128,256 --sweep none --skip tc,gemv --out "$R/tma_zp"
}

# session 16, second call (run 1: co-resident CTAs add little, so the schedule counts waves of
# one CTA an SM; the registry bands from run 1's sweep): the TMA GEMM's GPU tests, the
# per-layer table with the new defaults (split swept at 64 / 128 rows), then bf16 vs W4A16 end
# to end on 3B and 7B at batch 1-128 and the nano-vllm protocol
step_tma16b() {
  run tma_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_wgmma_tma.py
  run tma_sweep 110 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 16,32,48,64,96,128,192,256,512 --sweep tma --sweep-ms 64,128 --skip tc,gemv \
    --out "$R/tma_sweep"
  compare16 compare3b_e2e 150 "$CFG3" Qwen2.5-3B 100 compare_3b
  compare16 compare7b_e2e 150 "$CFG7" Qwen2.5-7B 100 compare_7b
}
# session 16, third call: run 2's TMA tests hit their limit in the Qwen-shape tests (34 of 36
# passed; run 1 likewise): each one verbose with a stack dump past 25 s; the GPU tests of the
# engine against transformers and of every CUDA path of a layer; 7B gate_up at 128 / 256 rows
# again (split 1 measured 79.9 us in session 15, 96 in runs 1-2)
step_tma16c() {
  run qwen_tests 110 python3 -m pytest -v -p no:cacheprovider -m gpu -rfE -x \
    -o faulthandler_timeout=25 --durations=0 tests/kernels/test_gluon_wgmma_tma.py -k qwen
  run gpu16 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/entrypoints/test_gpu_engine_w4a16.py tests/layers/test_wna16_kernels.py
  run gate_up 60 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b --layers gate_up \
    --zp 0 --ms 128,256 --sweep tma --sweep-ms 128,256 --skip tc,gemv --out "$R/gate_up"
}
# session 16, fourth call (run 4, typed as one command; these are its steps): AWQ (zero
# points) against symmetric W4A16 on 3B at batch 1 / 8 / 64, and the sm_80-89 dispatch
step_tma16d() {
  run awq 150 python3 -m pagoda.cli compare "config:$CFG3:w4a16" "config:$CFG3:awq" \
    --labels "Qwen2.5-3B W4A16,Qwen2.5-3B AWQ" --dtype bfloat16 --max-model-len 4096 \
    --prompt-len 512 --output-len 256 --batch-sizes 1,8,64 --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests 0 --baseline none --timeout 60 \
    --out "$R/compare_3b_awq"
  sm89_3b sm89 80
}
# session 16, fifth call (run 5, typed as one command): 3B bf16 vs W4A16 at batch 32 / 64 after
# the TMA GEMM's gate_up band moved to 17 rows on 3B
step_tma16e() {
  compare16 band 170 "$CFG3" Qwen2.5-3B 60 compare_3b_band 32,64 0
}
# session 17, second call (its prologue A/B went with the prologues): the batch-1 decode
# attention against its split-KV factor (the graph takes the pick for max_model_len at every
# context), then 3B bf16 vs W4A16 at batch 1 / 8 through `LLM` (each in its own process)
step_pro17b() {
  run decode_splits 100 python3 benchmarks/kernels/bench_decode_splits.py \
    --out "$R/decode_splits.json"
  compare16 compare3b 120 "$CFG3" Qwen2.5-3B 60 compare_3b 1,8 0
}
# (session 18: the sweep also times, past 128 rows, 256-row tiles of one slab a warpgroup: 241
# SASS instructions for two K steps of four m64n256k16 each, half the dequantization per MMA of
# the 128-row tile; up to session 19 also each default with x copied into slot order first, no
# quad transpose, which session 19 measured slower: deleted)
# session 17: the last split of a tile reads its sums back in one round trip a slab in the TMA
# GEMM (it took 8 on 128-row tiles, one per 16-row chunk, each waiting for the last), in one a
# tile in the cp.async wgmma GEMM (4 on 64-row tiles) and in the shared-dequantization GEMV
# (one per block of 8 rows): their GPU tests, then the per-layer sweep of the split (the wave
# model's `per + 5` for a split CTA was fitted with the old finish)
step_tma17() {
  run tma_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_wgmma_tma.py tests/kernels/test_gluon_mma_wgmma.py \
    tests/kernels/test_triton_w4a16_mma.py -k "not qwen7b"  # (incl. the one-slab configs)
  run tma_sweep 300 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 16,32,48,64,96,128,192,256,512 --sweep tma --sweep-ms 64,128,256 --skip tc,gemv \
    --out "$R/tma_sweep"
}
# session 17: why the TMA GEMM runs 7B gate_up at M = 128 at ~57 % of the bf16 tensor rate:
# Nsight Compute on it and on cuBLAS bf16 of the same shape (speed of light, warp stalls,
# compute and memory workloads), then the same at M = 64 where it beats bf16
step_ncu17() {
  run ncu_check 30 ncu --version
  for m in 128 64; do
    run "ncu_gate_up_$m" 150 ncu --clock-control none \
      --kernel-name regex:'^kernel$|nvjet|xmma|cutlass' --launch-count 6 \
      --section SpeedOfLight --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats python3 benchmarks/quant/ncu_layer.py --model 7b --layer gate_up \
      --m "$m" --kernel tma
  done
}
# session 18: Qwen2.5-VL-3B's decode steps take the fused decode attention (M-RoPE with [T]
# positions is plain RoPE) and with it the KV prefetch: bf16 / W4A16 with one image, against
# `fused_decode_attn` disabled (the separate kernels, no prefetch)
step_vl18() {
  run vl_fused 200 python3 benchmarks/vl/bench_vl.py --iters 3 --warmup 1 --output-len 128 \
    --skip-transformers --out "$R/vl_fused.json"
  run vl_unfused 200 env PAGODA_DISABLED_KERNELS=fused_decode_attn python3 \
    benchmarks/vl/bench_vl.py --iters 3 --warmup 1 --output-len 128 --skip-transformers \
    --out "$R/vl_unfused.json"
}
# session 19, first call: the engine GPU tests with the session-18 defaults (prologues and L2
# weight prefetch off, since deleted; session 18's run cut off after one unnamed failure here),
# then the TMA GEMM sweep of sessions 17-18 (one-slab 256-row tiles; slot-order x, deleted
# after this run) per layer at M = 16-512
step_s19a() {
  run engine_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/entrypoints/test_gpu_engine_w4a16.py tests/entrypoints/test_gpu_engine.py
  run tma_sweep 330 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0 \
    --ms 16,32,48,64,96,128,192,256,512 --sweep tma --sweep-ms 64,128,256 --skip tc,gemv \
    --out "$R/tma_sweep"
}
# session 19, second call: the GPU tests after deleting the prologues and the L2 weight
# prefetch (engine greedy vs transformers, the GEMVs, the decode attention) and of the tuned
# TMA table's configs (Qwen shapes at 128 / 256 rows), then the per-layer W4A16 kernels with
# the table against the heuristic (`tma_heur`) at swept and in-between M, with / without zp
step_s19b() {
  run engine_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/entrypoints/test_gpu_engine_w4a16.py tests/entrypoints/test_gpu_engine.py
  run kernel_tests 170 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_fused_decode_attention.py tests/kernels/test_triton_gemv.py \
    tests/kernels/test_gluon_wgmma_tma.py tests/kernels/test_triton_w4a16_mma.py \
    -k "not qwen7b and (qwen or one_slab or decode or gemv or graph)"
  run tuned 150 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0,1 \
    --ms 64,96,128,160,192,256 --sweep none --skip tc,gemv --out "$R/tuned"
}
# session 21: the TMA table with session 21's qkv / o entries (1-warpgroup 1-slab CTAs split
# 2-8, swept by fmlp20c's tma_small): its GPU tests, the table against the heuristic at and
# between the swept M with / without zero points, then bf16 vs W4A16 through `LLM`
step_s21a() {
  run tma_tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/kernels/test_gluon_wgmma_tma.py -k "one_slab or tuned"
  run tuned_small 120 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b,3b --zp 0,1 \
    --layers qkv,o --ms 64,96,128,160,192,256 --sweep none --skip tc,gemv --out "$R/tuned_small"
  compare16 compare3b_e2e 150 "$CFG3" Qwen2.5-3B 100 compare_3b
  compare16 compare7b_e2e 150 "$CFG7" Qwen2.5-7B 100 compare_7b
}
# session 21, queued (no device time was left): whether the TMA GEMM's band should take 7B o at
# 33-64 rows and 7B qkv at 129-256 (single points of session 21 measured it 19 % / 11 % ahead of
# the registry's kernel there; BENCHMARKS.md, session 21): 7B qkv / o at the rows between, every
# TMA config swept, next to mwg and dequant + cuBLAS; `benchmarks/quant/heuristic_ab.py` pairs a
# candidate heuristic's picks with today's over the same sweep (put the candidate in place
# first). Then bf16 vs W4A16 through `LLM` at 64 / 128 rows
step_s21b() {
  run heur_sweep 200 python3 benchmarks/quant/bench_w4a16_tc.py --models 7b --zp 0 \
    --layers qkv,o --ms 33,48,64,96,128,192,256 --sweep tma --sweep-ms 33,48,64,96,128,192,256 \
    --skip tc,gemv --out "$R/heur_sweep"
  compare16 compare3b_hi 120 "$CFG3" Qwen2.5-3B 100 compare_3b_hi 64,128
  compare16 compare7b_hi 120 "$CFG7" Qwen2.5-7B 100 compare_7b_hi 64,128
}
# session 19, third call: bf16 vs W4A16 through `LLM` (batch 1 / 8 / 64 / 128, the protocol's
# 256 requests) on 3B and 7B, then 3B bf16 batch-1 latency with MBU (acceptance 3)
step_s19c() {
  compare16 compare3b_e2e 150 "$CFG3" Qwen2.5-3B 100 compare_3b
  compare16 compare7b_e2e 150 "$CFG7" Qwen2.5-7B 100 compare_7b
  latrun 3b_bf16 "config:$CFG3"
}
# session 18, first call: the GPU tests of everything on by default that no GPU has run (the
# split-K finish, the KV prefetch, M-RoPE on the fused decode attention, slot-order x in the
# TMA GEMM), then the batch-1 decode graph of 3B W4A16 with and without the KV prefetch
# (session 19: the prologues and the L2 weight prefetch, also tested and A/B'd here in session
# 18, deleted)
step_check18() {
  run check_tests 360 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/entrypoints/test_gpu_engine.py tests/entrypoints/test_gpu_engine_w4a16.py \
    tests/worker/test_kv_prefetch.py tests/kernels/test_fused_decode_attention.py \
    tests/kernels/test_triton_gemv.py tests/kernels/test_triton_w4a16_mma.py \
    tests/models/test_qwen2_5_vl.py tests/kernels/test_gluon_wgmma_tma.py \
    tests/kernels/test_gluon_mma_wgmma.py -k "engine or prefetch or graph or \
decoder_attention or gemm_matches or qwen_shapes or within_ties or shared"
  ab_ablate 3b_w4a16 "config:$CFG3:w4a16"
}
# session 18, second call: the same A/B on 3B bf16; batch-1 latency + MBU of 3B bf16 / W4A16
# with the KV prefetch on (default) and off, each in its own process
step_ab18() {
  ab_ablate 3b_bf16 "config:$CFG3"
  latrun 3b_on "config:$CFG3"
  latrun 3b_off "config:$CFG3" PAGODA_DISABLED_KERNELS=kv_prefetch
  latrun 3b_w4a16_on "config:$CFG3:w4a16"
  latrun 3b_w4a16_off "config:$CFG3:w4a16" PAGODA_DISABLED_KERNELS=kv_prefetch
}
ab_ablate() {
  run "ablate_ab_$1" 110 python3 benchmarks/ablate_decode.py "$2" \
    --ablations none,nokv,none,nokv,none,nokv --out "$R/ablate_ab_$1.json"
}
# session 18: where a batch-128 / 64 decode step goes (session 16: 7B W4A16 at batch 128 fell
# from 0.92x to 0.87x bf16 with no slower layer; the protocol's decode runs at these batches):
# the graph alone, with the LM head, the engine step, and the profiler's kernel table
step_prof18() {
  local spec
  for spec in "7b_bf16_128:$CFG7:128" "7b_w4a16_128:$CFG7:w4a16:128" \
    "3b_w4a16_64:$CFG3:w4a16:64"; do
    local tag=${spec%%:*} rest=${spec#*:}
    run "prof_$tag" 150 python3 benchmarks/profile_decode.py "config:${rest%:*}" \
      --batch "${rest##*:}" --output-len 128 --out "$R/prof_$tag"
  done
}
# compare16 NAME LIMIT CONFIG LABEL TIMEOUT OUTDIR [BATCHES] [REQUESTS]: bf16 vs W4A16 at
# batch 1-128 (or BATCHES) + the protocol's 256 requests (or REQUESTS)
compare16() {
  run "$1" "$2" python3 -m pagoda.cli compare "config:$3" "config:$3:w4a16" \
    --labels "$4 bf16,$4 W4A16" --dtype bfloat16 --max-model-len 4096 \
    --prompt-len 512 --output-len 256 --batch-sizes "${7:-1,8,64,128}" --iters 2 \
    --gpu-memory-utilization 0.85 --throughput-requests "${8:-256}" --baseline none \
    --timeout "$5" --out "$R/$6"
}

nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv >"$R/gpu.txt" 2>&1
cat "$R/gpu.txt"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
lane() {
  local gpu=$1
  shift
  for s in $1; do
    CUDA_VISIBLE_DEVICES=$gpu "step_$s"
  done
}
if ((NGPU >= 2 && $# >= 2)); then
  lane 0 "$1" &
  lane 1 "$2" &
  wait
else
  lane 0 "$*"
fi
# The device's copy of .git can be stale and `.run_commit` is git-ignored (not carried unless
# named in the call's `carry`): type the hash into the command, RUN_COMMIT=abc1234 (a
# RUN_COMMIT=$(git rev-parse HEAD) there is expanded on the device, from that stale .git).
if [ -n "${RUN_COMMIT:-}" ]; then
  echo "$RUN_COMMIT" >"$R/commit.txt"
else
  cat .run_commit >"$R/commit.txt" 2>/dev/null || git rev-parse HEAD >"$R/commit.txt" 2>/dev/null
fi
tar czf "$OUT/results.tar.gz" -C "$R" . 2>/dev/null
cat "$R/summary.txt"
for f in "$R"/*.log; do
  echo "=== $(basename "$f")"
  grep -v -i "warn" "$f" | tail -n "${TAIL:-12}"
done
