"""A float64 reference forward of the MoE families (qwen3moe, qwen2moe, Mixtral in the llama
architecture, stacked or per-expert, and olmoe), written from llama.cpp's graphs
(``src/models/<arch>.cpp``, ``build_moe_ffn``) and independent of FreeToken's model code: the
weights are read and dequantized with gguf-py (``GGUFReader``, ``gguf.quants.dequantize``)
and every product runs in float64 torch, so it shows what the quantized weights compute
without activation rounding."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

__all__ = ["MoeReference"]

#: Per architecture: NEOX RoPE, per-head q/k norm, full-width q/k norm, renormalized top-k,
#: qwen2moe's gated shared expert.
_ARCHS = {
    "qwen3moe": dict(neox=True, head_norm=True, full_norm=False, renorm=True, shexp=False),
    "qwen2moe": dict(neox=True, head_norm=False, full_norm=False, renorm=False, shexp=True),
    "llama": dict(neox=False, head_norm=False, full_norm=False, renorm=True, shexp=False),
    "olmoe": dict(neox=True, head_norm=False, full_norm=True, renorm=False, shexp=False),
}


@dataclass
class MoeReference:
    """The dequantized model in float64; :meth:`logits` runs a token sequence from scratch.
    ``routes[layer]`` collects the expert ids chosen in the last call (``[T, k]``)."""

    path: Path
    arch: str = ""
    meta: dict[str, object] = field(default_factory=dict)
    w: dict[str, torch.Tensor] = field(default_factory=dict)
    routes: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r = gguf.GGUFReader(self.path)
        self.meta = {
            k: f.contents()
            for k, f in r.fields.items()
            if not k.startswith(("tokenizer.", "GGUF."))
        }
        self.arch = str(self.meta["general.architecture"])
        for t in r.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape))
            self.w[t.name] = torch.from_numpy(np.asarray(values, dtype=np.float64).reshape(shape))

    def key(self, name: str, default: float | None = None) -> float:
        """The number ``<arch>.name`` of the metadata (``default`` if absent)."""
        value = self.meta.get(f"{self.arch}.{name}", default)
        assert isinstance(value, (int, float)), (name, value)
        return value

    def _experts(self, p: str, kind: str, n: int) -> torch.Tensor:
        """``[E, rows, K]``: the stacked tensor, or the per-expert ones stacked."""
        stacked = f"{p}ffn_{kind}_exps.weight"
        if stacked in self.w:
            return self.w[stacked]
        return torch.stack([self.w[f"{p}ffn_{kind}.{e}.weight"] for e in range(n)])

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> np.ndarray:
        """``[T, vocab]`` float64 logits of ``tokens`` (teacher-forced, causal)."""
        a = _ARCHS[self.arch]
        eps = self.key("attention.layer_norm_rms_epsilon")
        n_layers = int(self.key("block_count"))
        nh = int(self.key("attention.head_count"))
        nkv = int(self.key("attention.head_count_kv", nh))
        hidden = int(self.key("embedding_length"))
        hd = int(self.key("attention.key_length", hidden // nh))
        base = self.key("rope.freq_base", 10000.0)
        n_exp = int(self.key("expert_count"))
        k_used = int(self.key("expert_used_count"))
        t = len(tokens)

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

        pos = torch.arange(t, dtype=torch.float64)
        inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos[:, None] * inv[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

        def rope(x: torch.Tensor) -> torch.Tensor:
            if a["neox"]:
                x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
                return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)

        def linear(x: torch.Tensor, name: str) -> torch.Tensor:
            y = x @ self.w[name + ".weight"].T
            bias = self.w.get(name + ".bias")
            return y + bias if bias is not None else y

        x = self.w["token_embd.weight"][tokens]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        silu: Callable[[torch.Tensor], torch.Tensor] = torch.nn.functional.silu
        for i in range(n_layers):
            p = f"blk.{i}."
            h = norm(x, self.w[p + "attn_norm.weight"])
            q, k, v = linear(h, p + "attn_q"), linear(h, p + "attn_k"), linear(h, p + "attn_v")
            if a["full_norm"]:  # olmoe: over the whole projection
                q = norm(q, self.w[p + "attn_q_norm.weight"])
                k = norm(k, self.w[p + "attn_k_norm.weight"])
            q, k, v = q.view(t, nh, hd), k.view(t, nkv, hd), v.view(t, nkv, hd)
            if a["head_norm"]:
                q = norm(q, self.w[p + "attn_q_norm.weight"])
                k = norm(k, self.w[p + "attn_k_norm.weight"])
            q, k = rope(q), rope(k)
            k = k.repeat_interleave(nh // nkv, dim=1)
            v = v.repeat_interleave(nh // nkv, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            s = s.masked_fill(~mask, -math.inf).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", s, v).reshape(t, nh * hd)
            x = x + linear(o, p + "attn_output")

            h = norm(x, self.w[p + "ffn_norm.weight"])
            probs = (h @ self.w[p + "ffn_gate_inp.weight"].T).softmax(-1)
            wts, ids = probs.topk(k_used, dim=-1)
            self.routes[i] = ids
            if a["renorm"]:
                wts = wts / wts.sum(-1, keepdim=True)
            gate = self._experts(p, "gate", n_exp)
            up = self._experts(p, "up", n_exp)
            down = self._experts(p, "down", n_exp)
            out = torch.zeros_like(x)
            for r in range(t):
                for j in range(k_used):
                    e = int(ids[r, j])
                    y = down[e] @ (silu(gate[e] @ h[r]) * (up[e] @ h[r]))
                    out[r] += wts[r, j] * y
            if a["shexp"]:
                y = linear(silu(linear(h, p + "ffn_gate_shexp")) * linear(h, p + "ffn_up_shexp"),
                           p + "ffn_down_shexp")  # fmt: skip
                out = out + torch.sigmoid(h @ self.w[p + "ffn_gate_inp_shexp.weight"])[:, None] * y
            x = x + out

        x = norm(x, self.w["output_norm.weight"])
        out_w = self.w.get("output.weight", self.w["token_embd.weight"])
        return (x @ out_w.T).numpy()
