"""The Gated DeltaNet hybrids (qwen35, qwen35moe, qwen3next) on the GPU, against the same
models on the CPU engine (whose own check against llama.cpp is tests/test_qwen35.py).

Teacher-forced on the CPU engine's greedy continuation: a prompt shorter than one delta-rule
chunk and one longer than two prefill chunks, run in prefill chunks, then 64 tokens fed one
decode step at a time; on every position the GPU's argmax equals the CPU's except at the
CPU's near-ties and the mean KL(CPU || GPU) is at most 0.005. Each GPU strategy (``gpu``,
``offload``, ``hybrid`` with a cache smaller than one layer's experts, ``cpu``: every route
through the hand-off) on the MoE architectures; the dense one has no experts to place.
Decode steps replay CUDA graphs (the recurrent step updates the cache's state buffers in
place) and give the eager step's logits, one sequence or several in one graph; a cut back
to a snapshot on the GPU continues as a fresh run; every decode step runs the recurrent layers'
fused kernels (``gpu.gdn_decode``), which on their own match the torch path in float64 over
several steps, several sequences, value heads tiled or grouped over fewer key heads and heads
of 32 to 256 (tests/gdn_cases.py). Through the live server on ``hybrid``:
a multi-turn chat and a shared system prompt reuse their prefixes and give the fresh runs'
outputs, and requests never read each other's state (tests/test_server_hybrid_prefix.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from freetoken import _core  # noqa: E402
from freetoken.engine.options import EngineOptions  # noqa: E402
from freetoken.errors import ShapeError  # noqa: E402
from freetoken.llm import LLM, PROMPT_CHUNK  # noqa: E402
from freetoken.runtime import gpu  # noqa: E402
from freetoken.runtime.recurrent_cache import HybridCache  # noqa: E402
from gdn_cases import EPS, Case, make_inputs, make_layer, reference_step  # noqa: E402
from synthetic import build_models  # noqa: E402
from teacher_forced import compare  # noqa: E402
from test_qwen35 import SHORT, _long_prompt  # noqa: E402

pytestmark = pytest.mark.gpu

N_GEN = 64
MAX_KL = 0.005
N_CTX = 2048

_BASE: dict[str, Any] = dict(
    layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, seed=5
)
_MOE: dict[str, Any] = dict(experts=8, top_k=2, expert_ffn=256)
MODELS = {
    "qwen35": dict(arch="qwen35", quant="q4_k,ssm=q6_k,attn_qkv=q5_k,output=q6_k"),
    "qwen35moe": dict(arch="qwen35moe", quant="q8_0,exps=q4_k,ffn_down_exps=q6_k", **_MOE),
    "qwen3next": dict(arch="qwen3next", quant="q5_k,exps=q4_0,shexp=q8_0,ssm=q8_0", **_MOE),
}
STRATEGIES = ["gpu", "offload", "hybrid", "cpu"]
CASES = [("qwen35", "gpu")] + [(m, s) for m in ("qwen35moe", "qwen3next") for s in STRATEGIES]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_models(MODELS, _BASE, tmp_path_factory.mktemp("gpu-qwen35"))


def _run_prompt(model: Any, prompt: list[int], cache: Any) -> np.ndarray:
    """The prompt's logits, run in prefill chunks on ``cache``."""
    rows = [
        model.forward(prompt[i : i + PROMPT_CHUNK], cache, all_logits=True)
        for i in range(0, len(prompt), PROMPT_CHUNK)
    ]
    return torch.cat(rows).numpy()


def _run(model: Any, prompt: list[int], gen: list[int], cache: Any = None) -> np.ndarray:
    """Logits of every position but the last: the prompt in prefill chunks, then the
    continuation one decode step at a time (on a new cache unless ``cache``)."""
    cache = cache if cache is not None else model.new_cache(N_CTX)
    rows = [_run_prompt(model, prompt, cache)]
    rows += [model.forward([t], cache)[None].numpy() for t in gen[:-1]]
    return np.concatenate(rows)


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(N_CTX)
    logits, out = model.forward(prompt, cache), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(out[-1:], cache)
    return out


@pytest.fixture(scope="module")
def cpu_runs(model_files: dict[str, Path]) -> dict[str, list[tuple[list[int], list[int], Any]]]:
    """Per model, per prompt: (prompt tokens, the CPU's greedy continuation, the CPU's
    logits of every position but the last)."""
    runs = {}
    for name, path in model_files.items():
        cpu = LLM(path, n_ctx=N_CTX, engine=EngineOptions(device="cpu"))
        runs[name] = []
        for text in (SHORT, _long_prompt()):
            prompt = cpu.tokenize(text)
            assert len(prompt) < 64 or len(prompt) > 2 * PROMPT_CHUNK
            gen = _greedy(cpu.model, prompt, N_GEN)
            runs[name].append((prompt, gen, _run(cpu.model, prompt, gen)))
    return runs


def _gpu_llm(path: Path, strategy: str) -> LLM:
    # 1 MiB of slots: fewer than one layer's experts on these models.
    mib = 1 if strategy in ("offload", "hybrid") else None
    opts = EngineOptions(device="cuda", moe_strategy=strategy, moe_cache_mib=mib)
    return LLM(path, n_ctx=N_CTX, engine=opts)


def _check(what: str, ref: np.ndarray, ours: np.ndarray) -> None:
    assert np.isfinite(ours).all(), f"{what}: non-finite logits"
    c = compare(ref, ours)
    assert not c.mismatches, f"{what}: {c.describe()}"
    assert c.mean_kl <= MAX_KL, f"{what}: {c.describe()}"


def _count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of ``gpu.gdn_decode`` (captured steps call it once, replays not)."""
    calls: list[int] = []
    fused = gpu.gdn_decode

    def counted(*args: Any) -> Any:
        calls.append(1)
        return fused(*args)

    monkeypatch.setattr(gpu, "gdn_decode", counted)
    return calls


@pytest.mark.parametrize(("name", "strategy"), CASES)
def test_gpu_matches_cpu(
    name: str,
    strategy: str,
    model_files: dict[str, Path],
    cpu_runs: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fused = _count_fused(monkeypatch)
    llm = _gpu_llm(model_files[name], strategy)
    place = llm.placement
    assert place is not None and place.strategy == strategy
    # Decode is one graph per step wherever no layer waits for Python (offload uploads).
    assert place.graphs == (strategy != "offload" or name == "qwen35"), place.describe()
    if strategy == "cpu":
        assert place.handoff_cpu_layers and not place.cpu_layers
    for prompt, gen, ref in cpu_runs[name]:
        what = f"{name} {strategy} ({len(prompt)} prompt tokens)"
        cache = llm.model.new_cache(N_CTX)
        fused.clear()
        _check(what, ref, _run(llm.model, prompt, gen, cache))
        assert fused, f"{what}: no decode step ran the fused recurrent kernels"
        # A graph lives as long as the cache it was captured on.
        assert _graphs_ran(llm.model) == place.graphs, what
        whole = llm.logits(prompt + gen)[:-1].numpy()  # all of it as prompt chunks
        _check(f"{what} prefill", ref, whole)


@pytest.mark.parametrize("name", list(MODELS))
def test_input_projections_fused_by_type(name: str, model_files: dict[str, Path]) -> None:
    """On the GPU a Gated DeltaNet layer's input projections (q/k/v channels, z gate, beta,
    alpha) of one GGUF type share one product; one of another type keeps its own."""
    from freetoken.models.delta_net import DeltaNetLayer
    from gguf import GGUFReader

    types = {t.name: t.tensor_type for t in GGUFReader(model_files[name]).tensors}
    llm = _gpu_llm(model_files[name], "gpu")
    layers = [blk.delta for blk in llm.model.blocks if isinstance(blk.delta, DeltaNetLayer)]
    assert layers
    for layer in layers:
        kinds = [types[lin.name] for lin in layer.in_proj]
        for lin, kind in zip(layer.in_proj, kinds, strict=True):
            shared = kinds.count(kind) > 1
            assert (lin.group is not None) == shared, (lin.name, kinds)
            if shared:
                assert len(lin.group.members) == kinds.count(kind), (lin.name, kinds)


def _graphs_ran(model: Any) -> bool:
    """Whether decode steps were captured on a cache still alive."""
    return model.graphs is not None and bool(model.graphs.graphs)


@pytest.mark.parametrize("name", list(MODELS))
def test_graph_decode_equals_eager_decode(
    name: str, model_files: dict[str, Path], cpu_runs: dict[str, Any]
) -> None:
    """The captured recurrent step (state buffers updated in place, the warm-up passes'
    updates put back) gives the eager step's logits, step after step."""
    # All experts resident: the same kernels serve every route in both runs (hybrid's hits
    # and misses would move with its cache between them).
    llm = _gpu_llm(model_files[name], "gpu")
    model = llm.model
    graphs = model.graphs
    assert graphs is not None
    prompt, gen, _ = cpu_runs[name][0]
    cache = model.new_cache(N_CTX)
    replayed = _run(model, prompt, gen, cache)
    assert _graphs_ran(model), "no graph ran"
    model.graphs = None
    try:
        eager = _run(model, prompt, gen)
    finally:
        model.graphs = graphs
    np.testing.assert_allclose(replayed, eager, atol=2e-3, rtol=1e-3)


def test_batched_decode_graph_keeps_each_state(
    model_files: dict[str, Path], cpu_runs: dict[str, Any]
) -> None:
    """Two sequences decoded together, one token each per step (the server's continuous
    batching), replayed as one graph: each keeps its own recurrent state and matches the
    CPU. The second joins five steps late and ends first (graphs of 1, 2, 1 sequences)."""
    name = "qwen35moe"
    llm = _gpu_llm(model_files[name], "gpu")
    model = llm.model
    assert model.graphs is not None
    runs = [r[:2] for r in cpu_runs[name]]
    runs[1] = (runs[1][0], runs[1][1][:40])
    seqs = [p + g for p, g in runs]
    caches = [model.new_cache(N_CTX) for _ in runs]
    outs = [[_run_prompt(model, p, c)] for (p, _), c in zip(runs, caches, strict=True)]
    nxt = [len(p) for p, _ in runs]
    joins, step = [0, 5], 0
    while live := [i for i, s in enumerate(seqs) if step >= joins[i] and nxt[i] < len(s) - 1]:
        rows = model.forward_batch([([seqs[i][nxt[i]]], caches[i]) for i in live])
        for i, row in zip(live, rows, strict=True):
            outs[i].append(row.numpy()[None])
            nxt[i] += 1
        step += 1
    assert any(len(key[0]) == 2 for key in model.graphs.graphs), "no two-sequence graph ran"
    for (prompt, _), out, (_, _, ref) in zip(runs, outs, cpu_runs[name], strict=True):
        got = np.concatenate(out)
        _check(f"batched decode ({len(prompt)} prompt tokens)", ref[: got.shape[0]], got)


def test_snapshot_restore_on_the_gpu(
    model_files: dict[str, Path], cpu_runs: dict[str, Any]
) -> None:
    """A cache on the GPU cut back to the snapshot where a prompt chunk ended (after decode
    steps captured as graphs moved its state on) continues as a fresh run; a cut before any
    snapshot runs again from the start. The snapshots take no device memory: the prompt's
    chunks leave less than one set of states allocated on the GPU."""
    name = "qwen3next"
    llm = _gpu_llm(model_files[name], "gpu")
    model = llm.model
    prompt, gen, ref = cpu_runs[name][1]
    _run_prompt(model, prompt, model.new_cache(N_CTX))  # first-run allocations out of the way
    cache = model.new_cache(N_CTX)
    assert isinstance(cache, HybridCache) and cache.ssm[0].is_cuda
    dev = cache.ssm[0].device
    states = sum(t.numel() * t.element_size() for t in (*cache.conv, *cache.ssm))
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    _run_prompt(model, prompt, cache)
    torch.cuda.synchronize(dev)
    grown = torch.cuda.memory_allocated(dev) - before
    assert len(prompt) > 2 * PROMPT_CHUNK and grown < states, (grown, states)
    for t in gen[:8]:
        model.forward([t], cache)
    assert cache.truncate(PROMPT_CHUNK + 10) == PROMPT_CHUNK
    seq = prompt + gen
    rest = [model.forward(seq[PROMPT_CHUNK:], cache, all_logits=True)[:-1].numpy()]
    _check("after a cut to a snapshot", ref[PROMPT_CHUNK:], np.concatenate(rest))
    assert cache.truncate(PROMPT_CHUNK - 1) == 0
    assert all(not s.any() for s in cache.ssm) and all(not c.any() for c in cache.conv)
    _check("after a cut to nothing", ref, _run(model, prompt, gen, cache))


GDN_CASES = {
    "tiled-128": Case(1, 2, 4, 128, 4, grouped=False, fused_ba=False),
    "grouped-48": Case(3, 2, 6, 48, 3, grouped=True, fused_ba=True),
    "tiled-256": Case(2, 1, 2, 256, 4, grouped=False, fused_ba=False),
    # More sequences than one launch takes.
    "grouped-70-seqs": Case(70, 2, 4, 32, 2, grouped=True, fused_ba=True),
}


@pytest.mark.parametrize("name", list(GDN_CASES))
def test_gdn_decode_matches_torch_float64(name: str) -> None:
    """The fused step against the torch path in float64, step after step with the states
    carried (each sequence its own), the states updated in place."""
    case = GDN_CASES[name]
    gen = torch.Generator().manual_seed(11)
    ref = make_layer(case, gen)
    ours = ref.to(torch.float32, "cuda")
    for step in range(4):
        ref_in, (mixed, z, b, a) = make_inputs(case, gen, "cuda")
        want, _ = reference_step(ref, ref_in)
        assert gpu.gdn_decode_fits(mixed, z, b, a, ours.weights, ours.states)
        got = gpu.gdn_decode(mixed, z, b, a, ours.weights, ours.states, case.grouped, EPS)
        what = f"{name} step {step}"
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4, msg=what)
        for (c, s), (rc, rs) in zip(ours.states, ref.states, strict=True):
            torch.testing.assert_close(c.cpu(), rc.float(), rtol=0, atol=0, msg=f"{what} conv")
            torch.testing.assert_close(s.double().cpu(), rs, rtol=1e-4, atol=1e-5, msg=what)


def test_gdn_decode_refuses_what_it_does_not_take() -> None:
    """Heads over GDN_MAX_DIM stay on the torch path (the wrapper refuses them); the FFI
    checks the sizes before the library sees them."""
    case = Case(1, 1, 2, gpu.GDN_MAX_DIM + 32, 4, grouped=False, fused_ba=False)
    layer = make_layer(case, torch.Generator().manual_seed(3)).to(torch.float32, "cuda")
    _, (mixed, z, b, a) = make_inputs(case, torch.Generator().manual_seed(4), "cuda")
    assert not gpu.gdn_decode_fits(mixed, z, b, a, layer.weights, layer.states)
    with pytest.raises(ShapeError):
        gpu.gdn_decode(mixed, z, b, a, layer.weights, layer.states, False, EPS)
    addr = mixed.data_ptr()
    stream = torch.cuda.current_stream().cuda_stream
    too_many = [(addr, addr)] * (gpu.GDN_MAX_SEQS + 1)
    for heads, states in (
        ((1, 2, gpu.GDN_MAX_DIM + 32, 4, False), [(addr, addr)]),
        ((1, 2, 64, 4, False), too_many),
    ):
        with pytest.raises(ShapeError):
            _core.cuda_gdn_decode(
                0, stream, heads, (4096, 4096, 2, 0), 2, EPS, (addr,) * 4, (addr,) * 4, states, addr
            )


@pytest.fixture(scope="module")
def prefix() -> Any:
    """The server checks (they need the `openai` client: only these tests skip without it)."""
    return pytest.importorskip("test_server_hybrid_prefix")


@pytest.fixture(scope="module")
def gpu_server(prefix: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = prefix.build_model(tmp_path_factory.mktemp("prefix-model"))
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    with prefix.serve(model, log, prefix.GPU_ARGS) as srv:
        yield srv


def test_server_multi_turn_chat(prefix: Any, gpu_server: Any) -> None:
    prefix.check_multi_turn_chat(gpu_server)


def test_server_shared_system_prompt(prefix: Any, gpu_server: Any) -> None:
    prefix.check_shared_system_prompt(gpu_server)


def test_server_requests_isolated(prefix: Any, gpu_server: Any) -> None:
    prefix.check_isolation(gpu_server)
