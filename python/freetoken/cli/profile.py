"""``freetoken profile``: run prompts through a MoE model and write its expert-use profile
(:mod:`freetoken.runtime.expert_profile`, docs/expert-profile.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from freetoken.cli.args import add_model_arguments
from freetoken.errors import InvalidInputError
from freetoken.runtime.expert_profile import expert_profile, write_profile

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``profile`` subcommand's flags: the model's, the prompts, the length and output."""
    add_model_arguments(p)
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
    from freetoken.llm import load_llm

    llm = load_llm(args)
    expert_profile(llm)  # fails early on a dense model
    for prompt in prompts:
        for _ in llm.generate(prompt, max_tokens=args.n_predict, stream=True, temperature=0):
            pass
    profile = expert_profile(llm)
    write_profile(profile, args.output)
    print(f"wrote {args.output}: {profile['tokens']} tokens, {len(profile['layers'])} MoE layers")
    return 0
