"""The fused Gated DeltaNet decode kernels (``cuda/src/gdn_decode.cuh``) compiled by g++
through a CPU emulation of the CUDA constructs they use (``tests/cuda_cpu/cuda_emulation.h``:
a thread per CUDA thread, barriers, warp shuffles) against the torch path in float64:
several steps with the states carried, several sequences with different states, value heads
tiled or grouped over fewer key heads, beta/alpha as two tensors or the fused per-key-head
layout, heads of 128 and of 48 (a partial column tile) and a conv of 4 and of 3 taps."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from emulation import build_emulator  # noqa: E402
from gdn_cases import Case, Inputs, Layer, make_inputs, make_layer, reference_step  # noqa: E402

N_STEPS = 3
CASES = {
    "tiled": Case(2, 2, 4, 128, 4, grouped=False, fused_ba=False),
    "grouped": Case(3, 2, 6, 48, 3, grouped=True, fused_ba=True),
}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator("gdn_emulate.cpp", tmp_path_factory)


def _run(lib: ctypes.CDLL, layer: Layer, inputs: Inputs) -> torch.Tensor:
    """One emulated step on ``layer`` (float32, states updated in place): the heads."""
    c = layer.case
    mixed, z, b, a = inputs
    n = c.n_seqs
    out = torch.empty(n, c.v_heads, c.head_dim)
    sizes = (ctypes.c_int64 * 7)(
        n, c.k_heads, c.v_heads, c.head_dim, c.conv_kernel, c.grouped, b.shape[2]
    )
    strides = (ctypes.c_int64 * 4)(mixed.stride(0), z.stride(0), b.stride(0), b.stride(1))
    ptrs = (ctypes.c_void_p * 8)(*(t.data_ptr() for t in (mixed, z, b, a, *layer.weights)))
    convs = (ctypes.c_void_p * n)(*(cs.data_ptr() for cs, _ in layer.states))
    ssms = (ctypes.c_void_p * n)(*(ss.data_ptr() for _, ss in layer.states))
    lib.gdn_emulate(
        sizes, strides, ctypes.c_float(1e-6), ptrs, convs, ssms, ctypes.c_void_p(out.data_ptr())
    )
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernels_match_the_torch_path(name: str, emulator: ctypes.CDLL) -> None:
    case = CASES[name]
    gen = torch.Generator().manual_seed(7)
    ref = make_layer(case, gen)
    ours = ref.to(torch.float32)
    for step in range(N_STEPS):
        ref_in, our_in = make_inputs(case, gen)
        want, _ = reference_step(ref, ref_in)
        got = _run(emulator, ours, our_in)
        what = f"{name} step {step}"
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=what)
        for (c, s), (rc, rs) in zip(ours.states, ref.states, strict=True):
            # The shifted inputs themselves: exact (the float32 copies of the same values).
            torch.testing.assert_close(c, rc.float(), rtol=0, atol=0, msg=f"{what} conv")
            torch.testing.assert_close(s.double(), rs, rtol=1e-4, atol=1e-5, msg=f"{what} ssm")
