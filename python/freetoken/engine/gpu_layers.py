"""Dense weights on the GPU: linear layers and the token embedding.

Two ways to run a quantized dense weight (``--dense-weights``):

- ``bf16``: dequantized once at load to bfloat16, products by cuBLAS with float32 output;
- ``quant``: kept in its GGUF type in a one-slot :class:`~freetoken.engine.gpu.ExpertPool`
  and run by ggml-cuda's MMVQ (up to 8 tokens) or MMQ, as llama.cpp runs it. Types without a
  GPU kernel fall back to bf16.

The choice and its measurement are in docs/gpu.md. Float32 weights (routers, small vectors)
stay float32 either way, so expert selection sees the same logits as on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from freetoken.engine import gpu
from freetoken.engine.options import DENSE_MODES
from freetoken.errors import InvalidInputError
from freetoken.models.layers import Embedding, HeadwiseLinear, Linear
from freetoken.quant import dequantize, type_info

__all__ = ["GpuEmbedding", "GpuHeadwise", "GpuLinear", "GpuLinearGroup"]


_F32 = type_info("F32").id


def _dequantized(lin: Linear, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(lin.weight.dequantize()).to(device=device, dtype=dtype)


class GpuLinear:
    """``y = x @ W.T (+ b)`` on the GPU for float32 ``x [..., K]``; float32 out."""

    def __init__(
        self, lin: Linear, device: torch.device, mode: str, keep_f32: bool = False
    ) -> None:
        if mode not in DENSE_MODES:
            raise InvalidInputError(f"dense weights `{mode}`: choose one of {DENSE_MODES}")
        self.name = lin.name
        self.n, self.k = lin.n, lin.k
        self.bias = None if lin.bias is None else lin.bias.to(device)
        #: The fused group this layer belongs to (see :class:`GpuLinearGroup`).
        self.group: GpuLinearGroup | None = None
        self.pool: gpu.ExpertPool | None = None
        self.weight: torch.Tensor | None = None
        qtype = lin.weight.qtype
        if keep_f32 or qtype == _F32:
            self.weight = _dequantized(lin, torch.float32, device)
        elif mode == "quant" and all(gpu.kernel_for(qtype, t) for t in (1, 9)):
            self.pool = gpu.ExpertPool(qtype, self.k, self.n, 1, device=device)
            self.pool.load(0, torch.from_numpy(np.ascontiguousarray(lin.weight.raw).copy()))
            self._ids = torch.zeros((1, 1), dtype=torch.int32, device=device)
        else:
            self.weight = _dequantized(lin, torch.bfloat16, device)

    @property
    def nbytes(self) -> int:
        """Device bytes of the weight."""
        if self.pool is not None:
            return self.pool.tensor.numel()
        assert self.weight is not None
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if self.pool is not None:
            t = x2.shape[0]
            if self._ids.shape[0] < t:
                self._ids = torch.zeros((t, 1), dtype=torch.int32, device=x.device)
            y = gpu.expert_matmul(self.pool, x2.contiguous(), self._ids[:t], check_ids=False)
            y = y.view(t, self.n)
        else:
            y = _mm(x2, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.n)


def _mm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    assert w is not None
    if w.dtype == torch.float32:
        return x @ w.t()
    # bf16 inputs, float32 accumulation and output (logits keep their precision).
    return torch.mm(x.to(w.dtype), w.t(), out_dtype=torch.float32)


class GpuLinearGroup:
    """Layers applied to the same input (Q/K/V, gate/up) whose bf16 weights are concatenated
    into one matrix: one product instead of several."""

    def __init__(self, members: Sequence[GpuLinear]) -> None:
        self.members = tuple(members)
        weights = [m.weight for m in self.members]
        self.weight = torch.cat(weights)  # type: ignore[arg-type]
        self.sizes = [m.n for m in self.members]
        biases = [m.bias for m in self.members]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [b if b is not None else self.weight.new_zeros(m.n, dtype=torch.float32)
                 for b, m in zip(biases, self.members, strict=True)]
            )  # fmt: skip
        for m in self.members:
            m.weight, m.group = None, self

    @staticmethod
    def fuse(members: Sequence[object]) -> None:
        """Fuses ``members`` when they are all bf16 :class:`GpuLinear` of one input size."""
        if len(members) < 2 or not all(
            isinstance(m, GpuLinear)
            and m.weight is not None
            and m.weight.dtype == torch.bfloat16
            and m.k == members[0].k  # type: ignore[attr-defined]
            for m in members
        ):
            return
        GpuLinearGroup(members)  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        lead = x.shape[:-1]
        y = _mm(x.reshape(-1, self.members[0].k), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return [
            part.view(*lead, n) for part, n in zip(y.split(self.sizes, -1), self.sizes, strict=True)
        ]


class GpuEmbedding:
    """The token embedding as a bf16 table on the GPU."""

    def __init__(self, emb: Embedding, device: torch.device) -> None:
        self.name = emb.name
        self.vocab, self.hidden = emb.vocab, emb.hidden
        self.device = device
        self.table = torch.empty((emb.vocab, emb.hidden), dtype=torch.bfloat16, device=device)
        chunk = 16384  # rows per dequantization: bounds the float32 staging
        for start in range(0, emb.vocab, chunk):
            n = min(chunk, emb.vocab - start)
            raw = emb.raw[start * emb.row : (start + n) * emb.row]
            self.table[start : start + n] = torch.from_numpy(
                dequantize(raw, emb.qtype, (n, emb.hidden))
            )

    lookup = Embedding.lookup

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.table).float()


class GpuHeadwise:
    """One float32 matrix per head on the GPU (MLA's ``attn_k_b``/``attn_v_b``, small):
    ``x [T, H, K] -> [T, H, N]``."""

    def __init__(self, hw: HeadwiseLinear, device: torch.device) -> None:
        self.weight = torch.stack([torch.from_numpy(m.dequantize()) for m in hw.heads]).to(
            device
        )  # [H, N, K]
        self.n = hw.n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.transpose(0, 1), self.weight.transpose(1, 2)).transpose(0, 1)
