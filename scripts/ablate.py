"""Thin wrapper: `python scripts/ablate.py ...` is `selfspec ablate ...` (see `selfspec ablate --help`)."""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["ablate", *sys.argv[1:]]))
