"""A model's hyperparameters, typed, from the GGUF metadata (``<arch>.*`` keys)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken.errors import GGUFError

__all__ = ["ModelConfig"]


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
        n_heads = key("attention.head_count", int)
        n_kv = meta.get(f"{arch}.attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):
            raise GGUFError(f"per-layer `{arch}.attention.head_count_kv` is not supported")
        if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
            raise GGUFError(f"head counts {n_heads} / {n_kv} do not form grouped attention")
        head_dim = key("attention.key_length", int, hidden // n_heads)
        window = key("attention.sliding_window", int, 0)
        swa = cls._swa_layers(meta, arch, n_layers, window, swa_pattern)
        scaling = key("rope.scaling.type", str, "none")
        factor = key("rope.scaling.factor", float, 1.0)
        if scaling not in ("none", "linear", "yarn") and factor != 1.0:
            raise GGUFError(f"rope scaling `{scaling}` is not supported")
        return cls(
            arch=arch,
            n_layers=n_layers,
            hidden=hidden,
            ffn=key("feed_forward_length", int, 0),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            head_dim_v=key("attention.value_length", int, head_dim),
            vocab_size=vocab_size,
            context_length=key("context_length", int),
            norm_eps=key("attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_base=key("rope.freq_base", float, 10000.0),
            rope_dim=key("rope.dimension_count", int, head_dim),
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
