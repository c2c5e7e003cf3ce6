"""Exports load into the serving side's own code and draft what selfspec's drafter drafts on the same base-model
features (``scripts/check_export.py``): ``--format speculators`` into vLLM ``speculators``' ``Eagle3DraftModel``,
``--format eagle3`` into SpecForge's ``LlamaForCausalLMEagle3`` (the reference model of the checkpoints SGLang
serves). Both are installed beside this environment (they pin other transformers/datasets versions); skipped only
when they cannot be installed here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["speculators==0.9.0", "specforge==0.2.0", "loguru", "pydantic-settings", "python-dotenv",
            "typing-inspection", "openai", "jiter", "distro", "sniffio", "anyio", "hs_connectors"]  # + import chain


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                          str(site), "--no-deps", *PACKAGES], capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.skip(f"speculators / specforge cannot be installed here: {pip.stderr.strip()[-400:]}")
    return site


def check(site: Path, out: Path, heads: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_export.py"), str(out), "--heads", str(heads),
                           "--model", "tiny:llama"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("fmt, changed", [("speculators", "layers.0.mlp.down_proj.weight"),
                                          ("eagle3", "midlayer.mlp.down_proj.weight")])
def test_the_engines_model_loads_the_export_and_drafts_the_same_logits(site, tmp_path, fmt, changed):
    from eagle.model import save_pretrained
    from selfspec.cli import main as cli
    from selfspec.runtime.models import load_model
    from selfspec.testing import eagle_draft

    model, _ = load_model("tiny:llama")
    save_pretrained(eagle_draft(model, seed=2, draft_vocab_size=50, aux_layers=[1, 2, 3]), tmp_path / "d")
    assert cli(["export", "--format", fmt, "--heads", str(tmp_path / "d"), "--out", str(tmp_path / "o"),
                "--model", "tiny:llama", "--dtype", "float32"]) == 0  # float32: the logits compare to 1e-3
    ok = check(site, tmp_path / "o", tmp_path / "d")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "same top-1 everywhere: True" in ok.stdout and "unexpected: []" in ok.stdout
    # The check can fail: the same export with one weight of the draft layer changed no longer matches.
    weights = load_file(str(tmp_path / "o" / "model.safetensors"))
    weights[changed] = weights[changed] * 3.0
    save_file(weights, str(tmp_path / "o" / "model.safetensors"))
    bad = check(site, tmp_path / "o", tmp_path / "d")
    assert bad.returncode == 1, bad.stdout + bad.stderr
