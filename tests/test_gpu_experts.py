"""GPU expert kernels (ggml-cuda MMVQ/MMQ through libfreetoken_cuda) against float64 products.

The reference is the float64 product of the dequantized weights (our CPU ggml dequantizes), so
only the GPU's own error counts: the q8_1 quantization of the activations, well under the 2e-2
bound. Tests marked ``gpu`` skip without torch CUDA or the library (``scripts/device.sh test``
runs them on the GPU machine); the pool-size test runs everywhere.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from freetoken import quant  # noqa: E402
from freetoken.errors import InvalidInputError, ShapeError, UnsupportedError  # noqa: E402
from freetoken.runtime import gpu  # noqa: E402

#: Every type with an MMVQ kernel in the pinned ggml-cuda (MMQ: all but IQ1_M).
KERNEL_TYPES = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "MXFP4", "NVFP4", "Q1_0", "Q2_0",
]  # fmt: skip
TOKENS = [1, 8, 9, 33, 64]
MMVQ_ONLY = {"IQ1_M"}
TOL = 2e-2

# K = 768 is three 256-blocks and leaves 256 elements to the next 512: the zeroed-tail path.
K, N, SLOTS, USED = 768, 128, 6, 4


@functools.cache
def _weights(qtype: str, k: int, n: int, slots: int, seed: int = 0):
    """(raw bytes per slot, dequantized float64 (slots, n, k))."""
    rng = np.random.default_rng(seed)
    raws, deq = [], []
    imatrix = np.ones(k, dtype=np.float32)
    for _ in range(slots):
        w = rng.standard_normal((n, k)).astype(np.float32)
        raw = quant.quantize(w, qtype, imatrix)
        raws.append(raw)
        deq.append(quant.dequantize(raw, qtype, (n, k)).astype(np.float64))
    return raws, np.stack(deq)


def _pool(qtype: str, k: int = K, n: int = N, slots: int = SLOTS, seed: int = 0):
    raws, deq = _weights(qtype, k, n, slots, seed)
    pool = gpu.ExpertPool(qtype, k, n, slots)
    for s, raw in enumerate(raws):
        pool.set_slot(s, raw)
    return pool, deq


def _ids(t: int, used: int = USED, slots: int = SLOTS, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(t, slots, generator=g), dim=1)[:, :used]
    return ids.to(torch.int32).cuda()


def _x(*shape: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).cuda()


def _ref_matmul(deq: np.ndarray, x: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    x64 = x.cpu().double().numpy()
    ids_np = ids.cpu().numpy()
    t, used = ids_np.shape
    out = np.empty((t, used, deq.shape[1]))
    for i in range(t):
        for j in range(used):
            xr = x64[i, j] if x64.ndim == 3 else x64[i]
            out[i, j] = deq[ids_np[i, j]] @ xr
    return out


def _rel_err(got: torch.Tensor, ref: np.ndarray) -> float:
    g = got.cpu().double().numpy()
    assert np.isfinite(g).all(), "non-finite output"
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


def test_pool_nbytes_without_a_gpu():
    row = K // 32 * 18
    assert gpu.pool_nbytes("Q4_0", K, N, SLOTS) == row * N * SLOTS + 256 // 32 * 18
    with pytest.raises(ShapeError, match="2"):
        gpu.pool_nbytes("Q4_0", 4096, 4096, 4096)
    st = gpu.status()
    assert st.available == (st.n_devices > 0)
    if not st.available:
        assert st.detail


@pytest.mark.gpu
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_expert_matmul_matches_float64(qtype: str, t: int):
    pool, deq = _pool(qtype)
    x, ids = _x(t, K), _ids(t)
    if qtype in MMVQ_ONLY and t > 8:
        assert gpu.kernel_for(qtype, t) is None
        with pytest.raises(UnsupportedError, match="no MMVQ/MMQ kernel"):
            gpu.expert_matmul(pool, x, ids)
        return
    assert gpu.kernel_for(qtype, t) == ("mmvq" if t <= 8 else "mmq")
    out = torch.full((t, USED, N), float("nan"), device="cuda")  # every element must be written
    gpu.expert_matmul(pool, x, ids, out=out)
    torch.cuda.synchronize()
    err = _rel_err(out, _ref_matmul(deq, x, ids))
    assert err <= TOL, f"{qtype} T={t}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 33])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_activation_rows_per_slot(qtype: str, t: int):
    # x of shape (T, n_used, K): each slot sees its own row (the down projection's layout).
    pool, deq = _pool(qtype)
    x, ids = _x(t, USED, K), _ids(t)
    out = gpu.expert_matmul(pool, x, ids)
    torch.cuda.synchronize()
    assert _rel_err(out, _ref_matmul(deq, x, ids)) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 9, 64])
def test_the_same_experts_for_every_token(t: int):
    # Duplicate expert ids across tokens: every token routes to the same slots.
    pool, deq = _pool("Q4_K")
    x = _x(t, K)
    ids = torch.tensor([[3, 0, 5, 1]] * t, dtype=torch.int32, device="cuda")
    out = gpu.expert_matmul(pool, x, ids)
    torch.cuda.synchronize()
    assert _rel_err(out, _ref_matmul(deq, x, ids)) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
def test_rows_not_a_multiple_of_the_mmq_tile(qtype: str):
    # N = 96: MMQ's bounds-checked ("fallback") tiles.
    pool, deq = _pool(qtype, n=96)
    x, ids = _x(33, K), _ids(33)
    out = gpu.expert_matmul(pool, x, ids)
    torch.cuda.synchronize()
    assert _rel_err(out, _ref_matmul(deq, x, ids)) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 33])
def test_a_token_naming_a_slot_twice_is_rejected(t: int):
    pool, _ = _pool("Q4_0")
    ids = _ids(t)
    ids[t // 2, 2] = ids[t // 2, 0]
    with pytest.raises(InvalidInputError, match="twice"):
        gpu.expert_matmul(pool, _x(t, K), ids)


@pytest.mark.gpu
def test_a_slot_outside_the_pool_is_rejected():
    pool, _ = _pool("Q4_0")
    ids = _ids(9)
    ids[4, 1] = SLOTS
    with pytest.raises(InvalidInputError, match="outside"):
        gpu.expert_matmul(pool, _x(9, K), ids)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["F16", "BF16", "F32", "TQ1_0", "TQ2_0"])
def test_a_type_without_a_kernel_is_unsupported(qtype: str):
    assert gpu.kernel_for(qtype, 1) is None
    pool = gpu.ExpertPool(qtype, K, N, SLOTS)
    with pytest.raises(UnsupportedError, match="no MMVQ/MMQ kernel"):
        gpu.expert_matmul(pool, _x(1, K), _ids(1))


@pytest.mark.gpu
def test_bad_arguments_are_refused_before_launch():
    pool, _ = _pool("Q4_0")
    with pytest.raises(ShapeError):
        gpu.expert_matmul(pool, _x(4, K + 32), _ids(4))
    with pytest.raises(InvalidInputError, match="int32"):
        gpu.expert_matmul(pool, _x(4, K), _ids(4).long())
    with pytest.raises(InvalidInputError):
        gpu.expert_matmul(pool, _x(4, K).cpu(), _ids(4))
    small = gpu.ExpertPool("Q4_0", K, N, SLOTS)
    small.tensor = small.tensor[:-1]  # the zeroed tail is part of the contract
    with pytest.raises(ShapeError, match="zeroed tail"):
        gpu.expert_matmul(small, _x(4, K), _ids(4))


@pytest.mark.gpu
def test_a_side_stream_gives_the_same_result():
    pool, _ = _pool("Q5_K")
    x, ids = _x(33, K), _ids(33)
    ref = gpu.expert_matmul(pool, x, ids)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = gpu.expert_matmul(pool, x, ids, check_ids=False)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(got, ref)


# One MoE layer in one call. Two quantized products in series (the activations are quantized
# to q8_1 twice), so the layer's bound is looser than one product's.
LAYER_TOL = 3e-2
HIDDEN, FFN, LSLOTS, LUSED = 768, 512, 12, 4


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _gelu(v):
    return 0.5 * v * (1.0 + np.tanh(0.7978845608028654 * v * (1.0 + 0.044715 * v * v)))


def _ref_layer(gd, ud, dd, x, ids, w, act):
    f = _silu if act == "silu" else _gelu
    x64 = x.cpu().double().numpy()
    ids_np, w_np = ids.cpu().numpy(), w.cpu().double().numpy()
    out = np.zeros((x64.shape[0], HIDDEN))
    for i in range(x64.shape[0]):
        for j in range(ids_np.shape[1]):
            s = ids_np[i, j]
            h = f(gd[s] @ x64[i]) * (ud[s] @ x64[i])
            out[i] += w_np[i, j] * (dd[s] @ h)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 8, 9, 64])
@pytest.mark.parametrize(
    ("types", "act"),
    [(("Q4_0", "Q4_0", "Q4_0"), "silu"), (("Q4_K", "Q4_K", "Q6_K"), "gelu"),
     (("Q8_0", "Q5_K", "IQ4_XS"), "silu")],
)  # fmt: skip
def test_moe_layer_matches_float64(types, act, t: int):
    gt, ut, dt = types
    gate, gd = _pool(gt, HIDDEN, FFN, LSLOTS, seed=10)
    up, ud = _pool(ut, HIDDEN, FFN, LSLOTS, seed=11)
    down, dd = _pool(dt, FFN, HIDDEN, LSLOTS, seed=12)
    x = _x(t, HIDDEN) * 0.5
    ids = _ids(t, LUSED, LSLOTS)
    w = torch.softmax(_x(t, LUSED, seed=3), dim=-1)
    base = _x(t, HIDDEN, seed=4)
    out = base.clone()
    gpu.moe_layer(gate, up, down, x, ids, w, act=act, out=out, accumulate=True)
    torch.cuda.synchronize()
    ref = _ref_layer(gd, ud, dd, x, ids, w, act)
    err = _rel_err(out - base, ref)
    assert err <= LAYER_TOL, f"{types} {act} T={t}: relative error {err:.3g}"


@pytest.mark.gpu
def test_moe_layer_replays_in_a_cuda_graph():
    # The decode step is meant to be captured: no synchronization inside (check_ids=False),
    # and ggml's scratch pool gives the same addresses on every call of the same shape.
    gate, _ = _pool("Q4_0", HIDDEN, FFN, LSLOTS, seed=10)
    up, _ = _pool("Q4_0", HIDDEN, FFN, LSLOTS, seed=11)
    down, _ = _pool("Q4_0", FFN, HIDDEN, LSLOTS, seed=12)
    x = _x(1, HIDDEN)
    ids = _ids(1, LUSED, LSLOTS)
    w = torch.softmax(_x(1, LUSED, seed=3), dim=-1)
    out = torch.empty(1, HIDDEN, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up on the capture stream: kernel setup, pool growth
            gpu.moe_layer(gate, up, down, x, ids, w, out=out, check_ids=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        gpu.moe_layer(gate, up, down, x, ids, w, out=out, check_ids=False)
    x.copy_(_x(1, HIDDEN, seed=7))
    g.replay()
    torch.cuda.synchronize()
    got = out.clone()
    ref = gpu.moe_layer(gate, up, down, x, ids, w)
    torch.cuda.synchronize()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
