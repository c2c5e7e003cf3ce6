"""The datastore drafter: its index finds exactly the occurrences a brute-force scan finds, the tree follows the
majority of them, a saved datastore reloads (and refuses damage or a foreign vocabulary), the command builds one, and
decoding with it alone or merged stays token-identical to greedy generate."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import decoding
from decoding import make_drafter
from decoding.drafter import DecodeState, SamplingParams
from lookup import LookupDrafter
from lookup.datastore import SEPARATOR, Datastore, DatastoreDrafter
from medusa import MedusaDrafter, MedusaHeads
from selfspec.runtime.io import DamagedDirectoryError
from selfspec.runtime.models import load_model
from selfspec.testing import ARCHITECTURES, tiny_model, write_prompt_response_data


def _brute_force(documents, sequence, limit):
    """The longest n <= limit whose last-n tokens of ``sequence`` occur in a document, and where they end."""
    best, ends = 0, []
    offset = 1  # tokens[0] is the leading separator
    for doc in documents:
        for end in range(len(doc)):
            n = 0
            while n < limit and n < len(sequence) and end - n >= 0 and doc[end - n] == sequence[-1 - n]:
                n += 1
            if n > best:
                best, ends = n, []
            if n == best and n > 0:
                ends.append(offset + end)
        offset += len(doc) + 1
    return best, sorted(ends)


@pytest.mark.parametrize("vocab", [3, 7, 50000, 300000])  # 300000: fewer tokens fit one packed key
def test_index_finds_what_a_scan_finds(vocab):
    g = np.random.default_rng(vocab)
    documents = [g.integers(0, vocab if vocab < 10 else 5, size=int(g.integers(1, 30))).tolist() for _ in range(12)]
    if vocab > 10:  # large ids, few distinct: the packing must still order them
        documents = [[t * (vocab // 5) + 1 for t in d] for d in documents]
    store = Datastore.build(documents, context=6)
    for trial in range(150):
        source = documents[int(g.integers(len(documents)))]
        sequence = source[:int(g.integers(1, len(source) + 1))]
        if trial % 3 == 0:  # also queries that occur nowhere in full
            sequence = [int(g.integers(0, 4)) * (vocab // 5 if vocab > 10 else 1) + (1 if vocab > 10 else 0)] + sequence
        limit = int(g.integers(1, 8))
        n, lo, hi = store.match(sequence, limit)
        best, ends = _brute_force(documents, sequence, min(limit, 6))
        assert n == best, (sequence, limit)
        assert sorted(store.order[lo:hi].tolist()) == (ends if n else []), (sequence, limit)
    assert store.match([vocab * 10], 4) == (0, 0, 0)  # an id the corpus never holds
    assert store.match([], 4) == (0, 0, 0)


def test_continuations_stop_at_the_document_end_and_the_tree_follows_the_majority():
    store = Datastore.build([[1, 2, 3, 4], [1, 2, 3, 4], [9, 2, 3, 5], [2, 3]], context=4)
    n, lo, hi = store.match([7, 2, 3], 4)
    assert n == 2 and hi - lo == 4
    rows = store.continuations(lo, hi, depth=3, max_occurrences=10).tolist()
    assert sorted(rows) == sorted([[4, SEPARATOR, 1], [4, SEPARATOR, 9], [5, SEPARATOR, 2], [SEPARATOR, SEPARATOR,
                                                                                                  SEPARATOR]])
    state = DecodeState(model=None, cache=None, sequence=torch.tensor([[7, 2, 3]]), sampling=SamplingParams())
    tree = DatastoreDrafter(store, nodes=4, num_tokens=3, min_score=0.0).propose(state)
    assert tree.tokens.tolist() == [4, 5] and tree.parents.tolist() == [-1, -1]  # 4 (2 of 4) before 5 (1 of 4)
    assert DatastoreDrafter(store, min_score=0.3).propose(state).tokens.tolist() == [4]
    assert DatastoreDrafter(store, min_ngram=3).propose(state) is None  # a 2-token match is too short here
    assert len(store.continuations(lo, hi, depth=2, max_occurrences=2)) == 2


def test_save_load_and_bad_input(tmp_path):
    store = Datastore.build([[5, 6, 7], [5, 6, 8]], context=3, meta={"vocab_size": 11})
    store.save(tmp_path / "ds", card="# card\n")
    loaded = Datastore.load(tmp_path / "ds")
    assert loaded.tokens.tolist() == store.tokens.tolist() and loaded.order.tolist() == store.order.tolist()
    assert loaded.meta["vocab_size"] == 11 and loaded.meta["num_documents"] == 2 and loaded.context == 3
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="vocabulary of 11 tokens, the model has"):
        make_drafter("datastore", model, str(tmp_path / "ds"))
    with pytest.raises(ValueError, match="two directories"):
        make_drafter(f"datastore:{tmp_path / 'ds'}", model, str(tmp_path / "ds"))
    with pytest.raises(ValueError, match="needs its directory"):
        make_drafter("datastore", model)
    with pytest.raises(ValueError, match="unknown datastore drafter option"):
        make_drafter("datastore", model, str(tmp_path / "ds"), width=2)
    (tmp_path / "ds" / "order.npy").write_bytes(b"garbage")
    with pytest.raises(DamagedDirectoryError, match="order.npy"):
        Datastore.load(tmp_path / "ds")
    heads = tmp_path / "heads"
    MedusaHeads.for_model(model, num_heads=1).save_pretrained(heads)
    with pytest.raises(ValueError, match="is not a datastore"):
        Datastore.load(heads)
    with pytest.raises(ValueError, match="no token"):
        Datastore.build([[], []])
    with pytest.raises(ValueError, match="ids >= 0"):
        Datastore.build([[1, -3]])
    with pytest.raises(ValueError, match="min_ngram"):
        DatastoreDrafter(store, min_ngram=5, max_ngram=2)


def test_the_command_builds_a_datastore_from_conversations(tmp_path, capsys):
    from selfspec.cli import main

    data = write_prompt_response_data(tmp_path / "data.jsonl", n=5)
    assert main(["datastore", "--data", str(data), "--out", str(tmp_path / "ds"), "--model", "tiny:llama",
                 "--context", "8"]) == 0
    assert "5 conversations" in capsys.readouterr().out
    store = Datastore.load(tmp_path / "ds")
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert config["context"] == 8 and config["num_documents"] == 5 and store.meta["vocab_size"] == config["vocab_size"]
    assert "--context 8" in (tmp_path / "ds" / "README.md").read_text()
    # only the assistant turns: each answer is one document, and every token of it is indexed
    assert main(["datastore", "--data", str(data), "--out", str(tmp_path / "answers"), "--model", "tiny:llama",
                 "--turns", "assistant"]) == 0
    answers = Datastore.load(tmp_path / "answers")
    assert answers.meta["turns"] == "assistant" and answers.meta["num_documents"] == 5
    assert answers.meta["num_tokens"] < store.meta["num_tokens"]
    _, tokenizer = load_model("tiny:llama")
    text = tokenizer.decode([t for t in answers.tokens.tolist() if t >= 0])
    assert "1 plus 1 is 2." in text and "Question" not in text
    # each part of a merged drafter may name its own directory, on the command line as in the benchmark
    assert main(["generate", "--model", "tiny:llama", "--prompt", "Question 1: what is 1 plus 1?", "--json",
                 "--draft", f"lookup+datastore:{tmp_path / 'ds'}", "--max-new-tokens", "6"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]["new_tokens"] == 6
    # several datasets are indexed together
    more = write_prompt_response_data(tmp_path / "more.jsonl", n=3)
    assert main(["datastore", "--data", str(data), str(more), "--out", str(tmp_path / "both"), "--model",
                 "tiny:llama", "--context", "8"]) == 0
    both = Datastore.load(tmp_path / "both")
    assert both.meta["num_documents"] == 8 and str(more) in (tmp_path / "both" / "README.md").read_text()
    assert main(["datastore", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x"),
                 "--model", "tiny:llama"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_equality_with_the_datastore_alone_and_merged(arch, tmp_path):
    model = tiny_model(arch, dtype=torch.float64)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for seed in range(2):
        prompt = torch.randint(1, vocab, (1, 6), generator=torch.Generator().manual_seed(seed))
        expected = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        # the corpus: the model's own continuations of this prompt and of others (what self-distillation stores),
        # plus noise, so that the index proposes right and wrong continuations
        corpus = [expected[0].tolist(), torch.randint(1, vocab, (40,), generator=g).tolist()]
        store = Datastore.build(corpus, context=8, meta={"vocab_size": vocab})
        store.save(tmp_path / f"ds{seed}")
        heads = MedusaHeads.for_model(model, num_heads=2)
        for drafter in (DatastoreDrafter(store, min_ngram=1),
                        make_drafter(f"lookup+datastore:{tmp_path / f'ds{seed}'}", model),
                        decoding.combine(MedusaDrafter(heads, tree=[[0], [1]]), LookupDrafter(),
                                         DatastoreDrafter(store, nodes=6, num_tokens=6))):
            out = decoding.generate(model, drafter, prompt, max_new_tokens=24, eos_token_id=None)
            assert out.sequences.tolist() == expected.tolist()
            accepted += sum(out.stats.accepted_per_step)
    assert accepted > 0  # the datastore held the answers: drafts were accepted


def test_batch_rows_share_one_index_and_decode_as_alone():
    from decoding.batch import fork, generate_batch

    model = tiny_model("llama")
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 5)]
    expected = [model.generate(p, max_new_tokens=16, min_new_tokens=16, do_sample=False) for p in prompts]
    store = Datastore.build([e[0].tolist() for e in expected], context=8)
    drafter = decoding.combine(LookupDrafter(), DatastoreDrafter(store, min_ngram=1))
    assert fork(drafter).drafters[1].datastore is store  # forks share the index, never copy it
    out = generate_batch(model, drafter, prompts, max_new_tokens=16)
    assert [s.tolist() for s in out.sequences] == [e.tolist() for e in expected]
    assert all(s.tau > 1.5 for s in out.stats)  # every row's own answer is in the store


@pytest.mark.real_model
@pytest.mark.xdist_group("real_model")
def test_smollm2_with_a_datastore_of_its_own_answers_on_the_skinny_kernel(smollm2):
    """The setting of the benchmark: the model's own greedy answers to other prompts indexed, then prompt lookup +
    datastore on the skinny kernel, against HF generate on the same kernel."""
    from selfspec.runtime.kernels import linear_backend
    from selfspec.runtime.prompts import encode_prompt
    from selfspec.testing import hf_greedy_continuations

    model, tokenizer = smollm2
    with linear_backend(model, "skinny"):
        corpus = hf_greedy_continuations(model, tokenizer, ("List three fruits.", "Write a Python function that adds "
                                         "two numbers.", "Explain what a noun is."), 48)
        store = Datastore.build([ids[0] for ids in corpus.values()], meta={"vocab_size": model.config.vocab_size})
        drafter = decoding.combine(LookupDrafter(), DatastoreDrafter(store))
        references = hf_greedy_continuations(model, tokenizer, ("List three vegetables.", "Write a Python function "
                                             "that multiplies two numbers."), 48)
        taus = []
        for text, expected in references.items():
            ids = encode_prompt(tokenizer, text)
            out = decoding.generate(model, drafter, ids, max_new_tokens=48, eos_token_id=tokenizer.eos_token_id)
            assert out.sequences.tolist() == expected, text
            taus.append(out.stats.tau)
    assert sum(taus) / len(taus) > 1.3, taus
