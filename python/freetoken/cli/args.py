"""The flags several subcommands share: the model and the engine's."""

from __future__ import annotations

import argparse

from freetoken.engine import options as engine_options

__all__ = ["add_model_arguments"]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``-m``, ``-t``, ``-c``, ``-v`` and the engine flags."""
    p.add_argument("-m", "--model", help="GGUF model path (default: the embedded Gemma 3 270M)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (0: model's)")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log placement, pools and per-step figures"
    )
    engine_options.add_arguments(p)
