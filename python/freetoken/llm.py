"""``freetoken.LLM``: load a GGUF model and generate text; the engine the CLI and the server
drive."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from os import PathLike
from typing import TYPE_CHECKING, Any

import torch

from freetoken import _core
from freetoken.default_model import default_model_path
from freetoken.engine import options as engine_options
from freetoken.engine import spec_options
from freetoken.engine.audit import ExpertAudit
from freetoken.engine.draft_length import DraftLength
from freetoken.engine.options import EngineOptions
from freetoken.engine.repack import RepackStats, cpu_served, quantized_weights, repack
from freetoken.engine.spec_options import SpecOptions
from freetoken.engine.speculative import (
    Drafter,
    SynthAcceptance,
    check_draft_vocab,
    cut_cache,
    drafter_factory,
    verify_tokens,
)
from freetoken.errors import InvalidInputError, UnsupportedError
from freetoken.gguf import GGUFFile
from freetoken.models import load_model
from freetoken.models.transformer import Transformer
from freetoken.progress import ProgressBar
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.moe import default_threads
from freetoken.runtime.sampler import Sampler, SamplingParams
from freetoken.runtime.speculative import SpecCounters
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer.textstream import StopFilter

if TYPE_CHECKING:
    from freetoken.engine.placement import Placement

__all__ = ["LLM", "GenerationStats", "load_llm"]

#: Tokens evaluated per forward pass while reading a prompt.
PROMPT_CHUNK = 512

log = logging.getLogger("freetoken")


def _log_step(kind: str, n_tokens: int, t0: float) -> None:
    """One forward pass's figures at DEBUG level (``-v``)."""
    if log.isEnabledFor(logging.DEBUG):
        ms = (time.perf_counter() - t0) * 1e3
        log.debug("%s step: %d tokens, %.2f ms, %.1f t/s", kind, n_tokens, ms, n_tokens / ms * 1e3)


@dataclass
class GenerationStats:
    """Token counts and wall time of the last generation."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    #: Speculative decoding: tokens drafted and accepted, verify steps by length.
    spec: SpecCounters | None = None

    @property
    def prompt_tokens_per_s(self) -> float:
        """Prompt tokens evaluated per second."""
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        """Tokens generated per second (after the first)."""
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0


class LLM:
    """A loaded model with its tokenizer and one KV cache.

    ``model`` is a GGUF path, or None for the embedded default model. The engine keeps the
    tokens of the last request, so a following request that shares a prefix (a chat turn)
    evaluates only what is new.

    Process-wide settings: loading sets torch's intra-op threads to 1 (``torch.set_num_threads``;
    the Rust pools run the heavy products and torch's threads would only contend with them)
    and, with ``n_threads`` or ``engine.poll``, sizes FreeToken's own CPU pool.
    :meth:`close` (or leaving a ``with LLM(...)`` block) puts torch's thread count back.
    Placement, pools and per-step figures are logged on the ``freetoken`` logger (INFO and
    DEBUG); nothing is printed. ``spec`` turns on speculative decoding
    (engine/speculative.py).
    """

    def __init__(
        self,
        model: str | PathLike[str] | None = None,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        progress: bool = False,
        engine: EngineOptions | None = None,
        spec: SpecOptions | None = None,
    ) -> None:
        path = default_model_path() if model is None else model
        engine = engine or EngineOptions()
        if n_threads is not None and n_threads < 1:
            raise InvalidInputError(f"n_threads must be at least 1, got {n_threads}")
        self.path = os.fspath(path)
        name = os.path.basename(self.path)
        reading = ProgressBar(f"reading {name}") if progress and not engine.mmap else None
        # The file first: a bad one is the one error reported, before the device is chosen.
        self.gguf = GGUFFile(self.path, mmap=engine.mmap, progress=reading)
        with_gpu = engine_options.use_gpu(engine)
        if with_gpu and (engine.cache_type_k, engine.cache_type_v) != ("f32", "f32"):
            raise UnsupportedError(
                "--cache-type-k/-v f16 runs on the CPU engine: GPU KV caches are f32 "
                "(--device cpu, or leave the cache types at f32)"
            )
        poll_us = engine.pool_poll_us(with_gpu)
        if n_threads is not None or poll_us is not None:
            _core.set_num_threads(n_threads or _core.num_threads(), poll_us)
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        bar = ProgressBar(f"loading {name}") if progress else None
        # -t sizes the expert executor too unless --moe-cpu-threads does (llama.cpp's -t). On
        # the CPU engine an executor of the process pool's size shares that pool.
        moe_threads = engine.moe_cpu_threads or n_threads or default_threads(with_gpu)
        shared = not with_gpu and moe_threads == _core.num_threads()
        self.model = load_model(
            self.gguf, bar, moe_threads, engine.moe_cpu_precise, poll_us, moe_shared=shared
        )
        self.model.swa_full = engine.swa_full
        self.model.kv_dtypes = engine.kv_dtypes
        self.tokenizer = Tokenizer.from_gguf_metadata(self.gguf.metadata)
        if n_ctx <= 0:
            n_ctx = self.model.cfg.context_length
        self.n_ctx = n_ctx
        #: Where the model went (None: all on the CPU).
        self.placement: Placement | None = None
        if engine_options.use_gpu(engine):
            from freetoken.engine.placement import place

            self.placement = place(self.model, engine, n_ctx)
        #: What was repacked for the CPU kernels at load (engine/repack.py; None: ``--no-repack``).
        self.repacked: RepackStats | None = None
        if engine.repack:
            cpu_only = (
                quantized_weights(self.model)
                if self.placement is None
                else cpu_served(self.model, self.placement)
            )
            bar = ProgressBar(f"repacking {name}") if progress and cpu_only else None
            self.repacked = repack(cpu_only, self.gguf, bar)
            log.info(
                "repacked %d of %d weight matrices for the CPU kernels (%s), %.0f MiB of the "
                "mapping released",
                self.repacked.packed,
                self.repacked.seen,
                _core.cpu_kernel_isa(),
                self.repacked.released / (1 << 20),
            )
        #: ``--moe-cache-audit``: a record per generation (None: off).
        self.audit = (
            ExpertAudit(engine.moe_cache_audit, self.model, self.placement)
            if engine.moe_cache_audit
            else None
        )
        self.spec = spec or SpecOptions()
        #: draft-simple's model.
        self.draft: Transformer | None = None
        if self.spec.draft_model is not None:
            draft_gguf = GGUFFile(self.spec.draft_model, mmap=engine.mmap)
            check_draft_vocab(self.gguf, draft_gguf)
            self.draft = load_model(draft_gguf, None, moe_threads, moe_shared=shared)
            self.draft.kv_dtypes = engine.kv_dtypes
            # The draft model runs on the CPU whatever the target's placement.
            if engine.repack:
                repack(quantized_weights(self.draft), draft_gguf)
        #: Makes a sequence's drafter for a context of the tokens given (None: no
        #: speculative decoding).
        self.drafters: Callable[[int], Drafter] | None = None
        if self.spec.enabled:
            self.drafters = drafter_factory(
                self.spec, self.model, self.gguf, self.draft, self.placement
            )
        self._drafter: Drafter | None = None
        #: ``--spec-draft-n-auto``: chooses each step's draft length (it keeps what the steps
        #: cost from one generation to the next).
        self._draft_length = DraftLength() if self.spec.n_auto else None
        # Allocated on first use: the server brings its own caches.
        self._cache: KVCache | None = None
        self._tokens: list[int] = []
        self._lock = threading.Lock()
        self.last_stats = GenerationStats()

    def close(self) -> None:
        """Puts torch's intra-op thread count back as it was before loading and drops the KV
        cache. The model stays usable (at torch's thread count)."""
        torch.set_num_threads(self._torch_threads)
        self._cache = None
        self._drafter = None
        self._tokens = []

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def vocab_size(self) -> int:
        """Rows of the output projection."""
        return self.model.cfg.vocab_size

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text`` (BOS added per the model when ``add_special``)."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``."""
        return self.tokenizer.decode(list(tokens))

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Teacher-forced float32 logits ``[len(tokens), vocab]`` from an empty context."""
        tokens = list(tokens)
        cache = self.model.new_cache(max(len(tokens), 1))
        parts = [
            self.model.forward(tokens[i : i + PROMPT_CHUNK], cache, all_logits=True)
            for i in range(0, len(tokens), PROMPT_CHUNK)
        ]
        return torch.cat(parts) if parts else torch.empty(0, self.vocab_size)

    def _evaluate(self, tokens: list[int]) -> torch.Tensor:
        """Logits after ``tokens``, reusing the cached prefix shared with the last request."""
        if not tokens:
            raise InvalidInputError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise InvalidInputError(
                f"the prompt has {len(tokens)} tokens, the context size is {self.n_ctx}"
            )
        common = 0
        for a, b in zip(self._tokens, tokens, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token must run to give logits
        if self._cache is None:
            self._cache = self.model.new_cache(self.n_ctx, max_step=PROMPT_CHUNK)
            if self.drafters is not None:
                self._drafter = self.drafters(self.n_ctx)
        common = self._cache.truncate(common)
        if self._drafter is not None:
            self._drafter.rewind(common)
        self._tokens = tokens[:common]
        logits = torch.empty(0)
        for i in range(common, len(tokens), PROMPT_CHUNK):
            chunk = tokens[i : i + PROMPT_CHUNK]
            t0 = time.perf_counter()
            logits = self._run(chunk, all_logits=False)
            _log_step("prompt", len(chunk), t0)
        return logits

    def _run(self, tokens: list[int], all_logits: bool) -> torch.Tensor:
        """One forward step of ``tokens`` after the cache's, shown to the drafter."""
        cache, drafter = self._cache, self._drafter
        assert cache is not None
        start = cache.length
        hidden: list[torch.Tensor] | None = (
            [] if drafter is not None and drafter.needs_hidden else None
        )
        logits = self.model.forward_batch([(tokens, cache)], all_logits, hidden)[0]
        if drafter is not None:
            drafter.observe(tokens, start, hidden[0] if hidden is not None else None)
        self._tokens += tokens
        return logits

    def stream_tokens(
        self, prompt_tokens: list[int], max_tokens: int, params: SamplingParams
    ) -> Iterator[int]:
        """Yields sampled token ids after ``prompt_tokens`` until an end-of-generation token,
        ``max_tokens``, or the context end. Stats go to ``last_stats``."""
        if max_tokens < 0:
            raise InvalidInputError(f"max_tokens must be non-negative, got {max_tokens}")
        with self._lock:
            stats = self.last_stats = GenerationStats(prompt_tokens=len(prompt_tokens))
            t0 = time.perf_counter()
            logits = self._evaluate(prompt_tokens)
            cache = self._cache
            assert cache is not None  # _evaluate made it
            stats.prompt_seconds = time.perf_counter() - t0
            sampler = Sampler(params, self.vocab_size)
            history = list(prompt_tokens)
            t1 = time.perf_counter()
            if self._drafter is not None:
                stats.spec = SpecCounters()
                yield from self._speculate(logits, sampler, history, max_tokens, stats)
                max_tokens = 0
            for n in range(max_tokens):
                tok = sampler.sample(logits, history)
                if tok in self.tokenizer.eog_ids:
                    break
                history.append(tok)
                yield tok
                if n + 1 == max_tokens or len(self._tokens) + 1 >= self.n_ctx:
                    break
                t2 = time.perf_counter()
                logits = self._run([tok], all_logits=False)
                _log_step("decode", 1, t2)
                stats.generated_tokens = n + 1
                stats.generation_seconds = time.perf_counter() - t1
            stats.generated_tokens = len(history) - len(prompt_tokens)
            stats.generation_seconds = time.perf_counter() - t1
            if self.audit is not None:
                spec = {}
                if stats.spec is not None:
                    spec = {"drafted": stats.spec.drafted, "accepted": stats.spec.accepted}
                self.audit.record(
                    prompt_tokens=stats.prompt_tokens,
                    generated_tokens=stats.generated_tokens,
                    **spec,
                )

    def _speculate(
        self,
        logits: torch.Tensor,
        sampler: Sampler,
        history: list[int],
        max_tokens: int,
        stats: GenerationStats,
    ) -> Iterator[int]:
        """:meth:`stream_tokens`' generation with speculative decoding: each step verifies
        the sampled token and a draft after it in one forward step."""
        cache, drafter, counters = self._cache, self._drafter, stats.spec
        assert cache is not None and drafter is not None and counters is not None
        eog = self.tokenizer.eog_ids
        probs = self.spec.synth_probs
        synth = SynthAcceptance(probs, sampler.seed) if probs else None
        pending = [sampler.sample(logits, history)] if max_tokens else []
        n = 0
        t1 = time.perf_counter()
        while pending:
            for tok in pending:
                if tok in eog:
                    return
                history.append(tok)
                yield tok
                n += 1
                stats.generated_tokens = n
                stats.generation_seconds = time.perf_counter() - t1
                if n == max_tokens or len(self._tokens) + 1 >= self.n_ctx:
                    return
            tok = pending[-1]
            t2 = time.perf_counter()
            n_max = self.spec.n_max
            if self._draft_length is not None:
                n_max = self._draft_length.choose(self.spec.limits)
            # Drafts past the last token asked for, or the context, are not worth a row.
            room = min(n_max, max_tokens - n - 1, self.n_ctx - len(self._tokens) - 2)
            limits = replace(self.spec.limits, n_max=room)
            draft = drafter.draft(history, limits) if room > 0 else []
            t3 = time.perf_counter()
            cache.keep_steps = bool(draft)
            try:
                rows = self._run([tok, *draft], all_logits=True)
            finally:
                cache.keep_steps = False
            _log_step("verify", len(draft) + 1, t3)
            pending = verify_tokens(sampler, rows, history, draft, eog, synth)
            kept = len(pending) - 1
            counters.add(len(draft), kept)
            length = len(self._tokens) - len(draft) + kept
            cut_cache(cache, drafter, length)
            del self._tokens[length:]
            if self._draft_length is not None:
                self._draft_length.record(len(draft), kept, time.perf_counter() - t2)

    def _stream_text(
        self, tokens: list[int], max_tokens: int, params: SamplingParams, stop: Sequence[str]
    ) -> Iterator[str]:
        decoder = self.tokenizer.incremental_decoder()
        stops = StopFilter(stop)
        for tok in self.stream_tokens(tokens, max_tokens, params):
            text = stops.feed(decoder.add(tok))
            if text:
                yield text
            if stops.stopped:
                return
        tail = stops.feed(decoder.flush()) + stops.flush()
        if tail:
            yield tail

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        stream: bool = False,
        stop: Sequence[str] = (),
        add_special: bool = True,
        **sampling: Any,
    ) -> str | Iterator[str]:
        """Continues ``prompt`` (text, or token ids). ``sampling`` takes the fields of
        :class:`SamplingParams` (temperature, top_k, top_p, min_p, repeat_penalty, ...,
        seed). With ``stream=True`` returns an iterator of text pieces."""
        params = SamplingParams(**sampling)
        tokens = (
            self.tokenize(prompt, add_special=add_special)
            if isinstance(prompt, str)
            else [int(t) for t in prompt]
        )
        pieces = self._stream_text(tokens, max_tokens, params, stop)
        return pieces if stream else "".join(pieces)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        max_tokens: int = 512,
        stream: bool = False,
        stop: Sequence[str] = (),
        **sampling: Any,
    ) -> str | Iterator[str]:
        """Answers a conversation (``[{"role": ..., "content": ...}]``) rendered with the
        model's chat template; same options as :meth:`generate`."""
        tokens = self.tokenizer.encode_chat(list(messages), add_generation_prompt=True)
        return self.generate(tokens, max_tokens=max_tokens, stream=stream, stop=stop, **sampling)


def load_llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    """The model of the common flags (``-m``, ``-c``, ``-t``, the engine flags and, where the
    command has them, the speculative decoding flags), loaded with a progress bar;
    ``overrides`` replace LLM arguments (``n_ctx``, ``progress``...)."""
    kwargs: dict[str, Any] = dict(
        n_ctx=args.ctx_size,
        n_threads=args.threads,
        progress=True,
        engine=engine_options.from_args(args),
    )
    if hasattr(args, "spec_type"):
        kwargs["spec"] = spec_options.from_args(args)
    return LLM(args.model, **(kwargs | overrides))
