#!/usr/bin/env bash
# The engine's GPU checks in one call: graph/verify tests on CUDA, the original scenario
# under compute-sanitizer memcheck, then the end-to-end and step benchmarks (tables last).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT_DIR/install.log" 2>&1 \
    || export PYTHONPATH=$PWD
SUMMARY=()
note() { SUMMARY+=("| $1 | $2 | $3 s |"); }

start=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_graphs.py \
    tests/engine/test_spec_overflow.py >"$OUT_DIR/engine_tests.log" 2>&1
note "engine GPU tests" "rc=$?: $(tail -n 1 "$OUT_DIR/engine_tests.log")" $((SECONDS - start))
tail -n 15 "$OUT_DIR/engine_tests.log"

# memcheck twice: eager only with every allocation its own (no caching allocator), then with
# captured graphs (capture needs the caching allocator).
for mode in eager graphs; do
    start=$SECONDS
    if [ $mode = eager ]; then envs="PYTORCH_NO_CUDA_MEMORY_CACHING=1 ENGINE_TEST_GRAPH_MAX_BATCH=0"
    else envs="ENGINE_TEST_GRAPH_MAX_BATCH=4"; fi
    log="$OUT_DIR/engine_memcheck_$mode.log"
    env $envs timeout 200 compute-sanitizer --tool memcheck \
        python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec_overflow.py >"$log" 2>&1
    rc=$?
    errors=$(grep -o "ERROR SUMMARY: [0-9]* error" "$log" | tail -n 1)
    note "memcheck $mode (verify > largest graph)" "rc=$rc: ${errors:-no summary}; $(grep -E 'passed|failed' "$log" | tail -n 1)" $((SECONDS - start))
done

for bench in "benchmarks/bench_engine.py --device cuda" benchmarks/bench_steps.py; do
    start=$SECONDS
    name=$(basename "${bench%% *}" .py)
    # shellcheck disable=SC2086
    timeout 240 python3 $bench >"$OUT_DIR/$name.log" 2>&1
    note "$name" "rc=$?" $((SECONDS - start))
    echo; echo "== $bench"; grep -E "^(\||H200|tokens)" "$OUT_DIR/$name.log" || tail -n 30 "$OUT_DIR/$name.log"
done
echo; echo "| step | result | time |"; echo "|---|---|---|"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/engine_summary.md"
