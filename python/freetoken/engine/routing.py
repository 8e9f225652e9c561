"""Expert routing per family: router logits -> top-k expert ids and weights.

``softmax``: probabilities over all experts, top-k of them (Qwen, Mixtral, OLMoE);
``sigmoid``: independent scores with a selection-only bias (``exp_probs_b``) and optional
grouped top-k (DeepSeek V3, GLM-4.5); ``softmax_weight``: top-k on the logits, softmax over
the chosen ones (gpt-oss). Then optional renormalization and a routed scaling factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.errors import UnsupportedError

__all__ = ["Routing", "route"]

#: The smallest positive half-precision normal: llama.cpp clamps the weight sum to it.
_MIN_WEIGHT_SUM = 6.103515625e-5

#: GGUF `expert_gating_func` values.
GATING_FUNCS = {0: "softmax", 1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


@dataclass(frozen=True)
class Routing:
    """How a family turns router logits into routes."""

    top_k: int
    func: str = "softmax"
    normalize: bool = False
    scale: float = 1.0
    n_groups: int = 1
    groups_used: int = 1

    def __post_init__(self) -> None:
        if self.func not in ("softmax", "sigmoid", "softmax_weight"):
            raise UnsupportedError(f"expert gating function `{self.func}`")


def route(
    logits: torch.Tensor, r: Routing, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (ids int32 ``[T, k]``, weights float32 ``[T, k]``)."""
    logits = logits.float()
    if r.func == "softmax_weight":
        top, ids = logits.topk(r.top_k, dim=-1)
        weights = top.softmax(-1)
    else:
        probs = logits.softmax(-1) if r.func == "softmax" else logits.sigmoid()
        select = probs + bias if bias is not None else probs
        if r.n_groups > 1:
            t, e = select.shape
            groups = select.view(t, r.n_groups, e // r.n_groups)
            # A group's score is the sum of its two best experts.
            scores = groups.topk(2, dim=-1).values.sum(-1)
            keep = scores.topk(r.groups_used, dim=-1).indices
            mask = torch.ones(t, r.n_groups, dtype=torch.bool)
            mask.scatter_(1, keep, False)
            select = groups.masked_fill(mask[..., None], float("-inf")).view(t, e)
        ids = select.topk(r.top_k, dim=-1).indices
        weights = probs.gather(-1, ids)
    if r.normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(_MIN_WEIGHT_SUM)
    if r.scale != 1.0:
        weights = weights * r.scale
    return ids.to(torch.int32).contiguous(), weights.contiguous()
