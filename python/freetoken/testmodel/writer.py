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
  a few units and the tokens pick varied experts with clear margins (a near-tie would make
  routing flip on rounding noise). Each expert is an FFN as above; the down projections are
  scaled by ``1 / sqrt(E[sum_k w_k^2])`` for the architecture's routing weights ``w`` (estimated
  by simulating the routing on such logits), so the routed sum has the block's size whatever
  the routing. With shared experts, the routed part carries 2/3 of the block's power.
  Selection biases (``exp_probs_b``) are N(0, 0.02^2) against sigmoid scores spread over
  (0, 1); gpt-oss's attention sinks are N(0, 1) logits.

Every tensor comes from its own generator, seeded by (seed, tensor name), so a test can
regenerate any tensor's source values with :func:`source_tensors`. A stack of experts draws
each expert from its own generator, seeded by (seed, ``name#expert``), so that the stacked and
the per-expert layouts of one seed hold the same weights.
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter

from freetoken import quant as qt
from freetoken.errors import FileAccessError, InvalidInputError
from freetoken.testmodel.archs import (
    OPTIONAL_FIELDS,
    ArchSpec,
    MetaItem,
    ModelConfig,
    RoutingSpec,
    TensorDef,
    gated_act_rms,
    get_arch,
)
from freetoken.testmodel.spec import QuantSpec, fallback_type, parse_quant_spec, type_name
from freetoken.testmodel.vocab import Vocab, read_vocab, resolve_vocab

__all__ = [
    "PlannedTensor",
    "WeightGen",
    "build_config",
    "make_test_model",
    "plan_tensors",
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
#: Spread of the router logits (softmax or sigmoid scores of unit-RMS inputs).
ROUTER_SCALE = 3.0
#: The routed experts' share of an MoE block's power when it has shared experts.
ROUTED_SHARE = 2.0 / 3.0
#: Selection bias (exp_probs_b) spread.
PROBS_BIAS_STD = 0.02
#: Biases added to a block's output, relative to the block's size.
OUT_BIAS_SCALE = 0.3
#: Rows simulated to estimate the routing weights' power.
_ROUTE_SAMPLES = 4096
#: Output rows of control, byte and unused tokens relative to ordinary ones.
SPECIAL_OUTPUT_SCALE = 0.5
#: Rows quantized per call, so big matrices do not need a second full-size buffer.
CHUNK_ELEMENTS = 1 << 24

# llama.cpp's file types (include/llama.h, llama_ftype) by the type most matrices have, as
# llama.cpp itself guesses them for files without general.file_type.
_FILE_TYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23,
    "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ2_S": 28, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32,
    "TQ1_0": 36, "TQ2_0": 37, "MXFP4": 38, "NVFP4": 39, "Q1_0": 40, "Q2_0": 41,
}  # fmt: skip


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


def _logit_spread(hidden: int, n_out: int, target: float) -> float:
    """The std ``s`` of the other tokens' logits for which the expected top-1 is ``target``.

    The final hidden state is RMS-normed (|h|^2 = hidden); its embedding part makes the
    matching logit about s * sqrt(hidden) / sqrt(1 + BLOCKS_RMS^2), the others are N(0, s^2).
    Solves match - ln(sum of the others' exp) = logit(target) for the smallest such s (or the
    best s where no s reaches it).
    """
    a = math.sqrt(hidden / (1.0 + BLOCKS_RMS**2))
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
    """The float32 source values of each tensor (deterministic in seed and tensor name)."""

    def __init__(self, arch: ArchSpec, cfg: ModelConfig, seed: int, normal: np.ndarray) -> None:
        self.arch, self.cfg, self.seed = arch, cfg, seed
        self.normal = normal
        h = cfg.hidden
        n_out = int(normal.sum()) or cfg.vocab_size
        spread = _logit_spread(h, n_out, TARGET_TOP1)
        self.sigma_embd = spread / math.sqrt(h)
        # The residual stream's size: gemma multiplies the embeddings by sqrt(hidden).
        self.sigma_res = self.sigma_embd * (math.sqrt(h) if arch.embed_scale else 1.0)
        self.block_rms = BLOCKS_RMS / math.sqrt(2 * cfg.layers) * self.sigma_res
        self.act_rms = gated_act_rms(arch.ffn_act)
        self._embd: np.ndarray | None = None
        # MoE: with shared experts, the routed ones carry 2/3 of the FFN block's power.
        routing = arch.routing(cfg)
        shared = bool(cfg.shared_experts)
        self.moe_share = math.sqrt(ROUTED_SHARE) if shared else 1.0
        self.shexp_share = math.sqrt(1.0 - ROUTED_SHARE)
        self.routed_gain = 1.0 / math.sqrt(routed_power(routing, cfg.experts)) if routing else 1.0
        # qwen2moe scales the shared expert by sigmoid(z), z ~ N(0, 1).
        self.shexp_gain = 1.0 / _sigmoid_rms() if getattr(arch, "shared_gate", False) else 1.0

    def rng(self, name: str) -> np.random.Generator:
        """The generator of tensor ``name``."""
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def embeddings(self) -> np.ndarray:
        """``token_embd`` as float32 (kept: the output projection is built from it)."""
        if self._embd is None:
            cfg = self.cfg
            rng = self.rng("token_embd.weight")
            e = rng.standard_normal((cfg.vocab_size, cfg.hidden), dtype=np.float32)
            e *= np.float32(self.sigma_embd)
            self._embd = e
        return self._embd

    def permutation(self) -> np.ndarray:
        """perm: the output row of ordinary token j is the embedding of token perm[j]."""
        perm = np.arange(self.cfg.vocab_size)
        idx = np.flatnonzero(self.normal)
        perm[idx] = idx[self.rng("output.permutation").permutation(len(idx))]
        return perm

    def tensor(self, t: TensorDef) -> np.ndarray:
        """The source values of ``t``, float32, shape ``t.shape``."""
        if len(t.shape) == 3 and t.source is None and t.role != "embd":
            return np.stack(list(self.chunks(t)))
        return next(self.chunks(t))

    def chunks(self, t: TensorDef) -> Iterator[np.ndarray]:
        """The source values of ``t`` in row order: one array per expert of a stack (and of
        MLA's per-head ``attn_k_b`` / ``attn_v_b``), else the whole tensor."""
        role = t.role
        if role == "embd":
            yield self.embeddings()
            return
        if role == "output":
            w = self.embeddings()[self.permutation()]
            w[~self.normal] *= np.float32(SPECIAL_OUTPUT_SCALE)
            yield w
            return
        std = self._matrix_std(t)
        if std is None:
            yield self._vector(t)
        elif t.source is not None:
            stacked, x = t.source
            yield self._normal(f"{stacked}#{x}", t.shape, std)
        elif len(t.shape) == 3:
            for x in range(t.shape[0]):
                yield self._normal(f"{t.name}#{x}", t.shape[1:], std)
        else:
            yield self._normal(t.name, t.shape, std)

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
                w *= np.float32(ATTN_SHARPNESS)
            return w.astype(np.float32)
        if role == "post_norm":
            w = 1.0 + NORM_JITTER * rng.standard_normal(t.shape, dtype=np.float32)
            return (w * np.float32(self.block_rms)).astype(np.float32)
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
        if role == "mla_kb":
            # k_nope = c @ attn_k_b[head]: the sum runs over the kv_lora_rank axis.
            return 1.0 / math.sqrt(t.shape[-2])
        if role == "router":
            return ROUTER_SCALE / math.sqrt(t.k)
        if role == "attn_out":
            # Inputs have unit-size entries; the output should have RMS block_rms (unless a
            # post norm sets the size).
            return ffn_out / math.sqrt(t.k)
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


def routed_power(r: RoutingSpec, n_experts: int) -> float:
    """E[sum_k w_k^2] of the routing weights of ``r`` for router logits N(0, ROUTER_SCALE^2)
    (simulated with a fixed seed, llama.cpp's ``build_moe_ffn`` steps)."""
    rng = np.random.default_rng(0x5EED)
    logits = ROUTER_SCALE * rng.standard_normal((_ROUTE_SAMPLES, n_experts))
    if r.func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        probs = e / e.sum(-1, keepdims=True)
    elif r.func == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        probs = logits
    select = probs.copy()
    if r.selection_bias:
        select += PROBS_BIAS_STD * rng.standard_normal(n_experts)
    if r.groups > 1:
        g = select.reshape(_ROUTE_SAMPLES, r.groups, -1)
        score = np.sort(g, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-score, axis=-1)[:, : r.groups_used]
        mask = np.ones(score.shape, dtype=bool)
        np.put_along_axis(mask, keep, False, axis=-1)
        select = np.where(mask[..., None], -np.inf, g).reshape(_ROUTE_SAMPLES, -1)
    ids = np.argsort(-select, axis=-1)[:, : r.top_k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if r.func == "softmax_weight":
        w = np.exp(w - w.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    if r.normalize:
        w /= np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
    w *= r.scale
    return float((w * w).sum(-1).mean())


def source_tensors(
    arch: str,
    cfg: ModelConfig,
    seed: int,
    vocab: Vocab,
    names: list[str] | None = None,
) -> Iterator[tuple[TensorDef, np.ndarray]]:
    """The float32 source values the writer quantized, regenerated from the seed."""
    spec_arch = get_arch(arch)
    gen = WeightGen(spec_arch, cfg, seed, vocab.normal_tokens())
    for t in spec_arch.tensors(cfg):
        if names is None or t.name in names:
            yield t, gen.tensor(t)


def _encode(values: np.ndarray, qtype: int) -> np.ndarray:
    """``values`` in type ``qtype`` as bytes (uint8), quantized a chunk of rows at a time."""
    return _encode_chunks([values], qtype, values.size)


def _encode_chunks(chunks: Iterable[np.ndarray], qtype: int, n_values: int) -> np.ndarray:
    """The concatenated rows of ``chunks`` (``n_values`` values in all) in type ``qtype`` as
    bytes; a stack of experts arrives one expert at a time, so it is never held in float32
    whole."""
    info = qt.type_info(qtype)
    out: np.ndarray | None = None
    pos = 0
    for values in chunks:
        k = values.shape[-1]
        if out is None:
            out = np.empty(n_values // k * info.row_size(k), dtype=np.uint8)
        if info.name == "F32":
            raw32 = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint8)
            out[pos : pos + len(raw32)] = raw32
            pos += len(raw32)
            continue
        rows = values.reshape(-1, k)
        imatrix = np.ones(k, dtype=np.float32) if info.requires_imatrix else None
        step = max(1, CHUNK_ELEMENTS // max(k, 1))
        for r in range(0, rows.shape[0], step):
            raw = qt.quantize(np.ascontiguousarray(rows[r : r + step]), info.id, imatrix)
            out[pos : pos + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            pos += len(raw)
    assert out is not None and pos == len(out)
    return out


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
                t.name, t.shape, np.dtype(np.float32), p.nbytes, raw_dtype=_gguf_type(p.qtype)
            )  # type: ignore[arg-type]

    gen = WeightGen(spec_arch, cfg, seed, voc.normal_tokens())
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plan:
            data = _encode_chunks(gen.chunks(p.tensor), p.qtype, math.prod(p.tensor.shape))
            writer.write_tensor_data(data)
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
