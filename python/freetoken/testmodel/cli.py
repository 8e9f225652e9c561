"""``freetoken make-test-model``: the command line of :func:`make_test_model`."""

from __future__ import annotations

import argparse
import sys

from freetoken.errors import FreeTokenError, InvalidInputError
from freetoken.testmodel.archs import OPTIONAL_FIELDS, swa_pattern_from_text
from freetoken.testmodel.archs_gemma4 import SHAPE_PRESETS as GEMMA4_PRESETS
from freetoken.testmodel.archs_hybrid import SHAPE_PRESETS as HYBRID_PRESETS
from freetoken.testmodel.check import MIN_TOP1, top1_probabilities
from freetoken.testmodel.registry import ARCHS
from freetoken.testmodel.routing import ZIPF_S
from freetoken.testmodel.writer import ROUTINGS, make_test_model

__all__ = ["SHAPE_PRESETS", "add_arguments", "run"]

#: The benchmark models' shapes (``--preset``).
SHAPE_PRESETS: dict[str, dict[str, object]] = {**HYBRID_PRESETS, **GEMMA4_PRESETS}

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

default vocabularies (--vocab), from the llama.cpp tree's models/: llama:
ggml-vocab-llama-spm.gguf; qwen2, qwen3, qwen2moe, qwen3moe, gpt-oss, glm4moe:
ggml-vocab-qwen2.gguf; olmoe: ggml-vocab-gpt-neox.gguf; deepseek2: ggml-vocab-deepseek-llm.gguf;
gemma4: ggml-vocab-gemma-4.gguf; gemma3: the default model's (Gemma 3 270M) tokenizer.

MoE examples:
  --arch qwen3moe --experts 16 --top-k 4 --expert-ffn 256 --quant q8_0,exps=q4_k
  --arch llama --experts 8 --top-k 2 --expert-layout per-expert        (Mixtral)
  --arch gpt-oss --experts 8 --top-k 4 --quant q8_0,exps=mxfp4 --sliding-window 8
  --arch deepseek2 --leading-dense 1 --shared-experts 1 --q-lora-rank 128
      --kv-lora-rank 64 --head-dim 48 --rope-dim 16 --expert-groups 4
      --expert-groups-used 2 --expert-weights-scale 2.5
Router weights are F32 (llama-quantize leaves ffn_gate_inp unquantized).

Gated DeltaNet hybrids (qwen35, qwen35moe, qwen3next): every --full-attention-interval-th
layer gated full attention (partial RoPE over --rope-dim, default a quarter of the head), the
others linear attention (--linear-k-heads, --linear-v-heads, --linear-head-dim, --conv-kernel);
quant names attn_qkv attn_gate ssm_beta ssm_alpha ssm_ba ssm_out (group ssm); ssm_conv1d is F32.
  --preset qwen3.5-35b-a3b --layers 8 --quant q8_0,exps=q4_k      (an 8-layer cut)
  --preset qwen3-next-80b-a3b

Gemma 4 (gemma4): dense by default (full layers --head-dim-full / --kv-heads-full, keys as
values); the E-series with --per-layer-width and --shared-kv-layers; the MoE with --experts
(the dense FFN is the shared expert; --expert-layout fused writes ffn_gate_up_exps).
  --preset gemma-4-26b-a4b --layers 6 --quant q8_0,exps=q4_k      (a 6-layer cut)
  --arch gemma4 --layers 6 --sliding-window 64 --swa-pattern 6 --per-layer-width 64
      --shared-kv-layers 2

big and skewed MoE models:
  --routing zipf gives each MoE layer hot experts: the route shares are about proportional to
  rank^-S (--zipf-s, default 0.55: with 128 experts the hottest 25% take half of the routes,
  as in Qwen3-30B-A3B), the ranks dealt to the experts by a per-layer permutation. It is made
  through the routers (ffn_gate_inp) and a shared direction in the token embeddings.
  --tile-experts N draws the routed experts of N MoE layers only; the i-th MoE layer repeats
  the (i mod N)-th's bytes (routers, attention and norms stay per layer), so a big model is
  written in a fraction of the time. --threads (default: every core) generate, quantize and
  write in parallel; the output does not depend on their number.
  Qwen3-30B-A3B's shape, 18 GB (on 2 cores: 43 s to write, 13 s for the check):
  --arch qwen3moe --layers 48 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128
      --experts 128 --top-k 8 --expert-ffn 768 --ffn 768 --quant q8_0,exps=q4_0
      --vocab ggml-vocab-qwen2.gguf --tile-experts 4 --routing zipf"""


#: Options passed on only when given (each architecture refuses the ones it does not have):
#: the architecture-specific fields, less those every MoE architecture takes as flags.
_ARCH_OPTIONS = tuple(
    k
    for k in OPTIONAL_FIELDS
    if k
    not in ("experts", "top_k", "expert_ffn", "shared_experts", "leading_dense", "expert_layout")
)


def _on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "1", "yes"):
        return True
    if text.lower() in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds make-test-model's options to ``parser`` (and its description and grammar help)."""
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--arch", choices=sorted(ARCHS), help="architecture (required unless --preset gives it)"
    )
    parser.add_argument(
        "--preset",
        choices=sorted(SHAPE_PRESETS),
        help="a benchmark model's shape (architecture and sizes); the flags given override it",
    )
    parser.add_argument("--layers", type=int, help="blocks (default 2)")
    parser.add_argument("--hidden", type=int, help="embedding size (default 256)")
    parser.add_argument("--ffn", type=int, help="FFN size (default 512)")
    parser.add_argument("--heads", type=int, help="attention heads (default 4)")
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
        "--ctx", type=int, help="context_length metadata (default: the preset's, else 4096)"
    )
    parser.add_argument("--rope-theta", type=float, help="RoPE base (default: the family's)")
    parser.add_argument("--rms-eps", type=float, help="RMSNorm epsilon (default: the family's)")
    parser.add_argument(
        "--tied", action="store_true", help="no output.weight: the output reuses token_embd"
    )
    parser.add_argument(
        "--sliding-window",
        type=int,
        help="gemma3, gpt-oss: local attention window (gemma3: default 512, 0: every layer "
        "global; gpt-oss: default 128)",
    )
    parser.add_argument(
        "--swa-pattern",
        metavar="N|0,1,..",
        help="gemma3, gpt-oss: every N-th layer global, or 1 (sliding) / 0 (global) per layer "
        "(default: no key, llama.cpp's 6; gpt-oss: 2)",
    )
    parser.add_argument(
        "--rope-theta-swa",
        type=float,
        help="gemma3: RoPE base of the sliding layers (default: no key, llama.cpp's 10000)",
    )
    moe = parser.add_argument_group(
        "mixture of experts (qwen3moe qwen2moe llama olmoe gpt-oss glm4moe deepseek2 qwen35moe "
        "qwen3next)"
    )
    moe.add_argument(
        "--experts",
        type=int,
        metavar="E",
        help="routed experts per layer (default 8; llama: 0, dense, else Mixtral)",
    )
    moe.add_argument("--top-k", type=int, metavar="K", help="experts per token (default 2)")
    moe.add_argument(
        "--expert-ffn",
        type=int,
        metavar="I",
        help="one expert's FFN width (default: --ffn)",
    )
    moe.add_argument(
        "--shared-experts",
        type=int,
        metavar="N",
        help="shared experts, N * I wide (qwen2moe glm4moe deepseek2; default 1)",
    )
    moe.add_argument(
        "--leading-dense",
        type=int,
        default=0,
        metavar="N",
        help="first N layers dense, --ffn wide (glm4moe deepseek2; default 0)",
    )
    moe.add_argument(
        "--expert-layout",
        choices=["stacked", "per-expert", "fused"],
        help="llama (Mixtral): stacked ffn_*_exps, or the older ffn_*.E per expert (which "
        "this llama.cpp no longer loads); gemma4: stacked or fused ffn_gate_up_exps "
        "(default stacked)",
    )
    moe.add_argument(
        "--expert-gating",
        choices=["softmax", "sigmoid"],
        help="deepseek2: softmax (V2) or sigmoid with exp_probs_b (V3, the default)",
    )
    moe.add_argument(
        "--expert-weights-norm",
        type=_on_off,
        metavar="on|off",
        help="glm4moe deepseek2: renormalize the top-k weights (default on)",
    )
    moe.add_argument(
        "--expert-weights-scale",
        type=float,
        metavar="S",
        help="glm4moe deepseek2: routed scaling factor (default 1)",
    )
    moe.add_argument(
        "--expert-groups",
        type=int,
        default=0,
        metavar="G",
        help="glm4moe deepseek2: expert groups for grouped top-k (default: none)",
    )
    moe.add_argument(
        "--expert-groups-used",
        type=int,
        default=0,
        metavar="U",
        help="glm4moe deepseek2: groups kept per token",
    )
    attn = parser.add_argument_group("attention variants")
    attn.add_argument(
        "--rope-dim",
        type=int,
        help="glm4moe: rotated dims per head (default half); deepseek2: qk_rope_head_dim "
        "(default half of --head-dim)",
    )
    attn.add_argument(
        "--qk-norm", action="store_true", default=None, help="glm4moe: per-head q/k norms"
    )
    attn.add_argument(
        "--q-lora-rank",
        type=int,
        help="deepseek2: q compression rank (default hidden/2; 0: a plain attn_q)",
    )
    attn.add_argument(
        "--kv-lora-rank", type=int, help="deepseek2: kv compression rank (default hidden/4)"
    )
    attn.add_argument(
        "--v-head-dim", type=int, help="deepseek2: value head size (default head-dim - rope-dim)"
    )
    lin = parser.add_argument_group("Gated DeltaNet linear attention (qwen35 qwen35moe qwen3next)")
    lin.add_argument(
        "--linear-k-heads",
        type=int,
        metavar="N",
        help="query/key heads of the linear attention (default hidden / head size)",
    )
    lin.add_argument(
        "--linear-v-heads", type=int, metavar="N", help="value heads (default twice the key heads)"
    )
    lin.add_argument(
        "--linear-head-dim", type=int, metavar="D", help="key and value head size (default "
        "min(128, hidden / 2))"
    )  # fmt: skip
    lin.add_argument("--conv-kernel", type=int, metavar="K", help="conv1d width (default 4)")
    lin.add_argument(
        "--full-attention-interval",
        type=int,
        metavar="N",
        help="every N-th layer full attention, the others linear (default 4)",
    )
    g4 = parser.add_argument_group("Gemma 4 (gemma4)")
    g4.add_argument("--head-dim-full", type=int, help="full layers' head size (default --head-dim)")
    g4.add_argument(
        "--kv-heads-full", type=int, help="full layers' key/value heads (default --kv-heads)"
    )
    g4.add_argument(
        "--per-layer-width", type=int, help="E-series per-layer input width (default 0: none)"
    )
    g4.add_argument(
        "--shared-kv-layers",
        type=int,
        help="E-series: trailing layers reading earlier layers' caches (default 0)",
    )
    parser.add_argument(
        "--nextn-layers",
        type=int,
        metavar="N",
        help="multi-token-prediction (nextn) layers after the trunk (qwen35, qwen35moe, "
        "qwen3next, glm4moe; default 0)",
    )
    big = parser.add_argument_group("big and skewed MoE models (see below)")
    big.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="uniform",
        help="uniform: no preferred experts (default); zipf: per-layer hot experts",
    )
    big.add_argument(
        "--zipf-s",
        type=float,
        default=ZIPF_S,
        metavar="S",
        help=f"zipf routing: route shares ~ rank^-S (default {ZIPF_S})",
    )
    big.add_argument(
        "--tile-experts",
        type=int,
        default=0,
        metavar="N",
        help="draw only N MoE layers' experts, the others repeat them (default 0: all)",
    )
    big.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="threads generating, quantizing and writing (default: every core)",
    )
    parser.add_argument("--name", help="general.name (default: FreeToken test ARCH)")
    parser.add_argument(
        "--check",
        choices=["auto", "freetoken", "llama.cpp", "none"],
        default="auto",
        help="engine of the peakedness check (auto: FreeToken if importable, else the "
        "llama.cpp reference; none: skip)",
    )


#: The shape flags' defaults where neither the flag nor a preset gives a value.
_SHAPE_DEFAULTS: dict[str, object] = {
    "layers": 2, "hidden": 256, "ffn": 512, "heads": 4, "experts": 0, "top_k": 0,
    "expert_ffn": 0, "ctx": 4096,
}  # fmt: skip


def _apply_preset(args: argparse.Namespace) -> None:
    """Fills the flags not given from ``--preset`` and then from :data:`_SHAPE_DEFAULTS`."""
    preset = SHAPE_PRESETS[args.preset] if args.preset else {}
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key, value in _SHAPE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.arch is None:
        raise InvalidInputError("give --arch or --preset")


def run(args: argparse.Namespace) -> int:
    """Runs make-test-model with parsed ``args``; FreeTokenError on bad input or a flat model."""
    _apply_preset(args)
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
        experts=args.experts,
        top_k=args.top_k,
        expert_ffn=args.expert_ffn,
        shared_experts=args.shared_experts,
        leading_dense=args.leading_dense,
        expert_layout=args.expert_layout or "stacked",
        name=args.name,
        routing=args.routing,
        zipf_s=args.zipf_s,
        tile_experts=args.tile_experts,
        threads=args.threads,
        **{k: getattr(args, k) for k in _ARCH_OPTIONS if getattr(args, k) is not None},
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
