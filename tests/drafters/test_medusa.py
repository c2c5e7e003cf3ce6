"""Medusa heads and drafter on tiny random models: config, zero-init, save/load, base-model checks, trees, and
greedy equality of Medusa decoding with the base model's own ``generate``."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import decoding
import medusa
from decoding import DecodeState, SamplingParams, TreeTemplate, make_drafter
from medusa import MedusaConfig, MedusaDrafter, MedusaHeads, default_tree, expected_accept_length
from medusa.trees import prior_accuracy
from selfspec.runtime.identity import BaseModelMismatchError
from selfspec.testing import randomize_heads, tiny_model

HIDDEN, VOCAB = 32, 96  # selfspec.testing's tiny models




def last_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, output_hidden_states=True).hidden_states[-1]


# --- config ---------------------------------------------------------------------------------------------------

def test_config_round_trip(tmp_path):
    config = MedusaConfig(num_heads=3, num_layers=2, hidden_size=HIDDEN, vocab_size=VOCAB,
                          base_model={"name": "x", "fingerprint": "abc"}, tree=[[0], [0, 0], [1]],
                          head_accuracy=[[0.5, 0.2], [0.3, 0.1], [0.2, 0.05]], training={"lr": 1e-3, "steps": 7})
    config.save(tmp_path)
    assert MedusaConfig.load(tmp_path) == config
    assert MedusaConfig.load(tmp_path / "config.json") == config
    assert MedusaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("bad, match", [
    (dict(num_heads=0), "num_heads must be an integer >= 1"),
    (dict(num_layers=0), "num_layers must be an integer >= 1"),
    (dict(num_heads=2.5), "num_heads"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(num_heads=2, head_accuracy=[[0.5]]), "1 rows for 2 heads"),
    (dict(num_heads=1, head_accuracy=[[1.5]]), r"in \[0, 1\]"),
    (dict(num_heads=1, tree=[[0], [0, 0]]), "only 1 heads"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        MedusaConfig(**bad)


def test_config_unknown_key_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="unknown MedusaConfig key.*num_head"):
        MedusaConfig.from_dict({"num_head": 3})
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        MedusaConfig.load(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        MedusaConfig.load(tmp_path)


# --- heads ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("share", [True, False])
def test_zero_init_heads_equal_base_prediction(tiny_arch, share):
    model = tiny_model(tiny_arch, dtype=torch.float64)
    heads = MedusaHeads.for_model(model, num_heads=3, num_layers=2, share_lm_head=share)
    ids = torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        logits = heads(out.hidden_states[-1])  # [heads, batch, seq, vocab]
    assert logits.shape == (3, 2, 7, VOCAB)
    for k in range(3):
        torch.testing.assert_close(logits[k], out.logits, rtol=1e-10, atol=1e-10)


def test_heads_shapes_parameters_and_partial_heads(tiny_llama64):
    heads = randomize_heads(MedusaHeads.for_model(tiny_llama64, num_heads=4, num_layers=2))
    # Shared LM head: the heads' own ResBlocks are all there is to train and save.
    assert {n for n, _ in heads.named_parameters()} == {"resblock_weight", "resblock_bias"}
    assert sum(p.numel() for p in heads.parameters()) == 4 * 2 * (HIDDEN * HIDDEN + HIDDEN)
    assert heads.resblock_weight.dtype == torch.float64
    hidden = last_hidden(tiny_llama64, torch.tensor([[1, 5, 9]]))
    features = heads.features(hidden)
    assert features.shape == (4, 1, 3, HIDDEN)
    logits = heads(hidden)
    torch.testing.assert_close(logits, tiny_llama64.get_output_embeddings()(features))
    torch.testing.assert_close(heads(hidden, num_heads=2), logits[:2])
    # Distinct weights per head: no two heads agree.
    for a, b in itertools.combinations(range(4), 2):
        assert not torch.allclose(logits[a], logits[b])


def test_private_lm_heads_are_parameters(tiny_llama64):
    heads = MedusaHeads.for_model(tiny_llama64, num_heads=2, share_lm_head=False)
    assert {n for n, _ in heads.named_parameters()} == {"resblock_weight", "resblock_bias", "lm_head_weight"}
    assert heads.lm_head_weight.shape == (2, VOCAB, HIDDEN)
    # A private copy: training it leaves the base model's LM head alone.
    with torch.no_grad():
        heads.lm_head_weight.zero_()
    assert tiny_llama64.get_output_embeddings().weight.abs().sum() > 0


def test_for_model_rejects_fields_read_from_the_model(tiny_llama64):
    with pytest.raises(ValueError, match="reads.*hidden_size"):
        MedusaHeads.for_model(tiny_llama64, hidden_size=8)
    with pytest.raises(ValueError, match="num_heads must be"):
        MedusaHeads.for_model(tiny_llama64, num_heads=0)
    with pytest.raises(ValueError, match="unknown MedusaConfig key"):
        MedusaHeads.for_model(tiny_llama64, heads=2)


@pytest.mark.parametrize("share", [True, False])
def test_save_load_round_trip(tmp_path, tiny_llama64, share):
    config = dict(num_heads=3, num_layers=2, share_lm_head=share, head_accuracy=[[0.6, 0.2], [0.4, 0.1], [0.3, 0.1]],
                  tree=[[0], [1], [0, 0]], training={"command": "accelerate launch train/medusa.py", "lr": 1e-3})
    heads = randomize_heads(MedusaHeads.for_model(tiny_llama64, **config))
    out = tmp_path / "heads"
    heads.save_pretrained(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # no temporary directory left behind
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert visible == ["README.md", "config.json", "model.safetensors"]
    readme = (out / "README.md").read_text()
    assert "accelerate launch train/medusa.py" in readme and "0.600" in readme
    loaded = MedusaHeads.from_pretrained(out, tiny_llama64)
    assert loaded.config == heads.config
    hidden = last_hidden(tiny_llama64, torch.tensor([[1, 2, 3, 4]]))
    torch.testing.assert_close(loaded(hidden), heads(hidden), rtol=0, atol=0)
    # Saving again replaces the directory in place.
    randomize_heads(heads, seed=1).save_pretrained(out)
    torch.testing.assert_close(MedusaHeads.from_pretrained(out, tiny_llama64)(hidden), heads(hidden), rtol=0, atol=0)


def test_shared_lm_head_is_not_saved(tmp_path, tiny_llama64):
    from safetensors.torch import load_file

    MedusaHeads.for_model(tiny_llama64).save_pretrained(tmp_path / "h")
    assert set(load_file(str(tmp_path / "h" / "model.safetensors"))) == {"resblock_weight", "resblock_bias"}


def test_heads_refuse_another_base_model(tmp_path):
    model = tiny_model("llama", dtype=torch.float64)
    MedusaHeads.for_model(model).save_pretrained(tmp_path / "h")
    other_model = tiny_model("qwen2", dtype=torch.float64)
    with pytest.raises(BaseModelMismatchError, match="Medusa heads"):
        MedusaHeads.from_pretrained(tmp_path / "h", other_model)
    with pytest.raises(ValueError):  # the mismatch error is a ValueError: the CLI prints it as one line
        medusa.load(other_model, tmp_path / "h")


def test_heads_load_with_a_warning_on_a_model_that_differs_only_in_its_weights(tmp_path):
    """The committed heads were trained on SmolLM2 dequantized from Q4_1; the original fp32 checkpoint or a
    fine-tune has the same shapes and vocabulary: the heads load (with a warning naming the difference) and
    decoding stays exactly that model's."""
    from selfspec.runtime.identity import BaseModelWeightsWarning

    model = tiny_model("llama")
    randomize_heads(MedusaHeads.for_model(model, num_heads=2), scale=0.1).save_pretrained(tmp_path / "h")
    tuned = tiny_model("llama", seed=1)
    with pytest.warns(BaseModelWeightsWarning, match="same architecture, shapes and vocabulary but other weights"):
        drafter = medusa.load(tuned, tmp_path / "h", tree=[[0], [1], [0, 0]])
    ids = torch.randint(2, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    out = decoding.generate(tuned, drafter, ids, max_new_tokens=16)
    expected = tuned.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              min_new_tokens=16, pad_token_id=0)
    assert torch.equal(out.sequences, expected)


def test_heads_load_on_the_same_base_in_another_dtype(tmp_path):
    MedusaHeads.for_model(tiny_model("llama")).save_pretrained(tmp_path / "h")
    heads = MedusaHeads.from_pretrained(tmp_path / "h", tiny_model("llama", dtype=torch.bfloat16))
    assert heads.resblock_weight.dtype == torch.bfloat16  # cast to the base model's LM head


def test_missing_heads_files(tmp_path, tiny_llama64):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "absent")):
        MedusaHeads.from_pretrained(tmp_path / "absent", tiny_llama64)
    MedusaHeads.for_model(tiny_llama64).save_pretrained(tmp_path / "h")
    (tmp_path / "h" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        MedusaHeads.from_pretrained(tmp_path / "h", tiny_llama64)
    (tmp_path / "h" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        MedusaHeads.from_pretrained(tmp_path / "h", tiny_llama64)


def test_weights_that_do_not_match_the_config(tmp_path, tiny_llama64):
    MedusaHeads.for_model(tiny_llama64, num_heads=2).save_pretrained(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**config, "num_heads": 3}))
    with pytest.raises(ValueError, match="config.json has .* bytes"):  # edited after saving: the marker says so
        MedusaHeads.from_pretrained(tmp_path / "h", tiny_llama64)
    from selfspec.runtime.io import _write_marker
    _write_marker(tmp_path / "h")  # a consistent directory whose weights do not fit its config
    with pytest.raises(ValueError, match="does not match"):
        MedusaHeads.from_pretrained(tmp_path / "h", tiny_llama64)


# --- trees ----------------------------------------------------------------------------------------------------

def _prefix_closed(choices) -> bool:
    paths = {tuple(c) for c in choices}
    return all(len(c) == 1 or c[:-1] in paths for c in paths)


def test_default_tree_is_the_best_tree_of_its_size():
    accuracy = [[0.5, 0.3, 0.1], [0.4, 0.2, 0.15], [0.35, 0.1, 0.05]]
    nodes = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    for size in (1, 3, 5):
        tree = default_tree(accuracy, size)
        assert len(tree) == size and _prefix_closed(tree)
        best = max(expected_accept_length(c, accuracy)
                   for c in itertools.combinations(nodes, size) if _prefix_closed(c))
        assert expected_accept_length(tree, accuracy) == pytest.approx(best)


def test_default_tree_prior_and_errors():
    for size in (8, 16, 32):
        tree = default_tree(None, size)
        assert len(tree) == size and _prefix_closed(tree) and max(map(len, tree)) <= 4
        assert tree == sorted(tree, key=lambda c: (len(c), c))
    assert max(map(len, default_tree(None, 32, num_heads=2))) <= 2
    assert all(sum(row) <= 1 for row in prior_accuracy(6))
    with pytest.raises(ValueError, match="size must be >= 1"):
        default_tree(None, 0)
    with pytest.raises(ValueError, match="at most 4 nodes"):
        default_tree([[0.5, 0.5], [0.5]], 5)
    with pytest.raises(ValueError, match="accuracies the heads do not have"):
        expected_accept_length([[0, 0]], [[0.5]])


# --- drafter --------------------------------------------------------------------------------------------------

def _state(model, ids: torch.Tensor) -> DecodeState:
    hidden = last_hidden(model, ids[:, :-1])
    return DecodeState(model=model, cache=None, sequence=ids, sampling=SamplingParams(), hidden={-1: hidden})


@pytest.mark.parametrize("tree", [None, 8, [[0], [0, 0], [0, 0, 0], [1], [1, 0], [2]], "[[0], [1], [0, 1]]"])
def test_drafter_proposes_each_heads_top_k_in_the_tree(tiny_llama64, tree):
    heads = randomize_heads(MedusaHeads.for_model(tiny_llama64, num_heads=3, num_layers=1))
    drafter = MedusaDrafter(heads, tree=tree)
    assert drafter.hidden_layers == (-1,)
    ids = torch.tensor([[1, 7, 3, 11, 5]])
    state = _state(tiny_llama64, ids)
    draft = drafter.propose(state)
    template = drafter.template
    assert len(draft) == len(template) and torch.equal(draft.parents, template.parents)
    # Node at depth d and rank r holds head d-1's r-th best token for the hidden state that predicted the root.
    hidden = state.hidden[-1][0, -1]
    for i, (depth, rank) in enumerate(zip(template.depth.tolist(), template.rank.tolist())):
        head_logits = tiny_llama64.get_output_embeddings()(
            hidden + torch.nn.functional.silu(heads.resblock_weight[depth - 1, 0] @ hidden
                                              + heads.resblock_bias[depth - 1, 0]))
        assert int(draft.tokens[i]) == int(head_logits.topk(rank + 1).indices[rank])


def test_reduced_draft_vocabulary(tiny_llama64, tmp_path):
    heads = randomize_heads(MedusaHeads.for_model(tiny_llama64, num_heads=2, draft_vocab_size=40))
    vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:40]
    heads.set_draft_vocab(vocab)
    drafter = MedusaDrafter(heads, tree=[[0], [1], [2], [0, 0], [0, 1]])
    state = _state(tiny_llama64, torch.tensor([[1, 7, 3, 11, 5]]))
    draft = drafter.propose(state)
    # Each node is the rank-r token among the draft vocabulary's rows of the full logits.
    full = heads(state.hidden[-1][:, -1:]).reshape(2, -1)
    restricted = vocab[full[:, vocab].topk(3, dim=-1).indices]  # [heads, 3] token ids
    template = drafter.template
    for i, (depth, rank) in enumerate(zip(template.depth.tolist(), template.rank.tolist())):
        assert int(draft.tokens[i]) == int(restricted[depth - 1, rank])
    assert set(draft.tokens.tolist()) <= set(vocab.tolist())
    heads.save_pretrained(tmp_path / "h")
    loaded = MedusaHeads.from_pretrained(tmp_path / "h", tiny_llama64)
    assert torch.equal(loaded.draft_vocab, vocab) and loaded.config.draft_vocab_size == 40
    with pytest.raises(ValueError, match="beyond the heads' draft vocabulary of 40"):
        MedusaDrafter(loaded, tree=[[r] for r in range(41)])
    with pytest.raises(ValueError, match="distinct ids"):
        heads.set_draft_vocab(torch.zeros(40, dtype=torch.long))
    with pytest.raises(ValueError, match="needs share_lm_head=True"):
        MedusaHeads.for_model(tiny_llama64, num_heads=2, draft_vocab_size=40, share_lm_head=False)
    with pytest.raises(ValueError, match="full vocabulary"):
        MedusaHeads.for_model(tiny_llama64, num_heads=2).set_draft_vocab(vocab)


def test_greedy_equality_with_a_reduced_draft_vocabulary():
    model = tiny_model("llama", dtype=torch.float64)
    heads = randomize_heads(MedusaHeads.for_model(model, num_heads=3, draft_vocab_size=48), scale=0.5, seed=3)
    heads.set_draft_vocab(torch.arange(VOCAB - 1, VOCAB - 49, -1))
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = decoding.generate(model, MedusaDrafter(heads, tree=TREES["wide41"]), ids, max_new_tokens=24)
        assert out.sequences.tolist() == greedy_reference(model, ids, 24).tolist()


def test_resolve_tree(tiny_llama64, tmp_path):
    heads = MedusaHeads.for_model(tiny_llama64, num_heads=2, tree=[[0], [1]])
    assert MedusaDrafter(heads).template.choices == [[0], [1]]  # the heads' saved tree
    assert len(MedusaDrafter(heads, tree="5").template) == 5
    (tmp_path / "tree.json").write_text("[[0], [0, 0]]")
    assert MedusaDrafter(heads, tree=str(tmp_path / "tree.json")).template.choices == [[0], [0, 0]]
    (tmp_path / "config.json").write_text('{"tree": [[1], [1, 0]]}')
    assert MedusaDrafter(heads, tree=str(tmp_path / "config.json")).template.choices == [[1], [1, 0]]
    assert MedusaDrafter(heads, tree=TreeTemplate.chain(2)).template.max_depth == 2
    with pytest.raises(ValueError, match="3 deep but there are only 2"):
        MedusaDrafter(heads, tree=TreeTemplate.chain(3))
    with pytest.raises(ValueError, match="not a size"):
        MedusaDrafter(heads, tree="wide")
    with pytest.raises(ValueError, match="holds no list of choices"):
        MedusaDrafter(heads, tree='{"size": 3}')
    with pytest.raises(ValueError, match="prefix"):
        MedusaDrafter(heads, tree=[[0, 0]])


def test_dynamic_tree_keeps_the_most_confident_nodes(tiny_llama64):
    heads = randomize_heads(MedusaHeads.for_model(tiny_llama64, num_heads=3), scale=0.5, seed=5)
    drafter = MedusaDrafter(heads, tree=24, dynamic=7)
    pool = drafter.template
    state = _state(tiny_llama64, torch.tensor([[1, 7, 3, 11, 5]]))
    draft = drafter.propose(state)
    assert len(draft) == 7
    # Reference: score every pool node by its path's log-probability, independently of the selector.
    with torch.no_grad():
        log_probs = heads(state.hidden[-1][:, -1:]).reshape(3, -1).log_softmax(-1)
    top = log_probs.topk(pool.max_rank, dim=-1)
    scores = {tuple(c): sum(float(top.values[d, r]) for d, r in enumerate(c)) for c in pool.choices}
    best = sorted(scores, key=lambda c: -scores[c])[:7]
    expected = sorted(best, key=lambda c: (len(c), c))
    assert _prefix_closed(expected)
    tokens = [int(top.indices[len(c) - 1, c[-1]]) for c in expected]
    parents = [expected.index(c[:-1]) if len(c) > 1 else -1 for c in expected]
    assert draft.tokens.tolist() == tokens and draft.parents.tolist() == parents
    # The structure the selector derives equals the one DraftTree derives from parents alone.
    fresh = decoding.DraftTree(draft.tokens, draft.parents)
    assert torch.equal(draft.ancestor_mask, fresh.ancestor_mask) and torch.equal(draft.depth, fresh.depth)
    with pytest.raises(ValueError, match="between 1 and the pool's 24"):
        MedusaDrafter(heads, tree=24, dynamic=25)


def test_registry(tmp_path, tiny_llama64):
    assert "medusa" in decoding.available_drafters()
    MedusaHeads.for_model(tiny_llama64, num_heads=2).save_pretrained(tmp_path / "h")
    drafter = make_drafter("medusa", tiny_llama64, str(tmp_path / "h"), tree="4")
    assert isinstance(drafter, MedusaDrafter) and len(drafter.template) == 4
    with pytest.raises(ValueError, match="needs a heads directory"):
        make_drafter("medusa", tiny_llama64)
    assert len(make_drafter("medusa", tiny_llama64, str(tmp_path / "h"), tree="8", dynamic="3").propose(
        _state(tiny_llama64, torch.tensor([[1, 2, 3]])))) == 3
    with pytest.raises(ValueError, match=r"unknown medusa drafter option\(s\) \['depth'\]"):
        make_drafter("medusa", tiny_llama64, str(tmp_path / "h"), depth=3)


# --- greedy equality ------------------------------------------------------------------------------------------

# A chain, the default 16-node tree, a wide one (32 candidates at depth 1 cover a third of the tiny vocabulary, so
# even random heads get drafts accepted and the accept path runs), and 12 nodes re-chosen from it every step.
TREES = {"chain3": TreeTemplate.chain(3).choices, "default16": 16,
         "wide41": [[r] for r in range(32)] + [[0, r] for r in range(8)] + [[0, 0, 0]], "dynamic12of41": None}
PROMPTS = ([1, 17, 4, 33, 8], [1, 60, 61, 2, 9, 9, 40, 12, 3])


def greedy_reference(model, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, pad_token_id=0)


def test_greedy_equality(tiny_arch):
    model = tiny_model(tiny_arch, dtype=torch.float64)
    heads = randomize_heads(MedusaHeads.for_model(model, num_heads=3), scale=0.5, seed=3)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        reference = greedy_reference(model, ids, 24).tolist()
        for name, tree in TREES.items():
            drafter = (MedusaDrafter(heads, tree=TREES["wide41"], dynamic=12) if name == "dynamic12of41"
                       else MedusaDrafter(heads, tree=tree))
            out = decoding.generate(model, drafter, ids, max_new_tokens=24)
            assert out.sequences.tolist() == reference, f"tree {name}, prompt {prompt}"
            if name == "wide41":
                assert sum(out.stats.accepted_per_step) > 0, "no draft accepted: the accept path did not run"



def test_sampling_and_streaming(tiny_llama64):
    heads = randomize_heads(MedusaHeads.for_model(tiny_llama64, num_heads=3), scale=0.5, seed=3)
    drafter = MedusaDrafter(heads, tree=TREES["wide41"])
    ids = torch.tensor([PROMPTS[0]])
    runs = [decoding.generate(tiny_llama64, drafter, ids, max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=20,
                              seed=7) for _ in range(2)]
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()  # seeded: reproducible
    assert runs[0].sequences.shape == (1, ids.shape[1] + 20)
    other = decoding.generate(tiny_llama64, drafter, ids, max_new_tokens=20, temperature=0.8, seed=8)
    assert other.sequences.tolist() != runs[0].sequences.tolist()

    class Collect:
        def __init__(self):
            self.tokens, self.ended = [], False

        def put(self, value):
            self.tokens += value.reshape(-1).tolist()

        def end(self):
            self.ended = True

    streamer = Collect()
    out = decoding.generate(tiny_llama64, drafter, ids, max_new_tokens=20, streamer=streamer)
    assert streamer.ended and streamer.tokens == out.sequences[0].tolist()

# --- demo -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lookup", [True, False])
def test_demo_on_a_tiny_model(tmp_path, capsys, lookup):
    from selfspec.cli import main
    from selfspec.runtime.models import load_model

    model, _ = load_model("tiny:llama")
    randomize_heads(MedusaHeads.for_model(model, num_heads=2), scale=0.05).save_pretrained(tmp_path / "h")
    rc = main(["demo", "--model", "tiny:llama", "--heads", str(tmp_path / "h"), "--max-new-tokens", "12",
               "--threads", "1", "--tree", "8"] + ([] if lookup else ["--no-lookup"]))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "answers identical: 3/3" in out and "tokens/s" in out and "tree of 8 nodes" in out
    assert ("merged with prompt lookup" in out) == lookup and ("with Medusa heads + lookup" in out) == lookup
    assert out.count("x\n") >= 3  # a speedup per prompt


def test_demo_with_a_datastore_and_own_prompts(tmp_path, capsys):
    from lookup.datastore import Datastore
    from selfspec.cli import main
    from selfspec.runtime.models import load_model

    model, _ = load_model("tiny:llama")
    randomize_heads(MedusaHeads.for_model(model, num_heads=2), scale=0.05).save_pretrained(tmp_path / "h")
    Datastore.build([[5, 6, 7, 8]], meta={"vocab_size": model.config.vocab_size}).save(tmp_path / "ds")
    rc = main(["demo", "--model", "tiny:llama", "--heads", str(tmp_path / "h"), "--max-new-tokens", "8",
               "--threads", "1", "--datastore", str(tmp_path / "ds"), "--prompt", "one", "--prompt", "two"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "answers identical: 2/2" in out and "+ lookup + datastore" in out and "[1] one" in out and "[2] two" in out


@pytest.mark.parametrize("lookup", [True, False])
def test_demo_beside_a_feature_drafter(tmp_path, capsys, lookup):
    """``--feature-drafter DIR`` answers the same prompts with it (as lookup's fallback), in its own columns, and
    counts its answers in the identity check; the committed one is skipped for a model it was not made for."""
    from eagle.model import save_pretrained
    from lookup.datastore import Datastore
    from selfspec.cli import main
    from selfspec.runtime.models import load_model
    from selfspec.testing import eagle_draft

    model, _ = load_model("tiny:llama")
    randomize_heads(MedusaHeads.for_model(model, num_heads=2), scale=0.05).save_pretrained(tmp_path / "h")
    save_pretrained(eagle_draft(model, seed=3, draft_vocab_size=60), tmp_path / "e")
    common = ["demo", "--model", "tiny:llama", "--heads", str(tmp_path / "h"), "--max-new-tokens", "10",
              "--threads", "1", "--prompt", "one", "--prompt", "two"] + ([] if lookup else ["--no-lookup"])
    Datastore.build([[5, 6, 7, 8]], meta={"vocab_size": model.config.vocab_size}).save(tmp_path / "ds")
    assert main(common + ["--feature-drafter", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    assert f"feature drafter {tmp_path / 'e'}" in out and "answers identical: 2/2" in out
    name = "with the feature drafter" + (" (lookup|eagle)" if lookup else "")
    assert f"{name} (B)" in out and "speedup B" in out and f"all, {name}: speedup" in out
    assert out.count("over HF greedy generate") == 2
    assert main(common + ["--feature-drafter", str(tmp_path / "e"), "--datastore", str(tmp_path / "ds")]) == 0
    out = capsys.readouterr().out
    assert "datastore merged in" in out and f"{name} + datastore (B)" in out and "answers identical: 2/2" in out
    assert main(common + ["--feature-drafter", str(tmp_path / "e"), "--no-feature-drafter"]) == 0
    out = capsys.readouterr().out
    assert "speedup B" not in out and out.count("over HF greedy generate") == 1
    assert main(common) == 0  # the committed drafter is SmolLM2's: not for this model, so not shown, with a note
    captured = capsys.readouterr()
    assert "speedup B" not in captured.out and captured.out.count("over HF greedy generate") == 1
    assert "not shown" in captured.err and "--no-feature-drafter silences this" in captured.err
    other, _ = load_model("tiny:qwen2")
    save_pretrained(eagle_draft(other, seed=3), tmp_path / "q")
    assert main(common + ["--feature-drafter", str(tmp_path / "q")]) == 2  # asked for by name: an error
    err = capsys.readouterr().err
    assert f"--feature-drafter {tmp_path / 'q'}:" in err and "trained for" in err
    assert main(common + ["--feature-drafter", str(tmp_path / "none")]) == 2
    assert f"--feature-drafter {tmp_path / 'none'}:" in capsys.readouterr().err
    # made for a model of the same shapes with other weights: asked for by name, it runs (with the loader's warning)
    from selfspec.runtime.identity import BaseModelWeightsWarning
    from selfspec.runtime.tiny import tiny_model

    other_weights = tiny_model("llama", seed=1, vocab_size=model.config.vocab_size)
    save_pretrained(eagle_draft(other_weights, seed=3, draft_vocab_size=60), tmp_path / "w")
    with pytest.warns(BaseModelWeightsWarning):
        assert main(common + ["--feature-drafter", str(tmp_path / "w")]) == 0
    assert "speedup B" in capsys.readouterr().out


def test_demo_errors(tmp_path, capsys):
    from selfspec.cli import main
    from selfspec.runtime.models import load_model

    assert main(["demo", "--model", "tiny:llama", "--heads", str(tmp_path / "none")]) == 2
    assert "no Medusa heads at" in capsys.readouterr().err
    other, _ = load_model("tiny:qwen2")
    MedusaHeads.for_model(other).save_pretrained(tmp_path / "q")
    assert main(["demo", "--model", "tiny:llama", "--heads", str(tmp_path / "q")]) == 2
    assert "were trained for" in capsys.readouterr().err
