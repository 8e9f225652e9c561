"""Llama (and Mistral, which shares the ``llama`` architecture): the plain pre-norm decoder.
llama.cpp's converter permutes Q and K so that RoPE rotates adjacent pairs. A file with
``llama.expert_count`` > 0 is Mixtral: ``load_model`` then builds the FFNs with
:func:`ffn_factory` (:mod:`freetoken.models.mixtral`)."""

from freetoken.models.mixtral import ffn_factory
from freetoken.models.transformer import Features

__all__ = ["FEATURES", "ffn_factory"]

FEATURES = Features(rope_neox=False)
