"""``freetoken profile`` writes the expert-use profile of docs/expert-profile.md: one entry per
MoE layer, one count per expert, and every evaluated token counted top-k times per layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from freetoken.testmodel import make_test_model


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "qwen3moe.gguf"
    return make_test_model(
        "qwen3moe",
        layers=2,
        hidden=128,
        ffn=128,
        heads=4,
        experts=8,
        top_k=2,
        expert_ffn=128,
        seed=3,
        out=out,
    )


def profile_cmd(model: Path, prompts: Path, out: Path, n_predict: int) -> list[str]:
    return [
        *(sys.executable, "-m", "freetoken.cli", "profile", "-m", str(model)),
        *("--prompts", str(prompts), "-n", str(n_predict), "-o", str(out)),
    ]


def run_profile(model: Path, tmp_path: Path, prompt: str, n_predict: int) -> dict[str, Any]:
    (tmp_path / "prompts.txt").write_text(prompt + "\n")
    out = tmp_path / "profile.json"
    r = subprocess.run(
        profile_cmd(model, tmp_path / "prompts.txt", out, n_predict),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_profile_counts_every_route(moe_model: Path, tmp_path: Path) -> None:
    from freetoken.llm import LLM

    prompt = "The quick brown fox jumps over the lazy dog"
    # -n 0: exactly the prompt's tokens are evaluated, each routed to top-k experts per layer.
    prof = run_profile(moe_model, tmp_path, prompt, 0)
    n_tokens = len(LLM(moe_model, n_ctx=64).tokenize(prompt))
    assert prof["format"] == "freetoken.expert-profile" and prof["version"] == 1
    model = prof["model"]
    got = (model["architecture"], model["n_layers"], model["n_experts"], model["top_k"])
    assert got == ("qwen3moe", 2, 8, 2)
    assert [layer["layer"] for layer in prof["layers"]] == [0, 1]
    for layer in prof["layers"]:
        assert len(layer["counts"]) == 8
        assert sum(layer["counts"]) == layer["routes"] == n_tokens * 2
    assert prof["tokens"] == n_tokens


def test_profile_includes_generated_tokens(moe_model: Path, tmp_path: Path) -> None:
    from freetoken.llm import LLM

    prompt = "def add(a, b):"
    n_prompt = len(LLM(moe_model, n_ctx=64).tokenize(prompt))
    prof = run_profile(moe_model, tmp_path, prompt, 6)
    # Every generated token but the last is fed back (fewer if the model ends early).
    assert n_prompt <= prof["tokens"] <= n_prompt + 5


def test_profile_refuses_a_dense_model(tmp_path: Path) -> None:
    dense = make_test_model(
        "qwen3", layers=1, hidden=64, ffn=128, heads=4, seed=1, out=tmp_path / "d.gguf"
    )
    (tmp_path / "p.txt").write_text("hello\n")
    r = subprocess.run(
        profile_cmd(dense, tmp_path / "p.txt", tmp_path / "x.json", 4),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "not a mixture-of-experts model" in r.stderr
