"""Training-free layer skipping (Draft & Verify, SWIFT): which base layers the draft skips, saved as a directory.

The skip set is chosen on calibration prompts by ``scripts/search_layer_skip.py``; the directory holds only
``config.json`` (the set, the base-model identity and the search's measurements) and a README.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from early_exit.estimates import agreement, chain_speedup, relative_cost
from selfspec.runtime.identity import check_base_model
from selfspec.runtime.io import CONFIG_NAME, atomic_directory
from selfspec.runtime.layers import num_decoder_layers

KIND = "layer-skip"


def check_skip_layers(skip_layers: Sequence[int], total: int) -> None:
    """Raises: ValueError: a layer index outside 0..L-1, or a set that skips every layer."""
    bad = [i for i in skip_layers if not isinstance(i, int) or not 0 <= i < total]
    if bad:
        raise ValueError(f"skip_layers must be layer indices in 0..{total - 1}, got {bad}")
    if len(set(skip_layers)) >= total:
        raise ValueError(f"skip_layers skips all {total} layers: the draft must keep at least one")


def default_skip_layers(total: int) -> list[int]:
    """Every other layer of the second half (Draft & Verify's finding: late layers are the most skippable);
    a starting point when no searched set is given."""
    return list(range(total // 2, total - 1, 2))


@dataclass
class LayerSkipConfig:
    """Attributes:
        skip_layers: base decoder layers the draft does not run.
        base_model: identity of the base model the set was searched on.
        metrics: the search's measurements (tau, relative cost, per-candidate scores).
        policy: default draft policy options (``max_depth``, ...) found best with this set; callers may override.
    """

    skip_layers: list[int]
    base_model: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    kind: str = KIND

    def save(self, directory: str | Path, readme: str | None = None) -> Path:
        with atomic_directory(directory) as tmp:
            (Path(tmp) / CONFIG_NAME).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
            (Path(tmp) / "README.md").write_text(readme or _readme(self))
        return Path(directory)

    @classmethod
    def load(cls, directory: str | Path, model) -> LayerSkipConfig:
        """Raises:
            FileNotFoundError: no config.json in ``directory``.
            ValueError: not a layer-skip config, searched on another base model, or layers that do not fit it.
        """

        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{directory} is not a layer-skip directory: no {CONFIG_NAME}")
        data = json.loads(path.read_text())
        if data.get("kind") != KIND:
            raise ValueError(f"{directory} holds a {data.get('kind')!r} config, not a layer-skip set")
        config = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        check_base_model(config.base_model, model, what=f"layer-skip set {directory}", on_weights="warn")
        check_skip_layers(config.skip_layers, num_decoder_layers(model))
        return config


def _readme(config: LayerSkipConfig) -> str:
    name = config.base_model.get("name_or_path") or "the base model"
    return (f"# Layer-skip draft for {name}\n\nSkipped layers: {config.skip_layers}.\n\n"
            "Use: `selfspec generate --draft layer-skip --heads DIR`. Made by `scripts/search_layer_skip.py`.\n\n"
            f"```json\n{json.dumps(config.metrics, indent=2, sort_keys=True)}\n```\n")


def search_skip_layers(model, calibration, *, max_depth: int = 6, max_skip: int | None = None,
                       keep: Sequence[int] = (0,), log=None) -> tuple[list[int], dict[str, Any]]:
    """Greedy search for the skip set: each round skips the one more layer that scores best, for ``max_skip``
    rounds (default half the layers); the best set of any round wins.

    The score of a set is :func:`early_exit.estimates.chain_speedup` of its top-1 agreement with the full model
    on ``calibration`` and its relative cost. Rounds go on past a worse score because skipping nothing is a local
    optimum (a perfect draft at full cost scores exactly 1) that single skips rarely beat. ``keep`` lists layers
    never skipped (the first layer: skipping it wrecks every draft). Returns the set (sorted) and the record of
    every round (score, agreement, cost, chain length).
    """

    total = num_decoder_layers(model)
    head = model.get_output_embeddings()

    def draft_head(hidden):
        return head(model.model.norm(hidden))

    def score(skip: list[int]) -> dict[str, Any]:
        kept = [i for i in range(total) if i not in skip]
        a = agreement(model, calibration, kept, draft_head)
        cost = relative_cost(model, len(kept))
        speedup, k = chain_speedup(a, cost, max_depth)
        return {"skip": sorted(skip), "speedup": speedup, "max_depth": k, "agreement": a, "cost": cost}

    rounds = [score([])]
    candidates = [i for i in range(total) if i not in keep]
    limit = total // 2 if max_skip is None else max_skip
    while candidates and len(rounds) - 1 < limit:
        skip = rounds[-1]["skip"]
        trials = [score(skip + [i]) for i in candidates]
        best = max(trials, key=lambda r: r["speedup"])
        candidates = [i for i in candidates if i not in best["skip"]]
        rounds.append(best)
        if log is not None:
            log(best)
    best = max(rounds, key=lambda r: r["speedup"])
    metrics = {"expected_speedup": best["speedup"], "max_depth": best["max_depth"], "agreement": best["agreement"],
               "relative_cost": best["cost"], "rounds": rounds}
    return best["skip"], metrics
