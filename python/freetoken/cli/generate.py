"""``freetoken generate``: continue a prompt, or chat (``-cnv``) with the model's template."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from freetoken.cli.args import add_model_arguments
from freetoken.engine import spec_options

if TYPE_CHECKING:
    from freetoken.llm import LLM

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``generate`` flags: the model's, sampling, prompt and length."""
    add_model_arguments(p)
    _add_sampling_arguments(p)
    spec_options.add_arguments(p)
    p.add_argument("-p", "--prompt", help="prompt (with -cnv: the system prompt)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate")
    p.add_argument(
        "-cnv", "--conversation", action="store_true", help="chat with the model's template"
    )


def _add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature (<= 0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=-1, help="RNG seed (-1: random)")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "temperature": args.temp,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "repeat_last_n": args.repeat_last_n,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": None if args.seed < 0 else args.seed,
    }


def _print_stats(llm: LLM) -> None:
    s = llm.last_stats
    print(
        f"\nprompt: {s.prompt_tokens} tokens, {s.prompt_tokens_per_s:.1f} t/s | "
        f"generation: {s.generated_tokens} tokens, {s.generation_tokens_per_s:.1f} t/s",
        file=sys.stderr,
    )
    if s.spec is not None:
        print(
            f"speculative: {s.spec.drafted} drafted, {s.spec.accepted} accepted "
            f"({100 * s.spec.acceptance:.1f}%), {sum(s.spec.steps.values())} verify steps",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    """Generates from ``-p``, or chats with ``-cnv``; the text on stdout, speeds on stderr."""
    from freetoken.llm import load_llm

    llm = load_llm(args)
    sampling = _sampling(args)
    if args.conversation:
        return _chat_loop(llm, args, sampling)
    prompt = args.prompt if args.prompt is not None else ""
    for piece in llm.generate(prompt, max_tokens=args.n_predict, stream=True, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(llm)
    return 0


def _chat_loop(llm: LLM, args: argparse.Namespace, sampling: dict[str, Any]) -> int:
    messages: list[dict[str, str]] = []
    if args.prompt:
        messages.append({"role": "system", "content": args.prompt})
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in llm.chat(messages, max_tokens=args.n_predict, stream=True, **sampling):
            sys.stdout.write(piece)
            sys.stdout.flush()
            reply.append(piece)
        sys.stdout.write("\n")
        _print_stats(llm)
        messages.append({"role": "assistant", "content": "".join(reply)})
