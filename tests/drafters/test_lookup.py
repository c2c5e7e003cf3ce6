"""Prompt-lookup drafts, merged trees and combined drafters: what they propose, and that decoding with them stays
token-identical to the base model's greedy generate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import decoding
from decoding import DraftTree, combine, fallback, make_drafter, merge_trees
from decoding.drafter import DecodeState, SamplingParams
from lookup import LookupDrafter, lookup_continuation, lookup_continuations
from lookup.drafter import suffix_matches
from lookup.tree import count_tree
from medusa import MedusaDrafter, MedusaHeads
from selfspec.testing import ARCHITECTURES, tiny_model


def test_lookup_takes_the_longest_then_most_recent_match():
    seq = torch.tensor([5, 1, 2, 3, 7, 1, 2, 4, 8, 9, 1, 2])
    # "1 2" occurred twice before; the later occurrence (followed by 4 8) wins.
    assert lookup_continuation(seq, max_ngram=2, min_ngram=1, num_tokens=3).tolist() == [4, 8, 9]
    # No earlier "9 1 2": from n = 3 it falls back to n = 2.
    assert lookup_continuation(seq, max_ngram=3, min_ngram=2, num_tokens=2).tolist() == [4, 8]
    # Only 1-grams: the most recent earlier "2" is followed by 4 8 9 1 2.
    assert lookup_continuation(seq, max_ngram=1, min_ngram=1, num_tokens=5).tolist() == [4, 8, 9, 1, 2]
    assert lookup_continuation(torch.tensor([1, 2, 3]), 2, 1, 4) is None  # nothing repeats
    assert lookup_continuation(torch.tensor([4]), 2, 1, 4) is None
    # A continuation running into the end of the sequence is cut there.
    assert lookup_continuation(torch.tensor([6, 6]), 2, 1, 4).tolist() == [6]


def test_several_candidates_come_from_distinct_earlier_occurrences():
    seq = torch.tensor([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 4, 9, 1, 2])
    found = lookup_continuations(seq, max_ngram=2, min_ngram=1, num_tokens=2, num_candidates=3)
    # "1 2" was followed by 3 4 (most recent), 5 6, and 3 4 again (a repeat, skipped).
    assert [f.tolist() for f in found] == [[3, 4], [5, 6]]
    drafter = LookupDrafter(max_ngram=2, num_tokens=2, num_candidates=3)
    tree = drafter.propose(DecodeState(model=None, cache=None, sequence=seq[None], sampling=SamplingParams()))
    assert tree.tokens.tolist() == [3, 4, 5, 6] and tree.parents.tolist() == [-1, 0, -1, 2]
    single = LookupDrafter(max_ngram=2, num_tokens=2, num_candidates=1).propose(
        DecodeState(model=None, cache=None, sequence=seq[None], sampling=SamplingParams()))
    assert single.tokens.tolist() == [3, 4]
    assert make_drafter("lookup", None, num_candidates="2").num_candidates == 2
    assert make_drafter("lookup", None, nodes="none").nodes is None


def _state(tokens) -> DecodeState:
    return DecodeState(model=None, cache=None, sequence=torch.tensor(tokens)[None], sampling=SamplingParams())


def test_suffix_matches_equal_a_brute_force_count():
    g = np.random.default_rng(0)
    for trial in range(200):
        seq = g.integers(0, 3 if trial % 2 else 6, size=int(g.integers(1, 40)))
        cap = int(g.integers(1, 12))
        got = suffix_matches(seq, cap)
        for j in range(seq.size - 1):
            n = 0
            while n < cap and n <= j and seq[j - n] == seq[seq.size - 1 - n]:
                n += 1
            assert got[j] == n, (seq.tolist(), j, cap)


def test_the_draft_grows_with_the_match_and_follows_the_majority():
    # "8 9" occurred three times before the final one (after 7, 6, 5: a 2-token match each), continued twice by
    # 1 2 3 4 and once by 5 6
    seq = [7, 8, 9, 1, 2, 3, 4, 6, 8, 9, 5, 6, 5, 8, 9, 1, 2, 3, 4, 0, 8, 9]
    tree = LookupDrafter(tokens_per_match=2, num_tokens=10, nodes=5, nodes_per_match=None).propose(_state(seq))
    # 2 matched tokens -> depth 4; 1 2 3 4 scores 2/3 and comes first, then 5 (1/3)
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5] and tree.parents.tolist() == [-1, 0, 1, 2, -1]
    # a longer match elsewhere wins over more frequent shorter ones
    assert LookupDrafter(tokens_per_match=2, num_tokens=10).propose(_state(seq + [5])).tokens.tolist()[0] == 6
    short = LookupDrafter(tokens_per_match=1, num_tokens=10).propose(_state([4, 5, 6, 9, 9, 4]))
    assert short.tokens.tolist() == [5]  # a 1-token match drafts 1 token
    long = LookupDrafter(tokens_per_match=1, num_tokens=10).propose(_state([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]))
    assert long.tokens.tolist() == [5, 6, 7, 1]  # 4 matched tokens: 4 drafted, running into the root
    classic = LookupDrafter(max_ngram=3, num_tokens=4, num_candidates=1, nodes=None, tokens_per_match=None,
                            nodes_per_match=None)
    assert classic.propose(_state(seq)).tokens.tolist() == [1, 2, 3, 4]
    # a node budget per matched token: the 2-token match gets 2 * 2 of the 5 nodes (the majority path first)
    assert LookupDrafter(tokens_per_match=2, num_tokens=10, nodes=5, nodes_per_match=2).propose(
        _state(seq)).tokens.tolist() == [1, 2, 3, 4]
    assert make_drafter("lookup", None, None, nodes_per_match="none").nodes_per_match is None
    # ... which is on by default: 2 nodes per matched token
    assert LookupDrafter().nodes_per_match == 2
    assert LookupDrafter(tokens_per_match=2, num_tokens=10, nodes=5).propose(_state(seq)).tokens.tolist() == [1, 2, 3, 4]
    assert LookupDrafter().propose(_state([1, 2, 3])) is None


def test_count_tree_keeps_the_likeliest_nodes():
    continuations = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    tree = count_tree(continuations, nodes=3)
    # scores: 1: 3/4, 2: 2/4, then 3, 4, 5, 6 at 1/4: ties go to the first seen (3)
    assert tree.tokens.tolist() == [1, 2, 3] and tree.parents.tolist() == [-1, 0, 1]
    full = count_tree(continuations, nodes=100)
    assert sorted(full.tokens.tolist()) == [1, 2, 3, 4, 5, 6] and len(full) == 6
    assert all(p < i for i, p in enumerate(full.parents.tolist()))
    assert count_tree(continuations, nodes=100, min_score=0.3).tokens.tolist() == [1, 2]
    assert count_tree([[7, -1, 8]], nodes=5, stop_token=-1).tokens.tolist() == [7]
    assert count_tree([], nodes=4) is None and count_tree([[]], nodes=4) is None
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        count_tree(continuations, nodes=0)


def test_lookup_drafter_errors():
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 1"):
        LookupDrafter(num_tokens=0)
    with pytest.raises(ValueError, match="exceeds max_ngram"):
        LookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="no heads"):
        make_drafter("lookup", None, "some/dir")
    with pytest.raises(ValueError, match="unknown lookup drafter option"):
        make_drafter("lookup", None, width=2)
    with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
        LookupDrafter(nodes=0)
    with pytest.raises(ValueError, match="nodes_per_match must be an integer >= 1"):
        LookupDrafter(nodes_per_match=0)


def test_merge_shares_common_paths_and_keeps_parents_first():
    a = DraftTree(torch.tensor([10, 11, 12, 20]), torch.tensor([-1, 0, 1, -1]))  # 10-11-12 and 20
    b = DraftTree.chain([10, 11, 13])  # shares 10-11, then branches
    merged = merge_trees([a, None, b])
    assert merged.tokens.tolist() == [10, 11, 12, 20, 13]
    assert merged.parents.tolist() == [-1, 0, 1, -1, 1]
    assert {tuple(merged.tokens[p].tolist()) for p in merged.paths} == {(10, 11, 12), (10, 11, 13), (20,)}
    assert merge_trees([None, None]) is None and merge_trees([b]) is b
    sampled = DraftTree.chain([1], draft_probs=torch.full((1, 4), 0.25))
    with pytest.raises(ValueError, match="cannot be merged"):
        merge_trees([a, sampled])


def _repetitive_prompt(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(1, vocab, (5,), generator=g)
    return torch.cat([motif, torch.randint(1, vocab, (3,), generator=g), motif, motif[:2]]).unsqueeze(0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_equality_with_lookup_and_medusa_plus_lookup(arch, tmp_path):
    model = tiny_model(arch, dtype=torch.float64)
    vocab = model.config.vocab_size
    heads = MedusaHeads.for_model(model, num_heads=2)
    with torch.no_grad():  # nonzero heads: they differ from the base head and from each other
        for p in heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    accepted = 0
    for seed in range(3):
        prompt = _repetitive_prompt(vocab, seed)
        expected = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False).tolist()
        for drafter in (LookupDrafter(), LookupDrafter(num_tokens=5, tokens_per_match=None),
                        LookupDrafter(num_tokens=3, num_candidates=3, nodes=None),
                        combine(MedusaDrafter(heads, tree=[[0], [1], [0, 0]]), LookupDrafter(max_ngram=2)),
                        combine(MedusaDrafter(heads, tree=[[0], [1]]), LookupDrafter(num_candidates=2))):
            out = decoding.generate(model, drafter, prompt, max_new_tokens=30, eos_token_id=None)
            assert out.sequences.tolist() == expected
            accepted += sum(out.stats.accepted_per_step)
    assert accepted > 0  # the lookup found repeats and the accept path ran


class _Scripted(decoding.DrafterBase):
    """Proposes a one-node tree in the steps ``script`` marks True (in order), nothing in the others; counts calls."""

    def __init__(self, script, token=3):
        self.script, self.token, self.calls, self.observed = list(script), token, 0, 0

    def propose(self, state):
        self.calls += 1
        return DraftTree.chain([self.token]) if self.script.pop(0) else None

    def observe(self, state):
        self.observed += 1


def test_a_fallback_is_asked_only_where_the_drafters_before_it_propose_nothing():
    state = DecodeState(model=None, cache=None, sequence=torch.tensor([[4, 5, 6]]), sampling=SamplingParams())
    first, second = _Scripted([True, False, False, True, False], 3), _Scripted([True, False, False], 4)
    third = _Scripted([True, False], 5)
    chain = fallback(first, second, third)
    assert [None if t is None else t.tokens.tolist() for t in (chain.propose(state) for _ in range(5))] == [
        [3], [4], [5], [3], None]
    assert (first.calls, second.calls, third.calls) == (5, 3, 2)
    assert chain.proposed == [2, 1, 1]
    for _ in range(3):
        chain.observe(state)
    assert first.observed == second.observed == third.observed == 3  # every drafter stays in step
    with pytest.raises(ValueError, match="at least one"):
        fallback()


def test_lookup_falling_back_to_the_feature_drafter_decodes_losslessly(tmp_path):
    """``lookup|eagle+lookup[...]``: the feature drafter drafts exactly in the steps lookup has no match for, its
    queued context catches up there, and every output is the base model's greedy one."""
    from eagle.drafter import EagleDrafter, EaglePolicy
    from eagle.model import save_pretrained
    from selfspec.testing import eagle_draft

    model = tiny_model("llama")
    vocab = model.config.vocab_size
    draft = eagle_draft(model, seed=5)
    save_pretrained(draft, tmp_path / "e")
    eagle = EagleDrafter(model, draft, EaglePolicy(depth=3, nodes=5))
    lookup = LookupDrafter()
    asked: list[bool] = []  # per step: whether lookup had nothing, so the feature drafter was asked
    lookup_propose, eagle_propose = lookup.propose, eagle.propose
    lookup.propose = lambda state: asked.append((tree := lookup_propose(state)) is None) or tree
    eagle_calls = []
    eagle.propose = lambda state: eagle_calls.append(1) or eagle_propose(state)
    drafter = combine(fallback(lookup, eagle), LookupDrafter(nodes=2, min_ngram=2))
    for seed in range(3):
        prompt = _repetitive_prompt(vocab, seed)
        expected = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False).tolist()
        out = decoding.generate(model, drafter, prompt, max_new_tokens=30, eos_token_id=None)
        assert out.sequences.tolist() == expected
    assert len(eagle_calls) == sum(asked) and 0 < sum(asked) < len(asked)  # both kinds of step happened
    assert drafter.drafters[0].proposed[1] > 0
    # the same from a spec, on the command line's syntax ('|' binds tighter than '+')
    built = make_drafter(f"lookup|eagle:{tmp_path / 'e'}[depth=2]+lookup[nodes=2,min_ngram=2]", model)
    assert isinstance(built, decoding.CombinedDrafter) and isinstance(built.drafters[0], decoding.FallbackDrafter)
    first, feature = built.drafters[0].drafters
    assert isinstance(first, LookupDrafter) and isinstance(feature, EagleDrafter) and feature.policy.depth == 2
    assert built.drafters[1].nodes == 2 and set(built.hidden_layers) == set(feature.hidden_layers)
    alone = make_drafter(f"lookup|eagle:{tmp_path / 'e'}", model)
    assert isinstance(alone, decoding.FallbackDrafter)
    for bad, message in (("lookup|", "empty part"), ("+lookup", "empty part")):
        with pytest.raises(ValueError, match=message):
            make_drafter(bad, model)
    from decoding.registry import Part, make_combined
    with pytest.raises(ValueError, match="falls back from nothing"):
        make_combined([Part("lookup", None, True)], model, {})


def test_combined_drafters_from_the_registry_and_the_benchmark(tmp_path):
    from selfspec.bench.methods import GenSettings, parse_method

    model = tiny_model("llama")
    MedusaHeads.for_model(model, num_heads=2).save_pretrained(tmp_path / "h")
    drafter = make_drafter("medusa+lookup", model, str(tmp_path / "h"), tree="3", **{"lookup.num_tokens": 2})
    assert isinstance(drafter, decoding.CombinedDrafter) and drafter.hidden_layers == (-1,)
    medusa_part, lookup_part = drafter.drafters
    assert len(medusa_part.template) == 3 and lookup_part.num_tokens == 2
    with pytest.raises(ValueError, match="not among"):
        make_drafter("medusa+lookup", model, str(tmp_path / "h"), **{"layer-skip.x": 1})
    method = parse_method(f"medusa:{tmp_path / 'h'}+lookup")
    prompt = _repetitive_prompt(model.config.vocab_size, 0)
    settings = GenSettings(max_new_tokens=12)
    assert method.generate(model, prompt, settings).tokens == parse_method("vanilla").generate(model, prompt, settings).tokens
    with pytest.raises(KeyError, match="unknown drafter 'medusae'"):
        parse_method("medusae:x+lookup")


def test_drafter_specs_carry_per_drafter_options(tmp_path):
    from decoding.registry import parse_part
    from selfspec.bench.methods import GenSettings, parse_method

    assert parse_part("datastore:runs/ds[nodes=3, min_ngram=1, floor=0.5, x=none]") == (
        "datastore", "runs/ds", {"nodes": 3, "min_ngram": 1, "floor": 0.5, "x": "none"})
    assert parse_part("lookup") == ("lookup", None, {}) and parse_part("medusa:d") == ("medusa", "d", {})
    with pytest.raises(ValueError, match="write key=value"):
        parse_part("lookup[nodes]")
    model = tiny_model("llama")
    spec = "lookup[max_ngram=3,num_tokens=4,num_candidates=1,nodes=none,tokens_per_match=none]"
    classic = make_drafter(spec, model)
    assert (classic.max_ngram, classic.num_tokens, classic.nodes, classic.tokens_per_match) == (3, 4, None, None)
    MedusaHeads.for_model(model, num_heads=2).save_pretrained(tmp_path / "h")
    merged = make_drafter(f"medusa:{tmp_path / 'h'}[tree=3]+lookup[nodes=2]", model)
    assert len(merged.drafters[0].template) == 3 and merged.drafters[1].nodes == 2
    # the benchmark: two settings of one drafter side by side in one run
    methods = [parse_method("lookup[num_tokens=2,tokens_per_match=none]"), parse_method("lookup"),
               parse_method(f"medusa:{tmp_path / 'h'}+lookup[nodes=1]")]
    assert methods[0].drafter(model).num_tokens == 2 and methods[1].drafter(model).num_tokens == 15
    assert methods[2].drafter(model).drafters[1].nodes == 1
    prompt = _repetitive_prompt(model.config.vocab_size, 0)
    settings = GenSettings(max_new_tokens=12)
    expected = parse_method("vanilla").generate(model, prompt, settings).tokens
    assert all(m.generate(model, prompt, settings).tokens == expected for m in methods)
    with pytest.raises(ValueError, match="unknown lookup drafter option"):
        parse_method("lookup[width=2]").drafter(model)
    # typed options reach every drafter's factory: an early-exit policy set in the spec
    from early_exit.classifier import new_classifier
    new_classifier(model, 2, adapter_layers=1).save_pretrained(tmp_path / "x", model)
    exit_drafter = parse_method(f"early-exit:{tmp_path / 'x'}[max_depth=2,threshold=0.5]").drafter(model)
    assert (exit_drafter.policy.max_depth, exit_drafter.policy.threshold) == (2, 0.5)


def test_method_lists_keep_commas_inside_options(tmp_path, capsys):
    from selfspec.bench.methods import split_methods
    from selfspec.cli import main

    assert split_methods("vanilla, lookup[nodes=8,num_tokens=4],medusa:d+lookup[nodes=2] ,") == [
        "vanilla", "lookup[nodes=8,num_tokens=4]", "medusa:d+lookup[nodes=2]"]
    for bad in ("lookup[nodes=8", "lookup]"):
        with pytest.raises(ValueError, match="without its"):
            split_methods(bad)
    assert main(["bench", "--model", "tiny:llama", "--limit", "1", "--max-new-tokens", "6", "--threads", "1",
                 "--methods", "vanilla,lookup[num_tokens=2,tokens_per_match=none],lookup", "--out",
                 str(tmp_path / "b"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "lookup[num_tokens=2,tokens_per_match=none]" in out
