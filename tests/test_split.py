"""The layer split over several GPUs (engine/split.py): llama.cpp's layer rule worked out by
hand for given proportions, the expert cache divided by expert bytes, and each bad flag a
clear error (``EngineOptions``, the planner with a given GPU count, the CLI: one line, exit
code 2). The GPU run of a one-range split is in test_gpu_models.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from freetoken.engine.options import EngineOptions
from freetoken.engine.split import SplitPlan, parse_tensor_split, plan_split
from freetoken.errors import InvalidInputError, UnsupportedError


def test_proportions_three_to_one_over_48_layers() -> None:
    # Split points 0.75 and 1.0; layer i goes to GPU 0 while i / 49 < 0.75, i.e. i <= 36; the
    # output layer (i = 48, 48 / 49 = 0.98) to GPU 1.
    plan = plan_split(48, 2, tensor_split=(3, 1))
    assert plan.devices == (0, 1)
    assert plan.ranges == (range(0, 37), range(37, 48))
    assert plan.output_device == 1
    assert [plan.device_of(i) for i in (0, 36, 37, 47)] == [0, 0, 1, 1]


def test_free_memory_weighs_the_gpus_without_proportions() -> None:
    # 24 and 8 GiB free: points 0.75 and 1.0 as for 3,1; equal free memory over 9 layers:
    # points 0.5 and 1.0, layer i on GPU 0 while i / 10 < 0.5, i.e. 0-4.
    gib = 1 << 30
    assert plan_split(48, 2, free_bytes=[24 * gib, 8 * gib]).ranges == (range(37), range(37, 48))
    assert plan_split(9, 2, free_bytes=[gib, gib]).ranges == (range(5), range(5, 9))


def test_a_zero_proportion_leaves_a_gpu_out() -> None:
    # Points 0.5, 0.5, 1.0: nothing falls below 0.5 on GPU 1 that GPU 0 does not take.
    plan = plan_split(10, 3, tensor_split=(1, 0, 1))
    assert plan.devices == (0, 2)
    assert plan.ranges == (range(6), range(6, 10))  # i / 11 < 0.5 for i <= 5


def test_cache_divided_by_expert_bytes() -> None:
    # 4 layers, 2 GPUs at 1,1: points 0.5 and 1.0, layers 0-2 (i / 5 < 0.5) and 3. Layer 0 is
    # dense; the others carry 100 bytes of experts each: GPU 0 holds 200 of 300 bytes.
    plan = plan_split(4, 2, tensor_split=(1, 1), cache_mib=900, expert_bytes=[0, 100, 100, 100])
    assert plan.ranges == (range(3), range(3, 4))
    assert plan.cache_mib == (600, 300)
    # 1000 over the same 2:1 bytes: 666 and 333 rounded down, the MiB left to the larger share.
    assert plan_split(
        4, 2, tensor_split=(1, 1), cache_mib=1000, expert_bytes=[0, 100, 100, 100]
    ).cache_mib == (667, 333)


def test_one_gpu_or_mode_none_is_one_range_on_the_main_gpu() -> None:
    assert plan_split(30, 1).ranges == (range(30),)
    plan = plan_split(30, 4, mode="none", main_gpu=2, cache_mib=512)
    assert (plan.devices, plan.ranges, plan.cache_mib, plan.output_device) == (
        (2,),
        (range(30),),
        (512,),
        2,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tensor_split=(1, 1, 1)), "3 proportions for 2 GPUs"),
        (dict(tensor_split=(1,)), "1 proportions for 2 GPUs"),
        (dict(tensor_split=(1, -1)), "proportions must be >= 0"),
        (dict(tensor_split=(0, 0)), "not all zero"),
        (dict(main_gpu=2), "--main-gpu 2: this host has 2 GPUs"),
        (dict(main_gpu=-1), "--main-gpu -1"),
        (dict(mode="none", tensor_split=(1, 1)), "--tensor-split needs --split-mode layer"),
        (dict(mode="rows"), "--split-mode rows"),
    ],
)
def test_bad_split_flags_name_the_flag(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        plan_split(8, 2, **kwargs)


def test_row_split_is_refused() -> None:
    with pytest.raises(UnsupportedError, match="--split-mode row"):
        plan_split(8, 2, mode="row")


@pytest.mark.parametrize(
    ("text", "want"), [("3,1", (3.0, 1.0)), ("1/1/2", (1.0, 1.0, 2.0)), (" 0.5, 0 ", (0.5, 0.0))]
)
def test_tensor_split_syntax(text: str, want: tuple[float, ...]) -> None:
    assert parse_tensor_split(text) == want


@pytest.mark.parametrize(
    ("text", "match"),
    [("1,x", "'x' is not a number"), ("1,-2", "-2"), ("0,0", "zero"), ("nan,1", "nan")],
)
def test_bad_tensor_split_syntax(text: str, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        parse_tensor_split(text)


def test_engine_options_check_the_flags() -> None:
    with pytest.raises(InvalidInputError, match="--main-gpu must be >= 0"):
        EngineOptions(main_gpu=-1)
    with pytest.raises(InvalidInputError, match="every proportion is zero"):
        EngineOptions(tensor_split=(0.0, 0.0))
    with pytest.raises(InvalidInputError, match="--split-mode"):
        EngineOptions(split_mode="tensor")


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["-ts", "1,-1"], "--tensor-split"),
        (["--tensor-split", "0,0"], "every proportion is zero"),
        (["-mg", "-1"], "--main-gpu"),
    ],
)
def test_cli_bad_split_flags_one_line_exit_2(flags: list[str], match: str) -> None:
    cmd = ["generate", "-m", "missing.gguf", "-n", "1", "-p", "hi", *flags]
    r = subprocess.run(
        [sys.executable, "-m", "freetoken.cli", *cmd], capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], r.stderr


# -- a plan given as it is, and the bookkeeping of its execution (no GPU needed) ----------


def _two_on_gpu0() -> SplitPlan:
    return SplitPlan((0, 0), (range(0, 3), range(3, 5)), (None, 2), 0)


def test_a_given_plan_may_name_one_gpu_twice() -> None:
    plan = _two_on_gpu0()
    plan.check(5, 1)
    assert plan.layer_devices() == (0, 0, 0, 0, 0)
    assert not plan.several_devices
    assert SplitPlan((1, 0), (range(2), range(2, 4)), (None, None), 1).layer_devices() == (
        1,
        1,
        0,
        0,
    )
    assert SplitPlan((0, 0), (range(2), range(2, 4)), (None, None), 1).several_devices


@pytest.mark.parametrize(
    ("plan", "n_gpus", "match"),
    [
        (SplitPlan((0,), (range(4),), (None,), 0), 1, "covers 4 of the 5 layers"),
        (SplitPlan((0, 0), (range(3), range(4, 5)), (None, None), 0), 1, "each must start"),
        (SplitPlan((0, 0), (range(1, 3), range(3, 5)), (None, None), 0), 1, "each must start"),
        (SplitPlan((0, 0), (range(0), range(0, 5)), (None, None), 0), 1, "each must start"),
        (SplitPlan((0, 2), (range(3), range(3, 5)), (None, None), 0), 2, "names GPU 2"),
        (SplitPlan((0, 1), (range(3), range(3, 5)), (None, None), 2), 2, "names GPU 2"),
        (SplitPlan((0,), (range(3), range(3, 5)), (None, None), 0), 1, "one GPU and one cache"),
        (SplitPlan((0, 0), (range(3), range(3, 5)), (None, -1), 0), 1, "must be >= 0"),
    ],
)
def test_a_given_plan_is_checked(plan: SplitPlan, n_gpus: int, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        plan.check(5, n_gpus)


def test_engine_options_take_a_plan_instead_of_the_split_flags() -> None:
    plan = _two_on_gpu0()
    assert EngineOptions(split_plan=plan).split_plan is plan
    with pytest.raises(InvalidInputError, match="no --split-mode or --tensor-split"):
        EngineOptions(split_plan=plan, tensor_split=(1.0,))
    with pytest.raises(InvalidInputError, match="no --split-mode or --tensor-split"):
        EngineOptions(split_plan=plan, split_mode="layer")


def test_each_layer_cache_on_its_device() -> None:
    # The meta device stands in for a second GPU: tensors with a device and no data.
    from freetoken.runtime.kv_cache import KVCache
    from freetoken.runtime.recurrent_cache import HybridCache

    cpu, meta = torch.device("cpu"), torch.device("meta")
    cache = KVCache(3, 8, 2, 4, 4, devices=[cpu, cpu, meta])
    assert [k.device for k in cache.k] == [cpu, cpu, meta]
    assert [v.device for v in cache.v] == [cpu, cpu, meta]
    with pytest.raises(InvalidInputError, match="2 devices for a cache of 3 layers"):
        KVCache(3, 8, 2, 4, 4, devices=[cpu, meta])
    states = [((2, 3), (2, 4, 4))] * 3
    hybrid = HybridCache(1, 8, 2, 4, 4, states, kv_devices=[meta], state_devices=[cpu, meta, meta])
    assert hybrid.k[0].device == meta
    assert [c.device for c in hybrid.conv] == [cpu, meta, meta]
    assert [s.device for s in hybrid.ssm] == [cpu, meta, meta]
    plain = HybridCache(1, 8, 2, 4, 4, states)
    assert {t.device for t in (*plain.k, *plain.conv, *plain.ssm)} == {cpu}


def test_step_views_per_device() -> None:
    from freetoken.runtime.kv_cache import KVCache
    from freetoken.runtime.step import Span, Step

    cache = KVCache(1, 8, 1, 4, 4)
    pos = torch.arange(3)
    step = Step(pos, [Span(pos[:2], 2, cache, 8), Span(5, 1, cache)], keep_hidden=True)
    assert step.on(torch.device("cpu")) is step  # its own device: itself
    meta = torch.device("meta")
    view = step.on(meta)
    assert step.on(meta) is view  # once per step and device
    assert view.pos.device == meta and view.kv is step.kv and view.keep_hidden
    assert view.rope is not step.rope and view.masks is not step.masks
    first, second = view.spans
    assert isinstance(first.start, torch.Tensor) and first.start.device == meta
    assert (first.n, first.cache, first.n_keys) == (2, cache, 8)
    assert second.start == 5 and second.cache is cache
    view.hidden = torch.zeros(3, 4, device=meta)
    step.take_hidden(view)
    assert step.hidden is view.hidden
    step.take_hidden(step)
    assert step.hidden is view.hidden


def test_handoff_sequence_continues_across_devices() -> None:
    # The hand-off's requests are one sequence for the CPU thread: a device's first request
    # after another device's starts from that device's count. Keys stand in for devices.
    from freetoken.engine.hybrid import HybridExperts

    h = HybridExperts.__new__(HybridExperts)
    h.counters = {"a": torch.zeros(1, dtype=torch.int64), "b": torch.zeros(1, dtype=torch.int64)}
    h.last_counter = None

    def request(dev: str) -> int:
        counter = h._counter(dev)  # type: ignore[arg-type]
        counter += 1  # what a request does on the device
        return int(counter)

    assert [request(d) for d in "aabab"] == [1, 2, 3, 4, 5]
    assert [request(d) for d in "bba"] == [6, 7, 8]
    # A captured stage is entered first: its graph then holds no copy; a device without
    # hand-off layers has nothing to follow.
    h.enter("b")  # type: ignore[arg-type]
    assert h.last_counter is h.counters["b"] and int(h.counters["b"]) == 8
    h.enter("c")  # type: ignore[arg-type]
    assert h.last_counter is h.counters["b"]
    assert request("b") == 9


def test_the_placement_log_shows_the_split() -> None:
    from freetoken.engine.placement import Placement

    place = Placement("hybrid", "quant", torch.device("cuda", 0), split=_two_on_gpu0())
    place.range_bytes = [(300 << 20, 2 << 20), (200 << 20, 1 << 20)]
    lines = place.describe().splitlines()
    assert "  GPU 0: layers 0-2, 300 MiB dense + 2 MiB expert cache" in lines
    assert "  GPU 0: layers 3-4, 200 MiB dense + 1 MiB expert cache" in lines
    assert "  GPU 0: output norm and projection" in lines
    one = Placement("gpu", "quant", torch.device("cuda", 0), split=plan_split(5, 1))
    assert len(one.describe().splitlines()) == 1  # one range: no split lines


def test_ranges_see_their_moe_layers() -> None:
    from types import SimpleNamespace

    from freetoken.engine.placement import _ranges

    moe = [SimpleNamespace(index=i) for i in (1, 2, 3, 4)]
    rs = _ranges(_two_on_gpu0(), moe, moe[1:3])  # type: ignore[arg-type]
    assert [r.layers for r in rs] == [range(3), range(3, 5)]
    assert [[ex.index for ex in r.moe] for r in rs] == [[1, 2], [3, 4]]
    assert [[ex.index for ex in r.servable] for r in rs] == [[2], [3]]
    assert [r.cache_mib for r in rs] == [None, 2]
    assert rs[1].tag == "GPU 0, layers 3-4: "


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe"])
def test_layer_devices_on_one_device_change_nothing(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Per-layer devices that are all the model's own: the caches are laid out per layer, the
    # step enters each layer's device (itself) and the logits are the plain run's, bit for bit.
    from freetoken.engine.options import EngineOptions as Options
    from freetoken.llm import LLM
    from synthetic import build_models

    spec = dict(arch=arch, head_dim=64, experts=8, top_k=2, expert_ffn=128, quant="q8_0")
    base = dict(layers=4, hidden=128, ffn=256, heads=4, kv_heads=2, seed=3)
    path = build_models({arch: spec}, base, tmp_path_factory.mktemp("split-cpu"))[arch]
    llm = LLM(path, n_ctx=64, engine=Options(device="cpu"))
    seq = llm.tokenize("The capital of France is")
    want = llm.logits(seq).numpy()
    model = llm.model
    cpu = torch.device("cpu")
    model.layer_devices, model.output_device = (cpu,) * model.cfg.n_layers, cpu
    cache = model.new_cache(64)
    assert all(k.device == cpu for k in cache.k)
    assert (llm.logits(seq).numpy() == want).all()
    one = [model.forward(seq[:-1], cache, all_logits=True)]
    one.append(model.forward(seq[-1:], cache)[None])
    assert (torch.cat(one).numpy() == want).all()


def test_stages_are_runs_of_one_device() -> None:
    from freetoken.runtime.cuda_graph import Stage, stages

    g0, g1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert stages([g0, g0, g1, g1], g1) == [
        Stage(g0, range(0, 2), False),
        Stage(g1, range(2, 4), True),
    ]
    # The output layer on another GPU than the last layers: a stage of its own.
    assert stages([g1, g1, g0, g0], g1) == [
        Stage(g1, range(0, 2), False),
        Stage(g0, range(2, 4), False),
        Stage(g1, range(4, 4), True),
    ]
    assert stages([g0, g1, g0], g0) == [
        Stage(g0, range(0, 1), False),
        Stage(g1, range(1, 2), False),
        Stage(g0, range(2, 3), True),
    ]
    assert stages([g0] * 3, g0) == [Stage(g0, range(3), True)]


def test_each_range_plans_from_its_layers_profile(tmp_path_factory: pytest.TempPathFactory) -> None:
    import json

    from freetoken.runtime.expert_profile import FORMAT, VERSION, profile_of_layers

    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": {"architecture": "qwen3moe", "n_layers": 4},
        "layers": [{"layer": i, "routes": 2, "counts": [1, 1]} for i in range(4)],
    }
    path = tmp_path_factory.mktemp("profile") / "p.json"
    path.write_text(json.dumps(doc))
    for given in (doc, str(path)):
        part = profile_of_layers(given, range(2, 4))
        assert [e["layer"] for e in part["layers"]] == [2, 3]
        assert part["model"] == doc["model"] and part["format"] == FORMAT
    assert profile_of_layers({"format": "other"}, range(2)) == {"format": "other"}
