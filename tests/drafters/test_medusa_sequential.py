"""Sequential (Hydra-style) Medusa heads on tiny random models: the step against a hand-written reference, teacher
forcing against step-by-step drafting, every tree node against its own path walked independently, save/load, and
greedy equality with the base model's ``generate`` on every tiny architecture and several trees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import decoding
from decoding import DecodeState, SamplingParams, TreeTemplate
from medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from medusa.heads import path_tokens
from selfspec.testing import MEDUSA_TEST_TREES, greedy_reference, sequential_heads, tiny_model

VOCAB = 96




def head_logits(heads: MedusaHeads, model, state: torch.Tensor, k: int) -> torch.Tensor:
    if heads.shared_lm_head is not None:
        return model.get_output_embeddings()(state)
    return heads.lm_head_weight[k] @ state


def reference_step(heads: MedusaHeads, state: torch.Tensor, token: int, k: int) -> torch.Tensor:
    """Head ``k`` written out for one vector: s + SiLU(W s + U e + b), then plain ResBlocks."""
    e = heads.shared_embeddings.weight[token]
    x = state
    for layer in range(heads.config.num_layers):
        pre = heads.resblock_weight[k, layer] @ x + heads.resblock_bias[k, layer]
        if layer == 0:
            pre = pre + heads.token_weight[k] @ e
        x = x + F.silu(pre)
    return x


def test_config_and_construction_errors(tiny_llama64):
    with pytest.raises(ValueError, match="sequential must be true or false"):
        MedusaConfig(sequential="yes")
    config = MedusaHeads.for_model(tiny_llama64, num_heads=2, sequential=True).config
    with pytest.raises(ValueError, match="need the base model's input embeddings"):
        MedusaHeads(config, tiny_llama64.get_output_embeddings())
    heads = MedusaHeads.for_model(tiny_llama64, num_heads=2, sequential=True)
    hidden = torch.zeros(1, 4, heads.config.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match="need tokens"):
        heads.features(hidden)
    with pytest.raises(ValueError, match="step\\(\\) is for sequential heads"):
        MedusaHeads.for_model(tiny_llama64, num_heads=2).step(hidden[0], torch.zeros(4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="width must be an integer >= 1"):
        MedusaDrafter(heads, tree=4, dynamic=2, width=0)


def test_zero_init_sequential_heads_equal_the_base_prediction(tiny_llama64):
    heads = MedusaHeads.for_model(tiny_llama64, num_heads=3, num_layers=2, sequential=True)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = tiny_llama64(ids, output_hidden_states=True)
        logits = heads(out.hidden_states[-1], tokens=path_tokens(ids, 3))
    for k in range(3):
        torch.testing.assert_close(logits[k], out.logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_teacher_forced_features_match_the_step_written_out(tiny_llama64, num_layers):
    heads = sequential_heads(tiny_llama64, num_layers=num_layers)
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    hidden = torch.randn(2, 9, heads.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tokens = path_tokens(ids, 3)
    assert tokens[1, 2].tolist() == ids[1, 3:6].tolist() and tokens[0, 8].tolist() == [0, 0, 0]
    features = heads.features(hidden, tokens=tokens)
    assert features.shape == (3, 2, 9, heads.config.hidden_size)
    torch.testing.assert_close(heads.features(hidden, num_heads=2, tokens=tokens), features[:2])
    for b, t in [(0, 0), (1, 4), (1, 8)]:
        state = hidden[b, t]
        for k in range(3):
            state = reference_step(heads, state, int(tokens[b, t, k]), k)
            torch.testing.assert_close(features[k, b, t], state)




@pytest.mark.parametrize("tree", list(MEDUSA_TEST_TREES))
@pytest.mark.parametrize("share", [True, False])
def test_every_node_is_its_own_paths_top_k(tiny_llama64, tree, share):
    # Private random LM heads spread the candidates over the vocabulary, so that a node built from the wrong
    # parent state or token would show; the shared tiny LM head favours a few tokens whatever the state.
    heads = sequential_heads(tiny_llama64, num_heads=4, seed=4, share_lm_head=share)
    drafter = MedusaDrafter(heads, tree=MEDUSA_TEST_TREES[tree])
    ids = torch.tensor([[1, 7, 3, 11, 5]])
    with torch.no_grad():
        hidden = tiny_llama64(ids[:, :-1], output_hidden_states=True).hidden_states[-1]
    draft = drafter.propose(DecodeState(model=tiny_llama64, cache=None, sequence=ids, sampling=SamplingParams(),
                                        hidden={-1: hidden}))
    template = drafter.template
    assert torch.equal(draft.parents, template.parents)
    tokens, parents = draft.tokens.tolist(), template.parents.tolist()
    for i, rank in enumerate(template.rank.tolist()):
        # Walk node i's path from the root: root token first, then each ancestor's token, one head per depth.
        path = []
        node = parents[i]
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        state = hidden[0, -1]
        with torch.no_grad():
            for k, token in enumerate([5] + path[::-1]):
                state = reference_step(heads, state, token, k)
            logits = head_logits(heads, tiny_llama64, state, len(path))
            assert tokens[i] == int(logits.topk(rank + 1).indices[rank]), f"node {i} of tree {tree}"
    if not share:
        assert len(set(tokens)) > len(tokens) // 2, f"degenerate draft {tokens}: the test would not discriminate"


def test_reduced_draft_vocabulary_and_save_load(tiny_llama64, tmp_path):
    heads = sequential_heads(tiny_llama64, num_heads=3, draft_vocab_size=40, seed=6)
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:40]
    heads.set_draft_vocab(vocab)
    heads.save_pretrained(tmp_path / "h")
    loaded = MedusaHeads.from_pretrained(tmp_path / "h", tiny_llama64)
    assert loaded.config.sequential and torch.equal(loaded.token_weight, heads.token_weight)
    ids = torch.tensor([[1, 7, 3, 11, 5]])
    with torch.no_grad():
        hidden = tiny_llama64(ids[:, :-1], output_hidden_states=True).hidden_states[-1]
    state = DecodeState(model=tiny_llama64, cache=None, sequence=ids, sampling=SamplingParams(), hidden={-1: hidden})
    tree = MEDUSA_TEST_TREES["branchy"][:9]
    a, b = MedusaDrafter(heads, tree=tree).propose(state), MedusaDrafter(loaded, tree=tree).propose(state)
    assert a.tokens.tolist() == b.tokens.tolist() and set(a.tokens.tolist()) <= set(vocab.tolist())
    # Depth 1 is head 0's top-k over the draft vocabulary, from the root's state.
    with torch.no_grad():
        s = reference_step(heads, hidden[0, -1], 5, 0)
        full = tiny_llama64.get_output_embeddings()(s)
    assert a.tokens[:3].tolist() == vocab[full[vocab].topk(3).indices].tolist()




def test_greedy_equality(tiny_arch):
    model = tiny_model(tiny_arch, dtype=torch.float64)
    heads = sequential_heads(model, num_heads=4, seed=3)
    accepted = 0
    for prompt in ([1, 17, 4, 33, 8], [1, 60, 61, 2, 9, 9, 40, 12, 3]):
        ids = torch.tensor([prompt])
        reference = greedy_reference(model, ids, 24).tolist()
        for name, tree in MEDUSA_TEST_TREES.items():
            out = decoding.generate(model, MedusaDrafter(heads, tree=tree), ids, max_new_tokens=24)
            assert out.sequences.tolist() == reference, f"tree {name}, prompt {prompt}"
            accepted += sum(out.stats.accepted_per_step)
    assert accepted > 0, "no draft accepted: the accept path did not run"


def reference_beam(heads, model, hidden, root, depth, size, width, top_k):
    """EAGLE-2's expansion written out node by node: ``{path: score}`` of the ``size`` best nodes."""
    grown, frontier = {}, []
    state = reference_step(heads, hidden, root, 0)
    logp = head_logits(heads, model, state, 0).log_softmax(-1)
    for token in logp.topk(min(top_k if depth > 1 else size, size)).indices.tolist():
        grown[(token,)] = float(logp[token])
        frontier.append(((token,), state))
    for level in range(1, depth):
        frontier = sorted(frontier, key=lambda f: -grown[f[0]])[:width]
        children = []
        for path, parent_state in frontier:
            state = reference_step(heads, parent_state, path[-1], level)
            logp = head_logits(heads, model, state, level).log_softmax(-1)
            for token in logp.topk(top_k).indices.tolist():
                grown[path + (token,)] = grown[path] + float(logp[token])
                children.append((path + (token,), state))
        frontier = children
    best = sorted(grown, key=lambda p: (-grown[p], len(p)))[:size]
    return {p: grown[p] for p in best}


@pytest.mark.parametrize("size, width, top_k", [(1, 1, 1), (6, 2, 3), (12, 4, 4), (20, 3, 5)])
def test_dynamic_tree_keeps_the_most_probable_grown_paths(tiny_llama64, size, width, top_k):
    heads = sequential_heads(tiny_llama64, num_heads=4, seed=7, share_lm_head=False)
    drafter = MedusaDrafter(heads, tree=TreeTemplate.chain(4).choices, dynamic=size, width=width, top_k=top_k)
    ids = torch.tensor([[1, 7, 3, 11, 5]])
    with torch.no_grad():
        hidden = tiny_llama64(ids[:, :-1], output_hidden_states=True).hidden_states[-1]
        draft = drafter.propose(DecodeState(model=tiny_llama64, cache=None, sequence=ids, sampling=SamplingParams(),
                                            hidden={-1: hidden}))
        expected = reference_beam(heads, tiny_llama64, hidden[0, -1], 5, 4, size, width, top_k)
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    paths = []
    for i in range(len(tokens)):
        path, node = [], i
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        paths.append(tuple(path[::-1]))
    assert len(paths) == len(set(paths)) == size
    assert set(paths) == set(expected), (sorted(paths), sorted(expected))
    if size > 1:
        assert draft.max_depth > 1  # the test covers expansion beyond depth 1


def test_greedy_equality_with_dynamic_trees(tiny_arch):
    model = tiny_model(tiny_arch, dtype=torch.float64)
    heads = sequential_heads(model, num_heads=4, seed=3)
    accepted = 0
    for prompt, new in (([1, 17, 4, 33, 8], 24), ([1, 60, 61, 2, 9, 9, 40, 12, 3], 13)):
        ids = torch.tensor([prompt])
        reference = greedy_reference(model, ids, new).tolist()
        for size, width, top_k in ((3, 1, 2), (10, 3, 3), (16, 4, 4), (32, 2, 24)):
            drafter = MedusaDrafter(heads, dynamic=size, width=width, top_k=top_k)
            out = decoding.generate(model, drafter, ids, max_new_tokens=new)
            assert out.sequences.tolist() == reference, f"dynamic {size}/{width}/{top_k}, prompt {prompt}"
            assert max(out.stats.tree_sizes) <= size
            accepted += sum(out.stats.accepted_per_step)
    assert accepted > 0, "no draft accepted: the accept path did not run"
