"""Qwen3-VL, text only (GGUF architecture ``qwen3vl``): Qwen3's decoder (per-head Q/K norms,
NEOX layout) with interleaved multi-section RoPE (``rope.dimension_sections``). A text token's
positions are ``(p, p, p, 0)``, as llama.cpp gives them: the pairs of the first three sections
turn with ``p``, those that read the fourth position stay unrotated. Image-side keys
(``n_deepstack_layers``) change nothing for text: llama.cpp pads token embeddings with zeros
where the deepstack features would go."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from freetoken.errors import GGUFError
from freetoken.models.config import ModelConfig
from freetoken.models.transformer import Features

__all__ = ["FEATURES", "rope_sections", "text_rope_factors"]


def rope_sections(meta: Mapping[str, Any], arch: str) -> tuple[int, int, int, int]:
    """The four RoPE sections (pairs per position component); one number means all four,
    a shorter array is padded with zeros (llama.cpp's ``get_key_or_arr``)."""
    key = f"{arch}.rope.dimension_sections"
    value = meta.get(key)
    if value is None:
        raise GGUFError(f"missing metadata key `{key}`")
    items = [value] * 4 if isinstance(value, int) else value
    if (
        not isinstance(items, list)
        or not 0 < len(items) <= 4
        or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in items)
        or sum(items) == 0
    ):
        raise GGUFError(f"metadata `{key}` is {value!r}, expected up to 4 section sizes")
    s = [*items, 0, 0, 0][:4]
    return s[0], s[1], s[2], s[3]


def text_rope_factors(meta: Mapping[str, Any], cfg: ModelConfig) -> torch.Tensor:
    """Frequency factors that turn text positions into the interleaved multi-section
    rotation (ggml's IMROPE): pair ``i``'s sector ``i mod sum(sections)`` reads the height
    position where ``sector % 3 == 1`` and ``sector < 3 * s1``, the width where ``% 3 == 2``
    and ``< 3 * s2``, the time where ``% 3 == 0`` and ``< 3 * s0``, else the extra position.
    Text has ``p`` in the first three and 0 in the last: factor 1, or infinite (no turn)."""
    if cfg.rope_dim != cfg.head_dim:
        raise GGUFError(
            f"{cfg.arch}: rope.dimension_count {cfg.rope_dim} is not the head size {cfg.head_dim}"
        )
    s0, s1, s2, s3 = rope_sections(meta, cfg.arch)
    total = s0 + s1 + s2 + s3
    if total > cfg.rope_dim:
        raise GGUFError(
            f"{cfg.arch}: RoPE sections {[s0, s1, s2, s3]} exceed the {cfg.rope_dim} rotated dims"
        )
    factors = []
    for i in range(cfg.rope_dim // 2):
        sector = i % total
        text = (
            (sector % 3 == 1 and sector < 3 * s1)
            or (sector % 3 == 2 and sector < 3 * s2)
            or (sector % 3 == 0 and sector < 3 * s0)
        )
        factors.append(1.0 if text else math.inf)
    return torch.tensor(factors, dtype=torch.float32)


FEATURES = Features(rope_neox=True, qk_norm=True, rope_factors=text_rope_factors)
