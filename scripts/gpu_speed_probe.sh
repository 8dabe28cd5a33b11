#!/usr/bin/env bash
# GPU speed probe, one call on the GPU machine (about 7 minutes): decode at a grid of shapes
# timed at every split count against the engine's split policy (bench_decode_launches.py
# --split-grid), then torch.profiler summaries of a decode-heavy run at batch 64 (random
# llama3_8b) and of speculative decoding at batch 1 (random smollm2_135m: verify against
# decode steps).
# Logs go to $OUT when set (the device tool brings that folder back); the summary is printed.
#   bash scripts/gpu_speed_probe.sh          # carry .carry (scripts/gpu_env.sh's wheels)
# PROBE_PARTS="grid decode decode-off spec run load3d extend prefetch pdl-kinds verify
# timeline sweep-verify verify-attention verify-configs engine short ncu gluon pdl"
# picks parts (default: grid decode spec); GRID_TIMEOUT / DECODE_TIMEOUT / SPEC_TIMEOUT /
# LOAD3D_TIMEOUT / EXTEND_TIMEOUT / PREFETCH_TIMEOUT / PDL_KINDS_TIMEOUT / VERIFY_TIMEOUT /
# TIMELINE_TIMEOUT / SWEEP_VERIFY_TIMEOUT / VERIFY_ATTENTION_TIMEOUT / VERIFY_CONFIGS_TIMEOUT
# / ENGINE_TIMEOUT / SHORT_TIMEOUT / NCU_TIMEOUT / GLUON_TIMEOUT / PDL_TIMEOUT (s). extend times extend configurations in turns with SDPA
# (`bench_extend.py --turns`). load3d and prefetch time the opt-in kernel variants
# against the defaults: PROBE_PARTS="load3d prefetch". pdl-kinds times the default model's batch-1
# passes with PDL `top` kept to one kind of launch at a time (`pdl.KINDS`): which launches'
# overlap a 13-node verify pass loses, where an 8-node one gains. verify times the default model's
# batch-1 verify passes against a decode pass as the engine runs them (PDL `auto`), with the
# output layer cuBLAS's and the package's, and its product alone at 1, 8 and 13 rows; timeline
# prints those passes' kernels on the device's timeline with PDL off and `auto` (`bench_steps.py
# --timeline`). sweep-verify times the verify pass's all-rows matrix launches at 8 and 13 rows
# over a space of tiles, warps and key steps in flight (`bench_gemv_sweeps.py --sweep-verify`).
# verify-attention times the default model's batch-1 verify passes with the verify attention's
# launch as the policy chooses it and with the other `VERIFY_CONFIGS` entry's settings
# (`bench_steps.py --verify-attention`); verify-configs each `VERIFY_CONFIGS` launch alone at
# verify shapes of 1-64 requests, timed in turns, beside the policy's choice (`bench_decode_launches.py
# --verify-configs`). engine runs `bench_engine.py --no-hf --batches 1,64 --max-tokens 256` (the
# end-to-end targets against the roofline floor); short times decode at short contexts beside a
# copy of the same bytes (`bench_attention.py --short`). ncu reads Nsight Compute's counters of
# the extend and decode kernels beside SDPA's and a copy's (`ncu_attention.py`; its reports and
# raw CSVs in $OUT/ncu; NCU_LABELS=<labels separated by commas> picks some). gluon checks the
# Gluon prefill kernel's variants against SDPA, then times them beside SDPA's flash kernel and
# the package's extend kernel (`bench_gluon_extend.py`). pdl times decode and verify with PDL
# off and in each mode (`bench_attention.py --pdl`).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# the package, and the wheels the image lacks (llguidance: the engine imports it)
source scripts/gpu_env.sh
echo "$gpu_env_status"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader \
    | tee "$OUT_DIR/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
rc=0
for part in ${PROBE_PARTS:-grid decode spec}; do
    case "$part" in
    grid) cmd=(python3 benchmarks/bench_decode_launches.py --split-grid); limit=${GRID_TIMEOUT:-230} ;;
    decode) cmd=(python3 benchmarks/profile_steps.py decode); limit=${DECODE_TIMEOUT:-120} ;;
    decode-off)  # the same with the engine's launch_ahead off (it is on by default on CUDA)
        cmd=(python3 benchmarks/profile_steps.py decode --no-launch-ahead)
        limit=${DECODE_TIMEOUT:-120} ;;
    spec) cmd=(python3 benchmarks/profile_steps.py spec); limit=${SPEC_TIMEOUT:-60} ;;
    run)  # the whole decode-heavy run at batch 64: the prompts' prefill and every decode step
        cmd=(python3 benchmarks/profile_steps.py decode --prefill --steps 300 --max-tokens 256)
        limit=${DECODE_TIMEOUT:-120} ;;
    load3d)  # the all-rows products flat against in 3-d blocks (ENGINE_ROWS_LOAD_3D): each
        # verify launch alone, then the default model's passes (random weights) flat and
        # with the launches without SiLU*mul in 3-d blocks, twice in turn
        cmd=(bash -c 'python3 benchmarks/bench_gemv.py --load-3d --shapes smollm2_135m \
            --dtype float32 --rows 8,13 && for v in 0 plain 0 plain; do
            echo "ENGINE_ROWS_LOAD_3D=$v"
            ENGINE_ROWS_LOAD_3D=$v python3 benchmarks/bench_steps.py --preset smollm2_135m \
            --dtype float32 --batches 1 --context 512 --max-context 8192 --tree-nodes 8,13
            done')
        limit=${LOAD3D_TIMEOUT:-200} ;;
    extend)  # extend configurations timed in turns with SDPA
        cmd=(python3 benchmarks/bench_extend.py --turns)
        limit=${EXTEND_TIMEOUT:-200} ;;
    prefetch)  # the decode split kernel's PREFETCH configurations beside the defaults
        cmd=(python3 benchmarks/bench_attention.py --decode); limit=${PREFETCH_TIMEOUT:-200} ;;
    pdl-kinds)  # PDL off; then `top` on every launch, and on some kinds of launch at a time
        cmd=(bash -c 'steps="python3 benchmarks/bench_steps.py --preset smollm2_135m \
            --dtype float32 --batches 1 --context 512 --max-context 8192 --tree-nodes 8,13"
            $steps --pdl off && $steps --pdl top --pdl-kinds \
            "all;products;attention,merge;ops,index,draw;attention,merge,ops,index,draw"')
        limit=${PDL_KINDS_TIMEOUT:-300} ;;
    verify)  # the output layer's product alone, then the passes with it both ways
        cmd=(bash -c 'python3 benchmarks/bench_gemv.py --shapes smollm2_135m --dtype float32 \
            --rows 1,8,13 --only lm_head && python3 benchmarks/bench_steps.py --preset \
            smollm2_135m --dtype float32 --batches 1 --context 512 --max-context 8192 \
            --tree-nodes 8,13 --output-layer "cublas;package"')
        limit=${VERIFY_TIMEOUT:-200} ;;
    timeline)
        cmd=(python3 benchmarks/bench_steps.py --preset smollm2_135m --dtype float32 --batches 1
            --context 512 --max-context 8192 --tree-nodes 8,13 --pdl off,auto --timeline)
        limit=${TIMELINE_TIMEOUT:-200} ;;
    sweep-verify)  # each at 84 launches (an H100: about 35 s a row count)
        cmd=(python3 benchmarks/bench_gemv_sweeps.py --sweep-verify --shapes smollm2_135m
            --dtype float32 --rows 8,13)
        limit=${SWEEP_VERIFY_TIMEOUT:-200} ;;
    verify-attention)  # the policy's verify launch against 64-key blocks, one engine each
        cmd=(python3 benchmarks/bench_steps.py --preset smollm2_135m --dtype float32 --batches 1
            --context 512 --max-context 8192 --tree-nodes 8,13 --verify-attention
            'policy;{"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}')
        limit=${VERIFY_ATTENTION_TIMEOUT:-200} ;;
    verify-configs)  # each VERIFY_CONFIGS launch alone at verify shapes, timed in turns
        cmd=(python3 benchmarks/bench_decode_launches.py --verify-configs)
        limit=${VERIFY_CONFIGS_TIMEOUT:-200} ;;
    short)  # decode at short contexts against a copy of the same bytes
        cmd=(python3 benchmarks/bench_attention.py --short); limit=${SHORT_TIMEOUT:-120} ;;
    ncu)  # hardware counters: each label in its own ncu run
        cmd=(python3 benchmarks/ncu_attention.py --out "$OUT_DIR/ncu")
        [ -n "${NCU_LABELS:-}" ] && cmd+=(--only "$NCU_LABELS")
        limit=${NCU_TIMEOUT:-300} ;;
    gluon)  # the Gluon prefill kernel's variants checked, then timed beside SDPA and ours
        cmd=(python3 benchmarks/bench_gluon_extend.py); limit=${GLUON_TIMEOUT:-200} ;;
    pdl)  # decode and verify with PDL off and in each mode
        cmd=(python3 benchmarks/bench_attention.py --pdl); limit=${PDL_TIMEOUT:-200} ;;
    engine)  # end to end against the roofline floor at batch 1 and 64 (random Llama-3-8B)
        cmd=(python3 benchmarks/bench_engine.py --no-hf --batches 1,64 --max-tokens 256
            --device cuda)
        limit=${ENGINE_TIMEOUT:-250} ;;
    *) echo "unknown part $part (grid, decode, decode-off, spec, run, load3d, extend,"\
        "prefetch, pdl-kinds, verify, timeline, sweep-verify, verify-attention,"\
            "verify-configs, engine, short, ncu, gluon, pdl)"
        exit 2 ;;
    esac
    start=$(date +%s)
    timeout "$limit" "${cmd[@]}" >"$OUT_DIR/$part.log" 2>&1
    status=$?
    echo "== $part: rc=$status in $(( $(date +%s) - start )) s (limit $limit)"
    grep -v "^split-grid \|Warning\|warn(" "$OUT_DIR/$part.log" | tail -n 80
    [ "$status" -ne 0 ] && rc=$status
done
echo "== split-grid records"
grep "^split-grid " "$OUT_DIR/grid.log" 2>/dev/null
exit $rc
