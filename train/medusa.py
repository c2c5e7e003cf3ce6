"""Train Medusa heads (the recipe is ``medusa.recipe``; see its docstring and configs/medusa/):

    accelerate launch train/medusa.py --config configs/medusa/smollm2-135m.yaml [key=value ...] [--resume]
    selfspec train medusa --config configs/medusa/smollm2-135m.yaml      # the same, without this file
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Python puts this script's folder first on the import path, where this file would stand for the `medusa`
    # package: start the recipe without it.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from selfspec.cli.train import run_recipe

    sys.exit(run_recipe("medusa", sys.argv[1:]))
