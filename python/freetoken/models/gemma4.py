"""Gemma 4 (GGUF architecture ``gemma4``): the dense models, the E-series and the 26B-A4B
mixture of experts, as llama.cpp's ``src/models/gemma4.cpp`` runs them.

Gemma 3's decoder (sandwich norms, GELU-tanh gating, embeddings scaled by sqrt(hidden),
per-head q/k norms, NEOX RoPE) with, read from the metadata as llama.cpp reads it:

- sliding-window and full layers per ``attention.sliding_window_pattern`` (one flag per
  layer), each kind with its own head size (``attention.key_length`` for full layers,
  ``key_length_swa`` for sliding ones), KV head count (``attention.head_count_kv`` per
  layer), rotated dims and RoPE base (``rope.freq_base`` / ``rope.freq_base_swa``); the full
  layers' proportional RoPE comes as ``rope_freqs.weight`` (infinite factors on the pairs
  that do not turn), which the sliding layers do not use;
- values RMS-normed per head without a weight; a full layer without ``attn_v`` attends over
  its keys' projection as values; attention unscaled (the q/k norms set the scale);
- the E-series' trailing ``attention.shared_kv_layers`` layers, which have no key or value
  projections and attend over the cache of the last earlier layer of their kind;
- the E-series' per-layer inputs (``embedding_length_per_layer_input`` wide per layer): the
  token's row of ``per_layer_token_embd`` (looked up on the host from the mapped file: the
  table is large and mostly cold) plus a normed projection of the embedding, added after
  each layer through a GELU gate (``inp_gate``, ``proj``, ``post_norm``);
- an optional per-layer output scale (``layer_output_scale``);
- MoE layers (those with ``ffn_gate_inp``): the dense FFN as a shared expert beside the
  routed ones, each with its own norms (``ffn_norm``/``post_ffw_norm_1`` and
  ``pre_ffw_norm_2``/``post_ffw_norm_2``); the router reads the attention output RMS-normed
  without a weight, over sqrt(hidden), times ``ffn_gate_inp.scale``; softmax top-k,
  renormalized; ``ffn_down_exps.scale`` (where present) scales each expert's output; the
  experts' gate and up stacked or fused (``ffn_gate_up_exps``);
- the final logits soft-capped by ``final_logit_softcapping`` where given.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from freetoken.errors import GGUFError
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Embedding, Linear, load_vector, rms_norm
from freetoken.models.transformer import (
    FFN,
    Block,
    DenseFFN,
    Features,
    FFNFactory,
    Step,
    Transformer,
)
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing

__all__ = ["FEATURES", "MODEL", "Gemma4MoE", "Gemma4Transformer", "attn_scale", "ffn_factory"]

FEATURES = Features(
    rope_neox=True,
    qk_norm=True,
    sandwich_norm=True,
    embed_scale=True,
    activation="gelu_tanh",
    rope_factors_full_only=True,
    v_norm=True,
    k_as_v=True,
)


def attn_scale(cfg: ModelConfig) -> float:
    """Gemma 4 does not scale the queries (llama.cpp: ``f_attention_scale = 1``)."""
    return 1.0


class NormedFFN:
    """``post(ffn(pre(x)))``: the dense FFN of a MoE layer with its own norms, the shared
    expert beside the routed ones."""

    def __init__(self, ffn: DenseFFN, pre: torch.Tensor, post: torch.Tensor, eps: float) -> None:
        self.ffn, self.pre, self.post, self.eps = ffn, pre, post, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.ffn(rms_norm(x, self.pre, self.eps)), self.post, self.eps)


class Gemma4MoE(MoeFFN):
    """A Gemma 4 MoE layer's feed-forward, called on the residual after attention (not on
    a normed input): the shared expert (:class:`NormedFFN`) plus the routed experts of
    ``pre_ffw_norm_2(x)``, normed by ``post_ffw_norm_2``, routed on the scaled
    weightless norm of ``x`` (module docstring)."""

    def __init__(self, gguf: GGUFFile, ctx: MoeContext, cfg: ModelConfig, i: int) -> None:
        p, h, eps = f"blk.{i}.", cfg.hidden, cfg.norm_eps
        router = Linear(gguf, p + "ffn_gate_inp", (cfg.n_experts, h))
        fused = p + "ffn_gate_up_exps.weight"
        layer = (
            expert_layer(gguf, ctx, i, act="gelu", gate_up=[fused])
            if fused in gguf
            else expert_layer(gguf, ctx, i, act="gelu")
        )
        if layer.n_experts != cfg.n_experts:
            raise GGUFError(
                f"{p}ffn_down_exps.weight holds {layer.n_experts} experts, the metadata "
                f"`{cfg.arch}.expert_count` says {cfg.n_experts}"
            )
        shared = NormedFFN(
            DenseFFN(gguf, p, h, cfg.layer(i).ffn, "gelu_tanh"),
            load_vector(gguf, p + "ffn_norm.weight", h),
            load_vector(gguf, p + "post_ffw_norm_1.weight", h),
            eps,
        )
        routing = Routing(top_k=cfg.n_experts_used, func="softmax", normalize=True)
        super().__init__(layer, router, routing, ctx.executor, None, shared)
        self.eps, self.inv_sqrt_hidden = eps, 1.0 / math.sqrt(h)
        self.router_scale = load_vector(gguf, p + "ffn_gate_inp.scale", h)
        self.pre_norm = load_vector(gguf, p + "pre_ffw_norm_2.weight", h)
        self.post_norm = load_vector(gguf, p + "post_ffw_norm_2.weight", h)
        scale = p + "ffn_down_exps.scale"
        self.expert_scale = load_vector(gguf, scale, cfg.n_experts) if scale in gguf else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        r = F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.inv_sqrt_hidden
        ids, weights = self.backend.route(self.router(r * self.router_scale), self.routing, None)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids.long()]
        h = rms_norm(x, self.pre_norm, self.eps).contiguous()
        routed = rms_norm(self.backend.run(self.layer, h, ids, weights), self.post_norm, self.eps)
        assert self.shared is not None
        return self.shared(x) + routed


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """The MoE feed-forward on layers with a router (``ffn_gate_inp``), else the dense one."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        if f"blk.{i}.ffn_gate_inp.weight" in gguf:
            return Gemma4MoE(gguf, ctx, cfg, i)
        return DenseFFN(gguf, f"blk.{i}.", cfg.hidden, cfg.layer(i).ffn, "gelu_tanh")

    return make


class HostRows(Embedding):
    """Rows of a table that stay in the mapped file on the host, dequantized on lookup
    whatever device the model runs on (GPU placement leaves them there)."""

    host_resident = True

    def rows(self, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The rows of checked token ids ``[T]``, float32 ``[T, width]`` on ``device``."""
        return self(tokens.cpu()).to(device)


class PerLayerInputs:
    """The E-series' per-layer inputs of a step: ``(norm(proj(x) / sqrt(hidden)) + rows *
    sqrt(width)) / sqrt(2)``, ``[T, layers, width]``, from the token ids and the scaled
    embeddings ``x``."""

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, width: int) -> None:
        n = cfg.n_layers * width
        self.width, self.n_layers, self.hidden = width, cfg.n_layers, cfg.hidden
        self.table = HostRows(gguf, "per_layer_token_embd.weight", cfg.vocab_size, n)
        self.proj = Linear(gguf, "per_layer_model_proj", (n, cfg.hidden))
        self.norm = load_vector(gguf, "per_layer_proj_norm.weight", width)

    def __call__(self, tokens: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
        t, shape = x.shape[0], (x.shape[0], self.n_layers, self.width)
        rows = self.table.rows(tokens, x.device).view(shape) * math.sqrt(self.width)
        proj = (self.proj(x) * (1.0 / math.sqrt(self.hidden))).view(t, *shape[1:])
        return (rms_norm(proj, self.norm, eps) + rows) * (1.0 / math.sqrt(2.0))


class LayerExtras:
    """What a Gemma 4 layer adds after its FFN: the per-layer input's gate, projection and
    norm (E-series) and the output scale, each where the file has it."""

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, i: int, width: int) -> None:
        p, h = f"blk.{i}.", cfg.hidden
        self.inp_gate = self.proj = self.post_norm = None
        if width:
            self.inp_gate = Linear(gguf, p + "inp_gate", (width, h))
            self.proj = Linear(gguf, p + "proj", (h, width))
            self.post_norm = load_vector(gguf, p + "post_norm.weight", h)
        scale = p + "layer_output_scale.weight"
        self.out_scale = load_vector(gguf, scale, 1) if scale in gguf else None

    def __call__(self, x: torch.Tensor, inputs: torch.Tensor | None, eps: float) -> torch.Tensor:
        """``x`` after the layer's per-layer input ``inputs [T, width]`` and output scale."""
        if inputs is not None:
            assert self.inp_gate is not None and self.proj is not None
            assert self.post_norm is not None
            g = F.gelu(self.inp_gate(x), approximate="tanh") * inputs
            x = x + rms_norm(self.proj(g), self.post_norm, eps)
        if self.out_scale is not None:
            x = x * self.out_scale
        return x


def _require(gguf: GGUFFile, key: str, kind: type) -> None:
    value = gguf.metadata.get(key)
    if value is None:
        raise GGUFError(f"missing metadata key `{key}`")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GGUFError(f"metadata `{key}` is {value!r}, expected {kind.__name__}")


def _check_shared_kv(cfg: ModelConfig) -> None:
    """Each shared-KV layer reads a layer of its own kind (what llama.cpp's reuse assumes)."""
    for i in range(cfg.n_layers - cfg.shared_kv_layers, cfg.n_layers):
        src = cfg.kv_source(i)
        if cfg.swa_layers[src] != cfg.swa_layers[i]:
            kind = "sliding-window" if cfg.swa_layers[i] else "full"
            raise GGUFError(
                f"metadata `{cfg.arch}.attention.shared_kv_layers` {cfg.shared_kv_layers}: "
                f"{kind} layer {i} would read layer {src}, which is not {kind}"
            )


class Gemma4Transformer(Transformer):
    """The Gemma 4 decoder (module docstring)."""

    #: Model attributes beyond the Transformer's that GPU placement moves: beside the first
    #: layers, and (lists of one entry per layer) each entry beside its layer.
    gpu_parts = ("per_layer",)
    gpu_layer_parts = ("layer_extras",)
    #: Its pass (:meth:`run`: the per-layer inputs and extras) is not :meth:`run_part`'s.
    staged_graphs = False

    def __init__(
        self,
        gguf: GGUFFile,
        cfg: ModelConfig,
        feat: Features,
        attn_scale: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        make_ffn: FFNFactory | None = None,
    ) -> None:
        a = cfg.arch
        # Keys llama.cpp's gemma4 loader requires.
        _require(gguf, f"{a}.attention.sliding_window_pattern", list)
        for key in ("attention.sliding_window", "embedding_length_per_layer_input",
                    "attention.key_length_swa", "attention.value_length_swa"):  # fmt: skip
            _require(gguf, f"{a}.{key}", int)
        _check_shared_kv(cfg)
        if make_ffn is None and any(n.endswith("ffn_gate_inp.weight") for n in gguf.tensors):
            raise GGUFError(f"the file has expert routers but no `{a}.expert_count`")
        super().__init__(gguf, cfg, feat, attn_scale, progress, make_ffn)
        width = gguf.metadata[f"{a}.embedding_length_per_layer_input"]
        self.per_layer = PerLayerInputs(gguf, cfg, width) if width else None
        self.layer_extras = [LayerExtras(gguf, cfg, i, width) for i in range(cfg.n_layers)]
        #: Steps read the host (the per-layer rows), so they cannot be captured as graphs.
        self.host_inputs = self.per_layer is not None

    def run(self, tokens: torch.Tensor, step: Step, rows: torch.Tensor | None) -> torch.Tensor:
        eps = self.cfg.norm_eps
        x = self.embed(tokens) * math.sqrt(self.cfg.hidden)
        inputs = self.per_layer(tokens, x, eps) if self.per_layer is not None else None
        for i, blk in enumerate(self.blocks):
            x, at = self._to_layer(i, x, step)
            x = self._layer(i, blk, x, at)
            x = self.layer_extras[i](x, None if inputs is None else inputs[:, i].to(x.device), eps)
        x, _ = self._to_layer(None, x, step)
        return self._head(x, None if rows is None else rows.to(x.device))

    def _layer(self, i: int, blk: Block, x: torch.Tensor, step: Step) -> torch.Tensor:
        eps = self.cfg.norm_eps
        assert blk.post_attn_norm is not None and blk.post_ffn_norm is not None
        a = blk.wo(self._attention(i, blk, rms_norm(x, blk.attn_norm, eps), step))
        x = x + rms_norm(a, blk.post_attn_norm, eps)
        # A MoE layer norms its two inputs itself (module docstring).
        moe = isinstance(blk.ffn, Gemma4MoE)
        f = blk.ffn(x) if moe else blk.ffn(rms_norm(x, blk.ffn_norm, eps))
        return x + rms_norm(f, blk.post_ffn_norm, eps)


MODEL = Gemma4Transformer
