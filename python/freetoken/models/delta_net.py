"""Gated DeltaNet linear attention (the recurrent layers of Qwen3.5 and Qwen3-Next).

Per token ``t`` and value head ``h``, with the head's key/query head ``k_t, q_t`` (L2-normed,
``q`` scaled by ``1/sqrt(d)``), value ``v_t``, decay ``g_t = softplus(alpha_t + dt) * a``
(``a = -exp(A_log)``, so ``g_t < 0``) and ``beta_t = sigmoid(b_t)``, the state
``S [d_k, d_v]`` runs the gated delta rule::

    S' = exp(g_t) S
    S  = S' + k_t (beta_t (v_t - S'^T k_t))^T
    o_t = S^T q_t

:func:`delta_rule_step` is that recurrence as written (decode, one token per step);
:func:`delta_rule_chunked` computes the same over a prompt in chunks of :data:`CHUNK` tokens:
inside a chunk the corrections ``w_t = beta_t (v_t - S'^T k_t)`` solve one unit lower
triangular system ``(I + L) W = beta V - diag(beta exp(G)) K S_0`` (``L[t, s] = beta_t
(k_t . k_s) exp(G_t - G_s)`` for ``s < t``, ``G`` the running sum of ``g`` in the chunk), so
every chunk is a few batched matrix products and one triangular solve, and only the chunks
are a loop.

Around it (:class:`DeltaNetLayer`): the fused ``attn_qkv`` projection through a causal
depthwise conv1d (its last ``conv_kernel - 1`` inputs are the rolling conv state) and SiLU,
split into q, k, v; the heads' output RMS-normed per head by ``ssm_norm``, gated by
``silu(z)`` (``z = attn_gate x``), and projected by ``ssm_out``. On the GPU a decode step runs
everything between the projections in two kernels (:func:`~freetoken.runtime.gpu.gdn_decode`);
on the CPU it runs the conv and the norms over all its sequences at once and the delta rule
in one call per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken import _core
from freetoken.errors import GGUFError
from freetoken.gguf import GGUFFile
from freetoken.models.layers import Linear, linear_group, load_vector, rms_norm
from freetoken.runtime import gpu

__all__ = [
    "CHUNK",
    "DeltaNetLayer",
    "DeltaNetShape",
    "causal_conv",
    "delta_rule_chunked",
    "delta_rule_step",
    "l2_norm",
]

#: Tokens per chunk of the chunked recurrence (llama.cpp's is 64 too).
CHUNK = 64


@dataclass(frozen=True)
class DeltaNetShape:
    """The linear attention's sizes (llama.cpp's ``ssm.*`` keys) and head layout."""

    k_heads: int
    """Query/key heads (``ssm.group_count``)."""
    v_heads: int
    """Value heads (``ssm.time_step_rank``)."""
    head_dim: int
    """Key and value head size (``ssm.state_size``)."""
    conv_kernel: int
    """The conv1d's width (``ssm.conv_kernel``)."""
    grouped: bool
    """Value heads grouped by key head (qwen3next: head ``h`` reads key head ``h // r``);
    else tiled (qwen35: key head ``h % k_heads``), as the converter orders them."""

    @property
    def channels(self) -> int:
        """The conv's channels: q, k and v."""
        return (2 * self.k_heads + self.v_heads) * self.head_dim

    @property
    def value_dim(self) -> int:
        """The width of the value heads together."""
        return self.v_heads * self.head_dim

    @classmethod
    def from_metadata(cls, meta: dict, arch: str, grouped: bool) -> DeltaNetShape:
        """Reads the ``{arch}.ssm.*`` keys; GGUFError naming the key on a bad value."""

        def key(name: str) -> int:
            full = f"{arch}.ssm.{name}"
            value = meta.get(full)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GGUFError(f"metadata `{full}` is {value!r}, expected a positive integer")
            return value

        shape = cls(
            k_heads=key("group_count"),
            v_heads=key("time_step_rank"),
            head_dim=key("state_size"),
            conv_kernel=key("conv_kernel"),
            grouped=grouped,
        )
        if shape.v_heads % shape.k_heads:
            raise GGUFError(
                f"metadata `{arch}.ssm.time_step_rank` ({shape.v_heads} value heads) is not a "
                f"multiple of `{arch}.ssm.group_count` ({shape.k_heads} key heads)"
            )
        inner = key("inner_size")
        if inner != shape.value_dim:
            raise GGUFError(
                f"metadata `{arch}.ssm.inner_size` is {inner}, expected time_step_rank * "
                f"state_size = {shape.value_dim}"
            )
        if shape.conv_kernel < 2:
            raise GGUFError(f"metadata `{arch}.ssm.conv_kernel` is {shape.conv_kernel}, need >= 2")
        return shape


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (llama.cpp's ``build_gdn_l2_norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, all_states: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal conv of ``x [T, C]`` after ``state [K-1, C]`` (the previous
    inputs) with ``weight [C, K]`` (tap ``K-1`` on the current token); returns the output
    ``[T, C]`` and the new state (the last ``K-1`` inputs; with ``all_states`` the state
    after each token, ``[T, K-1, C]``)."""
    k = weight.shape[1]
    xs = torch.cat([state, x])
    windows = xs.unfold(0, k, 1)  # [T, C, K]
    if all_states:
        return (windows * weight).sum(-1), windows[:, :, 1:].transpose(1, 2)
    return (windows * weight).sum(-1), xs[xs.shape[0] - (k - 1) :]


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token: ``q, k, v [H, T, d]`` (q already scaled), ``g, beta
    [H, T]``, ``state [H, d_k, d_v]``; returns the outputs ``[H, T, d_v]`` and the state
    (with ``all_states`` the state after each token, ``[T, H, d_k, d_v]``: the recurrence
    makes each anyway). Decode runs it with ``T = 1``."""
    s = state
    outs, states = [], []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        kt = k[:, t]
        delta = (v[:, t] - torch.einsum("hkv,hk->hv", s, kt)) * beta[:, t, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[:, t]))
        states.append(s)
    return torch.stack(outs, 1), torch.stack(states) if all_states else s


def delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """:func:`delta_rule_step` of one token on the CPU in one call (``_core.delta_rule_step``),
    ``state`` (contiguous float32 ``[H, d_k, d_v]``, see :func:`decodes_in_place`) updated in
    place: the torch ops would read and write the whole state four times into new tensors.
    Returns the outputs ``[H, 1, d_v]``."""
    out = torch.empty(v.shape[0], 1, v.shape[2])
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    _core.delta_rule_step(q, k, v, g, beta, state, out)
    return out


def decodes_in_place(state: torch.Tensor) -> bool:
    """Whether :func:`delta_rule_decode` takes ``state``."""
    return state.device.type == "cpu" and state.dtype == torch.float32 and state.is_contiguous()


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`delta_rule_step` computed per chunk (module docstring). The last
    chunk is padded with tokens of zero key, value and beta and no decay, which leave the
    state as it is."""
    h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q = q.view(h, n, chunk, dk)
    k = k.view(h, n, chunk, dk)
    v = v.view(h, n, chunk, dv)
    cum = g.view(h, n, chunk).cumsum(-1)  # G within each chunk
    beta = beta.view(h, n, chunk)
    # exp(G_t - G_s) on and below the diagonal, 0 above (never exp of a positive number).
    diff = cum[..., :, None] - cum[..., None, :]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, -math.inf)).exp()
    kb = k * beta[..., None]
    strict = (kb @ k.transpose(-1, -2)) * decay
    strict = strict.tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    # (I + L) X = [beta V | beta exp(G) K]: the values and the keys' pull on the state.
    rhs = torch.cat([v * beta[..., None], kb * cum.exp()[..., None]], -1)
    solved = torch.linalg.solve_triangular(strict + eye, rhs, upper=False, unitriangular=True)
    value, k_cum = solved.split([dv, dk], -1)
    qk = ((q @ k.transpose(-1, -2)) * decay).tril()
    q_decay = q * cum.exp()[..., None]
    last = cum[..., -1]  # [h, n]
    k_tail = k * (last[..., None] - cum).exp()[..., None]
    s = state
    outs = []
    for c in range(n):
        w = value[:, c] - k_cum[:, c] @ s
        outs.append(q_decay[:, c] @ s + qk[:, c] @ w)
        s = s * last[:, c].exp()[:, None, None] + k_tail[:, c].transpose(-1, -2) @ w
    o = torch.cat(outs, 1)[:, :t]
    return o, s


class DeltaNetLayer:
    """One Gated DeltaNet layer's weights and computation (module docstring). ``fused_ba``:
    one ``ssm_ba`` matrix holds, per key head, its value heads' beta rows and then their
    alpha rows (qwen3next); else ``ssm_beta`` and ``ssm_alpha`` (qwen35)."""

    def __init__(
        self, gguf: GGUFFile, i: int, hidden: int, shape: DeltaNetShape, fused_ba: bool
    ) -> None:
        p = f"blk.{i}."
        s = shape
        self.shape = s
        if fused_ba:
            ba = [Linear(gguf, p + "ssm_ba", (2 * s.v_heads, hidden))]
        else:
            ba = [
                Linear(gguf, p + "ssm_beta", (s.v_heads, hidden)),
                Linear(gguf, p + "ssm_alpha", (s.v_heads, hidden)),
            ]
        #: The products of the layer's input, applied as one group (one quantization of the
        #: input; on the GPU one product where their types stack): the mixed q/k/v
        #: channels, the output gate z, then ``ssm_ba`` or ``ssm_beta`` and ``ssm_alpha``.
        self.in_proj: tuple[Linear, ...] = (
            Linear(gguf, p + "attn_qkv", (s.channels, hidden)),
            Linear(gguf, p + "attn_gate", (s.value_dim, hidden)),
            *ba,
        )
        gguf.expect(p + "ssm_conv1d.weight", (s.channels, s.conv_kernel))
        self.conv = torch.from_numpy(gguf.array(p + "ssm_conv1d.weight").copy()).reshape(
            s.channels, s.conv_kernel
        )
        self.dt = load_vector(gguf, p + "ssm_dt.bias", s.v_heads)
        self.a = load_vector(gguf, p + "ssm_a", s.v_heads)
        self.norm = load_vector(gguf, p + "ssm_norm.weight", s.head_dim)
        self.out = Linear(gguf, p + "ssm_out", (hidden, s.value_dim))

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """The conv state's and the delta-rule state's shapes for one sequence."""
        s = self.shape
        return (s.conv_kernel - 1, s.channels), (s.v_heads, s.head_dim, s.head_dim)

    def _beta_alpha(self, ba: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The beta and alpha inputs ``[T, G, R]`` (views, ``G * R`` value heads; head ``h``
        at ``[:, h // R, h % R]``) from the products of ``ssm_beta``/``ssm_alpha`` (one group
        of all heads), or per key head its value heads' rows of the fused ``ssm_ba``."""
        s = self.shape
        if len(ba) == 2:
            b, a = ba
            return b.view(-1, 1, s.v_heads), a.view(-1, 1, s.v_heads)
        r = s.v_heads // s.k_heads
        fused = ba[0].view(ba[0].shape[0], s.k_heads, 2 * r)
        return fused[..., :r], fused[..., r:]

    def __call__(
        self,
        x: torch.Tensor,
        spans: list[tuple[int, torch.Tensor, torch.Tensor]],
        eps: float,
        keep_steps: list[bool] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The layer's output ``[T, hidden]`` for the rows of ``x [T, hidden]``, cut into
        sequences ``spans`` of (rows, conv state, delta-rule state); returns it with each
        sequence's new states. A sequence with ``keep_steps`` runs token by token and gets
        the states after each of its tokens (``[n, ...]`` stacks: a verify step's
        checkpoints). A decode step on the GPU (one token per sequence, no checkpoints) runs
        the fused kernels (:func:`~freetoken.runtime.gpu.gdn_decode`), which update the given
        states in place and hand them back."""
        mixed, z, *ba = linear_group(self.in_proj, x)
        b, a = self._beta_alpha(ba)
        o, states = self._gated_heads(mixed, z, b, a, spans, eps, keep_steps)
        return self.out(o.reshape(-1, self.shape.value_dim)), states

    def _gated_heads(
        self,
        mixed: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        spans: list[tuple[int, torch.Tensor, torch.Tensor]],
        eps: float,
        keep_steps: list[bool] | None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """What runs between the projections: the heads after the gated output norm
        ``[T, v_heads, head_dim]`` and each sequence's new states. A decode step (one token
        per sequence, no checkpoints) takes the GPU kernels where they fit, the batched CPU
        step where every state is decoded in place; the rest the torch ops per sequence."""
        s = self.shape
        states = [(conv, ssm) for _, conv, ssm in spans]
        weights = (self.conv, self.dt, self.a, self.norm)
        decode = all(n == 1 for n, _, _ in spans) and not any(keep_steps or ())
        if decode and gpu.gdn_decode_fits(mixed, z, b, a, weights, states):
            return gpu.gdn_decode(mixed, z, b, a, weights, states, s.grouped, eps), states
        beta = torch.sigmoid(b.reshape(-1, s.v_heads))
        g = F.softplus(a.reshape(-1, s.v_heads) + self.dt) * self.a
        if decode and all(decodes_in_place(ssm) for _, ssm in states):
            o, states = self._decode_cpu(mixed, beta, g, states, eps)
        else:
            o, states = self._recurrence(mixed, beta, g, spans, eps, keep_steps)
        return rms_norm(o, self.norm, eps) * F.silu(z.view(-1, s.v_heads, s.head_dim)), states

    def _heads(self, y: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
        """q (L2-normed and scaled), k (L2-normed) and v ``[n, v_heads, head_dim]`` from the
        conv's output ``y [n, channels]`` after SiLU, each key head's q and k repeated for
        its value heads."""
        s = self.shape
        n, d, r = y.shape[0], s.head_dim, s.v_heads // s.k_heads
        q, k, v = y.split([s.k_heads * d, s.k_heads * d, s.value_dim], -1)
        q = l2_norm(q.view(n, s.k_heads, d), eps) / math.sqrt(d)
        k = l2_norm(k.view(n, s.k_heads, d), eps)
        if r > 1:
            q, k = ((t.repeat_interleave(r, 1) if s.grouped else t.repeat(1, r, 1)) for t in (q, k))
        return q, k, v.view(n, s.v_heads, d)

    def _decode_cpu(
        self,
        mixed: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor,
        states: list[tuple[torch.Tensor, torch.Tensor]],
        eps: float,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A decode step on the CPU, one token of each sequence (row ``j`` of ``mixed``,
        ``beta``, ``g`` is sequence ``j``'s): the conv, SiLU and the norms over all rows at
        once, then the delta rule one call per sequence, its state updated in place (a solo
        step runs the same ops on one row). Returns the heads ``[n, v_heads, head_dim]`` and
        each sequence's new states."""
        xs = torch.cat([torch.stack([c for c, _ in states]), mixed[:, None]], 1)  # [n, K, C]
        q, k, v = self._heads(F.silu((xs * self.conv.T).sum(1)), eps)
        outs = [
            delta_rule_decode(
                q[j, :, None], k[j, :, None], v[j, :, None], g[j, :, None], beta[j, :, None], ssm
            )
            for j, (_, ssm) in enumerate(states)
        ]
        new = [(xs[j, 1:], ssm) for j, (_, ssm) in enumerate(states)]
        return torch.cat(outs, 1).transpose(0, 1), new

    def _recurrence(
        self,
        mixed: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor,
        spans: list[tuple[int, torch.Tensor, torch.Tensor]],
        eps: float,
        keep_steps: list[bool] | None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`__call__` between the projections and the output norm in torch ops, per
        sequence: the heads ``[T, v_heads, head_dim]`` and each sequence's new states."""
        outs, states, row = [], [], 0
        for j, (n, conv_state, ssm_state) in enumerate(spans):
            keep = bool(keep_steps and keep_steps[j])
            rows = slice(row, row + n)
            y, conv_state = causal_conv(mixed[rows], conv_state, self.conv, keep)
            q, k, v = self._heads(F.silu(y), eps)
            args = (
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                g[rows].T,
                beta[rows].T,
                ssm_state,
            )
            if n == 1 and not keep and decodes_in_place(ssm_state):
                o = delta_rule_decode(*args)
            elif n == 1 or keep:
                o, ssm_state = delta_rule_step(*args, all_states=keep)
            else:
                o, ssm_state = delta_rule_chunked(*args)
            outs.append(o.transpose(0, 1))
            states.append((conv_state, ssm_state))
            row += n
        return (outs[0] if len(outs) == 1 else torch.cat(outs)), states
