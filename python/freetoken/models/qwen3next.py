"""Qwen3-Next / Qwen3-Coder-Next (GGUF architecture ``qwen3next``): the Gated DeltaNet hybrid
decoder (:mod:`~freetoken.models.hybrid`) with value heads grouped by key head, the fused
``ssm_ba`` beta/alpha projection and NEOX partial RoPE; the experts and the gated shared
expert as in :mod:`~freetoken.models.qwen35moe`."""

from __future__ import annotations

from functools import partial

from freetoken.models.hybrid import HybridTransformer
from freetoken.models.qwen35moe import ffn_factory
from freetoken.models.transformer import Features

__all__ = ["FEATURES", "MODEL", "ffn_factory"]

FEATURES = Features(rope_neox=True, qk_norm=True, ffn_norm="post_attention_norm")

#: The model class ``load_model`` builds.
MODEL = partial(HybridTransformer, grouped=True, fused_ba=True)
