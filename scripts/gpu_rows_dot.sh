#!/usr/bin/env bash
# The all-rows matrix kernel with its products summed by tl.dot (ENGINE_ROWS_DOT), one call on
# the GPU machine (about 5 minutes, random weights, no model file): its GPU tests (the DOT
# launches compiled and checked on the device), the verify pass's four launches both ways
# (bench_gemv --dot), and the default model's shape's decode and verify passes with and
# without it (bench_steps, trees of 8 and 13 nodes, PDL off and `top`: the 13-row pass runs
# without PDL now: with the elementwise sums `top` cost it 13%). Logs go to
# $OUT when set.
#   bash scripts/gpu_rows_dot.sh          # DOT_PRECISION=tf32x3 (default) | tf32 | ieee
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
echo "$gpu_env_status"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
precision=${DOT_PRECISION:-tf32x3}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/ops/test_gemv.py \
    >"$OUT_DIR/dot_tests.log" 2>&1
echo "tests/ops/test_gemv.py: rc=$? $(tail -n 1 "$OUT_DIR/dot_tests.log")"
timeout 150 python3 benchmarks/bench_gemv.py --dot --shapes smollm2_135m --dtype float32 \
    --rows 8,13 >"$OUT_DIR/bench_gemv_dot.log" 2>&1
echo "bench_gemv --dot: rc=$?"
for setting in "" "$precision"; do
    log="$OUT_DIR/bench_steps_dot_${setting:-off}.log"
    ENGINE_ROWS_DOT=$setting timeout 180 python3 benchmarks/bench_steps.py \
        --preset smollm2_135m --dtype float32 --batches 1 --context 512 --max-context 8192 \
        --tree-nodes 8,13 --pdl off,top >"$log" 2>&1
    echo "bench_steps, ENGINE_ROWS_DOT=${setting:-unset}: rc=$?"
done
echo; echo "== bench_gemv --dot"; grep "^|" "$OUT_DIR/bench_gemv_dot.log"
for setting in off "$precision"; do
    echo; echo "== bench_steps, ENGINE_ROWS_DOT=$setting"
    grep "^|" "$OUT_DIR/bench_steps_dot_$setting.log" | head -n 8
done
