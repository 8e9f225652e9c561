"""The decoder shared by the families: each family file says which features it uses
(biases, q/k norms, sandwich norms, embedding scale, activation, RoPE layout and scaling,
sliding window, attention sinks, multi-head latent attention) and this module runs them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from freetoken import _core
from freetoken.errors import GGUFError, InvalidInputError
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import (
    Embedding,
    HeadwiseLinear,
    Linear,
    RopeScaling,
    attention,
    default_attn_scale,
    linear_group,
    load_vector,
    rms_norm,
    rope_cos_sin,
    rotate,
)
from freetoken.runtime import gpu
from freetoken.runtime.cuda_graph import MAX_BATCH, MAX_SPAN, GraphDecoder
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.moe import MoeContext
from freetoken.runtime.step import Span, Step

__all__ = ["DenseFFN", "Features", "MLAShape", "Span", "Step", "Transformer"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class StepHook(Protocol):
    """Work around each forward step (see ``Transformer.step_hook``)."""

    def begin(self, n_tokens: int, graph: bool = False) -> None:
        """Before a step of ``n_tokens`` (``graph``: one a captured graph replays; what the
        hook adds to it must then be the same at every replay)."""
        ...

    def end(self) -> None: ...

    def enter(self, device: torch.device) -> None:
        """Before work on ``device`` that a captured stage of the step replays, after work
        on another device (the layers split over several GPUs)."""
        ...


@dataclass(frozen=True)
class Features:
    """What a family adds to the plain pre-norm decoder."""

    rope_neox: bool = True
    qk_norm: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    activation: str = "silu"
    swa_pattern: int = 0
    #: Per-head attention sink logits (``attn_sinks``, gpt-oss).
    attn_sinks: bool = False
    #: The name of the norm before the feed-forward (gpt-oss, GLM: ``post_attention_norm``).
    ffn_norm: str = "ffn_norm"
    #: Q/K norms where the file has them (GLM-4.5: some sizes do, some do not).
    optional_qk_norm: bool = False
    #: Q/K norms over the whole projections, before the split into heads (OLMoE).
    qk_norm_full: bool = False
    #: Sliding-window layers use the full layers' RoPE base (unless the file gives
    #: ``rope.freq_base_swa``) and frequency scaling (gpt-oss); else base 10000, no scaling.
    swa_rope_as_full: bool = False
    #: Multi-head latent attention (DeepSeek-2/3): compressed q and kv, decoupled RoPE dims.
    mla: bool = False
    #: Read ``rope.scaling.yarn_log_multiplier`` as llama.cpp's deepseek2 does.
    yarn_log_mul: bool = False
    #: Read the YaRN betas and ``yarn_log_multiplier`` (mscale_all_dim as stored) as
    #: llama.cpp's mistral3 does.
    yarn_keys: bool = False
    #: Queries scaled by ``1 + beta * ln(1 + floor(pos / n_ctx_orig))`` where the file gives
    #: ``attention.temperature_scale`` (beta; Mistral 3).
    attn_temperature: bool = False
    #: The RoPE frequency factors of the family, from the metadata and config, in place of
    #: ``rope_freqs.weight`` (Qwen3-VL's multi-section RoPE at text positions).
    rope_factors: Callable[[Mapping[str, Any], ModelConfig], torch.Tensor] | None = None
    #: ``rope_freqs.weight`` applies to the full-attention layers only (Gemma 4's
    #: proportional RoPE); sliding-window layers rotate without factors.
    rope_factors_full_only: bool = False
    #: Values RMS-normed per head without a weight (Gemma 4).
    v_norm: bool = False
    #: A layer without ``attn_v`` attends over its keys' projection as values (Gemma 4).
    k_as_v: bool = False


FFN = Callable[[torch.Tensor], torch.Tensor]
#: Builds layer i's feed-forward; MoE families give their own.
FFNFactory = Callable[[GGUFFile, ModelConfig, int], FFN]


class DenseFFN:
    """``down(act(gate(x)) * up(x))``; ``suffix`` names other tensors of the same shape
    (``_shexp`` for shared experts)."""

    def __init__(
        self, gguf: GGUFFile, prefix: str, hidden: int, ffn: int, act: str, suffix: str = ""
    ) -> None:
        self.gate = Linear(gguf, f"{prefix}ffn_gate{suffix}", (ffn, hidden))
        self.up = Linear(gguf, f"{prefix}ffn_up{suffix}", (ffn, hidden))
        self.down = Linear(gguf, f"{prefix}ffn_down{suffix}", (hidden, ffn))
        self.act = _ACTIVATIONS[act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_group((self.gate, self.up), x)
        return self.down(self.act(gate) * up)


def dense_ffn(feat: Features) -> FFNFactory:
    """The factory of plain gated feed-forwards with the family's activation, each as wide
    as its layer's ``feed_forward_length``."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        return DenseFFN(gguf, f"blk.{i}.", cfg.hidden, cfg.layer(i).ffn, feat.activation)

    return make


def _meta_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(f"metadata `{key}` is {value!r}, expected an integer")
    return value


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention sizes (llama.cpp's deepseek2 hparams). ``latent``: the file
    has split ``attn_k_b``/``attn_v_b`` (its ``*_length_mla`` keys say so), so the cache keeps
    the compressed latent and RoPE key ``[kv_lora + rope]`` per position, one for all heads,
    and attention runs on it with ``k_b`` absorbed into the queries; otherwise (older files
    with ``attn_kv_b``) K and V are expanded per head and cached as such."""

    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    latent: bool

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], cfg: ModelConfig) -> MLAShape:
        """Reads the ``attention.*`` MLA keys of ``cfg.arch``."""
        a = cfg.arch
        latent = f"{a}.attention.key_length_mla" in meta
        k = _meta_int(meta, f"{a}.attention.key_length_mla") if latent else cfg.head_dim
        v = _meta_int(meta, f"{a}.attention.value_length_mla") if latent else cfg.head_dim_v
        if k <= cfg.rope_dim:
            raise GGUFError(f"MLA key length {k} leaves no dims outside RoPE ({cfg.rope_dim})")
        return cls(
            q_lora=_meta_int(meta, f"{a}.attention.q_lora_rank", 0),
            kv_lora=_meta_int(meta, f"{a}.attention.kv_lora_rank"),
            nope=k - cfg.rope_dim,
            rope=cfg.rope_dim,
            v=v,
            latent=latent,
        )


def _attn_temperature(
    meta: Mapping[str, Any], cfg: ModelConfig, rope: RopeScaling
) -> tuple[float, int] | None:
    """``(beta, n_ctx_orig)`` of the attention temperature, None where the file gives no
    ``attention.temperature_scale`` (or 0)."""
    key = f"{cfg.arch}.attention.temperature_scale"
    beta = meta.get(key, 0.0)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise GGUFError(f"metadata `{key}` is {beta!r}, expected a number")
    if not beta:
        return None
    if rope.n_ctx_orig <= 0:
        raise GGUFError(f"`{key}` needs an original context length (rope.scaling.*) above 0")
    return float(beta), rope.n_ctx_orig


class MLAWeights:
    """One layer's MLA projections: q (plain, or ``q_a`` -> norm -> ``q_b``), the compressed
    kv and RoPE key (``kv_a_mqa``, then ``kv_a_norm``), and its expansion (``k_b``/``v_b``
    per head, or ``kv_b``)."""

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, s: MLAShape, p: str) -> None:
        h, nh = cfg.hidden, cfg.n_heads
        self.wq = self.wq_a = self.wq_b = self.q_a_norm = None
        # llama.cpp reads the "lite" sizes without q_lora_rank: go by the tensors too.
        if s.q_lora and p + "attn_q_a.weight" in gguf:
            self.wq_a = Linear(gguf, p + "attn_q_a", (s.q_lora, h))
            self.q_a_norm = load_vector(gguf, p + "attn_q_a_norm.weight", s.q_lora)
            self.wq_b = Linear(gguf, p + "attn_q_b", (nh * (s.nope + s.rope), s.q_lora))
        else:
            self.wq = Linear(gguf, p + "attn_q", (nh * (s.nope + s.rope), h))
        self.wkv_a = Linear(gguf, p + "attn_kv_a_mqa", (s.kv_lora + s.rope, h))
        self.kv_a_norm = load_vector(gguf, p + "attn_kv_a_norm.weight", s.kv_lora)
        self.wk_b = self.wv_b = self.wkv_b = None
        if s.latent:
            self.wk_b = HeadwiseLinear(gguf, p + "attn_k_b.weight", (nh, s.kv_lora, s.nope))
            self.wv_b = HeadwiseLinear(gguf, p + "attn_v_b.weight", (nh, s.v, s.kv_lora))
        else:
            self.wkv_b = Linear(gguf, p + "attn_kv_b", (nh * (s.nope + s.v), s.kv_lora))

    def q(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """The queries, ``[T, heads * (nope + rope)]``."""
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.wq_b is not None and self.q_a_norm is not None
        return self.wq_b(rms_norm(self.wq_a(x), self.q_a_norm, eps))


class Block:
    """One decoder layer's weights and sizes (:meth:`ModelConfig.layer`). A layer that
    shares an earlier layer's cache (``kv_source``, Gemma 4) has no key and value
    projections (``wk`` and ``wv`` None); one whose keys serve as values has no ``wv``."""

    #: RoPE frequency factors of this layer (set by the Transformer).
    rope_factors: torch.Tensor | None = None

    def __init__(
        self,
        gguf: GGUFFile,
        cfg: ModelConfig,
        feat: Features,
        i: int,
        make_ffn: FFNFactory,
        mla: MLAShape | None = None,
    ) -> None:
        p = f"blk.{i}."
        shape = cfg.layer(i)
        h, hd, hdv = cfg.hidden, shape.head_dim, shape.head_dim_v
        nh, nkv = shape.n_heads, shape.n_kv_heads
        self.n_heads, self.n_kv_heads, self.head_dim, self.head_dim_v = nh, nkv, hd, hdv
        self.rope_dim = shape.rope_dim
        self.kv_source = cfg.kv_source(i)
        own_kv = self.kv_source == i
        self.attn_norm = load_vector(gguf, p + "attn_norm.weight", h)
        self.mla = MLAWeights(gguf, cfg, mla, p) if mla is not None else None
        self.wk: Linear | None = None
        self.wv: Linear | None = None
        if mla is None:
            self.wq = Linear(gguf, p + "attn_q", (nh * hd, h))
            if own_kv:
                self.wk = Linear(gguf, p + "attn_k", (nkv * hd, h))
                if not (feat.k_as_v and p + "attn_v.weight" not in gguf):
                    self.wv = Linear(gguf, p + "attn_v", (nkv * hdv, h))
                elif hdv != hd:
                    raise GGUFError(
                        f"{p}attn_v.weight is missing and keys ({hd}) cannot be values ({hdv})"
                    )
            self.wo = Linear(gguf, p + "attn_output", (h, nh * hdv))
        else:
            self.wo = Linear(gguf, p + "attn_output", (h, nh * mla.v))
        self.ffn_norm = load_vector(gguf, f"{p}{feat.ffn_norm}.weight", h)
        self.ffn = make_ffn(gguf, cfg, i)
        self.q_norm = self.k_norm = self.post_attn_norm = self.post_ffn_norm = None
        if feat.qk_norm or (feat.optional_qk_norm and p + "attn_q_norm.weight" in gguf):
            self.q_norm = load_vector(gguf, p + "attn_q_norm.weight", hd)
            if own_kv:
                self.k_norm = load_vector(gguf, p + "attn_k_norm.weight", hd)
        elif feat.qk_norm_full:
            self.q_norm = load_vector(gguf, p + "attn_q_norm.weight", nh * hd)
            self.k_norm = load_vector(gguf, p + "attn_k_norm.weight", nkv * hd)
        self.sinks = None
        if feat.attn_sinks:
            self.sinks = load_vector(gguf, p + "attn_sinks.weight", nh)
        if feat.sandwich_norm:
            self.post_attn_norm = load_vector(gguf, p + "post_attention_norm.weight", h)
            self.post_ffn_norm = load_vector(gguf, p + "post_ffw_norm.weight", h)
        self.swa = cfg.swa_layers[i]
        #: RoPE base and frequency scale of this layer (set by the Transformer).
        self.rope_base = cfg.rope_base
        self.rope_scale = 1.0


def past_trunk(cfg: ModelConfig, i: int) -> ModelConfig:
    """``cfg`` extended to layer ``i`` past the trunk (a multi-token-prediction layer): a
    full-attention layer with its own keys and values."""
    swa = (*cfg.swa_layers, *[False] * (i + 1 - len(cfg.swa_layers)))
    return replace(cfg, n_layers=i + 1, swa_layers=swa[: i + 1])


class Transformer:
    """A decoder-only model over a mapped GGUF file (dense, or MoE through ``make_ffn``)."""

    def __init__(
        self,
        gguf: GGUFFile,
        cfg: ModelConfig,
        feat: Features,
        attn_scale: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        make_ffn: FFNFactory | None = None,
    ) -> None:
        meta = gguf.metadata
        cfg = self._trunk(meta, cfg)
        self.feat = feat
        #: The MoE executor and counters of MoE families (set by ``load_model``).
        self.moe: MoeContext | None = None
        self.rope = RopeScaling.from_metadata(meta, cfg.arch, feat.yarn_log_mul, feat.yarn_keys)
        self.attn_temp = _attn_temperature(meta, cfg, self.rope) if feat.attn_temperature else None
        self.mla = MLAShape.from_metadata(meta, cfg) if feat.mla else None
        self.attn_scale = attn_scale or default_attn_scale(cfg.head_dim)
        if self.mla is not None:
            # llama.cpp's deepseek2: YaRN's mscale (from mscale_all_dim) squared, over the
            # per-head key size.
            mscale = self.rope.attn_factor * (1.0 + 0.1 * math.log(1.0 / self.rope.freq_scale))
            mscale *= 1.0 + 0.1 * self.rope.yarn_log_mul * math.log(1.0 / self.rope.freq_scale)
            self.attn_scale = mscale * mscale / math.sqrt(self.mla.nope + self.mla.rope)
        make_ffn = make_ffn or dense_ffn(feat)
        self.make_ffn = make_ffn
        self.rope_factors = (
            load_vector(gguf, "rope_freqs.weight", cfg.rope_dim // 2)
            if "rope_freqs.weight" in gguf
            else None
        )
        if feat.rope_factors is not None:
            self.rope_factors = feat.rope_factors(meta, cfg)
        self.blocks = []
        swa_base = meta.get(f"{cfg.arch}.rope.freq_base_swa", cfg.rope_base)
        for i in range(cfg.n_layers):
            blk = Block(gguf, cfg, feat, i, make_ffn, self.mla)
            if not blk.swa:
                blk.rope_scale = self.rope.freq_scale
            elif feat.swa_rope_as_full:
                blk.rope_base, blk.rope_scale = float(swa_base), self.rope.freq_scale
            else:
                blk.rope_base = cfg.rope_base_swa
            if not (blk.swa and feat.rope_factors_full_only):
                blk.rope_factors = self.rope_factors
            self.blocks.append(blk)
            if progress:
                progress(i + 1, cfg.n_layers)
        self._load_ends(gguf, cfg)

    def _trunk(self, meta: Mapping[str, Any], cfg: ModelConfig) -> ModelConfig:
        """Sets ``cfg`` (the decoder layers only) and ``n_nextn``: trailing
        multi-token-prediction blocks (GLM-4.5, DeepSeek-3, Qwen3.5) are not decoder layers."""
        nextn = _meta_int(meta, f"{cfg.arch}.nextn_predict_layers", 0)
        if not 0 <= nextn < cfg.n_layers:
            raise GGUFError(
                f"metadata `{cfg.arch}.nextn_predict_layers` is {nextn}: it must leave at least "
                f"one of the {cfg.n_layers} layers to the decoder"
            )
        #: The multi-token-prediction layers after the trunk (``models/mtp.py`` runs them).
        self.n_nextn = nextn
        n = cfg.n_layers - nextn
        self.cfg = replace(cfg, n_layers=n, swa_layers=cfg.swa_layers[:n])
        return self.cfg

    def _load_ends(self, gguf: GGUFFile, cfg: ModelConfig) -> None:
        """The token embedding, the final norm and the output projection (the embedding's
        matrix where the file has no ``output.weight``), after the blocks as a file orders
        them: a missing tensor is reported in that order."""
        self.embed = Embedding(gguf, "token_embd.weight", cfg.vocab_size, cfg.hidden)
        self.output_norm = load_vector(gguf, "output_norm.weight", cfg.hidden)
        out_name = "output" if "output.weight" in gguf else "token_embd"
        self.output = Linear(gguf, out_name, (cfg.vocab_size, cfg.hidden))

    #: Where the model's tensors live (set by GPU placement): with the layers split over
    #: several GPUs, the first layers' device (the embedding, token ids and positions).
    device = torch.device("cpu")
    #: Each layer's device where placement split the layers over several GPUs (None: all on
    #: :attr:`device`); the output norm and projection are then on :attr:`output_device`.
    layer_devices: tuple[torch.device, ...] | None = None
    output_device = torch.device("cpu")
    #: Decode steps as CUDA graphs (set by GPU placement when every layer can be captured).
    graphs: GraphDecoder | None = None
    #: Sliding-window layers keep every position in CPU caches too (``--swa-full``).
    swa_full: bool = False
    #: The KV caches' key and value element types (``--cache-type-k/v``).
    kv_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
    #: Called around every step with its token count (``begin(n)``, then ``end()`` even when
    #: the step raised): the hybrid experts' CPU thread lives for the step (set by placement).
    step_hook: StepHook | None = None
    #: Whether a step over several GPUs can be captured stage by stage: :meth:`run_part` is
    #: the family's whole pass (a family with a pass of its own sets False).
    staged_graphs = True

    def mtp_block(self, gguf: GGUFFile, i: int) -> Block:
        """Layer ``i`` past the trunk (a multi-token-prediction layer) as a full-attention
        block of this family with its feed-forward, run as layer 0 of its own cache
        (``models/mtp.py``)."""
        blk = Block(gguf, past_trunk(self.cfg, i), self.feat, i, self.make_ffn, self.mla)
        blk.rope_scale = self.rope.freq_scale
        blk.kv_source = 0  # layer 0 of the head's own cache
        return blk

    def mtp_kv_shape(self) -> tuple[int, int, int]:
        """(heads, key dims, value dims) per position of a multi-token-prediction layer's
        cache: a full-attention layer's."""
        return self._kv_shapes()[0]

    def _kv_shapes(self) -> list[tuple[int, int, int]]:
        """Per layer, per position: (heads, key dims, value dims) of the cache; 0 heads for
        a layer that reads another's."""
        c, m = self.cfg, self.mla
        if m is not None and m.latent:
            # The latent and RoPE key are the keys; the values are the latent part of them.
            return [(1, m.kv_lora + m.rope, 0)] * c.n_layers
        if m is not None:
            return [(c.n_heads, m.nope + m.rope, m.v)] * c.n_layers
        return [
            (b.n_kv_heads if b.kv_source == i else 0, b.head_dim, b.head_dim_v)
            for i, b in enumerate(self.blocks)
        ]

    def kv_bytes(self, n_ctx: int) -> int:
        """Bytes of one sequence's KV cache of ``n_ctx`` positions (float32)."""
        return 4 * n_ctx * sum(heads * (dk + dv) for heads, dk, dv in self._kv_shapes())

    def new_cache(self, n_ctx: int, max_step: int = 0) -> KVCache:
        """An empty KV cache for one sequence of up to ``n_ctx`` tokens, on the model's
        device. With ``max_step`` (the most tokens a step gives the sequence), a cache on the
        CPU keeps sliding-window layers in rings of what they can still see (unless
        ``swa_full``)."""
        dev = self.device
        windows = [self.cfg.sliding_window if blk.swa else 0 for blk in self.blocks]
        heads, dk, dv = zip(*self._kv_shapes(), strict=True)
        return KVCache(
            self.cfg.n_layers,
            n_ctx,
            heads,
            dk,
            dv,
            device=dev,
            v_transposed=dev.type == "cuda",
            windows=windows if dev.type == "cpu" and not self.swa_full else (),
            max_step=max_step,
            dtypes=self.kv_dtypes,
            devices=self.layer_devices or (),
        )

    def forward(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Runs ``tokens`` after the cache's positions; returns float32 logits for the last
        token ``[vocab]``, or for every token ``[T, vocab]`` with ``all_logits``."""
        return self.forward_batch([(tokens, cache)], all_logits)[0]

    @torch.inference_mode()
    def forward_batch(
        self,
        seqs: list[tuple[list[int], KVCache]],
        all_logits: bool | Sequence[bool] = False,
        hidden: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Runs several sequences in one pass (continuous batching): the weight products see
        all their rows together, attention runs per sequence on its own cache. Returns each
        sequence's logits as :meth:`forward` does (``all_logits`` may be given per
        sequence: a verify step beside prompt chunks); a ``hidden`` list gets each sequence's
        final hidden states ``[n, hidden]`` (after the output norm, on the model's device)."""
        spans = []
        for tokens, cache in seqs:
            if not tokens:
                raise InvalidInputError("a sequence in the batch has no tokens")
            spans.append(Span(cache.reserve(len(tokens)), len(tokens), cache))
        flat = [t for tokens, _ in seqs for t in tokens]
        self.embed.check(flat)
        every = [all_logits] * len(spans) if isinstance(all_logits, bool) else list(all_logits)
        graph = self._graphable(spans, every)
        hook = self.step_hook
        if hook is not None:
            hook.begin(len(flat), graph)
        try:
            if graph:
                assert self.graphs is not None
                rows = [tokens for tokens, _ in seqs]
                out = self._replay(self.graphs, rows, spans, every, hidden)
                if out is not None:
                    return out
            # Ids on the device only for an eager step (a replay copies its own).
            return self._logits(self.embed.lookup(flat), spans, every, hidden)
        finally:
            if hook is not None:
                hook.end()

    def _graphable(self, spans: list[Span], every: list[bool]) -> bool:
        """Whether a captured step can run these spans: decode tokens (one per sequence) and
        verify steps (a few tokens of a cache with ``keep_steps``, every logit asked for),
        distinct caches. Prompt chunks run eagerly."""
        if self.graphs is None or len(spans) > MAX_BATCH:
            return False  # no graphs (the CPU path), or more sequences than a graph takes
        return len({id(sp.cache) for sp in spans}) == len(spans) and all(
            sp.n == 1 or (e and sp.cache.keep_steps and sp.n <= MAX_SPAN)
            for sp, e in zip(spans, every, strict=True)
        )

    @staticmethod
    def _replay(
        graphs: GraphDecoder,
        tokens: list[list[int]],
        spans: list[Span],
        every: list[bool],
        hidden: list[torch.Tensor] | None,
    ) -> list[torch.Tensor] | None:
        """Each sequence's logits as :meth:`_logits` gives them, from a captured step (None:
        the set is new, run it eagerly)."""
        lengths = [sp.n for sp in spans]
        caches = [sp.cache for sp in spans]
        out = graphs.step(list(zip(tokens, caches, strict=True)), hidden is not None)
        if out is None:
            return None
        if hidden is not None:
            assert out[1] is not None
            hidden.extend(out[1].split(lengths))
        rows = gpu.to_host(out[0]).split(lengths)
        return [r if e else r[-1] for r, e in zip(rows, every, strict=True)]

    def _logits(
        self,
        ids: torch.Tensor,
        spans: list[Span],
        every: list[bool],
        hidden: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The host copy of each sequence's logits (every row where ``every`` says so, else
        the last), run eagerly."""
        dev = self.device
        pos = torch.cat([torch.arange(int(sp.start), int(sp.start) + sp.n) for sp in spans]).to(dev)
        picked = None
        if not all(every):
            at, parts = 0, []
            for sp, e in zip(spans, every, strict=True):
                parts.append(torch.arange(at, at + sp.n) if e else torch.tensor([at + sp.n - 1]))
                at += sp.n
            picked = torch.cat(parts).to(dev)
        step = Step(pos, spans, keep_hidden=hidden is not None)
        logits = gpu.to_host(self.run(ids, step, picked))
        if hidden is not None:
            assert step.hidden is not None
            hidden.extend(step.hidden.split([sp.n for sp in spans]))
        for sp in spans:
            sp.cache.commit(sp.n)
        split = logits.split([sp.n if e else 1 for sp, e in zip(spans, every, strict=True)])
        return [r if e else r[0] for r, e in zip(split, every, strict=True)]

    def run(self, tokens: torch.Tensor, step: Step, rows: torch.Tensor | None) -> torch.Tensor:
        """The forward pass on tensors: token ids ``[T]`` (on the model's device) at
        ``step``'s positions; logits of the ``rows`` given, or of every token. Nothing here
        reads a tensor back to the host on the GPU path, so a decode step can be captured as
        a CUDA graph."""
        return self.run_part(tokens, step, range(len(self.blocks)), rows, head=True)

    def run_part(
        self,
        x: torch.Tensor,
        step: Step,
        layers: range,
        rows: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        """Part of :meth:`run` (a stage of a step over several GPUs, captured on its GPU):
        from token ids where ``layers`` starts at layer 0 (the embedding first), else from
        the activation entering ``layers``; through ``layers``; then, with ``head``, the
        output layer's logits of ``rows`` (as :meth:`run`), else the activation after."""
        if layers.start == 0:
            x = self.embed(x)
            if self.feat.embed_scale:
                x = x * math.sqrt(self.cfg.hidden)
        for i in layers:
            x, at = self._to_layer(i, x, step)
            x = self._layer(i, self.blocks[i], x, at)
        if not head:
            return x
        x, at = self._to_layer(None, x, step)
        logits = self._head(x, None if rows is None else rows.to(x.device), at)
        step.take_hidden(at)
        return logits

    def enter(self, device: torch.device) -> None:
        """Before a stage of a captured step runs on ``device`` outside :meth:`run` (its
        graph's capture or replay): the step hook's per-device state follows there."""
        if self.step_hook is not None:
            self.step_hook.enter(device)

    def _to_layer(self, i: int | None, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, Step]:
        """The activation ``x`` and ``step`` as layer ``i`` (None: the output layer) reads
        them: unchanged but where the layers are split over several GPUs and ``i`` is on
        another device than ``x``; then ``x`` is copied there (on both devices' current
        streams, which torch orders) and the step is that device's (:meth:`Step.on`)."""
        devs = self.layer_devices
        if devs is None:
            return x, step
        dev = self.output_device if i is None else devs[i]
        return (x if x.device == dev else x.to(dev, non_blocking=True)), step.on(dev)

    def _head(
        self, x: torch.Tensor, rows: torch.Tensor | None, step: Step | None = None
    ) -> torch.Tensor:
        """The logits of the last layer's output ``x`` at ``rows`` (None: every row); a
        ``step`` with ``keep_hidden`` gets every row's hidden state after the output norm."""
        cfg = self.cfg
        keep = step is not None and step.keep_hidden
        if rows is not None and not keep:
            x = x[rows]
        h = rms_norm(x, self.output_norm, cfg.norm_eps)
        if step is not None and keep:
            step.hidden = h
            h = h if rows is None else h[rows]
        logits = self.output(h)
        if cfg.final_logit_softcap:
            cap = cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _layer(self, i: int, blk: Block, x: torch.Tensor, step: Step) -> torch.Tensor:
        cfg = self.cfg
        h = rms_norm(x, blk.attn_norm, cfg.norm_eps)
        if blk.mla is not None:
            a = blk.wo(self._mla_attention(i, blk.mla, blk, h, step))
        else:
            a = blk.wo(self._attention(i, blk, h, step))
        if blk.post_attn_norm is not None:
            a = rms_norm(a, blk.post_attn_norm, cfg.norm_eps)
        x = x + a
        h = rms_norm(x, blk.ffn_norm, cfg.norm_eps)
        f = blk.ffn(h)
        if blk.post_ffn_norm is not None:
            f = rms_norm(f, blk.post_ffn_norm, cfg.norm_eps)
        return x + f

    def _rope(self, x: torch.Tensor, step: Step, blk: Block, n_rot: int) -> torch.Tensor:
        whole = self._whole_neox(x, n_rot)
        cos, sin = self._rope_tables(x, step, blk, n_rot, whole)
        if whole:
            return x * cos + x.roll(n_rot // 2, -1) * sin
        return rotate(x, cos, sin, n_rot, self.feat.rope_neox)

    def _whole_neox(self, x: torch.Tensor, n_rot: int) -> bool:
        """Whether NEOX RoPE rotates ``x``'s whole heads."""
        return self.feat.rope_neox and n_rot == x.shape[-1]

    def _rope_tables(
        self, x: torch.Tensor, step: Step, blk: Block, n_rot: int, whole: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One table per (base, scale) and step, shared by the layers. When NEOX rotates whole
        # heads, the table holds cos/sin for both halves: x * cos + roll(x) * sin is then the
        # whole rotation (fewer kernels on the GPU, the same float operations).
        key = (blk.rope_base, n_rot, blk.rope_scale, x.dtype, whole, blk.rope_factors is None)
        if key not in step.rope:
            cos, sin = rope_cos_sin(
                step.pos,
                blk.rope_base,
                n_rot,
                blk.rope_scale,
                x.dtype,
                blk.rope_factors,
                self.rope,
            )
            if whole:
                cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
            step.rope[key] = (cos, sin)
        return step.rope[key]

    def _temperature(self, step: Step, dtype: torch.dtype) -> torch.Tensor:
        """The rows' query scales ``[T, 1, 1]`` (see ``Features.attn_temperature``)."""
        assert self.attn_temp is not None
        beta, floor = self.attn_temp
        scale = torch.log(torch.floor(step.pos.to(torch.float64) / floor) + 1.0) * beta + 1.0
        return scale.to(dtype)[:, None, None]

    def _attention(
        self,
        i: int,
        blk: Block,
        h: torch.Tensor,
        step: Step,
    ) -> torch.Tensor:
        """Grouped-query attention of layer ``i``, before the output projection."""
        cfg, feat, eps = self.cfg, self.feat, self.cfg.norm_eps
        t = h.shape[0]
        k = v = None
        if blk.wk is not None:
            projs = (blk.wq, blk.wk) if blk.wv is None else (blk.wq, blk.wk, blk.wv)
            q, k, *vs = linear_group(projs, h)
            v = vs[0] if vs else k
        else:
            q = blk.wq(h)
        solo = self._cpu_one_token_spans(blk, h, step) if k is not None else []
        if len(solo) == len(step.spans):
            assert k is not None and v is not None
            return self._attend_one(
                i, blk, q, k, v, step, solo, q.new_empty(t, blk.n_heads * blk.head_dim_v)
            )
        raw = q, k, v
        # OLMoE norms the whole projections before the split into heads; the rest norm heads.
        qn, kn = blk.q_norm, blk.k_norm
        if feat.qk_norm_full:
            if qn is not None and kn is not None and k is not None:
                q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
            qn = kn = None
        q = q.view(t, blk.n_heads, blk.head_dim)
        if k is not None and v is not None:
            k = k.view(t, blk.n_kv_heads, blk.head_dim)
            v = v.view(t, blk.n_kv_heads, blk.head_dim_v)
            if feat.v_norm:
                v = F.rms_norm(v, (blk.head_dim_v,), None, eps)
        if q.is_cuda and q.dtype == torch.float32 and self._whole_neox(q, blk.rope_dim):
            # One kernel each for q and k: the head norm and the rotation (runtime/gpu.py).
            cos, sin = self._rope_tables(q, step, blk, blk.rope_dim, whole=True)
            q = gpu.norm_rope(q, qn, cos, sin, eps)
            if k is not None:
                k = gpu.norm_rope(k, kn, cos, sin, eps)
        else:
            if qn is not None:
                q = rms_norm(q, qn, eps)
            q = self._rope(q, step, blk, blk.rope_dim)
            if k is not None:
                k = self._rope(k if kn is None else rms_norm(k, kn, eps), step, blk, blk.rope_dim)
        if self.attn_temp is not None:
            q = q * self._temperature(step, q.dtype)
        window = cfg.sliding_window if blk.swa else 0
        out = self._attend(i, q, k, v, step, window, blk.sinks, blk.kv_source, set(solo))
        if solo:
            assert raw[1] is not None and raw[2] is not None
            self._attend_one(i, blk, raw[0], raw[1], raw[2], step, solo, out)
        return out

    def _cpu_one_token_spans(self, blk: Block, h: torch.Tensor, step: Step) -> list[int]:
        """The spans of ``step`` that :meth:`_attend_one` runs: those of one token, when the
        layer input ``h`` is on the CPU and the layer's features allow."""
        f = self.feat
        if not (
            h.device.type == "cpu"
            and blk.wv is not None
            and not (f.qk_norm_full or f.v_norm or self.cfg.shared_kv_layers)
            and self.attn_temp is None
        ):
            return []
        return [
            s
            for s, sp in enumerate(step.spans)
            if sp.n == 1 and isinstance(sp.start, int) and not sp.cache.v_transposed
        ]

    def _attend_one(
        self,
        i: int,
        blk: Block,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        step: Step,
        spans: list[int],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`_attention` from the projections ``q, k, v`` on for the one-token ``spans``
        of ``step`` on the CPU, into their rows of ``out``: the head norms, RoPE, the cache
        store and the attention in one Rust call per sequence. A sequence takes this call
        whether it steps alone or beside others, so that batched and solo runs agree to the
        last bit."""
        cos, sin = self._rope_tables(q, step, blk, blk.rope_dim, whole=False)
        window = self.cfg.sliding_window if blk.swa else 0
        rows = [0]
        for sp in step.spans:
            rows.append(rows[-1] + sp.n)
        for s in spans:
            sp, r = step.spans[s], rows[s]
            assert isinstance(sp.start, int)
            write, lo, hi = sp.cache.one_token_rows(i, sp.start, window)
            _core.attend_one(
                q[r],
                k[r],
                v[r],
                sp.cache.k[i],
                sp.cache.v[i],
                write,
                lo,
                hi,
                blk.n_heads,
                blk.n_kv_heads,
                blk.q_norm,
                blk.k_norm,
                self.cfg.norm_eps,
                cos[r],
                sin[r],
                self.feat.rope_neox,
                self.attn_scale,
                blk.sinks,
                out[r],
            )
        return out

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        step: Step,
        window: int = 0,
        sinks: torch.Tensor | None = None,
        source: int | None = None,
        skip: set[int] | None = None,
    ) -> torch.Tensor:
        """Each sequence's rows of ``q [T, heads, dims]`` and, when the layer has its own,
        ``k, v`` (after RoPE): their keys and values stored in cache layer ``layer`` (or,
        without ``k, v``, those of layer ``source`` whose cache this one shares, from this
        step), their queries attending over them; ``[T, heads * dims_v]``. The rows of the
        spans in ``skip`` are left for the caller to store and fill."""
        src = layer if source is None else source
        outs, row = [], 0
        for s, sp in enumerate(step.spans):
            n = sp.n
            if skip and s in skip:
                assert v is not None
                outs.append(q.new_empty(n, q.shape[1] * v.shape[-1]))
                row += n
                continue
            if k is not None and v is not None:
                k_all, v_all = sp.store(layer, k[row : row + n], v[row : row + n])
                if self.cfg.shared_kv_layers:
                    step.kv[(s, layer)] = (k_all, v_all)
            else:
                # The source layer may be on another GPU of a split: its keys come over.
                k_all, v_all = (t.to(q.device) for t in step.kv[(s, src)])
            if n == 1 and gpu.attn_decode_fits(q[row], k_all, v_all, sinks):
                # A decode step: one kernel instead of a scale, a mask and two products.
                out = gpu.attn_decode(
                    q[row], k_all, v_all, sp.start, self.attn_scale, window, sinks
                )
            else:
                out = attention(
                    q[row : row + n],
                    k_all,
                    v_all,
                    sp.start,
                    self.attn_scale,
                    window,
                    sinks,
                    step.masks,
                    sp.first_key(src),
                )
            outs.append(out)
            row += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _mla_attention(
        self,
        i: int,
        w: MLAWeights,
        blk: Block,
        h: torch.Tensor,
        step: Step,
    ) -> torch.Tensor:
        """Multi-head latent attention of layer ``i`` (see :class:`MLAShape`), before the
        output projection: ``[T, heads * v]``."""
        cfg, s = self.cfg, self.mla
        assert s is not None
        t, nh, eps = h.shape[0], cfg.n_heads, cfg.norm_eps
        q_nope, q_pe = w.q(h, eps).view(t, nh, s.nope + s.rope).split([s.nope, s.rope], -1)
        q_pe = self._rope(q_pe, step, blk, s.rope)
        c, k_pe = w.wkv_a(h).split([s.kv_lora, s.rope], -1)
        c = rms_norm(c, w.kv_a_norm, eps)
        k_pe = self._rope(k_pe.reshape(t, 1, s.rope), step, blk, s.rope)
        if w.wk_b is not None and w.wv_b is not None:
            # Absorb k_b into the queries: q_nope . (k_b c) = (k_b^T q_nope) . c, so every
            # head attends over the one cached latent; v_b expands the result per head.
            q = torch.cat([w.wk_b(q_nope), q_pe], -1)
            k = torch.cat([c.view(t, 1, s.kv_lora), k_pe], -1)
            v = k.new_empty(t, 1, 0)
        else:
            assert w.wkv_b is not None
            k_nope, v = w.wkv_b(c).view(t, nh, s.nope + s.v).split([s.nope, s.v], -1)
            q = torch.cat([q_nope, q_pe], -1)
            k = torch.cat([k_nope, k_pe.expand(t, nh, s.rope)], -1)
        outs, row = [], 0
        for sp in step.spans:
            n = sp.n
            k_all, v_all = sp.store(i, k[row : row + n], v[row : row + n])
            if s.latent:
                v_all = k_all[..., : s.kv_lora]
            outs.append(
                attention(
                    q[row : row + n], k_all, v_all, sp.start, self.attn_scale, masks=step.masks
                )
            )
            row += n
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        if w.wv_b is not None:
            o = w.wv_b(o.view(t, nh, s.kv_lora)).reshape(t, nh * s.v)
        return o
