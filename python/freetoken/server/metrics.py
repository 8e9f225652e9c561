"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Counters and histograms are updated from the engine thread and the event loop alike, so each
update takes a lock; gauges are read through callbacks at scrape time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from freetoken.server.scheduler import Job, SchedulerHooks

__all__ = ["Counter", "Gauge", "Histogram", "Registry", "ServerMetrics"]

Labels = tuple[tuple[str, str], ...]
M = TypeVar("M", bound="_Metric")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A monotonically increasing count, optionally split by labels."""

    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Adds ``amount`` (>= 0) to the series named by ``labels``."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """The current value of one series (0 if it was never incremented)."""
        with self._lock:
            return self._values.get(tuple(sorted(labels.items())), 0.0)

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items()) or [((), 0.0)]
        return [f"{self.name}{_labels(k)} {_num(v)}" for k, v in items]


def _reader(status: Callable[[], dict[str, float]], key: str) -> Callable[[], float]:
    """A gauge's function: ``status()[key]`` at scrape time."""
    return lambda: status()[key]


class Gauge(_Metric):
    """A value read at scrape time from ``fn``."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, fn: Callable[[], float]) -> None:
        super().__init__(name, help_text)
        self.fn = fn

    def samples(self) -> list[str]:
        return [f"{self.name} {_num(self.fn())}"]


class Histogram(_Metric):
    """Observations counted into cumulative ``le`` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        self.bounds = sorted(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._n = 0

    def observe(self, x: float) -> None:
        """Records one observation."""
        i = next((i for i, b in enumerate(self.bounds) if x <= b), len(self.bounds))
        with self._lock:
            self._counts[i] += 1
            self._sum += x
            self._n += 1

    @property
    def count(self) -> int:
        """How many observations were recorded."""
        return self._n

    def samples(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._n
        out, cum = [], 0
        for bound, c in zip([*self.bounds, math.inf], counts, strict=True):
            cum += c
            out.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cum}')
        out.append(f"{self.name}_sum {_num(total)}")
        out.append(f"{self.name}_count {n}")
        return out


class Registry:
    """The server's metrics, rendered together by :meth:`render`."""

    def __init__(self) -> None:
        self._metrics: list[_Metric] = []
        self._extra: list[Callable[[], Iterable[tuple[str, str, str, float]]]] = []

    def add(self, metric: M) -> M:
        """Registers ``metric``; returns it."""
        self._metrics.append(metric)
        return metric

    def add_source(self, fn: Callable[[], Iterable[tuple[str, str, str, float]]]) -> None:
        """Registers a callback yielding ``(name, kind, help, value)`` at scrape time, for
        counters the engine keeps itself (the MoE cache's). A name may carry labels
        (``name{tokens="2-4"}``); a metric's series come one after another."""
        self._extra.append(fn)

    def render(self) -> str:
        """All metrics in the Prometheus text format."""
        lines: list[str] = []
        for m in self._metrics:
            lines += m.header()
            lines += m.samples()
        for fn in self._extra:
            named = ""
            for name, kind, help_text, value in fn():
                base = name.split("{", 1)[0]
                if base != named:
                    lines += [f"# HELP {base} {help_text}", f"# TYPE {base} {kind}"]
                    named = base
                lines.append(f"{name} {_num(value)}")
        return "\n".join(lines) + "\n"


TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics(SchedulerHooks):
    """The series ``/metrics`` serves; the scheduler feeds them through its hooks."""

    def __init__(self, scheduler_status: Callable[[], dict[str, float]]) -> None:
        self.registry = r = Registry()
        self.requests = r.add(
            Counter("freetoken_requests_total", "HTTP requests answered, by endpoint and status")
        )
        self.prompt_tokens = r.add(
            Counter("freetoken_prompt_tokens_total", "Prompt tokens of admitted requests")
        )
        self.cached_tokens = r.add(
            Counter(
                "freetoken_prompt_tokens_cached_total",
                "Prompt tokens reused from the prefix cache instead of evaluated",
            )
        )
        self.generated = r.add(Counter("freetoken_generation_tokens_total", "Tokens generated"))
        self.drafted = r.add(
            Counter("freetoken_spec_drafted_tokens_total", "Speculative draft tokens verified")
        )
        self.accepted = r.add(
            Counter(
                "freetoken_spec_accepted_tokens_total", "Speculative draft tokens kept by verify"
            )
        )
        self.started = r.add(
            Counter(
                "freetoken_requests_started_total",
                "Generations accepted; each ends finished or cancelled",
            )
        )
        self.finished = r.add(
            Counter("freetoken_requests_finished_total", "Generations that ran to their end")
        )
        self.cancelled = r.add(
            Counter(
                "freetoken_requests_cancelled_total",
                "Generations cancelled because the client went away",
            )
        )
        self.ttft = r.add(
            Histogram(
                "freetoken_time_to_first_token_seconds",
                "From request submission to the first generated token",
                TTFT_BUCKETS,
            )
        )
        self.itl = r.add(
            Histogram(
                "freetoken_inter_token_latency_seconds",
                "Between consecutive generated tokens of one request",
                ITL_BUCKETS,
            )
        )
        self.duration = r.add(
            Histogram(
                "freetoken_request_duration_seconds",
                "From request submission to its last token",
                DURATION_BUCKETS,
            )
        )
        self.step_seqs = r.add(
            Histogram(
                "freetoken_batch_sequences",
                "Sequences per forward pass (continuous batching at work)",
                BATCH_BUCKETS,
            )
        )
        self.step_tokens = r.add(
            Counter("freetoken_batch_tokens_total", "Tokens evaluated by forward passes")
        )
        gauges = {
            "requests_waiting": "Requests queued for a slot (queue depth)",
            "requests_running": "Requests holding a slot",
            "slots_total": "KV cache slots (--parallel)",
            "kv_cache_tokens_used": "KV cache tokens held by running requests",
            "kv_cache_tokens_cached": "KV cache tokens kept in idle slots for prefix reuse",
            "kv_cache_tokens_capacity": "KV cache capacity in tokens, all slots",
            "kv_cache_usage_ratio": "Fraction of the KV cache held by running requests",
        }
        for key, help_text in gauges.items():
            r.add(Gauge(f"freetoken_{key}", help_text, _reader(scheduler_status, key)))

    def render(self) -> str:
        """The Prometheus text of every series."""
        return self.registry.render()

    # -- scheduler hooks (engine thread) -----------------------------------------------------

    def on_submit(self) -> None:
        self.started.inc()

    def on_admit(self, job: Job) -> None:
        self.prompt_tokens.inc(job.prompt_tokens)
        self.cached_tokens.inc(job.cached_tokens)

    def on_cancel(self) -> None:
        self.cancelled.inc()

    def on_step(self, n_seqs: int, n_tokens: int) -> None:
        self.step_seqs.observe(n_seqs)
        self.step_tokens.inc(n_tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_token_latency(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_generated(self, n: int) -> None:
        self.generated.inc(n)

    def on_draft(self, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def on_finish(self, job: Job) -> None:
        self.finished.inc()
        if job.t_end is not None:
            self.duration.observe(job.t_end - job.t_submit)
