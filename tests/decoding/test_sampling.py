"""Speculative sampling keeps the base model's distribution exactly (temperature, top-k, top-p).

On a 6-token vocabulary the joint distribution of the first three generated tokens has 216 cells. 5,000 seeded
runs of our loop (with matched and adversarial draft distributions) are compared with 5,000 samples of plain
transformers sampling by a two-sample chi-square test, and both with the exact distribution. A deliberately wrong
acceptance rule must fail the same test, so the test can fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding import DrafterBase, DraftTree, generate, verify
from decoding.drafter import SamplingParams
from selfspec.testing import tiny_model

VOCAB = 6
RUNS = 5000
ALPHA = 1e-3
PROMPT = torch.tensor([[1, 4, 2, 5]])
CONFIGS = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7": SamplingParams(temperature=0.7),
    "topk3": SamplingParams(temperature=1.0, top_k=3),
    "topp0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = tiny_model("llama", dtype=torch.float64, vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    with torch.no_grad():  # flatten the sharpened head a little: every cell should be reachable
        m.lm_head.weight.mul_(0.15)
    return m


@pytest.fixture(scope="module")
def raw_logits(model):
    """Base logits after the prompt plus every generated prefix of length 0, 1 and 2."""
    table = {}
    for length in range(3):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long)], dim=1)
            with torch.no_grad():
                table[prefix] = model(ids).logits[0, -1]
    return table


def exact_joint(raw_logits, sampling) -> torch.Tensor:
    probs = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    for i, (a, b, c) in enumerate(itertools.product(range(VOCAB), repeat=3)):
        pa = verify.target_probs(raw_logits[()][None], sampling)[0, a]
        pb = verify.target_probs(raw_logits[(a,)][None], sampling)[0, b]
        pc = verify.target_probs(raw_logits[(a, b)][None], sampling)[0, c]
        probs[i] = pa * pb * pc
    return probs


class TableDrafter(DrafterBase):
    """Draws a depth-2 tree (2 children per node) i.i.d. from a draft distribution q(context)."""

    def __init__(self, raw_logits, mode: str, generator: torch.Generator):
        self.raw, self.mode, self.g = raw_logits, mode, generator

    def q(self, prefix):
        logits = self.raw[prefix]
        if self.mode == "matched":  # close to p but not equal to it
            return 0.8 * torch.softmax(logits, -1) + 0.2 / VOCAB
        return torch.softmax(-2.0 * logits, -1)  # adversarial: favours what the model finds unlikely

    def propose(self, state):
        generated = tuple(state.sequence[0, PROMPT.shape[1]:].tolist())
        if len(generated) != 1:
            return None
        q1 = self.q(generated)
        first = torch.multinomial(q1, 2, replacement=True, generator=self.g).tolist()
        tokens, parents, probs = list(first), [-1, -1], [q1, q1]
        for i, token in enumerate(first):
            q2 = self.q(generated + (token,))
            for t in torch.multinomial(q2, 2, replacement=True, generator=self.g).tolist():
                tokens.append(t)
                parents.append(i)
                probs.append(q2)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(probs))


class TopTwoDrafter(TableDrafter):
    """Deterministic drafts (no draft_probs): the two most likely tokens under q, like Medusa's top-k."""

    def propose(self, state):
        generated = tuple(state.sequence[0, PROMPT.shape[1]:].tolist())
        if len(generated) != 1:
            return None
        first = torch.topk(self.q(generated), 2).indices.tolist()
        tokens, parents = list(first), [-1, -1]
        for i, token in enumerate(first):
            tokens += torch.topk(self.q(generated + (token,)), 2).indices.tolist()
            parents += [i, i]
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def counts_of(samples: torch.Tensor) -> torch.Tensor:
    codes = samples[:, 0] * VOCAB * VOCAB + samples[:, 1] * VOCAB + samples[:, 2]
    return torch.bincount(codes, minlength=VOCAB ** 3).double()


def chi2_pvalue(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def merged_bins(expected: torch.Tensor, *observed: torch.Tensor):
    """Merge every cell expected to hold fewer than 5 counts into one bin (the usual chi-square validity rule)."""
    small = expected < 5
    out = [torch.cat([x[~small], x[small].sum().reshape(1)]) for x in (expected, *observed)]
    keep = out[0] > 0
    return [x[keep] for x in out]


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected, observed = merged_bins(probs * counts.sum(), counts)
    stat = float(((observed - expected) ** 2 / expected).sum())
    return chi2_pvalue(stat, len(expected) - 1)


def two_sample(a: torch.Tensor, b: torch.Tensor) -> float:
    expected, a, b = merged_bins((a + b) / 2, a, b)
    both = a + b
    stat = float(((a - b) ** 2 / both).sum())
    return chi2_pvalue(stat, len(both) - 1)


def our_samples(model, raw_logits, sampling, drafter_cls, mode, seed=0):
    generator = torch.Generator().manual_seed(seed)
    drafter = drafter_cls(raw_logits, mode, torch.Generator().manual_seed(seed + 1))
    out = []
    for _ in range(RUNS):
        seq = generate(model, drafter, PROMPT, max_new_tokens=4, temperature=sampling.temperature,
                       top_k=sampling.top_k, top_p=sampling.top_p, generator=generator, eos_token_id=[]).sequences
        out.append(seq[0, PROMPT.shape[1]:PROMPT.shape[1] + 3])
    return torch.stack(out)


def hf_samples(model, sampling, seed=0):
    torch.manual_seed(seed)
    out = model.generate(PROMPT.repeat(RUNS, 1), do_sample=True, max_new_tokens=3, temperature=sampling.temperature,
                         top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0, pad_token_id=0)
    return out[:, PROMPT.shape[1]:]


# Every sampling config with a matched and an adversarial draft; deterministic top-2 drafts (Medusa-like) once.
CASES = [(config, mode) for config in CONFIGS for mode in ("matched", "adversarial")] + [("topp0.8", "top2")]


@pytest.mark.slow
@pytest.mark.parametrize("config,mode", CASES)
def test_speculative_sampling_matches_hf_distribution(model, raw_logits, config, mode):
    sampling = CONFIGS[config]
    drafter_cls = TopTwoDrafter if mode == "top2" else TableDrafter
    ours = counts_of(our_samples(model, raw_logits, sampling, drafter_cls, "matched" if mode == "top2" else mode))
    hf = counts_of(hf_samples(model, sampling))
    exact = exact_joint(raw_logits, sampling)
    assert goodness_of_fit(hf, exact) > ALPHA  # the exact distribution is the one transformers samples
    assert two_sample(ours, hf) > ALPHA
    assert goodness_of_fit(ours, exact) > ALPHA


def _wrong_rule(tree, logits, sampling, generator=None):
    """A classic bug: after rejecting a draft, resample from p instead of the residual max(p - q, 0)."""
    p_all = verify.target_probs(logits, sampling)
    accepted, node = [], -1
    while True:
        p = p_all[node + 1]
        for child in tree.children[node + 1]:
            x = int(tree.tokens[child])
            q_x = float(tree.draft_probs[child][x])
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * q_x < float(p[x]):
                accepted.append(child)
                node = child
                break
        else:
            return verify.Verdict(accepted, int(torch.multinomial(p, 1, generator=generator)))


@pytest.mark.slow
def test_wrong_acceptance_rule_is_detected(model, raw_logits, monkeypatch):
    monkeypatch.setattr(verify, "speculative", _wrong_rule)
    sampling = CONFIGS["t1.0"]
    ours = counts_of(our_samples(model, raw_logits, sampling, TableDrafter, "adversarial"))
    hf = counts_of(hf_samples(model, sampling))
    assert two_sample(ours, hf) < ALPHA
    assert goodness_of_fit(ours, exact_joint(raw_logits, sampling)) < ALPHA


def test_speculative_with_all_accepted_none_accepted_some_accepted():
    """Format checks of the verdict with certain outcomes (one-hot targets)."""
    vocab = 5
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1]))
    sampling = SamplingParams(temperature=1.0)
    big = 50.0
    g = torch.Generator().manual_seed(0)

    def onehot_logits(rows):
        logits = torch.zeros(len(rows), vocab, dtype=torch.float64)
        for i, t in enumerate(rows):
            logits[i, t] = big
        return logits

    all_ok = verify.speculative(tree, onehot_logits([1, 2, 3, 4]), sampling, g)
    assert all_ok.accepted == [0, 1, 2] and all_ok.next_token == 4
    none_ok = verify.speculative(tree, onehot_logits([0, 2, 3, 4]), sampling, g)
    assert none_ok.accepted == [] and none_ok.next_token == 0
    some_ok = verify.speculative(tree, onehot_logits([1, 4, 3, 4]), sampling, g)
    assert some_ok.accepted == [0] and some_ok.next_token == 4
    greedy = verify.greedy(tree, onehot_logits([1, 4, 3, 4]))
    assert greedy.accepted == [0] and greedy.next_token == 4
