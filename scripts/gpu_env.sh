# Sourced by the GPU scripts (gpu_suite.sh, gpu_spec.sh) on the GPU machine, from the
# repository root: installs the package and puts the dependencies its image lacks on
# PYTHONPATH. The image has torch and triton and no network, so the package installs with
# --no-deps, and gguf and llguidance (GGUF loading, structured output) and pytest-xdist (the
# GPU suite's test workers, `GPU_WORKERS`) come as wheels carried in $GPU_WHEELS (default
# .carry/wheels, git-ignored). Fetch them here before the call:
#   .venv/bin/python -m pip download -q --no-deps gguf llguidance pytest-xdist execnet \
#       -d .carry/wheels
# and name .carry in the device call's carry. Logs go to $OUT_DIR/install.log; `gpu_env_status`
# says what was done (a line for a summary).
GPU_WHEELS=${GPU_WHEELS:-.carry/wheels}
GPU_SITE=${GPU_SITE:-/tmp/engine-gpu-site}
gpu_env_status=""
if python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT_DIR/install.log" 2>&1; then
    gpu_env_status="package installed"
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    gpu_env_status="install failed; PYTHONPATH=$PWD used (see install.log)"
fi
if ! python3 -c 'import gguf, llguidance, xdist' >/dev/null 2>&1; then
    if compgen -G "$GPU_WHEELS/*.whl" >/dev/null; then
        python3 -m pip install -q --no-deps --target "$GPU_SITE" "$GPU_WHEELS"/*.whl \
            >>"$OUT_DIR/install.log" 2>&1
        export PYTHONPATH=$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}
    fi
    if python3 -c 'import gguf, llguidance, xdist' >/dev/null 2>&1; then
        gpu_env_status="$gpu_env_status; gguf, llguidance and xdist from $GPU_WHEELS"
    else
        gpu_env_status="$gpu_env_status; gguf, llguidance or xdist missing: no wheels in $GPU_WHEELS"
        echo "gguf, llguidance or xdist cannot be imported and $GPU_WHEELS has no wheels of them;" \
            "fetch them (see scripts/gpu_env.sh) and carry them" >&2
    fi
fi
