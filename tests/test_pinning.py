"""How long expert memory stays page-locked (``gpu_moe.pin_host_memory``): as long as its owner
(the slot pools) lives, then unregistered once. Runs without a GPU: the CUDA runtime's register
and unregister calls are recorded by a stand-in. Pins collected as soon as the function
returns would leave every upload on pageable memory, at a sixth of PCIe speed, while the engine
reported the memory pinned."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from freetoken.engine import gpu_moe  # noqa: E402


class _Runtime:
    def __init__(self) -> None:
        self.registered: set[int] = set()
        self.unregistered: list[int] = []

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.add(addr)
        return 0

    def cudaHostUnregister(self, addr: int) -> int:  # noqa: N802
        self.registered.discard(addr)
        self.unregistered.append(addr)
        return 0


def _layer(index: int, base: int) -> SimpleNamespace:
    """Three kinds of 4 experts of 256 bytes each, stacked from ``base``."""
    kinds = [
        SimpleNamespace(nbytes=256, ranges=[(base + k * 4096 + e * 256, 256) for e in range(4)])
        for k in range(3)
    ]
    return SimpleNamespace(index=index, kinds=kinds, layer=object())


class _Owner:
    pass


def test_pins_live_as_long_as_their_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    layers = [_layer(0, 1 << 20), _layer(1, 2 << 20)]
    owner = _Owner()
    assert gpu_moe.pin_host_memory(layers, owner)  # type: ignore[arg-type]
    starts = {m.ranges[0][0] for ex in layers for m in ex.kinds}
    gc.collect()
    assert rt.registered == starts and rt.unregistered == []
    del owner
    gc.collect()
    assert rt.registered == set() and sorted(rt.unregistered) == sorted(starts)
