"""Prefix attention for Medusa heads on tiny random models: identity at initialisation, the block written out by
hand, decode-time (incremental, cached) against training-time (whole sequence) outputs, save/load, and greedy
equality with the base model's ``generate`` for parallel and sequential heads on every tiny architecture."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import decoding
from decoding import DecodeState, SamplingParams
from medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from medusa.heads import path_tokens
from selfspec.runtime.attention import LayerCache, rotary_of
from selfspec.testing import MEDUSA_TEST_TREES, greedy_reference, prefix_heads, randomize_heads, tiny_model

VOCAB = 96




def reference_block(heads: MedusaHeads, model, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The prefix block for one sequence ``[q, hidden]``, written out position by position with explicit RoPE."""
    block, e = heads.prefix, heads.shared_embeddings.weight[next_tokens]
    u = hidden + e @ block.token_proj.weight.T
    norm = lambda x, w: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    n = norm(u, block.norm.weight)
    heads_, dim = block.num_heads, block.head_dim
    q, k, v = (n @ p.weight.T for p in (block.q_proj, block.k_proj, block.v_proj))
    q, k, v = (x.view(-1, heads_, dim).transpose(0, 1) for x in (q, k, v))  # [heads, seq, dim]
    rotary = rotary_of(model)
    if rotary is not None:
        cos, sin = rotary(hidden[None], position_ids=torch.arange(hidden.shape[0])[None])
        rot = lambda x: x * cos[0] + torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin[0]  # noqa: E731
        q, k = rot(q), rot(k)
    out = torch.zeros_like(q)
    for t in range(hidden.shape[0]):
        scores = (q[:, t:t + 1] @ k[:, :t + 1].transpose(-1, -2)) / math.sqrt(dim)
        out[:, t] = (scores.softmax(-1) @ v[:, :t + 1])[:, 0]
    a = u + out.transpose(0, 1).reshape(hidden.shape[0], -1) @ block.o_proj.weight.T
    m = norm(a, block.mlp_norm.weight)
    return a + (F.silu(m @ block.gate_proj.weight.T) * (m @ block.up_proj.weight.T)) @ block.down_proj.weight.T


def test_config_errors_and_construction(tiny_llama64):
    with pytest.raises(ValueError, match="prefix_attention must be true or false"):
        MedusaConfig(prefix_attention=1)
    with pytest.raises(ValueError, match="prefix_mlp_size must be an integer >= 0"):
        MedusaConfig(prefix_mlp_size=-1)
    heads = MedusaHeads.for_model(tiny_llama64, num_heads=2, prefix_attention=True)
    text = tiny_llama64.config
    assert heads.config.prefix_num_heads == text.num_attention_heads
    assert heads.config.prefix_head_dim == text.hidden_size // text.num_attention_heads
    with pytest.raises(ValueError, match="need the base model's input embeddings"):
        MedusaHeads(heads.config, tiny_llama64.get_output_embeddings())
    with pytest.raises(ValueError, match="need tokens"):
        heads.features(torch.zeros(1, 4, heads.config.hidden_size, dtype=torch.float64))
    with pytest.raises(ValueError, match="no prefix attention"):
        MedusaHeads.for_model(tiny_llama64, num_heads=2).context(torch.zeros(1, 1, 32), torch.zeros(1, 1).long())


@pytest.mark.parametrize("sequential", [False, True])
def test_untrained_prefix_block_is_the_identity(tiny_llama64, sequential):
    plain = randomize_heads(MedusaHeads.for_model(tiny_llama64, num_heads=3, sequential=sequential), scale=0.1)
    with_prefix = MedusaHeads.for_model(tiny_llama64, num_heads=3, sequential=sequential, prefix_attention=True,
                                        prefix_mlp_size=16)
    with_prefix.load_state_dict(plain.state_dict(), strict=False)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 7, tiny_llama64.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tokens = path_tokens(ids, 3)
    torch.testing.assert_close(with_prefix.features(hidden, tokens=tokens),
                               plain.features(hidden, tokens=tokens if sequential else None), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_block_matches_the_reference_written_out(arch):
    model = tiny_model(arch, dtype=torch.float64)
    heads = prefix_heads(model, seed=1)
    ids = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(1, 9, model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(4))
    out = heads.context(hidden, ids)
    torch.testing.assert_close(out[0], reference_block(heads, model, hidden[0], ids[0]))
    assert (out - hidden).abs().max() > 0.1, "the block barely changed its input: the test would not discriminate"


def test_incremental_decoding_equals_the_whole_sequence(tiny_llama64):
    heads = prefix_heads(tiny_llama64, seed=2)
    ids = torch.randint(2, VOCAB, (1, 13), generator=torch.Generator().manual_seed(5))
    hidden = torch.randn(1, 13, tiny_llama64.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    whole = heads.context(hidden, ids)
    cache, parts, start = LayerCache(), [], 0
    for size in (5, 1, 3, 1, 3):  # a prefill, then steps that accept 0, 2, 0 and 2 draft tokens
        positions = torch.arange(start, start + size)[None]
        parts.append(heads.context(hidden[:, start:start + size], ids[:, start:start + size], positions, cache))
        start += size
    assert cache.length == 13
    torch.testing.assert_close(torch.cat(parts, dim=1), whole)
    # Right padding: a padded batch row gives the same outputs at its real positions.
    padded = heads.context(torch.cat([hidden, torch.randn(1, 4, tiny_llama64.config.hidden_size, dtype=torch.float64)], 1),
                           torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1))
    torch.testing.assert_close(padded[:, :13], whole)


def test_drafter_starts_from_the_block_output_and_keeps_its_cache_in_step(tiny_llama64):
    heads = prefix_heads(tiny_llama64, seed=3, num_heads=4)
    drafter = MedusaDrafter(heads, tree=MEDUSA_TEST_TREES["branchy"])
    ids = torch.tensor([[1, 7, 3, 11, 5, 20, 9]])
    with torch.no_grad():
        hidden = tiny_llama64(ids, output_hidden_states=True).hidden_states[-1]
    state = DecodeState(model=tiny_llama64, cache=None, sequence=ids[:, :5], sampling=SamplingParams(),
                        hidden={-1: hidden[:, :4]})
    drafter.begin(state)
    assert drafter.context_cache.length == 4
    # The start state is the block's output at the last verified position, with the root as its next token.
    expected = heads.context(hidden[:, :4], ids[:, 1:5])[:, -1:]
    torch.testing.assert_close(drafter._start, expected)
    state.sequence, state.hidden = ids, {-1: hidden[:, 4:6]}  # a step that accepted one node: 2 new positions
    drafter.observe(state)
    torch.testing.assert_close(drafter._start, heads.context(hidden[:, :6], ids[:, 1:7])[:, -1:])
    state.hidden = {-1: hidden[:, 6:7]}  # out of step: the base cache did not grow by this much
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.observe(state)


def test_save_load_roundtrip(tiny_llama64, tmp_path):
    heads = prefix_heads(tiny_llama64, seed=4)
    heads.save_pretrained(tmp_path / "h")
    loaded = MedusaHeads.from_pretrained(tmp_path / "h", tiny_llama64)
    assert loaded.config.prefix_attention and loaded.config.prefix_mlp_size == 24
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("sequential", [False, True])
def test_greedy_equality(tiny_arch, sequential):
    model = tiny_model(tiny_arch, dtype=torch.float64)
    heads = prefix_heads(model, seed=5, sequential=sequential, num_heads=4 if sequential else 3)
    accepted = 0
    for prompt, new in (([1, 17, 4, 33, 8], 24), ([1, 60, 61, 2, 9, 9, 40, 12, 3], 17), ([5], 9)):
        ids = torch.tensor([prompt])
        reference = greedy_reference(model, ids, new).tolist()
        for name in ("chain4" if sequential else "full3x3x2", "branchy", "wide"):
            tree = MEDUSA_TEST_TREES[name]
            if not sequential:
                tree = [path for path in (tree if isinstance(tree, list) else []) if len(path) <= 3] or 8
            drafter = MedusaDrafter(heads, tree=tree)
            out = decoding.generate(model, drafter, ids, max_new_tokens=new)
            assert out.sequences.tolist() == reference, f"tree {name}, prompt {prompt}"
            accepted += sum(out.stats.accepted_per_step)
    assert accepted > 0, "no draft accepted: the accept path did not run"
