#!/usr/bin/env bash
# Why a verify pass of the default model's shape costs more than a decode pass at batch 1 on
# the GPU (about 3 minutes): bench_steps (forward of each, CUDA graphs, kernel tables) in
# float32 and bfloat16, then the model's matrix products at 1 and 13 rows (bench_gemv).
#   bash scripts/gpu_verify_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT_DIR/install.log" 2>&1 \
    || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
rc=0
run() {  # name, timeout, command...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local status=$?
    echo "== $name: rc=$status"
    grep -v "Warning\|warn(" "$OUT_DIR/$name.log" | tail -n 60
    [ "$status" -ne 0 ] && rc=$status
}
# VERIFY_DTYPES="float32": one dtype only (a shorter call)
for dtype in ${VERIFY_DTYPES:-float32 bfloat16}; do
    run "steps_$dtype" 120 python3 benchmarks/bench_steps.py --preset smollm2_135m \
        --dtype "$dtype" --batches 1,8 --profile
    run "gemv_$dtype" 60 python3 benchmarks/bench_gemv.py --shapes smollm2_135m \
        --dtype "$dtype" --rows 1,13
done
exit $rc
