"""Qwen3-VL-MoE, text only (GGUF architecture ``qwen3vlmoe``): Qwen3-MoE's layers (softmax
routing renormalized over the top-k on every layer) with Qwen3-VL's multi-section RoPE at text
positions (:mod:`freetoken.models.qwen3vl`)."""

from freetoken.models.qwen3moe import ffn_factory
from freetoken.models.qwen3vl import FEATURES

__all__ = ["FEATURES", "ffn_factory"]
