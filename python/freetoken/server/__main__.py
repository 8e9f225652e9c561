"""``python -m freetoken.server``: the same as ``freetoken serve``."""

from __future__ import annotations

import argparse
import sys

from freetoken.errors import FreeTokenError
from freetoken.server import add_arguments, run


def main() -> int:
    """Parses the ``serve`` flags and runs the server."""
    parser = argparse.ArgumentParser(prog="python -m freetoken.server", description=__doc__)
    add_arguments(parser)
    try:
        return run(parser.parse_args())
    except FreeTokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
