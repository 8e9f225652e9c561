"""One token's CPU attention over a long cache: ``freetoken._core.attend_one`` (one layer,
float32 cache, no norms or RoPE) for a few released models' head shapes and cache lengths,
ms a call over the engine's thread pool.

    python benches/bench_attend_one.py [--positions 512,4096,16384] [-r 50]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from freetoken import _core

#: (name, query heads, KV heads, head dim).
SHAPES = [
    ("Gemma 3 270M", 4, 1, 256),
    ("Qwen3.5 full attention", 16, 2, 256),
    ("Qwen3-30B-A3B", 32, 4, 128),
]


def time_call(heads: int, kv_heads: int, dim: int, n: int, reps: int) -> float:
    """Seconds a call, the query at the last of ``n`` cached positions."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal(heads * dim).astype(np.float32)
    k = rng.standard_normal(kv_heads * dim).astype(np.float32)
    keys = rng.standard_normal((n, kv_heads, dim)).astype(np.float32)
    values = keys.copy()
    out = np.zeros(heads * dim, np.float32)
    args = (q, k, k, keys, values, [n - 1], 0, n, heads, kv_heads)
    rest = (None, None, 1e-6, None, None, False, dim**-0.5, None, out)
    _core.attend_one(*args, *rest)
    t0 = time.perf_counter()
    for _ in range(reps):
        _core.attend_one(*args, *rest)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    """Prints one markdown row per shape."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", default="512,4096,16384")
    ap.add_argument("-r", "--repetitions", type=int, default=50)
    args = ap.parse_args()
    lengths = [int(n) for n in args.positions.split(",")]
    print(f"threads {_core.num_threads()}, ms a call")
    print("| shape | " + " | ".join(f"{n} positions" for n in lengths) + " |")
    print("| --- |" + " ---: |" * len(lengths))
    for name, h, hkv, d in SHAPES:
        ms = [1e3 * time_call(h, hkv, d, n, args.repetitions) for n in lengths]
        print(f"| {name} ({h} / {hkv} x {d}) | " + " | ".join(f"{m:.3f}" for m in ms) + " |")


if __name__ == "__main__":
    main()
