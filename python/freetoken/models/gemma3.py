"""Gemma 3: interleaved sliding-window and global layers (every sixth is global, with its
own RoPE base), Q/K norms, sandwich norms around attention and FFN, GELU-tanh gating, and
embeddings scaled by sqrt(hidden). GGUF norm weights already include Gemma's +1."""

import math

from freetoken.models.config import ModelConfig
from freetoken.models.transformer import Features

FEATURES = Features(
    rope_neox=True,
    qk_norm=True,
    sandwich_norm=True,
    embed_scale=True,
    activation="gelu_tanh",
    swa_pattern=6,
)


def attn_scale(cfg: ModelConfig) -> float:
    """Queries are scaled by 1/sqrt(head_dim), except in the 27B model (62 layers), which
    uses 1/sqrt(hidden / heads)."""
    if cfg.n_layers == 62:
        return 1.0 / math.sqrt(cfg.hidden / cfg.n_heads)
    return 1.0 / math.sqrt(cfg.head_dim)
