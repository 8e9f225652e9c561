"""Dense weights on the GPU: linear layers and the token embedding.

Two ways to run a quantized dense weight (``--dense-weights``):

- ``bf16``: dequantized once at load to bfloat16, products by cuBLAS with float32 output;
- ``quant``: kept in its GGUF type in a one-slot :class:`~freetoken.runtime.gpu.ExpertPool`
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

from freetoken.engine.options import DENSE_MODES
from freetoken.errors import InvalidInputError
from freetoken.models.layers import Embedding, HeadwiseLinear, Linear, finish
from freetoken.quant import dequantize, type_info
from freetoken.runtime import gpu

__all__ = ["GpuEmbedding", "GpuHeadwise", "GpuLinear", "GpuLinearGroup"]


_F32 = type_info("F32").id


def _dequantized(lin: Linear, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(lin.weight.dequantize()).to(device=device, dtype=dtype)


class _Weight:
    """One matrix ``(n, k)`` on the device: a one-slot pool in its GGUF type (MMVQ/MMQ) or a
    bf16 / float32 tensor (cuBLAS)."""

    def __init__(
        self, n: int, k: int, pool: gpu.ExpertPool | None, dense: torch.Tensor | None
    ) -> None:
        self.n, self.k, self.pool, self.dense = n, k, pool, dense

    @classmethod
    def quantized(
        cls, qtype: int, n: int, k: int, raw: torch.Tensor, device: torch.device
    ) -> _Weight:
        pool = gpu.ExpertPool(qtype, k, n, 1, device=device)
        pool.load(0, raw)
        return cls(n, k, pool, None)

    @property
    def kind(self) -> object:
        """What must match for weights to stack: the input size and the GGUF type or dtype."""
        return (self.k, self.pool.qtype if self.pool is not None else self.dense.dtype)  # type: ignore[union-attr]

    @property
    def device(self) -> torch.device:
        return self.pool.device if self.pool is not None else self.dense.device  # type: ignore[union-attr]

    @property
    def nbytes(self) -> int:
        if self.pool is not None:
            return self.pool.tensor.numel()
        assert self.dense is not None
        return self.dense.numel() * self.dense.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, k] @ W.T``, float32 ``[T, n]``."""
        if self.pool is None:
            assert self.dense is not None
            if self.dense.dtype == torch.float32:
                return x @ self.dense.t()
            # bf16 inputs, float32 accumulation and output (logits keep their precision).
            return torch.mm(x.to(self.dense.dtype), self.dense.t(), out_dtype=torch.float32)
        t = x.shape[0]
        ids = gpu.constant(t, 0, torch.int32, x.device).view(t, 1)
        y = gpu.expert_matmul(self.pool, x.contiguous(), ids, check_ids=False)
        return y.view(t, self.n)

    @staticmethod
    def concat(weights: Sequence[_Weight]) -> _Weight:
        """The rows of ``weights``, all of one :attr:`kind`, stacked into one matrix
        (quantized rows are whole blocks, so their bytes concatenate)."""
        first = weights[0]
        assert all(w.kind == first.kind for w in weights)
        n = sum(w.n for w in weights)
        if first.pool is None:
            return _Weight(n, first.k, None, torch.cat([w.dense for w in weights]))  # type: ignore[misc]
        raw = torch.cat([w.pool.tensor[: w.pool.matrix_nbytes] for w in weights])  # type: ignore[union-attr]
        return _Weight.quantized(first.pool.qtype, n, first.k, raw, raw.device)


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
        self.scale = lin.scale
        #: The fused group this layer belongs to (see :class:`GpuLinearGroup`).
        self.group: GpuLinearGroup | None = None
        qtype = lin.weight.qtype
        self.w: _Weight | None
        if keep_f32 or qtype == _F32:
            self.w = _Weight(self.n, self.k, None, _dequantized(lin, torch.float32, device))
        elif mode == "quant" and all(gpu.kernel_for(qtype, t) for t in (1, 9)):
            raw = torch.from_numpy(np.ascontiguousarray(lin.weight.raw).copy())
            self.w = _Weight.quantized(qtype, self.n, self.k, raw, device)
        else:
            self.w = _Weight(self.n, self.k, None, _dequantized(lin, torch.bfloat16, device))

    @property
    def nbytes(self) -> int:
        """Device bytes of the weight (its group's, once fused)."""
        return self.w.nbytes if self.w is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group(x)[self.group.members.index(self)]
        assert self.w is not None
        lead = x.shape[:-1]
        y = finish(self.w.matmul(x.reshape(-1, self.k)), self.scale, self.bias)
        return y.view(*lead, self.n)


class GpuLinearGroup:
    """Layers applied to the same input (Q/K/V, gate/up) whose weights are stacked into one
    matrix: one product (and one quantization of the input) instead of several."""

    def __init__(self, members: Sequence[GpuLinear], w: _Weight) -> None:
        self.members = tuple(members)
        self.w = w
        self.sizes = [m.n for m in self.members]
        self.bias = None
        if any(m.bias is not None for m in self.members):
            self.bias = torch.cat(
                [m.bias if m.bias is not None else torch.zeros(m.n, device=w.device)
                 for m in self.members]
            )  # fmt: skip
        self.scale = None
        if any(m.scale is not None for m in self.members):
            self.scale = torch.cat(
                [torch.full((m.n,), 1.0 if m.scale is None else m.scale, device=w.device)
                 for m in self.members]
            )  # fmt: skip
        for m in self.members:
            m.w, m.group = None, self

    @staticmethod
    def fuse(members: Sequence[object]) -> None:
        """Fuses those of ``members`` that are :class:`GpuLinear` whose weights stack (same
        input size and type): one group per type shared by at least two of them."""
        layers = [m for m in members if isinstance(m, GpuLinear) and m.w is not None]
        by_type: dict[object, list[GpuLinear]] = {}
        for m in layers:
            by_type.setdefault(m.w.kind, []).append(m)  # type: ignore[union-attr]
        for same in by_type.values():
            if len(same) > 1:
                GpuLinearGroup(same, _Weight.concat([m.w for m in same]))  # type: ignore[misc]

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        lead = x.shape[:-1]
        y = finish(self.w.matmul(x.reshape(-1, self.members[0].k)), self.scale, self.bias)
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

    check = Embedding.check
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
