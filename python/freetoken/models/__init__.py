"""Model families, one file each; ``load_model`` picks one by ``general.architecture``."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from freetoken import _core
from freetoken.errors import UnsupportedError
from freetoken.gguf import GGUFFile
from freetoken.models import (
    deepseek2,
    gemma3,
    gemma4,
    glm4moe,
    gptoss,
    llama,
    minimax_m2,
    mistral3,
    olmoe,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen3next,
    qwen3vl,
    qwen3vlmoe,
    qwen35,
    qwen35moe,
)
from freetoken.models.config import ModelConfig
from freetoken.models.transformer import Transformer
from freetoken.runtime.moe import MoeContext, default_executor

__all__ = ["FAMILIES", "ModelConfig", "Transformer", "load_model"]

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "gemma3": gemma3,
    "gemma4": gemma4,
    "qwen3moe": qwen3moe,
    "qwen2moe": qwen2moe,
    "olmoe": olmoe,
    "gpt-oss": gptoss,
    "glm4moe": glm4moe,
    "deepseek2": deepseek2,
    "minimax-m2": minimax_m2,
    "mistral3": mistral3,
    "qwen3vl": qwen3vl,
    "qwen3vlmoe": qwen3vlmoe,
    "qwen35": qwen35,
    "qwen35moe": qwen35moe,
    "qwen3next": qwen3next,
}


def load_model(
    gguf: GGUFFile,
    progress: Callable[[int, int], None] | None = None,
    moe_threads: int | None = None,
    moe_precise: bool = False,
    moe_poll_us: int | None = None,
    moe_shared: bool = False,
) -> Transformer:
    """The model of ``gguf``'s architecture; UnsupportedError for an unknown one.
    ``moe_threads``, ``moe_precise``, ``moe_poll_us`` and ``moe_shared`` make the CPU expert
    executor of MoE models (``default_executor``)."""
    arch = gguf.architecture
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedError(
            f"{gguf.path}: architecture `{arch}` is not supported "
            f"(supported: {', '.join(sorted(FAMILIES))})"
        )
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if isinstance(tokens, list) else gguf.info("token_embd.weight").shape[0]
    feat = family.FEATURES
    cfg = ModelConfig.from_metadata(gguf.metadata, vocab, feat.swa_pattern)
    scale = family.attn_scale(cfg) if hasattr(family, "attn_scale") else None
    make_ffn = None
    moe = None
    # A family with an FFN factory is MoE when the file has experts (llama: Mixtral).
    if hasattr(family, "ffn_factory") and cfg.n_experts > 0:
        moe = MoeContext(
            default_executor(moe_threads, moe_precise, moe_poll_us, moe_shared),
            _core.MoeCounters(cfg.n_layers),
        )
        make_ffn = family.ffn_factory(moe)
    # A family may build its own Transformer (the hybrids: HybridTransformer).
    model_class = getattr(family, "MODEL", Transformer)
    model = model_class(gguf, cfg, feat, attn_scale=scale, progress=progress, make_ffn=make_ffn)
    model.moe = moe
    return model
