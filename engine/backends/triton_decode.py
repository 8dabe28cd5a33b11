"""Triton paged decode and target-verify attention: split-KV, GQA-packed, then a merge.

One program handles every query head of one kv head (and, when verifying, every tree query of
its request) over one split of the request's keys; verify is decode with D queries per request
and the ancestor mask. The splits' partial outputs are combined by their log-sums
(`triton_merge`), either by the last split program of each (request, kv head) to finish
(fused) or by a merge kernel. What a launch takes (splits, warps, configs) is chosen in
`decode_policy`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import pdl
from engine.backends import decode_policy
from engine.backends.decode_policy import num_sms
from engine.backends.triton_extend import online_softmax_step
from engine.backends.triton_merge import (
    check_counters,
    last_to_arrive,
    merge_counters,
    merge_rows,
    merge_splits,
    merge_tiles,
)
from engine.pdl import enter, leave


@triton.jit
def _kv_block(k_cache, v_cache, slots, key_ok, head_base, stride_ct, MASKED: tl.constexpr):
    """The K and V rows of the keys at `slots` ([keys, head_dim] each); MASKED: only where
    `key_ok` (zeros elsewhere)."""
    kv_offs = slots.to(tl.int64)[:, None] * stride_ct + head_base
    if MASKED:
        k_block = tl.load(k_cache + kv_offs, mask=key_ok[:, None], other=0.0)
        v_block = tl.load(v_cache + kv_offs, mask=key_ok[:, None], other=0.0)
    else:
        k_block = tl.load(k_cache + kv_offs)
        v_block = tl.load(v_cache + kv_offs)
    return k_block, v_block


@triton.jit
def _attend_keys(
    q_block,
    k_cache,
    v_cache,
    kv_indices,
    kv_start,
    start,
    hi,
    head_base,
    stride_ct,
    sm_scale_log2,
    bits,
    prefix,
    m_i,
    l_i,
    acc,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    TREE: tl.constexpr,
):
    """One block of keys [start, start + BLOCK_N): gather K/V by slot, online softmax.
    MASKED: the block may pass `hi` or (TREE) reach the draft tree's keys."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < hi
    if MASKED:
        slots = tl.load(kv_indices + kv_start + keys, mask=key_ok, other=0)
    else:
        slots = tl.load(kv_indices + kv_start + keys)
    k_block, v_block = _kv_block(k_cache, v_cache, slots, key_ok, head_base, stride_ct, MASKED)
    visible = key_ok[None, :]  # read only when MASKED
    if MASKED and TREE:
        node = keys - prefix
        in_tree = node >= 0
        shift = tl.where(in_tree, node, 0).to(tl.int64)
        ancestor = ((bits[:, None] >> shift[None, :]) & 1) != 0
        visible = visible & (ancestor | (~in_tree)[None, :])
    return online_softmax_step(
        q_block, k_block, v_block, visible, m_i, l_i, acc, sm_scale_log2, MASKED
    )


@triton.jit
def _decode_split_kernel(
    q,
    k_cache,
    v_cache,
    kv_indices,
    kv_indptr,
    qo_indptr,
    prefix_lens,
    tree_bits,
    partial,
    lse,
    out,
    counters,
    sm_scale_log2,
    num_splits,
    num_tokens,
    out_capacity,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_ch,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    MAX_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TREE: tl.constexpr,
    DIRECT: tl.constexpr,
    FUSED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    enter(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_start = tl.load(kv_indptr + req)
    seq_len = tl.load(kv_indptr + req + 1) - kv_start
    qo_start = tl.load(qo_indptr + req)
    num_q = tl.load(qo_indptr + req + 1) - qo_start

    rows = tl.arange(0, BLOCK_M)
    q_local = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    token = qo_start + q_local
    row_ok = (q_local < num_q) & (q_local < MAX_Q)
    dims = tl.arange(0, HEAD_DIM)
    tok64 = token.to(tl.int64)[:, None]
    q_block = tl.load(
        q + tok64 * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if TREE:  # keys below the prefix are visible to every tree node; the rest by ancestry
        prefix = tl.load(prefix_lens + req)
        bits = tl.load(tree_bits + token, mask=row_ok, other=0)
    else:
        prefix = seq_len
        bits = row_ok.to(tl.int64)

    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    full_end = lo + tl.maximum(tl.minimum(hi, prefix) - lo, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    head_base = kv_head * stride_ch + dims[None, :]
    if PREFETCH:  # a block's K/V loads go out before the products of the block before it,
        # its slots a block earlier still: no load waits on another inside the loop
        keys = lo + tl.arange(0, BLOCK_N)
        slots = tl.load(kv_indices + kv_start + keys, mask=keys < full_end, other=0)
        k_next, v_next = _kv_block(
            k_cache, v_cache, slots, keys < full_end, head_base, stride_ct, True
        )
        keys = keys + BLOCK_N
        slots = tl.load(kv_indices + kv_start + keys, mask=keys < full_end, other=0)
        for start in range(lo, full_end, BLOCK_N):
            k_block, v_block = k_next, v_next
            ahead = start + BLOCK_N + tl.arange(0, BLOCK_N) < full_end
            k_next, v_next = _kv_block(k_cache, v_cache, slots, ahead, head_base, stride_ct, True)
            keys = start + 2 * BLOCK_N + tl.arange(0, BLOCK_N)
            slots = tl.load(kv_indices + kv_start + keys, mask=keys < full_end, other=0)
            m_i, l_i, acc = online_softmax_step(
                q_block, k_block, v_block, ahead[None, :], m_i, l_i, acc, sm_scale_log2, False
            )
    else:
        for start in range(lo, full_end, BLOCK_N):  # whole blocks every query sees: no masks
            m_i, l_i, acc = _attend_keys(
                q_block,
                k_cache,
                v_cache,
                kv_indices,
                kv_start,
                start,
                hi,
                head_base,
                stride_ct,
                sm_scale_log2,
                bits,
                prefix,
                m_i,
                l_i,
                acc,
                BLOCK_N,
                False,
                TREE,
            )
    for start in range(full_end, hi, BLOCK_N):  # the ragged end and the tree's keys
        m_i, l_i, acc = _attend_keys(
            q_block,
            k_cache,
            v_cache,
            kv_indices,
            kv_start,
            start,
            hi,
            head_base,
            stride_ct,
            sm_scale_log2,
            bits,
            prefix,
            m_i,
            l_i,
            acc,
            BLOCK_N,
            True,
            TREE,
        )

    leave(PDL)
    has_keys = l_i > 0.0
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if DIRECT:  # one split: the result is the output
        out_ptrs = out + tok64 * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptrs,
            result.to(out.dtype.element_ty),
            mask=(row_ok & (token < out_capacity))[:, None],
        )
    else:
        part_ok = row_ok & (token < num_tokens)
        part_ptrs = partial + tok64 * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(part_ptrs + dims[None, :], result, mask=part_ok[:, None])
        log_sum = tl.where(
            has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf")
        )
        tl.store(lse + token * stride_lt + head * stride_lh + split, log_sum, mask=part_ok)
        if FUSED:  # the last split of (request, kv head) to finish merges its splits
            counter = counters + req * tl.num_programs(1) + kv_head
            if last_to_arrive(counter, num_splits):
                merge_rows(
                    partial,
                    lse,
                    out,
                    qo_start,
                    tl.minimum(num_q, MAX_Q) * GROUP,
                    kv_head,
                    num_splits,
                    num_tokens,
                    out_capacity,
                    stride_pt,
                    stride_ph,
                    stride_ps,
                    stride_lt,
                    stride_lh,
                    stride_ot,
                    stride_oh,
                    GROUP,
                    ROW_BLOCK,
                    SPLIT_CHUNK,
                    HEAD_DIM,
                )
                tl.store(counter, 0)  # zero at rest, for the next launch or graph replay
    # tokens no request owns (graph padding): zeros, written to out by one split where no
    # merge kernel follows, else as empty partials in every split for the merge to turn to 0
    if (req == tl.num_programs(0) - 1) & ((split == 0) | (not (DIRECT or FUSED))):
        _zero_padding(
            partial,
            lse,
            out,
            qo_start + num_q,
            num_tokens,
            out_capacity,
            split,
            q_local,
            head,
            rows < (BLOCK_M // GROUP) * GROUP,
            stride_pt,
            stride_ph,
            stride_ps,
            stride_lt,
            stride_lh,
            stride_ot,
            stride_oh,
            BLOCK_M // GROUP,
            BLOCK_M,
            HEAD_DIM,
            DIRECT or FUSED,
        )


@triton.jit
def _zero_padding(
    partial,
    lse,
    out,
    first_pad,
    num_tokens,
    out_capacity,
    split,
    q_local,
    head,
    in_step,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    TOKENS_PER_STEP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Zero outputs for the padding tokens (split-KV: empty partials the merge turns to 0)."""
    dims = tl.arange(0, HEAD_DIM)
    for first in range(first_pad, num_tokens, TOKENS_PER_STEP):
        pad = first + q_local
        pad_ok = in_step & (pad < num_tokens)
        pad64 = pad.to(tl.int64)[:, None]
        if DIRECT:
            out_ptrs = out + pad64 * stride_ot + head[:, None] * stride_oh + dims[None, :]
            tl.store(
                out_ptrs,
                tl.zeros([BLOCK_M, HEAD_DIM], out.dtype.element_ty),
                mask=(pad_ok & (pad < out_capacity))[:, None],
            )
        else:
            part_ptrs = partial + pad64 * stride_pt + head[:, None] * stride_ph
            tl.store(
                part_ptrs + split * stride_ps + dims[None, :],
                tl.zeros([BLOCK_M, HEAD_DIM], tl.float32),
                mask=pad_ok[:, None],
            )
            tl.store(
                lse + pad * stride_lt + head * stride_lh + split,
                tl.full([BLOCK_M], float("-inf"), tl.float32),
                mask=pad_ok,
            )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_bits: torch.Tensor | None,
    out: torch.Tensor,
    num_splits: int,
    max_q: int,
    sm_scale: float,
    config: dict | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode (tree_bits None: every key below seq_len visible) or verify (tree mask) into out.

    Grid: (requests, kv heads, num_splits), then (tokens, q heads) for the merge unless it is
    fused (config FUSED_MERGE; by default decode up to FUSED_MERGE_MAX_SPLITS splits, verify
    never): no host value beyond the tensor shapes, num_splits and max_q, so a fixed plan
    replays under a CUDA graph. `counters` (contiguous int32, `counters_needed` of them,
    zero at rest: see `merge_counters`; checked when the merge is fused) serve the
    fused merge; without them a zeroed buffer is made for this call. Tokens past
    qo_indptr[-1] (padding no request owns) get zero outputs."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_requests = kv_indptr.shape[0] - 1
    programs = num_requests * num_kv_heads * num_splits  # the split kernel's grid
    on_cpu = q.device.type == "cpu"
    cfg = decode_policy.decode_launch(
        on_cpu,
        tree_bits is not None,
        programs,
        num_sms(q.device),
        num_tokens,
        num_splits,
        config,
    )
    if num_tokens == 0 or num_requests == 0:
        return out
    direct = num_splits == 1
    fused = bool(cfg["FUSED_MERGE"]) and not direct
    if fused and counters is not None:
        check_counters(counters, num_requests, num_kv_heads)
    part_strides: tuple[int, ...]
    lse_strides: tuple[int, ...]
    if direct:
        partial, lse = out, out  # unused: one split writes the output itself
        part_strides, lse_strides = (0, 0, 0), (0, 0)
    else:
        partial = torch.empty(
            (num_tokens, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty(
            (num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
        part_strides, lse_strides = partial.stride()[:3], lse.stride()[:2]
    if not fused:
        counters = kv_indptr  # unused
    elif counters is None:
        counters = merge_counters(num_requests, num_kv_heads, q.device)
    group = num_q_heads // num_kv_heads
    block_s = triton.next_power_of_2(num_splits)
    row_block, split_chunk = (1, 1)  # unused unless fused
    if fused:
        row_block, split_chunk = merge_tiles(
            block_s,
            max_q * group,
            head_dim,
            cfg["num_warps"],
            cfg.get("MERGE_TILE"),
        )
    _decode_split_kernel[(num_requests, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        kv_indices,
        kv_indptr,
        qo_indptr,
        prefix_lens,
        tree_bits if tree_bits is not None else kv_indptr,
        partial,
        lse,
        out,
        counters,
        sm_scale * 1.4426950408889634,
        num_splits,
        num_tokens,
        out.shape[0],
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        *part_strides,
        *lse_strides,
        out.stride(0),
        out.stride(1),
        GROUP=group,
        MAX_Q=max_q,
        BLOCK_M=max(16, triton.next_power_of_2(max_q * group)),
        BLOCK_N=cfg["BLOCK_N"],
        HEAD_DIM=head_dim,
        TREE=tree_bits is not None,
        DIRECT=direct,
        FUSED=fused,
        ROW_BLOCK=row_block,
        SPLIT_CHUNK=split_chunk,
        PREFETCH=bool(cfg.get("PREFETCH", False)),
        **pdl.launch(q.device, "attention"),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if not direct and not fused and not cfg.get("SKIP_MERGE", False):  # skip: diagnostics
        merge_splits(partial, lse, out, num_splits)
    return out
