"""``freetoken make-test-model``: the command line of :func:`make_test_model`."""

from __future__ import annotations

import argparse
import sys

from freetoken.errors import FreeTokenError
from freetoken.testmodel.archs import ARCHS, swa_pattern_from_text
from freetoken.testmodel.check import MIN_TOP1, top1_probabilities
from freetoken.testmodel.writer import make_test_model

__all__ = ["add_arguments", "run"]

_DESCRIPTION = """\
Writes a synthetic GGUF model in a real architecture's tensor layout and metadata: seeded random
weights, scaled so that the next-token distribution is peaked (checked: the mean top-1
probability over a fixed prompt must be at least 0.2), a real vocabulary copied from a GGUF,
and per-tensor, per-layer quantization by a quant spec."""

_EPILOG = """\
quant spec (--quant): comma-separated items; the last rule that matches a tensor wins.
  TYPE                    the default for matrices no rule matches (F16 if none is given)
  NAME=TYPE               that matrix in every layer, or the global matrix
  blk.N.NAME=TYPE         only in layer N; also blk.N-M (inclusive) and blk.*
  NAME: attn_q attn_k attn_v attn_output ffn_gate ffn_up ffn_down token_embd output
        ffn_{gate,up,down}_exps ffn_{gate,up,down}_shexp (MoE); a glob such as attn_[qk];
        or a group: attn, ffn (experts too), exps, shexp, embd, *
  TYPE: any ggml storage type in any case: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k
        q4_k q5_k q6_k iq1_s iq1_m iq2_xxs iq2_xs iq2_s iq3_xxs iq3_s iq4_nl iq4_xs tq1_0
        tq2_0 mxfp4 nvfp4 q1_0 q2_0
  Norms and biases are always F32. Where a row length is not a multiple of the type's block
  size the type falls back as llama-quantize does: IQ* -> IQ4_NL; Q2_K Q3_K TQ* Q2_0 -> Q4_0;
  Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0; then F16 if that does not fit either;
  Q1_0 and NVFP4 have no fallback (an error, as in llama-quantize).
  examples: q4_k
            q8_0,attn=q4_0,ffn_down=q6_k,output=q8_0,embd=f16
            q4_0,blk.0-3.ffn_down=q5_k,blk.7.ffn=q8_0

default vocabularies (--vocab): llama: ggml-vocab-llama-spm.gguf, qwen2 and qwen3:
ggml-vocab-qwen2.gguf (from the llama.cpp tree's models/), gemma3: the default model's
(Gemma 3 270M) tokenizer."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds make-test-model's options to ``parser`` (and its description and grammar help)."""
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS), help="architecture")
    parser.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
    parser.add_argument("--hidden", type=int, default=256, help="embedding size (default 256)")
    parser.add_argument("--ffn", type=int, default=512, help="FFN size (default 512)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, help="head size (default: hidden / heads)")
    parser.add_argument(
        "--vocab", metavar="VOCAB.gguf", help="GGUF to copy the tokenizer.* keys from"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--quant", default="q8_0", metavar="SPEC", help="quant spec, see below (default q8_0)"
    )
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="GGUF to write")
    parser.add_argument(
        "--ctx", type=int, default=4096, help="context_length metadata (default 4096)"
    )
    parser.add_argument("--rope-theta", type=float, help="RoPE base (default: the family's)")
    parser.add_argument("--rms-eps", type=float, help="RMSNorm epsilon (default: the family's)")
    parser.add_argument(
        "--tied", action="store_true", help="no output.weight: the output reuses token_embd"
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        help="gemma3: local attention window (default 512; 0: every layer global)",
    )
    parser.add_argument(
        "--swa-pattern",
        metavar="N|0,1,..",
        help="gemma3: every N-th layer global, or 1 (sliding) / 0 (global) per layer "
        "(default: no key, llama.cpp's 6)",
    )
    parser.add_argument(
        "--rope-theta-swa",
        type=float,
        help="gemma3: RoPE base of the sliding layers (default: no key, llama.cpp's 10000)",
    )
    parser.add_argument("--name", help="general.name (default: FreeToken test ARCH)")
    parser.add_argument(
        "--check",
        choices=["auto", "freetoken", "llama.cpp", "none"],
        default="auto",
        help="engine of the peakedness check (auto: FreeToken if importable, else the "
        "llama.cpp reference; none: skip)",
    )


def run(args: argparse.Namespace) -> int:
    """Runs make-test-model with parsed ``args``; FreeTokenError on bad input or a flat model."""
    swa = None
    if args.swa_pattern is not None:
        swa = swa_pattern_from_text(args.swa_pattern, args.layers)
    path = make_test_model(
        args.arch,
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab=args.vocab,
        seed=args.seed,
        quant=args.quant,
        out=args.output,
        ctx=args.ctx,
        rope_theta=args.rope_theta,
        rms_eps=args.rms_eps,
        tied=args.tied,
        sliding_window=args.sliding_window,
        swa_pattern=swa,
        rope_theta_swa=args.rope_theta_swa,
        name=args.name,
    )
    size = path.stat().st_size / (1 << 20)
    print(f"wrote {path} ({size:.1f} MiB)", file=sys.stderr)
    if args.check == "none":
        return 0
    top1, engine = top1_probabilities(path, backend=args.check)
    mean = float(top1.mean())
    print(
        f"mean top-1 probability {mean:.3f} over {len(top1)} prompt tokens ({engine})",
        file=sys.stderr,
    )
    if mean < MIN_TOP1:
        raise FreeTokenError(
            f"{path}: the next-token distribution is too flat (mean top-1 {mean:.3f} < "
            f"{MIN_TOP1}); greedy comparisons on it would be coin flips"
        )
    return 0
