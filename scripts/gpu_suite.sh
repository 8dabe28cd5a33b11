#!/usr/bin/env bash
# The GPU suite, one call on the GPU machine: install the package, run the GPU tests, run them
# again under compute-sanitizer memcheck, run the benchmarks; a summary table comes last.
# Other parts add their GPU tests and benchmark scripts to the two lists below.
# Logs go to $OUT when set (the device tool brings that folder back), else to a temp folder.
set -uo pipefail

GPU_TESTS=(tests/backends tests/ops/test_fused.py tests/ops/test_gemv.py tests/ops/test_draw.py
           tests/model/test_sampling.py
           tests/shell/test_graphs.py tests/shell/test_extend_graphs.py
           tests/shell/test_plan_ahead.py tests/shell/test_verify_ahead.py
           tests/shell/test_spec_overflow.py tests/shell/test_prefix_cache.py tests/test_pdl.py
           tests/shell/test_walk_ahead.py)
# The original scenario (verify on a batch larger than the largest captured graph), also
# under memcheck with the caching allocator on, so that real CUDA graphs are captured.
# Planning ahead (a plan written while a captured replay runs) is checked the same way, and
# the extend graphs (prefixes, several requests, a chunk that does not sample), and the
# decode pass launched on a verify pass's walk on the device.
GRAPH_MEMCHECK_TESTS=(tests/shell/test_spec_overflow.py tests/shell/test_plan_ahead.py
    tests/shell/test_verify_ahead.py tests/shell/test_walk_ahead.py
    tests/shell/test_extend_graphs.py::test_an_extend_pass_replays_the_smallest_graph_it_fits
    tests/shell/test_extend_graphs.py::test_the_engine_replays_extend_graphs_when_asked
    tests/shell/test_extend_graphs.py::test_extend_graphs_capture_in_half_precision
    tests/shell/test_extend_graphs.py::test_extend_graphs_serve_chunks_mixed_passes_and_cached_prefixes
    tests/shell/test_graphs.py::test_a_pass_launched_at_a_commit_replays_after_the_commits_writes
    tests/shell/test_graphs.py::test_a_verify_pass_launched_ahead_replays_after_the_decode_pass_it_follows)
BENCHES=(benchmarks/bench_attention.py benchmarks/bench_extend_order.py benchmarks/bench_engine.py
         benchmarks/bench_steps.py benchmarks/bench_gemv.py benchmarks/bench_spec_host.py
         benchmarks/bench_sampling.py benchmarks/bench_prefill.py)
# GPU_BENCHES="a.py b.py" runs only those (e.g. to re-check after a change, within one call)
# (not listed: bench_extend.py, which runs one study a call, --grid or --turns; its --turns
# is PROBE_PARTS=extend of scripts/gpu_speed_probe.sh. Nor bench_gemv_sweeps.py, one sweep a
# call; its --sweep-verify is PROBE_PARTS=sweep-verify)
if [ -n "${GPU_BENCHES:-}" ]; then read -r -a BENCHES <<<"$GPU_BENCHES"; fi
# The whole suite takes longer than one device call may run (10 minutes): split it with
# GPU_PART=tests (install, tests, memcheck with CUDA graphs captured), GPU_PART=memcheck
# (install, memcheck without the caching allocator) and GPU_PART=benches (install,
# benchmarks). Unset, it runs all of them. The plain memcheck of all GPU tests no longer fits
# one call either (fourth session: ~168 of 170 tests at the 560 s limit): GPU_PART=memcheck1
# runs the kernel tests (H100: 378 in 78 s with the kernels compiled), memcheck2 to memcheck4
# the engine tests, which allocate on every step and run far slower under the sanitizer
# without the caching allocator (H100: the graph and plan-ahead tests' first 44 in 400 s, the
# PDL and prefix-cache tests' 35 in about 200 s): memcheck2 the graph and plan-ahead tests,
# memcheck3 verify ahead and spec overflow, memcheck4 prefix cache, PDL and walk ahead
# (H100, GPU_WORKERS=8: memcheck4's 45 tests in 136 s after their plain pass; 47 in 191 s).
# memcheck2 and memcheck3 do not fit a call: after memcheck2's 54 tests' plain pass (29 s),
# the sanitizer finished 24 of them in the rest of the 560 s; after memcheck3's 14 (18 s),
# the first 2 verify-ahead tests in 320 s. Give them a few tests a call with MEMCHECK_ONLY.
# On a fresh machine the GPU tests alone no longer fit 200 s either (the kernels compile at
# their first use): GPU_PART=tests1 and tests2 run their halves (kernel tests / engine tests),
# GPU_PART=graphcheck the memcheck with CUDA graphs captured, each within one call. The
# graph memcheck's 60 tests no longer fit one call either (H100: 37 of them in 420 s):
# GPU_PART=graphcheck1 (spec overflow, plan ahead: 35), graphcheck2 (verify ahead: on an
# H100 its first 4 tests took 300 s), graphcheck3 (walk ahead) and graphcheck4 (the graph
# tests). MEMCHECK_ONLY="tests/a.py tests/b.py::test_c" runs those instead in the memcheck
# parts (memcheck*, graphcheck*).
GPU_PART=${GPU_PART:-all}
part() { [ "$GPU_PART" = all ] || [ "$GPU_PART" = "$1" ]; }
MEMCHECK_TESTS=("${GPU_TESTS[@]}")
PYTEST_TESTS=("${GPU_TESTS[@]}")
case "$GPU_PART" in
    graphcheck1) GRAPH_MEMCHECK_TESTS=("${GRAPH_MEMCHECK_TESTS[@]:0:2}"); GPU_PART=graphcheck ;;
    graphcheck2) GRAPH_MEMCHECK_TESTS=("${GRAPH_MEMCHECK_TESTS[@]:2:1}"); GPU_PART=graphcheck ;;
    graphcheck3) GRAPH_MEMCHECK_TESTS=("${GRAPH_MEMCHECK_TESTS[@]:3:1}"); GPU_PART=graphcheck ;;
    graphcheck4) GRAPH_MEMCHECK_TESTS=("${GRAPH_MEMCHECK_TESTS[@]:4}"); GPU_PART=graphcheck ;;
    memcheck1) MEMCHECK_TESTS=("${GPU_TESTS[@]:0:5}"); GPU_PART=memcheck ;;
    memcheck2) MEMCHECK_TESTS=("${GPU_TESTS[@]:5:3}"); GPU_PART=memcheck ;;
    memcheck3) MEMCHECK_TESTS=("${GPU_TESTS[@]:8:2}"); GPU_PART=memcheck ;;
    memcheck4) MEMCHECK_TESTS=("${GPU_TESTS[@]:10}"); GPU_PART=memcheck ;;
    tests1) PYTEST_TESTS=("${GPU_TESTS[@]:0:5}"); GPU_PART=pytest ;;
    tests2) PYTEST_TESTS=("${GPU_TESTS[@]:5}"); GPU_PART=pytest ;;
esac
if [ -n "${MEMCHECK_ONLY:-}" ]; then
    read -r -a MEMCHECK_TESTS <<<"$MEMCHECK_ONLY"
    GRAPH_MEMCHECK_TESTS=("${MEMCHECK_TESTS[@]}")
fi
if ! part benches; then BENCHES=(); fi
TEST_TIMEOUT=${TEST_TIMEOUT:-540}            # seconds per step
SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-560}
# the graph memcheck (seventh session: 150 s no longer held it with the plan-ahead property
# drawing speculation in, at its 12 examples; it now runs SANITIZER_EXAMPLES as the other)
GRAPH_SANITIZER_TIMEOUT=${GRAPH_SANITIZER_TIMEOUT:-540}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
SANITIZER_EXAMPLES=${SANITIZER_EXAMPLES:-3}  # hypothesis examples per property under memcheck
BENCH_ARGS=${BENCH_ARGS:-}                   # e.g. --quick
# GPU_WORKERS=N runs the GPU tests in N pytest-xdist worker processes sharing the GPU: a fresh
# machine compiles every Triton kernel at its first use, and the workers spread that over the
# machine's cores (H100, 16 cores, 8 workers: all GPU tests in 48 s with the kernels compiled;
# on a fresh machine 88% of them in 150 s, against two calls of about 360 and 265 s in one
# process).
# The sanitizer gains nothing from workers (8 of them ran the graph memcheck at the pace of
# one process), but most of a memcheck part's time on a fresh machine is compiling under the
# sanitizer: with GPU_WORKERS > 1 each memcheck part first runs its tests without the
# sanitizer in the workers (a plain test run of its own, noted in the summary), so that the
# sanitizer's one process finds the kernels compiled (memcheck1 then took 78 s, against more
# than a 560 s call). 1 (the default): one process, no such pass.
GPU_WORKERS=${GPU_WORKERS:-1}
WORKER_ARGS=()
if [ "$GPU_WORKERS" -gt 1 ]; then WORKER_ARGS=(-n "$GPU_WORKERS"); fi
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-200}

cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
SUMMARY=()

note() { SUMMARY+=("| $1 | $2 | $3 s |"); }
# with GPU_WORKERS > 1, the tests $2... once without the sanitizer in the workers, so that a
# memcheck step after it finds their kernels compiled; noted as "pytest (CUDA, before $1)"
compile_first() {
    local what=$1 log="$OUT_DIR/compile_$1.log" rc start=$SECONDS
    shift
    [ "$GPU_WORKERS" -gt 1 ] || return 0
    timeout "$COMPILE_TIMEOUT" python3 -m pytest -q -p no:cacheprovider "${WORKER_ARGS[@]}" "$@" \
        >"$log" 2>&1
    rc=$?
    note "pytest (CUDA, before $what)" "rc=$rc: $(tail -n 1 "$log")" $((SECONDS - start))
}
# the sanitizer's errors in a log: its processes' ERROR SUMMARY lines added up (none: empty)
error_summary() {
    grep -o "ERROR SUMMARY: [0-9]* error" "$1" \
        | awk '{n += 1; s += $3}
               END {if (n) printf "ERROR SUMMARY: %d errors%s", s, (n > 1 ? " (" n " processes)" : "")}'
}

# 1. install (no network there: the package with --no-deps, the wheels the image lacks)
start=$SECONDS
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
note install "$gpu_env_status" $((SECONDS - start))
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    >"$OUT_DIR/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"cuda", torch.cuda.is_available())' >>"$OUT_DIR/gpu.txt" 2>&1
cat "$OUT_DIR/gpu.txt"

if part tests || part pytest; then
# 2. GPU tests
start=$SECONDS
timeout "$TEST_TIMEOUT" python3 -m pytest -q -m "not slow" -p no:cacheprovider \
    "${WORKER_ARGS[@]}" "${PYTEST_TESTS[@]}" >"$OUT_DIR/pytest.log" 2>&1
rc=$?
tail -n 25 "$OUT_DIR/pytest.log"
note "pytest (CUDA)" "rc=$rc: $(tail -n 1 "$OUT_DIR/pytest.log")" $((SECONDS - start))
fi

if part memcheck; then

# 3. the same under compute-sanitizer memcheck (no caching allocator: every block is its own)
if ! part tests && ! part pytest; then compile_first memcheck -m "not slow" "${MEMCHECK_TESTS[@]}"; fi
start=$SECONDS
ENGINE_TEST_EXAMPLES=$SANITIZER_EXAMPLES PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    timeout "$SANITIZER_TIMEOUT" compute-sanitizer --tool memcheck --print-limit 50 \
    python3 -m pytest -q -m "not slow" -p no:cacheprovider "${MEMCHECK_TESTS[@]}" \
    >"$OUT_DIR/memcheck.log" 2>&1
rc=$?
errors=$(error_summary "$OUT_DIR/memcheck.log")
tests=$(grep -E "passed|failed|error" "$OUT_DIR/memcheck.log" | grep -v "ERROR SUMMARY" | tail -n 1)
grep -m 20 -E "Invalid|out of bounds|FAILED" "$OUT_DIR/memcheck.log"
note "memcheck" "rc=$rc: ${errors:-no summary (timeout?)}; ${tests}" $((SECONDS - start))
fi

if part tests || part graphcheck; then

# 3b. memcheck with the caching allocator on: captured CUDA graphs replayed
if ! part tests; then compile_first graphcheck "${GRAPH_MEMCHECK_TESTS[@]}"; fi
start=$SECONDS
ENGINE_TEST_EXAMPLES=$SANITIZER_EXAMPLES \
    timeout "$GRAPH_SANITIZER_TIMEOUT" compute-sanitizer --tool memcheck --print-limit 50 \
    python3 -m pytest -q -p no:cacheprovider "${GRAPH_MEMCHECK_TESTS[@]}" \
    >"$OUT_DIR/memcheck_graphs.log" 2>&1
rc=$?
errors=$(error_summary "$OUT_DIR/memcheck_graphs.log")
tests=$(grep -E "passed|failed" "$OUT_DIR/memcheck_graphs.log" | grep -v "ERROR SUMMARY" \
    | tail -n 1)
note "memcheck, CUDA graphs captured" "rc=$rc: ${errors:-no summary (timeout?)}; ${tests}" \
    $((SECONDS - start))
fi

# 4. benchmarks (each prints its table last)
for bench in "${BENCHES[@]}"; do
    start=$SECONDS
    log="$OUT_DIR/$(basename "$bench" .py).log"
    # shellcheck disable=SC2086
    timeout "$BENCH_TIMEOUT" python3 "$bench" $BENCH_ARGS >"$log" 2>&1
    rc=$?
    note "$bench" "rc=$rc" $((SECONDS - start))
done

for bench in "${BENCHES[@]}"; do
    log="$OUT_DIR/$(basename "$bench" .py).log"
    echo; echo "== $bench"; grep -E "^(\||copy ceiling)" "$log" || tail -n 20 "$log"
done
echo; echo "| step | result | time |"; echo "|---|---|---|"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/summary.md"
