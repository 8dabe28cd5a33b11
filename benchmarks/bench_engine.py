"""End-to-end throughput: engine vs HF transformers `generate`, side by side in one run.

CPU (default model, fp32):   python benchmarks/bench_engine.py --device cpu
GPU (random Llama-3-8B bf16): python benchmarks/bench_engine.py --device cuda
On the GPU it also reports the decode step time against its floor, (weight bytes + KV bytes
read per step) / the measured copy bandwidth, and the whole run's wall clock (prefill
included) against the floor of its decode steps, beside the same engine with `launch_ahead`
off; then the wall clock against the roofline floor (the decode steps' floor plus the
prefill's FLOPs at the measured bf16 matrix-product peak) and the prefill steps' rate.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from engine import pdl
from engine.backends.torch_backend import TorchBackend
from engine.shell.engine import Engine
from engine.shell.runner import ModelRunner
from engine.state import SamplingParams

TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "the moon", "trains", "gardens"]


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    size = 2 * 2**30
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    repeats = 20
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * size * repeats / (time.perf_counter() - start)


def matmul_peak(device: str, size: int = 8192) -> float:
    """FLOP/s of a large bf16 matrix product (the dense peak a prefill can reach)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    repeats = 20
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def prefill_flops(model, prompt_len: int) -> float:
    """The matrix products and causal attention of one prompt's prefill on `model` (a
    LlamaModel), its output layer for the last token only (as the engine computes it): two
    FLOPs per weight of the layers' matrices a token, from the weights themselves."""
    mc = model.config
    matrices = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    attention = 2 * 2 * mc.q_size * prompt_len * (prompt_len + 1) / 2  # QK^T and PV, causal
    return 2 * matrices * prompt_len + mc.num_layers * attention + 2 * model.lm_head.numel()


def run_engine(engine: Engine, prompts: list, batch: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # warm-up on the same shapes (kernels compiled for them), prompts reversed: no prefix
    # the timed run could reuse
    warm = [list(reversed(p)) for p in prompts[:batch]]
    engine.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step_times.clear()
    started = time.perf_counter()
    tokens = 0
    for first in range(0, len(prompts), batch):
        outputs = engine.generate(prompts[first : first + batch], params)
        tokens += sum(len(o.token_ids) for o in outputs)
    elapsed = time.perf_counter() - started
    decode = [t for mode, t in engine.step_times if mode == "decode"]
    return dict(
        tokens=tokens,
        seconds=elapsed,
        decode_step=statistics.median(decode) if decode else float("nan"),
        # the steps that prefilled (with mixed passes, some also decode)
        prefill=sum(t for mode, t in engine.step_times if mode == "extend"),
    )


def hf_generate(
    model, tokenizer_pad: int, prompts: list[list[int]], batch: int, max_tokens: int, padded: bool
) -> dict:
    device = next(model.parameters()).device
    started = time.perf_counter()
    tokens = 0
    groups = (
        [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        if padded
        else [[p] for p in prompts]
    )
    for group in groups:
        width = max(len(p) for p in group)
        ids = torch.tensor([[tokenizer_pad] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=tokenizer_pad,
        )
        tokens += (out.shape[1] - width) * len(group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return dict(tokens=tokens, seconds=time.perf_counter() - started)


def cpu_main(args: argparse.Namespace) -> list[tuple]:
    from transformers import AutoModelForCausalLM

    from engine.model.loader import default_model_path

    torch.set_num_threads(args.threads or torch.get_num_threads())
    engine = Engine(device="cpu", dtype="float32", max_running_requests=16)
    # the same engine with every weight dequantized at load and the torch ops (no CPU kernels)
    dense = Engine(device="cpu", dtype="float32", max_running_requests=16, block_weights=False)
    dense.runtime.model.op_set = "reference"  # this process's only dense-weight model
    runner = dense.runner
    assert isinstance(runner, ModelRunner)  # one rank's
    backend = runner.backend
    assert isinstance(backend, TorchBackend)  # a CPU engine's ("auto") attention backend
    backend.use_cpu_kernel = False  # its passes only: read by each plan
    tokenizer = engine.tokenizer
    assert tokenizer is not None  # the default model's (only random weights come without)
    chats = [[{"role": "user", "content": f"Write a short story about {t}."}] for t in TOPICS]
    ids = [tokenizer.apply_chat_template(c) for c in chats]
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    pad = tokenizer.eos_token_id
    assert pad is not None  # the default model has an EOS token
    rows = []
    for batch in (1, 8):
        prompts = ids[: args.num_prompts if batch == 1 else 8]
        ours = run_engine(engine, prompts, batch, args.max_tokens)
        plain = run_engine(dense, prompts, batch, args.max_tokens)
        with torch.inference_mode():
            hf_runs = [hf_generate(hf, pad, prompts, batch, args.max_tokens, padded=False)]
            if batch > 1:
                hf_runs.append(hf_generate(hf, pad, prompts, batch, args.max_tokens, True))
        best = max(hf_runs, key=lambda r: r["tokens"] / r["seconds"])
        rows.append(
            (
                batch,
                ours["tokens"] / ours["seconds"],
                best["tokens"] / best["seconds"],
                plain["tokens"] / plain["seconds"],
            )
        )
    return rows


def _gpu_engine(preset: str = "llama3_8b", **overrides) -> Engine:
    settings: dict[str, Any] = dict(
        random_weights=preset,
        device="cuda",
        dtype="bfloat16",
        max_running_requests=64,
        cuda_graph_max_batch=64,
        max_context=1024,
        kv_cache_fraction=0.3,
        chunk_size=8192,
    )
    return Engine(**(settings | overrides))


def _gpu_runs(args: argparse.Namespace, engine: Engine, hf=None) -> dict[int, dict]:
    """Per batch size (1, 16, 64): one group of `batch` prompts of `args.prompt_len` random
    tokens, `args.max_tokens` new tokens each (the same prompts for every engine)."""
    generator = torch.Generator().manual_seed(0)
    runs = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, 30000, (batch, args.prompt_len), generator=generator).tolist()
        runs[batch] = run_engine(engine, prompts, batch, args.max_tokens)
        if hf is not None:
            with torch.inference_mode():
                run = hf_generate(hf, 0, prompts, batch, args.max_tokens, padded=True)
            runs[batch]["hf_rate"] = run["tokens"] / run["seconds"]
    return runs


def gpu_main(args: argparse.Namespace) -> list[tuple]:
    """The engine as configured by default beside the same engine with `launch_ahead` off
    (the A/B of launching each decode pass before the last one's tokens are read), or with
    `--baseline pdl-off`, with programmatic dependent launch off (`engine.pdl`; `--pdl`:
    the mode of the engine measured). The floor of a decode step: its weight and KV bytes
    over the copy bandwidth; end to end: the floor of every decode step over the wall clock
    of the whole group, prefill included; and the roofline floor: that plus the prefill's
    products at the measured dense peak."""
    bandwidth = copy_bandwidth("cuda")
    peak = matmul_peak("cuda")
    if args.baseline == "pdl-off":
        baseline_mode, baseline = "off", {}
    else:
        baseline_mode, baseline = args.pdl, {"launch_ahead": False}
    with pdl.using(baseline_mode):
        engine = _gpu_engine(args.preset, **baseline)
        without = _gpu_runs(args, engine)
    del engine
    torch.cuda.empty_cache()
    with pdl.using(args.pdl):
        return _gpu_rows(args, _gpu_engine(args.preset), without, bandwidth, peak)


def _gpu_rows(
    args: argparse.Namespace, engine: Engine, without: dict, bandwidth: float, peak: float
) -> list[tuple]:
    """The rows of `gpu_main`'s tables: `engine`'s runs against the baseline's, `without`."""
    mc = engine.runtime.model_config
    weight_bytes = engine.runtime.model.num_bytes()
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    hf = _hf_twin(mc) if not args.no_hf else None
    rows = []
    for batch, ours in _gpu_runs(args, engine, hf).items():
        off = without[batch]
        mean_context = args.prompt_len + args.max_tokens / 2
        floor = (weight_bytes + batch * mean_context * kv_per_token) / bandwidth
        prefill = batch * prefill_flops(engine.runtime.model, args.prompt_len)
        roofline = floor * args.max_tokens + prefill / peak
        rows.append(
            (
                batch,
                ours["tokens"] / ours["seconds"],
                ours.get("hf_rate", float("nan")),
                ours["decode_step"] * 1e3,
                floor * 1e3,
                floor / ours["decode_step"],
                floor * args.max_tokens / ours["seconds"],
                off["decode_step"] * 1e3,
                floor / off["decode_step"],
                floor * args.max_tokens / off["seconds"],
                bandwidth / 1e9,
                roofline / ours["seconds"],
                ours["prefill"] * 1e3,
                prefill / ours["prefill"] / 1e12,
                peak / 1e12,
            )
        )
    return rows


def _hf_twin(mc) -> torch.nn.Module:
    """The HF model of the same family and shape (its own config class, from the engine's
    config: `families.to_hf`), random bf16 weights, on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.model.families import to_hf

    config = AutoConfig.for_model(**(to_hf(mc) | {"max_position_embeddings": 8192}))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument(
        "--preset",
        default="llama3_8b",
        help="GPU: random weights of this shape (llama3_8b, qwen3_8b, qwen2_7b)",
    )
    parser.add_argument("--num-prompts", type=int, default=4, help="CPU batch-1 prompts")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--batches", default="1,16,64", help="GPU batch sizes, comma-separated")
    parser.add_argument(
        "--baseline",
        choices=["launch-ahead-off", "pdl-off"],
        default="launch-ahead-off",
        help="GPU: the engine beside the measured one: launch_ahead off, or PDL off",
    )
    parser.add_argument(
        "--pdl",
        choices=sorted(pdl.SETTINGS),
        default="auto",
        help="GPU: the programmatic dependent launch setting of the engine measured",
    )
    args = parser.parse_args()
    if args.device == "cpu":
        args.max_tokens = args.max_tokens or 64
        rows = cpu_main(args)
        print(f"\nCPU, default model fp32, {args.max_tokens} new tokens per prompt")
        print(
            "| batch | engine tok/s | HF generate tok/s | ratio | engine, no CPU kernels "
            "tok/s | its ratio |"
        )
        print("|---|---|---|---|---|---|")
        for batch, ours, hf, plain in rows:
            print(
                f"| {batch} | {ours:.1f} | {hf:.1f} | {ours / hf:.2f}x | {plain:.1f} | "
                f"{plain / hf:.2f}x |"
            )
    else:
        args.max_tokens = args.max_tokens or 256
        rows = gpu_main(args)
        print(
            f"\n{torch.cuda.get_device_name()}, random {args.preset} bf16, "
            f"{args.prompt_len}-token prompts, "
            f"{args.max_tokens} new tokens"
        )
        print(
            "| batch | engine tok/s | HF tok/s | ratio | decode step ms | floor ms | "
            f"floor/step | floor/wall | {args.baseline}: step ms | floor/step | floor/wall "
            "| copy GB/s |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for batch, ours, hf, step, floor, frac, wall, off, off_frac, off_wall, bw, *_ in rows:
            print(
                f"| {batch} | {ours:.0f} | {hf:.0f} | {ours / hf:.1f}x | {step:.2f} | "
                f"{floor:.2f} | {frac:.2f} | {wall:.2f} | {off:.2f} | {off_frac:.2f} | "
                f"{off_wall:.2f} | {bw:.0f} |"
            )
        print(
            "\nWith the prefill's floor: its products at the measured bf16 matrix-product "
            "peak (roofline floor = decode steps' floor + prefill FLOPs / peak)."
        )
        print(
            "| batch | roofline floor/wall | prefill steps ms | prefill TFLOP/s | "
            "matmul peak TFLOP/s |"
        )
        print("|---|---|---|---|---|")
        for batch, *_, roofline_wall, prefill_ms, prefill_rate, peak in rows:
            print(
                f"| {batch} | {roofline_wall:.2f} | {prefill_ms:.1f} | {prefill_rate:.0f} | "
                f"{peak:.0f} |"
            )


if __name__ == "__main__":
    main()
