"""A model's hyperparameters, typed, from the GGUF metadata (``<arch>.*`` keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken.errors import GGUFError

__all__ = ["LayerShape", "ModelConfig"]


def _get(meta: Mapping[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    if key not in meta:
        if default is ...:
            raise GGUFError(f"missing metadata key `{key}`")
        return default
    value = meta[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GGUFError(f"metadata `{key}` is {value!r}, expected {kind.__name__}")
    return value


def _per_layer(meta: Mapping[str, Any], key: str, n_layers: int, default: int) -> tuple[int, ...]:
    """A per-layer integer key: one value for every layer or an array of one per layer (as
    llama.cpp's ``get_key_or_arr`` reads it)."""
    value = meta.get(key, default)
    items = value if isinstance(value, list) else [value] * n_layers
    if len(items) != n_layers:
        raise GGUFError(f"metadata `{key}` has {len(items)} entries for {n_layers} layers")
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise GGUFError(f"metadata `{key}` is {value!r}, expected non-negative integers")
    return tuple(items)


@dataclass(frozen=True)
class LayerShape:
    """One layer's attention and feed-forward sizes (:meth:`ModelConfig.layer`)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int
    rope_dim: int
    ffn: int


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters shared by the decoder families."""

    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    rope_scale: float
    sliding_window: int
    swa_layers: tuple[bool, ...]
    rope_base_swa: float
    final_logit_softcap: float
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    expert_shared_ffn: int = 0
    leading_dense: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    expert_gating_func: int = 0
    expert_groups: int = 1
    expert_groups_used: int = 1
    #: Per layer, where the file gives arrays (``attention.head_count``,
    #: ``attention.head_count_kv``, ``feed_forward_length``); empty: the scalars above.
    layer_heads: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_ffn: tuple[int, ...] = ()
    #: Head and rotated sizes of the sliding-window layers (``attention.key_length_swa``,
    #: ``value_length_swa``, ``rope.dimension_count_swa``; 0: the full layers').
    head_dim_swa: int = 0
    head_dim_v_swa: int = 0
    rope_dim_swa: int = 0
    #: Trailing layers that reuse an earlier layer's keys and values
    #: (``attention.shared_kv_layers``, Gemma 3n / 4).
    shared_kv_layers: int = 0

    def layer(self, i: int) -> LayerShape:
        """Layer ``i``'s sizes: the per-layer arrays where the file has them, the
        sliding-window sizes on sliding-window layers."""
        swa = bool(self.swa_layers) and self.swa_layers[i]
        return LayerShape(
            n_heads=self.layer_heads[i] if self.layer_heads else self.n_heads,
            n_kv_heads=self.layer_kv_heads[i] if self.layer_kv_heads else self.n_kv_heads,
            head_dim=(self.head_dim_swa or self.head_dim) if swa else self.head_dim,
            head_dim_v=(self.head_dim_v_swa or self.head_dim_v) if swa else self.head_dim_v,
            rope_dim=(self.rope_dim_swa or self.rope_dim) if swa else self.rope_dim,
            ffn=self.layer_ffn[i] if self.layer_ffn else self.ffn,
        )

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer ``i`` attends over: itself, or for the
        trailing ``shared_kv_layers`` the last layer with its own cache of the same kind
        (llama.cpp: the second-to-last for sliding-window layers, the last for full ones)."""
        first_shared = self.n_layers - self.shared_kv_layers
        if i < first_shared:
            return i
        return first_shared - (2 if self.swa_layers[i] else 1)

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], vocab_size: int, swa_pattern: int = 0
    ) -> ModelConfig:
        """Reads ``<arch>.*`` keys; ``swa_pattern`` is the family's default sliding-window
        period (every ``swa_pattern``-th layer is global) when the file does not give one."""
        arch = _get(meta, "general.architecture", str)

        def key(name: str, kind: type, default: Any = ...) -> Any:
            return _get(meta, f"{arch}.{name}", kind, default)

        n_layers = key("block_count", int)
        hidden = key("embedding_length", int)
        heads = _per_layer(meta, f"{arch}.attention.head_count", n_layers, 0)
        if f"{arch}.attention.head_count" not in meta:
            raise GGUFError(f"missing metadata key `{arch}.attention.head_count`")
        kv_heads = _per_layer(meta, f"{arch}.attention.head_count_kv", n_layers, -1)
        kv_heads = tuple(h if k < 0 else k for h, k in zip(heads, kv_heads, strict=True))
        for n_heads, n_kv in zip(heads, kv_heads, strict=True):
            if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
                raise GGUFError(f"head counts {n_heads} / {n_kv} do not form grouped attention")
        n_heads, n_kv = heads[0], kv_heads[0]
        uniform = len(set(heads)) == 1 and len(set(kv_heads)) == 1
        ffn = _per_layer(meta, f"{arch}.feed_forward_length", n_layers, 0)
        head_dim = key("attention.key_length", int, hidden // n_heads)
        head_dim_v = key("attention.value_length", int, head_dim)
        rope_dim = key("rope.dimension_count", int, head_dim)
        window = key("attention.sliding_window", int, 0)
        swa = cls._swa_layers(meta, arch, n_layers, window, swa_pattern)
        shared_kv = key("attention.shared_kv_layers", int, 0)
        if shared_kv and not (0 <= shared_kv <= n_layers - 2):
            raise GGUFError(
                f"metadata `{arch}.attention.shared_kv_layers` is {shared_kv}: at most "
                f"{n_layers - 2} of the {n_layers} layers can share earlier ones' caches"
            )
        scaling = key("rope.scaling.type", str, "none")
        factor = key("rope.scaling.factor", float, 1.0)
        if scaling not in ("none", "linear", "yarn") and factor != 1.0:
            raise GGUFError(f"rope scaling `{scaling}` is not supported")
        return cls(
            arch=arch,
            n_layers=n_layers,
            hidden=hidden,
            ffn=ffn[0],
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            vocab_size=vocab_size,
            context_length=key("context_length", int),
            norm_eps=key("attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_base=key("rope.freq_base", float, 10000.0),
            rope_dim=rope_dim,
            rope_scale=1.0 / factor if scaling == "linear" and factor > 0 else 1.0,
            sliding_window=window,
            swa_layers=swa,
            rope_base_swa=key("rope.freq_base_swa", float, 10000.0),
            final_logit_softcap=key("final_logit_softcapping", float, 0.0),
            n_experts=key("expert_count", int, 0),
            n_experts_used=key("expert_used_count", int, 0),
            expert_ffn=key("expert_feed_forward_length", int, 0),
            expert_shared_ffn=key("expert_shared_feed_forward_length", int, 0),
            leading_dense=key("leading_dense_block_count", int, 0),
            expert_weights_norm=key("expert_weights_norm", bool, False),
            expert_weights_scale=key("expert_weights_scale", float, 1.0),
            expert_gating_func=key("expert_gating_func", int, 0),
            expert_groups=key("expert_group_count", int, 1),
            expert_groups_used=key("expert_group_used_count", int, 1),
            layer_heads=() if uniform else heads,
            layer_kv_heads=() if uniform else kv_heads,
            layer_ffn=() if len(set(ffn)) == 1 else ffn,
            head_dim_swa=key("attention.key_length_swa", int, 0),
            head_dim_v_swa=key("attention.value_length_swa", int, 0),
            rope_dim_swa=key("rope.dimension_count_swa", int, 0),
            shared_kv_layers=shared_kv,
        )

    @staticmethod
    def _swa_layers(
        meta: Mapping[str, Any], arch: str, n_layers: int, window: int, pattern: int
    ) -> tuple[bool, ...]:
        if window <= 0:
            return (False,) * n_layers
        given = meta.get(f"{arch}.attention.sliding_window_pattern", pattern)
        if isinstance(given, list):
            if len(given) != n_layers:
                raise GGUFError("sliding_window_pattern does not have one entry per layer")
            return tuple(bool(v) for v in given)
        # Every `given`-th layer is global, the rest slide (0: every layer slides).
        return tuple(given == 0 or i % given < given - 1 for i in range(n_layers))
