"""Multi-token prediction (``nextn``) heads: the layers some GGUFs carry after the trunk
(qwen35, qwen35moe, qwen3next, glm4moe), run as a draft model for speculative decoding.

As llama.cpp's ``graph_mtp`` (``src/models/qwen35moe.cpp``, ``glm4-moe.cpp``): for the token
``x_p`` at position ``p`` and the trunk's final hidden state ``h_{p-1}`` (after the output
norm) of the position before, ``eh_proj`` maps ``[enorm(embed(x_p)), hnorm(h_{p-1})]`` to the
hidden size, one decoder layer of the family runs on it (full attention over its own cache of
such pairs, then the family's feed-forward, MoE included), and ``shared_head_norm`` (else the
output norm) and ``shared_head_head`` (else the output projection) give the logits of the
token at ``p + 1`` and the hidden state a following draft step pairs with its token.
``nextn.embed_tokens`` replaces the token embeddings where the file has it. The head loads on
the CPU; with the trunk on a GPU, placement moves its layer there too
(``engine/placement.py``, :func:`~freetoken.engine.placement.place_mtp_head`), so that a draft
token is a few small GPU launches rather than a layer on the CPU. Its logits come from the
trunk's output projection where the file has no ``shared_head_head``, on the trunk's device:
the largest matrix is neither read on the CPU per draft token nor copied."""

from __future__ import annotations

import torch

from freetoken.errors import InvalidInputError
from freetoken.gguf import GGUFFile
from freetoken.models.layers import Embedding, Linear, load_vector, rms_norm
from freetoken.models.transformer import Transformer
from freetoken.runtime.cuda_graph import MAX_SPAN, GraphDecoder
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.step import Span, Step

__all__ = ["MtpHead"]


class MtpHead:
    """The first ``nextn`` layer of ``model`` (llama.cpp runs one, as here).
    InvalidInputError when the file has none."""

    def __init__(self, model: Transformer, gguf: GGUFFile) -> None:
        cfg = model.cfg
        i = cfg.n_layers
        p = f"blk.{i}.nextn."
        if model.n_nextn < 1 or p + "eh_proj.weight" not in gguf:
            raise InvalidInputError(
                f"--spec-type draft-mtp: {gguf.path} has no multi-token-prediction layer "
                f"(`{cfg.arch}.nextn_predict_layers` and tensor `{p}eh_proj.weight`)"
            )
        h, v = cfg.hidden, cfg.vocab_size
        self.model = model
        #: Where the head's layer runs, and its steps as CUDA graphs with their static
        #: paired hidden states ``[MAX_SPAN, hidden]`` (set by placement).
        self.device = torch.device("cpu")
        self.graphs: GraphDecoder | None = None
        self.paired: torch.Tensor | None = None
        self.eh_proj = Linear(gguf, p + "eh_proj", (h, 2 * h))
        self.enorm = load_vector(gguf, p + "enorm.weight", h)
        self.hnorm = load_vector(gguf, p + "hnorm.weight", h)
        # The head's own copies, on the CPU until placement moves them with the layer.
        name = p + "shared_head_norm.weight"
        self.head_norm = load_vector(gguf, name if name in gguf else "output_norm.weight", h)
        name = p + "shared_head_head"
        own = name + ".weight" in gguf
        self.head = Linear(gguf, name, (v, h)) if own else model.output
        self.head_device = torch.device("cpu") if own else model.output_device
        name = p + "embed_tokens.weight"
        self.embed = Embedding(gguf, name if name in gguf else "token_embd.weight", v, h)
        self.block = model.mtp_block(gguf, i)

    def new_cache(self, n_ctx: int) -> KVCache:
        """An empty cache of the head's attention for one sequence, on the head's device, of
        the model's key and value types."""
        gpu = self.device.type == "cuda"
        shape = self.model.mtp_kv_shape()
        dtypes = self.model.kv_dtypes
        return KVCache(1, n_ctx, *shape, dtypes=dtypes, device=self.device, v_transposed=gpu)

    @torch.inference_mode()
    def forward(
        self, tokens: list[int], hidden: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs ``tokens`` (at the cache's next positions) paired with the trunk's hidden
        states of the positions before them ``hidden [T, hidden]``; returns the float32
        logits ``[T, vocab]`` (on :attr:`head_device`) and the head's hidden states
        ``[T, hidden]`` (on :attr:`device`). Steps of up to ``MAX_SPAN`` tokens replay a
        CUDA graph where placement made :attr:`graphs`; both results are then the graph's
        outputs, valid until the head's next step."""
        n = len(tokens)
        self.embed.check(tokens)
        if self.graphs is not None and n <= MAX_SPAN:
            assert self.paired is not None
            self.paired[:n].copy_(hidden)
            out = self.graphs.step([(tokens, cache)], keep_hidden=True)
            assert out is not None and out[1] is not None  # one cache: captured at once
            return out[0], out[1]
        step = self._step(cache, n)
        logits = self._pass(self.embed.lookup(tokens), hidden.to(self.device), step, logits=True)
        cache.commit(n)
        assert logits is not None and step.hidden is not None
        return logits, step.hidden

    @torch.inference_mode()
    def advance(self, tokens: list[int], hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """:meth:`forward` without the logits where no graph runs: the head's cache takes
        ``tokens`` and the head's hidden states ``[T, hidden]`` come back (the target's
        step shown to the head, whose logits nobody reads: on the CPU the output projection
        is the largest read of all)."""
        n = len(tokens)
        if self.graphs is not None and n <= MAX_SPAN:
            return self.forward(tokens, hidden, cache)[1]
        step = self._step(cache, n)
        self._pass(self.embed.lookup(tokens), hidden.to(self.device), step, logits=False)
        cache.commit(n)
        assert step.hidden is not None
        return step.hidden

    def run(self, tokens: torch.Tensor, step: Step, rows: torch.Tensor | None) -> torch.Tensor:
        """The head's pass on tensors, what :attr:`graphs` capture (their ``Decoder``):
        token ids ``[T]`` paired with the first ``T`` rows of :attr:`paired`; every row's
        logits (``rows`` is not used) and, in ``step.hidden``, its hidden state."""
        assert self.paired is not None
        logits = self._pass(tokens, self.paired[: tokens.shape[0]], step, logits=True)
        assert logits is not None
        return logits

    def _step(self, cache: KVCache, n: int) -> Step:
        start = cache.reserve(n)
        pos = torch.arange(start, start + n, device=self.device)
        return Step(pos, [Span(start, n, cache)], keep_hidden=True)

    def _pass(
        self, ids: torch.Tensor, hidden: torch.Tensor, step: Step, logits: bool
    ) -> torch.Tensor | None:
        m, eps = self.model, self.model.cfg.norm_eps
        e = self.embed(ids)
        h = rms_norm(hidden, self.hnorm, eps)
        x = self.eh_proj(torch.cat([rms_norm(e, self.enorm, eps), h], -1))
        x = m._layer(0, self.block, x, step)
        step.hidden = out = rms_norm(x, self.head_norm, eps)
        return self.head(out.to(self.head_device)).float() if logits else None
