"""Writing a synthetic model: seeded weights, quantized by the spec, streamed into a GGUF.

How the weights are scaled (so that activations stay sane and the next token is predictable):

- Token embeddings are N(0, s^2/hidden). The output projection's row for an ordinary token j is
  the embedding of token perm(j), for a seeded permutation perm of the ordinary tokens (with
  ``tied`` it is the embedding itself). So the residual stream's embedding part makes the model
  predict perm^-1(current token): a peaked distribution, and greedy runs that walk through
  varied tokens instead of repeating one. Control, byte and unused tokens get output rows of
  half the size, so they are rarely predicted.
- Each attention and FFN block adds a random output of RMS ``BLOCKS_RMS / sqrt(2 * layers)``
  times the embedding's (set by attn_output / ffn_down, or by the post norms where the family
  has them), so together they perturb the embedding by about ``BLOCKS_RMS``: every layer moves
  every logit by a fair part of a unit, and the distribution depends on the context.
- ``s`` (the spread of the logits) is solved from hidden size, vocabulary size and the
  perturbation so that the expected top-1 probability is about ``TARGET_TOP1``.
- Input projections are N(0, 1/K) so that q, k, v, gate and up have unit-size entries; q is
  sharpened by ``ATTN_SHARPNESS`` so attention is not a plain average. Norm weights are
  1 + N(0, 0.05^2) (Gemma's too: GGUF stores its effective multiplier ``1 + w``). Biases are
  N(0, 0.1^2); biases added to a block's output (gpt-oss) are a fraction of the block's size.
- MoE layers: router rows are N(0, ROUTER_SCALE^2 / hidden), so the router logits spread over
  a few units and the tokens pick varied experts (for sigmoid gating a smaller scale was
  measured not to make the top-k choice more robust to rounding, see
  :mod:`~freetoken.testmodel.routing`). Each expert is an FFN as above; the down projections
  are scaled by ``1 / sqrt(E[sum_k w_k^2])`` for the architecture's routing weights ``w``
  (estimated by simulating the routing on such logits), so the routed sum has the block's
  size whatever the routing. With shared experts, the routed part carries 2/3 of the block's
  power. Selection biases (``exp_probs_b``) are N(0, 0.02^2) against sigmoid scores spread
  over (0, 1); gpt-oss's attention sinks are N(0, 1) logits.
- Skewed routing (``routing="zipf"``): every token embedding gets a shared component
  ``SHARED_EMBD * |e| * u`` along one seeded unit direction ``u``, so every normed hidden state
  has about the same projection ``c = SHARED_EMBD * sqrt(hidden / (1 + SHARED_EMBD^2))`` on
  ``u`` (measured: later layers hardly lower it). Each router row loses its random ``u``
  component and gets ``b_e / c`` along ``u`` instead, so its logit carries a per-expert bias
  ``b_e``: the biases of :func:`~freetoken.testmodel.routing.popularity_bias`, which give
  Zipf-like route shares (rank^-s), dealt to the experts by a per-layer seeded permutation
  (each layer has other hot experts). The output projection is built from the embeddings
  without the shared component.
- Tiled experts (``tile_experts=N``): the i-th MoE layer's routed expert matrices have the
  values of the (i mod N)-th's, and the same bytes where the types agree (kept in memory once,
  written again); routers, attention and norms stay per layer. Generating the experts, most
  of a big model's work, then takes N / layers of the time; writing the file does not shrink.

Tensors are generated, quantized and written by a pool of threads (numpy's generators, the
quantizer and ``os.pwrite`` release the GIL), one task per expert of a stack, per block of
rows of the embeddings and the output, or per other tensor, each written straight to its
offset in GGUFWriter's layout. Memory holds the pieces of at most ``2 * threads`` tasks, the
float32 embeddings, and the tiled layers' experts.

Every tensor comes from its own generator, seeded by (seed, tensor name), so a test can
regenerate any tensor's source values with :func:`source_tensors`. A stack of experts draws
each expert from its own generator, seeded by (seed, ``name#expert``), so that the stacked and
the per-expert layouts of one seed hold the same weights.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, GGUFWriter

from freetoken import quant as qt
from freetoken.errors import FileAccessError, InvalidInputError
from freetoken.testmodel.archs import (
    OPTIONAL_FIELDS,
    ArchSpec,
    MetaItem,
    ModelConfig,
    TensorDef,
    gated_act_rms,
)
from freetoken.testmodel.registry import get_arch
from freetoken.testmodel.routing import (
    PROBS_BIAS_STD,
    ROUTER_SCALE,
    ZIPF_S,
    popularity_bias,
    routed_power,
)
from freetoken.testmodel.spec import QuantSpec, fallback_type, parse_quant_spec, type_name
from freetoken.testmodel.vocab import Vocab, read_vocab, resolve_vocab

__all__ = [
    "ROUTINGS",
    "GenOptions",
    "PlannedTensor",
    "WeightGen",
    "build_config",
    "make_test_model",
    "plan_tensors",
    "routed_power",
    "source_tensors",
]

#: Total RMS of all blocks' outputs relative to the embedding in the residual stream.
BLOCKS_RMS = 1.5
#: The expected top-1 probability the logit spread is solved for (the check wants >= 0.2).
TARGET_TOP1 = 0.5
#: Factor on q so that attention scores spread over a few units, not one.
ATTN_SHARPNESS = 2.0
NORM_JITTER = 0.05
BIAS_STD = 0.1
#: The routed experts' share of an MoE block's power when it has shared experts.
ROUTED_SHARE = 2.0 / 3.0
#: Biases added to a block's output, relative to the block's size.
OUT_BIAS_SCALE = 0.3
#: Output rows of control, byte and unused tokens relative to ordinary ones.
SPECIAL_OUTPUT_SCALE = 0.5
#: Skewed routing: the shared component of the token embeddings relative to their size.
SHARED_EMBD = 0.5
#: Values per generation task and per quantizer call, so big matrices are cut into row blocks.
CHUNK_ELEMENTS = 1 << 24
#: The routings make-test-model draws.
ROUTINGS = ("uniform", "zipf")

# llama.cpp's file types (include/llama.h, llama_ftype) by the type most matrices have, as
# llama.cpp itself guesses them for files without general.file_type.
_FILE_TYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23,
    "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ2_S": 28, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32,
    "TQ1_0": 36, "TQ2_0": 37, "MXFP4": 38, "NVFP4": 39, "Q1_0": 40, "Q2_0": 41,
}  # fmt: skip

_BLK = re.compile(r"^blk\.\d+\.")

#: One piece of a tensor: its rows (of ``K`` values; 1 for a vector) and how to make them.
Piece = tuple[int, Callable[[], np.ndarray]]


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of the layout with the type it is written in."""

    tensor: TensorDef
    qtype: int
    requested: int
    """The type the spec asked for; differs from ``qtype`` after a fallback."""

    @property
    def fell_back(self) -> bool:
        """Whether the row length forced another type."""
        return self.qtype != self.requested

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        t = self.tensor
        rows = math.prod(t.shape[:-1])
        return qt.type_info(self.qtype).row_size(t.k) * rows


@dataclass(frozen=True)
class GenOptions:
    """How the weights are drawn beyond the model's shape (see the module docstring)."""

    routing: str = "uniform"
    """``uniform``: no preferred experts; ``zipf``: per-layer expert popularity ~ rank^-s."""
    zipf_s: float = ZIPF_S
    """The Zipf exponent of ``zipf`` routing (0: uniform shares)."""
    tile_experts: int = 0
    """0: every MoE layer's experts drawn; N: the i-th MoE layer's are the (i mod N)-th's."""

    def validate(self, arch: ArchSpec, cfg: ModelConfig) -> None:
        """InvalidInputError for options the model cannot have."""
        if self.routing not in ROUTINGS:
            raise InvalidInputError(
                f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}"
            )
        tile = self.tile_experts
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0:
            raise InvalidInputError(f"tile-experts must be an integer >= 0, got {tile!r}")
        if not math.isfinite(self.zipf_s) or self.zipf_s < 0:
            raise InvalidInputError(f"zipf-s must be >= 0, got {self.zipf_s}")
        if not arch.is_moe(cfg):
            if self.routing != "uniform" or tile:
                raise InvalidInputError("routing and tile-experts need routed experts")

    def metadata(self) -> list[MetaItem]:
        """Provenance keys for the options that differ from the defaults."""
        key = "freetoken.test_model."
        items = []
        if self.routing != "uniform":
            items.append(MetaItem(key + "routing", self.routing, GGUFValueType.STRING))
            items.append(MetaItem(key + "zipf_s", float(self.zipf_s), GGUFValueType.FLOAT32))
        if self.tile_experts:
            items.append(MetaItem(key + "tile_experts", self.tile_experts, GGUFValueType.UINT32))
        return items


def build_config(
    arch: str,
    *,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int | None,
    head_dim: int | None,
    vocab_size: int,
    **options: object,
) -> ModelConfig:
    """A validated :class:`ModelConfig` with the architecture's defaults filled in."""
    spec = get_arch(arch)
    if not isinstance(heads, int) or heads < 1:
        raise InvalidInputError(f"heads must be a positive integer, got {heads!r}")
    if head_dim is None:
        if hidden % heads:
            raise InvalidInputError(
                f"hidden ({hidden}) is not a multiple of heads ({heads}); give head_dim"
            )
        head_dim = hidden // heads
    cfg = ModelConfig(
        arch=arch,
        layers=layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        **options,  # type: ignore[arg-type]
    )
    cfg = spec.defaults(cfg)
    spec.validate(cfg)
    return cfg


def plan_tensors(arch: ArchSpec, cfg: ModelConfig, spec: QuantSpec) -> list[PlannedTensor]:
    """Every tensor of the model with its type: the spec's, after llama-quantize's fallback."""
    spec.check_layers(cfg.layers)
    f32 = qt.type_info("F32").id
    plan = []
    for t in arch.tensors(cfg):
        if not t.quantizable:
            plan.append(PlannedTensor(t, f32, f32))
            continue
        requested = spec.requested_type(t.short, t.layer)
        try:
            qtype = fallback_type(requested, t.k)
        except InvalidInputError as e:
            raise InvalidInputError(f"{t.name}: {e}") from None
        plan.append(PlannedTensor(t, qtype, requested))
    return plan


def _log_partition(s: float, n: int) -> float:
    """ln sum_k exp(s * z_k) for n standard normal z_k: ln(n) + s^2/2 while the sum is an
    average (s below sqrt(2 ln n)), else dominated by the largest terms, s * sqrt(2 ln n)
    (the random energy model's two regimes)."""
    ln_n = math.log(max(n, 2))
    s_c = math.sqrt(2.0 * ln_n)
    return ln_n + s * s / 2.0 if s <= s_c else s * s_c


def _logit_spread(hidden: int, n_out: int, target: float, shared_power: float = 0.0) -> float:
    """The std ``s`` of the other tokens' logits for which the expected top-1 is ``target``.

    The final hidden state is RMS-normed (|h|^2 = hidden); its embedding part makes the
    matching logit about s * sqrt(hidden) / sqrt(1 + shared_power + BLOCKS_RMS^2) (the shared
    component of skewed routing takes ``shared_power``), the others are N(0, s^2).
    Solves match - ln(sum of the others' exp) = logit(target) for the smallest such s (or the
    best s where no s reaches it).
    """
    a = math.sqrt(hidden / (1.0 + shared_power + BLOCKS_RMS**2))
    want = math.log(target / (1.0 - target))
    best_s, best = 0.5, -math.inf
    s = 0.5
    while s <= 64.0:
        margin = a * s - _log_partition(s, n_out)
        if margin >= want:
            return s
        if margin > best:
            best_s, best = s, margin
        s += 0.01
    return best_s


class WeightGen:
    """The float32 source values of each tensor (deterministic in seed, tensor name and
    :class:`GenOptions`); safe to use from several threads."""

    def __init__(
        self,
        arch: ArchSpec,
        cfg: ModelConfig,
        seed: int,
        normal: np.ndarray,
        options: GenOptions | None = None,
    ) -> None:
        self.arch, self.cfg, self.seed = arch, cfg, seed
        self.normal = normal
        self.options = options or GenOptions()
        h = cfg.hidden
        routing = arch.routing(cfg)
        # Skewed routing: the logit bias of each popularity rank, hottest first.
        self.popularity: np.ndarray | None = None
        if routing is not None and self.options.routing == "zipf":
            self.popularity = popularity_bias(cfg.experts, cfg.top_k, self.options.zipf_s)
        shared_power = SHARED_EMBD**2 if self.popularity is not None else 0.0
        n_out = int(normal.sum()) or cfg.vocab_size
        spread = _logit_spread(h, n_out, TARGET_TOP1, shared_power)
        self.sigma_embd = spread / math.sqrt(h)
        # The residual stream's size: gemma multiplies the embeddings by sqrt(hidden).
        self.sigma_res = self.sigma_embd * (math.sqrt(h) if arch.embed_scale else 1.0)
        self.block_rms = BLOCKS_RMS / math.sqrt(2 * cfg.layers) * self.sigma_res
        self.act_rms = gated_act_rms(arch.ffn_act)
        self._embd: np.ndarray | None = None
        self._perm: np.ndarray | None = None
        self._lock = threading.Lock()
        # MoE: with shared experts, the routed ones carry 2/3 of the FFN block's power.
        shared = bool(cfg.shared_experts)
        self.moe_share = math.sqrt(ROUTED_SHARE) if shared else 1.0
        self.shexp_share = math.sqrt(1.0 - ROUTED_SHARE)
        self.routed_gain = 1.0
        if routing is not None:
            self.routed_gain = 1.0 / math.sqrt(routed_power(routing, cfg.experts, self.popularity))
        # qwen2moe scales the shared expert by sigmoid(z), z ~ N(0, 1).
        self.shexp_gain = 1.0 / _sigmoid_rms() if getattr(arch, "shared_gate", False) else 1.0
        # Gated attention (the hybrids) scales the heads' averaged values by sigmoid(gate):
        # 2 / RMS(sigmoid) brings the block back to the others' size (measured: without it
        # zeroing a full-attention layer moved the distribution by a KL of 0.01 only).
        self.attn_gain = 2.0 / _sigmoid_rms() if getattr(arch, "gated_attention", False) else 1.0

    def rng(self, name: str) -> np.random.Generator:
        """The generator of tensor ``name``."""
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def embeddings(self) -> np.ndarray:
        """The token embeddings as float32, without skewed routing's shared component (kept:
        the output projection is built from them)."""
        with self._lock:
            if self._embd is None:
                cfg = self.cfg
                rng = self.rng("token_embd.weight")
                e = rng.standard_normal((cfg.vocab_size, cfg.hidden), dtype=np.float32)
                e *= np.float32(self.sigma_embd)
                self._embd = e
            return self._embd

    def permutation(self) -> np.ndarray:
        """perm: the output row of ordinary token j is the embedding of token perm[j]."""
        with self._lock:
            if self._perm is None:
                perm = np.arange(self.cfg.vocab_size)
                idx = np.flatnonzero(self.normal)
                perm[idx] = idx[self.rng("output.permutation").permutation(len(idx))]
                self._perm = perm
            return self._perm

    def shared_direction(self) -> np.ndarray:
        """Skewed routing's unit direction ``u`` (float64, ``hidden``)."""
        u = self.rng("routing.direction").standard_normal(self.cfg.hidden)
        return u / np.linalg.norm(u)

    def tiled(self, t: TensorDef) -> bool:
        """Whether ``t`` is a routed expert matrix that ``tile_experts`` shares between
        layers."""
        return bool(self.options.tile_experts) and t.layer is not None and t.short.endswith("_exps")

    def source_layer(self, t: TensorDef) -> int | None:
        """The layer whose values ``t`` has: its own, or for tiled experts that of the MoE
        layer it repeats."""
        if not self.tiled(t):
            return t.layer
        assert t.layer is not None
        first, n = self.cfg.leading_dense, self.options.tile_experts
        return first + (t.layer - first) % n

    def source_key(self, t: TensorDef) -> str:
        """The generator key of ``t``'s values: its name, with tiled experts' layer that of
        :meth:`source_layer`; ``stacked#expert`` for a per-expert matrix."""
        name = t.name if t.source is None else f"{t.source[0]}#{t.source[1]}"
        if not self.tiled(t):
            return name
        return _BLK.sub(f"blk.{self.source_layer(t)}.", name)

    def tensor(self, t: TensorDef) -> np.ndarray:
        """The source values of ``t``, float32, shape ``t.shape``."""
        parts = [make() for _, make in self.pieces(t)]
        if len(parts) == 1:
            return parts[0].reshape(t.shape)
        return np.concatenate([p.reshape(-1, t.k) for p in parts]).reshape(t.shape)

    def pieces(self, t: TensorDef) -> list[Piece]:
        """``t`` cut for the threads, in row order: one piece per expert of a stack (and per
        head of MLA's ``attn_k_b`` / ``attn_v_b``), blocks of rows of the embeddings and the
        output, else the whole tensor. Each piece is (rows, a function making them)."""
        role, k = t.role, t.k
        rows = math.prod(t.shape[:-1])
        if role in ("embd", "output"):
            step = max(1, CHUNK_ELEMENTS // k)
            make = self._embd_rows if role == "embd" else self._output_rows
            return [
                (min(step, rows - r), functools.partial(make, r, min(r + step, rows)))
                for r in range(0, rows, step)
            ]
        std = self._matrix_std(t)
        if std is None:
            return [(rows, lambda: self._vector(t))]
        name = self.source_key(t)
        if t.source is not None:
            return [(rows, lambda: self._normal(name, t.shape, std))]
        if len(t.shape) == 3:
            n = t.shape[1]
            return [
                (n, functools.partial(self._normal, f"{name}#{x}", t.shape[1:], std))
                for x in range(t.shape[0])
            ]
        if role == "router" and self.popularity is not None:
            return [(rows, lambda: self._skewed_router(t, std))]
        return [(rows, lambda: self._normal(name, t.shape, std))]

    def _embd_rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of ``token_embd``: the embeddings, with skewed routing's shared
        component."""
        e = self.embeddings()[lo:hi]
        if self.popularity is None:
            return e
        size = SHARED_EMBD * self.sigma_embd * math.sqrt(self.cfg.hidden)
        return e + (size * self.shared_direction()).astype(np.float32)

    def _output_rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of the output projection: permuted embeddings, smaller for the
        tokens that are not ordinary."""
        w = self.embeddings()[self.permutation()[lo:hi]]
        w[~self.normal[lo:hi]] *= np.float32(SPECIAL_OUTPUT_SCALE)
        return w

    def _skewed_router(self, t: TensorDef, std: float) -> np.ndarray:
        """A router whose logits carry the popularity biases, dealt to the experts by the
        layer's permutation, through the shared direction (module docstring)."""
        assert self.popularity is not None and t.layer is not None
        cfg, u = self.cfg, self.shared_direction()
        along = SHARED_EMBD * math.sqrt(cfg.hidden / (1.0 + SHARED_EMBD**2))  # c
        w = self._normal(t.name, t.shape, std).astype(np.float64)
        # The random part without its u component, rescaled to keep logits N(0, std^2 H).
        w -= np.outer(w @ u, u)
        w /= math.sqrt(1.0 - along**2 / cfg.hidden)
        bias = self.popularity[self.rng(f"{t.name}#popularity").permutation(cfg.experts)]
        w += np.outer(bias / along, u)
        return w.astype(np.float32)

    def _normal(self, key: str, shape: tuple[int, ...], std: float) -> np.ndarray:
        w = self.rng(key).standard_normal(shape, dtype=np.float32)
        w *= np.float32(std)
        return w

    def _vector(self, t: TensorDef) -> np.ndarray:
        """Norms, biases, routers' side vectors, sinks."""
        rng = self.rng(t.name)
        role = t.role
        if role == "norm":
            w = 1.0 + NORM_JITTER * rng.standard_normal(t.shape, dtype=np.float32)
            if t.short == "attn_q_norm":
                unscaled = math.sqrt(t.k) if self.arch.attn_unscaled else 1.0
                w *= np.float32(ATTN_SHARPNESS / unscaled)
            return w.astype(np.float32)
        if role == "input_scale":
            # Undoes a 1/sqrt(K) the graph applies to the input (gemma4's router).
            w = 1.0 + NORM_JITTER * rng.standard_normal(t.shape, dtype=np.float32)
            return (w * np.float32(math.sqrt(t.k))).astype(np.float32)
        if role == "proportional_rope":
            # The first quarter of the pairs turn, the rest do not (infinite factors).
            n = t.shape[0]
            return np.array([1.0] * (n // 4) + [1e30] * (n - n // 4), dtype=np.float32)
        if role == "post_norm":
            w = 1.0 + NORM_JITTER * rng.standard_normal(t.shape, dtype=np.float32)
            return (w * np.float32(self.block_rms)).astype(np.float32)
        if role == "ssm_a":
            # The decay rates -exp(A_log): per-token decays exp(softplus(alpha + dt) * a)
            # between about 0.4 and 0.95.
            return -(0.1 + 0.9 * rng.random(t.shape, dtype=np.float32)).astype(np.float32)
        std = {
            "bias": BIAS_STD,
            "out_bias": OUT_BIAS_SCALE * self.block_rms * self.moe_share,
            "probs_bias": PROBS_BIAS_STD,
            "sinks": 1.0,
            "shexp_gate": 1.0 / math.sqrt(t.k),
        }.get(role)
        if std is None:
            raise ValueError(f"{t.name}: unknown role {role!r}")
        return (std * rng.standard_normal(t.shape, dtype=np.float32)).astype(np.float32)

    def _matrix_std(self, t: TensorDef) -> float | None:
        """The std of a matrix role's entries; None for the vector roles."""
        arch, role = self.arch, t.role
        ffn_out = 1.0 if arch.sandwich_norm else self.block_rms
        if role == "proj_in":
            std = 1.0 / math.sqrt(t.k)
            if t.short in ("attn_q", "attn_q_b") and not arch.uses_qk_norm(self.cfg):
                std *= ATTN_SHARPNESS
            return std
        if role == "conv":
            # A depthwise conv over conv_kernel taps of unit-size inputs.
            return 1.0 / math.sqrt(t.k)
        if role == "mla_kb":
            # k_nope = c @ attn_k_b[head]: the sum runs over the kv_lora_rank axis.
            return 1.0 / math.sqrt(t.shape[-2])
        if role == "router":
            return ROUTER_SCALE / math.sqrt(t.k)
        if role == "attn_out":
            # Inputs have unit-size entries; the output should have RMS block_rms (unless a
            # post norm sets the size).
            return ffn_out * self.attn_gain / math.sqrt(t.k)
        if role == "ffn_out":
            return ffn_out / (math.sqrt(t.k) * self.act_rms)
        if role == "exp_out":
            return ffn_out * self.moe_share * self.routed_gain / (math.sqrt(t.k) * self.act_rms)
        if role == "shexp_out":
            return ffn_out * self.shexp_share * self.shexp_gain / (math.sqrt(t.k) * self.act_rms)
        return None


def _sigmoid_rms() -> float:
    """RMS of sigmoid(z) for z ~ N(0, 1)."""
    x, w = np.polynomial.hermite_e.hermegauss(64)
    w = w / w.sum()
    return float(np.sqrt((w / (1.0 + np.exp(-x)) ** 2).sum()))


def source_tensors(
    arch: str,
    cfg: ModelConfig,
    seed: int,
    vocab: Vocab,
    names: list[str] | None = None,
    options: GenOptions | None = None,
) -> Iterator[tuple[TensorDef, np.ndarray]]:
    """The float32 source values the writer quantized, regenerated from the seed."""
    spec_arch = get_arch(arch)
    gen = WeightGen(spec_arch, cfg, seed, vocab.normal_tokens(), options)
    for t in spec_arch.tensors(cfg):
        if names is None or t.name in names:
            yield t, gen.tensor(t)


# ---- encoding and writing on a pool of threads ---------------------------------------------


def _encode(values: np.ndarray, qtype: int, out: np.ndarray | None = None) -> np.ndarray:
    """``values`` in type ``qtype`` as bytes (uint8), into ``out`` if given (exactly their
    size), quantized a block of rows at a time."""
    info = qt.type_info(qtype)
    k = values.shape[-1]
    rows = values.reshape(-1, k)
    if out is None:
        out = np.empty(rows.shape[0] * info.row_size(k), dtype=np.uint8)
    if info.name == "F32":
        out[:] = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1).view(np.uint8)
        return out
    imatrix = np.ones(k, dtype=np.float32) if info.requires_imatrix else None
    step = max(1, CHUNK_ELEMENTS // max(k, 1))
    pos = 0
    for r in range(0, rows.shape[0], step):
        raw = qt.quantize(np.ascontiguousarray(rows[r : r + step]), info.id, imatrix)
        out[pos : pos + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        pos += len(raw)
    assert pos == len(out)
    return out


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    """Writes all of ``data`` at ``offset`` of ``fd``."""
    view = memoryview(data.data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _Tasks:
    """A pool of threads with at most ``2 * threads`` tasks submitted and not finished (each
    holds a piece's values), failing fast once a task has failed."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int) -> None:
        self.pool = pool
        self.slots = threading.Semaphore(2 * threads)
        self.failed: list[Future[None]] = []

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Runs ``fn`` on the pool once a slot is free; raises a failed task's exception."""
        self.slots.acquire()
        if self.failed:
            self.slots.release()
            self.failed[0].result()
        task = self.pool.submit(fn)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: Future[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failed.append(task)
        self.slots.release()

    def finish(self) -> None:
        """Waits for every task, raising the first failure."""
        self.pool.shutdown(wait=True)
        if self.failed:
            self.failed[0].result()


def _data_offsets(plan: list[PlannedTensor], start: int, alignment: int) -> list[int]:
    """Each tensor's file offset as GGUFWriter lays them out: from ``start`` (the aligned end
    of the tensor infos), each tensor padded to ``alignment``; plus the file's end."""
    offsets = [start]
    for p in plan:
        offsets.append(offsets[-1] + GGUFWriter.ggml_pad(p.nbytes, alignment))
    return offsets


def _encode_piece(
    fd: int, offset: int, make: Callable[[], np.ndarray], qtype: int, out: np.ndarray | None
) -> None:
    """Makes a piece's values, encodes them (into ``out`` if given) and writes them."""
    _pwrite(fd, _encode(make(), qtype, out), offset)


def _submit_tensor(
    tasks: _Tasks, fd: int, offset: int, p: PlannedTensor, gen: WeightGen, keep: bool
) -> tuple[np.ndarray | None, list[Future[None]]]:
    """Submits the tasks that write ``p`` at ``offset``, one per piece; with ``keep`` the
    bytes also go into a buffer, returned with the tasks that fill it."""
    buf = np.empty(p.nbytes, dtype=np.uint8) if keep else None
    row = qt.type_info(p.qtype).row_size(p.tensor.k)
    pieces, pos = [], 0
    for rows, make in gen.pieces(p.tensor):
        dst = buf[pos : pos + rows * row] if buf is not None else None
        pieces.append(tasks.submit(partial(_encode_piece, fd, offset + pos, make, p.qtype, dst)))
        pos += rows * row
    return buf, pieces


def _write_tensors(
    fd: int, offsets: list[int], plan: list[PlannedTensor], gen: WeightGen, threads: int
) -> None:
    """Writes every tensor's data at its offset, each piece generated, encoded and written
    by one of ``threads`` threads. Tiled experts are kept in memory the first time they are
    written, and the layers that repeat them (in the same type) write those bytes again."""
    tiles: dict[tuple[str, int], tuple[np.ndarray, list[Future[None]]]] = {}
    pool = ThreadPoolExecutor(threads, thread_name_prefix="make-test-model")
    tasks = _Tasks(pool, threads)
    try:
        for p, offset in zip(plan, offsets[:-1], strict=True):
            key = (gen.source_key(p.tensor), p.qtype)
            if key in tiles:
                data, sources = tiles[key]
                for source in sources:
                    source.result()
                tasks.submit(partial(_pwrite, fd, data, offset))
                continue
            keep = gen.tiled(p.tensor)
            buf, pieces = _submit_tensor(tasks, fd, offset, p, gen, keep)
            if buf is not None:
                tiles[key] = (buf, pieces)
        tasks.finish()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _gguf_type(qtype: int) -> GGMLQuantizationType | int:
    # gguf 0.19.0 cannot name every type (Q2_0); the writer only packs the number.
    try:
        return GGMLQuantizationType(qtype)
    except ValueError:
        return qtype


def _file_type(plan: list[PlannedTensor]) -> int:
    counts = Counter(p.qtype for p in plan if p.tensor.quantizable)
    if not counts:
        return 0
    name = type_name(counts.most_common(1)[0][0])
    return _FILE_TYPES.get(name, 0)


def _add_meta(writer: GGUFWriter, item: MetaItem) -> None:
    writer.add_key_value(item.key, item.value, item.vtype, sub_type=item.sub_type)


def default_threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def make_test_model(
    arch: str,
    *,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab: str | os.PathLike[str] | None = None,
    seed: int = 0,
    quant: str | QuantSpec = "q8_0",
    out: str | os.PathLike[str],
    ctx: int = 4096,
    rope_theta: float | None = None,
    rms_eps: float | None = None,
    tied: bool = False,
    sliding_window: int | None = None,
    swa_pattern: int | tuple[bool, ...] | None = None,
    rope_theta_swa: float | None = None,
    experts: int = 0,
    top_k: int = 0,
    expert_ffn: int = 0,
    shared_experts: int | None = None,
    leading_dense: int = 0,
    expert_layout: str = "stacked",
    name: str | None = None,
    log: Callable[[str], None] | None = None,
    routing: str = "uniform",
    zipf_s: float = ZIPF_S,
    tile_experts: int = 0,
    threads: int | None = None,
    **arch_options: Any,
) -> Path:
    """Writes a synthetic ``arch`` model to ``out`` and returns its path.

    The tensors and metadata are those llama.cpp's loader for ``arch`` expects; the
    ``tokenizer.*`` keys are copied from ``vocab`` (a vocab-only GGUF or any model; None: the
    architecture's default, see :func:`freetoken.testmodel.vocab.default_vocab`), whose token
    count sets the embedding and output rows. ``quant`` is a quant spec (grammar in
    :mod:`freetoken.testmodel.spec`). ``kv_heads`` defaults to ``heads``, ``head_dim`` to
    ``hidden // heads``; ``rope_theta`` and ``rms_eps`` to the architecture's values. Gemma 3
    only: ``sliding_window`` (0 or None: none), ``swa_pattern`` (N: every N-th layer global,
    or a bool per layer, True for sliding-window layers; None: llama.cpp's default 6) and
    ``rope_theta_swa`` (gpt-oss: the window defaults to 128 and the pattern to 2).

    MoE architectures (:mod:`~freetoken.testmodel.archs_moe`): ``experts`` routed experts per
    layer (default 8; llama: 0, a dense model, and with experts Mixtral), ``top_k`` of them per
    token (default 2), each ``expert_ffn`` wide (default ``ffn``); ``shared_experts`` (qwen2moe,
    glm4moe, deepseek2; default 1), ``leading_dense`` dense layers first (glm4moe, deepseek2;
    ``ffn`` wide), ``expert_layout`` ``"stacked"`` or ``"per-expert"`` (llama). ``arch_options``
    are the other :class:`~freetoken.testmodel.archs.ModelConfig` fields an architecture takes
    (``expert_gating``, ``expert_weights_norm``, ``expert_weights_scale``, ``expert_groups``,
    ``expert_groups_used``, ``rope_dim``, ``qk_norm``, ``q_lora_rank``, ``kv_lora_rank``,
    ``v_head_dim``); an option the architecture does not have is an InvalidInputError.

    ``routing`` ``"zipf"`` gives every MoE layer its own hot experts: route shares about
    proportional to rank^-``zipf_s`` (default :data:`~freetoken.testmodel.routing.ZIPF_S`),
    through the routers and a shared direction in the embeddings; ``"uniform"`` (the
    default) none. ``tile_experts`` N > 0 draws only N MoE layers' routed experts, the i-th
    MoE layer repeating the (i mod N)-th's (routers, attention and norms stay per layer): a
    big model in a fraction of the time. ``threads`` generate and quantize (default: every
    core this process may use). The module docstring says how each is done.

    ``log`` receives one line per fallback (default: stderr).

    The file is written next to ``out`` and renamed into place when complete.
    """
    spec_arch = get_arch(arch)
    say = log if log is not None else (lambda line: print(line, file=sys.stderr))
    spec = quant if isinstance(quant, QuantSpec) else parse_quant_spec(quant)
    unknown = sorted(set(arch_options) - set(OPTIONAL_FIELDS))
    if unknown:
        raise InvalidInputError(f"unknown model options: {', '.join(unknown)}")
    voc = read_vocab(resolve_vocab(vocab, arch))
    cfg = build_config(
        arch,
        layers=layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=voc.n_tokens,
        ctx=ctx,
        rope_theta=rope_theta,
        rms_eps=rms_eps,
        tied=tied,
        sliding_window=sliding_window,
        swa_pattern=swa_pattern,
        rope_theta_swa=rope_theta_swa,
        experts=experts,
        top_k=top_k,
        expert_ffn=expert_ffn,
        shared_experts=shared_experts,
        leading_dense=leading_dense,
        expert_layout=expert_layout,
        **arch_options,
    )
    if not isinstance(seed, int) or seed < 0:
        raise InvalidInputError(f"seed must be a non-negative integer, got {seed!r}")
    options = GenOptions(routing=routing, zipf_s=zipf_s, tile_experts=tile_experts)
    options.validate(spec_arch, cfg)
    if threads is None:
        threads = default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise InvalidInputError(f"threads must be a positive integer, got {threads!r}")
    plan = plan_tensors(spec_arch, cfg, spec)
    for p in plan:
        if p.fell_back:
            say(
                f"{p.tensor.name}: rows of {p.tensor.k} are not whole {type_name(p.requested)} "
                f"blocks, falling back to {type_name(p.qtype)}"
            )

    out_path = Path(out)
    tmp = out_path.with_name(out_path.name + ".part")
    writer = GGUFWriter(tmp, spec_arch.name)
    writer.add_name(name or f"FreeToken test {arch}")
    for item in spec_arch.metadata(cfg):
        _add_meta(writer, item)
    writer.add_file_type(_file_type(plan))
    writer.add_quantization_version(GGML_QUANT_VERSION)
    # Provenance, so a file says how to make it again (llama.cpp ignores unknown keys).
    writer.add_uint64("freetoken.test_model.seed", seed)
    writer.add_string("freetoken.test_model.quant", spec.text)
    writer.add_string("freetoken.test_model.vocab", voc.path.name)
    for item in options.metadata():
        _add_meta(writer, item)
    for item in voc.items:
        _add_meta(writer, item)
    f32 = qt.type_info("F32").id
    for p in plan:
        t = p.tensor
        if p.qtype == f32:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), p.nbytes)
        else:
            # A non-uint8 dtype makes the writer take the shape as elements, not bytes.
            writer.add_tensor_info(
                t.name,
                t.shape,
                np.dtype(np.float32),
                p.nbytes,
                raw_dtype=_gguf_type(p.qtype),  # type: ignore[arg-type]
            )

    gen = WeightGen(spec_arch, cfg, seed, voc.normal_tokens(), options)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]  # type: ignore[index]
        start = GGUFWriter.ggml_pad(fout.tell(), writer.data_alignment)
        offsets = _data_offsets(plan, start, writer.data_alignment)
        _write_tensors(fout.fileno(), offsets, plan, gen, threads)
        os.ftruncate(fout.fileno(), offsets[-1])
        writer.close()
        os.replace(tmp, out_path)
    except OSError as e:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise FileAccessError(f"cannot write {out_path}: {e}") from None
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out_path
