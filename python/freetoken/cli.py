"""The ``freetoken`` command line. Flags follow llama.cpp's where one exists."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from freetoken import __version__
from freetoken.engine import options as engine_options
from freetoken.errors import FreeTokenError

__all__ = ["main"]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF model path (default: the embedded Gemma 3 270M)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (0: model's)")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log placement, pools and per-step figures"
    )
    engine_options.add_arguments(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.8, help="temperature (<= 0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=-1, help="RNG seed (-1: random)")


def _sampling(args: argparse.Namespace) -> dict[str, object]:
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


def _load(args: argparse.Namespace) -> object:
    from freetoken.llm import load_llm

    return load_llm(args)


def _print_stats(llm: object) -> None:
    s = llm.last_stats  # type: ignore[attr-defined]
    print(
        f"\nprompt: {s.prompt_tokens} tokens, {s.prompt_tokens_per_s:.1f} t/s | "
        f"generation: {s.generated_tokens} tokens, {s.generation_tokens_per_s:.1f} t/s",
        file=sys.stderr,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    llm = _load(args)
    sampling = _sampling(args)
    if args.conversation:
        return _chat_loop(llm, args, sampling)
    prompt = args.prompt if args.prompt is not None else ""
    for piece in llm.generate(prompt, max_tokens=args.n_predict, stream=True, **sampling):  # type: ignore[attr-defined]
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(llm)
    return 0


def _chat_loop(llm: object, args: argparse.Namespace, sampling: dict[str, object]) -> int:
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
        for piece in llm.chat(messages, max_tokens=args.n_predict, stream=True, **sampling):  # type: ignore[attr-defined]
            sys.stdout.write(piece)
            sys.stdout.flush()
            reply.append(piece)
        sys.stdout.write("\n")
        _print_stats(llm)
        messages.append({"role": "assistant", "content": "".join(reply)})


def _cmd_inspect(args: argparse.Namespace) -> int:
    from freetoken.inspect import describe

    sys.stdout.write(describe(args.file, full=args.all))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from freetoken.bench import run_bench

    return run_bench(args)


def _cmd_info(args: argparse.Namespace) -> int:
    from freetoken.info import report

    print(report())
    return 0


class _InfoAction(argparse.Action):
    """``--version``: the version line and what this install can do (``freetoken info``)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        try:
            from freetoken.info import report

            print(report())
        except FreeTokenError as e:
            print(f"freetoken {__version__}\nerror: {e}", file=sys.stderr)
            parser.exit(2)
        parser.exit()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetoken", description="Run GGUF language models, MoE models beyond GPU memory."
    )
    parser.add_argument(
        "--version", action=_InfoAction, help="print what this install can do, then exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="version, CPU kernels, GPU library and device")
    info.set_defaults(func=_cmd_info)

    gen = sub.add_parser("generate", help="generate text from a prompt, or chat (-cnv)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("-p", "--prompt", help="prompt (with -cnv: the system prompt)")
    gen.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate")
    gen.add_argument(
        "-cnv", "--conversation", action="store_true", help="chat with the model's template"
    )
    gen.set_defaults(func=_cmd_generate)

    ins = sub.add_parser("inspect", help="print a GGUF file's metadata and tensors")
    ins.add_argument("file")
    ins.add_argument("--all", action="store_true", help="list every tensor, not per layer")
    ins.set_defaults(func=_cmd_inspect)

    bench = sub.add_parser("bench", help="prompt and decode speed, in the manner of llama-bench")
    _add_model_args(bench)
    bench.add_argument("-p", "--n-prompt", type=int, default=512)
    bench.add_argument("-n", "--n-gen", type=int, default=128)
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("-o", "--output", choices=["md", "json"], default="md")
    bench.set_defaults(func=_cmd_bench)

    from freetoken import server

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (aiohttp)")
    server.add_arguments(srv)
    srv.set_defaults(func=server.run)

    from freetoken import profile

    prof = sub.add_parser("profile", help="write a MoE model's expert-use profile")
    _add_model_args(prof)
    profile.add_arguments(prof)
    prof.set_defaults(func=profile.run)

    from freetoken import bandwidth

    bw = sub.add_parser("bench-bw", help="CPU, PCIe and GPU expert bandwidths per layer kind")
    bandwidth.add_arguments(bw)
    bw.set_defaults(func=bandwidth.run)

    from freetoken import testmodel

    mk = sub.add_parser("make-test-model", help="write a synthetic GGUF model")
    testmodel.add_arguments(mk)
    mk.set_defaults(func=testmodel.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: runs a subcommand; bad input prints one line and exits 2."""
    args = _build_parser().parse_args(argv)
    if args.command != "serve":  # the server configures its own logging
        logging.basicConfig(format="freetoken: %(message)s", level=logging.WARNING)
        verbose = getattr(args, "verbose", False)
        logging.getLogger("freetoken").setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except FreeTokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
