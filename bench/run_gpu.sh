#!/usr/bin/env bash
# GPU tests, the layout suite on CUDA and the benchmarks in one call; prints a table last.
# Usage (repository root): bash bench/run_gpu.sh [OUT_DIR]
#   STAGES   which stages to run (default "tests check bench eagle"); also "sanitize" (compute-sanitizer
#            memcheck and initcheck over the GPU tests of the kernels and the backends' graph path:
#            SANITIZE_TESTS, SANITIZE_K), "soak" (10,000 runner replays vs eager, SOAK_REPLAYS), "tune" (the launch-config sweep, ~200 s) and
#            "sweep" (issue #10: ours vs every FlashInfer configuration, bench/sweep/sweep.py; writes
#            $OUT/sweep.jsonl, $OUT/SWEEP.md, $OUT/prewarm/*.log; SWEEP_ARGS e.g. "--quick");
#            "eagle" is the EAGLE vs plain decode tokens/s table (bench/bench_eagle.py, ~5 min);
#            "fi" is issue #8, in three parts that also run alone (each fits a 10-minute call):
#            "fitests" the FlashInfer family's GPU tests, "ficheck" `check` on flashinfer, flashinfer_mla,
#            trtllm_mla and hybrid (FI_CASES / FI_SUITE_CASES cases, FI_BACKENDS), "fibench"
#            bench/bench_flashinfer_backends.py and its table; "tp" (two GPUs): tests/runtime/test_tp.py and
#            bench/bench_tp.py at TP 1 and 2 (TP_MODELS, default large-gqa,bench-gqa; TP_TIMEOUT)
#   SWEEP_COMMIT the commit the sweep names (where the copied tree has no current git metadata)
#   TEST_PATHS   the test paths of the "tests" stage (default: tests)
#   TEST_ARGS    more pytest arguments (after "-n JOBS --dist load", which it gets where pytest-xdist imports;
#                split on spaces: TEST_K="not soak" for a -k expression of several words)
#   CHECK_JOBS   `check --jobs` of the check stages, and the xdist workers (default: the cores but two);
#                CHECK_BACKENDS the check stage's backends (default: triton triton_mla torch_native);
#                CHECK_TIMEOUT a backend's check (default 250 s: triton_mla took 157-164 s at 14 jobs, fresh H200)
#   BENCH_FILES  the benchmark files of the "bench" stage (default: kernels, replay, runtime)
#   FlashInfer is measured beside our kernels when `import flashinfer` works (carry .whl).
set -u -o pipefail
out=${1:-${OUT:-/tmp/attn-bench}}
mkdir -p "$out"
# An editable install gives the import names of kernels/ and runtime/ (attn_backends_kernels,
# attn_backends_runtime) and the entry points (the runner suite of `check`); where pip cannot
# install offline, links in a folder on the path give the import names and a dist-info the entry points.
links=$(mktemp -d)
python -m pip install -q --no-deps --no-build-isolation -e . >"$links/pip.log" 2>&1
if ! (cd /tmp && python -c "import attn_backends_kernels, attn_backends_runtime") 2>/dev/null; then
  echo "editable install unusable (see below); import names from links, entry points from a dist-info"; tail -3 "$links/pip.log"
  ln -s "$PWD/kernels" "$links/attn_backends_kernels"
  ln -s "$PWD/runtime" "$links/attn_backends_runtime"
  # and a dist-info beside them declares pyproject's entry points (the runner suite of `check`)
  python - "$links" <<'PY'
import pathlib, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
d = pathlib.Path(sys.argv[1]) / f"attn_backends-{p['version']}.dist-info"
d.mkdir()
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
(d / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
    for group, eps in p["entry-points"].items()))
PY
fi
export PYTHONPATH="$PWD:$links${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export BENCH_TUNED="$out/tuned.json" BENCH_RESULTS="$out/results.jsonl" BENCH_EAGLE_RESULTS="$out/eagle.jsonl"
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
stages=" ${STAGES:-tests check bench eagle} "
status=0
rm -f "$BENCH_RESULTS" "$BENCH_EAGLE_RESULTS"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: not importable"

# Worker processes for the tests (pytest-xdist, where it imports: carry its wheel, it is not on the
# lent machines) and for `check --jobs`: the cores but two. Each test goes to the next free worker
# (--dist load): by file, the MLA kernel tests held one worker for most of a 10-minute call.
jobs=${CHECK_JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
if [[ $stages == *" tests "* ]]; then
  echo "== GPU tests (every test marked cuda)"
  xdist=$(python -c "import xdist" 2>/dev/null && echo "-n $jobs --dist load")
  timeout "${TEST_TIMEOUT:-480}" python -m pytest ${TEST_PATHS:-tests} -q -m cuda --maxfail=25 -p no:cacheprovider $xdist ${TEST_ARGS:-} ${TEST_K:+-k "$TEST_K"} 2>&1 \
      | tee "$out/tests.log" | tail -15 || status=1
fi
if [[ $stages == *" check "* ]]; then
  echo "== attn-backends check on cuda"
  for b in ${CHECK_BACKENDS:-triton triton_mla torch_native}; do
    timeout "${CHECK_TIMEOUT:-250}" python -m attn_backends.check.cli check --backend $b --device cuda --jobs "$jobs" \
        --cases "${CHECK_CASES:-200}" --suite-cases "${CHECK_SUITE_CASES:-60}" 2>&1 | tee "$out/check_${b//[:.]/_}.log" | tail -9 || status=1
  done
fi
if [[ $stages == *" sanitize "* ]]; then
  # the GPU tests of the kernels and of the backends' graph path, a fast subset (SANITIZE_K)
  sanitize_tests=${SANITIZE_TESTS:-tests/kernels tests/backends/test_cuda_graphs.py}
  for tool in memcheck initcheck; do
    echo "== compute-sanitizer $tool ($sanitize_tests)"
    extra=$([[ $tool == memcheck ]] && echo "--leak-check no")
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool $tool $extra --error-exitcode 7 \
        python -m pytest $sanitize_tests -q -m cuda -x -p no:cacheprovider \
        -k "${SANITIZE_K:-not 32768 and not real_sizes}" 2>&1 \
        | tee "$out/sanitize_$tool.log" | tail -6 || status=1
    grep -E "ERROR SUMMARY" "$out/sanitize_$tool.log" | tail -1
  done
fi
if [[ $stages == *" soak "* ]]; then
  echo "== soak: 10,000 replays over every bucket and mode of the runners, bitwise vs eager"
  timeout "${SOAK_TIMEOUT:-300}" python -m attn_backends_runtime.testing.soak --replays "${SOAK_REPLAYS:-10000}" \
      --device cuda 2>&1 | tee "$out/soak.log" | tail -12 || status=1
fi
if [[ $stages == *" tune "* ]]; then
  echo "== launch-config sweep"
  timeout "${TUNE_TIMEOUT:-200}" python bench/tune.py "$BENCH_TUNED" 2>&1 | tee "$out/tune.log" \
      | grep -E "BEST|device|failed|took|Error"
fi
if [[ $stages == *" sweep "* ]]; then
  echo "== sweep: ours vs FlashInfer's configurations (bench/sweep/sweep.py ${SWEEP_ARGS:-})"
  timeout "${SWEEP_TIMEOUT:-560}" python bench/sweep/sweep.py --out "$out" ${SWEEP_ARGS:-} 2>&1 \
      | tee "$out/sweep.log" | grep -vE "^(gqa|mla)" | tail -25 || status=1
  sed -n '/^## Targets/,/^## Mismatches/p' "$out/SWEEP.md" 2>/dev/null | head -60
fi
if [[ $stages == *" bench "* ]]; then
  echo "== benchmarks"
  timeout "${BENCH_TIMEOUT:-300}" python -m pytest ${BENCH_FILES:-bench/bench_kernels.py bench/bench_replay.py bench/bench_runtime.py} -q \
      -p no:cacheprovider --benchmark-columns=median,rounds 2>&1 | tee "$out/bench.log" | tail -8 || status=1
  python bench/report.py "$BENCH_RESULTS" | tee "$out/table.txt"
  python bench/bench_runtime.py "$BENCH_RESULTS" | tee "$out/runtime_table.txt"
fi
[[ $stages == *" fi "* ]] && stages="$stages fitests ficheck fibench "
if [[ $stages == *" fitests "* ]]; then
  echo "== FlashInfer family (issue #8): GPU tests"
  timeout "${FI_TEST_TIMEOUT:-540}" python -m pytest tests/backends/test_flashinfer_gpu.py tests/backends/test_flashinfer_cpu.py \
      tests/backends/test_trtllm_hybrid.py -q -p no:cacheprovider ${FI_TEST_ARGS:-} 2>&1 | tee "$out/fi_tests.log" | tail -15 \
      || status=1
fi
if [[ $stages == *" ficheck "* ]]; then
  echo "== attn-backends check on cuda (FlashInfer family)"
  for b in ${FI_BACKENDS:-flashinfer flashinfer_mla trtllm_mla hybrid}; do
    timeout "${CHECK_TIMEOUT:-300}" python -m attn_backends.check.cli check --backend $b --device cuda --jobs "$jobs" \
        --cases "${FI_CASES:-60}" --suite-cases "${FI_SUITE_CASES:-24}" 2>&1 | tee "$out/check_${b//[:.]/_}.log" | tail -12 \
        || status=1
  done
fi
if [[ $stages == *" fibench "* ]]; then
  echo "== FlashInfer backends vs raw wrappers (bench/bench_flashinfer_backends.py)"
  timeout "${FI_BENCH_TIMEOUT:-420}" python -m pytest bench/bench_flashinfer_backends.py -q -p no:cacheprovider \
      --benchmark-columns=median,rounds 2>&1 | tee "$out/fi_bench.log" | tail -4 || status=1
  python bench/bench_flashinfer_backends.py "$BENCH_RESULTS" | tee "$out/fi_table.txt"
fi
if [[ $stages == *" tp "* ]]; then   # issue #44, on a machine of two GPUs (nvidia-h200-x2)
  echo "== tensor parallel: NCCL, graphs and EAGLE at TP 2 against TP 1; tokens/s (bench/bench_tp.py)"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  timeout 200 python -m pytest -q -p no:cacheprovider -m cuda tests/runtime/test_tp.py 2>&1 | tee "$out/tp_tests.log" \
      | tail -3 || status=1
  timeout "${TP_TIMEOUT:-330}" python bench/bench_tp.py --tp 2 --device cuda --models "${TP_MODELS:-large-gqa,bench-gqa}" \
      --out "$out/tp.jsonl" 2>&1 | tee "$out/tp.log" | grep -v Warn || status=1
fi
if [[ $stages == *" eagle "* ]]; then
  echo "== EAGLE vs plain decode, tokens/s (bench/bench_eagle.py)"
  timeout "${EAGLE_TIMEOUT:-540}" python -m pytest bench/bench_eagle.py -q -p no:cacheprovider \
      --benchmark-columns=median,rounds ${EAGLE_ARGS:-} 2>&1 | tee "$out/eagle.log" | tail -4 || status=1
  python bench/bench_eagle.py "$BENCH_EAGLE_RESULTS" | tee "$out/eagle_table.txt"
fi
exit $status
