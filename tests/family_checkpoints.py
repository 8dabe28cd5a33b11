"""Tiny checkpoints of each family for the model tests: a byte-level BPE tokenizer with ChatML's
special tokens, an HF model made by transformers with its own config class (fixed seed, norms
and biases away from their starting values), saved as safetensors, and the same weights
written as a GGUF the way llama.cpp's converter writes them."""

from __future__ import annotations

import json

import gguf
import numpy as np
import torch
import transformers
from gguf.quants import quantize

STEPS = 32
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "t"), ("Ġ", "c")]
TEXTS = [
    "the cat in the hat, the cat in the hat, the cat in the",
    "in the heat",
    "a hat that is not a cat: the hat, the hat",
]
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)
# each family with a feature of its own: rope scaling, tied embeddings, a head size that is
# not hidden / heads
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
}


def template(family: str) -> str:
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant (" + family + ")\n"
        "{% endif %}"
    )


def tiny_tokenizer():
    """A byte-level BPE of 256 bytes, a few merges and ChatML's special tokens, split as
    Qwen2 splits (so llama.cpp's `qwen2` pre-tokenizer reads it back the same)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for first, second in MERGES:
        vocab[first + second] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def hf_model(family: str, tokenizer, **overrides):
    config_class, model_class, options = FAMILIES[family]
    config = getattr(transformers, config_class)(
        **{
            **BASE,
            **options,
            **overrides,
            "vocab_size": len(tokenizer),
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    )
    torch.manual_seed(21)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None  # 32 steps whatever comes
    return model


def save(model, tokenizer, directory, family: str) -> None:
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.chat_template = template(family)
    tokenizer.save_pretrained(str(directory))


class Checkpoint:
    """One family's tiny checkpoint, its prompts and HF's greedy tokens and logits."""

    def __init__(self, family: str, directory, tokenizer) -> None:
        self.family, self.directory = family, directory
        self.hf = hf_model(family, tokenizer)
        save(self.hf, tokenizer, directory, family)
        self.prompts = [tokenizer.encode(text) for text in TEXTS]
        self.tokens, self.logits = [], []
        for prompt in self.prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=STEPS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            self.tokens.append(out.sequences[0, len(prompt) :].tolist())
            self.logits.append(torch.cat(out.logits).float())  # [STEPS, vocab]
        # logits within 1e-4 of these cannot change an argmax whose top two are 2e-4 apart
        for logits in self.logits:
            top2 = logits.topk(2).values
            assert (top2[:, 0] - top2[:, 1]).min() > 2e-4, "a near tie: change the seed"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama (convert_hf_to_gguf's LlamaModel.permute)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    checkpoint: Checkpoint,
    tokenizer,
    path,
    quant: str = "F32",
    eot_token_id: int | None = None,
    sliding_window: int | None = None,
) -> None:
    """The HF model's weights and config as llama.cpp's converter writes them (Mistral as
    `llama`), named by gguf's own tensor map, matrices in `quant` (F32 or Q8_0), with the
    tokenizer and the chat template; an end-of-turn id and `<arch>.attention.sliding_window`
    where given."""
    hf, config = checkpoint.hf, checkpoint.hf.config
    arch = {"mistral": "llama"}.get(checkpoint.family, checkpoint.family)
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers
    )
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tokens = [None] * len(tokenizer)
    for token, index in tokenizer.get_vocab().items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([control if t in SPECIALS else normal for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    writer.add_chat_template(template(checkpoint.family))
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = permute(values, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quant == "Q8_0" and values.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_dir(tmp_path, tokenizer, family: str, **overrides):
    directory = tmp_path / family
    save(hf_model(family, tokenizer, **overrides), tokenizer, directory, family)
    return directory


def edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
