"""``freetoken serve``: an asyncio OpenAI-compatible server over one loaded model.

``add_arguments`` declares the flags (llama.cpp's names), ``run`` loads the model, starts the
engine thread and serves until SIGINT or SIGTERM. ``build_state`` is the same wiring for
callers that run their own event loop (tests, embedding).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from freetoken.engine import options as engine_options
from freetoken.engine import spec_options

if TYPE_CHECKING:
    from freetoken.server.scheduler import SchedulerHooks

__all__ = ["add_arguments", "build_state", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the ``serve`` flags to ``p``."""
    p.add_argument("-m", "--model", help="GGUF model path (default: the embedded Gemma 3 270M)")
    p.add_argument("--alias", help="model name the API reports and accepts (default: file name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"), help="require it")
    p.add_argument("-np", "--parallel", type=int, default=4, help="KV slots (requests at once)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context per slot (0: model's)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument(
        "-b", "--batch-size", type=int, default=256, help="prompt tokens evaluated per step"
    )
    p.add_argument(
        "-to",
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a client may take to send its body or to read one streamed event",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=1024,
        help="requests running or waiting for a slot; beyond, 429 with Retry-After",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    engine_options.add_arguments(p)
    spec_options.add_arguments(p)


def _model_names(path: str, alias: str) -> frozenset[str]:
    base = os.path.basename(path)
    stem = base[:-5] if base.endswith(".gguf") else base
    return frozenset({alias, base, stem, path})


#: The MoE engine's per-layer counters (``model.moe.counters.snapshot()`` fields), exported
#: summed over layers: (metric suffix, field, kind, help).
MOE_SERIES = (
    ("layer_steps_total", "steps", "counter", "MoE layer evaluations (layers x forward passes)"),
    ("routes_total", "routes", "counter", "Token-to-expert routes computed"),
    ("experts_total", "experts", "counter", "Distinct experts computed, summed per layer and step"),
    ("expert_bytes_total", "bytes", "counter", "Expert weight bytes read"),
    ("last_step_routes", "last_routes", "gauge", "Routes in the last forward pass, all layers"),
    (
        "last_step_experts",
        "last_experts",
        "gauge",
        "Distinct experts in the last forward pass, all layers",
    ),
    (
        "last_step_expert_bytes",
        "last_bytes",
        "gauge",
        "Expert weight bytes read in the last forward pass",
    ),
)


def _moe_counters(model: Any) -> Any:
    """A metrics source for the MoE counters of ``model`` (nothing for a dense model)."""
    moe = getattr(model, "moe", None)

    def source() -> list[tuple[str, str, str, float]]:
        if moe is None:
            return []
        snap = moe.collect().snapshot()
        return [
            (f"freetoken_moe_{name}", kind, help_text, float(sum(getattr(s, f) for s in snap)))
            for name, f, kind, help_text in MOE_SERIES
        ]

    return source


#: Where routes were computed (engine/audit.py), summed over the MoE layers.
PLACEMENT_SERIES = (
    ("routes", "counter", "Routes through the MoE layers"),
    ("gpu_routes", "counter", "Routes served from a GPU expert slot"),
    ("cpu_routes", "counter", "Routes computed by the CPU expert executor"),
    ("seeded_hits", "counter", "GPU routes on experts seeded from the plan or profile"),
    ("filled_hits", "counter", "GPU routes on experts filled into slots later (hybrid)"),
    (
        "fetched_routes",
        "counter",
        "GPU routes on experts uploaded for their step only (hybrid, steps of several tokens)",
    ),
    ("uploaded_bytes", "counter", "Expert bytes uploaded to the GPU (slots, staging)"),
)
#: Hybrid's split steps per step size (label ``tokens``: "1", "2-4", ...; engine/hybrid.py,
#: FETCH_FIELDS): (counter field, metric suffix, help).
FETCH_SERIES = (
    ("steps", "steps_total", "Split steps (GPU and CPU), by tokens a step"),
    (
        "uploaded_routes",
        "uploaded_routes_total",
        "Routes whose missed expert was uploaded for the step and computed on the GPU",
    ),
    ("cpu_routes", "cpu_routes_total", "Routes computed on the CPU in split steps"),
    ("uploaded_bytes", "uploaded_bytes_total", "Expert bytes uploaded for split steps"),
    ("cpu_bytes", "cpu_bytes_total", "Expert bytes the CPU read in split steps"),
    ("upload_s", "upload_seconds_total", "Seconds the split steps' uploads took"),
    ("cpu_s", "cpu_seconds_total", "Seconds the CPU spent answering split steps"),
)


def _expert_placement(llm: Any) -> Any:
    """A metrics source for :func:`freetoken.engine.audit.expert_counters`."""
    from freetoken.engine.audit import expert_counters

    def source() -> list[tuple[str, str, str, float]]:
        c = expert_counters(llm.model, llm.placement)
        if not c["layers"]:
            return []
        sums = {k: sum(la.get(k, 0) for la in c["layers"].values()) for k, *_ in PLACEMENT_SERIES}
        sums["cpu_routes"] = sums["routes"] - sums["gpu_routes"] - sums["fetched_routes"]
        sums["uploaded_bytes"] = c.get("uploaded_bytes", 0)
        fetch = c.get("fetch", {})
        return [
            (f"freetoken_moe_{name}_total", kind, help_text, float(sums[name]))
            for name, kind, help_text in PLACEMENT_SERIES
        ] + [
            (f'freetoken_moe_fetch_{suffix}{{tokens="{size}"}}', "counter", help_text, float(v[f]))
            for f, suffix, help_text in FETCH_SERIES
            for size, v in fetch.items()
        ]

    return source


class _Audited:
    """The metrics hooks, plus an audit record per finished request."""

    def __init__(self, hooks: Any, audit: Any) -> None:
        self._hooks, self._audit = hooks, audit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hooks, name)

    def on_finish(self, job: Any) -> None:
        self._hooks.on_finish(job)
        self._audit.record(
            request=job.id,
            prompt_tokens=job.prompt_tokens,
            cached_tokens=job.cached_tokens,
            generated_tokens=job.completion_tokens,
            drafted=job.drafted,
            accepted=job.accepted,
        )


def build_state(
    llm: Any,
    *,
    alias: str | None = None,
    n_slots: int = 4,
    n_ctx: int | None = None,
    api_key: str | None = None,
    batch_tokens: int = 256,
    timeout: float = 600.0,
    max_concurrent: int = 1024,
) -> Any:
    """Wires a loaded :class:`freetoken.LLM` into a started scheduler and a
    :class:`~freetoken.server.app.ServerState` (stop it with ``state.scheduler.stop()``)."""
    from freetoken.server.app import ServerConfig, ServerState
    from freetoken.server.metrics import ServerMetrics
    from freetoken.server.scheduler import Scheduler

    n_ctx = n_ctx or llm.n_ctx
    alias = alias or os.path.basename(llm.path)
    holder: dict[str, ServerState] = {}
    metrics = ServerMetrics(lambda: holder["state"].status())
    metrics.registry.add_source(_moe_counters(llm.model))
    metrics.registry.add_source(_expert_placement(llm))
    drafters = None if llm.drafters is None else functools.partial(llm.drafters, n_ctx)
    scheduler = Scheduler(
        llm.model,
        llm.tokenizer,
        n_slots=n_slots,
        n_ctx=n_ctx,
        vocab_size=llm.vocab_size,
        batch_tokens=batch_tokens,
        max_waiting=max_concurrent - n_slots,
        hooks=metrics
        if llm.audit is None
        else cast("SchedulerHooks", _Audited(metrics, llm.audit)),
        spec=llm.spec,
        drafter=drafters,
    )
    template = getattr(llm.tokenizer, "chat_template", None)
    cfg = ServerConfig(
        alias=alias,
        model_names=_model_names(llm.path, alias),
        n_ctx=n_ctx,
        vocab_size=llm.vocab_size,
        api_key=api_key or None,
        chat_template=template if isinstance(template, str) else None,
        created=int(time.time()),
        timeout=timeout,
    )
    state = holder["state"] = ServerState(scheduler, llm.tokenizer, cfg, metrics)
    scheduler.start()
    return state


def run(args: argparse.Namespace) -> int:
    """Runs the server until interrupted; returns the exit status."""
    from freetoken.errors import InvalidInputError
    from freetoken.server.app import serve
    from freetoken.server.routes import create_app

    if args.parallel < 1:
        raise InvalidInputError(f"--parallel must be at least 1, got {args.parallel}")
    if args.batch_size < 1:
        raise InvalidInputError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_concurrent_requests < args.parallel:
        raise InvalidInputError(
            f"--max-concurrent-requests ({args.max_concurrent_requests}) must be at least "
            f"--parallel ({args.parallel})"
        )
    if not args.timeout > 0:
        raise InvalidInputError(f"--timeout must be positive, got {args.timeout}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    from freetoken.llm import load_llm

    llm = load_llm(args)
    state = build_state(
        llm,
        alias=args.alias,
        n_slots=args.parallel,
        n_ctx=llm.n_ctx,
        api_key=args.api_key,
        batch_tokens=args.batch_size,
        timeout=args.timeout,
        max_concurrent=args.max_concurrent_requests,
    )

    def ready(host: str, port: int) -> None:
        print(f"freetoken: serving {state.cfg.alias} on http://{host}:{port}", flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(create_app(state), args.host, args.port, stop, ready)

    try:
        asyncio.run(main())
    except OSError as e:  # the address is taken or not ours
        print(
            f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr
        )
        return 2
    finally:
        state.scheduler.stop()
        state.pool.shutdown(wait=False)
    print("freetoken: stopped", file=sys.stderr)
    return 0
