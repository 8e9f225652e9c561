"""The ``freetoken`` command line: the argument parsing and :func:`main`; one module per
subcommand beside it (``serve`` is the server package's). Flags follow llama.cpp's where one
exists."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from freetoken import __version__
from freetoken.errors import FreeTokenError

__all__ = ["main"]


class _InfoAction(argparse.Action):
    """``--version``: the version line and what this install can do (``freetoken info``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        try:
            from freetoken.cli.info import report

            print(report())
        except FreeTokenError as e:
            print(f"freetoken {__version__}\nerror: {e}", file=sys.stderr)
            parser.exit(2)
        parser.exit()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetoken", description="Run GGUF language models, MoE models beyond GPU memory."
    )
    parser.add_argument(
        "--version", action=_InfoAction, help="print what this install can do, then exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from freetoken import server, testmodel
    from freetoken.cli import bench, bench_bw, generate, info, inspect, profile

    commands = [
        (info, "info", "version, CPU kernels, GPU library and device"),
        (generate, "generate", "generate text from a prompt, or chat (-cnv)"),
        (inspect, "inspect", "print a GGUF file's metadata and tensors"),
        (bench, "bench", "prompt and decode speed, in the manner of llama-bench"),
        (server, "serve", "an OpenAI-compatible HTTP server (aiohttp)"),
        (profile, "profile", "write a MoE model's expert-use profile"),
        (bench_bw, "bench-bw", "CPU, PCIe and GPU expert bandwidths per layer kind"),
        (testmodel, "make-test-model", "write a synthetic GGUF model"),
    ]
    for module, name, about in commands:
        p = sub.add_parser(name, help=about)
        module.add_arguments(p)
        p.set_defaults(func=module.run)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: runs a subcommand; bad input prints one line and exits 2."""
    args = _build_parser().parse_args(argv)
    if args.command != "serve":  # the server configures its own logging
        logging.basicConfig(format="freetoken: %(message)s", level=logging.WARNING)
        verbose = getattr(args, "verbose", False)
        logging.getLogger("freetoken").setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except FreeTokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
