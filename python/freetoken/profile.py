"""``freetoken profile``: run prompts through a MoE model and write its expert-use profile,
the per-layer routes per expert that the GPU expert cache is sized and seeded from.
The format is documented in ``docs/expert-profile.md``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from freetoken.engine import options as engine_options
from freetoken.errors import InvalidInputError, UnsupportedError

__all__ = ["FORMAT", "add_arguments", "expert_profile", "run"]

FORMAT = "freetoken.expert-profile"
VERSION = 1


def expert_profile(llm: Any) -> dict[str, Any]:
    """The profile of everything ``llm`` has computed so far (from the permanent counters)."""
    moe = llm.model.moe
    if moe is None:
        raise UnsupportedError(f"{llm.path} is not a mixture-of-experts model")
    cfg = llm.model.cfg
    layers = []
    for i, counts in enumerate(moe.collect().expert_counts()):
        if counts:
            layers.append({"layer": i, "routes": sum(counts), "counts": list(counts)})
    top_k = cfg.n_experts_used
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": {
            "file": os.path.basename(llm.path),
            "name": llm.gguf.metadata.get("general.name", ""),
            "architecture": cfg.arch,
            "n_layers": cfg.n_layers,
            "n_experts": cfg.n_experts,
            "top_k": top_k,
        },
        "tokens": layers[0]["routes"] // top_k if layers and top_k else 0,
        "layers": layers,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``profile`` subcommand's flags (model flags are added by the CLI)."""
    p.add_argument("--prompts", required=True, help="text file, one prompt per line")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate each")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile")


def run(args: argparse.Namespace) -> int:
    """Runs each prompt greedily and writes the profile."""
    try:
        prompts = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise InvalidInputError(f"cannot read --prompts {args.prompts}: {e.strerror}") from None
    if not prompts:
        raise InvalidInputError(f"{args.prompts} holds no prompts")
    llm = engine_options.load_llm(args)
    expert_profile(llm)  # fails early on a dense model
    for prompt in prompts:
        for _ in llm.generate(prompt, max_tokens=args.n_predict, stream=True, temperature=0):
            pass
    profile = expert_profile(llm)
    Path(args.output).write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {args.output}: {profile['tokens']} tokens, {len(profile['layers'])} MoE layers")
    return 0
