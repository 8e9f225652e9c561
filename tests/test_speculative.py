"""Speculative decoding on the CPU engine (engine/speculative.py):

- greedy: the tokens with speculation equal those without, 128 tokens after prompts of
  several lengths, with each family's multi-token-prediction head (qwen35, qwen35moe,
  qwen3next, glm4moe written with ``nextn_layers``), with a draft-model pair (the target's
  weights at a coarser quantization, so that some drafts are kept and some not: the cache
  rewind runs at every accepted length), the same pair with the draft length chosen per step
  (``--spec-draft-n-auto``), and with n-gram drafts; one run on gemma3 goes round its
  sliding-window rings;
- sampling: the tokens a verify step gives at a draft position are distributed as the
  target's distribution (float64 softmax of the model's logits over the top-k, computed
  here), by a chi-square test over 4000 draws per position; and the rule with a draft
  distribution that is not one-hot against its target, 20000 draws;
- the model-free parts: n-gram drafts, llama.cpp's synthetic rates, the cache rewind of a
  hybrid against a fresh run;
- bad input: a draft model with another vocabulary, draft-mtp on a model without nextn
  layers, draft counts out of range, synthetic rates that increase or leave [0, 1]: an
  InvalidInputError naming the flag or file, and from the CLI one line and exit code 2.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from freetoken.cli import main
from freetoken.engine.options import EngineOptions
from freetoken.engine.spec_options import SpecOptions
from freetoken.engine.speculative import verify_tokens
from freetoken.errors import FileAccessError, InvalidInputError
from freetoken.llm import LLM
from freetoken.runtime.sampler import Sampler, SamplingParams
from freetoken.runtime.speculative import accept_draft, ngram_draft, synth_rates
from freetoken.testmodel import make_test_model
from freetoken.testmodel.vocab import llama_tree
from teacher_forced import NEAR_TIE, routing_near_ties

GREEDY = SamplingParams(temperature=0.0)
N_GEN = 128
_TINY: dict[str, Any] = dict(layers=4, hidden=64, ffn=128, heads=2, kv_heads=1, head_dim=32)
_MOE: dict[str, Any] = dict(experts=4, top_k=2, expert_ffn=64)
MTP_MODELS: dict[str, dict[str, Any]] = {
    "qwen35": dict(arch="qwen35"),
    "qwen35moe": dict(arch="qwen35moe", **_MOE),
    "qwen3next": dict(arch="qwen3next", **_MOE),
    "glm4moe": dict(arch="glm4moe", leading_dense=1, **_MOE),
}
#: A prompt shorter than the n-gram, one of repeats, one longer than a delta-rule chunk.
PROMPTS = {
    "short": [1, 450, 4996],
    "repeats": [1] + [319, 4996, 17354, 1701] * 8,
    "long": [1] + [(37 * i) % 3000 + 100 for i in range(150)],
}


def _vocab(name: str) -> Path:
    try:
        return llama_tree() / "models" / name
    except FileAccessError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("spec")
    vocab = _vocab("ggml-vocab-llama-spm.gguf")
    made = {}

    def make(name: str, arch: str, **kw: Any) -> None:
        made[name] = make_test_model(
            arch, vocab=vocab, out=out / f"{name}.gguf", log=lambda _: None, **kw
        )

    for name, spec in MTP_MODELS.items():
        spec = dict(spec)
        make(f"{name}-mtp", spec.pop("arch"), nextn_layers=1, seed=4, **_TINY, **spec)
    pair = dict(seed=3, **_TINY, **_MOE)
    make("target", "qwen35moe", quant="q8_0", **pair)
    make("draft", "qwen35moe", quant="q4_0", **pair)
    make("qwen3", "qwen3", seed=2, **_TINY)
    make("gemma3", "gemma3", seed=2, sliding_window=8, swa_pattern=2, **_TINY)
    made["other-vocab"] = make_test_model(
        "qwen3", vocab=_vocab("ggml-vocab-gpt-2.gguf"), out=out / "other-vocab.gguf",
        log=lambda _: None, **_TINY,
    )  # fmt: skip
    return made


def _greedy(llm: LLM, prompt: list[int], n: int = N_GEN) -> list[int]:
    return list(llm.stream_tokens(prompt, n, GREEDY))


def _assert_same_tokens(plain: LLM, prompt: list[int], want: list[int], got: list[int]) -> None:
    """``got == want``, or equal up to a token that the one-token steps chose at a near-tie
    (the verify steps compute the same positions several tokens a step, another rounding):
    the plain run's top two logits there closer than ``NEAR_TIE``, or a MoE layer routing
    that position at a near-tie."""
    if got == want:
        return
    assert len(got) == len(want)
    i = next(j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    seq = prompt + want[: i + 1]
    logits = plain.model.forward(seq[:-1], plain.model.new_cache(len(seq)))
    top2 = torch.topk(logits.float(), 2).values
    if float(top2[0] - top2[1]) < NEAR_TIE:
        return
    routed = routing_near_ties(plain.model, seq, len(seq) - 2)
    assert routed, f"token {i} differs ({got[i]} != {want[i]}) away from any near-tie"


# ---- greedy equality ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MTP_MODELS))
def test_mtp_greedy_equals_plain(name: str, files: dict[str, Path]) -> None:
    path = files[f"{name}-mtp"]
    plain = LLM(path, n_ctx=512)
    spec = LLM(path, n_ctx=512, spec=SpecOptions(spec_type="draft-mtp", n_max=3))
    for prompt in PROMPTS.values():
        want = _greedy(plain, prompt)
        assert len(want) == N_GEN
        _assert_same_tokens(plain, prompt, want, _greedy(spec, prompt))
        stats = spec.last_stats.spec
        assert stats is not None and stats.drafted > 0


def test_draft_model_greedy_equals_plain(files: dict[str, Path]) -> None:
    plain = LLM(files["target"], n_ctx=512)
    spec = LLM(
        files["target"], n_ctx=512, spec=SpecOptions(draft_model=str(files["draft"]), n_max=4)
    )
    for prompt in PROMPTS.values():
        assert _greedy(spec, prompt) == _greedy(plain, prompt)
        stats = spec.last_stats.spec
        assert stats is not None
        # Drafts kept and drafts rejected: the rewind ran inside verify steps.
        assert 0 < stats.accepted < stats.drafted
        assert any(k > 2 for k in stats.steps)


@pytest.mark.parametrize("kind", ["draft-mtp", "draft-simple"])
def test_half_caches_for_drafts_too(kind: str, files: dict[str, Path]) -> None:
    """``-ctk/-ctv f16`` keep the MTP head's and the draft model's keys and values in half
    precision too, and speculative greedy still equals plain greedy on half caches."""
    half = EngineOptions(device="cpu", cache_type_k="f16", cache_type_v="f16")
    if kind == "draft-mtp":
        path, opts = files["qwen35moe-mtp"], SpecOptions(spec_type="draft-mtp", n_max=3)
    else:
        path, opts = files["target"], SpecOptions(draft_model=str(files["draft"]), n_max=4)
    plain = LLM(path, n_ctx=512, engine=half)
    spec = LLM(path, n_ctx=512, engine=half, spec=opts)
    assert spec.drafters is not None
    drafter = spec.drafters(64)
    cache = drafter.cache  # type: ignore[attr-defined]
    assert all(t.dtype == torch.float16 for t in cache.k + cache.v)
    for prompt in PROMPTS.values():
        want = _greedy(plain, prompt)
        _assert_same_tokens(plain, prompt, want, _greedy(spec, prompt))
        stats = spec.last_stats.spec
        assert stats is not None and stats.drafted > 0


def test_auto_draft_length_greedy_equals_plain(files: dict[str, Path]) -> None:
    opts = SpecOptions(draft_model=str(files["draft"]), n_max=4, n_auto=True)
    plain, spec = LLM(files["target"], n_ctx=512), LLM(files["target"], n_ctx=512, spec=opts)
    lengths: set[int] = set()
    for prompt in PROMPTS.values():
        assert _greedy(spec, prompt) == _greedy(plain, prompt)
        assert spec.last_stats.spec is not None
        lengths |= set(spec.last_stats.spec.steps)
    # Steps of every length ran (each is measured before the first choice), plain ones too.
    assert lengths == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("name", ["qwen3", "qwen35-mtp"])
def test_ngram_greedy_equals_plain(name: str, files: dict[str, Path]) -> None:
    opts = SpecOptions(spec_type="ngram-simple", ngram_size_n=1, ngram_size_m=4, n_max=4)
    plain, spec = LLM(files[name], n_ctx=512), LLM(files[name], n_ctx=512, spec=opts)
    drafted = 0
    for prompt in PROMPTS.values():
        assert _greedy(spec, prompt) == _greedy(plain, prompt)
        assert spec.last_stats.spec is not None
        drafted += spec.last_stats.spec.drafted
    assert drafted > 0


def test_sliding_window_rings_greedy_equals_plain(files: dict[str, Path]) -> None:
    # Window 8: the rings hold 8 + 511 positions (the prompt chunk); 500 + 128 go past them.
    prompt = [1] + [(53 * i) % 2000 + 100 for i in range(499)]
    plain = LLM(files["gemma3"], n_ctx=2048)
    spec = LLM(files["gemma3"], n_ctx=2048, spec=SpecOptions(draft_model=str(files["qwen3"])))
    cache_rings = plain.model.new_cache(2048, max_step=512).ring
    assert any(cache_rings) and len(prompt) + N_GEN > max(cache_rings)
    assert _greedy(spec, prompt) == _greedy(plain, prompt)


def test_prefix_reuse_after_speculation(files: dict[str, Path]) -> None:
    # A second request sharing the first's prompt and continuation reuses the cut-back caches.
    path = files["qwen35moe-mtp"]
    plain = LLM(path, n_ctx=512)
    spec = LLM(path, n_ctx=512, spec=SpecOptions(spec_type="draft-mtp"))
    first = PROMPTS["long"]
    out = _greedy(spec, first, 40)
    assert out == _greedy(plain, first, 40)
    second = first + out[:20] + [500, 501]
    assert _greedy(spec, second, 40) == _greedy(LLM(path, n_ctx=512), second, 40)


# ---- sampling ------------------------------------------------------------------------------


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square goodness-of-fit p-value of ``counts`` against ``probs``."""
    n = counts.sum()
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_sampling_keeps_the_target_distribution(files: dict[str, Path]) -> None:
    llm = LLM(files["qwen3"], n_ctx=64)
    prompt = PROMPTS["short"]
    logits = llm.logits(prompt)[-1].double()
    top = torch.topk(logits, 8)
    draft0 = int(top.indices[0])  # kept about 70% of the time
    rows = llm.logits([*prompt, draft0])[-2:]
    p1 = torch.topk(rows[1].double(), 8)
    n = 4000
    first = torch.zeros(8)
    second = torch.zeros(8)
    for seed in range(n):
        params = SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0, seed=seed)
        out = verify_tokens(Sampler(params, llm.vocab_size), rows, prompt, [draft0], ())
        first[(top.indices == out[0]).nonzero()[0, 0]] += 1
        if out[0] == draft0:
            second[(p1.indices == out[1]).nonzero()[0, 0]] += 1
    want0 = torch.softmax(top.values, -1)
    want1 = torch.softmax(p1.values, -1)
    # The kept draft's share is its target probability; then the next token is the target's.
    assert _chi2_pvalue(first, want0) > 1e-3
    assert second.sum() > 200 and _chi2_pvalue(second, want1) > 1e-3


def test_accept_rule_with_a_draft_distribution() -> None:
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(10, generator=gen, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(10, generator=gen, dtype=torch.float64) * 1.5, -1)
    counts = torch.zeros(10)
    draws = torch.multinomial(q, 20000, replacement=True, generator=gen)
    for d in draws.tolist():
        counts[accept_draft(p, d, q, gen)] += 1
    assert _chi2_pvalue(counts, p) > 1e-3


# ---- the model-free parts ------------------------------------------------------------------


def test_ngram_draft_follows_the_latest_earlier_match() -> None:
    ctx = [9, 1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 1, 2]
    # The last 2 tokens (1, 2) occur at 6 (latest before the end) and 1: 6 wins.
    assert ngram_draft(ctx, 2, 3) == [3, 7, 8]
    assert ngram_draft(ctx, 2, 9) == []  # too short a context for n + m
    assert ngram_draft([5, 6, 7, 8, 9, 10, 11, 12, 13, 6, 7], 2, 3) == [8, 9, 10]
    assert ngram_draft([5, 6, 7, 8, 9, 10, 11, 12, 13, 6, 99], 2, 3) == []  # no earlier match


def test_synth_rates_as_llama_cpp() -> None:
    assert synth_rates(None, (0.8, 0.6, 0.4), 3) == [0.8, 0.6, 0.4]
    rates = synth_rates(2.0, (), 3)
    assert math.isclose(sum(rates), 1.0, rel_tol=1e-6)  # mean length 1 + sum(rates)
    assert all(math.isclose(rates[i], rates[0] ** (i + 1)) for i in range(3))
    assert synth_rates(4.0, (), 3) == [1.0, 1.0, 1.0]
    assert synth_rates(None, (), 3) == []


def test_hybrid_rewind_matches_a_fresh_run(files: dict[str, Path]) -> None:
    llm = LLM(files["target"], n_ctx=128)
    model, prompt, step = llm.model, PROMPTS["long"][:70], [5, 6, 7, 8, 9]
    cache = model.new_cache(128)
    model.forward(prompt, cache)
    cache.keep_steps = True
    model.forward(step, cache, all_logits=True)
    cache.keep_steps = False
    cache.rewind(len(prompt) + 2)
    got = model.forward([42], cache)
    fresh = model.new_cache(128)
    model.forward(prompt, fresh)
    model.forward(step[:2], fresh)
    assert torch.equal(got, model.forward([42], fresh))


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(spec_type="ngram-simple", n_max=0), "--spec-draft-n-max"),
        (dict(spec_type="ngram-simple", n_max=33), "--spec-draft-n-max"),
        (dict(spec_type="ngram-simple", n_max=3, n_min=4), "--spec-draft-n-min"),
        (dict(spec_type="ngram-simple", p_min=1.5), "--spec-draft-p-min"),
        (dict(spec_type="draft-simple"), "--spec-draft-model"),
        (dict(spec_type="ngram-simple", synth_rates=(0.5, 0.6, 0.1)), "not increase"),
        (dict(spec_type="ngram-simple", synth_rates=(1.2, 0.6, 0.1)), "within [0, 1]"),
        (dict(spec_type="ngram-simple", synth_rates=(0.5,)), "3 values"),
        (dict(spec_type="ngram-simple", synth_len=5.0), "--spec-synth-len"),
        (dict(synth_rates=(0.5, 0.4, 0.1)), "need a --spec-type"),
        (dict(n_auto=True), "--spec-draft-n-auto needs a --spec-type"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(words)):
        SpecOptions(**kwargs)


def test_draft_model_with_another_vocabulary(files: dict[str, Path]) -> None:
    with pytest.raises(InvalidInputError, match="vocabulary"):
        LLM(files["qwen3"], spec=SpecOptions(draft_model=str(files["other-vocab"])))


def test_mtp_without_nextn_layers(files: dict[str, Path]) -> None:
    with pytest.raises(InvalidInputError, match=r"nextn\.eh_proj"):
        LLM(files["target"], spec=SpecOptions(spec_type="draft-mtp"))


@pytest.mark.parametrize(
    "flags",
    [
        ["-md", "{other}"],
        ["--spec-type", "draft-mtp"],
        ["--spec-type", "ngram-simple", "--spec-draft-n-max", "0"],
        ["--spec-type", "ngram-simple", "--spec-draft-n-min", "-1"],
        ["--spec-type", "ngram-simple", "--spec-synth-rates", "0.4,0.6,0.2"],
        ["--spec-type", "ngram-simple", "--spec-synth-rates", "0.4,x,0.2"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    flags: list[str], files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [f.format(other=files["other-vocab"]) for f in flags]
    rc = main(
        ["generate", "-m", str(files["qwen3"]), "-p", "hi", "-n", "2", "--device", "cpu", *flags]
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert rc == 2 and len(err) == 1


def test_cli_generate_and_bench_report_speculation(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    path = str(files["glm4moe-mtp"])
    spec = ["--spec-type", "draft-mtp", "--spec-synth-rates", "0.8,0.6,0.4"]
    assert main(["generate", "-m", path, "-p", "hi", "-n", "8", "--temp", "0", *spec]) == 0
    assert "drafted" in capsys.readouterr().err
    rc = main(["bench", "-m", path, "-p", "8", "-n", "48", "-r", "1", "-o", "json", *spec])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sp = out["spec"]
    assert sp["drafted"] > 0 and 0 < sp["accepted"] < sp["drafted"]
    assert sorted(sp["step_ms"]) == ["1", "2", "3", "4"] or sorted(sp["step_ms"]) == [1, 2, 3, 4]


def test_out_of_vocabulary_ids_are_refused(files: dict[str, Path]) -> None:
    """A token id outside the vocabulary is an InvalidInputError naming it, from a trunk step
    and from an MTP head's, and the caches keep nothing of it: the next step gives what it
    gives on fresh caches (the recurrent state included)."""
    from freetoken.models.mtp import MtpHead

    llm = LLM(files["qwen35moe-mtp"], n_ctx=64)
    model = llm.model
    bad = model.embed.vocab
    cache = model.new_cache(64)
    with pytest.raises(InvalidInputError, match=f"token id {bad} is outside the vocabulary"):
        model.forward([1, 450, bad], cache)
    assert cache.length == 0
    torch.testing.assert_close(
        model.forward([1, 450], cache), model.forward([1, 450], model.new_cache(64)), rtol=0, atol=0
    )
    head = MtpHead(model, llm.gguf)
    hidden = torch.zeros(1, model.cfg.hidden)
    head_cache = head.new_cache(64)
    with pytest.raises(InvalidInputError, match=f"token id {bad} is outside the vocabulary"):
        head.forward([bad], hidden, head_cache)
    with pytest.raises(InvalidInputError, match=f"token id {bad} is outside the vocabulary"):
        head.advance([bad], hidden, head_cache)
    assert head_cache.length == 0
