"""Tests of the CPU expert executor (``_core.MoeExecutor`` running a ``_core.MoeLayer``)
against float64 numpy references written here.

Weights are written to small GGUF files with gguf-py's writer; the reference dequantizes the
very bytes that were written with gguf-py's numpy dequantizer (``gguf.quants.dequantize``), an
implementation independent of ours. gguf-py 0.19.0 cannot decode Q1_0 and Q2_0: for those two
the reference uses ``freetoken.quant.dequantize`` (ggml's own ``to_float``), which other tests
check. IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS and IQ2_S blocks are random bits under one fp16 scale
rather than ggml quantizations: ggml's first quantization to those types builds lookup tables
for about 30 s of CPU (IQ1_S / IQ1_M 16 s, IQ2_S 7 s, IQ2_XS 3.5 s, IQ2_XXS 2 s), and the
executor needs valid blocks, not good approximations (every bit pattern of those blocks is a
valid grid index, sign or sub-block scale; only the fp16 super-block scale is set).

The reference computes ``y[t] = sum_j w[t, j] * down_e(act(gate_e x[t] + bg, up_e x[t] + bu))
+ bd`` in float64 from those dequantized weights. Inputs are realistic: each x row has unit
RMS (an RMSNorm output) and weights are N(0, 1/K) (unit-size gate and up values), routing
weights a softmax over the chosen experts.

Tolerance. The executor quantizes its activations as llama.cpp does (ggml's ``from_float`` for
the weight type's vec_dot type) -- x before gate and up, h = act(gate, up) before down -- and
that, not the weights, is the error against the float64 reference:

- q8_0 / q8_1 (legacy types, IQ4_NL, MXFP4, NVFP4, Q1_0, Q2_0): one scale per 32 values, step
  amax/127. Gaussian x (amax/rms ~ 2.1 over 32) costs ~0.8% and the heavier-tailed h ~0.9%.
  The bound, 2e-2 per token, holds with margin (``TOL``).
- q8_K (every K-quant, IQ type but IQ4_NL, and TQ type): one scale per 256 values. Over 256
  values gaussian x has amax/rms ~ 2.9 and h = silu(g) * u ~ 6.5, so the rounding noise
  amax / (127 * sqrt(12)) per element costs ~1% on y through x and ~1.5% through h. That is
  ggml's own algorithm -- llama.cpp's CPU mul_mat_id converts the activations the same way --
  and 2e-2 per token does not hold there: layers with a q8_K activation get
  ``TOL_Q8K`` = 3.5e-2.

Measured by ``benches/moe_accuracy.py`` (the executor against this module's reference, 2000
tokens at top-8, each type paired with Q8_0 on the other side), per-token error as mean / 99th
percentile / max; every type of one activation type behaves alike, since the reference uses the
dequantized weights and only the activations' rounding differs:

- the 10 q8_0 / q8_1 types: as gate and up 1.2 / 1.4 / 1.5-1.7%, as down 1.2 / 1.4 / 1.5-1.6%;
- the 15 q8_K types: as gate and up 1.35 / 1.7 / 1.9-2.1%, as down 1.7 / 2.2 / 2.4-2.8%;
- F16, BF16, F32 (their own products do not round x or h; what is left is the Q8_0 partner's):
  0.8-0.9 / 1.0-1.1 / 1.1-1.3%.

By source (the same float64 computation rounding only x, or only h, to q8_K, 2000 tokens): x's
rounding alone costs 1.0% on average and 1.6-1.7% at most, h's 1.5% and 2.5-2.8%. So every q8_K
down exceeds 2e-2 on some tokens (6% of them), and a q8_K gate/up on a rare few (0.05%; IQ1_S
and IQ4_XS reach 2.05%). K-quant kernels take only q8_K activations, so x and h cannot be
rounded more finely for them.

Residual activations (``MoeExecutor(n, residual_acts=True)``, ``--moe-cpu-precise``) close it:
x and h are quantized twice, the row and then its rounding residual, and every product is the
sum of both passes' dot products (for q8_1 the second pass's block sum also carries the first
one's fp16 rounding). Measured the same way (``benches/moe_accuracy.py --precise``, 500
tokens): at most 1e-4 per token for every type, 3e-4 for Q4_1 / Q5_1, so every case is checked
at ``TOL_PRECISE`` = 2e-3, ten times inside the 2e-2 bound, for every activation type. It
costs a second dot product per row (benches/README.md); the default stays ggml's rounding, so
that results match llama.cpp's. The ``executor`` fixture runs every test in both modes.

Since that bound is loose, every case is also checked against an emulated reference: the same
float64 computation with x and h rounded exactly as ggml's q8_0 / q8_1 / q8_K / f16 / bf16
conversions round them (and q8_1's fp16 block sums). It agrees with the executor to ~1e-7 but
for rare rounding flips of h (the executor's h is float32; flipped steps moved a token by up
to 3.2e-3 over 2000 tokens), within ``TOL_EMULATED`` = 5e-3: a dropped block, a wrong scale or
activation type, a lost bias or route would all show far above that.
"""

from __future__ import annotations

import gc
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import pytest
import torch
from freetoken import _core, quant
from freetoken.errors import (
    FreeTokenError,
    GGUFError,
    InvalidInputError,
    ShapeError,
    UnsupportedError,
)
from freetoken.gguf import GGUFFile
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing, route

TOL = 2e-2
TOL_Q8K = 3.5e-2
TOL_EMULATED = 5e-3
TOL_PRECISE = 2e-3

H, I = 256, 512  # noqa: E741 -- hidden and expert FFN sizes: whole 256-blocks for every type

#: Every storage type with a CPU dot product.
STORAGE_TYPES: list[str] = []
for _id in range(64):
    try:
        _info = quant.type_info(_id)
    except UnsupportedError:
        continue
    if _info.is_storage and _info.has_vec_dot:
        STORAGE_TYPES.append(_info.name)

#: gguf-py 0.19.0 has no dequantizer for these: the reference uses ggml's.
OWN_DEQUANT = {"Q1_0", "Q2_0"}
#: Written as random valid blocks (see the module docstring).
RANDOM_BLOCKS = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S"}
#: Types with a block minimum ``m`` (fp16, bytes 2-3 of each 32-block) whose vec_dot uses q8_1.
BLOCK_MIN_TYPES = {"Q4_1": 20, "Q5_1": 24}


def test_type_list_is_complete() -> None:
    assert len(STORAGE_TYPES) >= 28
    assert {"Q4_0", "Q4_K", "IQ1_S", "TQ1_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0"} <= set(
        STORAGE_TYPES
    )


# -- weights and files -----------------------------------------------------------------------


def type_id(qtype: str) -> int:
    return quant.type_info(qtype).id


def reference_dequant(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """``raw`` (uint8, rows last) as float64, by gguf-py where it can."""
    if qtype in OWN_DEQUANT:
        return quant.dequantize(np.ascontiguousarray(raw), qtype, shape).astype(np.float64)
    rows = np.ascontiguousarray(raw).reshape(-1, raw.shape[-1])
    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(type_id(qtype)))
    return values.reshape(shape).astype(np.float64)


@dataclass
class Mat:
    """One kind of expert matrix (gate, up or down) of every expert, as written."""

    qtype: str
    raw: np.ndarray  # uint8 [E, rows, row bytes]
    deq: np.ndarray  # float64 [E, rows, K]
    mins: np.ndarray | None = None  # float64 [E, rows, K / 32] block minimums (Q4_1, Q5_1)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.deq.shape  # type: ignore[return-value]

    @property
    def expert_bytes(self) -> int:
        return int(self.raw[0].nbytes)


def set_block_scale(blocks: np.ndarray, qtype: str, d: float) -> None:
    """Sets the fp16 super-block scale of every block (``blocks``: uint8 [..., type size])."""
    bits = int(np.array([d], dtype=np.float16).view(np.uint16)[0])
    if qtype == "IQ1_M":
        # block_iq1_m: qs[32], qh[16], scales u16[4]; d is the top nibbles of the scales.
        sc = blocks[..., 48:56].copy().view(np.uint16)
        for i in range(4):
            sc[..., i] = (sc[..., i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[..., 48:56] = sc.view(np.uint8)
    else:
        # block_iq1_s, block_iq2_xxs, block_iq2_xs, block_iq2_s: d comes first.
        blocks[..., 0:2] = np.array([bits], dtype=np.uint16).view(np.uint8)


def random_blocks(rng: np.random.Generator, qtype: str, shape: tuple[int, int, int]) -> Mat:
    """Random grid / sign / scale bits under one fp16 super-block scale, set so that the
    weights have RMS 1/sqrt(K)."""
    info = quant.type_info(qtype)
    e, rows, k = shape
    blocks = rng.integers(0, 256, (e, rows, k // info.block_size, info.type_size), np.uint8)
    set_block_scale(blocks, qtype, 1.0)
    rms = np.sqrt(np.mean(reference_dequant(blocks.reshape(e, rows, -1), qtype, shape) ** 2))
    set_block_scale(blocks, qtype, 1.0 / np.sqrt(k) / rms)
    raw = blocks.reshape(e, rows, -1)
    return Mat(qtype, raw, reference_dequant(raw, qtype, shape))


def make_mat(
    rng: np.random.Generator, qtype: str, shape: tuple[int, int, int], scale: float = 1.0
) -> Mat:
    """N(0, scale^2 / K) weights in ``qtype``, with their float64 dequantization."""
    if qtype in RANDOM_BLOCKS:
        return random_blocks(rng, qtype, shape)
    e, rows, k = shape
    a = (rng.standard_normal((e * rows, k)) * (scale / np.sqrt(k))).astype(np.float32)
    imatrix = None
    if quant.type_info(qtype).requires_imatrix:
        imatrix = (rng.random(k) + 0.5).astype(np.float32)
    raw = np.frombuffer(quant.quantize(a, qtype, imatrix), dtype=np.uint8).reshape(e, rows, -1)
    mins = None
    if qtype in BLOCK_MIN_TYPES:
        blocks = raw.reshape(e, rows, k // 32, BLOCK_MIN_TYPES[qtype])
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return Mat(qtype, raw, reference_dequant(raw, qtype, shape), mins)


@dataclass
class Experts:
    """One layer's experts as the reference sees them."""

    gate: Mat
    up: Mat
    down: Mat
    biases: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> float64 [E, n]
    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def n_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def expert_bytes(self) -> int:
        return self.gate.expert_bytes + self.up.expert_bytes + self.down.expert_bytes

    def uses_q8k(self) -> bool:
        q8k = type_id("Q8_K")
        return any(
            quant.type_info(m.qtype).vec_dot_type == q8k for m in (self.gate, self.up, self.down)
        )


def make_experts(
    rng: np.random.Generator,
    gate: str,
    up: str,
    down: str,
    e: int,
    scale: float = 1.0,
    biases: bool = False,
    act: str = "silu",
) -> Experts:
    ex = Experts(
        make_mat(rng, gate, (e, I, H), scale),
        make_mat(rng, up, (e, I, H), scale),
        make_mat(rng, down, (e, H, I)),
        act=act,
    )
    if biases:
        # Large enough that a lost bias moves the output far beyond the tolerance.
        ex.biases = {
            "gate": rng.standard_normal((e, I)) * 0.5,
            "up": rng.standard_normal((e, I)) * 0.5,
            "down": rng.standard_normal((e, H)) * 0.5,
        }
    return ex


class ModelFile:
    """Tensors for a small GGUF file; ``write`` writes and opens it."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, np.ndarray, tuple[int, ...] | None, int | None]] = []

    def add(self, name: str, raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> None:
        # An int8 view makes the writer take ``shape`` as elements, and the type as given
        # (gguf-py cannot name Q2_0).
        self.tensors.append((name, np.ascontiguousarray(raw).view(np.int8), shape, type_id(qtype)))

    def add_mat(self, name: str, m: Mat) -> None:
        self.add(name, m.raw, m.qtype, m.shape)

    def add_per_expert(self, pattern: str, m: Mat) -> list[str]:
        names = [pattern.format(e) for e in range(m.shape[0])]
        for n, raw in zip(names, m.raw, strict=True):
            self.add(n, raw, m.qtype, m.shape[1:])
        return names

    def add_f32(self, name: str, values: np.ndarray) -> None:
        self.tensors.append((name, np.ascontiguousarray(values, dtype=np.float32), None, None))

    def add_layer(self, i: int, ex: Experts) -> None:
        """``blk.i.ffn_{gate,up,down}_exps.weight`` (and ``.bias``): expert_layer's names."""
        for kind in ("gate", "up", "down"):
            self.add_mat(f"blk.{i}.ffn_{kind}_exps.weight", getattr(ex, kind))
            if kind in ex.biases:
                self.add_f32(f"blk.{i}.ffn_{kind}_exps.bias", ex.biases[kind])

    def write(self, path: Path) -> GGUFFile:
        w = gguf.GGUFWriter(str(path), "test")
        for name, data, shape, qtype in self.tensors:
            w.add_tensor(name, data, raw_shape=shape, raw_dtype=qtype)  # type: ignore[arg-type]
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return GGUFFile(path)


def stacked(i: int) -> dict[str, list[str]]:
    return {k: [f"blk.{i}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")}


def open_layer(
    f: GGUFFile,
    i: int,
    counters: _core.MoeCounters,
    ex: Experts,
    names: dict[str, list[str]] | None = None,
    **options: Any,
) -> _core.MoeLayer:
    bias_names = {f"{k}_bias": f"blk.{i}.ffn_{k}_exps.bias" for k in ex.biases}
    return _core.MoeLayer(
        f.handle,
        i,
        counters,
        act=ex.act,
        alpha=ex.alpha,
        limit=ex.limit,
        **(names or stacked(i)),
        **bias_names,
        **options,
    )


# -- inputs and calls ------------------------------------------------------------------------


def tokens(rng: np.random.Generator, t: int) -> np.ndarray:
    """``[t, H]`` float32 rows of unit RMS, like an RMSNorm output."""
    x = rng.standard_normal((t, H))
    return (x / np.sqrt(np.mean(x**2, axis=1, keepdims=True))).astype(np.float32)


def routes(
    rng: np.random.Generator, t: int, e: int, k: int, always: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """k distinct experts per token (``always`` among them), softmax weights over the k."""
    ids = np.empty((t, k), dtype=np.int32)
    for r in range(t):
        order = rng.permutation(e)
        if always is not None:
            order = np.concatenate([[always], order[order != always]])
        ids[r] = order[:k]
    logits = rng.standard_normal((t, k))
    w = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32)


def run(
    executor: _core.MoeExecutor,
    layer: _core.MoeLayer,
    x: np.ndarray,
    ids: np.ndarray,
    w: np.ndarray,
    skip_negative: bool = False,
) -> np.ndarray:
    out = np.full_like(x, np.nan)
    executor.run(layer, x, ids, w, out, skip_negative=skip_negative)
    return out


def submit(
    executor: _core.MoeExecutor,
    layer: _core.MoeLayer,
    x: np.ndarray,
    ids: np.ndarray,
    w: np.ndarray,
    out: np.ndarray,
    skip_negative: bool = False,
) -> Any:
    return executor.submit(layer, x, ids, w, out, skip_negative=skip_negative)


# -- the reference ---------------------------------------------------------------------------


def activation(ex: Experts, g: np.ndarray, u: np.ndarray) -> np.ndarray:
    if ex.act == "silu":
        return g / (1.0 + np.exp(-g)) * u
    if ex.act == "gelu":  # the tanh form, as ggml_gelu (GeGLU in llama.cpp)
        return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * u
    if ex.act == "swiglu_oai":  # ggml_swiglu_oai
        xg = np.minimum(g, ex.limit)
        yu = np.clip(u, -ex.limit, ex.limit)
        return xg / (1.0 + np.exp(-ex.alpha * xg)) * (yu + 1.0)
    raise AssertionError(ex.act)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def _q8_blocks(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's q8_0 / q8_1 rounding of float32 rows: (quants, fp32 scale) per n-block."""
    b = x.reshape(*x.shape[:-1], -1, n)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.round(b * inv), d


def act_quant(x: np.ndarray, qtype: str) -> np.ndarray:
    """x (float32 rows) as the executor sees it for a weight of ``qtype``: rounded to the
    vec_dot type exactly as ggml's from_float does, as float64."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    vdt = quant.type_info(quant.type_info(qtype).vec_dot_type).name
    if vdt == "F32":
        return x.astype(np.float64)
    if vdt == "F16":
        return x.astype(np.float16).astype(np.float64)
    if vdt == "BF16":
        return _to_bf16(x).astype(np.float64)
    if vdt in ("Q8_0", "Q8_1"):
        q, d = _q8_blocks(x, 32)
        return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)
    if vdt == "Q8_K":  # quantize_row_q8_K_ref: scale -127 / (the signed value of max |x|)
        b = x.reshape(*x.shape[:-1], -1, 256)
        top = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)
        iscale = np.where(top != 0, np.float32(-127) / np.where(top != 0, top, 1), 0)
        iscale = iscale.astype(np.float32)
        q = np.minimum(np.round(iscale * b), 127)
        d = np.where(iscale != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0)
        return (q * d.astype(np.float32).astype(np.float64)).reshape(x.shape)
    raise AssertionError(vdt)


def q8_1_sum_error(x: np.ndarray) -> np.ndarray:
    """Per 32-block: q8_1's stored sum fp16(d * sum(q)) minus the exact sum(q) * fp16(d), the
    term Q4_1 / Q5_1 dot products multiply by the block minimum."""
    q, d = _q8_blocks(np.ascontiguousarray(x, dtype=np.float32), 32)
    s = q.sum(axis=-1)
    stored = (d[..., 0] * s.astype(np.float32)).astype(np.float16).astype(np.float64)
    return stored - s * d[..., 0].astype(np.float16).astype(np.float64)


def matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w.T`` in float64. einsum, not BLAS: small products on a shared 2-core machine
    run 50x slower through OpenBLAS's threads than through einsum's single loop."""
    return np.einsum("tk,nk->tn", a, w)


def product(a: np.ndarray, m: Mat, e: int, emulate: bool) -> np.ndarray:
    if not emulate:
        return matmul(a, m.deq[e])
    y = matmul(act_quant(a, m.qtype), m.deq[e])
    if m.mins is not None:
        y += matmul(q8_1_sum_error(a), m.mins[e])
    return y


def reference(
    x: np.ndarray, ids: np.ndarray, w: np.ndarray, ex: Experts, emulate: bool = False
) -> np.ndarray:
    """float64 ``[T, H]``; ``emulate`` rounds x and h as the executor's activation types do."""
    xd = x.astype(np.float64)
    out = np.zeros(xd.shape)
    zero = {"gate": np.zeros((ex.n_experts, I)), "up": np.zeros((ex.n_experts, I))}
    b = {**zero, "down": np.zeros((ex.n_experts, H)), **ex.biases}
    for e in np.unique(ids):
        t, j = np.nonzero(ids == e)
        a = x[t] if emulate else xd[t]
        g = product(a, ex.gate, e, emulate) + b["gate"][e]
        u = product(a, ex.up, e, emulate) + b["up"][e]
        h = activation(ex, g, u)
        if emulate:
            h = h.astype(np.float32)
        y = product(h, ex.down, e, emulate) + b["down"][e]
        np.add.at(out, t, w[t, j, None].astype(np.float64) * y)
    return out


def rel_err(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1)


def check(
    out: np.ndarray,
    x: np.ndarray,
    ids: np.ndarray,
    w: np.ndarray,
    ex: Experts,
    executor: _core.MoeExecutor,
) -> None:
    """The per-token bounds of the module docstring for ``executor``'s mode: with residual
    activations ``TOL_PRECISE`` against the float64 reference for every type; else the type's
    bound against it and ``TOL_EMULATED`` against the emulated one."""
    assert np.isfinite(out).all()
    ref = reference(x, ids, w, ex)
    err = rel_err(out, ref)
    where = f"{ex.gate.qtype}/{ex.up.qtype}/{ex.down.qtype} {ex.act}"
    if executor.residual_acts:
        assert err.max() <= TOL_PRECISE, f"{where}: per-token error {err.max():.2e} (precise)"
        return
    tol = TOL_Q8K if ex.uses_q8k() else TOL
    assert err.max() <= tol, f"{where}: per-token error {err.max():.4f}"
    emu = rel_err(out, reference(x, ids, w, ex, emulate=True))
    assert emu.max() <= TOL_EMULATED, f"{where}: {emu.max():.2e} from the emulated reference"


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["ggml", "precise"])
def executor(request: pytest.FixtureRequest) -> _core.MoeExecutor:
    """Both modes: activations rounded once as ggml rounds them, and in two passes
    (``--moe-cpu-precise``)."""
    return _core.MoeExecutor(2, residual_acts=request.param == "precise")


class Pair(NamedTuple):
    """A file with two layers of 16 experts: layer 0 takes q8_0 activations (Q4_0 gate/up,
    Q8_0 down), layer 1 q8_K ones (Q4_K gate/up, Q6_K down)."""

    file: GGUFFile
    experts: tuple[Experts, Experts]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    rng = np.random.default_rng(100)
    exs = (
        make_experts(rng, "Q4_0", "Q4_0", "Q8_0", 16),
        make_experts(rng, "Q4_K", "Q4_K", "Q6_K", 16),
    )
    mf = ModelFile()
    for i, ex in enumerate(exs):
        mf.add_layer(i, ex)
    return Pair(mf.write(tmp_path_factory.mktemp("moe") / "pair.gguf"), exs)


@pytest.fixture(scope="module")
def partner() -> dict[str, Mat]:
    """Q8_0 gate, up and down of 4 experts: the fixed partner of every type."""
    rng = np.random.default_rng(200)
    return {
        "gate": make_mat(rng, "Q8_0", (4, I, H)),
        "up": make_mat(rng, "Q8_0", (4, I, H)),
        "down": make_mat(rng, "Q8_0", (4, H, I)),
    }


# -- correctness -----------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 8, 9, 33, 64])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("li", [0, 1], ids=["q8_0", "q8_K"])
def test_tokens_and_top_k(pair: Pair, executor: _core.MoeExecutor, t: int, k: int, li: int) -> None:
    ex = pair.experts[li]
    rng = np.random.default_rng(1000 * t + 10 * k + li)
    x = tokens(rng, t)
    ids, w = routes(rng, t, ex.n_experts, k)
    layer = open_layer(pair.file, li, _core.MoeCounters(2), ex)
    check(run(executor, layer, x, ids, w), x, ids, w, ex, executor)


@pytest.mark.parametrize("k", [1, 4])
def test_one_expert_on_every_token(pair: Pair, executor: _core.MoeExecutor, k: int) -> None:
    """33 tokens all route to expert 5: it is read once, and every token gets it."""
    ex = pair.experts[1]
    rng = np.random.default_rng(7 + k)
    x = tokens(rng, 33)
    ids, w = routes(rng, 33, ex.n_experts, k, always=5)
    counters = _core.MoeCounters(2)
    layer = open_layer(pair.file, 1, counters, ex)
    check(run(executor, layer, x, ids, w), x, ids, w, ex, executor)
    got = snap(counters.snapshot()[1])
    distinct = len(np.unique(ids))
    assert got.last_experts == distinct and (k > 1 or distinct == 1)
    assert got.last_routes == 33 * k
    assert got.last_bytes == distinct * ex.expert_bytes


def test_same_expert_twice_in_a_token(pair: Pair, executor: _core.MoeExecutor) -> None:
    """llama.cpp never routes a token to one expert twice, but the sum stays right if so."""
    ex = pair.experts[0]
    rng = np.random.default_rng(11)
    x = tokens(rng, 3)
    ids = np.array([[2, 2], [1, 2], [3, 3]], dtype=np.int32)
    w = np.array([[0.25, 0.75], [0.5, 0.5], [1.0, -0.5]], dtype=np.float32)
    layer = open_layer(pair.file, 0, _core.MoeCounters(2), ex)
    check(run(executor, layer, x, ids, w), x, ids, w, ex, executor)


def test_threads_do_not_change_the_result(pair: Pair) -> None:
    """Each output value is computed by one task: 1 and 2 threads agree bit for bit."""
    ex = pair.experts[1]
    rng = np.random.default_rng(12)
    x = tokens(rng, 9)
    ids, w = routes(rng, 9, ex.n_experts, 8)
    layer = open_layer(pair.file, 1, _core.MoeCounters(2), ex)
    one = run(_core.MoeExecutor(1), layer, x, ids, w)
    two = run(_core.MoeExecutor(2), layer, x, ids, w)
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("qtype", STORAGE_TYPES)
def test_every_type_with_a_q8_0_partner(
    qtype: str, partner: dict[str, Mat], executor: _core.MoeExecutor, tmp_path: Path
) -> None:
    """Layer 0: ``qtype`` gate and up, Q8_0 down; layer 1: Q8_0 gate and up, ``qtype`` down."""
    rng = np.random.default_rng(zlib.crc32(qtype.encode()))
    e = partner["gate"].shape[0]
    own = {
        "gate": make_mat(rng, qtype, (e, I, H)),
        "up": make_mat(rng, qtype, (e, I, H)),
        "down": make_mat(rng, qtype, (e, H, I)),
    }
    layers = (
        Experts(own["gate"], own["up"], partner["down"]),
        Experts(partner["gate"], partner["up"], own["down"]),
    )
    mf = ModelFile()
    for i, ex in enumerate(layers):
        mf.add_layer(i, ex)
    f = mf.write(tmp_path / "m.gguf")
    x = tokens(rng, 16)
    ids, w = routes(rng, 16, e, 2)
    for i, ex in enumerate(layers):
        layer = open_layer(f, i, _core.MoeCounters(2), ex)
        assert layer.types == tuple(type_id(m.qtype) for m in (ex.gate, ex.up, ex.down))
        check(run(executor, layer, x, ids, w), x, ids, w, ex, executor)


CROSS = [
    # gate, up, down, activation, biases, gate/up weight scale
    ("Q4_K", "Q4_K", "Q6_K", "silu", False, 1.0),
    ("IQ4_XS", "IQ4_XS", "Q5_K", "silu", False, 1.0),
    ("MXFP4", "MXFP4", "MXFP4", "swiglu_oai", True, 3.0),
    ("Q4_0", "Q4_0", "Q4_0", "gelu", False, 1.0),
    ("Q2_K", "Q2_K", "Q3_K", "silu", False, 1.0),
    ("IQ3_S", "IQ3_S", "IQ2_XXS", "silu", False, 1.0),
    ("IQ1_S", "IQ1_S", "IQ1_M", "silu", False, 1.0),
    ("TQ1_0", "TQ1_0", "TQ2_0", "silu", False, 1.0),
    ("Q5_1", "Q5_1", "Q4_1", "silu", True, 1.0),
    ("F16", "F16", "BF16", "gelu", False, 1.0),
    ("NVFP4", "NVFP4", "Q1_0", "silu", False, 1.0),
    ("Q2_0", "Q2_0", "IQ4_NL", "silu", False, 1.0),
    # gate and up of different types, and different activation types (q8_K and q8_0 / q8_1)
    ("Q4_K", "Q5_0", "Q6_K", "silu", False, 1.0),
    ("Q8_0", "IQ4_XS", "Q4_1", "silu", True, 1.0),
    ("F32", "Q5_1", "Q8_0", "gelu", False, 1.0),
]


@pytest.mark.parametrize(
    ("gate", "up", "down", "act", "biases", "scale"),
    CROSS,
    ids=["-".join(map(str, c[:5])) for c in CROSS],
)
def test_cross_pairs(
    gate: str,
    up: str,
    down: str,
    act: str,
    biases: bool,
    scale: float,
    executor: _core.MoeExecutor,
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{gate}{up}{down}{act}".encode()))
    ex = make_experts(rng, gate, up, down, 4, scale, biases, act)
    mf = ModelFile()
    mf.add_layer(0, ex)
    f = mf.write(tmp_path / "m.gguf")
    x = tokens(rng, 16)
    ids, w = routes(rng, 16, 4, 3)
    check(
        run(executor, open_layer(f, 0, _core.MoeCounters(1), ex), x, ids, w),
        x,
        ids,
        w,
        ex,
        executor,
    )


# -- activations, biases, layouts ------------------------------------------------------------


@pytest.mark.parametrize(
    ("act", "alpha", "limit", "scale"),
    [
        ("silu", 1.702, 7.0, 1.0),
        ("gelu", 1.702, 7.0, 1.0),
        ("swiglu_oai", 1.702, 7.0, 3.0),  # gate / up of std 3: the +-7 clamps bite
        ("swiglu_oai", 1.0, 1.5, 1.0),  # other parameters reach the kernel
    ],
)
def test_activations(
    act: str,
    alpha: float,
    limit: float,
    scale: float,
    executor: _core.MoeExecutor,
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(13)
    ex = make_experts(rng, "Q8_0", "Q8_0", "Q8_0", 4, scale, act=act)
    ex.alpha, ex.limit = alpha, limit
    mf = ModelFile()
    mf.add_layer(0, ex)
    f = mf.write(tmp_path / "m.gguf")
    x = tokens(rng, 16)
    ids, w = routes(rng, 16, 4, 2)
    out = run(executor, open_layer(f, 0, _core.MoeCounters(1), ex), x, ids, w)
    check(out, x, ids, w, ex, executor)
    # The test tells the activations apart, and gpt-oss's clamp and parameters: each wrong
    # one would fail some token by far.
    wrong = [(a, 1.702, 7.0) for a in ("silu", "gelu", "swiglu_oai") if a != act]
    if act == "swiglu_oai":
        wrong += [(act, alpha, 1e9), (act, alpha / 3, limit)]
    for a, al, li in wrong:
        other = Experts(ex.gate, ex.up, ex.down, act=a, alpha=al, limit=li)
        assert rel_err(out, reference(x, ids, w, other)).max() > 2 * TOL, (a, al, li)


def test_biases(executor: _core.MoeExecutor, tmp_path: Path) -> None:
    """gpt-oss's per-expert biases on gate, up and down, named as expert_layer names them."""
    rng = np.random.default_rng(14)
    ex = make_experts(rng, "Q8_0", "Q8_0", "Q4_0", 8, biases=True)
    mf = ModelFile()
    mf.add_layer(0, ex)
    f = mf.write(tmp_path / "m.gguf")
    ctx = MoeContext(executor, _core.MoeCounters(1))
    layer = expert_layer(f, ctx, 0, biases=True)
    x = tokens(rng, 9)
    ids, w = routes(rng, 9, 8, 3)
    out = run(executor, layer, x, ids, w)
    check(out, x, ids, w, ex, executor)
    for kind in ("gate", "up", "down"):
        missing = Experts(
            ex.gate, ex.up, ex.down, {k: v for k, v in ex.biases.items() if k != kind}
        )
        assert rel_err(out, reference(x, ids, w, missing)).max() > 2 * TOL, kind


def test_fused_gate_up(executor: _core.MoeExecutor, tmp_path: Path) -> None:
    """One ``ffn_gate_up_exps`` tensor [E, 2I, H]: gate rows first, then up."""
    rng = np.random.default_rng(15)
    ex = make_experts(rng, "Q4_K", "Q4_K", "Q8_0", 8)
    mf = ModelFile()
    fused = np.concatenate([ex.gate.raw, ex.up.raw], axis=1)
    mf.add("blk.0.ffn_gate_up_exps.weight", fused, "Q4_K", (8, 2 * I, H))
    mf.add_mat("blk.0.ffn_down_exps.weight", ex.down)
    f = mf.write(tmp_path / "m.gguf")
    ctx = MoeContext(executor, _core.MoeCounters(1))
    layer = expert_layer(f, ctx, 0, gate_up=["blk.0.ffn_gate_up_exps.weight"])
    assert layer.expert_bytes == ex.expert_bytes
    x = tokens(rng, 12)
    ids, w = routes(rng, 12, 8, 4)
    out = run(executor, layer, x, ids, w)
    check(out, x, ids, w, ex, executor)
    swapped = Experts(ex.up, ex.gate, ex.down)
    assert rel_err(out, reference(x, ids, w, swapped)).max() > 2 * TOL


def test_per_expert_layout(executor: _core.MoeExecutor, tmp_path: Path) -> None:
    """Mixtral's older layout: one [rows, K] tensor per expert (``blk.0.ffn_gate.3.weight``),
    here for gate and down, with a stacked up beside them."""
    rng = np.random.default_rng(16)
    ex = make_experts(rng, "Q4_0", "Q5_K", "IQ4_NL", 8)
    mf = ModelFile()
    names = {
        "gate": mf.add_per_expert("blk.0.ffn_gate.{}.weight", ex.gate),
        "up": ["blk.0.ffn_up_exps.weight"],
        "down": mf.add_per_expert("blk.0.ffn_down.{}.weight", ex.down),
    }
    mf.add_mat("blk.0.ffn_up_exps.weight", ex.up)
    f = mf.write(tmp_path / "m.gguf")
    counters = _core.MoeCounters(1)
    layer = expert_layer(f, MoeContext(executor, counters), 0, **names)
    assert layer.n_experts == 8 and layer.expert_bytes == ex.expert_bytes
    x = tokens(rng, 33)
    ids, w = routes(rng, 33, 8, 2)
    check(run(executor, layer, x, ids, w), x, ids, w, ex, executor)
    assert snap(counters.snapshot()[0]).last_bytes == len(np.unique(ids)) * ex.expert_bytes


# -- async -----------------------------------------------------------------------------------


def test_submit_wait_equals_run(pair: Pair, executor: _core.MoeExecutor) -> None:
    ex = pair.experts[1]
    rng = np.random.default_rng(17)
    layer = open_layer(pair.file, 1, _core.MoeCounters(2), ex)
    calls = []
    for t in (1, 9, 64, 33):
        x = tokens(rng, t)
        ids, w = routes(rng, t, ex.n_experts, 8)
        calls.append((x, ids, w, np.full_like(x, np.nan)))
    tickets = [submit(executor, layer, *c) for c in calls]  # all in flight at once
    # Synchronous calls on the same executor meanwhile (they share its pool).
    expected = [run(executor, layer, x, ids, w) for x, ids, w, _ in calls]
    for ticket, (_, _, _, out), want in reversed(list(zip(tickets, calls, expected, strict=True))):
        assert ticket.wait() is None
        assert ticket.wait() is None  # a second wait is a no-op
        np.testing.assert_array_equal(out, want)


def test_dropped_ticket_finishes_its_call(pair: Pair, executor: _core.MoeExecutor) -> None:
    """Dropping a ticket unwaited waits for its call (the job reads the owners' memory)."""
    ex = pair.experts[0]
    rng = np.random.default_rng(18)
    layer = open_layer(pair.file, 0, _core.MoeCounters(2), ex)
    x = tokens(rng, 33)
    ids, w = routes(rng, 33, ex.n_experts, 8)
    out = np.full_like(x, np.nan)
    ticket = submit(executor, layer, x, ids, w, out)
    del ticket
    gc.collect()
    np.testing.assert_array_equal(out, run(executor, layer, x, ids, w))


def test_submit_reports_errors_at_wait(pair: Pair, executor: _core.MoeExecutor) -> None:
    ex = pair.experts[0]
    rng = np.random.default_rng(19)
    layer = open_layer(pair.file, 0, _core.MoeCounters(2), ex)
    x = tokens(rng, 4)
    ids, w = routes(rng, 4, ex.n_experts, 2)
    ids[2, 1] = ex.n_experts
    out = np.full_like(x, np.nan)
    ticket = submit(executor, layer, x, ids, w, out)
    with pytest.raises(InvalidInputError):
        ticket.wait()
    assert np.isnan(out).all()


# -- counters --------------------------------------------------------------------------------


class Snap(NamedTuple):
    steps: int
    routes: int
    experts: int
    bytes: int
    last_routes: int
    last_experts: int
    last_bytes: int


def snap(c: _core.LayerCounts) -> Snap:
    return Snap(*(getattr(c, f) for f in Snap._fields))


def test_counters(pair: Pair, executor: _core.MoeExecutor) -> None:
    """Routes, distinct experts and weight bytes per layer and step: an expert on n tokens of a
    step is read once."""
    counters = _core.MoeCounters(2)
    layers = [open_layer(pair.file, i, counters, ex) for i, ex in enumerate(pair.experts)]
    per_expert = []
    for layer, ex in zip(layers, pair.experts, strict=True):
        sizes = [
            quant.type_info(m.qtype).row_size(m.shape[2]) * m.shape[1]
            for m in (ex.gate, ex.up, ex.down)
        ]
        assert layer.expert_bytes == sum(sizes) == ex.expert_bytes
        per_expert.append(sum(sizes))
    assert [snap(s) for s in counters.snapshot()] == [Snap(0, 0, 0, 0, 0, 0, 0)] * 2

    rng = np.random.default_rng(20)
    totals = [[0, 0, 0, 0], [0, 0, 0, 0]]
    # (layer, tokens, top-k, one expert for every route)
    for li, t, k, only in [(0, 64, 8, None), (0, 33, 1, 3), (1, 9, 2, None), (0, 1, 8, None)]:
        x = tokens(rng, t)
        ids, w = routes(rng, t, 16, k)
        if only is not None:
            ids[:] = only
        run(executor, layers[li], x, ids, w)
        distinct = len(np.unique(ids))
        last = (t * k, distinct, distinct * per_expert[li])
        for n, v in enumerate((1, *last)):
            totals[li][n] += v
        assert snap(counters.snapshot()[li]) == Snap(*totals[li], *last)
        if only is not None:
            assert last == (33, 1, per_expert[li])  # 33 tokens on one expert: read once
    assert totals[0][0] == 3 and totals[1][0] == 1


# -- skipped routes (the hybrid split) -------------------------------------------------------


@pytest.mark.parametrize("t", [1, 8, 33])
@pytest.mark.parametrize("li", [0, 1], ids=["q8_0", "q8_K"])
def test_skipped_routes(pair: Pair, executor: _core.MoeExecutor, t: int, li: int) -> None:
    """Routes marked -1 (hits, computed on the GPU) with ``skip_negative``: the output is the
    reference over the missed routes only (the hits' weights NaN, so one used shows), zero
    rows for tokens that missed nothing, and it adds up with the reference over the hits to
    the reference over every route; the counters count the missed routes only, and an expert
    only hits chose is not read. Without the flag -1 is an error, and -2 is one with it."""
    ex = pair.experts[li]
    rng = np.random.default_rng(3000 + 10 * t + li)
    x = tokens(rng, t)
    ids, w = routes(rng, t, ex.n_experts, 8)
    hit = rng.random(ids.shape) < 0.5
    if t > 1:
        hit[0] = True  # a token that missed nothing
    only_hits = ids[-1, 0]
    hit[ids == only_hits] = True  # an expert that only hits chose
    hit[-1, 1] = False
    miss = ~hit
    masked = np.where(hit, -1, ids).astype(np.int32)
    counters = _core.MoeCounters(2)
    layer = open_layer(pair.file, li, counters, ex)
    out = run(executor, layer, x, masked, np.where(hit, np.nan, w).astype(np.float32), True)

    assert (out[hit.all(axis=1)] == 0.0).all() and (t == 1 or hit[0].all())
    rows = miss.any(axis=1)
    w_miss, w_hit = np.where(miss, w, 0).astype(np.float32), np.where(hit, w, 0).astype(np.float32)
    check(out[rows], x[rows], ids[rows], w_miss[rows], ex, executor)
    full = out + reference(x, ids, w_hit, ex)
    tol = TOL_Q8K if ex.uses_q8k() else TOL
    assert rel_err(full, reference(x, ids, w, ex)).max() <= tol

    n, used = int(miss.sum()), np.unique(ids[miss])
    last = (n, len(used), len(used) * ex.expert_bytes)
    assert snap(counters.snapshot()[li]) == Snap(1, *last, *last)
    counts = np.bincount(ids[miss], minlength=ex.n_experts)
    assert counters.expert_counts()[li] == counts.tolist() and counts[only_hits] == 0

    # The background path computes the same.
    late = np.full_like(x, np.nan)
    submit(executor, layer, x, masked, w_miss, late, skip_negative=True).wait()
    np.testing.assert_array_equal(late, out)

    # Every route a hit: zeros, not a step.
    none = np.full_like(ids, -1)
    np.testing.assert_array_equal(run(executor, layer, x, none, w, True), np.zeros_like(x))
    assert snap(counters.snapshot()[li]).steps == 2

    # -1 without the flag, -2 with it: errors, the output untouched.
    bad = masked.copy()
    bad[-1, 1] = -2
    for i, flag in ((masked, False), (bad, True)):
        untouched = np.full_like(x, 7.0)
        with pytest.raises(InvalidInputError, match="out of range"):
            executor.run(layer, x, i, w, untouched, skip_negative=flag)
        assert (untouched == 7.0).all()
    assert snap(counters.snapshot()[li]).steps == 2


# -- bad input -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[GGUFFile, Experts]:
    """Four Q8_0 experts plus tensors that do not fit them."""
    rng = np.random.default_rng(21)
    ex = make_experts(rng, "Q8_0", "Q8_0", "Q8_0", 4)
    mf = ModelFile()
    mf.add_layer(0, ex)
    mf.add_mat("down_short", make_mat(rng, "Q8_0", (4, H, 256)))  # K = 256, not I
    mf.add_mat("up_wide", make_mat(rng, "Q8_0", (4, I + 32, H)))
    mf.add_mat("down_5", make_mat(rng, "Q8_0", (5, H, I)))
    mf.add_mat("gate_up_odd", make_mat(rng, "Q8_0", (4, 2 * I + 1, H)))
    mf.add("down_2d", ex.down.raw[0], "Q8_0", (H, I))
    mf.add("down_2d_q4", make_mat(rng, "Q4_0", (1, H, I)).raw[0], "Q4_0", (H, I))
    mf.add_f32("bias_short", np.zeros((4, I - 1)))
    mf.add_f32("bias_3", np.zeros((3, I)))
    mf.add("bias_f16", np.zeros((4, I), dtype=np.float16).view(np.uint8), "F16", (4, I))
    return mf.write(tmp_path_factory.mktemp("bad") / "bad.gguf"), ex


def test_bad_expert_ids(small: tuple[GGUFFile, Experts], executor: _core.MoeExecutor) -> None:
    """Out of range or negative ids: InvalidInputError, the output untouched, no crash."""
    f, ex = small
    counters = _core.MoeCounters(1)
    layer = open_layer(f, 0, counters, ex)
    rng = np.random.default_rng(22)
    x = tokens(rng, 5)
    for bad in (4, 5, 1 << 30, -1, -(1 << 31)):
        ids, w = routes(rng, 5, 4, 2)
        ids[3, 1] = bad
        out = np.full_like(x, 7.0)
        with pytest.raises(InvalidInputError, match="out of range"):
            executor.run(layer, x, ids, w, out)
        assert (out == 7.0).all()
    assert snap(counters.snapshot()[0]).steps == 0  # failed calls are not counted
    ids, w = routes(rng, 5, 4, 2)
    check(run(executor, layer, x, ids, w), x, ids, w, ex, executor)  # still fine afterwards


def layer_error(f: GGUFFile, **names: Any) -> type[BaseException]:
    with pytest.raises(FreeTokenError) as e:
        _core.MoeLayer(f.handle, 0, _core.MoeCounters(1), **names)
    return e.type


def test_bad_layers(small: tuple[GGUFFile, Experts]) -> None:
    f, _ = small
    s = stacked(0)
    # Shapes that do not chain.
    assert layer_error(f, **{**s, "down": ["down_short"]}) is ShapeError
    assert layer_error(f, **{**s, "up": ["up_wide"]}) is ShapeError
    assert layer_error(f, **{**s, "down": ["down_5"]}) is ShapeError  # 5 experts, not 4
    assert layer_error(f, **{**s, "down": ["down_2d"] * 3}) is ShapeError  # 3 experts
    assert layer_error(f, up=s["up"], down=s["down"], gate_up=["gate_up_odd"]) is ShapeError
    # Per-expert tensors that differ, a stacked name that is not 3-D, a missing tensor.
    assert issubclass(layer_error(f, **{**s, "down": ["down_2d", "down_2d_q4"] * 2}), GGUFError)
    assert issubclass(layer_error(f, **{**s, "down": ["down_2d"]}), GGUFError)
    assert issubclass(layer_error(f, **{**s, "down": ["no_such_tensor"]}), FreeTokenError)
    # Biases of the wrong shape or type (the file's tensor does not fit: GGUFError today).
    for bias in ("bias_short", "bias_3", "bias_f16"):
        assert issubclass(layer_error(f, **s, up_bias=bias), FreeTokenError)
    assert issubclass(layer_error(f, **s, down_bias="bias_short"), FreeTokenError)
    # Unknown activation; both or neither of gate and gate_up.
    assert layer_error(f, **s, act="relu") is UnsupportedError
    assert layer_error(f, **s, gate_up=s["gate"]) is InvalidInputError
    assert layer_error(f, up=s["up"], down=s["down"]) is InvalidInputError


def test_bad_calls(small: tuple[GGUFFile, Experts], executor: _core.MoeExecutor) -> None:
    """Sizes that do not fit, missing or misaligned arrays: errors, output untouched."""
    f, ex = small
    layer = open_layer(f, 0, _core.MoeCounters(1), ex)
    rng = np.random.default_rng(23)
    x = tokens(rng, 4)
    ids, w = routes(rng, 4, 4, 2)
    ids3 = np.zeros(9, dtype=np.int32)  # 9 routes for 4 tokens
    w3 = np.zeros(9, dtype=np.float32)
    out = np.full_like(x, 7.0)
    xf, of = x.reshape(-1), out.reshape(-1)

    def unaligned(a: np.ndarray, by: int) -> np.ndarray:
        raw = np.zeros(a.nbytes + by, dtype=np.uint8)
        return np.frombuffer(raw, dtype=a.dtype, count=a.size, offset=by)

    cases: list[tuple[type[FreeTokenError], tuple[Any, ...]]] = [
        (ShapeError, (xf[:-1], ids, w, of[:-1])),  # not whole rows
        (ShapeError, (x, ids3, w3, out)),
        (ShapeError, (x, ids[:0], w[:0], out)),  # no routes
        (InvalidInputError, (None, ids, w, out)),
        (InvalidInputError, (x, ids, w, None)),
        (InvalidInputError, (x, unaligned(ids, 1), w, out)),  # misaligned
        (InvalidInputError, (unaligned(x, 2), ids, w, out)),
    ]
    for err, args in cases:
        with pytest.raises(err):
            executor.run(layer, *args)
        assert (out == 7.0).all(), args
    # No tokens: nothing to do, nothing touched.
    executor.run(layer, x[:0], ids[:0], w[:0], out[:0])
    assert (out == 7.0).all()


def test_errors_are_freetoken_errors() -> None:
    for err in (ShapeError, InvalidInputError, UnsupportedError, GGUFError):
        assert issubclass(err, FreeTokenError)


# -- the MoE layer in torch ------------------------------------------------------------------


def test_moe_ffn(pair: Pair, executor: _core.MoeExecutor) -> None:
    """MoeFFN: router logits -> route -> the executor (+ a shared expert), from torch."""
    ex = pair.experts[1]
    counters = _core.MoeCounters(2)
    ctx = MoeContext(executor, counters)
    layer = expert_layer(pair.file, ctx, 1)
    rng = np.random.default_rng(24)
    router_w = torch.from_numpy(rng.standard_normal((16, H)).astype(np.float32) / 16)
    routing = Routing(top_k=4, func="softmax", normalize=True)

    def shared(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x

    ffn = MoeFFN(layer, lambda x: x @ router_w.T, routing, executor, shared=shared)
    x = torch.from_numpy(tokens(rng, 17))
    out = ffn(x).numpy()
    ids, w = route(x @ router_w.T, routing)
    check(out - 0.5 * x.numpy(), x.numpy(), ids.numpy(), w.numpy(), ex, executor)
    assert snap(counters.snapshot()[1]).last_routes == 17 * 4


# -- the GPU hand-off's host half ----------------------------------------------------------


def test_handoff_serves_missed_routes(pair: Pair, executor: _core.MoeExecutor) -> None:
    """``serve_handoffs`` (hybrid's CPU half), with this thread playing the GPU's kernels on
    the block: each request (layer, tokens) is answered in order with the reference over the
    routes whose expert is not resident, written into ``out``, by the table as it is at the
    request (a step marks the experts it fetches between requests); the layer counters are
    left to the GPU; a bad request is still answered (the GPU must not wait), flagged in the
    error word and raised by the ticket after the stop word."""
    max_t, k, n_experts = 8, 8, 16
    block = np.zeros(8, dtype=np.int64)
    x = np.zeros((max_t, H), dtype=np.float32)
    out = np.zeros((max_t, H), dtype=np.float32)
    ids = np.zeros((2, max_t, k), dtype=np.int32)
    w = np.zeros((2, max_t, k), dtype=np.float32)
    rng = np.random.default_rng(77)
    resident = np.where(rng.random((2, n_experts)) < 0.4, 1, -1).astype(np.int32)
    counters = _core.MoeCounters(2)
    layers = [open_layer(pair.file, i, counters, pair.experts[i]) for i in (0, 1)]
    ticket = executor.serve_handoffs(layers, block, x, out, ids, w, resident, max_t, k)

    def request(seq: int, layer: int, t: int) -> None:
        block[2] = (t << 32) | layer
        block[0] = seq
        deadline = time.monotonic() + 30
        while block[1] < seq:
            assert time.monotonic() < deadline, "no answer"

    for seq, (li, t) in enumerate([(0, 1), (1, 8), (0, 3)], start=1):
        xs = tokens(rng, t)
        r_ids, r_w = routes(rng, t, n_experts, k)
        x[:t], ids[li, :t], w[li, :t] = xs, r_ids, r_w
        if seq == 3:  # fetched for this request: the GPU computes it, the CPU skips it
            resident[li, r_ids[0][resident[li, r_ids[0]] < 0]] = np.iinfo(np.int32).max
        request(seq, li, t)
        miss = resident[li][r_ids] < 0
        rows = miss.any(axis=1)
        assert (out[:t][~rows] == 0).all()
        check(
            out[:t][rows],
            xs[rows],
            r_ids[rows],
            np.where(miss, r_w, 0)[rows],
            pair.experts[li],
            executor,
        )
    request(4, 2, 1)  # no layer 2
    assert block[4] == 4
    block[5] = 1
    with pytest.raises(InvalidInputError, match="layer 2"):
        ticket.wait()
    assert block[6] == 4 and block[1] == 4
    assert not any(any(c) for c in counters.expert_counts())
