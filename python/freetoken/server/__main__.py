"""``python -m freetoken.server``: the same as ``freetoken serve``."""

from __future__ import annotations

import sys

from freetoken.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
