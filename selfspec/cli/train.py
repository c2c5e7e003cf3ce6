"""``selfspec train RECIPE --config FILE [key=value ...] [--resume]``: run a training recipe by name.

Recipes register under the entry-point group ``selfspec.recipes`` (pyproject.toml): ``medusa`` and ``early-exit``
here, others from any installed package. ``accelerate launch train/medusa.py ...`` and
``accelerate launch -m selfspec.cli train medusa ...`` run the same recipe.
"""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points

RECIPE_GROUP = "selfspec.recipes"


def available_recipes() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=RECIPE_GROUP))


def run_recipe(name: str, argv: list[str]) -> int:
    """Run recipe ``name`` with its own command line ``argv`` (``--config FILE``, overrides, ``--resume``).

    Raises:
        KeyError: no recipe of that name is installed (the message lists the known ones).
    """
    found = {ep.name: ep for ep in entry_points(group=RECIPE_GROUP)}
    if name not in found:
        raise KeyError(f"unknown recipe {name!r}; available: {', '.join(sorted(found))}")
    found[name].load()(argv)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="run a training recipe (medusa, early-exit, ...)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help=f"recipe name ({', '.join(available_recipes())})")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="--config FILE [key=value ...] [--resume]")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if "--debug" in args.recipe_args:  # the remainder swallows it: it is selfspec's flag, not the recipe's
        args.debug = True
        args.recipe_args = [a for a in args.recipe_args if a != "--debug"]
    return run_recipe(args.recipe, args.recipe_args)
