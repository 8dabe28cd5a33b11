"""The launches of the Triton matrix-vector kernels (`engine.ops.gemv_kernels`) and the
products the op set runs through them: the linear layers of batch-1 decode, and fp32 passes
of a few rows (a small model's verify pass). Each product's arguments are checked here, and
`linear` and the fused products take the kernels where the launch policy
(`engine.ops.gemv_policy`: which products, which launch) gives them a launch.

At batch 1 a decode step's projections are matrix-vector products: all the time is spent
streaming the weight matrix once. cuBLAS picks split-K GEMM tiles for the narrower of them
(qkv and o_proj at Llama-3-8B's shape ran at 3.2 and 2.7 TB/s on an H200, plus a split-K
reduce launch), against ~4.2 TB/s for a copy. The one-row kernel streams whole weight rows
once: one launch, no reduction pass, fp32 accumulation.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from engine import pdl
from engine.ops import gemv_policy
from engine.ops.gemv_kernels import NORM, PLAIN, SILU, gemv_kernel, gemv_rows_kernel

# With PDL (`engine.pdl`) a launch prefetches the first columns of its weight rows into
# L2 while the kernel before it runs, at most PREFETCH_BYTES of them (ENGINE_PREFETCH_BYTES
# sets it for a process; 0: none).
PREFETCH_BYTES = int(os.environ.get("ENGINE_PREFETCH_BYTES", 16 * 2**20))


def _check(x: torch.Tensor, weight: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(
            f"{what} needs x [M, K] and weight [N, K] with K = {k}; got x {tuple(x.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= gemv_policy.MAX_ROWS:
        raise ValueError(
            f"{what} serves 1 to {gemv_policy.MAX_ROWS} rows; got {x.shape[0]} (use F.linear)"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"{what} needs unit stride along K; got x strides {x.stride()}, "
            f"weight strides {weight.stride()}"
        )


def _pdl_params(weight: torch.Tensor) -> dict:
    """The launch's PDL arguments (`pdl.launch`) and, with PDL, its weight prefetch."""
    launch = pdl.launch(weight.device, "products")
    if not launch["PDL"]:
        return {**launch, **_NO_PREFETCH}
    return {**launch, **_prefetch(tuple(weight.shape), weight.element_size())}


_NO_PREFETCH = {"PREFETCH_K": 0, "LINE": 1}


@functools.lru_cache(maxsize=256)
def _prefetch(shape: tuple[int, int], element_size: int) -> dict:
    """The prefetch arguments for a weight of `shape`: the first PREFETCH_K columns of each
    row prefetched before the wait (a power of two, at most PREFETCH_BYTES in all)."""
    (n, k), line = shape, pdl.LINE_BYTES // element_size
    budget = max(PREFETCH_BYTES // (n * element_size), 1)
    cols = min(triton.next_power_of_2(k), 1 << budget.bit_length() - 1)
    return {"PREFETCH_K": cols if cols >= line else 0, "LINE": line}


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    config: dict | None,
    prologue: int = PLAIN,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x' @ weight^T, the residual stream written by the NORM prologue or None)."""
    rows, n = x.shape[0], weight.shape[0]
    params = dict(gemv_policy.GEMV_CONFIG, **(config or {}))
    if params.pop("all_rows", False):
        if prologue == SILU:
            raise ValueError(
                "the all-rows kernel (config all_rows) takes no SiLU*mul before its "
                "products; that prologue runs in the row-at-a-time kernel (config None)"
            )
        return _launch_rows(x, weight, params, silu_mul=False, norm=norm)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, params["BLOCK_N"]),)
    residual_out, pointers, eps, norm_strides = _norm_args(x, norm)
    gemv_kernel[grid](
        x,
        weight,
        out,
        *pointers,
        rows,
        n,
        k,
        eps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *norm_strides,
        BLOCK_M=triton.next_power_of_2(rows),
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual_out is not None,
        **params,
        **_pdl_params(weight),
    )
    return out, residual_out


def _norm_args(
    x: torch.Tensor, norm: tuple[torch.Tensor | None, torch.Tensor, float] | None
) -> tuple[torch.Tensor | None, tuple, float, tuple[int, int]]:
    """What a launch passes for `norm` (residual or None, norm weight, eps; None: a launch
    without the NORM prologue): (the residual stream's new tensor, None without a residual;
    the residual, norm weight and stream pointers, x for those the kernel never reads; eps;
    the residual's and the stream's row strides)."""
    residual, norm_w, eps = norm if norm is not None else (None, x, 0.0)
    residual_out = torch.empty_like(x) if residual is not None else None
    pointers = (
        x if residual is None else residual,
        norm_w,
        x if residual_out is None else residual_out,
    )
    strides = (
        0 if residual is None else residual.stride(0),
        0 if residual_out is None else residual_out.stride(0),
    )
    return residual_out, pointers, eps, strides


def _launch_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    params: dict,
    silu_mul: bool,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the all-rows kernel's output: x' @ weight^T [rows, N], or (silu_mul) SiLU*mul of the
    products with weight's first half of rows and its second [rows, N / 2]; the residual
    stream the NORM prologue wrote, or None). x' is x, or with `norm` (residual or None,
    norm weight, eps) RMSNorm(x + residual)."""
    (rows, k), n = x.shape, weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    residual_out, pointers, eps, norm_strides = _norm_args(x, norm)
    gemv_rows_kernel[(triton.cdiv(n, params["BLOCK_N"]),)](
        x,
        weight,
        out,
        *pointers,
        rows,
        n,
        k,
        eps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        *norm_strides,
        BLOCK_M=triton.next_power_of_2(rows),
        WITH_NORM=norm is not None,
        HAS_RESIDUAL=residual_out is not None,
        SILU_MUL=silu_mul,
        **params,
        **_pdl_params(weight),
    )
    return out, residual_out


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype, for 1 <= M <= MAX_ROWS
    (`gemv_policy`; as F.linear without bias). `config` overrides the launch parameters
    (benchmarks)."""
    k = x.shape[-1]
    _check(x, weight, k, "gemv")
    return _launch(x, weight, k, config)[0]


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight^T, x + residual) in one launch (residual None:
    RMSNorm(x), and x is the stream), in either kernel (`config` all_rows: the all-rows
    kernel). The stream is rounded as the RMSNorm op rounds it; the product scales x's row
    by 1 / RMS after the sum, not before, so it differs from the op and `gemv` in rounding
    only."""
    k = x.shape[-1]
    _check(x, weight, k, "norm_gemv")
    _check_norm(x, residual, norm_weight, k, "norm_gemv")
    out, residual_out = _launch(x, weight, k, config, NORM, (residual, norm_weight, eps))
    return out, x if residual_out is None else residual_out


def _check_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, k: int, what: str
) -> None:
    if norm_weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"{what} needs norm_weight [{k}] and a residual shaped as x {tuple(x.shape)}; "
            f"got {tuple(norm_weight.shape)} and "
            f"{None if residual is None else tuple(residual.shape)}"
        )
    if residual is not None and residual.stride(1) != 1:
        raise ValueError(f"{what} needs a unit-stride residual; got {residual.stride()}")


def silu_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, config: dict | None = None
) -> torch.Tensor:
    """(SiLU(gate) * up) @ weight^T from gate_up [M, 2 * inter] (gate first) in one launch,
    as the SiLU*mul op then `gemv` round and compute it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_gemv needs gate_up [M, 2 * inter]; got {tuple(gate_up.shape)}")
    inter = gate_up.shape[1] // 2
    _check(gate_up, weight, inter, "silu_gemv")
    return _launch(gate_up, weight, inter, config, SILU)[0]


def gemv_silu(x: torch.Tensor, weight: torch.Tensor, config: dict) -> torch.Tensor:
    """SiLU(x @ gate^T) * (x @ up^T) [M, inter] from weight = [gate; up] [2 * inter, K] in
    one launch of the all-rows kernel (`config`: an all_rows launch, e.g.
    `gemv_policy.rows_config` for inter columns), as the product then the SiLU*mul op round
    and compute it: the gate_up product never reaches memory and no SiLU*mul launch
    follows."""
    return _launch_silu_rows(x, weight, config, None, "gemv_silu")[0]


def norm_gemv_silu(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: dict,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`gemv_silu` of RMSNorm(x + residual), x + residual) in one launch of the all-rows
    kernel: the norm as `norm_gemv` computes it (1 / RMS after the sums), then SiLU*mul after
    the products, so a float32 verify pass's MLP is two launches, this and the down product."""
    _check_norm(x, residual, norm_weight, x.shape[-1], "norm_gemv_silu")
    out, residual_out = _launch_silu_rows(
        x, weight, config, (residual, norm_weight, eps), "norm_gemv_silu"
    )
    return out, x if residual_out is None else residual_out


def _launch_silu_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: dict,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"{what} needs weight [2 * inter, K]; got {tuple(weight.shape)}")
    _check(x, weight, x.shape[-1], what)
    params = dict(gemv_policy.GEMV_CONFIG, **config)
    if not params.pop("all_rows", False):
        raise ValueError(
            f"{what} runs in the all-rows kernel: its config needs all_rows; got {config}"
        )
    return _launch_rows(x, weight, params, silu_mul=True, norm=norm)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """`gemv_policy.linear_config` for x against weight where the kernel can take them (CUDA,
    unit stride along K), else None."""
    if (
        x.is_cuda
        and x.dim() == 2
        and isinstance(weight, torch.Tensor)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    ):
        return gemv_policy.linear_config(
            x.shape[0], x.dtype, tuple(weight.shape), _num_sms(x.device)
        )
    return None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), with the matrix-vector kernel where it is the faster (on CUDA:
    `gemv_policy.linear_config`)."""
    config = _kernel_config(x, weight)
    if config is not None:
        return gemv(x, weight, config)
    return torch.nn.functional.linear(x, weight)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`norm_gemv` where the kernel is the faster for the product (`linear_config`): one
    row, or float32 rows in the all-rows kernel; None elsewhere (the caller runs the norm
    and `linear`)."""
    config = _kernel_config(x, weight)
    if config is None or (residual is not None and residual.stride(-1) != 1):
        return None
    if config.get("all_rows"):
        return norm_gemv(x, residual, norm_weight, eps, weight, config)
    if x.shape[0] != gemv_policy.FUSED_ROWS:
        return None
    launch = gemv_policy.norm_config(config, (weight.shape[0], weight.shape[1]), _num_sms(x.device))
    return norm_gemv(x, residual, norm_weight, eps, weight, launch)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`silu_gemv` for one row where the kernel is the faster for the product
    (`linear_config`); None elsewhere (the caller runs SiLU*mul and `linear`)."""
    config = _kernel_config(gate_up, weight)
    if config is None or gate_up.shape[0] != gemv_policy.FUSED_ROWS:
        return None
    return silu_gemv(gate_up, weight, config)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`gemv_silu` (SiLU*mul of x's product with weight = [gate; up]) where the all-rows
    kernel is the faster for the product (`linear_config`: float32, 2 to MAX_ROWS rows);
    None elsewhere (the caller runs `linear` and SiLU*mul)."""
    config = _kernel_config(x, weight)
    if config is None or not config.get("all_rows") or weight.shape[0] % 2:
        return None
    return gemv_silu(
        x, weight, gemv_policy.rows_config(weight.shape[0] // 2, _num_sms(x.device), silu_mul=True)
    )


def norm_linear_silu_mul(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`norm_gemv_silu` (the norm before the gate_up product and SiLU*mul after it) where
    the all-rows kernel is the faster for the product (`linear_config`: float32, 2 to
    MAX_ROWS rows); None elsewhere (the caller fuses what else applies)."""
    config = _kernel_config(x, weight)
    if (
        config is None
        or not config.get("all_rows")
        or weight.shape[0] % 2
        or (residual is not None and residual.stride(-1) != 1)
    ):
        return None
    launch = gemv_policy.rows_config(weight.shape[0] // 2, _num_sms(x.device), silu_mul=True)
    return norm_gemv_silu(x, residual, norm_weight, eps, weight, launch)
