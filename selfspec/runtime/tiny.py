"""Tiny randomly initialised causal LMs for tests, smoke runs and examples: built in-process, no download.

``load_model("tiny:ARCH")`` (``selfspec.runtime.models``) returns ``tiny_model_and_tokenizer(ARCH)``: a tiny model
whose vocabulary is a byte-level tokenizer with a chat template, so recipes and commands run end to end on it.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

# Small enough that a forward pass costs well under a millisecond, big enough for GQA, RoPE and several layers.
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", **_COMMON),
    "qwen2": dict(model_type="qwen2", **_COMMON),
    "mistral": dict(model_type="mistral", sliding_window=None, **_COMMON),
    "qwen3": dict(model_type="qwen3", head_dim=8, **_COMMON),
    "gemma": dict(model_type="gemma", head_dim=8, **_COMMON),
    "phi3": dict(model_type="phi3", pad_token_id=0, **{k: v for k, v in _COMMON.items()}),
    "gpt2": dict(model_type="gpt2", vocab_size=96, n_embd=32, n_layer=4, n_head=4, n_positions=512, n_inner=64,
                 tie_word_embeddings=False),
}
ARCHITECTURES = tuple(TINY_CONFIGS)


def tiny_config(arch: str, **overrides):
    if arch not in TINY_CONFIGS:
        raise KeyError(f"unknown tiny architecture {arch!r}; known: {', '.join(TINY_CONFIGS)}")
    spec = {**TINY_CONFIGS[arch], **overrides}
    model_type = spec.pop("model_type")
    spec.setdefault("bos_token_id", 1)
    # No EOS by default, so generations run their full length; tests that exercise EOS pass one explicitly.
    spec.setdefault("eos_token_id", None)
    return AutoConfig.for_model(model_type, **spec)


def tiny_model(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "sdpa", **overrides):
    """A randomly initialised causal LM of architecture ``arch`` in eval mode (same ``seed``, same weights)."""
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed * 1000 + ARCHITECTURES.index(arch))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    # Random init is near-uniform; sharpen the output so greedy paths are varied and drafts can be right.
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.mul_(8.0)
    return model.eval()


_BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A 260-token byte-level tokenizer (4 specials + 256 bytes) with a ChatML template: no download needed."""
    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>",
                                        bos_token="<|endoftext|>", additional_special_tokens=specials[2:])
    tokenizer.chat_template = _BYTE_CHAT_TEMPLATE
    return tokenizer


def tiny_model_and_tokenizer(arch: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: ``tiny_model(arch)`` over ``byte_tokenizer()``'s vocabulary, which never emits a
    special token (a random model would often end a turn at once)."""
    tokenizer = byte_tokenizer()
    model = tiny_model(arch, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, dtype=dtype)
    with torch.no_grad():
        model.get_output_embeddings().weight[tokenizer.all_special_ids] = 0
    return model, tokenizer


def tiny_gemma3(head_dim: int = 16, window: int = 6) -> torch.nn.Module:
    """A tiny random Gemma 3 text model (``Gemma3ForCausalLM``): sliding-window layers (``window`` positions) between
    full ones, per-head q/k norms, norms with random weights (Gemma's ``1 + w``), no end token. Not in
    ``TINY_CONFIGS``: the decode paths it needs (sliding windows past their length) are tested on it directly."""
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
        sliding_window=window, layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=16,
        tie_word_embeddings=False)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
        model.get_output_embeddings().weight.mul_(8.0)
    # random weights: no early end to either side's decoding, and no padding id (HF generate would mask a prompt's
    # token 0, the config's default pad id)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model.eval()
