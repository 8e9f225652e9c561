"""Building blocks of the decoder families, on torch float32 with quantized weights run by
the Rust quantized product."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from freetoken import _core
from freetoken.errors import GGUFError, InvalidInputError
from freetoken.gguf import GGUFFile
from freetoken.quant import QuantMatrix, dequantize
from freetoken.runtime.scales import weight_scale

__all__ = [
    "Embedding",
    "HeadwiseLinear",
    "Linear",
    "RopeScaling",
    "attention",
    "default_attn_scale",
    "finish",
    "linear_group",
    "load_vector",
    "rms_norm",
    "rope_cos_sin",
    "rotate",
]


class Linear:
    """``y = s * (x @ W.T) (+ b)`` with ``W`` quantized in the mapped file and ``s`` its
    ``.scale`` where the file has one (:mod:`freetoken.runtime.scales`)."""

    def __init__(self, gguf: GGUFFile, name: str, shape: tuple[int, int]) -> None:
        gguf.expect(f"{name}.weight", shape)
        self.name = f"{name}.weight"
        self.weight: QuantMatrix = gguf.matrix(f"{name}.weight")
        self.n, self.k = shape
        bias = f"{name}.bias"
        self.bias = load_vector(gguf, bias, shape[0]) if bias in gguf else None
        scale = weight_scale(gguf, name)
        self.scale = None if scale is None else float(scale[0])

    @functools.cached_property
    def spec(self) -> _core.QuantWeight:
        """The weight as ``_core.matmul_group`` takes it."""
        return self.weight.spec

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear_group((self,), x)[0]


def linear_group(layers: Sequence[Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer applied to the same ``x [..., K]`` in one Rust call: one quantization of x
    per activation type and one thread-pool dispatch for all of them (Q/K/V, gate/up)."""
    if x.dtype != torch.float32:
        raise InvalidInputError(f"activations must be float32, got {x.dtype}")
    if x.device.type != "cpu":
        # GPU layers (engine/gpu_layers.py): one product per fused group, else one each.
        products: dict[int, list[torch.Tensor]] = {}
        out = []
        for layer in layers:
            group = getattr(layer, "group", None)
            if group is None:
                out.append(layer(x))
                continue
            if id(group) not in products:
                products[id(group)] = group(x)
            out.append(products[id(group)][group.members.index(layer)])
        return out
    x = x.contiguous()
    lead = x.shape[:-1]
    ys = [torch.empty((*lead, layer.n), dtype=torch.float32) for layer in layers]
    _core.matmul_group([layer.spec for layer in layers], x, ys)
    return [finish(y, ly.scale, ly.bias) for y, ly in zip(ys, layers, strict=True)]


def finish(
    y: torch.Tensor, scale: float | torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """A product's output scaled by its weight's scale, then its bias added (llama.cpp's
    order)."""
    if scale is not None:
        y = y * scale
    return y if bias is None else y + bias


class HeadwiseLinear:
    """One quantized matrix per head, from a ``[H, N, K]`` tensor: ``x [T, H, K] -> [T, H, N]``
    (MLA's ``attn_k_b`` and ``attn_v_b``). Each head's rows are a contiguous slice of the
    mapped tensor, so the heads share the file's bytes."""

    def __init__(self, gguf: GGUFFile, name: str, shape: tuple[int, int, int]) -> None:
        info = gguf.expect(name, shape)
        raw = gguf.raw(name)
        n_heads, n, k = shape
        size = info.nbytes // n_heads
        self.heads = [
            QuantMatrix(raw[h * size : (h + 1) * size], info.qtype, (n, k)) for h in range(n_heads)
        ]
        self.n = n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], len(self.heads), self.n)
        for h, m in enumerate(self.heads):
            y = m.matmul(x[:, h].contiguous())
            assert isinstance(y, torch.Tensor)
            out[:, h] = y
        return out


class Embedding:
    """Token embedding rows, dequantized on lookup (the table stays quantized)."""

    device = torch.device("cpu")

    def __init__(self, gguf: GGUFFile, name: str, vocab: int, hidden: int) -> None:
        info = gguf.expect(name, (vocab, hidden))
        self.name = name
        self.raw = gguf.raw(name)
        self.qtype = info.qtype
        self.row = info.nbytes // vocab
        self.hidden = hidden
        self.vocab = vocab

    def check(self, tokens: Sequence[int]) -> None:
        """An InvalidInputError naming the first id outside the vocabulary."""
        for t in tokens:
            if not 0 <= t < self.vocab:
                raise InvalidInputError(
                    f"token id {t} is outside the vocabulary (0..{self.vocab - 1})"
                )

    def lookup(self, tokens: Sequence[int]) -> torch.Tensor:
        """Checked token ids as an int64 tensor on the embedding's device."""
        self.check(tokens)
        return torch.tensor(list(tokens), dtype=torch.int64, device=self.device)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of checked ids (:meth:`lookup`), float32 ``[T, hidden]``."""
        out = np.empty((tokens.numel(), self.hidden), dtype=np.float32)
        for i, t in enumerate(tokens.tolist()):
            out[i] = dequantize(
                self.raw[t * self.row : (t + 1) * self.row], self.qtype, (self.hidden,)
            )
        return torch.from_numpy(out)


def load_vector(gguf: GGUFFile, name: str, n: int) -> torch.Tensor:
    """A 1-D tensor (norm weight, bias) as float32."""
    gguf.expect(name, (n,))
    return torch.from_numpy(gguf.array(name).copy())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, scaled by ``weight``: on the CPU one Rust call in ggml's
    order (``_core.rms_norm``; torch's op costs tens of microseconds on a decode step's
    vectors), elsewhere torch's fused op."""
    if (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.shape == x.shape[-1:]
    ):
        x = x.contiguous()
        out = torch.empty_like(x)
        _core.rms_norm(x, weight.contiguous(), eps, out)
        return out
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@functools.lru_cache(maxsize=64)
def _inv_freq(base: float, n_rot: int, device: torch.device) -> torch.Tensor:
    # Cached per device: a captured CUDA graph may not copy from the host.
    return (base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)).to(device)


#: llama.cpp's `rope.scaling.type` default when the key is missing.
_DEFAULT_SCALING = "linear"


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """Context-length scaling of RoPE as llama.cpp sets up a context (``llama-context.cpp``)
    and ggml applies it (``rope_yarn``): ``freq_scale`` interpolates positions; with YaRN
    (``ext_factor`` 1) dims below the correction range keep the unscaled angle, a ramp mixes
    the two between ``beta_fast`` and ``beta_slow`` rotations over ``n_ctx_orig``, and cos/sin
    are multiplied by ``attn_factor * (1 + 0.1 ln(1 / freq_scale))``."""

    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    #: ``mscale_all_dim`` (DeepSeek-2 stores it as ``yarn_log_multiplier`` * 0.1); 0 when absent.
    yarn_log_mul: float = 0.0

    @classmethod
    def from_metadata(
        cls,
        meta: Mapping[str, Any],
        arch: str,
        read_log_mul: bool = False,
        read_yarn_keys: bool = False,
    ) -> RopeScaling:
        """The scaling of ``arch``'s ``rope.scaling.*`` keys; ``read_log_mul`` reads
        ``rope.scaling.yarn_log_multiplier`` as llama.cpp's deepseek2 loader does;
        ``read_yarn_keys`` reads it as stored (mscale_all_dim) with ``yarn_beta_fast`` and
        ``yarn_beta_slow``, as its mistral3 loader does."""
        kind = meta.get(f"{arch}.rope.scaling.type", _DEFAULT_SCALING)
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
        freq_scale = 1.0 / factor if factor else 1.0
        if kind == "none":
            freq_scale = 1.0
        elif kind not in ("linear", "yarn"):
            raise GGUFError(f"rope scaling `{kind}` is not supported")
        n_ctx_orig = int(
            meta.get(f"{arch}.rope.scaling.original_context_length", 0)
            or meta.get(f"{arch}.context_length", 0)
        )
        rope_attn_factor = float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0))
        log_mul = 0.0
        if read_log_mul and f"{arch}.rope.scaling.yarn_log_multiplier" in meta:
            # The converter stores 0.1 * mscale_all_dim; llama.cpp undoes the 0.1.
            log_mul = float(meta[f"{arch}.rope.scaling.yarn_log_multiplier"]) / 0.1
        betas = {}
        if read_yarn_keys:
            log_mul = float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
            for name in ("beta_fast", "beta_slow"):
                if f"{arch}.rope.scaling.yarn_{name}" in meta:
                    betas[name] = float(meta[f"{arch}.rope.scaling.yarn_{name}"])
        ext_factor = 1.0 if kind == "yarn" else 0.0
        attn_factor = 1.0
        if ext_factor:
            f = 1.0 / freq_scale
            if log_mul:
                mscale = log_mul if read_log_mul and log_mul != 1.0 else 1.0
                attn_factor = _yarn_mscale(f, mscale) / _yarn_mscale(f, log_mul)
            else:
                attn_factor = _yarn_mscale(f, 1.0)
            # ggml's rope multiplies this factor back in; llama.cpp cancels it here.
            attn_factor /= 1.0 + 0.1 * math.log(f)
        return cls(
            freq_scale=freq_scale,
            ext_factor=ext_factor,
            attn_factor=attn_factor * rope_attn_factor,
            n_ctx_orig=n_ctx_orig,
            yarn_log_mul=log_mul,
            **betas,
        )

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        """The first and last pair index of the YaRN ramp (ggml_rope_yarn_corr_dims)."""

        def dim(n_turns: float) -> float:
            return (
                n_rot * math.log(self.n_ctx_orig / (n_turns * 2 * math.pi)) / (2 * math.log(base))
            )

        low = max(0.0, math.floor(dim(self.beta_fast)))
        high = min(n_rot - 1.0, math.ceil(dim(self.beta_slow)))
        return low, high

    def cos_sin_scale(self, freq_scale: float) -> float:
        """The factor on cos and sin at ``freq_scale`` (ggml's ``mscale``)."""
        if self.ext_factor:
            return self.attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
        return self.attn_factor


def rope_cos_sin(
    pos: torch.Tensor,
    base: float,
    n_rot: int,
    scale: float,
    dtype: torch.dtype,
    freq_factors: torch.Tensor | None = None,
    yarn: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of each position, ``cos``/``sin`` of shape ``[T, 1, n_rot / 2]`` on
    ``pos``'s device; ``scale`` is the frequency scale; ``yarn`` adds YaRN's ramp and
    magnitude scaling (see :class:`RopeScaling`)."""
    inv = _inv_freq(base, n_rot, pos.device)
    if freq_factors is not None:
        inv = inv / freq_factors.to(device=pos.device, dtype=torch.float64)
    theta = pos.to(torch.float64)[:, None] * inv[None, :] * scale
    mscale = 1.0
    if yarn is not None:
        if yarn.ext_factor:
            low, high = yarn.corr_dims(n_rot, base)
            i = torch.arange(n_rot // 2, dtype=torch.float64, device=pos.device)
            ramp = 1 - ((i - low) / max(0.001, high - low)).clamp(0, 1)
            mix = ramp * yarn.ext_factor
            theta = theta * (1 - mix) + (theta / scale) * mix
        mscale = yarn.cos_sin_scale(scale)
    return (theta.cos() * mscale).to(dtype)[:, None, :], (theta.sin() * mscale).to(dtype)[
        :, None, :
    ]


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, neox: bool
) -> torch.Tensor:
    """Rotates the first ``n_rot`` dims of ``x [T, H, D]`` by :func:`rope_cos_sin`'s angles.
    NEOX pairs dim ``i`` with ``i + n_rot/2``; the original (llama) layout pairs adjacent
    dims."""
    half = n_rot // 2
    if neox:
        x1, x2 = x[..., :half], x[..., half:n_rot]
    else:
        x1, x2 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    rotated = torch.cat([r1, r2], -1) if neox else torch.stack([r1, r2], -1).flatten(-2)
    return torch.cat([rotated, x[..., n_rot:]], -1) if n_rot < x.shape[-1] else rotated


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int | torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    masks: dict[tuple[Any, ...], torch.Tensor | None] | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Causal grouped-query attention of queries at positions ``start..`` over keys
    ``key_start..key_start+len(k)-1``; with ``window``, a query at ``p`` sees keys ``j`` with
    ``p - j < window``. ``start`` may instead be a tensor of the queries' positions (a
    captured decode step, whose key range is fixed: keys past a query are masked). ``q [T, H, D]``,
    ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]`` -> ``[T, H * Dv]``. ``sinks [H]`` (gpt-oss) are
    per-head logits that join each softmax's denominator and carry no value. ``masks``
    shares the masks between the layers of one step. Keys and values of another element
    type (a float16 cache) are read as the queries' type."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    t, h, _ = q.shape
    n_keys = k.shape[0]
    first = 0
    if not isinstance(start, torch.Tensor) and window:
        # Keys before the first query's window are masked for every query: left out, so
        # that a cache that no longer holds them (a ring) computes on the same tensors.
        first = max(0, start - key_start - window + 1)
        k, v = k[first:], v[first:]
    at = id(start) if isinstance(start, torch.Tensor) else start
    key = (at, t, first, n_keys, window, key_start)
    if masks is not None and key in masks:
        mask = masks[key]
    else:
        mask = _causal_mask(start, t, first + key_start, n_keys + key_start, window, q.device)
        if masks is not None:
            masks[key] = mask
    if t == 1:
        return _one_query(q[0], k, v, mask, scale, sinks)
    if sinks is not None:
        k, v, mask = _with_sink(k, v, mask, sinks, t)
    hkv = k.shape[1]
    if q.device.type == "cpu" and h != hkv:
        return _grouped_cpu(q, k, v, mask, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=h != hkv,
    )
    return out.transpose(0, 1).reshape(t, -1)


def _grouped_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Grouped-query attention on the CPU as ``[key heads, group]`` batches over stride-0
    views of each key head's keys and values, which torch's fused CPU kernel takes as they
    are: its ``enable_gqa`` path ran as slowly as repeating the key heads (3-4x slower for 64
    or 512 queries over 4160 keys). ``mask``: ``[T, L]``, or ``[H, T, L]`` per head."""
    t, h, _ = q.shape
    n, hkv, _ = k.shape
    g = h // hkv
    qg = q.reshape(t, hkv, g, -1).permute(1, 2, 0, 3)
    kg = k.transpose(0, 1)[:, None].expand(hkv, g, n, k.shape[2])
    vg = v.transpose(0, 1)[:, None].expand(hkv, g, n, v.shape[2])
    if mask is not None and mask.dim() == 3:
        mask = mask.reshape(hkv, g, *mask.shape[1:])
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(t, -1)


def _one_query(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one query ``[H, D]`` (a decode step) as two batched products over the
    KV heads: the query heads of a group share their key head without copying it (the
    fused kernels' GQA expands the cache), in float32 throughout."""
    h, d = q.shape
    n_kv = k.shape[1]
    qg = (q * scale).view(n_kv, h // n_kv, d)
    scores = torch.bmm(qg, k.permute(1, 2, 0))  # [Hkv, G, L]
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).view(n_kv, h // n_kv, 1)], -1)
    p = scores.softmax(-1)
    if sinks is not None:
        p = p[..., :-1]
    out = torch.bmm(p, v.permute(1, 0, 2))  # [Hkv, G, Dv]
    return out.reshape(1, -1)


def _causal_mask(
    start: int | torch.Tensor, t: int, first: int, n_keys: int, window: int, device: torch.device
) -> torch.Tensor | None:
    """Which keys ``first..n_keys-1`` each query sees (None: all of them)."""
    if isinstance(start, torch.Tensor):
        qpos = start[:, None]
    elif t > 1:
        qpos = torch.arange(start, start + t, device=device)[:, None]
    else:
        return None
    kpos = torch.arange(first, n_keys, device=device)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= qpos - kpos < window
    return mask


def _with_sink(
    k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor, t: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One more key that every query sees: a zero key (so its score is only the additive
    mask, the head's sink logit) with a zero value."""
    k = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
    v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
    bias = torch.zeros(sinks.shape[0], t, k.shape[0], dtype=k.dtype, device=k.device)
    if mask is not None:
        bias[..., :-1].masked_fill_(~mask, float("-inf"))
    bias[..., -1] = sinks.to(k.dtype)[:, None]
    return k, v, bias


def default_attn_scale(head_dim: int) -> float:
    """The usual ``1/sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)
