"""The fused kernels of libfreetoken_cuda that replace chains of small torch kernels in a step.

``gpu.norm_rope`` (per-head RMSNorm + NEOX RoPE) against a float64 torch computation of the same
formula, and, without the norm, bit for bit against torch's float32 ``x * cos + roll(x) * sin``
(the kernel keeps torch's roundings: no FMAs); inputs are slices of a fused QKV product (rows
with a stride), as the attention passes them. ``gpu.topk_softmax`` (routing) against torch's
top-k, a float64 softmax of the chosen logits and a bincount of the routes.
``gpu.attn_decode`` (one query over the cached keys, split into chunks and merged) against a
float64 softmax attention with the causal and window masks and sinks written out
(``tests/attn_reference.py``, the cases of the CPU emulation and larger ones); the cache a
strided view of a larger one, as the KV cache hands it out, values in rows of positions or
transposed; inside a CUDA graph replayed at moving positions.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attn_reference import CASES, AttnCase, attn_inputs, attn_reference  # noqa: E402
from freetoken.errors import InvalidInputError, ShapeError  # noqa: E402
from freetoken.models.layers import rope_cos_sin  # noqa: E402
from freetoken.runtime import gpu  # noqa: E402

pytestmark = pytest.mark.gpu

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


#: The emulation's cases (``tests/attn_reference.py``) plus what only the GPU runs in reasonable
#: time: the benchmark model's shape, more keys than fit shared memory, and the most keys.
GPU_CASES = [
    *CASES,
    AttnCase(32, 4, 128, 128, 64, 63, 0, False),
    AttnCase(16, 2, 256, 256, 20000, 19990, 0, True),
    AttnCase(16, 8, 128, 128, 9000, 8999, 1024, False),
    AttnCase(4, 2, 256, 256, gpu.ATTN_MAX_KEYS, gpu.ATTN_MAX_KEYS - 1, 0, True),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("pos_on_gpu", [False, True])
@pytest.mark.parametrize("v_transposed", [False, True])
def test_attn_decode_matches_float64(case: AttnCase, pos_on_gpu: bool, v_transposed: bool) -> None:
    q, k, v, sinks = attn_inputs(case, v_transposed, "cuda")
    scale = case.d**-0.5
    pos = case.pos
    where = torch.tensor([pos], dtype=torch.int64, device="cuda") if pos_on_gpu else pos
    assert gpu.attn_decode_fits(q, k, v, sinks)
    got = gpu.attn_decode(q, k, v, where, scale, case.window, sinks)
    want = attn_reference(q, k, v, pos, scale, case.window, sinks)
    assert got.shape == (1, case.heads * case.dv)
    err = (got.double() - want).abs().max().item()
    assert err <= 2e-5 * max(want.abs().max().item(), 1.0), err


def test_attn_decode_replays_in_a_graph_as_the_position_moves() -> None:
    """A captured call (position on the GPU, several chunks and their merge) replayed at other
    positions, as a captured decode step is: each replay equals the float64 reference there."""
    case = AttnCase(16, 2, 256, 256, 1000, 0, 300, True)
    q, k, v, sinks = attn_inputs(case, True, "cuda")
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm-up first, as GraphDecoder runs
        gpu.attn_decode(q, k, v, pos, 0.0625, case.window, sinks)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = gpu.attn_decode(q, k, v, pos, 0.0625, case.window, sinks)
    torch.cuda.current_stream().wait_stream(stream)
    for p in (0, 31, 32, 299, 300, 640, 999):
        pos.fill_(p)
        graph.replay()
        want = attn_reference(q, k, v, p, 0.0625, case.window, sinks)
        err = (out.double() - want).abs().max().item()
        assert err <= 2e-5 * max(want.abs().max().item(), 1.0), (p, err)


def test_attn_decode_checks_its_workspace() -> None:
    """Sizes split into chunks need the workspace ``cuda_attn_decode_work`` reports: the
    library refuses a call without one instead of writing anywhere."""
    from freetoken import _core

    q, k, v, _ = attn_inputs(AttnCase(8, 2, 128, 128, 4000, 3999, 0, False), False, "cuda")
    out = torch.empty(8 * 128, device="cuda")
    assert _core.cuda_attn_decode_work(0, (8, 2, 128, 128, 4000)) > 0
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), 0, 0, out.data_ptr())
    sizes = (8, 2, 128, 128, 4000, k.stride(0), v.stride(0), v.stride(2))
    with pytest.raises(ShapeError, match="workspace"):
        _core.cuda_attn_decode(0, 0, sizes, (0, 3999), 1.0, ptrs, (0, 0))


def test_attn_decode_refuses_what_it_cannot_take() -> None:
    q = torch.randn(8, 64, device="cuda")
    k = torch.randn(10, 2, 64, device="cuda")
    assert not gpu.attn_decode_fits(q, k.half(), k.half(), None)
    assert not gpu.attn_decode_fits(q[:, :32], k, k, None)  # q not contiguous
    wide = torch.randn(10, 2, 128, device="cuda")[:, :, :64]
    assert not gpu.attn_decode_fits(q, k, wide, None)  # a gap between the value heads
    assert not gpu.attn_decode_fits(q, k.transpose(1, 2).contiguous().transpose(1, 2), k, None)
    k4 = torch.randn(10, 4, 64, device="cuda")
    assert not gpu.attn_decode_fits(torch.randn(6, 64, device="cuda"), k4, k4, None)  # 6 % 4
    too_many = torch.randn(gpu.ATTN_MAX_KEYS + 1, 2, 64, device="cuda")
    assert not gpu.attn_decode_fits(q, too_many, too_many, None)
    with pytest.raises(ShapeError):
        gpu.attn_decode(q, too_many, too_many, 0, 1.0)
    with pytest.raises(InvalidInputError):
        gpu.attn_decode(q, k, k, torch.tensor([1, 2], device="cuda"), 1.0)
    with pytest.raises(InvalidInputError):
        gpu.attn_decode(q, k, k, -1, 1.0)


@pytest.mark.parametrize("captured", [False, True])
def test_attn_decode_takes_the_gpu_kv_cache(captured: bool) -> None:
    """The GPU's KV cache (values transposed) hands a decode step views the kernel takes, for
    an eager step (int position) and a captured one (positions on the GPU, fixed key count),
    and the kernel over them equals the float64 reference."""
    from freetoken.runtime.kv_cache import KVCache

    cache = KVCache(2, 32, 2, 64, 48, device="cuda", v_transposed=True)
    g = torch.Generator().manual_seed(5)
    prompt_k, prompt_v = torch.randn(9, 2, 64, generator=g), torch.randn(9, 2, 48, generator=g)
    cache.store(1, 0, prompt_k.cuda(), prompt_v.cuda())
    k_new, v_new = torch.randn(1, 2, 64, generator=g).cuda(), torch.randn(1, 2, 48).cuda()
    start = torch.tensor([9], device="cuda") if captured else 9
    k_all, v_all = cache.store(1, start, k_new, v_new, 16 if captured else None)
    q = torch.randn(8, 64, generator=g).cuda()
    assert gpu.attn_decode_fits(q, k_all, v_all, None)
    got = gpu.attn_decode(q, k_all, v_all, start, 0.125)
    want = attn_reference(q, k_all, v_all, 9, 0.125, 0, None)
    assert (got.double() - want).abs().max().item() <= 2e-5 * max(want.abs().max().item(), 1.0)
