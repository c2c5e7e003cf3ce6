"""Tiny randomly initialised causal LMs for tests, smoke grids and examples: built in-process, no download."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

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


def assert_random_trees_decode_losslessly(model, seeds_and_lengths=((1, 3), (2, 17)), max_new_tokens: int = 20) -> None:
    """Greedy tree decoding equals ``model.generate`` with random 6-node trees that often hold the true
    continuation (so deep paths are accepted and verified), for each ``(seed, prompt length)``."""
    import decoding
    from decoding.testing import RandomDrafter

    vocab = model.config.vocab_size
    for seed, length in seeds_and_lengths:
        prompt = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
        expected = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                  min_new_tokens=max_new_tokens)
        drafter = RandomDrafter(vocab, size=6, seed=seed, reference=expected, hit_rate=0.7)
        out = decoding.generate(model, drafter, prompt, max_new_tokens=max_new_tokens, eos_token_id=None)
        assert out.sequences.tolist() == expected.tolist(), f"tree decoding diverged (seed {seed}, length {length})"
        assert out.stats.tau > 1.5, f"too few drafts accepted to exercise verification (tau {out.stats.tau:.2f})"


def assert_linear_backend_is_exact_and_lossless(model, backend: str, kernel_calls: list) -> None:
    """Put ``model`` (on the stock path) on linear ``backend`` and check: logits equal stock's (float32 rounding
    aside), every ``nn.Linear`` of the forward went through the kernel (``kernel_calls`` collects one entry per call,
    by a patch the caller set up), the parameters are untouched, and tree decoding stays lossless."""
    from selfspec.identity import base_model_identity
    from selfspec.kernels import set_linear_backend

    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        stock = model(ids).logits
        identity = base_model_identity(model)
        assert set_linear_backend(model, backend) == backend
        fast = model(ids).logits
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-4)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len(kernel_calls) == linears, f"{len(kernel_calls)} of {linears} linear layers ran on {backend}"
    assert base_model_identity(model) == identity  # parameters untouched: heads still recognise the model
    assert_random_trees_decode_losslessly(model)
