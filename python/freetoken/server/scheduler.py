"""Continuous batching on an engine thread, with a bounded pool of KV slots and prefix reuse.

The event loop submits :class:`Job` objects and awaits their events; the engine thread owns
the model and every KV cache. Each step it drops cancelled jobs, admits waiting ones into free
slots, and runs one ``forward_batch`` over all running sequences: one token for each job that
is decoding, plus prompt chunks (up to ``batch_tokens`` in all) for jobs still reading their
prompt. So a new request joins the running batch between two decode steps, and a long prompt
never stalls the others for more than one chunk.

Prefix cache: a slot keeps the tokens of its last request after it ends. A new request takes
the free slot sharing the longest prefix with its prompt, truncates the cache there and only
evaluates the rest.

Speculative decoding (a server started with ``--spec-type``; a request may lower or turn off
its draft with ``speculative.n_max`` and friends): each slot has a drafter, and a decoding
job's row of the step is its sampled token and a draft after it, verified in the same
forward pass as the others' tokens and prompt chunks; the slot's cache is then cut back to
the tokens kept (engine/speculative.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from freetoken.engine.draft_length import DraftLength
from freetoken.engine.spec_options import MAX_DRAFT, DraftLimits, SpecOptions
from freetoken.engine.speculative import Drafter, SynthAcceptance, cut_cache, verify_tokens
from freetoken.errors import FreeTokenError, RequestError
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.sampler import Sampler, SamplingParams
from freetoken.tokenizer.textstream import TextStream

__all__ = [
    "EngineModel",
    "EngineTokenizer",
    "Event",
    "GenerationRequest",
    "Job",
    "Scheduler",
    "SchedulerHooks",
    "TokenLogprob",
]

log = logging.getLogger("freetoken.server")

#: A cached prefix shorter than this is not reused (every prompt of a chat template shares
#: a few header tokens; reusing them saves nothing and changes the prompt's chunking).
MIN_PREFIX_MATCH = 16


class EngineModel(Protocol):
    """What the scheduler needs of a model (``freetoken.models.Transformer``)."""

    def new_cache(self, n_ctx: int, max_step: int = 0) -> KVCache: ...

    def forward_batch(
        self,
        seqs: list[tuple[list[int], KVCache]],
        all_logits: bool | Sequence[bool] = False,
        hidden: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]: ...


class EngineTokenizer(Protocol):
    """What the scheduler needs of a tokenizer."""

    eog_ids: Any

    def token_to_piece(self, token: int) -> bytes: ...


@dataclass
class GenerationRequest:
    """One generation, as the protocol layer hands it over.

    ``logprobs`` is None for no log-probabilities, else how many alternatives to report per
    token (0: only the chosen token's). ``cache_prompt=False`` evaluates the whole prompt
    even when a slot holds a prefix of it (llama.cpp's option of that name). ``draft``
    overrides the server's speculative draft limits (``n_max``, ``n_min``, ``p_min``;
    ``n_max`` 0: no drafts).
    """

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stop: Sequence[str] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    draft: dict[str, float] | None = None


@dataclass
class TokenLogprob:
    """A generated token with its log-probability and the top alternatives, from the model's
    own distribution (log-softmax of the logits, before penalties and truncation)."""

    token: int
    piece: bytes
    logprob: float
    top: list[tuple[int, bytes, float]] = field(default_factory=list)


@dataclass
class Event:
    """What the engine sends a job: new text and tokens, and at the end the finish reason
    (``stop``, ``length``), or an error."""

    text: str = ""
    n_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None


def _deliver(events: list[tuple[Job, Event]]) -> None:
    """On a client's event loop: each event into its job's queue, in order."""
    for job, ev in events:
        job.queue.put_nowait(ev)


class Job:
    """A request inside the scheduler; the handler iterates :meth:`events`."""

    _ids = 0

    def __init__(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        Job._ids += 1
        self.id = Job._ids
        self.req = req
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False
        self.finished = False
        # Filled in by the engine thread.
        self.prompt_tokens = len(req.prompt)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.seed: int | None = None
        self.stop_string: str | None = None  # the stop string that ended it, if any
        self._slot: Slot | None = None
        self._n_past = 0  # prompt tokens in the cache
        self._next: int | None = None  # sampled, to be fed in the next step
        self._ready: torch.Tensor | None = None  # logits to sample from without a forward
        self._sampler: Sampler | None = None
        self._history: list[int] = []
        self._text: TextStream | None = None
        self._t_last = 0.0
        self._limits: DraftLimits | None = None  # None: no speculative decoding
        self._synth: SynthAcceptance | None = None
        #: Speculative decoding: tokens drafted and accepted.
        self.drafted = 0
        self.accepted = 0

    async def events(self) -> AsyncIterator[Event]:
        """Yields the job's events until the final one (finish reason or error)."""
        while True:
            ev = await self.queue.get()
            yield ev
            if ev.finish_reason is not None or ev.error is not None:
                return


class Slot:
    """A KV cache and the tokens it holds (kept after a job for prefix reuse), and with
    speculative decoding its drafter (and with ``--spec-draft-n-auto`` what chooses its
    draft lengths, which keeps the steps' costs from one job to the next)."""

    def __init__(
        self,
        index: int,
        cache: KVCache,
        drafter: Drafter | None = None,
        draft_length: DraftLength | None = None,
    ) -> None:
        self.index = index
        self.cache = cache
        self.drafter = drafter
        self.draft_length = draft_length
        self.tokens: list[int] = []
        self.job: Job | None = None
        self.last_used = 0.0
        # Logits after the last job's whole prompt (tokens[:prompt_len]): an identical
        # prompt then starts sampling at once, with exactly the numbers of the first time.
        self.prompt_len = 0
        self.prompt_logits: torch.Tensor | None = None


class SchedulerHooks:
    """Callbacks the engine thread makes, for metrics; these do nothing."""

    def on_submit(self) -> None:
        """A job was accepted into the queue (the event loop's thread)."""

    def on_admit(self, job: Job) -> None:
        """A job got a slot (its prompt and cached token counts are set)."""

    def on_cancel(self) -> None:
        """A cancelled job was dropped."""

    def on_step(self, n_seqs: int, n_tokens: int) -> None:
        """A forward pass ran ``n_seqs`` sequences, ``n_tokens`` tokens in all."""

    def on_first_token(self, seconds: float) -> None:
        """A job sampled its first token, ``seconds`` after it was submitted."""

    def on_token_latency(self, seconds: float) -> None:
        """A job sampled another token, ``seconds`` after its previous one."""

    def on_generated(self, n: int) -> None:
        """``n`` tokens were generated."""

    def on_draft(self, drafted: int, accepted: int) -> None:
        """A verify step checked ``drafted`` draft tokens and kept ``accepted``."""

    def on_finish(self, job: Job) -> None:
        """A job ended normally."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """Runs generation jobs on an engine thread with continuous batching.

    ``n_slots`` KV caches of ``n_ctx`` tokens each are made up front, so memory is bounded;
    at most ``n_slots`` jobs run at once and the rest wait (up to ``max_waiting`` beyond the
    slots; beyond, submit answers 429).
    ``hooks`` receive the events the metrics count. ``spec`` and ``drafter`` (a factory of
    one slot's drafter) turn on speculative decoding.
    """

    def __init__(
        self,
        model: EngineModel,
        tokenizer: EngineTokenizer,
        *,
        n_slots: int,
        n_ctx: int,
        vocab_size: int,
        batch_tokens: int = 256,
        max_waiting: int = 1024,
        hooks: SchedulerHooks | None = None,
        spec: SpecOptions | None = None,
        drafter: Callable[[], Drafter] | None = None,
    ) -> None:
        if n_slots < 1 or n_ctx < 2 or batch_tokens < 1:
            raise FreeTokenError("need at least one slot, a context of 2 and a batch of 1")
        self.model = model
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.vocab_size = vocab_size
        self.batch_tokens = batch_tokens
        self.max_waiting = max_waiting
        self.hooks = hooks or SchedulerHooks()
        self.eog = frozenset(int(t) for t in tokenizer.eog_ids)
        self.spec = spec if spec is not None and spec.enabled and drafter is not None else None
        # A verify step is 1 + n_max tokens: the sliding-window rings must hold that.
        step = max(batch_tokens, self.spec.n_max + 1 if self.spec else 0)
        self.slots = [
            Slot(
                i,
                model.new_cache(n_ctx, max_step=step),
                drafter() if self.spec and drafter else None,
                DraftLength() if self.spec and self.spec.n_auto else None,
            )
            for i in range(n_slots)
        ]
        self._pending: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="freetoken-engine", daemon=True)
        self._piece_cache: dict[int, bytes] = {}
        # The events of the engine thread's current pass, handed over when it ends.
        self._outbox: list[tuple[Job, Event]] = []

    # -- the event loop's side -------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the engine thread; running and waiting jobs get an error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, req: GenerationRequest) -> Job:
        """Queues ``req``; call from the event loop. Raises RequestError for a prompt that
        does not fit the context or when the queue is full."""
        if not req.prompt:
            raise RequestError("the prompt is empty", param="prompt", code="empty_prompt")
        if len(req.prompt) >= self.n_ctx:
            raise RequestError(
                f"the prompt has {len(req.prompt)} tokens; the context size per request is "
                f"{self.n_ctx} (the prompt must leave room for at least one generated token)",
                param="prompt",
                code="context_length_exceeded",
            )
        bad = next((t for t in req.prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside [0, {self.vocab_size})", param="prompt")
        job = Job(req, asyncio.get_running_loop())
        job._limits = self._draft_limits(req.draft)
        with self._cond:
            if self._stopping:
                raise RequestError(
                    "the server is shutting down", status=503, err_type="server_error"
                )
            # Jobs in flight, whether the engine thread has moved them into a slot yet or not:
            # a job just submitted counts once, as its client sees it.
            running = sum(1 for j in self._active if not j.finished)
            if running + len(self._pending) >= len(self.slots) + self.max_waiting:
                raise RequestError(
                    f"too many requests: {running} running and {len(self._pending)} "
                    "waiting; retry later",
                    status=429,
                    code="too_many_requests",
                    err_type="rate_limit_error",
                )
            self._pending.append(job)
            self._cond.notify_all()
        self.hooks.on_submit()
        return job

    def _draft_limits(self, fields: dict[str, float] | None) -> DraftLimits | None:
        """A request's draft limits: the server's with the request's fields; RequestError
        for a value out of range (None: no drafts)."""
        if self.spec is None:
            if fields and fields.get("n_max", 1) > 0:
                raise RequestError(
                    "this server runs without speculative decoding (start it with --spec-type)",
                    param="speculative.n_max",
                )
            return None
        limits = replace(self.spec.limits, **fields) if fields else self.spec.limits  # type: ignore[arg-type]
        for name, value, lo, hi in (
            # Synthetic acceptance has a rate per position of the server's drafts only.
            ("n_max", limits.n_max, 0, self.spec.n_max if self.spec.synth_probs else MAX_DRAFT),
            ("n_min", limits.n_min, 0, limits.n_max),
            ("p_min", limits.p_min, 0.0, 1.0),
        ):
            if not lo <= value <= hi:
                raise RequestError(
                    f"'speculative.{name}' must be in [{lo:g}, {hi:g}], got {value:g}",
                    param=f"speculative.{name}",
                )
        return limits if limits.n_max > 0 else None

    def cancel(self, job: Job) -> None:
        """Cancels ``job`` (a client went away); its slot is freed before the next step."""
        if job.finished:
            return
        with self._cond:
            job.cancelled = True
            self._cond.notify_all()

    # -- status, read from the loop (plain reads of ints and lists) ---------------------------

    @property
    def n_waiting(self) -> int:
        """Jobs queued for a slot."""
        return len(self._pending)

    @property
    def n_running(self) -> int:
        """Jobs holding a slot."""
        return sum(1 for s in self.slots if s.job is not None)

    def kv_tokens(self) -> tuple[int, int, int]:
        """(tokens held by running jobs, tokens kept for prefix reuse, capacity)."""
        busy = idle = 0
        for s in self.slots:
            if s.job is not None:
                busy += s.cache.length
            else:
                idle += s.cache.length
        return busy, idle, len(self.slots) * self.n_ctx

    # -- the engine thread ------------------------------------------------------------------

    def _post(self, job: Job, ev: Event) -> None:
        if ev.finish_reason is not None or ev.error is not None:
            job.finished = True
            if job.t_end is None:
                job.t_end = time.perf_counter()
        self._outbox.append((job, ev))

    def _flush(self) -> None:
        """Hands the pass's events to their clients' event loops in order, one wake-up per
        loop: a wake-up per event writes to the loop's self-pipe and takes the GIL from the
        engine thread once per token of every stream."""
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for job, ev in outbox:
            by_loop.setdefault(job.loop, []).append((job, ev))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
                self._reap()
                self._admit()
            if self._active:
                try:
                    self._step()
                except Exception as e:  # a bug here must not leave clients waiting forever
                    log.exception("scheduler step failed")
                    err = RequestError(f"engine error: {e}", status=500, err_type="server_error")
                    for job in list(self._active):
                        self._post(job, Event(error=err))
                        self._release(job)
            self._flush()
        err = RequestError("the server is shutting down", status=503, err_type="server_error")
        with self._cond:
            for job in [*self._active, *self._pending]:
                self._post(job, Event(error=err))
            self._pending.clear()
        for job in list(self._active):
            self._release(job)
        self._flush()

    def _release(self, job: Job) -> None:
        slot = job._slot
        if slot is not None:
            slot.job = None
            slot.last_used = time.monotonic()
            job._slot = None
        if job in self._active:
            self._active.remove(job)

    def _reap(self) -> None:
        """Drops cancelled jobs (under the lock)."""
        for job in [j for j in self._pending if j.cancelled]:
            self.hooks.on_cancel()
            self._pending.remove(job)
            job.finished = True
        for job in [j for j in self._active if j.cancelled]:
            self.hooks.on_cancel()
            self._release(job)
            job.finished = True

    def _admit(self) -> None:
        """Moves waiting jobs into free slots, each into the one with the best prefix."""
        while self._pending:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self._pending.popleft()
            prompt = job.req.prompt
            reusable = prompt if job.req.cache_prompt else []

            def score(s: Slot, reusable: list[int] = reusable) -> tuple[int, float]:
                n = _common_prefix(s.tokens, reusable)
                return (n if n >= MIN_PREFIX_MATCH else 0, -s.last_used)

            slot = max(free, key=score)
            common = _common_prefix(slot.tokens, reusable)
            if common == len(prompt) == slot.prompt_len and slot.prompt_logits is not None:
                job._ready = slot.prompt_logits  # the same prompt again
            else:
                # A short match (template header) is not worth it: evaluating the prompt from
                # the start keeps its chunking, and so its numbers, as on an empty server.
                common = common if common >= MIN_PREFIX_MATCH else 0
                # The last prompt token runs again: its logits start the generation.
                common = min(common, len(prompt) - 1)
                slot.prompt_logits, slot.prompt_len = None, 0
            kept = slot.cache.truncate(common)
            if slot.drafter is not None:
                slot.drafter.rewind(kept)
            if kept < common:
                # A sliding-window ring no longer holds the keys this prefix needs.
                common, job._ready = kept, None
                slot.prompt_logits, slot.prompt_len = None, 0
            del slot.tokens[common:]
            slot.job = job
            job._slot = slot
            job._n_past = common
            job.cached_tokens = common
            try:
                job._sampler = Sampler(job.req.params, self.vocab_size)
            except FreeTokenError as e:
                self._post(job, Event(error=e))
                self._release(job)
                continue
            job.seed = job._sampler.seed
            if self.spec is not None:
                probs = self.spec.synth_probs
                job._synth = SynthAcceptance(probs, job.seed) if probs else None
            job._history = list(prompt)
            job._text = TextStream(job.req.stop)
            self._active.append(job)
            self.hooks.on_admit(job)

    def _step(self) -> None:
        """One forward pass over every running job."""
        for job in self._active:
            row, job._ready = job._ready, None
            if row is not None:
                self._sample_or_fail(job, row)
        batch: list[tuple[Job, list[int], bool]] = []
        drafts: dict[int, list[int]] = {}
        t0 = time.perf_counter()
        # Decoding jobs whose slot chooses its draft lengths: their steps are timed.
        timed: list[tuple[Job, DraftLength]] = []
        for job in self._active:
            if job._next is not None:
                draft = self._draft(job)
                if draft:
                    drafts[job.id] = draft
                batch.append((job, [job._next, *draft], True))
                length = job._slot.draft_length if job._slot and job._limits else None
                if length is not None:
                    timed.append((job, length))
        budget = self.batch_tokens
        for job in self._active:
            if job._next is not None or budget <= 0:
                continue
            rest = job.req.prompt[job._n_past :]
            # A prompt is cut only at multiples of batch_tokens, as it would be alone, so
            # its result does not depend on what else runs (a rest that does not fit the
            # budget left waits for a step where it comes first).
            if len(rest) > budget and budget < self.batch_tokens:
                continue
            chunk = rest[:budget]
            budget -= len(chunk)
            batch.append((job, chunk, len(chunk) == len(rest)))
        if not batch:
            return
        seqs = []
        for job, toks, _ in batch:
            assert job._slot is not None
            seqs.append((toks, job._slot.cache))
            job._slot.cache.keep_steps = job.id in drafts
        drafters = [job._slot.drafter if job._slot else None for job, _, _ in batch]
        hidden: list[torch.Tensor] | None = (
            [] if any(d is not None and d.needs_hidden for d in drafters) else None
        )
        starts = [c.length for _, c in seqs]
        try:
            logits = self.model.forward_batch(
                seqs, [job.id in drafts for job, _, _ in batch], hidden
            )
            for i, drafter in enumerate(drafters):
                if drafter is not None:  # every step the slot's cache runs, prompts too
                    rows = hidden[i] if hidden is not None else None
                    drafter.observe(seqs[i][0], starts[i], rows)
        except Exception as e:  # a failed step fails its jobs, not the server
            log.exception("engine step failed")
            err = (
                e
                if isinstance(e, RequestError)
                else RequestError(f"engine error: {e}", status=500, err_type="server_error")
            )
            for job, _, _ in batch:
                self._post(job, Event(error=err))
                self._release(job)
            return
        finally:
            for _, cache in seqs:
                cache.keep_steps = False
        self.hooks.on_step(len(batch), sum(len(t) for _, t, _ in batch))
        kept: dict[int, int] = {}
        for (job, toks, ready), row in zip(batch, logits, strict=True):
            slot = job._slot
            assert slot is not None
            slot.tokens += toks
            if job.id in drafts:
                n = self._verify_or_fail(job, row, drafts[job.id])
                if n is not None:
                    kept[job.id] = n
                continue
            if job._next is None:
                job._n_past += len(toks)
                if ready:  # the prompt is in: keep its logits for an identical one
                    slot.prompt_len, slot.prompt_logits = job._n_past, row.clone()
            if ready:
                self._sample_or_fail(job, row)
        # A step's time is all its jobs': a slot choosing its lengths sees the others' in it.
        seconds = time.perf_counter() - t0
        for job, length in timed:
            if job.id in kept or job.id not in drafts:
                length.record(len(drafts.get(job.id, [])), kept.get(job.id, 0), seconds)

    def _draft(self, job: Job) -> list[int]:
        """The draft after a decoding job's sampled token (none without speculation)."""
        slot, limits = job._slot, job._limits
        if slot is None or slot.drafter is None or limits is None:
            return []
        room = min(
            limits.n_max,
            job.req.max_tokens - job.completion_tokens - 1,
            self.n_ctx - slot.cache.length - 2,
        )
        if slot.draft_length is not None:
            room = min(room, slot.draft_length.choose(limits))
        if room <= 0:
            return []
        return slot.drafter.draft(job._history, replace(limits, n_max=room))

    def _verify_or_fail(self, job: Job, rows: torch.Tensor, draft: list[int]) -> int | None:
        """Keeps the drafts the rule accepts, emits them and the target's token after them,
        and cuts the slot back to the tokens kept; how many were kept (None: failed)."""
        slot, sampler = job._slot, job._sampler
        assert slot is not None and sampler is not None and slot.drafter is not None
        try:
            eog = () if job.req.ignore_eos else self.eog
            out = verify_tokens(sampler, rows, job._history, draft, eog, job._synth)
            kept = len(out) - 1
            length = slot.cache.length - len(draft) + kept
            cut_cache(slot.cache, slot.drafter, length)
            del slot.tokens[length:]
        except Exception as e:
            self._fail(job, e, "verify")
            return None
        job.drafted += len(draft)
        job.accepted += kept
        self.hooks.on_draft(len(draft), kept)
        for i, tok in enumerate(out):
            self._emit(job, tok, rows[i])
            if job._slot is None:  # finished
                break
        return kept

    def _fail(self, job: Job, e: Exception, what: str) -> None:
        log.exception("%s failed", what)
        err = (
            e
            if isinstance(e, FreeTokenError)
            else RequestError(f"{what} error: {e}", status=500, err_type="server_error")
        )
        self._post(job, Event(error=err))
        self._release(job)

    def _sample_or_fail(self, job: Job, row: torch.Tensor) -> None:
        try:
            self._sample(job, row)
        except Exception as e:
            self._fail(job, e, "sampling")

    def _piece(self, tok: int) -> bytes:
        piece = self._piece_cache.get(tok)
        if piece is None:
            piece = self.tokenizer.token_to_piece(tok)
            self._piece_cache[tok] = piece
        return piece

    def _logprobs(self, job: Job, row: torch.Tensor, tok: int) -> TokenLogprob:
        lp = torch.log_softmax(row.float(), dim=-1)
        k = job.req.logprobs or 0
        top: list[tuple[int, bytes, float]] = []
        if k > 0:
            vals, ids = torch.topk(lp, k)
            top = [(i, self._piece(i), v) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        return TokenLogprob(tok, self._piece(tok), float(lp[tok]), top)

    def _sample(self, job: Job, row: torch.Tensor) -> None:
        assert job._sampler is not None
        self._emit(job, job._sampler.sample(row, job._history), row)

    def _emit(self, job: Job, tok: int, row: torch.Tensor) -> None:
        """Hands ``tok`` (chosen from ``row``) to the job: its text, the end of generation,
        or the token to feed next."""
        assert job._text is not None and job._slot is not None
        now = time.perf_counter()
        if job.t_first is None:
            job.t_first = now
            self.hooks.on_first_token(now - job.t_submit)
        else:
            self.hooks.on_token_latency(now - job._t_last)
        job._t_last = now
        if tok in self.eog and not job.req.ignore_eos:
            self._finish(job, "stop", Event())
            return
        job.completion_tokens += 1
        job._history.append(tok)
        self.hooks.on_generated(1)
        ev = Event(text=job._text.feed(self._piece(tok)), n_tokens=1)
        if job.req.logprobs is not None:
            ev.logprobs.append(self._logprobs(job, row, tok))
        if job._text.stopped:
            self._finish(job, "stop", ev)
        elif job.completion_tokens >= job.req.max_tokens or job._slot.cache.length >= self.n_ctx:
            self._finish(job, "length", ev)
        else:
            job._next = tok
            self._post(job, ev)

    def _finish(self, job: Job, reason: str, ev: Event) -> None:
        assert job._text is not None
        ev.text += job._text.finish()
        ev.finish_reason = reason
        job.stop_string = job._text.stop_string
        job._next = None
        # Counted before the slot is seen free, so that an idle server's counts add up.
        job.t_end = time.perf_counter()
        self.hooks.on_finish(job)
        self._release(job)
        self._post(job, ev)
