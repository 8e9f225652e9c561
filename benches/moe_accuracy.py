"""Per-token error of the CPU expert executor against the float64 reference, per weight type,
over many tokens: the figures behind the tolerances of tests/test_moe_executor.py.

    python benches/moe_accuracy.py [-n 2000] [-k 8] [--types Q4_0,Q6_K] [--precise]

Each type is written as gate and up with a Q8_0 down, then as down with Q8_0 gate and up (8
experts, hidden 256, expert FFN 512, the test module's inputs: unit-RMS tokens, N(0, 1/K)
weights, softmax routing weights). Prints mean, 99th percentile and maximum of the per-token
relative error against the float64 product of the dequantized weights, and the largest
difference from the reference that rounds x and h as ggml does. ``--precise``: the executor
with residual activations (``--moe-cpu-precise``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# The test module's weights, inputs and references.
import test_moe_executor as t
from freetoken import _core, quant

N_EXPERTS = 8


def vec_dot_type(qtype: str) -> str:
    return quant.type_info(quant.type_info(qtype).vec_dot_type).name


def measure(
    ex: t.Experts, name: str, n_tokens: int, top_k: int, executor: _core.MoeExecutor, tmp: Path
) -> tuple[np.ndarray, float]:
    """Per-token errors against the float64 reference, and the largest against the emulated."""
    mf = t.ModelFile()
    mf.add_layer(0, ex)
    f = mf.write(tmp / f"{name}.gguf")
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x = t.tokens(rng, n_tokens)
    ids, w = t.routes(rng, n_tokens, N_EXPERTS, top_k)
    out = t.run(executor, t.open_layer(f, 0, _core.MoeCounters(1), ex), x, ids, w)
    err = t.rel_err(out, t.reference(x, ids, w, ex))
    emulated = float(t.rel_err(out, t.reference(x, ids, w, ex, emulate=True)).max())
    return err, emulated


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--tokens", type=int, default=2000)
    ap.add_argument("-k", "--top-k", type=int, default=8)
    ap.add_argument("--types", help="comma-separated types (default: every type with a dot)")
    ap.add_argument("--precise", action="store_true", help="residual activations")
    args = ap.parse_args()
    types = args.types.split(",") if args.types else t.STORAGE_TYPES
    executor = _core.MoeExecutor(2, residual_acts=args.precise)
    rng = np.random.default_rng(200)
    shapes = {
        "gate": (N_EXPERTS, t.I, t.H),
        "up": (N_EXPERTS, t.I, t.H),
        "down": (N_EXPERTS, t.H, t.I),
    }
    partner = {kind: t.make_mat(rng, "Q8_0", shape) for kind, shape in shapes.items()}
    print(f"{args.tokens} tokens, top-{args.top_k}: per-token relative error")
    print("| type | as | activation | mean | p99 | max | from emulated |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as d:
        for qtype in types:
            rng = np.random.default_rng(zlib.crc32(qtype.encode()))
            own = {kind: t.make_mat(rng, qtype, shape) for kind, shape in shapes.items()}
            pairs = (
                ("gate/up", t.Experts(own["gate"], own["up"], partner["down"])),
                ("down", t.Experts(partner["gate"], partner["up"], own["down"])),
            )
            for role, ex in pairs:
                name = f"{qtype}-{role.replace('/', '')}"
                err, emulated = measure(ex, name, args.tokens, args.top_k, executor, Path(d))
                print(
                    f"| {qtype} | {role} | {vec_dot_type(qtype)} | {err.mean():.4f} | "
                    f"{np.percentile(err, 99):.4f} | {err.max():.4f} | {emulated:.1e} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
