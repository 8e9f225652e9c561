"""Qwen3.5 dense (GGUF architecture ``qwen35``): the Gated DeltaNet hybrid decoder
(:mod:`~freetoken.models.hybrid`) with value heads tiled over the key heads, separate
``ssm_beta``/``ssm_alpha``, interleaved multi-section RoPE, and a SwiGLU FFN on every layer."""

from __future__ import annotations

from functools import partial

from freetoken.models.hybrid import HybridTransformer
from freetoken.models.transformer import Features

FEATURES = Features(rope_neox=True, qk_norm=True, ffn_norm="post_attention_norm")

#: The model class ``load_model`` builds.
MODEL = partial(HybridTransformer, grouped=False, fused_ba=False)
