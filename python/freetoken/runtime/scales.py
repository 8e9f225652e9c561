"""Per-tensor and per-expert weight scales: the ``<name>.scale`` companions llama.cpp's
converter writes beside NVFP4 tensors (their ``weight_scale_2``), each multiplying its
matrix's product, as llama.cpp's loader reads them for every architecture
(``src/llama-model.cpp``, the generic pass after the architecture's tensors)."""

from __future__ import annotations

import torch

from freetoken.errors import UnsupportedError
from freetoken.gguf import GGUFFile

__all__ = ["SCALED_MATRICES", "expert_scales", "weight_scale"]

#: The matrices whose ``.scale`` multiplies their product (one value; for stacked experts one
#: per expert). Other ``.scale`` tensors are a family's own (Gemma 4's router); the
#: ``.input_scale`` tensors the converter also writes llama.cpp loads and leaves unused, as
#: here.
SCALED_MATRICES = frozenset(
    {
        "attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate",
        "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
        "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
        "ssm_in", "ssm_out", "ssm_alpha", "ssm_beta", "output",
    }
)  # fmt: skip


def weight_scale(gguf: GGUFFile, name: str, n: int = 1) -> torch.Tensor | None:
    """The float32 ``<name>.scale`` of matrix ``name`` (``blk.N.attn_q``) where the file has
    one and the matrix is one llama.cpp scales; a ShapeError or GGUFError naming it unless it
    holds ``n`` values (one, or one per expert of stacked experts)."""
    scale = f"{name}.scale"
    if name.rsplit(".", 1)[-1] not in SCALED_MATRICES or scale not in gguf:
        return None
    gguf.expect(scale, (n,))
    return torch.from_numpy(gguf.array(scale).copy())


def expert_scales(
    gguf: GGUFFile, i: int, n_experts: int, biases: bool = False
) -> torch.Tensor | None:
    """Layer ``i``'s stacked experts' scales as one factor per expert on its output: the
    down product's scale times the up product's (the output is linear in the up product);
    None when the file has neither. Refused (UnsupportedError naming the tensor): a gate
    scale other than 1, which acts inside the activation, and any scale on experts with
    biases (gpt-oss), which a factor on the output cannot carry past the biases."""
    p = f"blk.{i}."
    if biases:
        for k in ("gate", "up", "down"):
            if weight_scale(gguf, f"{p}ffn_{k}_exps", n_experts) is not None:
                raise UnsupportedError(
                    f"tensor `{p}ffn_{k}_exps.scale`: scales on experts with biases are not "
                    "supported"
                )
        return None
    gate = weight_scale(gguf, p + "ffn_gate_exps", n_experts)
    if gate is not None and not bool((gate == 1).all()):
        raise UnsupportedError(
            f"tensor `{p}ffn_gate_exps.scale`: per-expert gate scales other than 1 are not "
            "supported (they act inside the activation)"
        )
    up = weight_scale(gguf, p + "ffn_up_exps", n_experts)
    down = weight_scale(gguf, p + "ffn_down_exps", n_experts)
    if up is None or down is None:
        return down if up is None else up
    return up * down
