"""The fused per-head RMSNorm + NEOX RoPE kernel (``gpu.norm_rope``, libfreetoken_cuda) against a
float64 torch computation of the same formula, and, without the norm, bit for bit against
torch's float32 ``x * cos + roll(x) * sin`` (the kernel keeps torch's roundings: no FMAs).
Inputs are slices of a fused QKV product (rows with a stride), as the attention passes them.
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
