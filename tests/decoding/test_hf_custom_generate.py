"""selfspec inside transformers' own ``model.generate`` (``custom_generate=selfspec.hf.CUSTOM_GENERATE``): greedy
output equal to plain ``generate`` with any drafter, sampling honoured, unsupported requests refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, StoppingCriteria, StoppingCriteriaList

from eagle.model import save_pretrained
from selfspec.hf import CUSTOM_GENERATE
from selfspec.runtime.tiny import tiny_model
from selfspec.testing import eagle_draft, random_prompt


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama")
    heads = tmp_path_factory.mktemp("eagle") / "d"
    save_pretrained(eagle_draft(model, draft_vocab_size=60), heads)
    return model, str(heads)


@pytest.mark.parametrize("draft", ["eagle", "eagle+lookup", "lookup", "none"])
def test_greedy_custom_generate_equals_plain_generate(setup, draft):
    model, heads = setup
    for n in (3, 12):
        ids = random_prompt(n, seed=n)
        plain = model.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
        ours = model.generate(ids, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, draft=draft,
                              heads=heads if draft.startswith("eagle") else None, max_new_tokens=24)
        assert torch.equal(ours, plain), (draft, n)


def test_sampling_settings_reach_the_decoder(setup):
    model, heads = setup
    ids = random_prompt(5, seed=2)
    a = model.generate(ids, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, draft="eagle", heads=heads,
                       do_sample=True, temperature=0.9, top_k=20, max_new_tokens=30)
    greedy = model.generate(ids, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, draft="eagle",
                            heads=heads, max_new_tokens=30)
    assert a.shape == greedy.shape and not torch.equal(a, greedy)  # sampled, not the greedy path


@pytest.mark.parametrize("draft", ["eagle", "lookup"])
def test_a_left_padded_batch_equals_generate_on_the_same_batch(setup, draft):
    """HF's convention: left-padded prompts with an attention mask in, prompts + new tokens (right-padded) out."""
    model, heads = setup
    prompts = [random_prompt(n, seed=n)[0] for n in (3, 9, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = p, 1
    plain = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0)
    ours = model.generate(ids, attention_mask=mask, custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                          draft=draft, heads=heads if draft == "eagle" else None, max_new_tokens=20, pad_token_id=0)
    assert torch.equal(ours, plain)


def test_unsupported_requests_are_refused(setup):
    model, heads = setup
    ids = random_prompt(5, seed=2)
    with pytest.raises(ValueError, match="without streamers, stopping criteria or logits processors"):
        model.generate(torch.cat([ids, ids]), custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                       max_new_tokens=4, repetition_penalty=1.3, pad_token_id=0)


PROCESSOR_SETTINGS = [
    {"repetition_penalty": 1.6},
    {"no_repeat_ngram_size": 2},
    {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "min_new_tokens": 20},
    {"bad_words_ids": "top"},  # filled in below: the tokens the unconstrained answer uses most
    {"logits_processor": "repetition"},  # a processor object passed in, as model.generate takes it
]


@pytest.mark.parametrize("settings", PROCESSOR_SETTINGS, ids=lambda d: "+".join(d))
@pytest.mark.parametrize("draft", ["eagle", "lookup"])
def test_logits_processors_apply_per_tree_node_and_match_generate(setup, settings, draft):
    """Processors change the target distribution: each tree node is scored with its own prefix, so the answer is
    model.generate's with the same settings (and differs from the unprocessed one)."""
    model, heads = setup
    for n in (4, 11):
        ids = random_prompt(n, seed=n + 1)
        unprocessed = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
        kwargs = dict(settings)
        if kwargs.get("bad_words_ids") == "top":
            counts = torch.bincount(unprocessed[0, n:])
            kwargs["bad_words_ids"] = [[int(t)] for t in counts.topk(2).indices]
        if kwargs.get("logits_processor") == "repetition":
            kwargs["logits_processor"] = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8)])
        plain = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None, **kwargs)
        assert not torch.equal(plain, unprocessed)
        ours = model.generate(ids, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, draft=draft,
                              heads=heads if draft == "eagle" else None, max_new_tokens=24, eos_token_id=None,
                              **kwargs)
        assert torch.equal(ours, plain), (settings, draft, n)


def test_processors_with_random_trees_match_generate():
    """decoding.generate(logits_processor=...) under drafts that copy the processed answer most of the time (deep,
    partial and branching acceptances), float64."""
    from transformers import NoRepeatNGramLogitsProcessor

    from decoding import generate
    from selfspec.testing import RandomDrafter

    model = tiny_model("qwen2", dtype=torch.float64)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.4), NoRepeatNGramLogitsProcessor(2)])
    for seed in range(6):
        ids = random_prompt(3 + 4 * seed, seed=seed)
        reference = model.generate(ids, do_sample=False, max_new_tokens=30, pad_token_id=0, repetition_penalty=1.4,
                                   no_repeat_ngram_size=2)
        drafter = RandomDrafter(96, size=3 + seed, seed=seed, reference=reference, hit_rate=0.8)
        out = generate(model, drafter, ids, max_new_tokens=30, logits_processor=processors)
        assert out.sequences.tolist() == reference.tolist() and out.stats.tau > 1.5


class StopAfterToken(StoppingCriteria):
    """Stop once ``token`` has been generated (a custom criterion that only looks at the ids)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] == self.token)


def test_stopping_criteria_and_stop_strings_stop_where_generate_stops(setup):
    from selfspec.runtime.models import load_model
    from selfspec.testing import eagle_draft as draft_for

    model, tokenizer = load_model("tiny:llama")
    heads = Path(setup[1]).parent / "bytes"
    save_pretrained(draft_for(model, draft_vocab_size=100), heads)
    ids = torch.tensor([tokenizer("<|im_start|>user\\nhello<|im_end|>\\n")["input_ids"]])
    full = model.generate(ids, do_sample=False, max_new_tokens=40, min_new_tokens=40, pad_token_id=0)
    new = full[0, ids.shape[1]:].tolist()
    token = new[9]
    # a stop string the continuation really contains: the first printable character it decodes to after a few tokens
    text = next(c for t in new[3:] for c in [tokenizer.decode([t])] if len(c) == 1 and c.isalnum())
    for extra in ({"stopping_criteria": StoppingCriteriaList([StopAfterToken(token)])},
                  {"stop_strings": [text], "tokenizer": tokenizer}):
        plain = model.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0, **extra)
        ours = model.generate(ids, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, draft="eagle+lookup",
                              heads=str(heads), max_new_tokens=40, **extra)
        assert torch.equal(ours, plain) and plain.shape[1] < full.shape[1], extra
