#!/usr/bin/env bash
# GPU kernel tests, a launch-config sweep and the benchmarks in one call; prints a table.
# Usage (repository root): bash bench/run_gpu.sh [OUT_DIR]
set -u -o pipefail
out=${1:-${OUT:-/tmp/attn-bench}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BENCH_TUNED="$out/tuned.json" BENCH_RESULTS="$out/results.jsonl"
rm -f "$BENCH_RESULTS"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

echo "== GPU kernel tests"
timeout "${TEST_TIMEOUT:-150}" python -m pytest tests/kernels -q -m cuda -x --durations=5 2>&1 \
    | tee "$out/tests.log" | tail -25

echo "== launch-config sweep"
timeout "${TUNE_TIMEOUT:-200}" python bench/tune.py "$BENCH_TUNED" 2>&1 | tee "$out/tune.log" \
    | grep -E "BEST|device|failed|took|Error"

echo "== benchmarks"
timeout "${BENCH_TIMEOUT:-100}" python -m pytest bench/bench_kernels.py -q \
    --benchmark-columns=median,rounds 2>&1 | tee "$out/bench.log" | tail -20
python bench/report.py "$BENCH_RESULTS" | tee "$out/table.txt"
