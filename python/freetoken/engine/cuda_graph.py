"""Decode steps replayed as CUDA graphs.

A decode step of one sequence runs hundreds of small kernels (norms, RoPE, attention, the
dense products, routing, one MoE launch per layer); launched one by one from Python they cost
far more than their work. :class:`GraphDecoder` captures the whole step (``Transformer.run``)
once per KV-cache length bucket and replays it: the token and its position are copied into
static input tensors, attention reads a fixed number of cached positions (the bucket) and
masks the ones past the token.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from freetoken.engine.kv_cache import KVCache
    from freetoken.models.transformer import Transformer

__all__ = ["GraphDecoder"]

#: Cached positions per bucket: a step attends over the next multiple of this.
BUCKET = 256


class GraphDecoder:
    """One-token steps of ``model`` (on a CUDA device) as CUDA graphs, per cache and bucket."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        dev = model.device
        self.token = torch.zeros(1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        # Our MoE launches run on torch's current stream; warm-up and capture share one side
        # stream, so ggml-cuda's per-stream scratch is allocated before capture starts.
        self.stream = torch.cuda.Stream(dev)
        self.mempool = torch.cuda.graph_pool_handle()
        # Per cache (dropped with it: a graph holds its tensors' addresses), per bucket.
        self.graphs: weakref.WeakKeyDictionary[
            KVCache, dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]
        ] = weakref.WeakKeyDictionary()

    def _forward(self, cache: KVCache, n_keys: int) -> torch.Tensor:
        from freetoken.models.transformer import Span, Step

        step = Step(self.pos, [Span(self.pos, 1, cache, n_keys)])
        return self.model.run(self.token, step, None)[0]

    def _capture(self, cache: KVCache, n_keys: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                self._forward(cache, n_keys)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, stream=self.stream):
            logits = self._forward(cache, n_keys)
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph, logits

    @torch.inference_mode()
    def step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Runs ``token`` at the cache's next position; returns its float32 logits (on the
        device). The caller has checked the token id."""
        start = cache.reserve(1)
        n_keys = min(cache.n_ctx, (start // BUCKET + 1) * BUCKET)
        self.token.fill_(token)
        self.pos.fill_(start)
        graphs = self.graphs.setdefault(cache, {})
        entry = graphs.get(n_keys)
        if entry is None:
            # The warm-up passes write this position's keys too: the replay rewrites them.
            entry = graphs[n_keys] = self._capture(cache, n_keys)
        graph, logits = entry
        graph.replay()
        cache.commit(1)
        return logits
