"""Synthetic GGUF test models in real architectures' layouts (``freetoken make-test-model``).

- :func:`make_test_model` writes one: the layout and metadata llama.cpp expects for the
  architecture (:mod:`~freetoken.testmodel.archs`; the MoE ones, with their routers,
  experts, shared experts and attention variants, in :mod:`~freetoken.testmodel.archs_moe`),
  a vocabulary copied from a GGUF
  (:mod:`~freetoken.testmodel.vocab`), seeded weights scaled for a peaked next-token
  distribution and quantized by a quant spec (:mod:`~freetoken.testmodel.spec`, whose
  docstring has the grammar) through :func:`freetoken.quant.quantize`.
- MoE models may have skewed routing, per-layer hot experts with Zipf-like route shares
  (:mod:`~freetoken.testmodel.routing`), and tiled experts, a few layers' experts repeated
  through a deep model so it is written fast (``routing``, ``tile_experts`` of
  :func:`make_test_model`).
- :func:`check_peakedness` measures the mean top-1 probability over a prompt.
- :func:`add_arguments` and :func:`run` are the CLI subcommand.
"""

from __future__ import annotations

from freetoken.testmodel.archs import ArchSpec, ModelConfig, TensorDef
from freetoken.testmodel.check import MIN_TOP1, check_peakedness, top1_probabilities
from freetoken.testmodel.cli import add_arguments, run
from freetoken.testmodel.registry import ARCHS
from freetoken.testmodel.spec import QuantSpec, fallback_type, parse_quant_spec
from freetoken.testmodel.vocab import default_vocab, llama_tree, read_vocab
from freetoken.testmodel.writer import make_test_model, plan_tensors, source_tensors

__all__ = [
    "ARCHS",
    "MIN_TOP1",
    "ArchSpec",
    "ModelConfig",
    "QuantSpec",
    "TensorDef",
    "add_arguments",
    "check_peakedness",
    "default_vocab",
    "fallback_type",
    "llama_tree",
    "make_test_model",
    "parse_quant_spec",
    "plan_tensors",
    "read_vocab",
    "run",
    "source_tensors",
    "top1_probabilities",
]
