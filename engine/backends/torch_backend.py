"""The reference backend: gathers KV by index and runs plain attention per request.

Plain and obviously correct; the oracle for the Triton backend and the CPU engine's backend.
On an AVX-512 CPU in fp32, decode and verify passes (a few new tokens per request) instead
run `engine/csrc/attention.cpp`, which reads K/V where they lie in the pool (no gather);
`attend_padded` stays the path for prefill and everything else, and the oracle in tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.backends.base import AttentionBackend, ForwardMetadata, host_metadata, register
from engine.state import Batch, Mode


def build_kv_indices(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    qo_indptr: torch.Tensor,
    out_slots: torch.Tensor,
    total: int,
) -> torch.Tensor:
    """Per request: its table row up to its prefix, then its new tokens' slots."""
    device = req_to_token.device
    batch_size = rows.shape[0]
    seq_lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
    owner = torch.repeat_interleave(
        torch.arange(batch_size, device=device), seq_lens, output_size=total
    )
    offset = torch.arange(total, device=device) - kv_indptr[:-1].long()[owner]
    prefix = prefix_lens.long()[owner]
    from_table = offset < prefix
    col = torch.clamp(offset, max=req_to_token.shape[1] - 1)
    table_slots = req_to_token[rows.long()[owner], col].long()
    new_index = torch.clamp(
        qo_indptr[:-1].long()[owner] + offset - prefix, min=0, max=max(out_slots.shape[0] - 1, 0)
    )
    new_slots = out_slots.long()[new_index] if out_slots.numel() else table_slots
    return torch.where(from_table, table_slots, new_slots).to(torch.int32)


def build_kv_indices_host(table: np.ndarray, batch: Batch) -> np.ndarray:
    """`build_kv_indices` on the host from numpy (the CPU's request table is a numpy view):
    a slice per request instead of ~15 tensor ops, ~0.5 ms a pass at batch 8."""
    parts = []
    for row, prefix, start, new in zip(
        batch.running.rows.tolist(),
        batch.prefix_lens.lens.tolist(),
        batch.new_lens.starts().tolist(),
        batch.new_lens.lens.tolist(),
        strict=True,
    ):
        parts += [table[row, :prefix], batch.out_slots[start : start + new]]
    if not parts:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(parts).astype(np.int32)


@register("torch")
class TorchBackend(AttentionBackend):
    # decode/verify through the CPU kernel when it applies (tests turn it off to compare)
    use_cpu_kernel = True

    def _kernel_applies(self, mode: Mode) -> bool:
        cache = self.pool.k_cache[0]
        return (
            self.use_cpu_kernel
            and mode in (Mode.DECODE, Mode.VERIFY)
            and cpu_kernels.usable(cache.device, cache.dtype)
        )

    def plan(self, batch: Batch) -> ForwardMetadata:
        device = self.pool.req_to_token.device
        on_device = device.type != "cpu"
        extra = {"rows": batch.running.rows.astype(np.int64)} if on_device else None
        meta, more = host_metadata(batch, device, extra)
        if not on_device:
            kv_indices = torch.from_numpy(
                build_kv_indices_host(self.pool.req_to_token.numpy(), batch)
            )
        else:
            rows = more["rows"]
            kv_indices = build_kv_indices(
                self.pool.req_to_token,
                rows,
                meta["prefix_lens"],
                meta["kv_indptr"],
                meta["qo_indptr"],
                meta["out_slots"],
                batch.seq_lens.total,
            )
        metadata = ForwardMetadata(kv_indices=kv_indices, **meta)
        if self._kernel_applies(batch.mode):
            # the plan's own index tensors, checked once for every layer of the pass
            metadata.extra["cpu_kernel"] = _kernel_indices(metadata)
        elif batch.new_lens.total:
            metadata.extra["padded"] = padded_layouts(metadata)
        return metadata

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: ForwardMetadata,
        scale: float | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_cache[layer], self.pool.v_cache[layer]
        if not kv_stored:
            k_cache[metadata.out_slots] = k.to(k_cache.dtype)
            v_cache[metadata.out_slots] = v.to(v_cache.dtype)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        if metadata.extra.get("cpu_kernel") and q.dtype == torch.float32:
            return attend_paged_cpu(q, k_cache, v_cache, metadata, scale)
        return attend_padded(q, k_cache, v_cache, metadata, scale)

    def cpu_kernel_attention(self, layer: int, metadata: ForwardMetadata) -> tuple | None:
        indices = metadata.extra.get("cpu_kernel")
        if indices is None:
            return None
        return self.pool.k_cache[layer], self.pool.v_cache[layer], *indices

    def forward_per_request(
        self, layer: int, q: torch.Tensor, metadata: ForwardMetadata, scale: float
    ) -> torch.Tensor:
        """The same attention one request at a time (the oracle for `attend_padded`);
        K/V of the new tokens must already be in the pool."""
        k_cache, v_cache = self.pool.k_cache[layer], self.pool.v_cache[layer]
        out = torch.empty_like(q)
        qo, kv = metadata.qo_indptr.tolist(), metadata.kv_indptr.tolist()
        for i, prefix in enumerate(metadata.prefix_lens.tolist()):
            q0, q1 = qo[i], qo[i + 1]
            if q1 == q0:
                continue
            slots = metadata.kv_indices[kv[i] : kv[i + 1]].long()
            mask = _mask(metadata, q0, q1, prefix, slots.shape[0], q.device)
            out[q0:q1] = attend(q[q0:q1], k_cache[slots], v_cache[slots], mask, scale)
        return out


def _padded_index(
    starts: torch.Tensor, lens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, width] flat positions of each request's entries (0 where padded) and validity."""
    offsets = torch.arange(width, device=starts.device)
    valid = offsets[None, :] < lens[:, None]
    return torch.where(valid, starts[:, None] + offsets[None, :], 0), valid


def padded_layouts(metadata: ForwardMetadata) -> list[dict[str, Any]]:
    """The padded layouts of a pass (`padded_layout`): one, or in an extend pass that mixes
    one-token requests (decodes) with prefill chunks, one for each kind, so that a decode is
    not padded to the chunk's length."""
    new_lens = (metadata.qo_indptr[1:] - metadata.qo_indptr[:-1]).long()
    if metadata.mode != Mode.EXTEND:
        return [padded_layout(metadata)]
    single = new_lens == 1
    if bool(single.all()) or not bool(single.any()):
        return [padded_layout(metadata)]
    return [
        padded_layout(metadata, single.nonzero().squeeze(1)),
        padded_layout(metadata, (~single).nonzero().squeeze(1)),
    ]


def padded_layout(
    metadata: ForwardMetadata, requests: torch.Tensor | None = None
) -> dict[str, Any]:
    """What every layer's padded attention shares, computed once per pass: each request's
    key slots [B, L], its query rows [B, Q], the flat rows of the real queries (`rows`, in
    the order [B, Q] reads them; all of them in order when `requests` is None), and the
    visibility mask [B, 1, Q, L] (the same rules as `_mask`; padding keys and queries see
    nothing). `requests`: only these requests (indices)."""
    qo, kv = metadata.qo_indptr.long(), metadata.kv_indptr.long()
    q_starts, q_lens = qo[:-1], qo[1:] - qo[:-1]
    k_starts, k_lens = kv[:-1], kv[1:] - kv[:-1]
    prefix = metadata.prefix_lens.long()
    q_width, k_width = metadata.max_new_len, metadata.max_seq_len
    if requests is not None:
        q_starts, q_lens, k_starts, k_lens, prefix = (
            t[requests] for t in (q_starts, q_lens, k_starts, k_lens, prefix)
        )
        q_width, k_width = int(q_lens.max()), int(k_lens.max())
    q_rows, q_valid = _padded_index(q_starts, q_lens, q_width)
    k_rows, k_valid = _padded_index(k_starts, k_lens, k_width)
    key_pos = torch.arange(k_rows.shape[1], device=q_rows.device)[None, None, :]
    prefix = prefix[:, None, None]
    if metadata.mode == Mode.VERIFY:
        assert metadata.tree_bits is not None  # a verify plan holds its trees' bits
        bits = metadata.tree_bits[q_rows]  # [B, Q]
        node = (key_pos - prefix).clamp(min=0)
        visible = (key_pos < prefix) | ((bits[:, :, None] >> node) & 1).bool()
    else:
        query_pos = prefix + torch.arange(q_rows.shape[1], device=q_rows.device)[None, :, None]
        visible = key_pos <= query_pos
    visible = visible & k_valid[:, None, :] & q_valid[:, :, None]
    real = q_valid.flatten().nonzero().squeeze(1)  # the real queries among [B, Q]'s rows
    return dict(
        slots=metadata.kv_indices.long()[k_rows],
        q_rows=q_rows,
        real=real,
        rows=q_rows.flatten()[real],
        visible=visible[:, None],
        whole=requests is None,
    )


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots [B, L]: [B, L, *cache.shape[1:]]."""
    return cache.index_select(0, slots.flatten()).unflatten(0, slots.shape)


def attend_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: ForwardMetadata,
    scale: float,
) -> torch.Tensor:
    """All requests at once, padded to the longest (per kind of request in a mixed pass):
    [B, Hq, Qmax, Lmax] scores in fp32 with the same masks as `_mask` (padding keys and
    queries masked out)."""
    batch_size = metadata.prefix_lens.shape[0]
    if q.shape[0] == 0 or batch_size == 0:
        return torch.zeros_like(q)
    layouts = metadata.extra.get("padded") or padded_layouts(metadata)
    if len(layouts) == 1:
        return _attend_layout(q, k_cache, v_cache, metadata, scale, layouts[0])
    out = torch.empty_like(q)
    for layout in layouts:
        out[layout["rows"]] = _attend_layout(q, k_cache, v_cache, metadata, scale, layout)
    return out


def _attend_layout(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: ForwardMetadata,
    scale: float,
    layout: dict[str, Any],
) -> torch.Tensor:
    """`attend_padded` over one layout: the outputs of its real queries, in its row order."""
    num_kv_heads = k_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    slots = layout["slots"]  # [B, L]; index_select is ~3x faster than k_cache[slots] on CPU
    keys = _gather(k_cache, slots).float().transpose(1, 2)  # [B, Hkv, L, D]
    values = _gather(v_cache, slots).float().transpose(1, 2)
    # GQA without copying K/V per q head (q heads h = kv * group + g, as repeat_interleave):
    # the G q heads of a kv head are G x Q queries of one attention over that head's keys.
    decode = metadata.mode == Mode.DECODE and layout["whole"]
    if decode:  # one query per request, in order: no gather
        queries = q.float().unsqueeze(1).unflatten(2, (num_kv_heads, group))
    else:
        queries = q.float()[layout["q_rows"]].unflatten(2, (num_kv_heads, group))
    num_q = queries.shape[1]  # queries: [B, Q, Hkv, G, D]
    queries = queries.permute(0, 2, 3, 1, 4).flatten(2, 3)  # [B, Hkv, G*Q, D]
    visible = layout["visible"]  # [B, 1, Q, L]: broadcasts over the G*Q rows when Q is 1
    if group > 1 and num_q > 1:
        key = f"visible x{group}"  # the same for every layer: made once per pass
        if key not in layout:
            layout[key] = visible.repeat(1, 1, group, 1)  # [B, 1, G*Q, L]
        visible = layout[key]
    out_padded = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=visible, scale=scale
    )
    # [B, Hkv, G, Q, D] -> [B, Q, Hq, D]; padding queries (all keys hidden) are never read
    out_padded = out_padded.unflatten(2, (group, num_q)).permute(0, 3, 1, 2, 4).flatten(2, 3)
    if decode:
        return out_padded[:, 0].to(q.dtype)
    return out_padded.flatten(0, 1).index_select(0, layout["real"]).to(q.dtype)


def attend_paged_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: ForwardMetadata,
    scale: float,
) -> torch.Tensor:
    """`attend_padded`'s result through the CPU kernel (fp32, K/V of the new tokens already
    in the pool): keys read in place, visibility from the same rules as `_mask`."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # tokens may be strided, heads not
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    batch_size = metadata.prefix_lens.shape[0]
    if q.shape[0] == 0 or batch_size == 0:
        return out.zero_()
    *indices, bits = metadata.extra["cpu_kernel"]  # checked once by the plan
    cpu_kernels.library().cpu_paged_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *(t.data_ptr() for t in indices),
        None if bits is None else bits.data_ptr(),
        batch_size,
        q.shape[0],
        q.shape[1],
        k_cache.shape[1],
        q.shape[2],
        q.stride(0),
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _kernel_indices(metadata: ForwardMetadata) -> tuple:
    """The plan's index tensors as the CPU attention kernel reads them (int32, tree bits int64,
    contiguous: what the plan makes on the CPU, checked, never copied)."""
    indices = (metadata.kv_indices, metadata.kv_indptr, metadata.qo_indptr, metadata.prefix_lens)
    bits = metadata.tree_bits if metadata.mode == Mode.VERIFY else None
    if any(t.dtype != torch.int32 or not t.is_contiguous() for t in indices) or (
        bits is not None and (bits.dtype != torch.int64 or not bits.is_contiguous())
    ):
        raise ValueError(
            "the CPU attention kernel reads contiguous int32 indices and int64 "
            "tree bits; the plan made other tensors"
        )
    return *indices, bits


def _mask(
    metadata: ForwardMetadata, q0: int, q1: int, prefix: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """[n_new, kv_len] bool: which keys each new token may see."""
    key = torch.arange(kv_len, device=device)
    if metadata.mode == Mode.VERIFY:
        assert metadata.tree_bits is not None  # a verify plan holds its trees' bits
        bits = metadata.tree_bits[q0:q1]
        node = (key - prefix).clamp(min=0)
        in_tree = ((bits[:, None] >> node[None, :]) & 1).bool()
        return torch.where(key[None, :] < prefix, True, in_tree)
    query_pos = prefix + torch.arange(q1 - q0, device=device)
    return key[None, :] <= query_pos[:, None]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D], k/v [L, Hkv, D], mask [n, L] -> [n, Hq, D], computed in fp32 (GQA)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, vf).to(q.dtype)
