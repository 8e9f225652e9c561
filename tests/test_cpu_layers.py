"""``--moe-cpu-layers SPEC`` (engine/cpu_layers.py): the spec's forms, the page-lock budget
(MemAvailable, RLIMIT_MEMLOCK, FREETOKEN_PIN_LIMIT_MIB) and the ``auto`` split. The GPU side
(layers left without slots served through the hybrid hand-off) is in test_gpu_models.py."""

from __future__ import annotations

import resource

import pytest
from freetoken.engine.cpu_layers import (
    PIN_LIMIT_ENV,
    parse_cpu_layers,
    pin_budget,
    split_for_pinning,
)
from freetoken.engine.options import EngineOptions
from freetoken.errors import InvalidInputError

MOE = [1, 3, 5, 7, 9]  # a model whose MoE layers follow dense ones


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (None, set()),
        ("", set()),
        ("3,7", {3, 7}),
        ("3-7", {3, 5, 7}),  # a range names the MoE layers inside it
        ("1, 5-5 ,9", {1, 5, 9}),
        ("2", {1, 3}),  # a count: the first MoE layers, as llama.cpp's --n-cpu-moe
        ("0", set()),
        ("auto", None),
    ],
)
def test_spec_forms(spec: str | None, want: set[int] | None) -> None:
    assert parse_cpu_layers(spec, MOE) == want


@pytest.mark.parametrize("spec", ["x", "1,,3", "7-3", "-1", "6", "3,4"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(InvalidInputError, match="--moe-cpu-layers"):
        parse_cpu_layers(spec, MOE)


def test_options_check_the_syntax() -> None:
    assert EngineOptions(moe_cpu_layers="0-3,8").moe_cpu_layers == "0-3,8"
    with pytest.raises(InvalidInputError, match="--moe-cpu-layers"):
        EngineOptions(moe_cpu_layers="half")


def test_pin_budget_takes_the_smallest_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PIN_LIMIT_ENV, raising=False)
    base, _ = pin_budget()
    avail = next(
        int(line.split()[1]) * 1024
        for line in open("/proc/meminfo")
        if line.startswith("MemAvailable:")
    )
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limits = [avail] + ([soft] if soft != resource.RLIM_INFINITY else [])
    # MemAvailable moves between the two reads; the rlimit does not.
    assert base is not None and abs(base - min(limits)) < 256 << 20
    monkeypatch.setenv(PIN_LIMIT_ENV, "1.5")
    assert pin_budget() == (int(1.5 * (1 << 20)), PIN_LIMIT_ENV)
    monkeypatch.setenv(PIN_LIMIT_ENV, "lots")
    with pytest.raises(InvalidInputError, match=PIN_LIMIT_ENV):
        pin_budget()


def test_auto_split() -> None:
    layers = [(1, 100), (3, 100), (5, 100), (7, 100)]
    tried: list[int] = []

    def pin(layer: int) -> bool:
        tried.append(layer)
        return True

    # Up to the budget, in order; nothing pinned past the first layer that does not fit.
    assert split_for_pinning(layers, 250, pin) == ([1, 3], [5, 7])
    assert tried == [1, 3]
    assert split_for_pinning(layers, None, lambda la: True) == ([1, 3, 5, 7], [])
    assert split_for_pinning(layers, 50, pin) == ([], [1, 3, 5, 7])
    # The driver refusing a layer ends the pinning there.
    assert split_for_pinning(layers, None, lambda la: la != 5) == ([1, 3], [5, 7])
