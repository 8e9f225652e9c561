"""Speculative decoding: the flags (llama.cpp's names), the drafters and the verify rule.

Each step drafts up to ``--spec-draft-n-max`` tokens after the token just sampled, runs that
token and the draft through the target model as one forward step of ``N + 1`` tokens, keeps
the drafts the acceptance rule takes (runtime/speculative.py) and the target's token after
them, and cuts the caches back to the tokens kept (``KVCache.rewind``: the KV cache, and the
Gated DeltaNet states from the step's checkpoints).

Drafters (``--spec-type``):

- ``ngram-simple``: the tokens that followed the latest earlier occurrence of the context's
  last ``--spec-ngram-simple-size-n`` tokens (no model);
- ``draft-simple``: a small model with the same vocabulary (``--spec-draft-model``), greedy,
  with its own cache kept in step with the context;
- ``draft-mtp``: the target's own multi-token-prediction layer (models/mtp.py), fed the
  target's hidden states of every position it runs.

A drafter stops early where its top token's probability falls below ``--spec-draft-p-min``,
and a draft shorter than ``--spec-draft-n-min`` is dropped; with ``--spec-draft-n-auto``
(ours) each step drafts the length the sequence's measured steps favour
(engine/draft_length.py). ``--spec-synth-len`` /
``--spec-synth-rates`` (benchmarks only, as llama.cpp's) keep each draft position with a set
probability whatever the tokens, so the output is not the model's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from freetoken.engine.spec_options import DraftLimits, SpecOptions
from freetoken.errors import InvalidInputError
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.sampler import Sampler
from freetoken.runtime.speculative import ngram_draft

if TYPE_CHECKING:
    from freetoken.engine.placement import Placement
    from freetoken.gguf import GGUFFile
    from freetoken.models.mtp import MtpHead
    from freetoken.models.transformer import Transformer

__all__ = [
    "Drafter",
    "ModelDrafter",
    "MtpDrafter",
    "NgramDrafter",
    "SynthAcceptance",
    "check_draft_vocab",
    "cut_cache",
    "drafter_factory",
    "verify_tokens",
]


class Drafter(Protocol):
    """Drafts for one sequence. ``observe`` sees every step the target runs (its tokens from
    position ``start``, and with ``needs_hidden`` the final hidden states), ``rewind`` every
    cut of the target's cache, and ``draft`` proposes tokens after ``context`` (which ends
    with the sampled token the target has not run yet)."""

    needs_hidden: bool

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor | None) -> None: ...

    def rewind(self, length: int) -> None: ...

    def draft(self, context: Sequence[int], limits: DraftLimits) -> list[int]: ...


def _trim(draft: list[int], limits: DraftLimits) -> list[int]:
    return draft[: limits.n_max] if len(draft) >= max(limits.n_min, 1) else []


class NgramDrafter:
    """``ngram-simple``: drafts from the context itself."""

    needs_hidden = False

    def __init__(self, opts: SpecOptions) -> None:
        self.opts = opts

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor | None) -> None:
        """Nothing to keep: the context is all."""

    def rewind(self, length: int) -> None:
        """Nothing to cut."""

    def draft(self, context: Sequence[int], limits: DraftLimits) -> list[int]:
        """The tokens that followed the last n-gram's latest earlier occurrence."""
        o = self.opts
        return _trim(ngram_draft(context, o.ngram_size_n, o.ngram_size_m), limits)


def _greedy_steps(
    step: Callable[[int], torch.Tensor], first: int, n_max: int, p_min: float
) -> list[int]:
    """Up to ``n_max`` argmax tokens, each fed back through ``step`` (token -> logits); stops
    where the top token's probability is below ``p_min``."""
    out: list[int] = []
    tok = first
    while len(out) < n_max:
        logits = step(tok)
        tok = int(logits.argmax())
        if p_min > 0.0 and float(torch.softmax(logits.double(), -1)[tok]) < p_min:
            break
        out.append(tok)
    return out


class ModelDrafter:
    """``draft-simple``: a small model with the target's vocabulary and its own cache, which
    holds the context up to the token before the sampled one between steps."""

    needs_hidden = False

    def __init__(self, model: Transformer, n_ctx: int) -> None:
        self.model = model
        self.cache = model.new_cache(n_ctx)
        self.tokens: list[int] = []

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor | None) -> None:
        """The draft model catches up in :meth:`draft`."""

    def rewind(self, length: int) -> None:
        """The cache follows the context in :meth:`draft`."""

    def draft(self, context: Sequence[int], limits: DraftLimits) -> list[int]:
        """Greedy tokens of the draft model after ``context``."""
        common = 0
        for a, b in zip(self.tokens, context[:-1], strict=False):
            if a != b:
                break
            common += 1
        kept = self.cache.truncate(common)
        rest = list(context[kept:-1])
        for i in range(0, len(rest), 512):
            self.model.forward(rest[i : i + 512], self.cache)
        room = self.cache.n_ctx - self.cache.length
        fed: list[int] = []

        def step(tok: int) -> torch.Tensor:
            fed.append(tok)
            return self.model.forward([tok], self.cache)

        out = _greedy_steps(step, context[-1], min(limits.n_max, room), limits.p_min)
        self.tokens = [*context[:-1], *fed]
        return _trim(out, limits)


class MtpDrafter:
    """``draft-mtp``: the target's multi-token-prediction head. Its cache holds, per position
    ``p`` the target has run, the pair (``h_{p-1}``, token ``p``); a draft runs the head from
    the sampled token on and is cut away again."""

    needs_hidden = True

    def __init__(self, head: MtpHead, n_ctx: int) -> None:
        self.head = head
        self.cache = head.new_cache(n_ctx)
        #: The target's final hidden state per position (on the head's device).
        self.hidden = torch.zeros(n_ctx, head.model.cfg.hidden, device=head.device)

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor | None) -> None:
        """Runs the head on the target's step: each token with the hidden state before it."""
        assert hidden is not None
        self.cache.truncate(start)
        hidden = hidden.to(self.head.device)
        before = self.hidden[start - 1 : start] if start else torch.zeros_like(self.hidden[:1])
        self.head.advance(tokens, torch.cat([before, hidden[:-1]]), self.cache)
        self.hidden[start : start + len(tokens)] = hidden

    def rewind(self, length: int) -> None:
        """Forgets the head's positions from ``length`` on."""
        self.cache.truncate(length)

    def draft(self, context: Sequence[int], limits: DraftLimits) -> list[int]:
        """Greedy tokens of the head after ``context``."""
        pos0 = len(context) - 1
        if self.cache.length != pos0:
            raise InvalidInputError(
                f"draft-mtp: the head holds {self.cache.length} positions, the context "
                f"{pos0} (a step ran without it)"
            )
        h = [self.hidden[pos0 - 1 : pos0] if pos0 else torch.zeros_like(self.hidden[:1])]

        def step(tok: int) -> torch.Tensor:
            logits, out = self.head.forward([tok], h[0], self.cache)
            h[0] = out
            return logits[0]

        room = self.cache.n_ctx - pos0
        out = _greedy_steps(step, context[-1], min(limits.n_max, room), limits.p_min)
        self.cache.truncate(pos0)
        return _trim(out, limits)


def _vocab(gguf: GGUFFile) -> list[str] | None:
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    return tokens if isinstance(tokens, list) else None


def drafter_factory(
    opts: SpecOptions,
    model: Transformer,
    gguf: GGUFFile,
    draft: Transformer | None = None,
    placement: Placement | None = None,
) -> Callable[[int], Drafter]:
    """Makes the drafters of ``opts`` (each for a sequence of the ``n_ctx`` tokens it is
    called with) of the target ``model`` (``gguf``); ``draft`` is the loaded draft model of
    ``draft-simple``. What the sequences share (the MTP head's weights) is loaded here, once,
    and goes to the trunk's GPU where ``placement`` put the trunk: InvalidInputError when
    the file has no MTP layer."""
    if opts.spec_type == "ngram-simple":
        return lambda n_ctx: NgramDrafter(opts)
    if opts.spec_type == "draft-mtp":
        from freetoken.models.mtp import MtpHead

        head = MtpHead(model, gguf)
        if placement is not None:
            from freetoken.engine.placement import place_mtp_head

            place_mtp_head(head, placement)
        return lambda n_ctx: MtpDrafter(head, n_ctx)
    assert opts.spec_type == "draft-simple" and draft is not None
    return lambda n_ctx: ModelDrafter(draft, n_ctx)


def check_draft_vocab(target: GGUFFile, draft: GGUFFile) -> None:
    """InvalidInputError unless the draft model's vocabulary is the target's (the same
    tokens, ``tokenizer.ggml.tokens``, in the same order)."""
    a, b = _vocab(target), _vocab(draft)
    if a is None or b is None:
        raise InvalidInputError(
            f"--spec-draft-model {draft.path}: a vocabulary (`tokenizer.ggml.tokens`) is missing"
        )
    if len(a) != len(b):
        raise InvalidInputError(
            f"--spec-draft-model {draft.path}: its vocabulary has {len(b)} tokens, the "
            f"model's {len(a)} (`tokenizer.ggml.tokens`): the draft model needs the same one"
        )
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            raise InvalidInputError(
                f"--spec-draft-model {draft.path}: token {i} is {y!r}, the model's is {x!r} "
                "(`tokenizer.ggml.tokens`): the draft model needs the same vocabulary"
            )


class SynthAcceptance:
    """``--spec-synth-*``: keeps draft position ``i`` with probability ``probs[i]`` given
    the positions before were kept, whatever the tokens (llama.cpp's rule; a drafted
    end-of-generation token is never kept)."""

    def __init__(self, probs: list[float], seed: int) -> None:
        self.probs = probs
        self.rng = random.Random(seed)

    def keep(self, i: int) -> bool:
        """Whether draft position ``i`` is kept."""
        return self.rng.random() < self.probs[i]


def verify_tokens(
    sampler: Sampler,
    rows: torch.Tensor | Sequence[torch.Tensor],
    history: Sequence[int],
    draft: Sequence[int],
    eog: Collection[int],
    synth: SynthAcceptance | None = None,
) -> list[int]:
    """The tokens a verify step gives: the drafts kept, then the target's token after them
    (``rows[i]``: the target's logits after ``history`` and ``draft[:i]``). Stops at an
    end-of-generation token."""
    out: list[int] = []
    for i, d in enumerate(draft):
        seen = [*history, *out]
        if synth is not None:
            kept = synth.keep(i) and d not in eog
            tok = d if kept else sampler.sample(rows[i], seen)
        else:
            tok = sampler.verify(rows[i], seen, d)
            kept = tok == d
        out.append(tok)
        if not kept or tok in eog:
            return out
    out.append(sampler.sample(rows[len(draft)], [*history, *out]))
    return out


def cut_cache(cache: KVCache, drafter: Drafter, length: int) -> None:
    """Cuts the target's cache and the drafter back to ``length`` positions."""
    cache.rewind(length)
    drafter.rewind(length)
