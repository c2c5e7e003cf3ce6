"""The import graph of the repository points down only (docs/ARCHITECTURE.md):

    selfspec.cli, selfspec.bench, selfspec.testing      applications and test helpers
    medusa, early_exit, lookup                         drafters (one package each, registered by entry point)
    decoding, selfspec.training                        the decode loop; training recipes' machinery
    selfspec.runtime                                   models, kernels, caches, io, identity, adapters

Every import of project code counts, function-local ones too. A test that reads the sources rather than running
them: it fails with the offending file, line and import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# (package prefix, level); the longest matching prefix decides a module's level.
LEVELS = {
    "selfspec.runtime": 0,
    "decoding": 1,
    "selfspec.training": 1,
    "medusa": 2,
    "early_exit": 2,
    "lookup": 2,
    "eagle": 2,
    "selfspec.bench": 3,
    "selfspec.cli": 3,
    "selfspec.testing": 3,
    "selfspec.hf": 3,
}
DRAFTERS = ("medusa", "early_exit", "lookup", "eagle")
PROJECT = ("selfspec", "decoding", "medusa", "early_exit", "lookup", "eagle")


def level_of(module: str) -> tuple[str, int] | None:
    matches = [p for p in LEVELS if module == p or module.startswith(p + ".")]
    if not matches:
        return None
    best = max(matches, key=len)
    return best, LEVELS[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def project_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of project code in ``path`` (relative ones resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            # `from pkg import module` imports pkg.module
            names = [f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in PROJECT]
    return found


def library_files() -> list[Path]:
    return sorted(p for top in PROJECT for p in (ROOT / top).rglob("*.py"))


def test_every_library_module_has_a_level():
    unplaced = [module_name(p) for p in library_files() if level_of(module_name(p)) is None
                and module_name(p) != "selfspec"]
    assert not unplaced, f"modules outside every layer of docs/ARCHITECTURE.md: {unplaced}"


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: Path):
    own = level_of(module_name(path))
    if own is None:
        return
    own_prefix, own_level = own
    wrong = []
    for line, target in project_imports(path):
        theirs = level_of(target)
        if theirs is None:  # the bare `selfspec` package: its __init__ imports nothing
            continue
        prefix, level = theirs
        if prefix == own_prefix:
            continue
        if level > own_level or (level == own_level and level != 3):
            # same level: drafters do not import each other; decoding and training are independent
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({prefix}, level {level}; "
                         f"this module: {own_prefix}, level {own_level})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_decoding_names_no_drafter():
    for path in (ROOT / "decoding").rglob("*.py"):
        text = path.read_text()
        for drafter in DRAFTERS:
            assert f"import {drafter}" not in text and f"from {drafter}" not in text, (path, drafter)


def test_train_launchers_hold_no_recipe():
    # The recipes live in their packages; train/*.py only start them (a script named like a package would
    # otherwise shadow it on the import path).
    for path in (ROOT / "train").glob("*.py"):
        assert len(path.read_text().splitlines()) < 30, f"{path} should be a thin launcher"
