"""The benchmark harness on tiny models: results schema, lossless accounting (a broken method is caught with a
large gap, a near-tie is told apart), warm-up and per-prompt rotation of the method order."""

from __future__ import annotations

import json

import pytest
import torch

from decoding.drafter import SamplingParams
from selfspec.bench import runner as bench
from selfspec.bench.methods import Generation, GenSettings, parse_method, register_method
from selfspec.bench.report import write_results
from selfspec.bench.runner import BenchRun, first_difference, run_benchmark, summarize, synthetic_prompts
from selfspec.cli import main
from selfspec.runtime.models import load_model
from selfspec.testing import tiny_model

SETTINGS = GenSettings(max_new_tokens=8)
FLIP_AT = 3


class _FlipMethod:
    """Deliberately broken: vanilla's output with the token at ``FLIP_AT`` changed."""

    name = "flip"

    def generate(self, model, input_ids, settings):
        out = parse_method("vanilla").generate(model, input_ids, settings)
        tokens = list(out.tokens)
        if len(tokens) > FLIP_AT:  # the warm-up may be shorter
            tokens[FLIP_AT] = (tokens[FLIP_AT] + 1) % model.config.vocab_size
        return Generation(tokens, out.seconds, out.steps, out.tau)


register_method("test-flip")(lambda arg, options: _FlipMethod())


def test_bench_cli_writes_results_schema(tmp_path):
    from medusa import MedusaHeads

    heads = MedusaHeads.for_model(load_model("tiny:llama")[0], num_heads=2)  # the model --model tiny:llama loads
    with torch.no_grad():
        heads.resblock_weight.normal_(0, 0.5)  # non-trivial drafts, so the tree path is really exercised
    heads.save_pretrained(tmp_path / "heads")
    out = tmp_path / "out"
    methods = f"vanilla,hf-pld,hf-early-exit:2,none,early-exit,layer-skip,medusa:{tmp_path / 'heads'}"
    rc = main(["bench", "--threads", "1", "--model", "tiny:llama", "--methods", methods,
               "--limit", "2", "--max-new-tokens", "8", "--warmup-tokens", "2", "--out", str(out), "--quiet"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"methods", "config"}
    medusa_name = f"medusa:{tmp_path / 'heads'}"
    assert list(results["methods"]) == ["vanilla", "hf-pld", "hf-early-exit:2", "none", "early-exit", "layer-skip",
                                        medusa_name]
    for name, entry in results["methods"].items():
        assert {"tokens_per_s", "tau", "speedup", "identical", "total", "divergences", "time_per_phase"} <= set(entry)
        assert entry["identical"] == entry["total"] == 2, name  # every correct method equals vanilla
        assert entry["divergences"] == [] and entry["tokens_per_s"] > 0
        assert entry["new_tokens"] == 16
    assert results["methods"]["vanilla"]["speedup"] == 1.0 and results["methods"]["vanilla"]["speedup_ci"] is None
    assert results["methods"]["vanilla"]["tau"] == 1.0
    low, high = results["methods"]["none"]["speedup_ci"]
    assert low <= results["methods"]["none"]["speedup"] <= high
    assert results["methods"][medusa_name]["tau"] > 1.0  # random heads still get some tokens accepted
    assert {"prefill", "draft", "verify", "accept", "compact", "observe", "other"} == set(results["methods"]["none"]["time_per_phase"])
    assert results["config"]["max_new_tokens"] == 8 and results["config"]["num_prompts"] == 2
    # the attention the run used is recorded with the linear backend (selfspec's on every backend but stock)
    assert (results["config"]["attention"] == "sdpa") == (results["config"]["linear_backend"] == "stock")
    assert "| hf-pld |" in (out / "results.md").read_text()
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_broken_method_is_reported_divergent_with_large_gap(tmp_path):
    model = tiny_model("llama")
    prompts = synthetic_prompts(model.config.vocab_size, 2)
    run = run_benchmark(model, prompts, ["test-flip", "hf-pld"], SETTINGS, warmup_tokens=2, progress=False)
    results = summarize(model, run)
    flip = results["flip"]
    assert flip["identical"] == 0 and flip["total"] == 2 and flip["bugs"] == 2
    for d in flip["divergences"]:
        assert d["position"] == FLIP_AT and d["method_token"] != d["vanilla_token"]
        assert d["gap"] > 1e-2 and not d["near_tie"]
    assert results["hf-pld"]["identical"] == 2 and results["hf-pld"]["bugs"] == 0
    write_results({"methods": results, "config": {"model": "tiny:llama", "max_new_tokens": 8}}, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "| flip |" in md and "0/2 (2 BUG)" in md and md.count("| BUG |") == 2


def test_divergence_at_exact_tie_is_a_near_tie():
    model = tiny_model("llama")
    prompts = synthetic_prompts(model.config.vocab_size, 1)
    run = run_benchmark(model, prompts, [], SETTINGS, warmup_tokens=1, progress=False)
    ref = run.generations["vanilla"][0].tokens
    pos = 2
    other = next(t for t in range(model.config.vocab_size) if t not in ref)
    with torch.no_grad():  # token `other` now scores exactly as vanilla's token: an exact tie at `pos`
        head = model.get_output_embeddings().weight
        head[other] = head[ref[pos]]
    run.generations["tie"] = [Generation(ref[:pos] + [other] + ref[pos + 1:], 1.0)]
    tie = summarize(model, run)["tie"]
    assert tie["identical"] == 0 and tie["bugs"] == 0
    assert tie["divergences"][0]["position"] == pos and tie["divergences"][0]["gap"] < 1e-6
    assert tie["divergences"][0]["near_tie"]


def test_method_longer_than_vanilla_is_a_bug_without_gap():
    model = tiny_model("llama")
    run = run_benchmark(model, synthetic_prompts(96, 1), [], SETTINGS, warmup_tokens=1, progress=False)
    ref = run.generations["vanilla"][0].tokens
    run.generations["long"] = [Generation(ref + [5], 1.0)]
    d = summarize(model, run)["long"]["divergences"][0]
    assert d["position"] == len(ref) and d["gap"] is None and not d["near_tie"]


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def generate(self, model, input_ids, settings):
        self.log.append((self.name, settings.max_new_tokens))
        return Generation([1] * settings.max_new_tokens, 0.01, settings.max_new_tokens, 1.0)


def test_warmup_then_rotated_order_per_prompt():
    log: list = []
    methods = [_Recorder(n, log) for n in ("vanilla", "a", "b")]
    prompts = [bench.Prompt(i, torch.tensor([[2, 3]])) for i in range(4)]
    run_benchmark(None, prompts, methods, GenSettings(max_new_tokens=5), warmup_tokens=2, progress=False)
    assert log[:3] == [("vanilla", 2), ("a", 2), ("b", 2)]  # one short warm-up each
    order = [name for name, _ in log[3:]]
    assert order == ["vanilla", "a", "b", "a", "b", "vanilla", "b", "vanilla", "a", "vanilla", "a", "b"]


def test_vanilla_is_added_and_reference_reused():
    log: list = []
    prompts = [bench.Prompt(0, torch.tensor([[2, 3]]))]
    first = run_benchmark(None, prompts, [_Recorder("vanilla", log)], SETTINGS, progress=False)
    again = run_benchmark(None, prompts, [_Recorder("x", log)], SETTINGS, reference=first, progress=False)
    assert list(again.generations) == ["vanilla", "x"]
    assert again.generations["vanilla"] is first.generations["vanilla"]
    assert [n for n, _ in log].count("vanilla") == 2  # warm-up + one prompt, only in the first run
    with pytest.raises(ValueError, match="other generation settings"):
        run_benchmark(None, prompts, [_Recorder("x", log)], GenSettings(max_new_tokens=3), reference=first)


def test_method_specs():
    assert parse_method("vanilla").name == "vanilla"
    assert parse_method("hf-pld:4").generate_kwargs == {"prompt_lookup_num_tokens": 4}
    assert parse_method("hf-early-exit:2").generate_kwargs == {"assistant_early_exit": 2}
    assert parse_method("none").name == "none"
    with pytest.raises(ValueError, match="exit layer"):
        parse_method("hf-early-exit")
    with pytest.raises(ValueError, match="integer"):
        parse_method("hf-pld:x")
    with pytest.raises(KeyError, match="available: .*vanilla"):
        parse_method("nonsense")


def test_cli_errors_are_one_line(tmp_path, capsys):
    bench_args = ["bench", "--threads", "1", "--model", "tiny:llama", "--out", str(tmp_path)]
    assert main([*bench_args, "--methods", "nonsense"]) == 2
    assert "unknown method 'nonsense'" in capsys.readouterr().err
    assert main([*bench_args, "--prompts", str(tmp_path / "x.jsonl")]) == 2
    assert "x.jsonl" in capsys.readouterr().err


def test_sampling_skips_the_lossless_check():
    model = tiny_model("llama")
    run = run_benchmark(model, synthetic_prompts(96, 1), ["none"], GenSettings(max_new_tokens=4, sampling=SamplingParams(temperature=1.0)),
                        warmup_tokens=1, progress=False)
    assert isinstance(run, BenchRun)
    entry = summarize(model, run)["none"]
    assert entry["identical"] is None and entry["divergences"] == []


def test_first_token_acceptance_and_draft_cost_per_token():
    """The issue-#19 columns: steps whose first draft token was accepted over all steps, and draft milliseconds per
    proposed draft token, pooled over prompts; methods that do not draft report neither."""
    model = tiny_model("llama")
    prompts = [bench.Prompt(i, torch.tensor([[5, 6, 7]])) for i in range(2)]
    run = BenchRun(prompts, SETTINGS)
    run.generations["vanilla"] = [Generation([1, 2], 1.0, 2, 1.0)] * 2
    run.generations["drafty"] = [Generation([1, 2], 0.5, 4, 2.0, {"draft": 0.02}, drafted=8, first_accepted=1),
                                 Generation([1, 2], 0.5, 6, 2.0, {"draft": 0.04}, drafted=12, first_accepted=6)]
    results = summarize(model, run)
    assert results["drafty"]["first_token_acceptance"] == pytest.approx(7 / 10)
    assert results["drafty"]["draft_ms_per_token"] == pytest.approx(1e3 * 0.06 / 20)
    assert results["vanilla"]["first_token_acceptance"] is None and results["vanilla"]["draft_ms_per_token"] is None
    from selfspec.bench.report import markdown_table

    table = markdown_table({"methods": results})
    assert "| 0.70 | 3.00 |" in table and "| vanilla | 2.00 | 1.00x | 1.00 | N/A | N/A |" in table


def test_drafter_methods_report_acceptance_from_the_decode_statistics():
    model = tiny_model("llama")
    gen = parse_method("early-exit").generate(model, torch.tensor([[5, 6, 7, 8]]), SETTINGS)
    assert gen.drafted >= gen.steps > 0  # a chain of 6 per step
    assert 0 <= gen.first_accepted <= gen.steps


def test_batched_benchmark_reports_each_batch_size_and_checks_every_row(tmp_path, capsys):
    out = tmp_path / "batched"
    rc = main(["bench", "--threads", "1", "--model", "tiny:llama", "--methods", "vanilla,lookup,none",
               "--batch-sizes", "1,3", "--limit", "5", "--max-new-tokens", "10", "--out", str(out), "--quiet",
               "--linear-backend", "stock"])
    assert rc == 0
    results = json.loads((out / "results-batched.json").read_text())
    assert list(results["batch_sizes"]) == ["1", "3"]
    for size, entries in results["batch_sizes"].items():
        assert list(entries) == ["vanilla", "lookup", "none"]
        for name, e in entries.items():
            assert e["identical"] == e["total"] == 5, (size, name)  # every row equals its batch-1 answer
            assert e["new_tokens"] == 50 and e["tokens_per_s"] > 0
        assert entries["vanilla"]["speedup"] == 1.0 and entries["none"]["tau"] == 1.0
    assert "| lookup |" in (out / "results-batched.md").read_text()
    rc = main(["bench", "--model", "tiny:llama", "--methods", "vanilla,hf-pld", "--batch-sizes", "2", "--limit", "2",
               "--out", str(out), "--quiet"])
    assert rc == 2 and "'hf-pld' cannot decode batches" in capsys.readouterr().err


def test_spread_takes_prompts_from_every_block_of_the_file(tmp_path):
    """MT-bench lists its categories in blocks of ten: --spread takes --limit prompts evenly spaced over the file,
    the default the first ones; the bench command records which."""
    from selfspec.runtime.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    categories = ["writing", "roleplay", "reasoning", "math"]
    path.write_text("".join(json.dumps({"question_id": 81 + i, "category": categories[i // 10], "turns": [f"q{i}"]})
                            + "\n" for i in range(40)))
    first = read_prompts(path, 4)
    assert [p["id"] for p in first] == [81, 82, 83, 84] and {p["category"] for p in first} == {"writing"}
    spread = read_prompts(path, 4, spread=True)
    assert [p["id"] for p in spread] == [81, 91, 101, 111] and [p["category"] for p in spread] == categories
    assert [p["id"] for p in read_prompts(path, 6, spread=True)] == [81, 87, 94, 101, 107, 114]
    assert len(read_prompts(path, 99, spread=True)) == 40 and len(read_prompts(path, None, spread=True)) == 40
    strings = tmp_path / "strings.jsonl"
    strings.write_text('"just a string"\n')
    with pytest.raises(ValueError, match=r"strings.jsonl:1: expected a JSON object with 'turns' or 'prompt', got str"):
        read_prompts(strings)
    out = tmp_path / "out"
    assert main(["bench", "--model", "tiny:llama", "--methods", "vanilla", "--limit", "2", "--max-new-tokens", "4",
                 "--out", str(out), "--quiet", "--spread"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["spread"] is True


@pytest.mark.xdist_group("skinny")
def test_vanilla_on_the_project_kernels_uses_the_decoders_cache_and_stock_keeps_its_own(monkeypatch):
    """``vanilla`` on the skinny kernels runs HF ``generate`` over the KV cache the speculative decoders use (and so
    through the layers' one-call path): the same output as plain ``generate``; ``vanilla@stock`` keeps transformers'
    own cache, as shipped."""
    from selfspec.runtime import skinny
    from selfspec.runtime.cache import BufferedLayer
    from selfspec.runtime.kernels import set_linear_backend

    if not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.unavailable_reason()}")
    model = tiny_model("llama", dtype=torch.float32, head_dim=64)
    prompt = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(4))
    expected = model.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)[0, 7:].tolist()
    set_linear_backend(model, "skinny")
    seen, fused = [], []
    real_generate, real_layer, real_stack = model.generate, skinny.decoder_layer, skinny.decoder_stack
    monkeypatch.setattr(model, "generate", lambda *a, **k: seen.append(k.get("cache")) or real_generate(*a, **k))
    monkeypatch.setattr(skinny, "decoder_layer", lambda h, *a: fused.append(h.shape[0]) or real_layer(h, *a))
    monkeypatch.setattr(skinny, "decoder_stack", lambda s, h, *a: fused.append(h.shape[0]) or real_stack(s, h, *a))
    settings = GenSettings(max_new_tokens=10)
    from selfspec.runtime.lean import stack_calls

    before = stack_calls(model)
    generation = parse_method("vanilla").generate(model, prompt, settings)
    assert generation.tokens == expected and generation.steps == 10 and generation.tau == 1.0
    assert all(type(layer) is BufferedLayer for layer in seen[-1].layers) and fused
    assert stack_calls(model) - before == 9  # every step after the prefill as one call: the step counter leaves it on
    fused.clear()
    assert parse_method("vanilla@stock").generate(model, prompt, settings).tokens == expected
    assert seen[-1] is None and not fused
    from selfspec.cli.demo import _baseline  # the demo's baseline follows the same rule

    seen.clear()
    sequences, _ = _baseline(model, prompt, 10, None)
    assert sequences[0, 7:].tolist() == expected and all(type(layer) is BufferedLayer for layer in seen[-1].layers)


def test_a_fallback_method_reports_which_drafter_each_step_came_from(tmp_path):
    """``lookup|medusa:DIR`` on prompts that repeat a motif: per prompt the steps whose tree came from lookup and from
    the heads (the drafter's own counts over that prompt), pooled per method, printed as shares in results.md."""
    from medusa import MedusaHeads
    from selfspec.bench.report import fallback_lines

    model = tiny_model("llama")
    heads = MedusaHeads.for_model(model, num_heads=2)
    heads.save_pretrained(tmp_path / "h")
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(2, model.config.vocab_size, (6,), generator=g)
    prompts = [bench.Prompt(f"p{i}", torch.cat([motif, torch.randint(2, model.config.vocab_size, (3,), generator=g),
                                                motif[: 2 + i]]).unsqueeze(0)) for i in range(2)]
    spec = f"lookup|medusa:{tmp_path / 'h'}"
    settings = GenSettings(max_new_tokens=24)
    run = run_benchmark(model, prompts, [spec], settings, warmup_tokens=4, progress=False)
    gens = run.generations[spec]
    for gen in gens:
        assert set(gen.fallback) == {"lookup", "medusa"}
        assert sum(gen.fallback.values()) <= gen.steps  # steps with no tree at all are not counted
    results = summarize(model, run)
    entry = results[spec]
    assert entry["identical"] == 2
    pooled = entry["fallback_steps"]
    assert pooled == {name: sum(g.fallback[name] for g in gens) for name in ("lookup", "medusa")}
    assert pooled["lookup"] > 0 and pooled["medusa"] > 0  # both kinds of step happened
    assert results["vanilla"]["fallback_steps"] is None
    medusa_settings = entry["drafters"][1]
    assert medusa_settings["drafter"] == "MedusaDrafter" and json.dumps(medusa_settings)
    import medusa
    alone = medusa.load(model, tmp_path / "h")
    assert medusa_settings["settings"] == {"tree_nodes": len(alone.template), "tree_depth": alone.template.max_depth,
                                           "dynamic": None, "width": None, "top_k": None, "draft_weights": None}
    text = fallback_lines({"methods": results})
    lookup_share = f"lookup {pooled['lookup'] / entry['steps']:.0%}"
    assert f"| {spec} | {lookup_share}, medusa " in text and "vanilla" not in text
    write_results({"methods": results, "config": {"model": "tiny:llama", "max_new_tokens": 24}}, tmp_path / "out")
    assert lookup_share in (tmp_path / "out" / "results.md").read_text()


def test_results_record_what_each_drafter_ran_with(tmp_path, monkeypatch):
    """``eagle:DIR`` means the tree saved for the machine it runs on: results.json records the resolved policy and
    where it came from, for every member of a combination or fallback (lookup's options too)."""
    import selfspec.runtime.kernels as drafter_module  # where every family asks its machine class
    from eagle.model import save_pretrained
    from selfspec.testing import eagle_draft

    model = tiny_model("llama")
    draft = eagle_draft(model, draft_vocab_size=64)
    draft.config.decoding = {"depth": 2, "nodes": 3, "top_k": 2, "width": 2}
    draft.config.decoding_by_machine = {"test-class": {"policy": {"depth": 3, "nodes": 5, "top_k": 2, "width": 1}}}
    save_pretrained(draft, tmp_path / "e")
    monkeypatch.setattr(drafter_module, "machine_class", lambda device=None: "test-class")
    prompts = synthetic_prompts(model.config.vocab_size, 1, seed=0)
    spec = f"lookup[nodes=4]|eagle:{tmp_path / 'e'}"
    run = run_benchmark(model, prompts, [spec], GenSettings(max_new_tokens=8), warmup_tokens=2, progress=False)
    entry = summarize(model, run)[spec]
    lookup_entry, eagle_entry = entry["drafters"]
    assert lookup_entry["drafter"] == "LookupDrafter" and lookup_entry["settings"]["nodes"] == 4
    assert lookup_entry["settings"]["nodes_per_match"] == 2 and "policy_source" not in lookup_entry
    assert eagle_entry["drafter"] == "EagleDrafter" and eagle_entry["policy_source"] == "calibrated for test-class"
    assert (eagle_entry["settings"]["depth"], eagle_entry["settings"]["nodes"]) == (3, 5)
    assert "drafters" not in summarize(model, run)["vanilla"]
    scoped = f"eagle:{tmp_path / 'e'}@q8_0"  # a method under another draft format records it beside its policy
    run2 = run_benchmark(model, prompts, [scoped], GenSettings(max_new_tokens=4), warmup_tokens=2, progress=False)
    (only,) = summarize(model, run2)[scoped]["drafters"]
    assert only["scope"] == "@q8_0" and only["drafter"] == "EagleDrafter"
    json.dumps(entry["drafters"])  # as results.json stores it
    write_results({"methods": summarize(model, run), "config": {"model": "tiny:llama"}}, tmp_path / "out")
    text = (tmp_path / "out" / "results.md").read_text()
    assert "Drafters as run" in text and "| EagleDrafter | depth=3, nodes=5," in text
    assert "| calibrated for test-class |" in text and "nodes_per_match=2" in text


def test_fallback_counts_name_the_members_of_nested_groups():
    from decoding import combine, fallback, fallback_counts
    from lookup import LookupDrafter

    a, b, c = LookupDrafter(), LookupDrafter(nodes=2), LookupDrafter(nodes=3)
    inner = fallback(a, b, names=["first", "second"])
    inner.proposed = [4, 2]
    assert fallback_counts(combine(inner, c)) == {"first": 4, "second": 2}
    assert fallback_counts(c) == {} and fallback_counts(combine(a, c)) == {}
    assert fallback(a, b).names == ["LookupDrafter", "LookupDrafter"]
    with pytest.raises(ValueError, match="2 names for 3 drafters"):
        fallback(a, b, c, names=["x", "y"])


def test_speedup_and_tau_per_prompt_category():
    """Per category, speedup is the method's pooled tokens/s over vanilla's on the same prompts (not the overall
    vanilla speed), tau the step-weighted mean; the report shows one column per category, and nothing without
    categories."""
    from selfspec.bench.report import category_lines

    model = tiny_model("llama")
    prompts = [bench.Prompt(i, torch.tensor([[5, 6, 7]]), category) for i, category in
               enumerate(["coding", "coding", "writing"])]
    run = BenchRun(prompts, SETTINGS)
    run.generations["vanilla"] = [Generation([1] * 10, 1.0, 10, 1.0), Generation([1] * 10, 1.0, 10, 1.0),
                                  Generation([1] * 10, 2.0, 10, 1.0)]
    run.generations["fast"] = [Generation([1] * 10, 0.5, 5, 2.0), Generation([1] * 10, 0.5, 4, 2.5),
                               Generation([1] * 10, 2.0, 10, 1.0)]
    results = summarize(model, run)
    per = results["fast"]["per_category"]
    assert list(per) == ["coding", "writing"]
    assert per["coding"]["prompts"] == 2 and per["coding"]["speedup"] == pytest.approx(2.0)
    assert per["coding"]["tau"] == pytest.approx((2.0 * 5 + 2.5 * 4) / 9)
    assert per["writing"]["speedup"] == pytest.approx(1.0) and per["writing"]["tokens_per_s"] == pytest.approx(5.0)
    assert results["fast"]["per_prompt"][2]["category"] == "writing"
    text = category_lines({"methods": results})
    assert "| method | coding (2) | writing (1) |" in text and "| fast | 2.00x (2.22) | 1.00x (1.00) |" in text
    for p in prompts:
        p.category = None
    assert summarize(model, run)["fast"]["per_category"] is None
    assert category_lines({"methods": summarize(model, run)}) == ""


def test_the_first_prompts_of_a_file_blocked_by_category_are_flagged(tmp_path, monkeypatch):
    """MT-bench lists its categories in blocks of ten: ``--limit 12`` alone takes two categories of eight, which a
    warning names (with the fix, --spread); spread prompts, or a limit that covers every category, pass silently."""
    import warnings

    path = tmp_path / "mt.jsonl"
    rows = [{"question_id": i, "category": ["writing", "coding", "math"][i // 4], "turns": [f"q{i}"]} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    class _Tok:
        chat_template = None

        def __call__(self, text, return_tensors=None):
            return type("Enc", (), {"input_ids": torch.tensor([[2, 3, 4]])})()

    reads = []
    read = bench.read_prompts
    monkeypatch.setattr(bench, "read_prompts", lambda *args, **kw: reads.append(args) or read(*args, **kw))
    with pytest.warns(UserWarning, match=r"first 5 prompts .* cover 2 of its 3 categories \(writing, coding; not math\)"
                                         r".*--spread"):
        prompts = bench.load_prompts(_Tok(), str(path), 5, vocab_size=10)
    assert len(reads) == 1  # the file is read once for the prompts and their categories
    assert [p.category for p in prompts] == ["writing"] * 4 + ["coding"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spread = bench.load_prompts(_Tok(), str(path), 3, vocab_size=10, spread=True)
        assert [p.category for p in spread] == ["writing", "coding", "math"]
        assert len(bench.load_prompts(_Tok(), str(path), 12, vocab_size=10)) == 12
        assert len(bench.load_prompts(_Tok(), str(path), None, vocab_size=10)) == 12


def test_two_draft_weight_formats_compare_in_one_run(tmp_path, monkeypatch):
    """``eagle:DIR@float16`` and ``eagle:DIR@q4_1`` in one benchmark: each method's drafter packs its own layers in
    its format (once: the next generation finds them packed), outputs stay vanilla's, and the process-wide choice is
    restored after every generation; an unknown name after '@' lists backends and draft weights."""
    from eagle.model import save_pretrained
    from selfspec.runtime import kernels, skinny
    from selfspec.runtime.kernels import set_linear_backend
    from selfspec.testing import eagle_draft

    monkeypatch.setattr(kernels, "_draft_weights", "float16")
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    heads = save_pretrained(eagle_draft(model, seed=7, draft_vocab_size=60), tmp_path / "e")
    specs = [f"eagle:{heads}@float16", f"eagle:{heads}@q4_1"]
    methods = [parse_method(spec) for spec in specs]
    run = run_benchmark(model, synthetic_prompts(model.config.vocab_size, 2), methods, SETTINGS, warmup_tokens=2,
                        progress=False)
    assert kernels.draft_weights() == "float16"
    for spec, method, expected in zip(specs, methods, ("float16", "q4_1")):
        layers = method.inner.drafter(model).draft.linear_layers()
        formats = {skinny.packed_format(m.forward._weight) for m in layers if m.in_features % 32 == 0}
        assert formats == {expected}, spec
        packed = [m.forward._weight for m in layers]
        with kernels.using_draft_weights(expected):
            method.generate(model, run.prompts[0].input_ids, SETTINGS)
        assert all(a is m.forward._weight for a, m in zip(packed, layers))  # not repacked
    results = summarize(model, run)
    assert all(results[spec]["identical"] == 2 for spec in specs)
    with pytest.raises(ValueError, match="draft weights: float16, float32, q8_0, q4_1"):
        parse_method(f"eagle:{heads}@q5")


def test_speedup_interval_is_a_paired_bootstrap_over_the_prompts():
    """The interval brackets the reported speedup (total tokens over total seconds against vanilla's), collapses to a
    point when every prompt gains alike, widens with the spread between prompts, and is reproducible."""
    def gens(seconds, tokens=100):
        return [Generation(list(range(tokens)), s) for s in seconds]

    vanilla = gens([1.0, 2.0, 1.5, 1.0, 3.0, 2.5])
    alike = gens([0.5, 1.0, 0.75, 0.5, 1.5, 1.25])  # 2x on every prompt
    assert bench.speedup_interval(alike, vanilla) == pytest.approx([2.0, 2.0])
    mixed = gens([0.4, 1.9, 0.5, 0.9, 1.0, 2.4])  # 2.5x, 1.05x, 3x, 1.1x, 3x, 1.04x
    point = bench.tokens_per_s(mixed) / bench.tokens_per_s(vanilla)
    low, high = bench.speedup_interval(mixed, vanilla)
    assert low < point < high and high - low > 0.3
    assert bench.speedup_interval(mixed, vanilla) == [low, high]  # seeded
    narrow = bench.speedup_interval(mixed, vanilla, level=0.5)
    assert low <= narrow[0] <= narrow[1] <= high
    assert bench.speedup_interval(mixed[:1], vanilla[:1]) is None  # one prompt: no spread to resample
