#!/usr/bin/env bash
# The model families on one H200 (~6-8 minutes): install the package, run the family layer
# tests and the fused RoPE kernel tests (q/k/v bias and q/k head norms inside the RoPE / K-V
# store launch) on CUDA, then bench_engine.py for random Qwen3-8B and Llama-3-8B weights
# (128 new tokens per request), and print both tables: the decode step against its floor.
# Logs go to $OUT when set (the device tool brings that folder back), else to a temp folder.
set -uo pipefail

TESTS=(tests/ops/test_family_layers.py tests/ops/test_qkv_extras.py tests/ops/test_fused.py)
PRESETS=(${FAMILY_PRESETS:-qwen3_8b llama3_8b})  # e.g. FAMILY_PRESETS="qwen3_8b qwen2_7b"
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-170}

cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
SUMMARY=()
note() { SUMMARY+=("| $1 | $2 | $3 s |"); }

start=$SECONDS
if python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT_DIR/install.log" 2>&1; then
    note install ok $((SECONDS - start))
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    note install "failed; PYTHONPATH=$PWD used (see install.log)" $((SECONDS - start))
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader \
    | tee "$OUT_DIR/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT_DIR/gpu.txt"

start=$SECONDS
timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
    >"$OUT_DIR/pytest.log" 2>&1
rc=$?
grep -E "FAILED|Error" "$OUT_DIR/pytest.log" | head -n 20
note "pytest (CUDA): ${TESTS[*]}" "rc=$rc: $(tail -n 1 "$OUT_DIR/pytest.log")" $((SECONDS - start))

for preset in "${PRESETS[@]}"; do
    start=$SECONDS
    timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_engine.py --device cuda --preset "$preset" \
        --max-tokens 128 >"$OUT_DIR/bench_engine_$preset.log" 2>&1
    rc=$?
    note "bench_engine.py --preset $preset --max-tokens 128" "rc=$rc" $((SECONDS - start))
done

for preset in "${PRESETS[@]}"; do
    log="$OUT_DIR/bench_engine_$preset.log"
    echo; echo "== bench_engine.py --preset $preset"
    grep -E "^(\||NVIDIA|H200)" "$log" || tail -n 20 "$log"
done
echo; echo "| step | result | time |"; echo "|---|---|---|"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/summary.md"
