#!/usr/bin/env bash
# One device call: install the carried xgrammar wheels (.whl/, see BENCHMARKS.md), run the GPU
# structured-output test, then the overhead / compile-stall benchmark. Results land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/entrypoints/test_structured_outputs.py \
  2>&1 | tail -15 | tee "$OUT/structured_gpu_tests.log"
timeout 300 python3 benchmarks/structured/bench_structured.py --out "$OUT" \
  2>&1 | grep -v -i "warn" | tail -15 | tee "$OUT/structured.log"
