"""``--moe-cache-audit FILE.jsonl`` (engine/audit.py) and the same counters on ``/metrics``,
on the CPU (the GPU strategies' records: tests/test_gpu_models.py). Expected counts come from
the generation's own arithmetic: a fresh cache evaluates the prompt and every generated token
but the last, each through every MoE layer with ``top_k`` routes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from freetoken.engine.hybrid import FETCH_FIELDS, HybridStats
from freetoken.engine.options import EngineOptions
from freetoken.errors import FileAccessError
from freetoken.llm import LLM
from freetoken.server import _expert_placement
from synthetic import build_models

TOP_K = 2
N_GEN = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = dict(arch="qwen3moe", head_dim=32, experts=8, top_k=TOP_K, expert_ffn=64)
    base = dict(layers=2, hidden=128, ffn=256, heads=4, kv_heads=2, seed=5, quant="q8_0")
    return build_models({"moe": spec}, base, tmp_path_factory.mktemp("audit"))["moe"]


def test_one_record_per_generation(model: Path, tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    llm = LLM(model, n_ctx=128, engine=EngineOptions(device="cpu", moe_cache_audit=str(log)))
    out = [llm.generate(p, max_tokens=N_GEN, temperature=0) for p in ("One two", "Three")]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == 2 and all(isinstance(o, str) for o in out)
    first = recs[0]
    assert first["strategy"] == "cpu" and first["prompt_tokens"] == len(llm.tokenize("One two"))
    g = first["generated_tokens"]
    evaluated = first["prompt_tokens"] + g - (1 if g == N_GEN else 0)
    assert [la["layer"] for la in first["layers"]] == [0, 1]
    for la in first["layers"]:
        assert la["routes"] == evaluated * TOP_K
        assert la["cpu_routes"] == la["routes"] and la["gpu_routes"] == 0
        assert la["hit_rate"] == 0.0
    assert first["hit_rate"] == 0.0 and first["cpu_routes"] == 2 * evaluated * TOP_K
    # The second record counts only its own generation (the shared prefix is not re-run).
    second = recs[1]["layers"][0]["routes"]
    assert 0 < second <= (recs[1]["prompt_tokens"] + N_GEN) * TOP_K

    # /metrics: the same counters, summed over the layers, since load.
    series = {name: v for name, _, _, v in _expert_placement(llm)()}
    total = sum(r["cpu_routes"] for r in recs)
    assert series["freetoken_moe_routes_total"] == total
    assert series["freetoken_moe_cpu_routes_total"] == total
    assert series["freetoken_moe_gpu_routes_total"] == 0


def test_unwritable_audit_log(model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "missing" / "audit.jsonl"
    with pytest.raises(FileAccessError, match="audit log"):
        LLM(model, n_ctx=64, engine=EngineOptions(device="cpu", moe_cache_audit=str(bad)))


def test_hybrid_stats_since_counts_between_snapshots() -> None:
    """``freetoken bench`` reports the hybrid counters of its timed passes only: the later
    snapshot less the one taken after the warm-up."""

    def snap(routes: list[int], hits: list[int], busy: float, fills: int) -> HybridStats:
        return HybridStats(
            layers=[0, 1],
            routes=np.array(routes),
            hits=np.array(hits),
            seeded_hits=np.array(hits) // 2,
            filled_hits=np.array(hits) - np.array(hits) // 2,
            fetched=np.array(routes) // 4,
            answered=sum(routes),
            cpu_busy_s=busy,
            fills=fills,
            swaps=fills // 3,
            uploaded_bytes=fills * 100,
            resident=[[fills], [fills + 1]],
            bookkeeping_s=busy / 10,
            fetch={
                size: {f: fills * (i + 1) for i, f in enumerate(FETCH_FIELDS)}
                for size in ("9-16", "17-32")[: 1 + (fills > 10)]
            },
        )

    warm, end = snap([16, 16], [2, 4], 1.5, 9), snap([48, 80], [18, 36], 4.0, 12)
    d = end.since(warm)
    assert d.routes.tolist() == [32, 64] and d.hits.tolist() == [16, 32]
    assert d.hit_rate == pytest.approx(48 / 96)  # the warm-up's 6 of 32 left out
    assert d.cpu_busy_s == pytest.approx(2.5) and d.bookkeeping_s == pytest.approx(0.25)
    assert (d.fills, d.swaps, d.uploaded_bytes, d.answered) == (3, 1, 300, 96)
    assert d.seeded_hits.tolist() == [8, 16] and d.filled_hits.tolist() == [8, 16]
    assert d.fetched.tolist() == [8, 16]
    assert d.resident == end.resident
    # Per step size: 12 - 9 of each field times its position; "17-32" is new since the warm-up.
    assert d.fetch == {
        "9-16": {f: 3 * (i + 1) for i, f in enumerate(FETCH_FIELDS)},
        "17-32": {f: 12 * (i + 1) for i, f in enumerate(FETCH_FIELDS)},
    }


def test_fetch_counters_in_the_record_and_on_metrics(model: Path) -> None:
    """A hybrid record's ``fetch`` holds the step sizes that ran since the previous record,
    each field's difference; ``/metrics`` has every size's totals as labelled series, one
    HELP/TYPE header per metric."""
    from freetoken.engine.audit import _delta, expert_counters
    from freetoken.server.metrics import Registry

    def stats(steps: int, routes: int) -> HybridStats:
        c = dict.fromkeys(FETCH_FIELDS, 0) | {"steps": steps, "uploaded_routes": routes}
        z = np.zeros(2, dtype=np.int64)
        return HybridStats(
            [0, 1], z, z, z, z, z, 0, 0.0, 0, 0, 0, [[], []], 0.0,
            fetch={"2-4": c, "9-16": dict(c, steps=5)},
        )  # fmt: skip

    class Experts:
        uploaded_bytes = 0

        def __init__(self, s: HybridStats) -> None:
            self.s = s

        def stats(self) -> HybridStats:
            return self.s

    class Placement:
        strategy = "hybrid"

        def __init__(self, s: HybridStats) -> None:
            self.experts = Experts(s)

    llm = LLM(model, n_ctx=64, engine=EngineOptions(device="cpu"))
    llm.generate("One", max_tokens=2, temperature=0)  # routes, so the layers are listed
    before = expert_counters(llm.model, Placement(stats(2, 30)))
    now = expert_counters(llm.model, Placement(stats(7, 100)))
    d = _delta(now, before)["fetch"]
    assert set(d) == {"2-4"} and d["2-4"]["steps"] == 5 and d["2-4"]["uploaded_routes"] == 70

    llm.placement = Placement(stats(7, 100))  # type: ignore[assignment]
    registry = Registry()
    registry.add_source(_expert_placement(llm))
    text = registry.render()
    assert text.count("# TYPE freetoken_moe_fetch_steps_total counter") == 1
    assert 'freetoken_moe_fetch_steps_total{tokens="2-4"} 7' in text
    assert 'freetoken_moe_fetch_steps_total{tokens="9-16"} 5' in text
    assert 'freetoken_moe_fetch_uploaded_routes_total{tokens="9-16"} 100' in text
