"""``freetoken bench-bw``: measures this machine's bandwidth figures per layer kind of a MoE
model, saves them for the engine (:mod:`freetoken.engine.bandwidth_profile`) and prints them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_arguments", "markdown", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench-bw`` subcommand's flags."""
    p.add_argument("-m", "--model", required=True, help="GGUF model path (a MoE model)")
    p.add_argument(
        "-t", "--threads", type=int, default=None, help="CPU expert threads (default: as hybrid)"
    )
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="md table or JSON")
    p.add_argument(
        "--seconds", type=float, default=2.0, help="duration of each measurement (default 2)"
    )
    p.add_argument(
        "--no-mmap",
        dest="mmap",
        action="store_false",
        help="read the model into memory first, as the engine's --no-mmap",
    )


def _gbps(rate: dict[str, Any] | None) -> str:
    return f"{rate['gbps']:.2f}" if rate else "-"


def markdown(doc: dict[str, Any]) -> str:
    """The table ``bench-bw -o md`` prints."""
    gpu = doc["gpu"]
    about = gpu["name"] if gpu["available"] else f"none ({gpu['detail']})"
    lines = [
        f"CPU: {doc['host']['cpu']}, {doc['host']['threads']} expert threads; GPU: {about}",
        "",
        "| kind | layers | expert KiB | CPU t1 GB/s | CPU t8 GB/s | PCIe GB/s | fetch kernel "
        "GB/s | GPU t1 GB/s | CPU with GPU | GPU with CPU | CPU with fetch | fetch with CPU "
        "| break-even reuse |",
        "| --- | --- |" + " ---: |" * 11,
    ]
    for key, e in doc["kinds"].items():
        reuse = e["break_even_reuse"]
        lines.append(
            f"| {key} | {','.join(map(str, e['layers']))} | {e['expert_bytes'] / 1024:.1f} "
            f"| {_gbps(e['cpu_t1'])} | {_gbps(e['cpu_t8'])} | {_gbps(e['pcie_expert'])} "
            f"| {_gbps(e['pcie_gather'])} | {_gbps(e['gpu_t1'])} | {_gbps(e['cpu_t1_with_gpu'])} "
            f"| {_gbps(e['gpu_t1_with_cpu'])} | {_gbps(e['cpu_t1_with_gather'])} "
            f"| {_gbps(e['pcie_gather_with_cpu'])} | {'-' if reuse is None else f'{reuse:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Measures, saves the profile in the cache and prints it (md table or JSON)."""
    from freetoken.engine.bandwidth_profile import document, save

    doc = document(args.model, args.threads, args.seconds, args.mmap)
    path = save(doc)
    sys.stdout.write(json.dumps(doc) + "\n" if args.output == "json" else markdown(doc))
    print(f"wrote {path}", file=sys.stderr)
    return 0
