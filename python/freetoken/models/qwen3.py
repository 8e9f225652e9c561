"""Qwen3: per-head RMSNorm on Q and K before RoPE, no biases, NEOX RoPE."""

from freetoken.models.transformer import Features

FEATURES = Features(rope_neox=True, qk_norm=True)
