"""Where a model runs: the engine flags shared by ``generate``, ``bench``, ``serve`` and
``profile``, and :func:`use_gpu`, whether they send a model to the GPU
(``engine.placement.place`` then acts on them; ``freetoken.llm.load_llm`` loads a model with
them)."""

from __future__ import annotations

import argparse
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken.engine.split import SPLIT_MODES, SplitPlan, parse_tensor_split
from freetoken.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CACHE_SCOPES",
    "CACHE_TYPES",
    "DENSE_MODES",
    "DEVICES",
    "MOE_STRATEGIES",
    "EngineOptions",
    "add_arguments",
    "from_args",
    "use_gpu",
]

DEVICES = ("auto", "cpu", "cuda")
#: ``cpu`` keeps the experts on the CPU executor, the dense layers still on the GPU;
#: ``hybrid`` computes the GPU cache's misses on the CPU (engine/hybrid.py).
MOE_STRATEGIES = ("auto", "cpu", "gpu", "offload", "hybrid")
#: One slot pool per expert type triple, or per layer.
CACHE_SCOPES = ("type", "per-layer")
#: How dense weights run on the GPU (engine/gpu_layers.py).
DENSE_MODES = ("quant", "bf16")
#: Element types of the KV cache (llama.cpp's ``--cache-type-k/v`` names).
CACHE_TYPES = ("f32", "f16")
#: Microseconds of polling per ``--poll`` level (llama.cpp's 0-100 scale).
POLL_STEP_US = 20
#: ``--poll``'s default on the CPU engine: llama.cpp's level, 1 ms. Its one pool serves a
#: step's dense products and experts in turn, calls tens of microseconds apart, so workers
#: that keep polling between them start each at once (benches/README.md, "The engine on
#: packed rows"); GPU placements keep the pools' 100 µs.
CPU_ENGINE_POLL = 50

_log = logging.getLogger("freetoken")


@dataclass(frozen=True)
class EngineOptions:
    """``device``: ``auto`` (the GPU when there is one), ``cpu`` or ``cuda``.
    ``moe_strategy``: where routed experts run with a GPU: ``auto``, ``cpu`` (the CPU expert
    executor), ``gpu`` (all resident), ``offload`` (slot pools filled on demand) or
    ``hybrid`` (slot pools; the misses computed on the CPU at the same time).
    ``dense_weights``: ``quant`` (ggml-cuda MMVQ/MMQ on the GGUF types) or ``bf16``.
    ``moe_cache_*``: the slot pools' size in MiB (default: what fits), ``type`` or
    ``per-layer`` pools, and an expert-use profile (``freetoken profile``) to size and seed
    them; ``moe_cache_adaptive`` evicts by aged route counts instead of recency.
    ``moe_cpu_threads``: the CPU expert executor's threads (default: ``-t``);
    ``moe_cpu_precise``: its activations quantized in two passes (runtime/moe.py,
    ``default_executor``). ``poll``: llama.cpp's ``--poll`` level, 0-100: idle CPU workers
    poll for the next job ``poll`` x 20 µs before they sleep (None: 1 ms on the CPU engine,
    llama.cpp's, and 100 µs with a GPU).
    ``moe_cpu_layers``: MoE layers only the CPU serves (ids and ranges, a count, or ``auto``:
    engine/cpu_layers.py).
    ``moe_cache_audit``: a JSONL file that gets one record per generation (engine/audit.py).
    ``moe_fetch_share``: under ``hybrid``, the share (0-1) of a layer's missed experts that
    steps of several tokens upload and compute on the GPU, the rest computed on the CPU
    meanwhile (None: chosen per layer and step from the bench-bw figures, engine/fetch.py).
    ``mmap``: map the model file (the default) or, False (``--no-mmap``), read it into
    huge-page-backed memory (freetoken.gguf.GGUFFile).
    ``repack``: on the CPU engine, weights copied once into the layout the CPU kernels in use
    read fastest (engine/repack.py; False: llama.cpp's ``--no-repack``).
    ``split_mode``, ``tensor_split``, ``main_gpu``: llama.cpp's ``--split-mode`` (None:
    ``layer``, llama.cpp's default; ``none`` keeps the model on the main GPU),
    ``--tensor-split`` proportions and ``--main-gpu`` (:mod:`freetoken.engine.split`).
    ``split_plan``: the layer ranges given as they are instead (a
    :class:`~freetoken.engine.split.SplitPlan`: each range's GPU and cache share, the output
    layer's GPU; several ranges may name one GPU), checked against the model and the host at
    placement.
    ``swa_full``: sliding-window layers keep every position in a CPU KV cache (llama.cpp's
    ``--swa-full``: longer prefixes stay reusable) instead of a ring of what they can still
    see (runtime/kv_cache.py).
    ``cache_type_k``, ``cache_type_v``: the KV cache's element types, ``f32`` or ``f16``
    (llama.cpp's ``--cache-type-k/v``; ``f16`` halves the cache and what attention reads
    over a long context); ``f16`` runs on the CPU engine (GPU caches are float32)."""

    device: str = "auto"
    moe_strategy: str = "auto"
    dense_weights: str = "quant"
    moe_cache_mib: int | None = None
    moe_cache_scope: str = "type"
    moe_cache_profile: str | None = None
    moe_cache_adaptive: bool = False
    moe_cpu_threads: int | None = None
    moe_cpu_precise: bool = False
    poll: int | None = None
    moe_cpu_layers: str | None = None
    moe_cache_audit: str | None = None
    moe_fetch_share: float | None = None
    mmap: bool = True
    repack: bool = True
    swa_full: bool = False
    cache_type_k: str = "f32"
    cache_type_v: str = "f32"
    split_mode: str | None = None
    tensor_split: tuple[float, ...] | None = None
    main_gpu: int = 0
    split_plan: SplitPlan | None = None

    def __post_init__(self) -> None:
        for value, allowed, flag in (
            (self.device, DEVICES, "--device"),
            (self.moe_strategy, MOE_STRATEGIES, "--moe-strategy"),
            (self.dense_weights, DENSE_MODES, "--dense-weights"),
            (self.moe_cache_scope, CACHE_SCOPES, "--moe-cache-scope"),
            (self.cache_type_k, CACHE_TYPES, "--cache-type-k"),
            (self.cache_type_v, CACHE_TYPES, "--cache-type-v"),
        ):
            if value not in allowed:
                raise InvalidInputError(f"{flag} {value}: choose one of {', '.join(allowed)}")
        if self.moe_cache_mib is not None and self.moe_cache_mib < 0:
            raise InvalidInputError(f"--moe-cache-mib must be >= 0, got {self.moe_cache_mib}")
        from freetoken.engine.cpu_layers import parse_cpu_layers

        parse_cpu_layers(self.moe_cpu_layers, range(1 << 20))  # the syntax; ids at placement
        if self.moe_cpu_threads is not None and self.moe_cpu_threads < 1:
            raise InvalidInputError(
                f"--moe-cpu-threads must be at least 1, got {self.moe_cpu_threads}"
            )
        if self.poll is not None and not 0 <= self.poll <= 100:
            raise InvalidInputError(f"--poll must be within 0-100, got {self.poll}")
        if self.moe_fetch_share is not None:
            if not 0.0 <= self.moe_fetch_share <= 1.0:
                raise InvalidInputError(
                    f"--moe-fetch-share must be within 0-1, got {self.moe_fetch_share}"
                )
            if self.moe_strategy not in ("auto", "hybrid"):
                raise InvalidInputError(
                    "--moe-fetch-share applies to --moe-strategy hybrid (or auto), not "
                    f"{self.moe_strategy}"
                )
        if self.split_mode is not None and self.split_mode not in SPLIT_MODES:
            raise InvalidInputError(
                f"--split-mode {self.split_mode}: choose one of {', '.join(SPLIT_MODES)}"
            )
        if self.main_gpu < 0:
            raise InvalidInputError(f"--main-gpu must be >= 0, got {self.main_gpu}")
        if self.tensor_split is not None:
            parse_tensor_split(",".join(map(str, self.tensor_split)))  # >= 0, not all zero
        if self.split_plan is not None and (
            self.split_mode is not None or self.tensor_split is not None
        ):
            raise InvalidInputError(
                "a split plan gives the layer ranges itself: no --split-mode or --tensor-split"
            )

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The keys' and the values' torch element types."""
        import torch

        by_name = {"f32": torch.float32, "f16": torch.float16}
        return by_name[self.cache_type_k], by_name[self.cache_type_v]

    @property
    def poll_us(self) -> int | None:
        """How long idle CPU workers poll, in microseconds (None: the pools' default)."""
        return None if self.poll is None else self.poll * POLL_STEP_US

    def pool_poll_us(self, with_gpu: bool) -> int | None:
        """``poll_us``, or without ``--poll`` on the CPU engine :data:`CPU_ENGINE_POLL`'s."""
        if self.poll is None and not with_gpu:
            return CPU_ENGINE_POLL * POLL_STEP_US
        return self.poll_us


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the engine flags to ``p``."""
    g = p.add_argument_group("engine")
    g.add_argument("--device", choices=DEVICES, default="auto", help="auto: the GPU if any")
    g.add_argument(
        "--moe-strategy",
        choices=MOE_STRATEGIES,
        default="auto",
        help="where routed experts run with a GPU (auto: gpu when all fit, else hybrid)",
    )
    g.add_argument(
        "--moe-cpu-threads", type=int, default=None, help="CPU expert threads (default: -t)"
    )
    g.add_argument(
        "--poll",
        type=int,
        default=None,
        metavar="0-100",
        help=f"CPU workers poll for the next job N x {POLL_STEP_US} us before they sleep "
        f"(default: {CPU_ENGINE_POLL} on the CPU engine, as llama.cpp; 5 with a GPU)",
    )
    g.add_argument(
        "--moe-cpu-precise",
        action="store_true",
        help="CPU experts: a second activation pass over the rounding residual (tracks float "
        "math to ~0.01%%, for up to 2x the CPU expert time; default: round as llama.cpp does)",
    )
    g.add_argument(
        "--moe-cpu-layers",
        default=None,
        metavar="SPEC",
        help="MoE layers served by the CPU only: ids/ranges (0,2,5-7), a count, or auto",
    )
    g.add_argument("--moe-cache-mib", type=int, default=None, help="GPU expert cache size")
    g.add_argument("--moe-cache-scope", choices=CACHE_SCOPES, default="type")
    g.add_argument("--moe-cache-profile", default=None, help="expert-use profile (JSON)")
    g.add_argument(
        "--moe-cache-audit",
        default=None,
        metavar="FILE.jsonl",
        help="append one record per generation: where each layer's routes were computed",
    )
    g.add_argument(
        "--moe-fetch-share",
        type=float,
        default=None,
        metavar="F",
        help="hybrid, steps of several tokens: upload this share (0-1) of each layer's missed "
        "experts to the GPU, the CPU computes the rest meanwhile (default: from bench-bw)",
    )
    g.add_argument(
        "--moe-cache-adaptive",
        action="store_true",
        help="evict the least used experts (aged route counts) instead of the least recent",
    )
    g.add_argument(
        "--dense-weights", choices=DENSE_MODES, default="quant", help="GPU dense products"
    )
    g.add_argument(
        "--no-mmap",
        dest="mmap",
        action="store_false",
        help="read the model into memory (huge pages where the kernel allows) instead of "
        "mapping it: faster CPU experts, needs the model's size free in RAM",
    )
    g.add_argument(
        "-nr",
        "--no-repack",
        dest="repack",
        action="store_false",
        help="CPU engine: keep the weights' rows as the file stores them instead of repacking "
        "them for the CPU kernels (AVX2: Q4_0, Q8_0, Q4_K)",
    )
    g.add_argument(
        "--swa-full",
        action="store_true",
        help="keep every position in sliding-window layers' KV cache (CPU) instead of a ring "
        "of the window: more memory, longer reusable prefixes",
    )
    for short, name, what in (
        ("-ctk", "--cache-type-k", "keys"),
        ("-ctv", "--cache-type-v", "values"),
    ):
        g.add_argument(
            short,
            name,
            choices=CACHE_TYPES,
            default="f32",
            help=f"the KV caches' {what} (the model's, an MTP head's, a draft model's): f32 "
            "or f16 (half the memory; the CPU engine)",
        )

    g.add_argument(
        "-sm",
        "--split-mode",
        choices=SPLIT_MODES,
        default=None,
        help="several GPUs: layer (ranges of layers, the default) or none (--main-gpu alone)",
    )
    g.add_argument(
        "-ts",
        "--tensor-split",
        default=None,
        metavar="N0,N1,...",
        help="proportions of the layers per GPU, e.g. 3,1",
    )
    g.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="INDEX", help="the GPU to use")


def from_args(args: argparse.Namespace) -> EngineOptions:
    """The options of parsed :func:`add_arguments` flags."""
    return EngineOptions(
        device=args.device,
        moe_strategy=args.moe_strategy,
        dense_weights=args.dense_weights,
        moe_cache_mib=args.moe_cache_mib,
        moe_cache_scope=args.moe_cache_scope,
        moe_cache_profile=args.moe_cache_profile,
        moe_cache_adaptive=args.moe_cache_adaptive,
        moe_cpu_threads=args.moe_cpu_threads,
        moe_cpu_precise=args.moe_cpu_precise,
        poll=args.poll,
        moe_cpu_layers=args.moe_cpu_layers,
        moe_cache_audit=args.moe_cache_audit,
        moe_fetch_share=args.moe_fetch_share,
        mmap=args.mmap,
        repack=args.repack,
        swa_full=args.swa_full,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        split_mode=args.split_mode,
        tensor_split=None if args.tensor_split is None else parse_tensor_split(args.tensor_split),
        main_gpu=args.main_gpu,
    )


def use_gpu(opts: EngineOptions) -> bool:
    """Whether the model goes to the GPU (``auto``: when torch and libfreetoken_cuda see
    one; otherwise FreeToken runs CPU-only and says why in one line, once)."""
    if opts.device == "cpu":
        return False
    import torch

    from freetoken.runtime import gpu

    ready = gpu.available() and torch.cuda.is_available()
    if opts.device == "cuda" and not ready:
        from freetoken.errors import UnsupportedError

        raise UnsupportedError(f"--device cuda: no usable GPU ({gpu.status().detail})")
    if not ready:
        _note_cpu_only()
    return ready


@functools.cache
def _note_cpu_only() -> None:
    import torch

    from freetoken.runtime import gpu

    line, detail = gpu.cpu_only_notice(gpu.status(), torch.cuda.is_available())
    _log.warning(line)
    _log.info("GPU: %s", detail)
