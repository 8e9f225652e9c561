"""Speculative decoding on the GPU strategies (``gpu``, ``offload``, ``hybrid`` and ``cpu``
experts): greedy tokens with speculation equal those without on the same strategy, 128 tokens
after prompts of two lengths, for the model's own MTP head (glm4moe, and the Gated DeltaNet
hybrids where a GPU placement takes them), a draft-model pair (the target's weights at a
coarser quantization) and n-gram drafts, and with the draft length chosen per step
(``--spec-draft-n-auto``: plain steps, with the head shown them, between verify steps of
every length). The verify step is one forward step of N + 1 tokens
through the strategy. The MTP head's layer runs on the trunk's GPU, teacher-forced against the
same head on the CPU engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from freetoken.engine.options import EngineOptions  # noqa: E402
from freetoken.engine.spec_options import SpecOptions  # noqa: E402
from freetoken.engine.speculative import MtpDrafter  # noqa: E402
from freetoken.errors import FileAccessError, UnsupportedError  # noqa: E402
from freetoken.llm import LLM  # noqa: E402
from freetoken.runtime.sampler import SamplingParams  # noqa: E402
from freetoken.testmodel import make_test_model  # noqa: E402
from freetoken.testmodel.vocab import llama_tree  # noqa: E402
from teacher_forced import compare  # noqa: E402

pytestmark = pytest.mark.gpu

STRATEGIES = ["gpu", "offload", "hybrid", "cpu"]
_SHAPE: dict[str, Any] = dict(
    layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2,
    expert_ffn=128,
)  # fmt: skip
PROMPTS = [[1, 450, 4996], [1] + [(37 * i) % 3000 + 100 for i in range(150)]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("spec-gpu")
    try:
        vocab = llama_tree() / "models" / "ggml-vocab-llama-spm.gguf"
    except FileAccessError as e:
        pytest.skip(str(e))

    def make(name: str, arch: str, **kw: Any) -> Path:
        return make_test_model(
            arch, vocab=vocab, out=out / f"{name}.gguf", log=lambda _: None, **_SHAPE, **kw
        )

    return {
        "glm4moe-mtp": make("glm4moe-mtp", "glm4moe", leading_dense=1, nextn_layers=1, seed=4),
        "qwen35moe-mtp": make("qwen35moe-mtp", "qwen35moe", nextn_layers=1, seed=4),
        "target": make("target", "qwen3moe", seed=3, quant="q8_0"),
        "draft": make("draft", "qwen3moe", seed=3, quant="q4_0"),
    }


def _llm(path: Path, strategy: str, spec: SpecOptions | None = None) -> LLM:
    mib = 1 if strategy in ("offload", "hybrid") else None
    opts = EngineOptions(device="cuda", moe_strategy=strategy, moe_cache_mib=mib)
    try:
        return LLM(path, n_ctx=512, engine=opts, spec=spec)
    except UnsupportedError as e:  # a family no GPU placement takes yet
        pytest.skip(str(e))


def _greedy(llm: LLM, prompt: list[int]) -> list[int]:
    return list(llm.stream_tokens(prompt, 128, SamplingParams(temperature=0.0)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("model", "spec"),
    [
        ("glm4moe-mtp", dict(spec_type="draft-mtp")),
        ("qwen35moe-mtp", dict(spec_type="draft-mtp")),
        ("qwen35moe-mtp", dict(spec_type="draft-mtp", n_auto=True)),
        ("target", dict(spec_type="draft-simple", n_max=4)),
        ("target", dict(spec_type="ngram-simple", ngram_size_n=1, ngram_size_m=4, n_max=4)),
    ],
)
def test_gpu_greedy_with_speculation_equals_plain(
    strategy: str, model: str, spec: dict[str, Any], files: dict[str, Path]
) -> None:
    if spec["spec_type"] == "draft-simple":
        spec = {**spec, "draft_model": str(files["draft"])}
    plain = _llm(files[model], strategy)
    fast = _llm(files[model], strategy, SpecOptions(**spec))
    for prompt in PROMPTS:
        assert _greedy(fast, prompt) == _greedy(plain, prompt)
        assert fast.last_stats.spec is not None


def _head_logits(llm: LLM, tokens: list[int], hidden: torch.Tensor, one_by_one: int) -> np.ndarray:
    """The MTP head's logits teacher-forced on ``tokens``: each token paired with the trunk's
    final hidden state ``hidden`` of the position before, as ``MtpDrafter.observe`` pairs
    them; the last ``one_by_one`` tokens one step each (drafting's steps: CUDA graphs on the
    GPU), the others in one step."""
    assert llm.drafters is not None
    drafter = llm.drafters(len(tokens) + 1)
    assert isinstance(drafter, MtpDrafter)
    before = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
    cut = len(tokens) - one_by_one
    rows = [drafter.head.forward(tokens[:cut], before[:cut], drafter.cache)[0].cpu()]
    for i in range(cut, len(tokens)):
        rows.append(
            drafter.head.forward(tokens[i : i + 1], before[i : i + 1], drafter.cache)[0].cpu()
        )
    return torch.cat(rows).numpy()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model", ["glm4moe-mtp", "qwen35moe-mtp"])
def test_gpu_mtp_head_matches_the_cpu_head(
    strategy: str, model: str, files: dict[str, Path]
) -> None:
    spec = SpecOptions(spec_type="draft-mtp")
    cpu = LLM(files[model], n_ctx=512, engine=EngineOptions(device="cpu"), spec=spec)
    tokens = PROMPTS[1]
    hidden: list[torch.Tensor] = []  # the CPU engine's trunk feeds both heads
    cpu.model.forward_batch([(tokens, cpu.model.new_cache(len(tokens)))], hidden=hidden)
    gpu = _llm(files[model], strategy, spec)
    drafter = gpu.drafters(8) if gpu.drafters is not None else None
    assert isinstance(drafter, MtpDrafter) and drafter.head.device.type == "cuda"
    # Resident experts where the strategy allows, so that the head's steps are graphs.
    assert (drafter.head.graphs is not None) == (strategy != "cpu")
    ref = _head_logits(cpu, tokens, hidden[0], 8)
    c = compare(ref, _head_logits(gpu, tokens, hidden[0], 8))
    assert not c.mismatches and c.mean_kl <= 0.005, c.describe()
