"""Drafters are found by name through the ``selfspec.drafters`` entry points: ``decoding`` names no drafter, and a
package installed beside selfspec adds one with no change here."""

from __future__ import annotations

import sys

import pytest
import torch

from decoding import available_drafters, generate, make_drafter, register_drafter
from decoding.registry import _REGISTERED, installed_drafters
from lookup import LookupDrafter
from selfspec.testing import tiny_model

BUILT_IN = {"none", "lookup", "medusa", "early-exit", "layer-skip"}

PLUGIN = '''
import torch
from decoding import DraftTree, DrafterBase

CALLS = []

class RepeatDrafter(DrafterBase):
    """Proposes the last token again, as a chain of two."""
    def propose(self, state):
        return DraftTree.chain(torch.tensor([state.root, state.root]))

def make_repeat_drafter(model, heads_dir=None, **options):
    CALLS.append((heads_dir, options))
    return RepeatDrafter()
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A third-party distribution on the import path, as pip would install it: a module and its dist-info with one
    ``selfspec.drafters`` entry point."""
    (tmp_path / "selfspec_repeat_plugin.py").write_text(PLUGIN)
    info = tmp_path / "selfspec_repeat_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: selfspec-repeat-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[selfspec.drafters]\nrepeat = selfspec_repeat_plugin:make_repeat_drafter\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed_drafters.cache_clear()
    yield
    installed_drafters.cache_clear()
    sys.modules.pop("selfspec_repeat_plugin", None)


def test_the_built_in_drafters_come_from_entry_points():
    assert BUILT_IN <= set(installed_drafters())
    assert BUILT_IN <= set(available_drafters())
    assert installed_drafters()["medusa"].value == "medusa.drafter:make_medusa_drafter"


def test_a_third_party_drafter_plugs_in_and_decodes_losslessly(plugin):
    assert "repeat" in available_drafters()
    model = tiny_model("llama")
    drafter = make_drafter("repeat", model, None, depth=2)
    import selfspec_repeat_plugin

    assert selfspec_repeat_plugin.CALLS == [(None, {"depth": 2})]
    prompt = torch.tensor([[5, 7, 7, 9, 7]])
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    out = generate(model, drafter, prompt, max_new_tokens=16, eos_token_id=None)
    assert out.sequences.tolist() == expected.tolist()
    # It combines with the built-in drafters like any other.
    combined = make_drafter("repeat+lookup", model)
    assert isinstance(combined.drafters[1], LookupDrafter)
    out = generate(model, combined, prompt, max_new_tokens=16, eos_token_id=None)
    assert out.sequences.tolist() == expected.tolist()


def test_runtime_registration_wins_and_unknown_names_list_the_known_ones(monkeypatch):
    monkeypatch.setitem(_REGISTERED, "lookup", lambda model, heads_dir=None, **o: LookupDrafter(num_tokens=2))
    assert make_drafter("lookup", None).num_tokens == 2
    register_drafter("made-here")(lambda model, heads_dir=None, **o: LookupDrafter())
    try:
        assert "made-here" in available_drafters()
    finally:
        _REGISTERED.pop("made-here")
    with pytest.raises(KeyError, match="unknown drafter 'nope'; available: .*medusa"):
        make_drafter("nope", None)


def test_the_empty_drafter_takes_no_heads_or_options():
    with pytest.raises(ValueError, match="no heads directory and no options"):
        make_drafter("none", None, "some/dir")
