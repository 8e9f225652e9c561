"""Token sampling with llama.cpp's default sampler chain and defaults.

The chain, in llama.cpp's default order (``common/common.h``, ``common_params_sampling``):

1. penalties over the last ``repeat_last_n`` tokens of the history: the repeat penalty divides a
   positive logit and multiplies a non-positive one (once per distinct token); then
   ``count * frequency_penalty + presence_penalty`` is subtracted;
2. top-k: keep the ``top_k`` largest logits (0 = off);
3. top-p: keep the smallest prefix of the sorted candidates whose probability mass (softmax of the
   candidates left by top-k, at temperature 1) reaches ``top_p`` (1 = off);
4. min-p: keep candidates whose probability is at least ``min_p`` times the largest, i.e. whose
   logit is at least ``max + log(min_p)`` (0 = off);
5. temperature: divide the logits by ``temperature``; ``temperature <= 0`` is greedy (argmax
   after the penalties, which every truncation step keeps);
6. draw from the softmax of what is left, with one uniform number per draw from a seeded
   generator.

Everything runs as torch ops on the logits' device (CPU or CUDA), vectorised over a batch; the
only Python loop is over the history windows, a few dozen tokens each.
"""

from __future__ import annotations

import math
import numbers
import operator
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.errors import InvalidInputError, ShapeError
from freetoken.runtime.speculative import accept_draft

__all__ = ["Sampler", "SamplingParams", "log_softmax"]

# When top-k is off and top-p is on, the top-p set is usually small: take the largest logits in
# growing chunks and sort the whole vocabulary only if their mass still falls short of top_p
# (a full sort of 262144 floats costs ~40 ms on a CPU core, topk(1024) ~2 ms).
_TOP_P_TRY_K = (1024, 8192, 65536)

# Without top-k and top-p, min-p needs no sorting; topk of its survivors beats masking the
# whole row only when they are few (topk(40) ~0.5 ms, topk(1024) ~2 ms, full row ~2.5 ms).
_MIN_P_TOPK_MAX = 256

_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes up to a uint64


def _real(name: str, value: object) -> float:
    """``value`` as a float, rejecting non-numbers, bools and NaN with a message naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"sampling parameter {name} must be a number, got {value!r}")
    v = float(value)
    if math.isnan(v):
        raise InvalidInputError(f"sampling parameter {name} is NaN")
    return v


def _integer(name: str, value: object) -> int:
    """``value`` as an int, rejecting bools, floats and other non-integers."""
    if isinstance(value, bool):
        raise InvalidInputError(f"sampling parameter {name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(
            f"sampling parameter {name} must be an integer, got {value!r}"
        ) from None


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, named and defaulted as llama.cpp's ``common_params_sampling``.

    Attributes:
        temperature: divides the logits after truncation; ``<= 0`` samples greedily (argmax).
        top_k: keep only the ``top_k`` most likely tokens; 0 disables it.
        top_p: nucleus sampling threshold in (0, 1]; 1 disables it.
        min_p: keep tokens with probability at least ``min_p`` times the top one's, in [0, 1];
            0 disables it.
        repeat_penalty: > 0; 1 disables it. Positive logits of tokens seen in the window are
            divided by it, non-positive ones multiplied.
        repeat_last_n: how many of the latest history tokens the penalties look at; 0 disables
            all three penalties.
        presence_penalty: subtracted once from the logit of each token seen in the window.
        frequency_penalty: subtracted once per occurrence in the window.
        seed: seed of the random draws; ``None`` (or -1, llama.cpp's spelling) picks a random
            one, which :attr:`Sampler.seed` reports.

    Construction validates every field and raises :class:`~freetoken.errors.InvalidInputError`
    naming the bad one.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values go in through object.__setattr__.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        temperature = _real("temperature", self.temperature)
        if math.isinf(temperature):
            raise InvalidInputError(f"temperature must be finite, got {temperature}")
        put("temperature", temperature)

        top_k = _integer("top_k", self.top_k)
        if top_k < 0:
            raise InvalidInputError(f"top_k must be >= 0 (0 disables it), got {top_k}")
        put("top_k", top_k)

        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
        put("top_p", top_p)

        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise InvalidInputError(f"min_p must be in [0, 1] (0 disables it), got {min_p}")
        put("min_p", min_p)

        repeat_penalty = _real("repeat_penalty", self.repeat_penalty)
        # llama.cpp's rule: finite, > 0, and with a finite reciprocal.
        if not (
            math.isfinite(repeat_penalty)
            and repeat_penalty > 0.0
            and math.isfinite(1.0 / repeat_penalty)
        ):
            raise InvalidInputError(
                f"repeat_penalty must be finite and > 0 (1 disables it), got {repeat_penalty}"
            )
        put("repeat_penalty", repeat_penalty)

        repeat_last_n = _integer("repeat_last_n", self.repeat_last_n)
        if repeat_last_n < 0:
            raise InvalidInputError(
                f"repeat_last_n must be >= 0 (0 disables penalties), got {repeat_last_n}"
            )
        put("repeat_last_n", repeat_last_n)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not math.isfinite(value):
                raise InvalidInputError(f"{name} must be finite, got {value}")
            put(name, value)

        if self.seed is not None:
            seed: int | None = _integer("seed", self.seed)
            if seed == -1:
                seed = None  # llama.cpp's "random seed"
            elif seed is not None and not 0 <= seed <= _MAX_SEED:
                raise InvalidInputError(
                    f"seed must be in [0, 2**64) or -1/None for a random one, got {seed}"
                )
            put("seed", seed)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax after penalties (``temperature <= 0``)."""
        return self.temperature <= 0.0

    @property
    def penalties_enabled(self) -> bool:
        """True when the penalty step changes anything (llama.cpp's ``is_disabled`` negated)."""
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the model's own distribution, for logprobs reporting.

    This is the raw model distribution (no penalties, truncation or temperature), as the
    OpenAI API reports it. Works along the last dimension; returns float32 on the logits' device.
    """
    return torch.log_softmax(logits.float(), dim=-1)


class Sampler:
    """Draws tokens from logits with llama.cpp's default sampler chain (see the module doc).

    The sampler is stateless apart from its random generator: the penalties read the history
    passed in on every call (prompt and generated tokens so far, as llama.cpp feeds both to its
    penalty sampler). The random numbers come from a CPU ``torch.Generator``, one float64 per
    draw, so a given seed gives the same tokens on CPU and CUDA logits alike, and
    ``sample_batch`` over B rows gives what B calls of ``sample`` would.
    """

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        """Make a sampler for ``vocab_size`` logits per position; seeds its generator."""
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"params must be a SamplingParams, got {type(params).__name__}")
        vocab_size = _integer("vocab_size", vocab_size)
        if vocab_size <= 0:
            raise InvalidInputError(f"vocab_size must be > 0, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        # A random seed is drawn here (not left to torch) so that it can be reported and reused.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)

    # -- public API ----------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Draw the next token from one position's logits (1-D, ``vocab_size`` long).

        ``history`` is the token ids so far (prompt and generated); only its last
        ``repeat_last_n`` entries matter. Raises ShapeError on a wrong shape and
        InvalidInputError on NaN logits, a row without a finite maximum or a history id
        outside the vocabulary.
        """
        x = self._check_logits(logits, 1)
        return self._sample_rows(x.unsqueeze(0), [history])[0]

    def sample_batch(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> list[int]:
        """Draw one token per row of ``logits`` ([B, vocab_size]), row b penalised by
        ``histories[b]``. Equivalent to B calls of :meth:`sample` in row order."""
        x = self._check_logits(logits, 2)
        if len(histories) != x.shape[0]:
            raise ShapeError(f"{x.shape[0]} rows of logits but {len(histories)} histories")
        if x.shape[0] == 0:
            return []
        return self._sample_rows(x, histories)

    def candidates(
        self, logits: torch.Tensor, history: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final distribution :meth:`sample` draws from, for one position.

        Returns ``(token_ids, logprobs)``: int64 ids of the tokens that survive the chain and
        their float64 log-probabilities after temperature, most likely first. Greedy gives the
        argmax with log-probability 0. Draws no random number.
        """
        x = self._check_logits(logits, 1).unsqueeze(0)
        x = self._penalize(x, [history])
        if self.params.greedy:
            top, idx = x.max(dim=-1)
            self._raise_if_bad(torch.isfinite(top).tolist())
            return idx.to(torch.int64), torch.zeros(1, dtype=torch.float64, device=x.device)
        w, cand, ok = self._weights(x)
        self._raise_if_bad(ok.tolist())
        w = w[0]
        ids = cand[0] if cand is not None else torch.arange(w.shape[0], device=w.device)
        kept = w > 0
        w, ids = w[kept], ids[kept]
        order = torch.argsort(w, descending=True)
        return ids[order], torch.log(w[order] / w.sum())

    def probs(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """The final distribution :meth:`sample` draws from, dense: float64 ``[vocab]`` on
        the CPU (greedy: one-hot at the argmax). Draws no random number."""
        ids, logprobs = self.candidates(logits, history)
        p = torch.zeros(self.vocab_size, dtype=torch.float64)
        p[ids.cpu()] = logprobs.cpu().exp()
        return p

    def verify(
        self,
        logits: torch.Tensor,
        history: Sequence[int],
        draft: int,
        draft_probs: torch.Tensor | None = None,
    ) -> int:
        """The token at a speculative draft position: ``draft`` when the standard rule keeps
        it (runtime/speculative.py), else one from the residual distribution, so that the
        result is distributed as :meth:`sample`'s. ``draft_probs``: the draft's distribution
        (None: the draft was its argmax). Greedy: the argmax, as :meth:`sample`."""
        if self.params.greedy:
            return self.sample(logits, history)
        return accept_draft(self.probs(logits, history), draft, draft_probs, self._gen)

    # -- internals -----------------------------------------------------------------------------

    def _check_logits(self, logits: torch.Tensor, ndim: int) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor):
            raise InvalidInputError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        if not logits.is_floating_point():
            raise InvalidInputError(f"logits must be floating point, got {logits.dtype}")
        if logits.ndim != ndim or logits.shape[-1] != self.vocab_size:
            want = "[vocab_size]" if ndim == 1 else "[batch, vocab_size]"
            raise ShapeError(
                f"logits must have shape {want} with vocab_size={self.vocab_size}, "
                f"got {tuple(logits.shape)}"
            )
        # float16/bfloat16 model outputs are upcast; float32 is used as is (not copied).
        return logits.float()

    def _penalize(self, x: torch.Tensor, histories: Sequence[Sequence[int]]) -> torch.Tensor:
        """Apply repeat/presence/frequency penalties; returns a new tensor when it changes any."""
        p = self.params
        if not p.penalties_enabled:
            return x
        n, vocab = p.repeat_last_n, self.vocab_size
        keys = []
        for b, history in enumerate(histories):
            window = history[-n:] if len(history) > n else history
            if len(window) == 0:
                continue
            t = torch.as_tensor(window, device="cpu")
            if t.ndim != 1 or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise InvalidInputError(
                    f"history must be a 1-D sequence of integer token ids, got {t.dtype} "
                    f"with shape {tuple(t.shape)}"
                )
            t = t.to(torch.int64)
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise InvalidInputError(f"history token id {bad} is outside [0, {vocab})")
            keys.append(t + b * vocab)  # one flat key per (row, token): one unique() for all
        if not keys:
            return x
        uniq, counts = torch.unique(torch.cat(keys), return_counts=True)
        uniq = uniq.to(x.device)
        counts = counts.to(device=x.device, dtype=torch.float32)
        x = x.clone()  # never modify the caller's logits
        flat = x.view(-1)
        v = flat[uniq]
        # llama.cpp: divide positive logits, multiply the others, so the penalty always lowers
        # the logit; then subtract count * frequency + presence, in float32 as it does.
        v = torch.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
        v = v - (counts * p.frequency_penalty + p.presence_penalty)
        flat[uniq] = v
        return x

    def _candidates(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Narrow each row to a set that holds every token the chain can keep.

        Returns (values, ids, log normaliser). Values are sorted descending unless ids is None
        (the whole row, unsorted: no top-k, top-p or min-p). The log normaliser, present when
        top-p is on, is the logsumexp of the set top-p sees: the top-k survivors, or the whole
        row when top-k is off.
        """
        p, vocab = self.params, self.vocab_size
        if 0 < p.top_k < vocab:
            vals, idx = torch.topk(x, p.top_k, dim=-1)
            norm = torch.logsumexp(vals.double(), dim=-1, keepdim=True)
            return vals, idx, norm if p.top_p < 1.0 else None
        if p.top_p >= 1.0 and p.min_p <= 0.0:
            return x, None, None
        top = x.amax(dim=-1, keepdim=True)
        log_norm: torch.Tensor | None = None
        if p.top_p < 1.0:
            # logsumexp by hand: torch.logsumexp is a few times slower on a CPU. A NaN or +inf
            # maximum makes this garbage, but such rows are reported as not ok anyway.
            log_norm = top.double() + torch.exp(x - top).sum(dim=-1, keepdim=True).double().log()
        if p.min_p > 0.0:
            # Top-p and min-p both keep a prefix of the sorted row and min-p's cut depends only
            # on the maximum, so the final set is the shorter prefix: the min-p survivors
            # (usually few) are all that need sorting. Same float32 threshold as _weights.
            k = max(int((x >= top + math.log(p.min_p)).sum(dim=-1).max()), 1)  # NaN row: 0
            if p.top_p >= 1.0 and k > _MIN_P_TOPK_MAX:
                return x, None, None  # many survivors and no top-p: mask the unsorted row
            vals, idx = torch.topk(x, k, dim=-1)
            return vals, idx, log_norm
        assert log_norm is not None  # top-p is on: min-p alone returned above
        for k in _TOP_P_TRY_K:
            if k >= vocab:
                break
            vals, idx = torch.topk(x, k, dim=-1)
            mass = torch.exp(vals.double() - log_norm).sum(dim=-1)
            if bool((mass >= p.top_p).all()):
                return vals, idx, log_norm
        vals, idx = torch.sort(x, dim=-1, descending=True)
        return vals, idx, log_norm

    def _weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Unnormalised float64 weights of the final distribution over the candidates.

        Returns (weights [B, n], candidate ids [B, n] or None for the identity, row ok [B]):
        a row is not ok when its maximum is NaN or infinite (NaN anywhere in a row makes it the
        maximum for torch's max and topk).
        """
        p = self.params
        vals, idx, log_norm = self._candidates(x)
        top = vals[:, :1] if idx is not None else vals.amax(dim=-1, keepdim=True)
        ok = torch.isfinite(top).squeeze(-1)
        keep = None
        n = vals.shape[-1]
        if log_norm is not None:
            cum = torch.exp(vals.double() - log_norm).cumsum(dim=-1)
            # Keep up to and including the first candidate where the mass reaches top_p.
            n_keep = (cum < p.top_p).sum(dim=-1, keepdim=True) + 1
            keep = torch.arange(n, device=x.device) < n_keep
        if p.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  logit_i >= max + log(min_p); the max always survives.
            above = vals >= top + math.log(p.min_p)
            keep = above if keep is None else keep & above
        # Softmax numerator of logits / temperature, in float64 and shifted by the maximum
        # before dividing (so a tiny temperature cannot overflow): the top token gets weight 1,
        # dropped tokens 0.
        z = (vals.double() - top.double()) / p.temperature
        if keep is not None:
            z = z.masked_fill(~keep, -math.inf)
        return torch.exp(z), idx, ok

    def _sample_rows(self, x: torch.Tensor, histories: Sequence[Sequence[int]]) -> list[int]:
        x = self._penalize(x, histories)
        greedy_cpu = self.params.greedy and x.device.type == "cpu"
        out = _argmax_rows(x) if greedy_cpu else self._draw_rows(x)
        self._raise_if_bad([t >= 0 for t in out])
        return out

    def _draw_rows(self, x: torch.Tensor) -> list[int]:
        """Each row's token (-1 where the row cannot be sampled), on the logits' device."""
        if self.params.greedy:
            top, tok = x.max(dim=-1)
            ok = torch.isfinite(top)
        else:
            w, idx, ok = self._weights(x)
            cum = w.cumsum(dim=-1)
            total = cum[:, -1:]
            u = torch.rand((x.shape[0], 1), generator=self._gen, dtype=torch.float64).to(x.device)
            # Inverse CDF: the first position whose cumulative weight exceeds u * total. Using
            # "exceeds" (right=True) never lands on a zero-weight (dropped) token.
            pos = torch.searchsorted(cum, u * total, right=True)
            # Rounding can put u * total at total; the first index where cum reaches total is
            # the last token with weight (cum rose there), so clamp to it.
            pos = torch.minimum(pos, (cum < total).sum(dim=-1, keepdim=True))
            tok = (idx.gather(-1, pos) if idx is not None else pos).squeeze(-1)
        # One device-to-host transfer for both the tokens and the validity flags.
        return torch.where(ok, tok, -1).tolist()

    @staticmethod
    def _raise_if_bad(ok: list[bool]) -> None:
        for row, good in enumerate(ok):
            if not good:
                raise InvalidInputError(
                    f"logits row {row} has NaN or no finite maximum (all -inf, or +inf); "
                    "cannot sample"
                )


def _argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's first maximum (-1 where that is not finite) of host logits: numpy's argmax
    reads a row about 4x faster than torch's max (the server samples every sequence of a step
    this way); both take the first of equal maxima and stop at a NaN."""
    rows = x.numpy()
    ids = rows.argmax(axis=-1)
    best = np.take_along_axis(rows, ids[:, None], axis=-1)[:, 0]
    return np.where(np.isfinite(best), ids, -1).tolist()
