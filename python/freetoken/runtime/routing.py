"""Expert routing per family: router logits -> top-k expert ids and weights.

``softmax``: probabilities over all experts, top-k of them (Qwen, Mixtral, OLMoE);
``sigmoid``: independent scores with a selection-only bias (``exp_probs_b``) and optional
grouped top-k (DeepSeek V3, GLM-4.5); ``softmax_weight``: top-k on the logits, softmax over
the chosen ones (gpt-oss). Then optional renormalization and a routed scaling factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.errors import InvalidInputError, ShapeError, UnsupportedError

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

    @property
    def softmax_top_k(self) -> bool:
        """Whether the weights are the renormalized top-k of a softmax with no selection
        bias or groups: the softmax of the k largest logits (one kernel on the GPU)."""
        return self.func == "softmax" and self.normalize and self.n_groups == 1

    @property
    def weight_scale(self) -> float:
        """The routed scaling factor (1 when the file's 0 means none)."""
        return self.scale if self.scale != 0.0 else 1.0

    def __post_init__(self) -> None:
        if self.func not in ("softmax", "sigmoid", "softmax_weight"):
            raise UnsupportedError(f"expert gating function `{self.func}`")
        if self.top_k < 1 or self.n_groups < 1 or not 1 <= self.groups_used <= self.n_groups:
            raise InvalidInputError(
                f"routing needs top_k >= 1 and 1 <= groups_used <= n_groups, got top_k "
                f"{self.top_k}, {self.groups_used} of {self.n_groups} groups"
            )


def route(
    logits: torch.Tensor, r: Routing, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (ids int32 ``[T, k]``, weights float32 ``[T, k]``).

    As llama.cpp's ``build_moe_ffn``: ``bias`` moves the selection only; the weights are the
    unbiased probabilities of the chosen experts (for ``softmax_weight`` their logits,
    softmaxed over the k); a scale of 0 means none."""
    if logits.dim() != 2:
        raise ShapeError(f"router logits must be [tokens, experts], got {tuple(logits.shape)}")
    e = logits.shape[1]
    if bias is not None and tuple(bias.shape) != (e,):
        raise ShapeError(f"selection bias has shape {tuple(bias.shape)}, expected ({e},)")
    per_group = e // r.n_groups
    if e % r.n_groups or (r.n_groups > 1 and per_group < 2):
        raise ShapeError(f"{e} experts do not split into {r.n_groups} groups of two or more")
    if r.top_k > r.groups_used * per_group:
        raise ShapeError(
            f"top-{r.top_k} of {e} experts ({r.groups_used} of {r.n_groups} groups used)"
        )
    logits = logits.float()
    if r.softmax_top_k and bias is None:
        # Renormalized top-k of a softmax is the softmax of the top-k logits: two kernels on
        # the GPU instead of six (a decode step runs one per layer).
        # A full sort of the expert logits, then the first k: one kernel on the GPU where
        # topk takes two.
        vals, ids = logits.sort(dim=-1, descending=True)
        vals, ids = vals[..., : r.top_k], ids[..., : r.top_k]
        weights = vals.softmax(-1)
        if r.weight_scale != 1.0:
            weights = weights * r.weight_scale
        return ids.to(torch.int32).contiguous(), weights.contiguous()
    if r.func == "softmax":
        probs = logits.softmax(-1)
    elif r.func == "sigmoid":
        probs = logits.sigmoid()
    else:
        probs = logits
    select = probs + bias if bias is not None else probs
    if r.n_groups > 1:
        t = select.shape[0]
        groups = select.reshape(t, r.n_groups, per_group)
        # A group's score is the sum of its two best experts.
        scores = groups.topk(2, dim=-1).values.sum(-1)
        keep = scores.topk(r.groups_used, dim=-1).indices
        mask = torch.ones(t, r.n_groups, dtype=torch.bool, device=select.device)
        mask.scatter_(1, keep, False)
        select = groups.masked_fill(mask[..., None], float("-inf")).reshape(t, e)
    ids = select.topk(r.top_k, dim=-1).indices
    weights = probs.gather(-1, ids)
    if r.func == "softmax_weight":
        weights = weights.softmax(-1)
    if r.normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(_MIN_WEIGHT_SUM)
    if r.weight_scale != 1.0:
        weights = weights * r.weight_scale
    return ids.to(torch.int32).contiguous(), weights.contiguous()
