"""Triton extend attention: a cached prefix (gathered through kv_indices) plus new tokens.

Each program owns BLOCK_M new tokens of one request and HEADS q heads of one kv head (1 by
default; with more, the heads share each K/V block loaded, their rows interleaved by token
in one tile of BLOCK_M x HEADS rows). Stage 1 walks the prefix keys in the pool (whole
blocks unmasked, the last partial one masked); stage 2 reads the new tokens' K/V straight
from the k/v inputs, unmasked below the diagonal block and causally masked on it (in one loop
with `DIAGONAL_IN_LOOP`, else in two). On Hopper, in bf16 and fp16, the new tokens' q, K and
V tiles come through tensor-memory (TMA) descriptors of [tokens, heads * head_dim] rows (q of
several heads: of [tokens, heads, head_dim] tiles): a tile that runs past the request's
tokens reads the next request's or a padding token's (masked, never stored) or zeros past
the last. Masked keys weigh 0, so their values must be finite (0 x NaN is NaN): padding
tokens (after the last request's, in a pass padded to a token count) belong to no request,
and the backend zeroes their output rows, so that their K/V stay finite in every layer.
Zeroing the masked values in the tile instead moved the values through registers: 1.3-1.6x
the time (H200). The descriptors and whether a tensor allows them: `backends/tma.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.backends import extend_policy
from engine.backends.tma import rows_descriptor, tma_ready
from engine.pdl import enter, leave


@triton.jit
def softmax_accumulate(scores, v_block, m_i, l_i, acc, sm_scale_log2, GUARDED: tl.constexpr):
    """One key block's scores (masked keys at -inf) into the running maximum m_i (log2
    units), sum l_i and output acc. GUARDED: a row may have seen no key yet (its maximum
    -inf); else every row's maximum is finite."""
    # the scale joins the subtraction (one multiply-add an element)
    m_new = tl.maximum(m_i, tl.max(scores, 1) * sm_scale_log2)
    if GUARDED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.math.exp2(scores * sm_scale_log2 - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v_block.dtype), v_block, acc)  # accumulates in place (wgmma's C)
    return m_new, l_i, acc


@triton.jit
def online_softmax_step(
    q_block, k_block, v_block, visible, m_i, l_i, acc, sm_scale_log2, MASKED: tl.constexpr
):
    """A key block attended: its keys where `visible` with MASKED (a row may then have seen
    none yet), all of them without (`visible` unused)."""
    scores = tl.dot(q_block, tl.trans(k_block))
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    return softmax_accumulate(scores, v_block, m_i, l_i, acc, sm_scale_log2, MASKED)


@triton.jit
def _extend_kernel(
    q,
    k,
    v,
    q_desc,
    k_desc,
    v_desc,
    k_cache,
    v_cache,
    kv_indices,
    kv_indptr,
    qo_indptr,
    prefix_lens,
    out,
    out_capacity,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TMA: tl.constexpr,
    Q_AXIS: tl.constexpr,
    R_AXIS: tl.constexpr,
    H_AXIS: tl.constexpr,
    PDL: tl.constexpr,
    HEADS: tl.constexpr = 1,
    DIAGONAL_IN_LOOP: tl.constexpr = False,
):
    enter(PDL)
    q_block_id = tl.num_programs(Q_AXIS) - 1 - tl.program_id(Q_AXIS)  # longest blocks first
    req = tl.program_id(R_AXIS)
    first_head = tl.program_id(H_AXIS) * HEADS
    kv_head = first_head // GROUP
    # int32 whatever the offsets' type (a graph's are int64): descriptor loads take 32 bits
    qo_start = tl.load(qo_indptr + req).to(tl.int32)
    num_new = tl.load(qo_indptr + req + 1).to(tl.int32) - qo_start
    first = q_block_id * BLOCK_M
    if first < num_new:
        prefix = tl.load(prefix_lens + req)
        kv_start = tl.load(kv_indptr + req)
        dims = tl.arange(0, HEAD_DIM)
        # a tile row: token first + row // HEADS of the request, q head first_head + row % HEADS
        if HEADS == 1:
            rows = first + tl.arange(0, BLOCK_M)
            head_col = first_head
        else:
            rows = first + tl.arange(0, BLOCK_M * HEADS) // HEADS
            head_col = (first_head + tl.arange(0, BLOCK_M * HEADS) % HEADS)[:, None]
        row_ok = rows < num_new
        token = (qo_start + rows).to(tl.int64)
        if TMA:  # rows past the request's own are other requests' (or zeros): never stored
            if HEADS == 1:
                q_block = q_desc.load([qo_start + first, first_head * HEAD_DIM])
            else:  # [tokens, heads, dims] tiles: rows interleaved by token as above
                q_block = q_desc.load([qo_start + first, first_head, 0]).reshape(
                    BLOCK_M * HEADS, HEAD_DIM
                )
        else:
            q_block = tl.load(
                q + token[:, None] * stride_qt + head_col * stride_qh + dims[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )
        m_i = tl.full([BLOCK_M * HEADS], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * HEADS], tl.float32)
        acc = tl.zeros([BLOCK_M * HEADS, HEAD_DIM], tl.float32)
        cache_head = kv_head * stride_ch + dims[None, :]
        full = prefix - prefix % BLOCK_N
        for start in range(0, full, BLOCK_N):  # stage 1: whole blocks of the cached prefix
            keys = start + tl.arange(0, BLOCK_N)
            slots = tl.load(kv_indices + kv_start + keys).to(tl.int64)
            offs = slots[:, None] * stride_ct + cache_head
            k_block = tl.load(k_cache + offs)
            v_block = tl.load(v_cache + offs)
            m_i, l_i, acc = online_softmax_step(
                q_block, k_block, v_block, None, m_i, l_i, acc, sm_scale_log2, MASKED=False
            )
        if full < prefix:  # the prefix's last, partial block
            keys = full + tl.arange(0, BLOCK_N)
            key_ok = keys < prefix
            slots = tl.load(kv_indices + kv_start + keys, mask=key_ok, other=0).to(tl.int64)
            offs = slots[:, None] * stride_ct + cache_head
            k_block = tl.load(k_cache + offs, mask=key_ok[:, None], other=0.0)
            v_block = tl.load(v_cache + offs, mask=key_ok[:, None], other=0.0)
            m_i, l_i, acc = online_softmax_step(
                q_block,
                k_block,
                v_block,
                key_ok[None, :],
                m_i,
                l_i,
                acc,
                sm_scale_log2,
                MASKED=True,
            )
        if DIAGONAL_IN_LOOP:  # stage 2 in one loop: the diagonal block's loads pipelined too
            for start in range(0, tl.minimum(first + BLOCK_M, num_new), BLOCK_N):
                local = start + tl.arange(0, BLOCK_N)
                if TMA:  # keys past the request's own are masked below
                    k_block = k_desc.load([qo_start + start, kv_head * HEAD_DIM])
                    v_block = v_desc.load([qo_start + start, kv_head * HEAD_DIM])
                else:
                    keys = (qo_start + local).to(tl.int64)[:, None]
                    key_in = (local < num_new)[:, None]
                    k_ptrs = k + keys * stride_kt + kv_head * stride_kh + dims[None, :]
                    v_ptrs = v + keys * stride_vt + kv_head * stride_vh + dims[None, :]
                    k_block = tl.load(k_ptrs, mask=key_in, other=0.0)
                    v_block = tl.load(v_ptrs, mask=key_in, other=0.0)
                scores = tl.dot(q_block, tl.trans(k_block))
                # the diagonal blocks (a uniform branch, the rest unmasked): those ending past
                # the tile's first token, which start before it where BLOCK_N > BLOCK_M
                if start + BLOCK_N > first:
                    visible = (local[None, :] < num_new) & (local[None, :] <= rows[:, None])
                    scores = tl.where(visible, scores, float("-inf"))
                # every row sees a key by its diagonal block's end (its own): no guard
                m_i, l_i, acc = softmax_accumulate(
                    scores, v_block, m_i, l_i, acc, sm_scale_log2, GUARDED=False
                )
        else:
            for start in range(0, first, BLOCK_N):  # stage 2a: below the diagonal block
                if TMA:
                    k_block = k_desc.load([qo_start + start, kv_head * HEAD_DIM])
                    v_block = v_desc.load([qo_start + start, kv_head * HEAD_DIM])
                else:
                    keys = (qo_start + start + tl.arange(0, BLOCK_N)).to(tl.int64)
                    k_block = tl.load(
                        k + keys[:, None] * stride_kt + kv_head * stride_kh + dims[None, :]
                    )
                    v_block = tl.load(
                        v + keys[:, None] * stride_vt + kv_head * stride_vh + dims[None, :]
                    )
                m_i, l_i, acc = online_softmax_step(
                    q_block, k_block, v_block, None, m_i, l_i, acc, sm_scale_log2, MASKED=False
                )
            last = tl.minimum(first + BLOCK_M, num_new)
            for start in range(first, last, BLOCK_N):  # stage 2b: the diagonal block, causal
                local = start + tl.arange(0, BLOCK_N)
                key_ok = local < num_new
                if TMA:  # keys past the request's own are masked below
                    k_block = k_desc.load([qo_start + start, kv_head * HEAD_DIM])
                    v_block = v_desc.load([qo_start + start, kv_head * HEAD_DIM])
                else:
                    keys = (qo_start + local).to(tl.int64)
                    k_block = tl.load(
                        k + keys[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                        mask=key_ok[:, None],
                        other=0.0,
                    )
                    v_block = tl.load(
                        v + keys[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                        mask=key_ok[:, None],
                        other=0.0,
                    )
                visible = key_ok[None, :] & (local[None, :] <= rows[:, None])
                m_i, l_i, acc = online_softmax_step(
                    q_block, k_block, v_block, visible, m_i, l_i, acc, sm_scale_log2, MASKED=True
                )
        leave(PDL)
        result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        store_ok = row_ok & (token < out_capacity)
        out_ptrs = out + token[:, None] * stride_ot + head_col * stride_oh + dims[None, :]
        tl.store(out_ptrs, result.to(out.dtype.element_ty), mask=store_ok[:, None])


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    out: torch.Tensor,
    max_new_len: int,
    max_seq_len: int,
    sm_scale: float,
    config: dict | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves, into out.
    k/v are the new tokens' K/V in the cache dtype, [T, Hkv, D]. max_new_len, max_seq_len:
    the most new tokens and keys of a request (a bound: a captured launch serves other
    passes). `config` replaces the launch `choose_extend_config` would choose (on a GPU)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_requests = qo_indptr.shape[0] - 1
    group = num_q_heads // k_cache.shape[1]
    cfg = extend_policy.extend_launch(
        q.device.type == "cpu", num_requests, max_seq_len, group, config
    )
    order, heads = cfg["GRID_ORDER"], cfg["HEADS"]
    if num_tokens == 0 or num_requests == 0:  # refused settings above even so
        return out
    sizes = {
        "q": triton.cdiv(max_new_len, cfg["BLOCK_M"]),
        "r": num_requests,
        "h": num_q_heads // heads,
    }
    grid = tuple(sizes[axis] for axis in order)
    tma = bool(cfg["TMA"]) and tma_ready(q, k, v)
    if tma:
        q_desc = rows_descriptor(q, cfg["BLOCK_M"], heads)
        k_desc, v_desc = rows_descriptor(k, cfg["BLOCK_N"]), rows_descriptor(v, cfg["BLOCK_N"])
    else:
        q_desc, k_desc, v_desc = q, k, v
    _extend_kernel[grid](
        q,
        k,
        v,
        q_desc,
        k_desc,
        v_desc,
        k_cache,
        v_cache,
        kv_indices,
        kv_indptr,
        qo_indptr,
        prefix_lens,
        out,
        out.shape[0],
        sm_scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        HEAD_DIM=head_dim,
        TMA=tma,
        Q_AXIS=order.index("q"),
        R_AXIS=order.index("r"),
        H_AXIS=order.index("h"),
        HEADS=heads,
        DIAGONAL_IN_LOOP=bool(cfg["DIAGONAL_IN_LOOP"]),
        **pdl.launch(q.device, "attention"),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
