"""The EAGLE-3 feature drafter: training-time test computes what decoding computes, every tree it proposes decodes
losslessly on every supported architecture, its caches stay in step, and it saves, loads and trains."""

from __future__ import annotations

import json
import math

import pytest
import torch

from decoding.drafter import DecodeState, SamplingParams
from decoding.generate import generate
from eagle.drafter import EagleDrafter, EaglePolicy, make_eagle_drafter, saved_policy
from eagle.model import DraftCache, EagleConfig, from_pretrained, save_pretrained
from selfspec.runtime.tiny import tiny_gemma3, tiny_model
from selfspec.testing import eagle_draft, greedy_reference, random_prompt

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3")


def base(arch: str):
    """The tiny base of ``arch``; ``gemma3``: sandwich-normed layers, two rotary embeddings, sliding windows of 6
    positions between full layers (so the longer prompts below decode past the window)."""
    return tiny_gemma3() if arch == "gemma3" else tiny_model(arch)


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
    model = base(arch)
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


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_step_is_its_layer_class_forward(arch):
    """With the embedding half of q/k/v zeroed and the hidden norm the layer's input norm, a draft step computes what
    the base's decoder-layer class computes on the hidden states: the residual wiring and the norms (Gemma 3's four)
    are the class's own."""
    model = base(arch)
    draft = eagle_draft(model, seed=5)
    layer = draft.layer
    hidden_size = model.config.hidden_size
    reference = type(layer)(layer.self_attn.config, layer_idx=0)
    state = {k: v for k, v in layer.state_dict().items() if not k.startswith("self_attn.") or "_proj." not in k
             or "o_proj" in k}
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            wide = getattr(layer.self_attn, name)
            wide.weight[:, :hidden_size] = 0
            state[f"self_attn.{name}.weight"] = wide.weight[:, hidden_size:].clone()
            if wide.bias is not None:
                state[f"self_attn.{name}.bias"] = wide.bias.clone()
        draft.hidden_norm.load_state_dict(layer.input_layernorm.state_dict())
    reference.load_state_dict(state)
    hidden = torch.randn(1, 5, hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(3, 8)[None]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out = draft.step(hidden, random_prompt(5, seed=4), positions, mask, None)
        expected = reference(hidden, position_embeddings=draft._rotary(hidden, positions), attention_mask=mask,
                             position_ids=positions)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert torch.allclose(out, expected, atol=1e-5), (arch, (out - expected).abs().max())


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
    "min-prob": EaglePolicy(depth=5, nodes=8, top_k=3, width=2, min_prob=0.05),
    "min-prob-high": EaglePolicy(depth=4, nodes=6, min_prob=0.6),  # most steps verify the root alone
    "min-prob-depth-1": EaglePolicy(depth=1, nodes=4, min_prob=0.1),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_greedy_output_equals_generate(arch, policy):
    model = base(arch)
    drafter = EagleDrafter(model, eagle_draft(model, seed=7, draft_vocab_size=60), POLICIES[policy])
    sizes = []
    for n, new in ((1, 9), (4, 30), (23, 17)):
        ids = random_prompt(n, seed=n)
        out = generate(model, drafter, ids, max_new_tokens=new)
        assert torch.equal(out.sequences, greedy_reference(model, ids, new)), (arch, policy, n)
        assert drafter.cache.length == out.sequences.shape[1] - 2 or out.stats.new_tokens == new
        sizes += out.stats.tree_sizes
    if policy == "min-prob":  # a cut that keeps trees and cuts some: outputs are checked on both kinds of step
        assert max(sizes) > 0 and min(sizes) < 8, (arch, sizes)


def test_trees_respect_the_policy_and_leave_the_cache_as_found(llama):
    drafter = EagleDrafter(llama, eagle_draft(llama, seed=2), EaglePolicy(depth=4, nodes=9, top_k=3, width=2))
    sizes, depths = [], []

    original = drafter.propose

    def propose(state):
        drafter._extend(state)  # the positions observe queued: what propose runs first
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


def test_min_prob_keeps_the_likely_nodes_of_the_same_tree(llama):
    """``min_prob`` cuts the tree the unpruned policy grows at the nodes whose draft path probability falls below
    it (parents always kept with their children), proposes nothing where no node qualifies, and outputs stay equal."""
    draft = eagle_draft(llama, seed=2)
    ids = greedy_reference(llama, random_prompt(6, seed=9), 20)
    with torch.no_grad():
        hidden = llama(ids, output_hidden_states=True).hidden_states
    layers = tuple(draft.config.aux_layers)
    sizes = []
    for cut in (0.02, 0.1, 0.3):
        for end in (8, 13, 19):
            trees = {}
            for min_prob in (0.0, cut):
                policy = EaglePolicy(depth=4, nodes=9, top_k=3, width=2, min_prob=min_prob)
                drafter = EagleDrafter(llama, draft, policy)
                state = DecodeState(model=llama, cache=None, sequence=ids[:, :end], sampling=SamplingParams(),
                                    hidden={layer: hidden[layer][:, :end - 1] for layer in layers})
                drafter.begin(state)
                trees[min_prob] = drafter.propose(state)
                scores = _path_probs(drafter, state, trees[min_prob])
                assert all(p >= min_prob - 1e-6 for p in scores), (cut, end, scores)
                # what the drafter records for the tree (scripts/draft_calibration.py reads it) is each node's own
                assert [math.exp(s) for s in drafter.path_log_probs] == pytest.approx(scores, rel=1e-4)
            full, pruned = trees[0.0], trees[cut]
            full_paths = full.token_paths
            full_probs = dict(zip(full_paths, _path_probs(EagleDrafter(llama, draft), state, full)))
            kept = {path for path, prob in full_probs.items() if prob >= cut}
            # the pruned tree's paths are exactly the unpruned tree's paths likely enough (up to float ties at the cut)
            assert set(pruned.token_paths) <= set(full_paths)
            assert {p for p in kept if full_probs[p] > cut * 1.001} <= set(pruned.token_paths)
            sizes.append(len(pruned))
    assert max(sizes) > 0 and min(sizes) < 9  # the cut kept something somewhere, and cut something
    drafter = EagleDrafter(llama, draft, EaglePolicy(depth=4, nodes=9, top_k=3, width=2, min_prob=0.999))
    prompt = random_prompt(6, seed=3)
    out = generate(llama, drafter, prompt, max_new_tokens=12)
    assert torch.equal(out.sequences, greedy_reference(llama, prompt, 12))
    assert max(out.stats.tree_sizes) == 0  # a random draft is never that sure: plain steps throughout


def _path_probs(drafter, state, tree):
    """Each node's path probability under the draft, recomputed one path at a time from the draft's own steps."""
    draft = drafter.draft
    column = {int(t): c for c, t in enumerate(draft.draft_vocab.tolist())}
    probs = []
    with torch.no_grad():
        for path in tree.token_paths:
            probs.append(_path_prob(drafter, draft, column, state, path))
    return probs


def _path_prob(drafter, draft, column, state, path):
    """One path's probability: the draft stepped along it alone, on a fresh copy of the drafter's context."""
    fresh = EagleDrafter(drafter.model, draft, EaglePolicy())
    fresh.begin(state)
    fresh._extend(state)
    prefix = fresh.cache.length
    hidden, total = fresh.last, 0.0
    for level, token in enumerate(path):
        total += float(torch.log_softmax(draft.logits(hidden[0]).float(), dim=-1)[-1, column[token]])
        if level + 1 < len(path):
            hidden = draft.step(hidden[:, -1:], torch.tensor([[token]]), torch.tensor([[prefix + level]]), None,
                                fresh.cache)
    return math.exp(total)


def test_observed_positions_wait_for_the_next_proposal(llama):
    """``observe`` only queues the accepted positions; ``propose`` runs everything queued in one pass. Steps observed
    without a proposal between them (where the drafter is a fallback that was not asked) leave the draft cache and
    the next tree what a drafter catching up after every step would have."""
    draft = eagle_draft(llama, seed=4)
    ids = greedy_reference(llama, random_prompt(7, seed=6), 14)
    with torch.no_grad():
        hidden = llama(ids, output_hidden_states=True).hidden_states
    layers = tuple(draft.config.aux_layers)
    chunks = [(7, 10), (10, 11), (11, 14), (14, 18)]  # the prompt's 6 cached positions, then 4 accepted steps

    def run(eager: bool):
        drafter = EagleDrafter(llama, draft, EaglePolicy(depth=3, nodes=6, top_k=3))
        state = DecodeState(model=llama, cache=None, sequence=ids[:, :7], sampling=SamplingParams(),
                            hidden={layer: hidden[layer][:, :6] for layer in layers})
        drafter.begin(state)
        for start, end in chunks:
            if eager:
                drafter._extend(state)
            assert drafter.cache.length == (state.cache_length if eager else 0)
            state.sequence = ids[:, :end]
            state.hidden = {layer: hidden[layer][:, start - 1:end - 1] for layer in layers}
            drafter.observe(state)
        assert len(drafter.pending) == (1 if eager else 1 + len(chunks))
        tree = drafter.propose(state)
        assert drafter.cache.length == state.cache_length == 17 and not drafter.pending
        return tree, drafter.cache.keys[..., :17, :].clone()

    lazy_tree, lazy_keys = run(eager=False)
    eager_tree, eager_keys = run(eager=True)
    assert torch.allclose(lazy_keys, eager_keys, atol=1e-5)
    assert lazy_tree.tokens.tolist() == eager_tree.tokens.tolist()
    assert lazy_tree.parents.tolist() == eager_tree.parents.tolist()
    # out of step: more positions observed than the base cache holds
    drafter = EagleDrafter(llama, draft, EaglePolicy())
    state = DecodeState(model=llama, cache=None, sequence=ids[:, :7], sampling=SamplingParams(),
                        hidden={layer: hidden[layer][:, :6] for layer in layers})
    drafter.begin(state)
    with pytest.raises(RuntimeError, match="out of step"):
        drafter.observe(state)


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


def test_a_policy_calibrated_for_this_kind_of_machine_replaces_the_default(llama, tmp_path, monkeypatch):
    import selfspec.runtime.kernels as drafter_module  # where every family asks its machine class

    draft = eagle_draft(llama, seed=4, draft_vocab_size=50)
    draft.config.decoding = {"depth": 3, "nodes": 7, "top_k": 2, "width": 2, "min_prob": 0.01}
    draft.config.decoding_by_machine = {
        "x86_64-avx512": {"policy": {"depth": 4, "nodes": 4, "top_k": 2, "width": 2, "threshold": 0.4},
                          "calibrated_on": "AMD EPYC (test)", "date": "2026-12-07"},
        "cuda": {"policy": {"depth": 6, "nodes": 40, "top_k": 8, "width": 4}}}
    save_pretrained(draft, tmp_path / "d")
    card = (tmp_path / "d" / "README.md").read_text()
    assert "## Drafting calibrated per kind of machine" in card and "AMD EPYC (test) 2026-12-07" in card
    for machine, expected, source in [
            ("x86_64-avx512", EaglePolicy(depth=4, nodes=4, top_k=2, width=2, threshold=0.4),
             "calibrated for x86_64-avx512"),
            ("x86_64-avx2", EaglePolicy(depth=3, nodes=7, top_k=2, width=2, min_prob=0.01), "default"),  # no entry
            ("aarch64", EaglePolicy(depth=3, nodes=7, top_k=2, width=2, min_prob=0.01), "default")]:
        monkeypatch.setattr(drafter_module, "machine_class", lambda device=None, m=machine: m)
        loaded = make_eagle_drafter(llama, str(tmp_path / "d"))
        assert (loaded.policy, loaded.policy_source) == (expected, source), machine
    # (an entry replaces the default whole: the default's min_prob did not leak into it)
    # explicit options still override the machine's entry (only what they name)
    monkeypatch.setattr(drafter_module, "machine_class", lambda device=None: "x86_64-avx512")
    loaded = make_eagle_drafter(llama, str(tmp_path / "d"), nodes=6)
    assert loaded.policy == EaglePolicy(depth=4, nodes=6, top_k=2, width=2, threshold=0.4)
    assert loaded.policy_source == "calibrated for x86_64-avx512 + options"
    ids = random_prompt(6, seed=1)  # and decodes losslessly, as any policy must
    assert torch.equal(generate(llama, loaded, ids, max_new_tokens=15).sequences, greedy_reference(llama, ids, 15))
    assert EagleDrafter(llama, draft, EaglePolicy()).policy_source == "given"
    # an entry with an option the drafter does not have is refused where it would be used, naming it and the fix
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["decoding_by_machine"]["x86_64-avx512"]["policy"]["treshold"] = 0.4
    bad = tmp_path / "typo"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"decoding_by_machine\['x86_64-avx512'\] names unknown option\(s\) "
                                         r"\['treshold'\].*recalibrate"):
        saved_policy(EagleConfig.load(bad / "config.json"))
    # an entry that is not what calibrate writes is refused on load, naming the entry and the fix
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["decoding_by_machine"]["cuda"] = {"depth": 6}
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"decoding_by_machine\['cuda'\] must be an object with a 'policy'"):
        EagleConfig.load(tmp_path / "d" / "config.json")


def test_machine_classes_follow_the_vector_unit(monkeypatch):
    from selfspec.runtime import kernels, skinny

    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    for flags, expected in [("fma avx2", "x86_64-avx2"), ("avx2 avx512f avx512bw", "x86_64-avx512"),
                            ("avx2 avx512f amx_tile amx_bf16", "x86_64-avx512-amx"), ("sse4_2", "x86_64")]:
        monkeypatch.setattr(skinny, "cpuinfo_fields", lambda flags=flags: {"flags": flags})
        assert kernels.machine_class() == expected == kernels.machine_class("cpu")
    monkeypatch.setattr("platform.machine", lambda: "AMD64")  # Windows' name for it, and no /proc/cpuinfo there
    monkeypatch.setattr(skinny, "cpuinfo_fields", lambda: {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert kernels.machine_class() == "x86_64-avx2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert kernels.machine_class() == "x86_64-avx512"
    monkeypatch.setattr("platform.machine", lambda: "arm64")  # macOS
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert kernels.machine_class() == "aarch64"
    assert kernels.machine_class(torch.device("cuda", 1)) == "cuda"  # a device's type, whatever the CPU
    assert kernels.machine_class("meta") == "meta"


def test_bad_input_is_refused_clearly(llama, tmp_path):
    with pytest.raises(ValueError, match="needs a trained drafter directory"):
        make_eagle_drafter(llama)
    draft = eagle_draft(llama)
    save_pretrained(draft, tmp_path / "d")
    with pytest.raises(ValueError, match="unknown eagle drafter option"):
        make_eagle_drafter(llama, str(tmp_path / "d"), bogus=1)
    with pytest.raises(ValueError, match="nodes must be an integer"):
        EaglePolicy(nodes=0)
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=r"min_prob must be a number in \[0, 1\)"):
            EaglePolicy(min_prob=bad)
    with pytest.raises(ValueError, match="a static tree is set.*pass tree=null"):
        EaglePolicy(tree=((0,), (0, 0)), min_prob=0.1)
    saved_static = tmp_path / "static"
    static = eagle_draft(llama)
    static.config.decoding = {"tree": [[0], [0, 0]]}  # a drafter whose saved default is a static tree
    save_pretrained(static, saved_static)
    with pytest.raises(ValueError, match="given or saved with the drafter"):
        make_eagle_drafter(llama, str(saved_static), min_prob=0.1)
    assert make_eagle_drafter(llama, str(saved_static), min_prob=0.1, tree=None).policy.tree is None
    with pytest.raises(ValueError, match="supports"):
        eagle_draft(tiny_model("gpt2"))
    weights = tmp_path / "d" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors has 100 bytes"):
        from_pretrained(tmp_path / "d", llama)
    save_pretrained(draft, tmp_path / "e")
    from selfspec.runtime.identity import BaseModelWeightsWarning
    with pytest.warns(BaseModelWeightsWarning, match="other weights"):  # same shapes, other weights: loads
        from_pretrained(tmp_path / "e", tiny_model("llama", seed=5))
    with pytest.raises(ValueError, match="trained for"):
        from_pretrained(tmp_path / "e", tiny_model("qwen2"))


def test_half_precision_storage_loads_into_the_base_dtype(llama, tmp_path):
    draft = eagle_draft(llama, seed=6)
    save_pretrained(draft, tmp_path / "h", dtype=torch.float16)
    loaded = from_pretrained(tmp_path / "h", llama)
    assert next(loaded.parameters()).dtype == torch.float32
    torch.testing.assert_close(loaded.fc.weight, draft.fc.weight.half().float())
    drafter = EagleDrafter(llama, loaded)
    ids = random_prompt(5, seed=2)
    assert torch.equal(generate(llama, drafter, ids, max_new_tokens=12).sequences, greedy_reference(llama, ids, 12))


# Weight names and shapes of speculators' Eagle3Speculator (src/speculators/models/eagle3/core.py and
# model_definitions.py, read at commit c05b95b3): fc over the fused layers, the first decoder layer with q/k/v over
# [embedding; hidden] and its own hidden_norm, the final norm, the draft LM head, d2t offsets and the t2d mask.
def speculators_expected_shapes(config, hidden, heads, kv_heads, head_dim, inner, vocab, draft_vocab, aux):
    return {
        "fc.weight": (hidden, aux * hidden),
        "layers.0.input_layernorm.weight": (hidden,), "layers.0.hidden_norm.weight": (hidden,),
        "layers.0.post_attention_layernorm.weight": (hidden,),
        "layers.0.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": (inner, hidden), "layers.0.mlp.up_proj.weight": (inner, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inner),
        "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden), "d2t": (draft_vocab,), "t2d": (vocab,),
    }


@pytest.mark.parametrize("share", [True, False])
def test_speculators_export_has_its_layout_and_imports_back_to_the_same_drafts(llama, tmp_path, share):
    from safetensors.torch import load_file

    from eagle.export import export_speculators, import_speculators

    draft = eagle_draft(llama, seed=8, draft_vocab_size=40, share_lm_head=share)
    draft.config.decoding = {"depth": 3}
    export_speculators(draft, tmp_path / "spec")
    # the drafting it saved rides along and comes back; the engine's depth is the GPU tree's where there is one
    calibrated = {"cuda": {"policy": {"depth": 5, "nodes": 30}}, "x86_64-avx2": {"policy": {"depth": 2, "nodes": 4}}}
    draft.config.decoding_by_machine = calibrated
    export_speculators(draft, tmp_path / "gpu")
    assert json.loads((tmp_path / "gpu" / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 5
    assert import_speculators(tmp_path / "gpu", llama).config.decoding_by_machine == calibrated
    assert import_speculators(tmp_path / "gpu", llama).config.decoding == {"depth": 3}
    draft.config.decoding_by_machine = {}
    state = load_file(str(tmp_path / "spec" / "model.safetensors"))
    c = llama.config
    expected = speculators_expected_shapes(c, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                           c.hidden_size // c.num_attention_heads, c.intermediate_size, c.vocab_size,
                                           40, len(draft.config.aux_layers))
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert torch.equal(state["d2t"] + torch.arange(40), draft.draft_vocab) and int(state["t2d"].sum()) == 40
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 40 and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == draft.config.aux_layers
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == (draft.config.base_model.get("name_or_path") or None)
    export_speculators(draft, tmp_path / "spec2", verifier="org/target-model")
    config = json.loads((tmp_path / "spec2" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target-model"

    back = import_speculators(tmp_path / "spec", llama)
    ids = random_prompt(9, seed=4)
    aux = aux_states(llama, ids, draft.config.aux_layers)
    with torch.no_grad():
        for a, b in zip(draft.unroll(aux, ids, torch.ones_like(ids), 3), back.unroll(aux, ids, torch.ones_like(ids), 3)):
            torch.testing.assert_close(draft.logits(a), back.logits(b))
    trees = []
    for d in (draft, back):
        drafter = EagleDrafter(llama, d, EaglePolicy(depth=3, nodes=6, top_k=2, width=2))
        seen = []
        original = drafter.propose
        drafter.propose = lambda state, o=original, s=seen: s.append(o(state)) or s[-1]
        out = generate(llama, drafter, ids, max_new_tokens=16)
        assert torch.equal(out.sequences, greedy_reference(llama, ids, 16))
        trees.append([(t.tokens.tolist(), t.parents.tolist()) for t in seen])
    assert trees[0] == trees[1]


def test_eagle3_export_has_the_sglang_layout_and_every_format_loads_back_for_decoding(llama, tmp_path):
    from safetensors.torch import load_file

    from eagle.export import directory_format, export_eagle3, export_speculators, load_drafter

    draft = eagle_draft(llama, seed=9, draft_vocab_size=40, aux_layers=[1, 2, 3])
    draft.config.decoding = {"depth": 3, "nodes": 5}
    draft.config.decoding_by_machine = {"x86_64-avx512": {"policy": {"depth": 4, "nodes": 4, "threshold": 0.4}}}
    save_pretrained(draft, tmp_path / "own")
    export_eagle3(draft, tmp_path / "sg", dtype=torch.float32)
    export_speculators(draft, tmp_path / "spec")
    export_eagle3(draft, tmp_path / "bf16")  # the default: what SGLang serves with
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    state = load_file(str(tmp_path / "sg" / "model.safetensors"))
    c = llama.config
    expected = {(f"midlayer.{k.removeprefix('layers.0.')}" if k.startswith("layers.0.") else k): v
                for k, v in speculators_expected_shapes(c, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                                        c.hidden_size // c.num_attention_heads, c.intermediate_size,
                                                        c.vocab_size, 40, 3).items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == c.vocab_size
    # SGLang / SpecForge count layer *outputs*: output_hidden_states[i] is their id i - 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["tie_word_embeddings"] is False and config["target_hidden_size"] == c.hidden_size
    assert [directory_format(tmp_path / d) for d in ("own", "sg", "spec")] == ["selfspec", "eagle3", "speculators"]
    ids = random_prompt(9, seed=5)
    aux = aux_states(llama, ids, [1, 2, 3])
    trees = []
    for d in ("own", "sg", "spec"):
        back = load_drafter(tmp_path / d, llama)
        assert back.config.aux_layers == [1, 2, 3]  # and every format brings back the drafting it was saved with
        assert (back.config.decoding, back.config.decoding_by_machine) == (draft.config.decoding,
                                                                           draft.config.decoding_by_machine)
        with torch.no_grad():
            for a, b in zip(draft.unroll(aux, ids, torch.ones_like(ids), 3),
                            back.unroll(aux, ids, torch.ones_like(ids), 3)):
                torch.testing.assert_close(draft.logits(a), back.logits(b))
        drafter = make_eagle_drafter(llama, str(tmp_path / d), nodes=6, top_k=2, width=2)  # what --draft eagle:DIR does
        seen = []
        original = drafter.propose
        drafter.propose = lambda state, o=original, s=seen: s.append(o(state)) or s[-1]
        assert torch.equal(generate(llama, drafter, ids, max_new_tokens=16).sequences, greedy_reference(llama, ids, 16))
        trees.append([(t.tokens.tolist(), t.parents.tolist()) for t in seen])
    assert trees[0] == trees[1] == trees[2]


def test_eagle3_export_refuses_what_sglangs_llama_layer_cannot_hold(llama, tmp_path):
    from eagle.export import export_eagle3, export_speculators, import_eagle3

    with pytest.raises(ValueError, match="fuses exactly 3 base layers"):
        export_eagle3(eagle_draft(llama, aux_layers=[1, 2]), tmp_path / "two")
    # the engines capture inputs of layers 1..N-1, in layer order, once each
    for aux in ([3, 1, 2], [1, 1, 2], [1, 2, 4]):
        for export in (export_eagle3, export_speculators):
            with pytest.raises(ValueError, match=r"strictly increasing within 1\.\.3"):
                export(eagle_draft(llama, aux_layers=aux), tmp_path / "order")
    with pytest.raises(ValueError, match="has no biases"):
        export_eagle3(eagle_draft(tiny_model("llama", attention_bias=True), aux_layers=[1, 2, 3]), tmp_path / "bias")
    with pytest.raises(ValueError, match="Llama's and takes drafters of llama, mistral bases; got 'qwen2'"):
        export_eagle3(eagle_draft(tiny_model("qwen2"), aux_layers=[1, 2, 3]), tmp_path / "qwen")
    assert not any((tmp_path / d).exists() for d in ("two", "qwen", "order", "bias"))
    export_eagle3(eagle_draft(llama, aux_layers=[1, 2, 3]), tmp_path / "ok")
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="do not name LlamaForCausalLMEagle3"):
        import_eagle3(tmp_path / "ok", llama)
    for variant in ({"fc_norm": True}, {"norm_output": False}, {"norm_before_residual": True}):
        (tmp_path / "ok" / "config.json").write_text(json.dumps({**config, **variant}))
        with pytest.raises(ValueError, match="a variant selfspec's drafter does not compute|EAGLE-3 variant"):
            import_eagle3(tmp_path / "ok", llama)
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "ok" / "model.safetensors"
    original = load_file(str(weights))
    save_file({**original, "fc_norm.0.weight": torch.ones(llama.config.hidden_size)}, str(weights))
    with pytest.raises(ValueError, match=r"tensors \['fc_norm.0.weight'\] that the plain EAGLE-3 layer does not"):
        import_eagle3(tmp_path / "ok", llama)
    save_file(original, str(weights))
    with pytest.raises(ValueError, match="does not fit this base model"):  # a base of another hidden size
        import_eagle3(tmp_path / "ok", tiny_model("llama", hidden_size=48))
    # a base of another MLP width takes it at the draft layer's own width (read off the weights)
    other = import_eagle3(tmp_path / "ok", tiny_model("llama", intermediate_size=48))
    assert other.config.intermediate_size == llama.config.intermediate_size == other.layer.mlp.down_proj.in_features


def test_export_command_writes_the_speculators_directory(tmp_path, capsys):
    from selfspec.cli import main as cli
    from selfspec.runtime.models import load_model

    model, _ = load_model("tiny:llama")
    save_pretrained(eagle_draft(model, seed=2, draft_vocab_size=50), tmp_path / "d")
    assert cli(["export", "--format", "speculators", "--heads", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                "--model", "tiny:llama"]) == 0
    assert (tmp_path / "o" / "model.safetensors").is_file() and "speculators eagle3" in capsys.readouterr().out
    assert cli(["export", "--format", "speculators", "--heads", str(tmp_path / "missing"),
                "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_card_names_a_base_loaded_from_a_directory_by_its_architecture(llama):
    from eagle.model import render_card

    draft = eagle_draft(llama, seed=0)
    config = draft.config
    config.base_model = {**(config.base_model or {}), "name_or_path": "/tmp", "architecture": "LlamaForCausalLM",
                         "num_hidden_layers": 4}
    assert render_card(config).splitlines()[0] == ("# EAGLE-3 feature drafter for a LlamaForCausalLM of 4 layers "
                                                   "(loaded from /tmp)")
    config.base_model["name_or_path"] = "smollm2-135m-instruct"
    assert render_card(config).splitlines()[0] == "# EAGLE-3 feature drafter for smollm2-135m-instruct"


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_training_attention_equals_the_dense_mask(arch, monkeypatch):
    """The training-time-test attention computed by its structure (``ttt_attention``) gives the outputs and the
    gradients of the layer's own attention over the dense mask, padding included, on every architecture."""
    import eagle.model

    model = base(arch)
    draft = eagle_draft(model, seed=4).train()
    ids = torch.cat([random_prompt(10, seed=6), random_prompt(10, seed=7)])
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    aux = aux_states(model, ids, draft.config.aux_layers)
    runs = []
    for sparse in (True, False):
        draft.zero_grad(set_to_none=True)
        with monkeypatch.context() as m:
            if sparse:  # the structured path really runs: no dense mask beyond step 0's causal block is built
                dense = eagle.model.ChainMask.dense
                m.setattr(eagle.model.ChainMask, "dense", lambda self, *a: pytest.fail("dense mask built")
                          if self.blocks > 1 else dense(self, *a))
            outputs = draft.unroll(aux, ids, mask, steps=4, sparse=sparse)
        sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() * (j + 1) for j, o in enumerate(outputs)).backward()
        runs.append((outputs, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (sparse_out, sparse_grads), (dense_out, dense_grads) = runs
    for a, b in zip(sparse_out, dense_out):
        assert torch.allclose(a, b, atol=1e-5), (arch, (a - b).abs().max())
    assert sparse_grads.keys() == dense_grads.keys() and len(sparse_grads) > 5
    for name in sparse_grads:
        # float32 sums in another order: their error scales with the gradient's magnitude (Gemma's run to ~2,500,
        # its embeddings scaled by sqrt(hidden)), so the absolute tolerance does too; a wrong mask is off by O(1).
        scale = float(dense_grads[name].abs().max())
        assert torch.allclose(sparse_grads[name], dense_grads[name], atol=1e-4 * max(1.0, scale / 100), rtol=1e-4), \
            (arch, name, float((sparse_grads[name] - dense_grads[name]).abs().max()), scale)
    assert draft.layer.self_attn.config._attn_implementation == model.config._attn_implementation  # restored


@pytest.mark.parametrize("fallback", ["sdpa", "eager"])
def test_ttt_attention_hands_what_it_does_not_cover_to_the_models_own(llama, fallback, monkeypatch):
    """A soft cap is not in the structured path: the model's own attention runs it with the dense mask (additive for
    eager); elsewhere the structured path gives the model's own numbers."""
    import eagle.model
    from eagle.model import ChainMask, _own_attention, ttt_attention

    attn = llama.model.layers[0].self_attn
    b, heads, kv, s, d, blocks = 2, attn.config.num_attention_heads, attn.config.num_key_value_heads, 5, attn.head_dim, 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=g)
    k, v = torch.randn(b, kv, blocks * s, d, generator=g), torch.randn(b, kv, blocks * s, d, generator=g)
    first = torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(b, 1, s, s).clone()
    first[1, :, :, 3:] = torch.eye(s, dtype=torch.bool)[:, 3:]  # row 1 padded after position 2
    mask = ChainMask(first, blocks, fallback)
    dense = mask.dense(torch.float32 if fallback == "eager" else None)
    own, _ = _own_attention(attn, fallback)(attn, q, k, v, dense, dropout=0.0, scaling=d ** -0.5)
    calls = []

    def recording(module, implementation):
        calls.append(implementation)
        return _own_attention(module, implementation)

    monkeypatch.setattr(eagle.model, "_own_attention", recording)
    structured, _ = ttt_attention(attn, q, k, v, mask, scaling=d ** -0.5)
    assert torch.allclose(structured, own, atol=1e-5) and calls == []
    # a sliding window (Mistral passes its config's on every call) is not applied, as sdpa and eager do not apply
    # one with an explicit mask: the structured path runs
    windowed, _ = ttt_attention(attn, q, k, v, mask, scaling=d ** -0.5, sliding_window=2)
    assert torch.allclose(windowed, own, atol=1e-5) and calls == []
    if fallback == "eager":  # a soft cap goes to the model's own (sdpa refuses one itself; Llama's eager ignores it)
        handed_on, _ = ttt_attention(attn, q, k, v, mask, scaling=d ** -0.5, softcap=30.0)
        assert calls == ["eager"] and torch.allclose(handed_on, own, atol=1e-5)
    with pytest.raises(TypeError, match="training-time-test steps only"):
        ttt_attention(attn, q, k, v, mask.dense())


def test_decode_steps_read_rotary_rows_from_a_table_equal_to_the_rotary_module(llama):
    """A draft step looks its positions' cos / sin up in a table the base's rotary module computed once (grown to
    a power of two past the largest position asked): the same values the module gives for those positions."""
    draft = eagle_draft(llama, seed=1)
    rotary = llama.get_decoder().rotary_emb
    x = torch.randn(1, 3, llama.config.hidden_size)
    for positions in (torch.tensor([[0, 5, 5]]), torch.tensor([[1500, 1501, 2047]])):
        cos, sin = draft._rotary_rows(x, positions)
        want_cos, want_sin = rotary(x, position_ids=positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert draft._rotary_table[0].shape[0] == 2048


def test_a_gemma3_drafter_saves_and_loads_but_exports_to_neither_llama_layer_format(tmp_path):
    """A Gemma 3 draft layer is no Llama layer: selfspec saves and loads it (decoding equal before and after), and
    both serving formats, whose draft layer is Llama's, refuse it by name."""
    from eagle.export import export_eagle3, export_speculators

    model = tiny_gemma3()
    draft = eagle_draft(model, seed=6, draft_vocab_size=50)
    save_pretrained(draft, tmp_path / "d")
    loaded = from_pretrained(tmp_path / "d", model)
    prompt = random_prompt(8, seed=2)
    runs = [generate(model, EagleDrafter(model, d, EaglePolicy(depth=3, nodes=5)), prompt, max_new_tokens=14)
            for d in (draft, loaded)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.tree_sizes == runs[1].stats.tree_sizes and max(runs[0].stats.tree_sizes) == 5
    with pytest.raises(ValueError, match="got 'gemma3_text'.*--draft eagle"):
        export_speculators(loaded, tmp_path / "spec")
    with pytest.raises(ValueError, match="gemma3_text"):
        export_eagle3(loaded, tmp_path / "e3")
    assert not (tmp_path / "spec").exists() and not (tmp_path / "e3").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_wider_mlp_drafts_losslessly_and_trains_as_it_decodes(arch, tmp_path):
    """A draft layer whose MLP is wider than the base's (``EagleConfig.intermediate_size``): training-time test
    computes what decoding computes, greedy output equals generate, and it saves and loads at its own width."""
    model = base(arch)
    width = 3 * model.config.intermediate_size
    draft = eagle_draft(model, seed=11, draft_vocab_size=60, intermediate_size=width)
    assert draft.layer.mlp.down_proj.in_features == width and draft.config.intermediate_size == width
    ids = random_prompt(7, seed=2)
    aux = aux_states(model, ids, draft.config.aux_layers)
    with torch.no_grad():
        unrolled = draft.unroll(aux, ids, torch.ones_like(ids), 2)
        cache = DraftCache()
        first = draft.step(draft.fuse(aux), torch.cat([ids[:, 1:], ids[:, :1]], 1), torch.arange(7)[None],
                           torch.ones(7, 7, dtype=torch.bool).tril()[None, None], cache)
    torch.testing.assert_close(first[:, :-1], unrolled[0][:, :-1], rtol=1e-4, atol=1e-4)
    drafter = EagleDrafter(model, draft, POLICIES["small"])
    for n, new in ((1, 9), (23, 17)):
        prompt = random_prompt(n, seed=n)
        assert torch.equal(generate(model, drafter, prompt, max_new_tokens=new).sequences,
                           greedy_reference(model, prompt, new)), (arch, n)
    save_pretrained(draft, tmp_path / "wide")
    back = from_pretrained(tmp_path / "wide", model)
    assert back.config.intermediate_size == width
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), back.state_dict().values()))


def test_a_wider_mlp_exports_its_width_and_every_format_imports_it_back(llama, tmp_path):
    from eagle.export import export_eagle3, export_speculators, load_drafter

    width = 5 * llama.config.intermediate_size // 2
    draft = eagle_draft(llama, seed=12, draft_vocab_size=40, aux_layers=[1, 2, 3], intermediate_size=width)
    export_speculators(draft, tmp_path / "spec")
    export_eagle3(draft, tmp_path / "sg", dtype=torch.float32)
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["transformer_layer_config"][
        "intermediate_size"] == width
    assert json.loads((tmp_path / "sg" / "config.json").read_text())["intermediate_size"] == width
    ids = random_prompt(9, seed=6)
    aux = aux_states(llama, ids, [1, 2, 3])
    for d in ("spec", "sg"):
        back = load_drafter(tmp_path / d, llama)
        assert back.config.intermediate_size == width
        with torch.no_grad():
            for a, b in zip(draft.unroll(aux, ids, torch.ones_like(ids), 2),
                            back.unroll(aux, ids, torch.ones_like(ids), 2)):
                torch.testing.assert_close(draft.logits(a), back.logits(b))
    narrow = eagle_draft(llama, seed=12, draft_vocab_size=40, aux_layers=[1, 2, 3])
    export_speculators(narrow, tmp_path / "plain")
    assert load_drafter(tmp_path / "plain", llama).config.intermediate_size is None  # the base's width: not stated
