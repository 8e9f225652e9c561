"""Random Gated DeltaNet decode steps and their reference: the torch path of
:class:`~freetoken.models.delta_net.DeltaNetLayer` (``_gated_heads``, one token per sequence)
in float64. Shared by the fused kernel's tests (emulated on the CPU, and on the GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from freetoken.models.delta_net import DeltaNetLayer, DeltaNetShape

EPS = 1e-6


@dataclass(frozen=True)
class Case:
    """A layer's shape, how many sequences decode together, and the b/a layout: ``fused_ba``
    per key head its value heads' beta then alpha rows (qwen3next), else two tensors."""

    n_seqs: int
    k_heads: int
    v_heads: int
    head_dim: int
    conv_kernel: int
    grouped: bool
    fused_ba: bool

    @property
    def shape(self) -> DeltaNetShape:
        return DeltaNetShape(
            self.k_heads, self.v_heads, self.head_dim, self.conv_kernel, self.grouped
        )


@dataclass
class Layer:
    """A case's weights ``(conv, dt_bias, ssm_a, norm)`` and per sequence its states."""

    case: Case
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    states: list[tuple[torch.Tensor, torch.Tensor]]

    def to(self, dtype: torch.dtype, device: str = "cpu") -> Layer:
        """A copy in ``dtype`` on ``device`` (the states cloned: the kernels update them)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype=dtype, device=device).clone()

        conv, dt, ssm_a, norm = (move(t) for t in self.weights)
        states = [(move(c), move(s)) for c, s in self.states]
        return Layer(self.case, (conv, dt, ssm_a, norm), states)


def make_layer(case: Case, gen: torch.Generator) -> Layer:
    """Random weights, with one head's ``alpha + dt`` above softplus's threshold (20), and
    different random states per sequence."""
    s = case.shape
    h, d = s.v_heads, s.head_dim
    conv = torch.randn(s.channels, s.conv_kernel, generator=gen, dtype=torch.float64) * 0.5
    dt = torch.randn(h, generator=gen, dtype=torch.float64)
    dt[0] = 30.0
    ssm_a = -torch.exp(torch.randn(h, generator=gen, dtype=torch.float64) * 0.5)
    norm = 1.0 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)
    states = [
        (
            torch.randn(s.conv_kernel - 1, s.channels, generator=gen, dtype=torch.float64),
            0.1 * torch.randn(h, d, d, generator=gen, dtype=torch.float64),
        )
        for _ in range(case.n_seqs)
    ]
    return Layer(case, (conv, dt, ssm_a, norm), states)


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_inputs(case: Case, gen: torch.Generator, device: str = "cpu") -> tuple[Inputs, Inputs]:
    """One token per sequence: the projections ``mixed [S, C]``, ``z [S, H * D]`` and the
    beta/alpha views ``[S, G, R]`` as ``DeltaNetLayer._beta_alpha`` makes them, in float64
    on the CPU and in float32 on ``device`` (the same values, the same layout)."""
    s, n = case.shape, case.n_seqs
    mixed = torch.randn(n, s.channels, generator=gen, dtype=torch.float64)
    z = torch.randn(n, s.value_dim, generator=gen, dtype=torch.float64)
    r = s.v_heads // s.k_heads
    if case.fused_ba:
        ba = torch.randn(n, s.k_heads, 2 * r, generator=gen, dtype=torch.float64)
    else:
        ba = torch.randn(2, n, 1, s.v_heads, generator=gen, dtype=torch.float64)

    def views(dtype: torch.dtype, dev: str) -> Inputs:
        m, zz, both = (t.to(dtype=dtype, device=dev) for t in (mixed, z, ba))
        if case.fused_ba:
            return m, zz, both[..., :r], both[..., r:]
        return m, zz, both[0], both[1]

    return views(torch.float64, "cpu"), views(torch.float32, device)


def reference_step(
    layer: Layer, inputs: Inputs
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The torch path's step on ``layer`` (float64): the gated heads ``[S, H, D]`` and the
    new states (also stored in ``layer``)."""
    torch_layer = DeltaNetLayer.__new__(DeltaNetLayer)
    torch_layer.shape = layer.case.shape
    torch_layer.conv, torch_layer.dt, torch_layer.a, torch_layer.norm = layer.weights
    spans = [(1, c, s) for c, s in layer.states]
    mixed, z, b, a = inputs
    o, states = torch_layer._gated_heads(mixed, z, b, a, spans, EPS, None)
    layer.states = states
    return o, states
