"""Llama (and Mistral, which shares the ``llama`` architecture): the plain pre-norm decoder.
llama.cpp's converter permutes Q and K so that RoPE rotates adjacent pairs."""

from freetoken.models.transformer import Features

FEATURES = Features(rope_neox=False)
