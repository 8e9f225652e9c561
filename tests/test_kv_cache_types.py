"""``--cache-type-k/-v f16``: the KV cache in half precision on the CPU engine (llama.cpp's
default cache type). A half cache holds half the bytes; a prompt's logits are, bit for bit,
those of a float32 cache holding the same keys and values rounded to half (torch's rounding;
the Rust one-token step's is checked the same way in ``ft_cpu::attend``'s tests); decoding
in steps of one to five tokens stays within the teacher-forced bounds of llama.cpp, whose
cache is f16 too; the flags parse as llama.cpp's, and a GPU placement refuses f16 in one
line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from freetoken.engine import options
from freetoken.engine.options import EngineOptions
from freetoken.errors import UnsupportedError
from freetoken.llm import LLM
from freetoken.runtime.kv_cache import KVCache
from ring_model import STEP, build, random_tokens, stepped
from teacher_forced import compare

N_CTX = 64


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sliding-window layers (rings, written by index) beside full ones."""
    return build(tmp_path_factory.mktemp("kv-types") / "gemma3.gguf")


def _llm(path: Path, k: str = "f16", v: str = "f16") -> LLM:
    engine = EngineOptions(device="cpu", cache_type_k=k, cache_type_v=v)
    return LLM(path, n_ctx=N_CTX, engine=engine)


def test_a_half_cache_holds_half_the_bytes(gemma3: Path) -> None:
    half = _llm(gemma3).model.new_cache(N_CTX, max_step=STEP)
    full = _llm(gemma3, "f32", "f32").model.new_cache(N_CTX, max_step=STEP)
    assert all(t.dtype == torch.float16 for t in half.k + half.v)
    nbytes = [sum(t.numel() * t.element_size() for t in c.k + c.v) for c in (half, full)]
    assert 2 * nbytes[0] == nbytes[1]


@pytest.mark.parametrize(("k", "v"), [("f16", "f16"), ("f16", "f32"), ("f32", "f16")])
def test_prompt_logits_are_a_float32_cache_of_rounded_values(
    gemma3: Path, k: str, v: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(gemma3, k, v)
    seq = random_tokens(llm, 40)
    got = llm.model.forward(seq, llm.model.new_cache(N_CTX), all_logits=True)
    ref = _llm(gemma3, "f32", "f32").model
    store = KVCache.store

    def rounded(
        self: KVCache,
        layer: int,
        start: int | torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        n_keys: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def half(x: torch.Tensor, t: str) -> torch.Tensor:
            return x.half().float() if t == "f16" else x

        return store(self, layer, start, half(keys, k), half(values, v), n_keys)

    monkeypatch.setattr(KVCache, "store", rounded)
    want = ref.forward(seq, ref.new_cache(N_CTX), all_logits=True)
    assert torch.equal(got, want)


def test_stepped_decode_matches_llamacpp(gemma3: Path, llama_ref_root: Path) -> None:
    import llama_ref

    llm = _llm(gemma3)
    seq = random_tokens(llm, 48)  # six windows
    ours = stepped(llm.model, seq, N_CTX, STEP)[:-1].numpy()
    with llama_ref.LlamaRef.load(gemma3, n_ctx=N_CTX, n_threads=2, root=llama_ref_root) as ref:
        want = ref.logits(seq)[:-1]
    c = compare(want, ours)
    assert not c.mismatches and c.mean_kl <= 0.005, c.describe()


def test_flags_are_llamacpps() -> None:
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    opts = options.from_args(p.parse_args(["-ctk", "f16", "--cache-type-v", "f16"]))
    assert opts.kv_dtypes == (torch.float16, torch.float16)
    assert options.from_args(p.parse_args([])).kv_dtypes == (torch.float32, torch.float32)
    with pytest.raises(SystemExit):
        p.parse_args(["-ctk", "q4_0"])


@pytest.mark.gpu
def test_a_gpu_placement_refuses_half_caches(gemma3: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    engine = EngineOptions(device="cuda", cache_type_k="f16")
    with pytest.raises(UnsupportedError, match="cache-type"):
        LLM(gemma3, n_ctx=N_CTX, engine=engine)
