"""How long expert memory stays page-locked (``gpu_moe.pin_host_memory``): as long as its owner
(the slot pools) lives, then unregistered once. Runs without a GPU: the CUDA runtime's register
and unregister calls are recorded by a stand-in. Pins collected as soon as the function
returns would leave every upload on pageable memory, at a sixth of PCIe speed, while the engine
reported the memory pinned. Also what is registered: each stacked kind's range, kinds that
tile one range (a fused gate/up tensor) as one, per-expert tensors not at all; and which
layers the device's fetch can read (every kind evenly spaced inside a registration)."""

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


def _expert_layer(index: int, ranges: list[list[tuple[int, int]]]) -> gpu_moe.ExpertLayer:
    """A layer of 4 experts whose kinds lie at ``ranges`` (one (address, bytes) per expert)."""
    gate, up, down = (gpu_moe.Matrices(0, 1, 1, r) for r in ranges)
    return gpu_moe.ExpertLayer(SimpleNamespace(index=index, n_experts=4), 2, gate, up, down)  # type: ignore[arg-type]


def _layer(index: int, base: int) -> gpu_moe.ExpertLayer:
    """Three kinds of 4 experts of 256 bytes each, stacked from ``base``."""
    return _expert_layer(
        index, [[(base + k * 4096 + e * 256, 256) for e in range(4)] for k in range(3)]
    )


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


def test_what_is_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    base = 1 << 20
    # Gate and up tiled per expert (each expert's 256 gate bytes, then its 256 up bytes),
    # down stacked after them.
    fused = _expert_layer(
        0,
        [
            [(base + e * 512, 256) for e in range(4)],
            [(base + e * 512 + 256, 256) for e in range(4)],
            [(base + 2048 + e * 128, 128) for e in range(4)],
        ],
    )
    assert fused.host_spans() == [(base, base + 2048), (base + 2048, base + 2560)]
    assert fused.fetch_sources() == [(base, 512), (base + 256, 512), (base + 2048, 128)]
    # Per-expert down tensors at uneven distances: not registered, not fetchable.
    loose = _expert_layer(
        1,
        [
            [(2 * base + e * 256, 256) for e in range(4)],
            [(2 * base + 1024 + e * 256, 256) for e in range(4)],
            [(3 * base + e * e * 4096, 128) for e in range(4)],
        ],
    )
    assert loose.host_spans() == [(2 * base, 2 * base + 1024), (2 * base + 1024, 2 * base + 2048)]
    assert loose.fetch_sources() is None
    pins = gpu_moe.PinnedExperts()
    assert pins.pin(fused) and pins.pin(loose)
    assert rt.registered == {base, base + 2048, 2 * base, 2 * base + 1024}
    assert pins.holds(fused) and not pins.holds(loose)
    assert not gpu_moe.PinnedExperts().holds(fused)  # nothing registered there
