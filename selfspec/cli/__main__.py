"""``python -m selfspec.cli`` is the ``selfspec`` command."""

import sys

from selfspec.cli import main

sys.exit(main())
