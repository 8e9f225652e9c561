"""``python -m freetoken``: the same command line as ``freetoken``."""

import sys

from freetoken.cli import main

sys.exit(main())
