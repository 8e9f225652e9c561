"""Decode attention for the tests of ``attn_decode.cuh`` (its CPU emulation and the GPU
kernel): a float64 reference with the causal and window masks and the sinks written out, the
cases both run, and their inputs as the KV cache hands them out (strided views of larger
buffers, values in rows of positions or transposed)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["CASES", "AttnCase", "attn_inputs", "attn_reference", "min_chunk"]


def min_chunk(d: int, dv: int) -> int:
    """Keys of a chunk while there are few keys: the chunk reads at least 64 KiB of keys and
    values (``ATTN_MIN_CHUNK_BYTES``), in whole score passes of 32 keys, at most 512."""
    keys = -(-65536 // ((d + dv) * 4))
    return min(512, -(-keys // 32) * 32)


class AttnCase(NamedTuple):
    heads: int
    kv: int
    d: int
    dv: int
    n_keys: int
    pos: int
    window: int
    sinks: bool


#: Query heads per kv head 1, 2, 8 and more than 8 (blocks of 6 + 6 and of 5 + 4); head sizes
#: 64..512 and rows not in float4s; one key, a chunk's length and one either side of it, many
#: chunks, keys past the query (a captured step), windows, sinks, and no visible key.
CASES = [
    AttnCase(8, 8, 64, 64, 1, 0, 0, False),
    AttnCase(8, 4, 128, 128, min_chunk(128, 128) - 1, min_chunk(128, 128) - 2, 0, False),
    AttnCase(8, 4, 128, 128, min_chunk(128, 128), min_chunk(128, 128) - 1, 0, True),
    AttnCase(8, 4, 128, 128, min_chunk(128, 128) + 1, min_chunk(128, 128), 0, False),
    AttnCase(16, 2, 256, 256, min_chunk(256, 256) + 1, 20, 0, False),  # an empty last chunk
    AttnCase(8, 1, 512, 512, 3 * min_chunk(512, 512) - 1, 90, 0, True),
    AttnCase(12, 1, 64, 64, 3000, 2999, 0, False),
    AttnCase(9, 1, 128, 128, 700, 600, 100, True),
    AttnCase(4, 2, 66, 42, 37, 30, 0, False),  # rows not in float4s; a value tail of 2 dims
    AttnCase(4, 2, 64, 64, 500, 450, 64, False),  # most chunks outside the window
    AttnCase(8, 2, 64, 512, 100, 99, 0, False),  # two value dimensions per thread
    AttnCase(4, 4, 32, 16, 300, 299, 0, True),  # value dimensions over 8 slices of keys
    AttnCase(4, 2, 64, 64, 200, 400, 50, False),  # the window past every key: zeros
    AttnCase(4, 2, 64, 64, 200, 400, 50, True),  # and with sinks: still zeros
]


def attn_inputs(
    case: AttnCase, v_transposed: bool, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``q [H, D]``, keys ``[L, Hkv, D]`` and values ``[L, Hkv, Dv]`` as views of larger
    buffers (rows wider than the heads read, more positions than read; transposed values as
    ``KVCache(v_transposed=True)`` keeps them: ``[Hkv, Dv, n_ctx]`` permuted, ``n_ctx`` a
    multiple of 4 unless the heads are not in float4s), and the sinks."""
    h, kv, d, dv, n = case.heads, case.kv, case.d, case.dv, case.n_keys
    g = torch.Generator().manual_seed(h * 1000 + n + d)
    q = torch.randn(h, d, generator=g).to(device)
    k = torch.randn(n + 5, 2 * kv, d, generator=g).to(device)[:n, :kv]
    if v_transposed:
        n_ctx = n + 5 if d % 4 else (n + 8) // 4 * 4
        v = torch.randn(kv + 1, dv, n_ctx, generator=g).to(device)[:kv, :, :n].permute(2, 0, 1)
    else:
        v = torch.randn(n + 5, kv + 1, dv, generator=g).to(device)[:n, :kv]
    sinks = torch.randn(h, generator=g).to(device) if case.sinks else None
    return q, k, v, sinks


def attn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Float64 attention of one query per head over keys 0..L-1 (position = row), ``[1, H *
    Dv]``; rows with no visible key (and no sink) are zeros."""
    h, n_kv = q.shape[0], k.shape[1]
    j = torch.arange(k.shape[0], device=q.device)
    seen = (j <= pos) & ((pos - j < window) if window else torch.ones_like(j, dtype=torch.bool))
    kk = k.double().repeat_interleave(h // n_kv, 1)  # [L, H, D]
    vv = v.double().repeat_interleave(h // n_kv, 1)
    s = torch.einsum("hd,lhd->hl", q.double(), kk) * scale
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None]], -1)
    p = s.softmax(-1)[:, : k.shape[0]].nan_to_num(0.0)  # all -inf: zeros, as the kernel
    return torch.einsum("hl,lhd->hd", p, vv).reshape(1, -1)
