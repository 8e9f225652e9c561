"""The Gated DeltaNet hybrids (qwen35, qwen35moe, qwen3next) on the CPU engine:

- the delta rule: the chunked prompt form and the one-token decode step against a float64
  loop over the recurrence as written, from a nonzero state, across chunk boundaries; the
  causal conv against torch's grouped conv1d;
- teacher-forced against llama.cpp (built from the same pinned source) on synthetic models of
  the three architectures, four quant mixes each (K-quants, legacy, IQ, mixed per layer): a
  prompt shorter than one delta-rule chunk and one longer than two prefill chunks, then 64
  tokens of llama.cpp's greedy continuation fed one decode step at a time; our argmax equals
  llama.cpp's except at its near-ties, mean KL(llama.cpp || ours) at most 0.005;
- the per-sequence state: a batch of two sequences gives each one's own logits, a cut back to
  a snapshot continues as a fresh run, a cut no snapshot serves runs again from the start;
  the state tensors are updated in place and a checkpoint puts a step's change back (what
  the GPU's captured decode steps rely on);
- bad files: a missing linear-attention tensor, a conv1d of the wrong width, head counts that
  do not divide, a full_attention_interval that does not fit: errors naming the tensor or key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from freetoken.errors import FreeTokenError, ShapeError
from freetoken.gguf import GGUFFile
from freetoken.llm import LLM, PROMPT_CHUNK
from freetoken.models import load_model
from freetoken.models.delta_net import (
    causal_conv,
    delta_rule_chunked,
    delta_rule_decode,
    delta_rule_step,
)
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.recurrent_cache import HybridCache
from gguf import GGUFValueType
from synthetic import build_models
from teacher_forced import compare
from test_moe_families_b import rewrite

N_GEN = 64
MAX_KL = 0.005
SHORT = "The capital of France is"

_BASE: dict[str, Any] = dict(
    layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, seed=5
)
_MOE: dict[str, Any] = dict(experts=8, top_k=2, expert_ffn=256)

#: Per architecture: K-quants, legacy, IQ, and types mixed per layer.
QUANTS = {
    "kquant": "q4_k,ssm=q6_k,attn_qkv=q5_k,output=q6_k",
    "legacy": "q4_0,attn_gate=q5_1,ssm_out=q8_0,ffn_down=q5_0,ffn_down_exps=q5_0",
    "iq": "iq4_xs,ssm=iq4_nl,output=q8_0",
    "mixed": "q8_0,blk.0.attn_qkv=q4_k,blk.1.ssm=q5_0,blk.2.attn_gate=iq4_xs,"
    "blk.3.attn=q4_1,blk.0-1.ffn=q5_k,blk.3.ffn=iq4_nl",
}
ARCHS = {"qwen35": {}, "qwen35moe": _MOE, "qwen3next": _MOE}
MODELS = {f"{a}-{q}": dict(arch=a, quant=spec, **extra) for a, extra in ARCHS.items()
          for q, spec in QUANTS.items()}  # fmt: skip


def _long_prompt() -> str:
    """Varied text of more than two prefill chunks of tokens."""
    words = [
        "river", "mountain", "quiet", "lantern", "seven", "copper", "violet", "harbor",
        "engine", "meadow", "thunder", "pocket", "winter", "silver", "orchard", "canvas",
    ]  # fmt: skip
    rng = np.random.default_rng(3)
    return " ".join(words[i] for i in rng.integers(0, len(words), 800))


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_models(MODELS, _BASE, tmp_path_factory.mktemp("qwen35"))


# ---- the recurrence ------------------------------------------------------------------------


def _reference(q, k, v, g, beta, s):
    """The gated delta rule token by token in float64 numpy."""
    q, k, v, g, beta, s = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta, s))
    s = s.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        for h in range(q.shape[0]):
            s[h] *= np.exp(g[h, t])
            delta = (v[h, t] - s[h].T @ k[h, t]) * beta[h, t]
            s[h] += np.outer(k[h, t], delta)
            out[h, t] = s[h].T @ q[h, t]
    return out, s


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
def test_delta_rule_chunked_and_step_match_float64(t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    h, d = 3, 16
    q = F.normalize(torch.randn(h, t, d, generator=gen), dim=-1) / d**0.5
    k = F.normalize(torch.randn(h, t, d, generator=gen), dim=-1)
    v = torch.randn(h, t, d, generator=gen)
    g = -torch.rand(h, t, generator=gen) * 2
    beta = torch.rand(h, t, generator=gen)
    s0 = torch.randn(h, d, d, generator=gen) * 0.3
    ref_o, ref_s = _reference(q, k, v, g, beta, s0)
    for fn in (delta_rule_chunked, delta_rule_step):
        o, s = fn(q, k, v, g, beta, s0)
        np.testing.assert_allclose(o.numpy(), ref_o, atol=2e-5, err_msg=fn.__name__)
        np.testing.assert_allclose(s.numpy(), ref_s, atol=2e-5, err_msg=fn.__name__)
    # Token by token through the decode step carries the same state.
    s = s0
    outs = []
    for i in range(t):
        o, s = delta_rule_step(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), s)
        outs.append(o)
    np.testing.assert_allclose(torch.cat(outs, 1).numpy(), ref_o, atol=2e-5)
    # And through the CPU's one-call step, the state updated in place.
    s = s0.clone()
    outs = [delta_rule_decode(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), s) for i in range(t)]
    np.testing.assert_allclose(torch.cat(outs, 1).numpy(), ref_o, atol=2e-5)
    np.testing.assert_allclose(s.numpy(), ref_s, atol=2e-5)


def test_delta_rule_decode_checks_sizes() -> None:
    h, d = 2, 8
    q, k, v = (torch.zeros(h, 1, d) for _ in range(3))
    g, beta = torch.zeros(h, 1), torch.zeros(h, 1)
    with pytest.raises(ShapeError, match="state has 120 values, 128 expected"):
        delta_rule_decode(q, k, v, g, beta, torch.zeros(h * d * d - 8))
    with pytest.raises(ShapeError, match="k has 14 values, 16 expected"):
        delta_rule_decode(q, k[:, :, :7], v, g, beta, torch.zeros(h, d, d))


def test_causal_conv_matches_torch_conv1d() -> None:
    gen = torch.Generator().manual_seed(0)
    c, kw, t = 6, 4, 9
    x = torch.randn(t + 5, c, generator=gen)
    w = torch.randn(c, kw, generator=gen)
    ref = F.conv1d(F.pad(x.T[None], (kw - 1, 0)), w[:, None, :], groups=c)[0].T
    state = torch.zeros(kw - 1, c)
    y1, state = causal_conv(x[:t], state, w)
    y2, state = causal_conv(x[t:], state, w)
    torch.testing.assert_close(torch.cat([y1, y2]), ref)
    torch.testing.assert_close(state, x[-(kw - 1) :])


# ---- against llama.cpp ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_runs(model_files: dict[str, Path], llama_ref_root: Path) -> dict[str, list[list[Any]]]:
    """Per model and prompt: (prompt tokens, greedy continuation, llama.cpp's logits of every
    position but the last)."""
    import llama_ref

    runs: dict[str, list[list[Any]]] = {}
    for name, path in model_files.items():
        with llama_ref.LlamaRef.load(path, n_ctx=2048, n_threads=2, root=llama_ref_root) as ref:
            runs[name] = []
            for text in (SHORT, _long_prompt()):
                prompt = ref.tokenize(text)
                gen = ref.greedy(prompt, N_GEN)
                seq = prompt + gen
                runs[name].append([prompt, gen, ref.logits(seq)[: len(seq) - 1]])
    return runs


def _ours(model: Any, prompt: list[int], gen: list[int]) -> np.ndarray:
    """The prompt in prefill chunks, then the continuation one decode step at a time."""
    cache = model.new_cache(2048)
    rows = [
        model.forward(prompt[i : i + PROMPT_CHUNK], cache, all_logits=True)
        for i in range(0, len(prompt), PROMPT_CHUNK)
    ]
    rows += [model.forward([t], cache)[None] for t in gen[:-1]]
    return torch.cat(rows).numpy()


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_llamacpp(
    name: str, model_files: dict[str, Path], llama_runs: dict[str, list[list[Any]]]
) -> None:
    model = load_model(GGUFFile(model_files[name]))
    for prompt, gen, ref in llama_runs[name]:
        assert len(prompt) < 64 or len(prompt) > 2 * PROMPT_CHUNK
        ours = _ours(model, prompt, gen)
        c = compare(ref, ours)
        assert not c.mismatches, f"{name} ({len(prompt)} prompt tokens): {c.describe()}"
        assert c.mean_kl <= MAX_KL, f"{name} ({len(prompt)} prompt tokens): {c.describe()}"


# ---- per-sequence state --------------------------------------------------------------------


def _same_positions(ref: torch.Tensor, ours: torch.Tensor) -> None:
    """The same positions computed in other steps (batched, reused, cut back): the CPU's
    multi-token products round by how many rows share a weight (the AVX2 tiles against the
    one-token kernels, for a dense step's tokens and an expert's routes alike), so the bound
    is the teacher-forced one. A sequence that read another's state, or a prefix that ran
    without its own, is off by a mean KL of 0.04-0.12 on these models."""
    c = compare(ref.reshape(-1, ref.shape[-1]).numpy(), ours.reshape(-1, ours.shape[-1]).numpy())
    assert not c.mismatches and c.mean_kl <= MAX_KL, c.describe()


def test_batched_sequences_keep_their_own_state(model_files: dict[str, Path]) -> None:
    model = load_model(GGUFFile(model_files["qwen3next-mixed"]))
    a, b = list(range(10, 50)), list(range(300, 320))
    alone = [model.forward(t, model.new_cache(256), all_logits=True) for t in (a, b)]
    ca, cb = model.new_cache(256), model.new_cache(256)
    both = model.forward_batch([(a, ca), (b, cb)], all_logits=True)
    for x, y in zip(alone, both, strict=True):
        _same_positions(x, y)
    # Decode steps of both in one batch, against each alone.
    da, db = model.forward_batch([([7], ca), ([9], cb)])
    ra, rb = model.new_cache(256), model.new_cache(256)
    model.forward(a, ra)
    model.forward(b, rb)
    _same_positions(model.forward([7], ra), da)
    _same_positions(model.forward([9], rb), db)


def test_batched_decode_steps_match_each_sequence_alone(model_files: dict[str, Path]) -> None:
    """Decode steps of three sequences in one batch (the CPU's batched Gated DeltaNet step:
    the conv and norms over all rows, the delta rule per sequence in place) give each the
    logits and states it gets decoding alone."""
    for name in ("qwen35moe-legacy", "qwen3next-mixed"):
        model = load_model(GGUFFile(model_files[name]))
        prompts = [list(range(10, 30)), list(range(300, 307)), list(range(40, 52))]
        steps = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
        batched = [model.new_cache(64) for _ in prompts]
        for p, c in zip(prompts, batched, strict=True):
            model.forward(p, c)
        rows = [
            model.forward_batch([([s[i]], c) for s, c in zip(steps, batched, strict=True)])
            for i in range(4)
        ]
        for j, (p, s) in enumerate(zip(prompts, steps, strict=True)):
            alone = model.new_cache(64)
            model.forward(p, alone)
            ref = torch.stack([model.forward([t], alone) for t in s])
            _same_positions(ref, torch.stack([r[j] for r in rows]))
            for got, want in zip(batched[j].ssm, alone.ssm, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_truncate_restores_a_snapshot_or_runs_again(model_files: dict[str, Path]) -> None:
    model = load_model(GGUFFile(model_files["qwen35-kquant"]))
    tokens = list(range(100, 200))
    fresh = model.forward(tokens, model.new_cache(256), all_logits=True)
    # The same steps as after the cut back below, on a new cache: equal to the last bit.
    steps = model.new_cache(256)
    model.forward(tokens[:64], steps)
    after_64 = model.forward(tokens[64:], steps, all_logits=True)
    cache = model.new_cache(256)
    assert isinstance(cache, HybridCache)
    model.forward(tokens[:64], cache)
    model.forward(tokens[64:90], cache)
    for t in tokens[90:95]:
        model.forward([t], cache)
    # 64 and 90 ended multi-token steps: 80 is served from 64, 64 and 90 exactly.
    assert cache.truncate(80) == 64
    out = model.forward(tokens[64:], cache, all_logits=True)
    torch.testing.assert_close(out, after_64, atol=0, rtol=0)
    _same_positions(fresh[64:], out)
    # Before the first snapshot: the states cannot serve it, the prefix runs again.
    assert cache.truncate(40) == 0
    assert all(not s.any() for s in cache.ssm) and all(not c.any() for c in cache.conv)
    out = model.forward(tokens, cache, all_logits=True)
    torch.testing.assert_close(out, fresh, atol=0, rtol=0)


def test_llm_chat_turn_reuses_prefix_like_a_fresh_run(model_files: dict[str, Path]) -> None:
    path = model_files["qwen35moe-legacy"]
    llm = LLM(path, n_ctx=512)
    first = list(range(20, 120))
    llm._evaluate(first)
    second = first + list(range(500, 530))
    reused = llm._evaluate(second)
    # The turn's steps on a new cache (the prefix, then the new tokens): the same to the
    # last bit; a fresh run of the whole turn in one step within the bound.
    model = load_model(GGUFFile(path))
    cache = model.new_cache(512)
    model.forward(first, cache)
    torch.testing.assert_close(reused, model.forward(second[100:], cache), atol=0, rtol=0)
    _same_positions(LLM(path, n_ctx=512)._evaluate(second), reused)


def test_states_stay_in_place_and_a_checkpoint_puts_them_back(
    model_files: dict[str, Path],
) -> None:
    """What a captured decode step (CUDA graph) relies on, on the same code the CPU runs: the
    recurrent states keep their tensors through prompt and decode steps and cuts back, and
    a checkpoint (taken before a capture's warm-up passes) puts a step's state change back,
    so the step run again gives the same logits."""
    model = load_model(GGUFFile(model_files["qwen3next-kquant"]))
    tokens = list(range(100, 180))
    cache = model.new_cache(256)
    assert isinstance(cache, HybridCache)
    ptrs = [t.data_ptr() for t in cache.conv + cache.ssm]
    model.forward(tokens[:70], cache)
    restore = cache.checkpoint()
    first = model.forward([5], cache)
    # As a capture's warm-up pass: the step ran, its position is not kept, the states moved.
    KVCache.truncate(cache, 70)
    restore()
    torch.testing.assert_close(model.forward([5], cache), first, atol=0, rtol=0)
    model.forward([6], cache)
    assert cache.truncate(71) == 70  # the snapshot at 70
    cache.truncate(0)
    model.forward(tokens, cache)
    assert [t.data_ptr() for t in cache.conv + cache.ssm] == ptrs


def test_captured_step_form_matches_eager_decode(model_files: dict[str, Path]) -> None:
    """Decode steps in the form a CUDA graph captures them (runtime/cuda_graph.py), run on the
    CPU: positions as a tensor, a fixed number of cached positions read with those past the
    token masked, two sequences in one step. The same logits as eager decode steps, and the
    states advance alike."""
    from freetoken.runtime.step import Span, Step

    for name in ("qwen35-kquant", "qwen3next-mixed"):
        model = load_model(GGUFFile(model_files[name]))
        prompts = [list(range(10, 50)), list(range(300, 371))]
        eager = [model.new_cache(256) for _ in prompts]
        graph = [model.new_cache(256) for _ in prompts]
        for p, e, g in zip(prompts, eager, graph, strict=True):
            model.forward(p, e)
            model.forward(p, g)
        for t in range(6):
            toks = [20 + t, 400 + t]
            ref = torch.stack(
                model.forward_batch([([x], c) for x, c in zip(toks, eager, strict=True)])
            )
            pos = torch.tensor([c.reserve(1) for c in graph])
            spans = [Span(pos[i : i + 1], 1, c, 256) for i, c in enumerate(graph)]
            with torch.inference_mode():
                out = model.run(torch.tensor(toks), Step(pos, spans), None)
            for c in graph:
                c.commit(1)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=f"{name} step {t}")
        for e, g in zip(eager, graph, strict=True):
            for a, b in zip(e.ssm + e.conv, g.ssm + g.conv, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---- bad files -----------------------------------------------------------------------------

_U32 = GGUFValueType.UINT32


def _bad(model_files: dict[str, Path], tmp_path: Path, **kw: Any) -> Path:
    return rewrite(model_files["qwen35-kquant"], tmp_path / "bad.gguf", **kw)


def test_missing_linear_attention_tensor(model_files: dict[str, Path], tmp_path: Path) -> None:
    path = _bad(model_files, tmp_path, tensors=lambda r: [
        (t.name, t.data, t.tensor_type) for t in r.tensors if t.name != "blk.1.ssm_a"
    ])  # fmt: skip
    with pytest.raises(FreeTokenError, match=r"blk\.1\.ssm_a"):
        load_model(GGUFFile(path))


def test_conv1d_of_wrong_width(model_files: dict[str, Path], tmp_path: Path) -> None:
    def narrower(r: Any) -> list[tuple[str, np.ndarray, int]]:
        return [
            (t.name, t.data[:, :3] if t.name.endswith("ssm_conv1d.weight") else t.data,
             t.tensor_type)
            for t in r.tensors
        ]  # fmt: skip

    with pytest.raises(FreeTokenError, match=r"blk\.0\.ssm_conv1d\.weight"):
        load_model(GGUFFile(_bad(model_files, tmp_path, tensors=narrower)))


def test_head_counts_that_do_not_divide(model_files: dict[str, Path], tmp_path: Path) -> None:
    path = _bad(model_files, tmp_path, meta={"qwen35.ssm.time_step_rank": (3, _U32)})
    with pytest.raises(FreeTokenError, match=r"qwen35\.ssm\.time_step_rank"):
        load_model(GGUFFile(path))


@pytest.mark.parametrize("interval", [0, 5])
def test_full_attention_interval_that_does_not_fit(
    model_files: dict[str, Path], tmp_path: Path, interval: int
) -> None:
    path = _bad(model_files, tmp_path, meta={"qwen35.full_attention_interval": (interval, _U32)})
    with pytest.raises(FreeTokenError, match=r"qwen35\.full_attention_interval"):
        load_model(GGUFFile(path))


# ---- make-test-model ------------------------------------------------------------------------


def test_preset_shape_and_overrides() -> None:
    """``--preset qwen3.5-35b-a3b`` has the issue's Qwen3.5-35B-A3B shape (checked on the
    layout, nothing written); a flag given overrides the preset."""
    import argparse

    from freetoken.testmodel import cli
    from freetoken.testmodel.registry import get_arch
    from freetoken.testmodel.writer import build_config

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--preset", "qwen3.5-35b-a3b", "--layers", "8", "-o", "x.gguf"])
    cli._apply_preset(args)
    assert (args.arch, args.layers, args.hidden, args.experts, args.top_k) == (
        "qwen35moe", 8, 2048, 256, 8,
    )  # fmt: skip
    # The released model's context (its config's max_position_embeddings): a server sized
    # for long prompts caps each slot at the file's context_length.
    assert args.ctx == 262144
    given = parser.parse_args(["--preset", "qwen3.5-35b-a3b", "--ctx", "8192", "-o", "x.gguf"])
    cli._apply_preset(given)
    assert given.ctx == 8192
    plain = parser.parse_args(["--arch", "qwen35moe", "-o", "x.gguf"])
    cli._apply_preset(plain)
    assert plain.ctx == 4096
    options = {k: getattr(args, k) for k in cli._ARCH_OPTIONS if getattr(args, k) is not None}
    cfg = build_config(
        args.arch, layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=248320,
        experts=args.experts, top_k=args.top_k, expert_ffn=args.expert_ffn,
        shared_experts=args.shared_experts, **options,
    )  # fmt: skip
    shapes = {t.name: t.shape for t in get_arch("qwen35moe").tensors(cfg)}
    # Layer 3 is full attention (every fourth), layer 0 linear.
    assert shapes["blk.3.attn_q.weight"] == (2 * 16 * 256, 2048)
    assert shapes["blk.3.attn_k.weight"] == (2 * 256, 2048)
    assert "blk.0.attn_q.weight" not in shapes
    assert shapes["blk.0.attn_qkv.weight"] == ((2 * 16 + 32) * 128, 2048)
    assert shapes["blk.0.ssm_conv1d.weight"] == ((2 * 16 + 32) * 128, 4)
    assert shapes["blk.0.ssm_out.weight"] == (2048, 32 * 128)
    assert shapes["blk.0.ffn_gate_exps.weight"] == (256, 512, 2048)
    assert shapes["blk.0.ffn_up_shexp.weight"] == (512, 2048)
    assert shapes["token_embd.weight"] == (248320, 2048)


@pytest.mark.parametrize("name", ["blk.0.ssm_out.weight", "blk.3.attn_output.weight"])
def test_every_layer_kind_matters(model_files: dict[str, Path], tmp_path: Path, name: str) -> None:
    """Zeroing a linear-attention layer's or the full-attention layer's output projection
    moves the distribution far beyond the KL tolerance: the comparisons above see both."""
    import shutil

    import gguf

    path = model_files["qwen35moe-legacy"]
    tokens = list(range(200, 260))
    model = load_model(GGUFFile(path))
    base = torch.softmax(model.forward(tokens, model.new_cache(128), True), -1)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    copy = tmp_path / "ablated.gguf"
    shutil.copy(path, copy)
    with open(copy, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(bytes(int(t.n_bytes)))  # blocks of zeros (scale 0)
    model = load_model(GGUFFile(copy))
    p = torch.softmax(model.forward(tokens, model.new_cache(128), True), -1)
    kl = float((base * (base.log() - p.log())).sum(-1).mean())
    assert kl > 0.05, (name, kl)
