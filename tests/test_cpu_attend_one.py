"""One token's attention on the CPU in one Rust call (``_core.attend_one``, taken by
``Transformer._attention`` for a single-token step): the same outputs and cached keys and
values as the torch path it replaces (head norms, RoPE, the cache store, ``layers.attention``),
position after position, through sliding-window rings that wrap and full caches, NEOX and
adjacent-pair RoPE; the CPU RMS norm (``_core.rms_norm``) against its float64 definition;
and bad shapes are errors before memory is touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from freetoken import _core
from freetoken.errors import ShapeError
from freetoken.llm import LLM
from freetoken.models.layers import rms_norm
from freetoken.models.transformer import Transformer
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.step import Span, Step
from synthetic import SMALL_DENSE

WINDOW = 8
MAX_STEP = 3


@pytest.fixture(scope="module", params=["gemma3", "llama", "qwen3"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    from freetoken.testmodel import make_test_model

    arch = request.param
    window = {"sliding_window": WINDOW, "swa_pattern": 2} if arch == "gemma3" else {}
    path = make_test_model(
        arch,
        **SMALL_DENSE,
        seed=3,
        quant="q8_0",
        out=tmp_path_factory.mktemp("attend") / f"{arch}.gguf",
        **window,
    )
    m = LLM(Path(path), n_ctx=64).model
    assert isinstance(m, Transformer)
    return m


def _run(model: Transformer, n: int) -> tuple[list[torch.Tensor], KVCache]:
    """Each layer's attention output at positions 0..n-1, one token a step, and the cache."""
    cache = model.new_cache(64, max_step=MAX_STEP)
    gen = torch.Generator().manual_seed(7)
    outs = []
    for p in range(n):
        cache.reserve(1)
        step = Step(torch.tensor([p]), [Span(p, 1, cache)])
        for i, blk in enumerate(model.blocks):
            h = torch.randn(1, model.cfg.hidden, generator=gen)
            outs.append(model._attention(i, blk, h, step))
        cache.commit(1)
    return outs, cache


def test_fused_attention_matches_the_torch_path(
    model: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 3 * (WINDOW + MAX_STEP)  # rings of WINDOW + MAX_STEP - 1 wrap twice
    cache = model.new_cache(64, max_step=MAX_STEP)
    step = Step(torch.tensor([0]), [Span(0, 1, cache)])
    assert model._cpu_one_token_spans(model.blocks[0], torch.zeros(1), step) == [0]
    assert any(cache.ring) == bool(model.feat.swa_pattern)
    got, got_cache = _run(model, n)
    with monkeypatch.context() as m:
        m.setattr(Transformer, "_cpu_one_token_spans", lambda self, blk, h, step: [])
        want, want_cache = _run(model, n)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for kw, kg in zip(want_cache.k + want_cache.v, got_cache.k + got_cache.v, strict=True):
        torch.testing.assert_close(kg, kw, rtol=1e-5, atol=1e-5)


def test_a_decode_row_is_the_same_beside_a_prompt_and_alone(model: Transformer) -> None:
    # A sequence's one-token step takes the same call in a step that also runs another
    # sequence's prompt rows (which take the torch path) as alone: bit-identical rows, so that
    # concurrent greedy streams follow their solo runs.
    gen = torch.Generator().manual_seed(11)
    h_one = torch.randn(1, model.cfg.hidden, generator=gen)
    h_prompt = torch.randn(4, model.cfg.hidden, generator=gen)
    alone_cache, mixed_cache = model.new_cache(64), model.new_cache(64)
    other = model.new_cache(64)
    for c in (alone_cache, mixed_cache, other):
        c.reserve(4)
    alone = Step(torch.tensor([0]), [Span(0, 1, alone_cache)])
    mixed = Step(torch.tensor([0, 1, 2, 3, 0]), [Span(0, 4, other), Span(0, 1, mixed_cache)])
    blk = model.blocks[0]
    assert model._cpu_one_token_spans(blk, h_one, mixed) == [1]
    want = model._attention(0, blk, h_one, alone)
    got = model._attention(0, blk, torch.cat([h_prompt, h_one]), mixed)
    assert torch.equal(got[4:], want)
    assert torch.equal(mixed_cache.k[0][:1], alone_cache.k[0][:1])
    # The prompt rows are those of the prompt alone.
    prompt_cache = model.new_cache(64)
    prompt_cache.reserve(4)
    solo = model._attention(0, blk, h_prompt, Step(torch.arange(4), [Span(0, 4, prompt_cache)]))
    torch.testing.assert_close(got[:4], solo, rtol=0, atol=0)


def test_bad_shapes_are_errors() -> None:
    q, k, v = torch.zeros(32), torch.zeros(16), torch.zeros(16)
    kc, vc, out = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(32)

    def call(write: list[int], lo: int, hi: int, q: torch.Tensor = q) -> None:
        _core.attend_one(
            q, k, v, kc, vc, write, lo, hi, 4, 2, None, None, 1e-6, None, None, True, 1.0, None, out
        )

    call([1], 0, 2)
    with pytest.raises(ShapeError):
        call([4], 0, 4)  # a row past the cache
    with pytest.raises(ShapeError):
        call([1], 2, 4)  # the token's own row not read
    with pytest.raises(ShapeError):
        call([1], 0, 2, torch.zeros(24))  # a short query


def test_rms_norm_matches_float64() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 640, generator=gen) * 40
    w = torch.randn(640, generator=gen)
    got = rms_norm(x, w, 1e-6)
    x64 = x.double()
    want = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ShapeError):
        _core.rms_norm(x, w[:7], 1e-6, torch.empty(3, 5, 640))  # not whole rows of the weight
    with pytest.raises(ShapeError):
        _core.rms_norm(x, w, 1e-6, torch.empty(3, 640))
