"""The fused kernels of libfreetoken_cuda that replace chains of small torch kernels in a step.

``gpu.norm_rope`` (per-head RMSNorm + NEOX RoPE) against a float64 torch computation of the same
formula, and, without the norm, bit for bit against torch's float32 ``x * cos + roll(x) * sin``
(the kernel keeps torch's roundings: no FMAs); inputs are slices of a fused QKV product (rows
with a stride), as the attention passes them. ``gpu.topk_softmax`` (routing) against torch's
top-k, a float64 softmax of the chosen logits and a bincount of the routes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from freetoken.engine import gpu  # noqa: E402
from freetoken.errors import InvalidInputError, ShapeError  # noqa: E402
from freetoken.models.layers import rope_cos_sin  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and gpu.available()), reason="needs a CUDA GPU"
    ),
]

EPS = 1e-6


def _inputs(t: int, heads: int, d: int, seed: int = 0):
    """q as a slice of a fused [T, (heads + 2) * d] product, its norm weight, the whole-head
    tables at positions 7.. (cos twice, -sin then sin)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(t, (heads + 2) * d, generator=g).cuda() * 3
    x = fused[:, : heads * d].view(t, heads, d)
    weight = (torch.rand(d, generator=g) + 0.5).cuda()
    pos = torch.arange(7, 7 + t, device="cuda")
    cos, sin = rope_cos_sin(pos, 1e6, d, 1.0, torch.float32)
    return x, weight, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def _reference(x, weight, cos, sin) -> torch.Tensor:
    x, cos, sin = x.double(), cos.double(), sin.double()
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


@pytest.mark.parametrize(("t", "heads", "d"), [(1, 32, 128), (5, 4, 128), (3, 8, 64), (2, 2, 96)])
def test_norm_rope_matches_float64(t: int, heads: int, d: int) -> None:
    x, weight, cos, sin = _inputs(t, heads, d)
    got = gpu.norm_rope(x, weight, cos, sin, EPS)
    assert got.shape == (t, heads, d) and got.is_contiguous()
    want = _reference(x, weight, cos, sin)
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err


@pytest.mark.parametrize("t", [1, 6])
def test_rope_alone_is_torch_bit_for_bit(t: int) -> None:
    x, _, cos, sin = _inputs(t, 4, 128, seed=t)
    got = gpu.norm_rope(x, None, cos, sin, EPS)
    assert torch.equal(got, x * cos + x.roll(64, -1) * sin)
    assert not torch.equal(got, gpu.norm_rope(x, torch.ones(128, device="cuda"), cos, sin, EPS))


def test_bad_input_raises() -> None:
    x, weight, cos, sin = _inputs(2, 4, 128)
    with pytest.raises(InvalidInputError):
        gpu.norm_rope(x.double(), weight, cos, sin, EPS)
    with pytest.raises(ShapeError):
        gpu.norm_rope(x, weight[:64], cos, sin, EPS)
    with pytest.raises(ShapeError):
        gpu.norm_rope(x, weight, cos[:1], sin[:1], EPS)
    odd = torch.zeros(2, 4, 5, device="cuda")
    table = torch.zeros(2, 1, 5, device="cuda")
    with pytest.raises(ShapeError):
        gpu.norm_rope(odd, None, table, table, EPS)


@pytest.mark.parametrize(("t", "e", "k"), [(1, 128, 8), (7, 64, 4), (3, 60, 6), (2, 8, 8)])
def test_topk_softmax_matches_torch(t: int, e: int, k: int) -> None:
    g = torch.Generator().manual_seed(e + k)
    fused = torch.randn(t, e + 5, generator=g).cuda() * 4  # logits as a strided slice
    logits = fused[:, :e]
    counts = torch.zeros(e, dtype=torch.int64, device="cuda")
    counts[0] = 3  # added to, not overwritten
    ids, w = gpu.topk_softmax(logits, k, 2.5, counts)
    vals, want_ids = logits.topk(k, dim=-1)
    assert torch.equal(ids.long(), want_ids)
    want_w = vals.double().softmax(-1) * 2.5
    assert torch.allclose(w.double(), want_w, rtol=1e-6, atol=1e-7)
    want_counts = torch.bincount(want_ids.flatten(), minlength=e)
    want_counts[0] += 3
    assert torch.equal(counts, want_counts)


def test_topk_softmax_ties_and_bad_input() -> None:
    logits = torch.zeros(2, 16, device="cuda")
    logits[1, 9] = float("nan")  # never picked ahead of a number, ids stay in range
    ids, w = gpu.topk_softmax(logits, 4)
    assert ids[0].tolist() == [0, 1, 2, 3] and torch.allclose(w[0], torch.full_like(w[0], 0.25))
    assert 9 not in ids[1].tolist()
    with pytest.raises(ShapeError):
        gpu.topk_softmax(logits, 33)
    with pytest.raises(ShapeError):
        gpu.topk_softmax(torch.zeros(1, 2048, device="cuda"), 4)
    with pytest.raises(InvalidInputError):
        gpu.topk_softmax(logits.double(), 4)
