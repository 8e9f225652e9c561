"""Stop strings cut the text at the earliest occurrence of any of them, whatever their order
in the list, the same from ``LLM.generate`` as from the server's text stream (one
implementation: freetoken.tokenizer.textstream)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from freetoken.tokenizer.textstream import TextStream

STOPS = ["world", "hello world"]
TEXT = "hello world"


def _server_text(pieces: list[bytes], stops: list[str]) -> str:
    stream = TextStream(stops)
    out = "".join(stream.feed(p) for p in pieces)
    return out if stream.stopped else out + stream.finish()


@pytest.fixture(scope="module")
def llm(default_model: Path):
    from freetoken.engine.options import EngineOptions
    from freetoken.llm import LLM

    return LLM(default_model, n_ctx=64, engine=EngineOptions(device="cpu"))


@pytest.mark.parametrize("stops", [STOPS, STOPS[::-1]])
def test_earliest_stop_from_llm_and_server(
    llm, stops: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = llm.tokenize(TEXT, add_special=False)

    def replay(prompt: list[int], max_tokens: int, params: object) -> Iterator[int]:
        yield from tokens

    # The model "generates" the tokens of TEXT: what is tested is the text path after it.
    monkeypatch.setattr(llm, "stream_tokens", replay)
    ours = llm.generate([1], max_tokens=len(tokens), stop=stops)
    server = _server_text([llm.tokenizer.token_to_piece(t) for t in tokens], stops)
    # "hello world" starts at 0, before "world" at 6: nothing is left before the cut.
    assert TEXT.index("hello world") < TEXT.index("world")
    assert ours == server == ""


def test_partial_stop_is_held_back_then_released() -> None:
    """Text that may begin a stop string waits; once it cannot, it comes out whole."""
    assert _server_text([b"hello wor", b"ks"], STOPS) == "hello works"
