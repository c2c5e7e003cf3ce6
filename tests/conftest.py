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
