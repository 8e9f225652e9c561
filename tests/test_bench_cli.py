"""``freetoken bench -d N`` (llama-bench's ``--n-depth``): each timed test runs after N
context tokens, which are not timed, and the rows name the depth; a negative depth is the
CLI's one error line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from freetoken.cli import main


def test_each_test_runs_after_the_context(
    default_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import freetoken.llm as llm_module

    calls: list[tuple[int, int]] = []  # (tokens, cache length before) of each forward pass
    load = llm_module.load_llm

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        llm = load(*args, **kwargs)
        forward = llm.model.forward

        def run(tokens: list[int], cache: Any, *a: Any, **k: Any) -> Any:
            calls.append((len(tokens), cache.length))
            return forward(tokens, cache, *a, **k)

        llm.model.forward = run
        return llm

    monkeypatch.setattr(llm_module, "load_llm", recording_load)
    depth, n_prompt, n_gen = 40, 8, 3
    args = ["bench", "-m", str(default_model), "-d", str(depth), "-p", str(n_prompt)]
    assert main([*args, "-n", str(n_gen), "-r", "1", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n_depth"] == depth
    # Warm-up and one repetition of each test: the context from an empty cache, then the test
    # on top of it, its prompt in one pass and its decode steps one token each.
    context = (depth, 0)
    prompt = [context, (n_prompt, depth)]
    decode = [context, *[(1, depth + i) for i in range(n_gen)]]
    assert calls == (prompt + decode) * 2
    assert main([*args, "-n", str(n_gen), "-r", "1"]) == 0
    table = capsys.readouterr().out
    assert f"pp{n_prompt} @ d{depth}" in table and f"tg{n_gen} @ d{depth}" in table


def test_a_negative_depth_is_one_error_line(
    default_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "-m", str(default_model), "-d", "-1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "-d" in err[0]
