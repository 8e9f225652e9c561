"""Weights repacked for the CPU kernels (engine/repack.py): which matrices the CPU engine packs
at load (by the kernel level in use and each tensor's type as gguf-py reads the file), the
mapped pages it drops (the kernel's own accounting of the mapping, ``/proc/self/smaps``), and
``--no-repack``. That the packed products give llama.cpp's logits is shown by the llama.cpp
comparisons (test_moe_models.py, test_models_vs_llamacpp.py), which scripts/test.sh runs again
under the AVX2 cap, where these types pack."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from freetoken import _core
from freetoken.engine.options import EngineOptions
from freetoken.engine.repack import cpu_served, quantized_weights
from freetoken.errors import InvalidInputError
from freetoken.gguf import GGUFFile
from freetoken.llm import LLM
from freetoken.quant import QuantMatrix
from gguf import GGUFReader
from synthetic import build_models

#: The types each kernel level reads packed.
PACKED_TYPES = {"avx2": {"Q4_0", "Q8_0", "Q4_K"}}
_PAGE = 4096


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MoE model whose dense and expert tensors mix packed and row-kernel types."""
    spec = dict(
        arch="qwen3moe",
        head_dim=64,
        experts=8,
        top_k=2,
        expert_ffn=256,
        quant="q4_0,attn_v=q6_k,attn_output=q8_0,exps=q4_k,ffn_down_exps=q5_k",
    )
    base = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, seed=5)
    return build_models({"mix": spec}, base, tmp_path_factory.mktemp("repack"))["mix"]


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def _mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process, as the kernel counts them."""
    rss, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
            ours = head[-1] == str(path.resolve())
        elif ours and head[0] == "Rss:":
            rss += int(head[1]) * 1024
    return rss


def _names(gguf: GGUFFile) -> dict[int, str]:
    return {gguf.raw(name).ctypes.data: name for name in gguf.tensors}


def _check_packed(llm: LLM, model: Path, cpu_layers: set[int] | None) -> tuple[int, int]:
    """Asserts that exactly the weights only the CPU reads (all, or the expert layers
    ``cpu_layers``) are packed where their type (gguf-py's) is one the level packs; returns
    (bytes, ranges) of the packed originals."""
    packable = PACKED_TYPES.get(_core.cpu_kernel_isa(), set())
    types = _types(model)
    names = _names(llm.gguf)
    packed_bytes, ranges, n_packed = 0, 0, 0
    for w in quantized_weights(llm.model):
        if isinstance(w, QuantMatrix):
            name = names[w.raw.ctypes.data]
            want = cpu_layers is None and types[name] in packable
            assert w.spec.packed == want, name
            n_packed += want
            packed_bytes += w.raw.nbytes * want
            ranges += want
            continue
        kinds = [
            k
            for k in ("gate", "up", "down")
            if types[f"blk.{w.index}.ffn_{k}_exps.weight"] in packable
            and (cpu_layers is None or w.index in cpu_layers)
        ]
        assert w.packed == kinds, f"layer {w.index}"
        n_packed += bool(kinds)
        for k in kinds:
            packed_bytes += sum(n for _, n in w.matrices(k).ranges)
            ranges += len(w.matrices(k).ranges)
    assert llm.repacked is not None and llm.repacked.packed == n_packed
    # Two partial pages per packed range at most stay.
    assert packed_bytes - 2 * _PAGE * ranges <= llm.repacked.released <= packed_bytes
    return packed_bytes, ranges


def test_the_cpu_engine_packs_what_the_level_reads_packed(model: Path) -> None:
    """Every dense matrix and expert kind of a packed type is packed, no other, and the
    originals' pages leave the process: what stays mapped is at most the unpacked tensors
    and the pages that packed matrices share with them."""
    llm = LLM(model, n_ctx=64, engine=EngineOptions(device="cpu"))
    rss = _mapped_rss(model)
    packed_bytes, _ = _check_packed(llm, model, None)
    assert llm.repacked is not None
    assert llm.repacked.seen == len(quantized_weights(llm.model))
    if _core.cpu_kernel_isa() not in PACKED_TYPES:
        assert packed_bytes == 0
        return
    assert packed_bytes > 0
    assert rss <= model.stat().st_size - llm.repacked.released
    # A step reads only what it needs from the mapping: the packed copies serve the
    # products, so the released pages mostly stay out.
    logits = llm.logits(llm.tokenize("Hello there"))
    assert np.isfinite(logits.numpy()).all()
    assert _mapped_rss(model) <= model.stat().st_size - llm.repacked.released // 2


@pytest.mark.slow
def test_per_expert_tensors_pack_and_track_llamacpp(
    tmp_path_factory: pytest.TempPathFactory, llama_ref_root: Path
) -> None:
    """Experts stored one tensor each (Mixtral's older layout, which llama.cpp no longer
    loads: it runs the stacked file of the same seed, the same weights) are packed one
    buffer per expert instead of one per kind, and the model still tracks llama.cpp
    teacher-forced."""
    import llama_ref
    from teacher_forced import compare
    from test_models_vs_llamacpp import MAX_KL, PROMPTS

    spec = dict(arch="llama", experts=8, top_k=2, expert_ffn=256, quant="q8_0,exps=q4_0")
    base = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, seed=7)
    specs = {"stacked": spec, "per-expert": {**spec, "expert_layout": "per-expert"}}
    files = build_models(specs, base, tmp_path_factory.mktemp("per-expert"))
    llm = LLM(files["per-expert"], n_ctx=128, engine=EngineOptions(device="cpu"))
    packable = _core.cpu_kernel_isa() in PACKED_TYPES
    for w in quantized_weights(llm.model):
        if not isinstance(w, QuantMatrix):
            assert w.packed == (["gate", "up", "down"] if packable else []), w.index
    load = llama_ref.LlamaRef.load
    with load(files["stacked"], n_ctx=128, n_threads=2, root=llama_ref_root) as ref:
        for prompt in PROMPTS[:2]:
            tokens = ref.tokenize(prompt)
            seq = tokens + ref.greedy(tokens, 16)
            rows = slice(len(tokens) - 1, len(seq) - 1)
            c = compare(ref.logits(seq)[rows], llm.logits(seq)[rows].numpy())
            assert not c.mismatches and c.mean_kl <= MAX_KL, f"{prompt!r}: {c.describe()}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("strategy", "cpu_layers", "served"),
    [("cpu", None, {0, 1}), ("hybrid", "1", {0}), ("hybrid", None, set())],
)
def test_gpu_placements_repack_the_layers_only_the_cpu_serves(
    model: Path, strategy: str, cpu_layers: str | None, served: set[int]
) -> None:
    """Under a GPU placement the dense weights and the slot-cached experts stay as mapped
    (the GPU uploads those bytes); the MoE layers only the CPU serves are packed."""
    engine = EngineOptions(moe_strategy=strategy, moe_cpu_layers=cpu_layers)
    llm = LLM(model, n_ctx=64, engine=engine)
    assert llm.placement is not None
    assert {w.index for w in cpu_served(llm.model, llm.placement)} == served
    _check_packed(llm, model, served)
    logits = llm.logits(llm.tokenize("Hello there"))
    assert np.isfinite(logits.numpy()).all()


def test_no_repack_keeps_the_mapping(model: Path) -> None:
    llm = LLM(model, n_ctx=64, engine=EngineOptions(device="cpu", repack=False))
    assert llm.repacked is None
    for w in quantized_weights(llm.model):
        assert not (w.spec.packed if isinstance(w, QuantMatrix) else w.packed)


@pytest.mark.parametrize("mmap", [True, False])
def test_packing_keeps_the_mapped_bytes_and_refuses_other_memory(model: Path, mmap: bool) -> None:
    """A packed matrix's mapped bytes read back as the file holds them (gguf-py's view of the
    tensor) once their pages are dropped; a copy read into memory drops nothing; bytes
    outside the mapping are refused before anything is packed."""
    gguf = GGUFFile(model, mmap=mmap)
    name = "token_embd.weight"
    m = gguf.matrix(name)
    packed, dropped = m.spec.pack(gguf.handle)
    assert packed == (m.info.name in PACKED_TYPES.get(_core.cpu_kernel_isa(), set()))
    assert dropped <= m.raw.nbytes and (dropped > 0) == (packed and mmap)
    want = next(t for t in GGUFReader(model).tensors if t.name == name)
    assert np.array_equal(m.raw, np.asarray(want.data).view(np.uint8).reshape(-1))
    other = QuantMatrix(m.raw.copy(), m.qtype, m.shape)
    with pytest.raises(InvalidInputError, match="not inside the mapping"):
        other.spec.pack(gguf.handle)
    assert not other.spec.packed
