"""scripts/draft_accuracy.py scores what the decode loop would draft: its depth-1 and chain counts equal a recount
made the decode way (the verified prefix extended position by position, one draft step at a time)."""

from __future__ import annotations

import pytest
import torch

from eagle.model import DraftCache
from selfspec.runtime.tiny import tiny_model
from selfspec.testing import eagle_draft, load_script, random_prompt


@pytest.fixture(scope="module")
def script():
    return load_script("draft_accuracy")


def decode_way(model, draft, full, start, depths):
    """Per position t >= start - 1: whether the first draft matches (every t with a target), and how many of a
    ``depths``-long chain's drafts match (every t with all its targets), each depth fed the true previous token."""
    with torch.no_grad():
        hidden = model(full, output_hidden_states=True).hidden_states
        fused = draft.fuse([hidden[i] for i in draft.config.aux_layers])
        vocab, s = draft.draft_vocab, full.shape[1]
        first, chains = [], []
        for t in range(start - 1, s - 2):
            cache = DraftCache()
            positions = torch.arange(t + 1)[None]
            mask = (torch.arange(t + 1)[None, :] <= positions[0, :, None])[None, None]
            out = draft.step(fused[:, :t + 1], full[:, 1:t + 2], positions, mask, cache)[:, -1:]
            accepted, alive = 0, True
            for j in range(min(depths, s - 2 - t)):
                if j:
                    out = draft.step(out, full[:, t + j + 1:t + j + 2], torch.tensor([[t + j]]), None, cache)
                ok = bool(vocab[draft.logits(out[0, 0]).argmax()] == full[0, t + j + 2])
                if j == 0:
                    first.append(ok)
                alive = alive and ok
                accepted += alive
            if t + depths + 1 < s:
                chains.append(accepted)
    return first, chains


def half_drafted(model, draft, prompt, new_tokens, seed=0):
    """``prompt`` + ``new_tokens`` tokens, each the drafter's own depth-1 guess with probability 1/2 (else random):
    a text a random drafter is often right on (scored the same whatever wrote it)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.cat([prompt, torch.randint(2, 96, (1, 1), generator=generator)], dim=1)
    with torch.no_grad():
        while ids.shape[1] < prompt.shape[1] + new_tokens:
            hidden = model(ids, output_hidden_states=True).hidden_states
            out = draft.unroll([hidden[i] for i in draft.config.aux_layers], ids, torch.ones_like(ids), 1)[0]
            guess = draft.draft_vocab[draft.logits(out[0, -2]).argmax()]  # position len-2 predicts the next token
            coin = torch.rand((), generator=generator) < 0.5
            token = guess if coin else torch.randint(2, 96, (), generator=generator)
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids


def test_scores_equal_a_decode_time_recount(script):
    model = tiny_model("llama")
    draft = eagle_draft(model, seed=4, draft_vocab_size=64).eval()
    prompt = random_prompt(6, seed=3)
    full = half_drafted(model, draft, prompt, 30)
    start, depths = prompt.shape[1], 3
    result = script.score(model, draft, [(full, start)], depths=depths)
    first, chains = decode_way(model, draft, full, start, depths)
    answer_positions = full.shape[1] - start - 1
    assert 0.25 < sum(first) / len(first) < 0.9, "the text should make the drafter right about half the time"
    assert result["answers"] == 1 and result["answer_tokens"] == full.shape[1] - start
    assert len(first) == answer_positions
    assert result["top1_per_depth"][0] == pytest.approx(sum(first) / answer_positions)
    assert max(chains) >= 1
    assert result["chain_accepted"] == pytest.approx(sum(chains) / len(chains))
    topk = result["depth1_topk"]
    assert topk[1] == pytest.approx(result["top1_per_depth"][0])
    assert topk[1] <= topk[2] <= topk[4] <= topk[8] <= 1.0
    expected_in_vocab = torch.isin(full[0, start:], draft.draft_vocab).float().mean().item()
    assert result["in_draft_vocab"] == pytest.approx(expected_in_vocab)
    assert script.score(model, draft, [(full, start)], depths=depths, full_vocab=True)["in_draft_vocab"] == 1.0


def test_first_drafts_are_scored_by_how_sure_the_base_was(script, monkeypatch):
    """``by_confidence`` splits the first drafts by the base's own probability of their target: every position lands
    in one bin (the shares add up to 1, the bins' hits to the overall depth-1 top-1), and each position's bin is the
    one its probability, recomputed here from the base's logits, falls in."""
    model = tiny_model("llama")
    draft = eagle_draft(model, seed=4, draft_vocab_size=64).eval()
    prompt = random_prompt(6, seed=3)
    full = half_drafted(model, draft, prompt, 30)
    start = prompt.shape[1]
    with torch.no_grad():
        probs = torch.softmax(model(full).logits[0, start:-1], -1).gather(-1, full[0, start + 1:, None])[:, 0]
    # a random tiny base is never sure: bins at its probabilities' terciles, so that every bin holds positions
    low, high = (round(float(q), 6) for q in probs.quantile(torch.tensor([1 / 3, 2 / 3])))
    edges = (0.0, low, high, 1.0)
    monkeypatch.setattr(script, "CONFIDENCE_BINS", edges)
    result = script.score(model, draft, [(full, start)], depths=2)
    bins = result["by_confidence"]
    assert [b["base_prob"] for b in bins] == [list(p) for p in zip(edges, edges[1:])]
    assert sum(b["share"] for b in bins) == pytest.approx(1.0)
    assert sum(b["share"] * b["top1"] for b in bins) == pytest.approx(result["top1_per_depth"][0])
    counts = [int(((probs >= a) & ((probs < b) if b < 1 else (probs <= b))).sum()) for a, b in zip(edges, edges[1:])]
    assert [round(b["share"] * len(probs)) for b in bins] == counts and min(counts) > 0
