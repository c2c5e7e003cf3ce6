"""Train an EAGLE-3 feature drafter (the recipe is ``eagle.recipe``; see its docstring and configs/eagle/):

    accelerate launch train/eagle.py --config configs/eagle/smollm2-135m.yaml [key=value ...] [--resume]
    selfspec train eagle --config configs/eagle/smollm2-135m.yaml      # the same, without this file
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Python puts this script's folder first on the import path, where this file would stand for the `eagle`
    # package: start the recipe without it.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from selfspec.cli.train import run_recipe

    sys.exit(run_recipe("eagle", sys.argv[1:]))
