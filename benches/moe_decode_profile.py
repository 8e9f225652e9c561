"""The MoE layers' share of a CPU decode step, and the expert executor's weight throughput.

    python benches/moe_decode_profile.py -m MODEL.gguf [-t 2] [-n 32] [-r 3]

Runs a 64-token prompt first (as ``freetoken bench``'s prompt pass does, which maps in most
experts), then ``-r`` times ``-n`` greedy decode steps from an empty cache, after one untimed
round. Each MoE layer's call is timed: routing plus executor (the MoE layers) and the executor
alone; the executor's bytes are the distinct experts a call reads, as its counters count them.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict

import torch
from freetoken import _core
from freetoken.engine.options import EngineOptions
from freetoken.llm import LLM
from freetoken.runtime import moe

_TIMES: defaultdict[str, float] = defaultdict(float)
_CALL, _RUN = moe.MoeFFN.__call__, moe.CpuExperts.run


def _timed_moe(self: moe.MoeFFN, x: torch.Tensor) -> torch.Tensor:
    """``MoeFFN.__call__`` timed whole (routing, experts, shared expert)."""
    t0 = time.perf_counter()
    out = _CALL(self, x)
    _TIMES["moe"] += time.perf_counter() - t0
    return out


def _timed_run(
    self: moe.CpuExperts,
    layer: _core.MoeLayer,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """``CpuExperts.run`` (the executor) timed, with the distinct experts' bytes it reads."""
    t0 = time.perf_counter()
    out = _RUN(self, layer, x, ids, weights)
    _TIMES["executor"] += time.perf_counter() - t0
    _TIMES["bytes"] += layer.expert_bytes * len(torch.unique(ids))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-nr", "--no-repack", action="store_true", help="keep the file's rows")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        n_ctx=max(args.n + 1, 64),
        n_threads=args.threads,
        progress=False,
        engine=EngineOptions(repack=not args.no_repack),
    )
    moe.MoeFFN.__call__ = _timed_moe  # type: ignore[method-assign]
    moe.CpuExperts.run = _timed_run  # type: ignore[method-assign]
    rng = random.Random(1)
    cache = llm.model.new_cache(max(args.n + 1, 64))
    llm.model.forward([rng.randrange(llm.vocab_size) for _ in range(64)], cache)
    for rep in range(args.r + 1):
        cache.truncate(0)
        _TIMES.clear()
        tok = rng.randrange(llm.vocab_size)
        t0 = time.perf_counter()
        for _ in range(args.n):
            tok = int(llm.model.forward([tok], cache).argmax())
        step = (time.perf_counter() - t0) / args.n
        if rep == 0:
            continue
        m, ex, b = (_TIMES[k] / args.n for k in ("moe", "executor", "bytes"))
        print(
            f"step {step * 1e3:.2f} ms ({1 / step:.1f} t/s): MoE layers {m * 1e3:.2f} ms "
            f"({m / step:.0%}), executor {ex * 1e3:.2f} ms ({ex / step:.0%}), "
            f"{b / 1e6:.1f} MB at {b / ex / 1e9:.1f} GB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
