"""Qwen2: the plain decoder with Q/K/V biases (loaded when present) and NEOX RoPE."""

from freetoken.models.transformer import Features

FEATURES = Features(rope_neox=True)
