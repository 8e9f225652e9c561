"""``python -m freetoken.cli``: the same as ``freetoken``."""

from __future__ import annotations

import sys

from freetoken.cli import main

if __name__ == "__main__":
    sys.exit(main())
