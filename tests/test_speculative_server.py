"""Speculative decoding in ``freetoken serve``, beside continuous batching: two live servers on
one synthetic qwen35moe model with a multi-token-prediction layer, one plain and one with
``--spec-type draft-mtp``, driven with the official ``openai`` client (and a third with
``--spec-draft-n-auto``). Greedy completions of several prompts sent at once (so verify steps
share forward passes with other requests' prompt chunks and decode tokens) are the same text
on both; a request that shares a prefix with an earlier one (the slot's cut-back caches
reused) too; ``/metrics`` counts drafted and accepted tokens; a request's ``speculative.*``
fields out of range get a 400 JSON error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from freetoken.errors import FileAccessError  # noqa: E402
from freetoken.testmodel import make_test_model  # noqa: E402
from freetoken.testmodel.vocab import llama_tree  # noqa: E402
from live_server import Server, live_server  # noqa: E402

ARGS = ["--parallel", "3", "-c", "512", "-b", "64", "--alias", "m", "--device", "cpu"]
PROMPTS = [
    [1, 450, 4996],
    [1] + [(37 * i) % 3000 + 100 for i in range(150)],
    [1] + [319, 4996, 17354, 1701] * 20,
    [1, 17354, 1701, 42, 43, 44, 45],
]


SPEC = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        vocab = llama_tree() / "models" / "ggml-vocab-llama-spm.gguf"
    except FileAccessError as e:
        pytest.skip(str(e))
    return make_test_model(
        "qwen35moe", layers=4, hidden=64, ffn=128, heads=2, kv_heads=1, head_dim=32,
        experts=4, top_k=2, expert_ffn=64, nextn_layers=1, seed=4, vocab=vocab,
        out=tmp_path_factory.mktemp("spec-model") / "mtp.gguf", log=lambda _: None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def servers(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    out = tmp_path_factory.mktemp("spec-server")
    with (
        live_server(model, out / "plain.txt", ARGS) as plain,
        live_server(model, out / "spec.txt", [*ARGS, *SPEC]) as speculative,
    ):
        yield plain, speculative


def _complete(server: Server, prompt: list[int], n: int = 48) -> str:
    r = server.client().completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0)
    assert r.usage.completion_tokens == n
    return str(r.choices[0].text)


def test_greedy_text_equals_plain_under_batching(servers: tuple[Server, Server]) -> None:
    plain, spec = servers
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        want = list(pool.map(lambda p: _complete(plain, p), PROMPTS))
        got = list(pool.map(lambda p: _complete(spec, p), PROMPTS))
    assert got == want
    assert spec.metric("freetoken_spec_drafted_tokens_total") > 0
    assert spec.metric("freetoken_spec_accepted_tokens_total") >= 0
    assert plain.metric("freetoken_spec_drafted_tokens_total") == 0


def test_auto_draft_length_equals_plain_under_batching(
    model: Path, servers: tuple[Server, Server], tmp_path: Path
) -> None:
    plain, _ = servers
    auto = [*ARGS, *SPEC, "--spec-draft-n-auto"]
    with live_server(model, tmp_path / "auto.txt", auto) as server:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            want = list(pool.map(lambda p: _complete(plain, p), PROMPTS))
            got = list(pool.map(lambda p: _complete(server, p), PROMPTS))
        assert got == want
        assert server.metric("freetoken_spec_drafted_tokens_total") > 0


def test_prefix_reuse_equals_plain(servers: tuple[Server, Server]) -> None:
    plain, spec = servers
    first = PROMPTS[1]
    head = _complete(spec, first, 24)
    assert head == _complete(plain, first, 24)
    longer = [*first, 500, 501, 502]
    assert _complete(spec, longer, 32) == _complete(plain, longer, 32)
    assert spec.metric("freetoken_prompt_tokens_cached_total") > 0


@pytest.mark.parametrize(
    "fields",
    [{"speculative.n_max": 99}, {"speculative.n_min": 5}, {"speculative.p_min": 1.5}],
)
def test_bad_draft_fields_are_400_json(servers: tuple[Server, Server], fields: dict) -> None:
    _, spec = servers
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, **fields}
    status, data = spec.raw("POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400
    assert data["error"]["param"] == next(iter(fields))


def test_draft_fields_on_a_plain_server_are_400(servers: tuple[Server, Server]) -> None:
    plain, _ = servers
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "speculative.n_max": 2}
    status, data = plain.raw("POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and "--spec-type" in data["error"]["message"]
