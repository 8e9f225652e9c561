"""Mistral 3 text models (GGUF architecture ``mistral3``: Ministral 3, Mistral Small 3.x):
Llama's decoder (the converter permutes Q and K for the adjacent-pair RoPE layout) with
YaRN read as llama.cpp's mistral3 loader reads it (``yarn_beta_fast``, ``yarn_beta_slow``,
``yarn_log_multiplier`` as mscale_all_dim) and, where the file gives
``attention.temperature_scale``, queries scaled by ``1 + beta * ln(1 + floor(pos / n_orig))``
over the original context ``n_orig`` (Llama 4's temperature tuning). The layout's MoE variant
(no released model) is not read: such a file lacks the dense FFN tensors."""

from freetoken.models.transformer import Features

__all__ = ["FEATURES"]

FEATURES = Features(rope_neox=False, yarn_keys=True, attn_temperature=True)
