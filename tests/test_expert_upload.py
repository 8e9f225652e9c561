"""Expert bytes into slot pools (``ExpertLayer.load``): stacked experts, a fused gate/up tensor
(each expert's gate rows, then its up rows, as llama.cpp's converter writes
``ffn_gate_up_exps``) and experts in scattered tensors all land in the slots as the host bytes
are, whatever path the copy takes. Runs on the CPU: the pools' device is the host's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from freetoken.engine.gpu_moe import ExpertLayer, Matrices  # noqa: E402
from freetoken.quant import type_info  # noqa: E402
from freetoken.runtime import gpu  # noqa: E402

Q8_0 = type_info("Q8_0").id
ROWS, K = 4, 64
SIZE = type_info("Q8_0").row_size(K) * ROWS  # one matrix's bytes
E = 6


class _Owner:
    """Keeps the host buffer alive beside the views over it."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.index, self.n_experts = buf, 0, E


def _layer(layout: str) -> tuple[ExpertLayer, dict[str, list[bytes]]]:
    """A layer whose gate and up experts are ``layout`` (stacked, fused, scattered, gapped),
    down always stacked after them; the expected bytes of each expert of each kind."""
    rng = np.random.default_rng(7)
    buf = rng.integers(0, 256, size=8 * E * SIZE, dtype=np.uint8)
    base = buf.ctypes.data
    if layout == "stacked":
        gate = [e * SIZE for e in range(E)]
        up = [(E + e) * SIZE for e in range(E)]
    elif layout == "fused":
        gate = [2 * e * SIZE for e in range(E)]
        up = [(2 * e + 1) * SIZE for e in range(E)]
    elif layout == "gapped":  # evenly spaced, but the pieces leave holes
        gate = [3 * e * SIZE for e in range(E)]
        up = [(3 * e + 1) * SIZE for e in range(E)]
    else:  # scattered: per-expert tensors in no order
        order = [4, 0, 9, 2, 7, 5, 11, 1, 3, 10, 6, 8]
        gate = [order[e] * SIZE for e in range(E)]
        up = [order[E + e] * SIZE for e in range(E)]
    down = [(4 * E + e) * SIZE for e in range(E)]
    kinds = [
        Matrices(Q8_0, ROWS, K, [(base + a, SIZE) for a in offsets]) for offsets in (gate, up, down)
    ]
    layer = ExpertLayer(_Owner(buf), 2, *kinds)  # type: ignore[arg-type]
    want = {
        name: [buf[a : a + SIZE].tobytes() for a in offsets]
        for name, offsets in zip(("gate", "up", "down"), (gate, up, down), strict=True)
    }
    return layer, want


@pytest.mark.parametrize("layout", ["stacked", "fused", "gapped", "scattered"])
@pytest.mark.parametrize(("first", "count", "slot"), [(0, E, 0), (1, 3, 4), (5, 1, 2)])
def test_experts_land_in_their_slots(layout: str, first: int, count: int, slot: int) -> None:
    layer, want = _layer(layout)
    pools = tuple(gpu.ExpertPool(Q8_0, K, ROWS, 8, device="cpu") for _ in range(3))
    layer.load(pools, first, count, slot)  # type: ignore[arg-type]
    for name, pool in zip(("gate", "up", "down"), pools, strict=True):
        for i in range(count):
            got = pool.slot_view(slot + i).numpy().tobytes()
            assert got == want[name][first + i], (name, first + i)
        untouched = [s for s in range(8) if not slot <= s < slot + count]
        assert all(not pool.slot_view(s).any() for s in untouched), name


def test_fused_gate_up_is_one_region() -> None:
    """Both kinds of a fused tensor come from the one range they tile; gaps or overlaps
    leave each kind to its own copy."""
    fused, _ = _layer("fused")
    lo = fused.gate.ranges[0][0]
    assert fused._tiled_region([0, 1], 0, E) == (lo, lo + 2 * E * SIZE)
    gapped, _ = _layer("gapped")
    assert gapped._tiled_region([0, 1], 0, E) is None
    scattered, _ = _layer("scattered")
    assert scattered._tiled_region([0, 1], 0, E) is None
