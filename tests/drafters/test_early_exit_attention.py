"""The Kangaroo-style attention adapter of the exit classifier: zero init is the training-free classifier, the
block is causal attention with the base model's RoPE, its own KV cache gives the full-sequence result, and the
drafter keeps that cache in step with the decode loop (begin / observe / crop after drafting)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from decoding.drafter import DecodeState, SamplingParams
from decoding.generate import generate
from early_exit import DraftPolicy, EarlyExitDrafter, ExitClassifierConfig, new_classifier
from early_exit.adapter import AdapterCache
from selfspec.testing import attention_classifier, tiny_model

LLAMA_FAMILY = ("llama", "qwen2", "mistral", "qwen3")




def random_hidden(model, batch: int = 1, length: int = 6, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, model.config.hidden_size, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("heads", [None, 2])
def test_untrained_attention_adapter_is_the_training_free_classifier(heads):
    model = tiny_model("qwen3", dtype=torch.float64)
    hidden = random_hidden(model, batch=2)
    plain = new_classifier(model, 2)
    adapted = new_classifier(model, 2, adapter="attention", adapter_layers=1, adapter_heads=heads)
    assert torch.equal(adapted(hidden, model), plain(hidden, model))
    # Not a vacuous identity: the block has trainable projections, and only the zero output projection hides them.
    assert adapted.attention.q_proj.weight.abs().sum() > 0 and not adapted.attention.o_proj.weight.any()
    with torch.no_grad():
        adapted.attention.o_proj.weight.normal_(0, 0.1)
    assert not torch.allclose(adapted(hidden, model), plain(hidden, model))


@pytest.mark.parametrize("mlp", [0, 24])
def test_attention_adapter_is_causal_attention_with_the_base_rope(mlp):
    """Against a reference written with transformers' own ``apply_rotary_pos_emb`` and an explicit causal softmax
    (and, with ``mlp``, the SwiGLU block after it written out)."""
    model = tiny_model("llama", dtype=torch.float64)
    classifier = attention_classifier(model, adapter_mlp_size=mlp)
    block = classifier.attention
    hidden = random_hidden(model, length=7)
    positions = torch.arange(7)[None]
    cos, sin = model.model.rotary_emb(hidden, position_ids=positions)
    x = block.norm(hidden)

    def heads(t):
        return t.view(1, 7, block.num_heads, block.head_dim).transpose(1, 2)

    q, k = apply_rotary_pos_emb(heads(block.q_proj(x)), heads(block.k_proj(x)), cos, sin)
    scores = q @ k.transpose(-1, -2) / block.head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ heads(block.v_proj(x))).transpose(1, 2).reshape(1, 7, -1)
    expected = hidden + block.o_proj(out)
    if mlp:
        m = block.mlp_norm(expected)
        expected = expected + (torch.nn.functional.silu(m @ block.gate_proj.weight.T) * (m @ block.up_proj.weight.T)
                               ) @ block.down_proj.weight.T
    torch.testing.assert_close(block(hidden, model), expected)
    # Causal: changing position 4 leaves positions 0..3 alone and changes 4..6.
    changed = hidden.clone()
    changed[:, 4] += 1.0
    before, after = block(hidden, model), block(changed, model)
    assert torch.equal(before[:, :4], after[:, :4]) and not torch.allclose(before[:, 4:], after[:, 4:])


def test_cache_in_pieces_equals_the_whole_sequence_and_padding_is_ignored():
    model = tiny_model("qwen2", dtype=torch.float64)
    classifier = attention_classifier(model)
    hidden = random_hidden(model, length=9)
    whole = classifier(hidden, model)
    cache = AdapterCache()
    classifier.extend_cache(cache, hidden[:, :4], model, torch.arange(4)[None])  # accepted positions: K/V only
    pieces = [classifier(hidden[:, 4:6], model, cache=cache), classifier(hidden[:, 6:], model, cache=cache)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole[:, 4:])
    assert cache.length == 9
    cache.crop(5)
    torch.testing.assert_close(classifier(hidden[:, 5:6], model, cache=cache), whole[:, 5:6])
    # A right-padded batch row gives its unpadded result at the real positions.
    batch = torch.cat([hidden, random_hidden(model, length=9, seed=1)])
    batch[0, 6:] = 0.0
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    torch.testing.assert_close(classifier(batch, model, attention_mask=mask)[0, :6], classifier(hidden[:, :6], model)[0])


class CheckedDrafter(EarlyExitDrafter):
    """Checks every chain it proposes against the classifier on the full model's own layer-E states of the whole
    sequence so far (teacher-forced): the adapter KV fed by begin/observe must reproduce the full-sequence result."""

    checked = 0

    def propose(self, state):
        tree = super().propose(state)
        assert self.adapter_cache.length == state.cache_length  # draft positions cropped back
        sequence = state.sequence
        with torch.no_grad():
            for token in tree.tokens.tolist():
                hidden = self.model(sequence, output_hidden_states=True).hidden_states[self.classifier.exit_layer]
                assert int(self.classifier(hidden, self.model)[0, -1].argmax()) == token
                sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=1)
                self.checked += 1
        return tree


@pytest.mark.parametrize("arch, mlp", [(arch, 0) for arch in LLAMA_FAMILY] + [("llama", 24), ("qwen3", 24)])
def test_chain_draft_is_the_classifier_on_the_full_sequence(arch, mlp):
    model = tiny_model(arch, dtype=torch.float64)
    ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    drafter = CheckedDrafter(model, attention_classifier(model, adapter_mlp_size=mlp), DraftPolicy.chain(3))
    out = generate(model, drafter, ids, max_new_tokens=16)
    expected = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    assert drafter.checked >= 3 * 4  # several steps, so the observe path was exercised, not only begin


def test_tree_draft_leaves_both_caches_as_they_were():
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(2, 96, (1, 8), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        hidden = model(ids[:, :-1], cache=cache, use_cache=True, output_hidden_states=True).hidden_states
    state = DecodeState(model=model, cache=cache, sequence=ids, sampling=SamplingParams(), hidden={2: hidden[2]})
    classifier = attention_classifier(model)
    drafter = EarlyExitDrafter(model, classifier, DraftPolicy(max_depth=3, top_k=3, width=3, max_nodes=9))
    assert drafter.hidden_layers == (2,)
    with pytest.raises(RuntimeError, match="begin"):
        drafter.propose(state)
    drafter.begin(state)
    keys = drafter.adapter_cache.keys.clone()
    before = [layer.keys.clone() for layer in cache.layers]
    tree = drafter.propose(state)
    assert len(tree) > 3
    assert torch.equal(drafter.adapter_cache.keys, keys)
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, before))
    # Each node's children are the classifier's best tokens on the node's own path: the tree mask hides the other
    # branches from the adapter as it does from the base layers.
    with torch.no_grad():
        for node in range(-1, len(tree)):
            children = tree.tokens[tree.parents == node].tolist()
            if not children:
                continue
            path, n = [], node
            while n >= 0:
                path.insert(0, int(tree.tokens[n]))
                n = int(tree.parents[n])
            sequence = torch.cat([ids, torch.tensor([path], dtype=torch.long)], dim=1)
            states = model(sequence, output_hidden_states=True).hidden_states[2]
            top = classifier(states, model)[0, -1].topk(len(children)).indices.tolist()
            assert set(children) == set(top), (node, children, top)


@pytest.mark.parametrize("options, message", [
    (dict(adapter="lstm", adapter_layers=1), "unknown adapter kind 'lstm'"),
    (dict(adapter="attention", adapter_layers=2), "adapter_layers must be 1"),
    (dict(adapter="attention", adapter_layers=0), "adapter_layers must be 1"),
    (dict(adapter="resblock", adapter_layers=1, adapter_heads=2), "attention adapter only"),
    (dict(adapter="attention", adapter_layers=1, adapter_heads=0), "adapter_heads must be an integer >= 1"),
    (dict(adapter="resblock", adapter_layers=1, adapter_mlp_size=8), "attention adapter only"),
    (dict(adapter="attention", adapter_layers=1, adapter_mlp_size=-1), "adapter_mlp_size must be an integer >= 0"),
])
def test_bad_adapter_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        new_classifier(tiny_model("llama"), 2, **options)


def test_old_configs_load_as_resblock_classifiers():
    old = {"adapter_layers": 1, "base_model": {}, "draft_vocab_size": None, "exit_layer": 18, "kind": "early-exit",
           "metrics": {}, "own_norm": True, "policy": {"max_depth": 3}}
    config = ExitClassifierConfig.from_dict(old)
    assert config.adapter == "resblock" and config.adapter_heads is None and config.backbone_adapter is None
    with pytest.raises(ValueError, match="unknown adapter kind"):
        ExitClassifierConfig.from_dict({**old, "adapter": "conv"})
