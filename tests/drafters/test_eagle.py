"""The EAGLE-3 feature drafter: training-time test computes what decoding computes, every tree it proposes decodes
losslessly on every supported architecture, its caches stay in step, and it saves, loads and trains."""

from __future__ import annotations

import pytest
import torch

from decoding.generate import generate
from eagle.drafter import EagleDrafter, EaglePolicy, make_eagle_drafter
from eagle.model import DraftCache, from_pretrained, save_pretrained
from selfspec.runtime.tiny import tiny_model
from selfspec.testing import eagle_draft, greedy_reference, random_prompt

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def aux_states(model, ids, layers):
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return [out.hidden_states[i] for i in layers]


@pytest.mark.parametrize("arch", ARCHS)
def test_training_unroll_equals_decode_time_chain(arch):
    """Step j of the unrolled draft at position t == the (j+1)-th draft step after a verified prefix s_0..s_t with
    the draft chain fed the true next tokens: what makes training-time test train the decoder it serves."""
    model = tiny_model(arch)
    draft = eagle_draft(model, seed=3)
    ids = random_prompt(12, seed=5)
    aux = aux_states(model, ids, draft.config.aux_layers)
    with torch.no_grad():
        unrolled = draft.unroll(aux, ids, torch.ones_like(ids), steps=3)
        for t in (0, 4, 8):
            cache = DraftCache()
            positions = torch.arange(t + 1)[None]
            mask = (torch.arange(t + 1)[None, :] <= positions[0, :, None])[None, None]
            out = draft.step(draft.fuse([a[:, :t + 1] for a in aux]), ids[:, 1:t + 2], positions, mask, cache)
            assert torch.allclose(out[:, -1], unrolled[0][:, t], atol=1e-5), (arch, t, 0)
            hidden = out[:, -1:]
            for j in (1, 2):
                out = draft.step(hidden, ids[:, t + j + 1:t + j + 2], torch.tensor([[t + j]]), None, cache)
                assert torch.allclose(out[:, 0], unrolled[j][:, t], atol=1e-5), (arch, t, j)
                hidden = out


def test_padding_does_not_change_the_unroll(llama):
    draft = eagle_draft(llama, seed=1)
    ids = random_prompt(9, seed=2)
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 9, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)], dim=1)
    aux = aux_states(llama, ids, draft.config.aux_layers)
    aux_padded = [torch.cat([a, torch.randn(1, 4, a.shape[-1])], dim=1) for a in aux]
    with torch.no_grad():
        plain = draft.unroll(aux, ids, torch.ones_like(ids), steps=3)
        padded_out = draft.unroll(aux_padded, padded, mask, steps=3)
    for j in range(3):  # positions whose whole chain stays inside the sequence
        assert torch.allclose(plain[j][:, :9 - j - 1], padded_out[j][:, :9 - j - 1], atol=1e-5)


POLICIES = {
    "default": EaglePolicy(),
    "small": EaglePolicy(depth=3, nodes=5, top_k=2, width=2),
    "chain": EaglePolicy(depth=5, nodes=5, top_k=1, width=1),
    "wide": EaglePolicy(depth=2, nodes=20, top_k=10, width=3),
    "one-node": EaglePolicy(depth=1, nodes=1),
    "static": EaglePolicy(tree=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0))),
    "threshold": EaglePolicy(depth=6, nodes=12, threshold=0.3),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_greedy_output_equals_generate(arch, policy):
    model = tiny_model(arch)
    drafter = EagleDrafter(model, eagle_draft(model, seed=7, draft_vocab_size=60), POLICIES[policy])
    for n, new in ((1, 9), (4, 30), (23, 17)):
        ids = random_prompt(n, seed=n)
        out = generate(model, drafter, ids, max_new_tokens=new)
        assert torch.equal(out.sequences, greedy_reference(model, ids, new)), (arch, policy, n)
        assert drafter.cache.length == out.sequences.shape[1] - 2 or out.stats.new_tokens == new


def test_trees_respect_the_policy_and_leave_the_cache_as_found(llama):
    drafter = EagleDrafter(llama, eagle_draft(llama, seed=2), EaglePolicy(depth=4, nodes=9, top_k=3, width=2))
    sizes, depths = [], []

    class Spy(EagleDrafter):
        pass

    original = drafter.propose

    def propose(state):
        before = drafter.cache.length
        keys = drafter.cache.keys.clone()
        tree = original(state)
        assert drafter.cache.length == before and torch.equal(drafter.cache.keys, keys)
        sizes.append(len(tree))
        depths.append(tree.max_depth)
        return tree

    drafter.propose = propose
    ids = random_prompt(6, seed=9)
    out = generate(llama, drafter, ids, max_new_tokens=25)
    assert torch.equal(out.sequences, greedy_reference(llama, ids, 25))
    assert sizes and all(s == 9 for s in sizes) and max(depths) <= 4


def test_eos_inside_a_tree_stops_there():
    model = tiny_model("llama")
    ids = random_prompt(5, seed=4)
    reference = greedy_reference(model, ids, 20)[0, 5:].tolist()
    eos = reference[6]
    drafter = EagleDrafter(model, eagle_draft(model, seed=1), EaglePolicy(depth=4, nodes=10))
    out = generate(model, drafter, ids, max_new_tokens=20, eos_token_id=eos)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                              eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, expected)


def test_sampling_runs_and_is_reproducible(llama):
    drafter = EagleDrafter(llama, eagle_draft(llama, seed=2), EaglePolicy(depth=3, nodes=6))
    ids = random_prompt(5, seed=3)
    a = generate(llama, drafter, ids, max_new_tokens=20, temperature=0.8, top_k=20, seed=11)
    b = generate(llama, drafter, ids, max_new_tokens=20, temperature=0.8, top_k=20, seed=11)
    assert torch.equal(a.sequences, b.sequences)


def test_save_load_round_trip_and_factory(llama, tmp_path):
    draft = eagle_draft(llama, seed=4, draft_vocab_size=50)
    draft.config.decoding = {"depth": 3, "nodes": 7, "top_k": 2, "width": 2}
    save_pretrained(draft, tmp_path / "d")
    loaded = from_pretrained(tmp_path / "d", llama)
    assert torch.equal(loaded.draft_vocab, draft.draft_vocab)
    for (name, a), (_, b) in zip(sorted(draft.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    drafter = make_eagle_drafter(llama, str(tmp_path / "d"))
    assert drafter.policy == EaglePolicy(depth=3, nodes=7, top_k=2, width=2)
    assert make_eagle_drafter(llama, str(tmp_path / "d"), nodes=4).policy.nodes == 4
    ids = random_prompt(6, seed=1)
    assert torch.equal(generate(llama, drafter, ids, max_new_tokens=15).sequences, greedy_reference(llama, ids, 15))


def test_bad_input_is_refused_clearly(llama, tmp_path):
    with pytest.raises(ValueError, match="needs a trained drafter directory"):
        make_eagle_drafter(llama)
    draft = eagle_draft(llama)
    save_pretrained(draft, tmp_path / "d")
    with pytest.raises(ValueError, match="unknown eagle drafter option"):
        make_eagle_drafter(llama, str(tmp_path / "d"), bogus=1)
    with pytest.raises(ValueError, match="nodes must be an integer"):
        EaglePolicy(nodes=0)
    with pytest.raises(ValueError, match="supports"):
        eagle_draft(tiny_model("gpt2"))
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="incomplete or damaged"):
        from_pretrained(tmp_path / "d", llama)
    other = tiny_model("llama", seed=5)
    save_pretrained(draft, tmp_path / "e")
    with pytest.raises(ValueError, match="trained for"):
        from_pretrained(tmp_path / "e", other)
