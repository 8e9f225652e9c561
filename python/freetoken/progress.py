"""A minimal progress bar on stderr for long work (loading a model)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``bar(done, total)`` redraws one line; the line is finished when ``done == total``."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        # Off a terminal (logs, pipes) only the finished line is worth printing.
        if done < total and not self.stream.isatty():
            return
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        end = "\n" if done >= total else ""
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {elapsed:.1f}s{end}")
        self.stream.flush()
