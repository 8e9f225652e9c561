"""Where a process's threads spend their time, from ``py-spy record --threads -f raw``
samples: per thread (and process, with ``--subprocesses``), its samples, the share of them
inside each function named with ``--inside`` (``forward_batch`` or
``Transformer.forward_batch``), and its most sampled frames: for each sample
the deepest frame whose file path contains ``--match`` (default ``freetoken``), else the
deepest frame.

    python benches/spy_summary.py serve.spy [--inside forward_batch] [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import re
from dataclasses import dataclass, field

__all__ = ["ThreadSamples", "read", "summarize"]

#: A frame of py-spy's raw format: ``function (path:line)``.
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^()]*):(?P<line>\d+)\)$")


@dataclass
class ThreadSamples:
    """One thread's samples: in all, inside each function asked for, and by leaf frame."""

    total: int = 0
    inside: collections.Counter[str] = field(default_factory=collections.Counter)
    leaves: collections.Counter[str] = field(default_factory=collections.Counter)


def _function(frame: str) -> str:
    m = _FRAME.match(frame)
    return m["func"] if m else frame


def read(lines: list[str], inside: list[str], match: str = "freetoken") -> dict[str, ThreadSamples]:
    """The samples of raw ``lines`` (``frame;frame;... count``, outermost first, the
    process and thread frames leading) by thread: the leading frames up to the first that
    names a source file are the thread's name."""
    threads: dict[str, ThreadSamples] = {}
    for raw in lines:
        raw = raw.rstrip("\n")
        if not raw.strip():
            continue
        stack, _, count = raw.rpartition(" ")
        frames = stack.split(";")
        lead = 0
        while lead < len(frames) and not _FRAME.match(frames[lead]):
            lead += 1
        name = ";".join(frames[:lead]) or "?"
        code = frames[lead:]
        t = threads.setdefault(name, ThreadSamples())
        n = int(count)
        t.total += n
        funcs = [_function(f) for f in code]
        for want in inside:
            if any(f == want or f.endswith("." + want) for f in funcs):
                t.inside[want] += n
        ours = [f for f in code if match in (_FRAME.match(f) or {"path": ""})["path"]]
        leaf = ours[-1] if ours else (code[-1] if code else "(no Python frame)")
        t.leaves[leaf] += n
    return threads


def summarize(threads: dict[str, ThreadSamples], top: int) -> str:
    """A markdown section per thread, the busiest first."""
    out = []
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1].total):
        out.append(f"## {name}: {t.total} samples")
        for want, n in sorted(t.inside.items()):
            out.append(f"- inside `{want}`: {n} ({100 * n / t.total:.1f}%)")
        out.append("")
        out.append("| samples | share | frame |")
        out.append("| ---: | ---: | --- |")
        for frame, n in t.leaves.most_common(top):
            out.append(f"| {n} | {100 * n / t.total:.1f}% | `{frame}` |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", help="py-spy record -f raw output")
    ap.add_argument("--inside", action="append", default=[], help="a function name")
    ap.add_argument("--match", default="freetoken", help="the leaf frames' path filter")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    with open(args.raw) as f:
        threads = read(f.readlines(), args.inside, args.match)
    print(summarize(threads, args.top))


if __name__ == "__main__":
    main()
