"""Thin wrapper: `python scripts/bench.py ...` is `selfspec bench ...` (see `selfspec bench --help`)."""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
