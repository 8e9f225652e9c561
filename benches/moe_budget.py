"""A model's GPU expert cache at a share of its expert bytes and llama.cpp's ``-ncmoe`` values
about the same VRAM, by bench_hybrid.py's rules (``cache_mib``, ``default_ncmoe``), on one
line for scripts/device.sh: the cache MiB, then the comma-separated ``-ncmoe`` values.

    python3 benches/moe_budget.py -m MODEL.gguf --fraction 0.25
    4428 26,28,31,41
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hybrid import cache_mib, default_ncmoe, model_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--fraction", type=float, default=0.25, help="share of the expert bytes")
    args = ap.parse_args()
    info = model_info(args.model)
    ncmoe = default_ncmoe(info["n_layers"], args.fraction)
    print(cache_mib(info["expert_bytes"], args.fraction), ",".join(map(str, ncmoe)))


if __name__ == "__main__":
    main()
