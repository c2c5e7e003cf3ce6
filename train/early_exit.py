"""Train an early-exit classifier or a LayerSkip adapter (the recipe is ``early_exit.recipe``; see configs/early_exit/):

    accelerate launch train/early_exit.py --config configs/early_exit/smollm2-135m.yaml [key=value ...] [--resume]
    selfspec train early-exit --config configs/early_exit/smollm2-135m.yaml      # the same, without this file
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Python puts this script's folder first on the import path, where this file would stand for the `early_exit`
    # package: start the recipe without it.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from selfspec.cli.train import run_recipe

    sys.exit(run_recipe("early-exit", sys.argv[1:]))
