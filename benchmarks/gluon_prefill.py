"""A causal prefill kernel written in Gluon (Triton's lower-level language) for Hopper, and
its variants: the study `bench_gluon_extend.py` checks, times and compiles (not a script).

One kernel, new tokens only (no cached prefix), bf16, head_dim 128, a program a tile of
BLOCK_M rows of one q head, keys in blocks of BLOCK_N through a ring of STAGES K/V slots
filled by TMA. Each key block's step issues the next block's scores and this block's
values' product (wgmma, asynchronous) and then runs the next block's softmax while they
multiply (FlashAttention-3's overlap within a warpgroup, which Triton 3.6 cannot express:
ptxas serializes its products). Without `WS` the compute warps issue the ring's loads
themselves, a CTA-wide barrier a step before each; with `WS` (warp specialization) one
more warp issues them as the compute warps free slots (mbarriers), and the compute loop
has no CTA-wide barrier (the package's loop has four a key block around its TMA loads).
With two warpgroups in turn (FlashAttention-3's ping-pong) a tile's rows are two compute
warpgroups' halves over the same K/V ring, and each issues its products only after the
other has issued its own (an mbarrier each way), so that one's softmax runs while the
other's products multiply (without the turns, the same two warpgroups run as their
warps are scheduled). `maxnreg` caps a thread's registers at launch so that two
programs fit an SM (one, with two warpgroups in turn); the partitions' registers are then
redistributed (`setmaxnreg`), the compute warps taking what the load warp does not need.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634
# name: (BLOCK_M, BLOCK_N, STAGES, num_warps, WS, maxnreg). WS: 0 the compute warps load
# too; 1 one load warp; 2 one load warp and two compute warpgroups of BLOCK_M // 2 rows
# each that issue their products in turn (num_warps: each warpgroup's, 4); 3 the same
# without the turns.
VARIANTS: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "64 x 64, 3 slots": (64, 64, 3, 4, 0, None),
    "64 x 64, 3 slots, WS": (64, 64, 3, 4, 1, 128),
    "64 x 64, 2 slots, WS": (64, 64, 2, 4, 1, 128),
    "128 x 64, 2 slots, 8 warps, WS": (128, 64, 2, 8, 1, 168),
    "128 x 64, 3 slots, 2 warpgroups in turn": (128, 64, 3, 4, 2, 168),
    "128 x 64, 4 slots, 2 warpgroups in turn": (128, 64, 4, 4, 2, 168),
    "128 x 64, 3 slots, 2 warpgroups": (128, 64, 3, 4, 3, 168),
}


def warpgroups(ws: int) -> int:
    """Compute warpgroups a program (WS 2: two, in turn; 3: two)."""
    return 2 if ws >= 2 else 1


def turn_regs(ws: int, maxnreg: int | None) -> int:
    """WS 2 and 3: the registers a thread of the second compute warpgroup takes
    (`setmaxnreg`), the first taking as many: the CTA's 12 warps (the load warp's group
    padded to four) hold maxnreg each at launch, the load group gives all but 24 back. Else
    0 (unused)."""
    if ws < 2:
        return 0
    if not maxnreg:
        raise ValueError("two compute warpgroups need maxnreg (the CTA's registers)")
    return min(256, (maxnreg * 12 * 32 - 24 * 4 * 32) // (2 * 4 * 32) // 8 * 8)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, ready, block, qo_start, kv_col, pred,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Key block `block`'s K and V rows into its ring slot (where `pred`)."""
    slot = block % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    row = qo_start + block * BLOCK_N
    tma.async_copy_global_to_shared(k_desc, [row, kv_col], bar, k_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, kv_col], bar, v_smem.index(slot), pred=pred)


@gluon.jit
def _issue_q(q_desc, q_smem, q_bar, row, col, GROUPS: gl.constexpr):
    """The tile's q rows, a warpgroup's share into each of q_smem's GROUPS slots."""
    mbarrier.expect(q_bar, GROUPS * q_desc.block_type.nbytes)
    for g in gl.static_range(GROUPS):
        rows = row + g * q_desc.block_type.shape[0]
        tma.async_copy_global_to_shared(q_desc, [rows, col], q_bar, q_smem.index(g))


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, qo_start, m0,
            head, kv_col, n_blocks, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            STAGES: gl.constexpr, GROUPS: gl.constexpr):  # fmt: skip
    """The load warp (WS): q, then each key block into its slot once the compute warps have
    freed it (`empty`, which every compute warpgroup arrives at; a slot's first fill waits
    for nothing)."""
    _issue_q(q_desc, q_smem, q_bar, qo_start + m0, head * HEAD_DIM, GROUPS)
    for block in range(n_blocks):
        slot = block % STAGES
        mbarrier.wait(empty.index(slot), ((block // STAGES) & 1) ^ 1)
        _issue_kv(k_desc, v_desc, k_smem, v_smem, ready, block, qo_start, kv_col, True,
                  BLOCK_N, STAGES)  # fmt: skip


@gluon.jit
def _turn_wait(turns, g, HALF: gl.constexpr, TURNS: gl.constexpr):
    """With TURNS, wait until the other warpgroup has issued its products of turn g - 1
    (warpgroup 0's first turn waits for nothing: a fresh barrier's previous phase)."""
    if TURNS:
        mbarrier.wait(turns.index(HALF), (g + 1 + HALF) & 1)


@gluon.jit
def _turn_pass(turns, HALF: gl.constexpr, TURNS: gl.constexpr):
    """With TURNS, let the other warpgroup issue its products (ours are issued)."""
    if TURNS:
        mbarrier.arrive(turns.index(1 - HALF))


@gluon.jit
def _step(j, q_smem, k_smem, v_smem, ready, empty, turns, k_desc, v_desc, s_zero, acc, p, m_i,
          l_i, alpha, rows, cols, seqlen, sm_scale_log2, n_blocks, qo_start, kv_col,
          o_layout: gl.constexpr, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, MASKED: gl.constexpr, WS: gl.constexpr,
          HALF: gl.constexpr):  # fmt: skip
    """Block j's values' product and block j+1's softmax: block j+1's scores and block j's
    product are issued first and multiply while the softmax runs. p is block j's weights
    (float32: a register copy of them would be read while its product is in flight), alpha
    the factor by which the output shrinks before it. MASKED: block j+1 reaches the
    diagonal or the request's end. WS 2: the products issued in this warpgroup's turn."""
    nxt = j + 1
    nslot = nxt % STAGES
    mbarrier.wait(ready.index(nslot), (nxt // STAGES) & 1)
    _turn_wait(turns, nxt, HALF, WS == 2)
    s = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)  # fmt: skip
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    slot = j % STAGES
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
    _turn_pass(turns, HALF, WS == 2)
    s = warpgroup_mma_wait(1, deps=(s,))  # the scores (issued first); the product in flight
    if MASKED:
        keys = nxt * BLOCK_N + cols
        visible = (keys[None, :] <= rows[:, None]) & (keys[None, :] < seqlen)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * sm_scale_log2)
    p = gl.exp2(s * sm_scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if WS:  # block j's slot is free of this warpgroup: the load warp may fill it
        mbarrier.arrive(empty.index(slot))
    else:  # every warp is past block j's product: its slot takes the block STAGES ahead
        gl.thread_barrier()
        ahead = j + STAGES
        _issue_kv(k_desc, v_desc, k_smem, v_smem, ready, ahead, qo_start, kv_col,
                  ahead < n_blocks, BLOCK_N, STAGES)  # fmt: skip
    return acc, p, m_new, l_i, alpha


@gluon.jit
def _compute(q_smem, k_smem, v_smem, q_bar, ready, empty, turns, k_desc, v_desc, out,
             qo_start, seqlen, m0, head, kv_col, n_blocks, sm_scale_log2, stride_ot,
             stride_oh, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, WS: gl.constexpr, NUM_WARPS: gl.constexpr,
             HALF: gl.constexpr):  # fmt: skip
    """A warpgroup's BLOCK_M rows from m0 over the tile's n_blocks key blocks, block by
    block (`_step`), the blocks below its diagonal in one loop and the rest in another (no
    branch in a loop), then its output stored. WS 2 and 3: warpgroup HALF of two; WS 2
    issues its products in turn with the other (the same count of turns: the prologue's,
    n_blocks - 1 steps' and the last product's)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    _turn_wait(turns, 0, HALF, WS == 2)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                      is_async=True)  # fmt: skip
    _turn_pass(turns, HALF, WS == 2)
    s = warpgroup_mma_wait(0, deps=(s,))
    if BLOCK_N > m0:  # block 0 on the diagonal
        visible = (cols[None, :] <= rows[:, None]) & (cols[None, :] < seqlen)
        s = gl.where(visible, s, float("-inf"))
    m_i = gl.max(s, 1) * sm_scale_log2
    p = gl.exp2(s * sm_scale_log2 - m_i[:, None])
    l_i = gl.sum(p, 1)
    alpha = gl.full([BLOCK_M], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
    below = gl.minimum(m0 // BLOCK_N, n_blocks)  # blocks wholly below the diagonal
    for j in range(0, below - 1):
        acc, p, m_i, l_i, alpha = _step(
            j, q_smem, k_smem, v_smem, ready, empty, turns, k_desc, v_desc, s_zero, acc, p,
            m_i, l_i, alpha, rows, cols, seqlen, sm_scale_log2, n_blocks, qo_start, kv_col,
            o_layout, p_layout, BLOCK_N, STAGES, False, WS, HALF,
        )  # fmt: skip
    for j in range(gl.maximum(below - 1, 0), n_blocks - 1):
        acc, p, m_i, l_i, alpha = _step(
            j, q_smem, k_smem, v_smem, ready, empty, turns, k_desc, v_desc, s_zero, acc, p,
            m_i, l_i, alpha, rows, cols, seqlen, sm_scale_log2, n_blocks, qo_start, kv_col,
            o_layout, p_layout, BLOCK_N, STAGES, True, WS, HALF,
        )  # fmt: skip
    last = n_blocks - 1
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    _turn_wait(turns, n_blocks, HALF, WS == 2)
    acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
    _turn_pass(turns, HALF, WS == 2)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    result = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = (out + (qo_start + o_rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh
            + o_cols[None, :])  # fmt: skip
    gl.store(ptrs, result.to(out.dtype.element_ty), mask=(o_rows < seqlen)[:, None])


@gluon.jit
def prefill_kernel(
    q_desc, k_desc, v_desc, out, qo_indptr, sm_scale_log2, stride_ot, stride_oh,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WS: gl.constexpr, REGS: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """Program (q block from the longest, request, q head): the tile's causal attention over
    the request's new tokens (qo_indptr: int32 offsets). WS 2 and 3: BLOCK_M rows in two
    warpgroups' halves (q_desc's block is a half), the second warpgroup's threads taking
    REGS registers (`turn_regs`)."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]  # a compute warpgroup's (`warpgroups`)
    GROUPS: gl.constexpr = BLOCK_M // ROWS
    q_block = gl.num_programs(0) - 1 - gl.program_id(0)
    req = gl.program_id(1)
    head = gl.program_id(2)
    qo_start = gl.load(qo_indptr + req)
    seqlen = gl.load(qo_indptr + req + 1) - qo_start
    m0 = q_block * BLOCK_M
    if m0 < seqlen:
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [GROUPS, ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=GROUPS)
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)
        n_blocks = gl.cdiv(gl.minimum(m0 + BLOCK_M, seqlen), BLOCK_N)
        kv_col = head // GROUP * HEAD_DIM
        if WS >= 2:
            gl.warp_specialize(
                [
                    (_compute, (q_smem.index(0), k_smem, v_smem, q_bar, ready, empty, turns,
                                k_desc, v_desc, out, qo_start, seqlen, m0, head, kv_col,
                                n_blocks, sm_scale_log2, stride_ot, stride_oh, ROWS, BLOCK_N,
                                HEAD_DIM, STAGES, WS, num_warps, 0)),
                    (_compute, (q_smem.index(1), k_smem, v_smem, q_bar, ready, empty, turns,
                                k_desc, v_desc, out, qo_start, seqlen, m0 + ROWS, head, kv_col,
                                n_blocks, sm_scale_log2, stride_ot, stride_oh, ROWS, BLOCK_N,
                                HEAD_DIM, STAGES, WS, num_warps, 1)),
                    (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready,
                               empty, qo_start, m0, head, kv_col, n_blocks, BLOCK_N, HEAD_DIM,
                               STAGES, GROUPS)),
                ],
                [num_warps, 1],
                [REGS, 24],
            )  # fmt: skip
        elif WS:
            gl.warp_specialize(
                [
                    (_compute, (q_smem.index(0), k_smem, v_smem, q_bar, ready, empty, turns,
                                k_desc, v_desc, out, qo_start, seqlen, m0, head, kv_col,
                                n_blocks, sm_scale_log2, stride_ot, stride_oh, BLOCK_M,
                                BLOCK_N, HEAD_DIM, STAGES, WS, num_warps, 0)),
                    (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready,
                               empty, qo_start, m0, head, kv_col, n_blocks, BLOCK_N, HEAD_DIM,
                               STAGES, GROUPS)),
                ],
                [1],
                [24],
            )  # fmt: skip
        else:
            _issue_q(q_desc, q_smem, q_bar, qo_start + m0, head * HEAD_DIM, GROUPS)
            for i in gl.static_range(STAGES):
                _issue_kv(k_desc, v_desc, k_smem, v_smem, ready, i, qo_start, kv_col,
                          i < n_blocks, BLOCK_N, STAGES)  # fmt: skip
            _compute(q_smem.index(0), k_smem, v_smem, q_bar, ready, empty, turns, k_desc,
                     v_desc, out, qo_start, seqlen, m0, head, kv_col, n_blocks, sm_scale_log2,
                     stride_ot, stride_oh, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, WS, num_warps,
                     0)  # fmt: skip


def shared_layout(block: list[int]):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def prefill(q, k, v, out, qo_indptr, max_len, scale, variant):
    """q [T, Hq, D], k and v [T, Hkv, D] (bf16, contiguous), qo_indptr int32 [B + 1]:
    causal attention of each request's new tokens into out [T, Hq, D]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block_m, block_n, stages, warps, ws, maxnreg = variant
    tokens, hq, d = q.shape
    hkv = k.shape[1]

    def desc(t, rows):
        flat = t.view(tokens, -1)
        block = [rows, d]
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block,
                                shared_layout(block))  # fmt: skip

    grid = (triton.cdiv(max_len, block_m), qo_indptr.numel() - 1, hq)
    prefill_kernel[grid](
        desc(q, block_m // warpgroups(ws)), desc(k, block_n), desc(v, block_n), out, qo_indptr,
        scale * LOG2E, out.stride(0), out.stride(1), hq // hkv, block_m, block_n, d, stages, ws,
        turn_regs(ws, maxnreg), num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
