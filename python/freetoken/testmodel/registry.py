"""The architectures make-test-model writes: the dense ones of ``archs.py`` and the families
of ``archs_moe.py``, ``archs_more.py``, ``archs_gemma4.py`` and ``archs_hybrid.py``, by GGUF
``general.architecture``."""

from __future__ import annotations

from freetoken.errors import InvalidInputError
from freetoken.testmodel.archs import ArchSpec, Gemma3, Qwen2, Qwen3
from freetoken.testmodel.archs_gemma4 import GEMMA4_ARCHS
from freetoken.testmodel.archs_hybrid import HYBRID_ARCHS
from freetoken.testmodel.archs_moe import MOE_ARCHS
from freetoken.testmodel.archs_more import MORE_ARCHS

__all__ = ["ARCHS", "get_arch"]

#: The architectures make-test-model writes, by GGUF ``general.architecture``.
ARCHS: dict[str, ArchSpec] = {
    # llama is among the MoE architectures: Mixtral shares it (dense when experts == 0).
    a.name: a
    for a in (Qwen2(), Qwen3(), Gemma3(), *MOE_ARCHS, *MORE_ARCHS, *GEMMA4_ARCHS, *HYBRID_ARCHS)
}


def get_arch(name: str) -> ArchSpec:
    """The :class:`ArchSpec` called ``name``; InvalidInputError if there is none."""
    arch = ARCHS.get(name)
    if arch is None:
        raise InvalidInputError(
            f"unknown architecture `{name}` (make-test-model writes: {', '.join(ARCHS)})"
        )
    return arch
