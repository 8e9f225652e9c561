"""Moving a loaded model onto the GPU (``--moe-strategy gpu|offload|hybrid|cpu``).

Dense weights become :mod:`freetoken.engine.gpu_layers` layers and vectors move as they are,
wherever the model's parts hold them (attributes, lists, tuples, dicts; placement fails if any
stays on the host). Each MoE feed-forward keeps its class and is given an expert backend:
:class:`~freetoken.engine.gpu_moe.GpuExperts` over resident, offloaded or hybrid slot pools,
or :class:`~freetoken.engine.gpu_moe.HostExperts` (the CPU executor) for layers the pools do
not serve. When no layer needs the host during a step, decode steps are replayed as CUDA
graphs (:mod:`freetoken.runtime.cuda_graph`). The same ``Transformer`` code then runs on the
device. MoE layers left without slots (``cpu``, or experts no GPU kernel serves) are computed
by the CPU executor through hybrid's hand-off where one hand-off serves them all, so their
steps are graphs too.

With the layers split over several GPUs (:mod:`freetoken.engine.split`) each range's layers,
their KV cache and recurrent state and their expert pools (within the range's share of the
cache) go to the range's GPU; the embedding goes to the first range's, the output norm and
projection to the plan's output GPU, and a step copies its activations once per boundary
between GPUs. A CUDA graph is captured on one device, so a decode step over several GPUs is
a graph per stage (the layers of one GPU in a row), replayed in order with the copies between
them (:class:`~freetoken.runtime.cuda_graph.StagedGraphDecoder`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from freetoken.engine.bandwidth_profile import KindBandwidth, load_bandwidth_profile
from freetoken.engine.cpu_layers import parse_cpu_layers, pin_budget, split_for_pinning
from freetoken.engine.gpu_layers import (
    GpuEmbedding,
    GpuHeadwise,
    GpuLinear,
    GpuLinearGroup,
)
from freetoken.engine.gpu_moe import (
    ExpertLayer,
    GpuExperts,
    HostExperts,
    OffloadExperts,
    PinnedExperts,
    PoolShare,
    ResidentExperts,
    gpu_servable,
)
from freetoken.engine.hybrid import HybridExperts
from freetoken.engine.options import DENSE_MODES, MOE_STRATEGIES, EngineOptions
from freetoken.engine.split import SplitPlan, plan_split
from freetoken.errors import InvalidInputError, UnsupportedError
from freetoken.models.layers import Embedding, HeadwiseLinear, Linear
from freetoken.models.transformer import Transformer
from freetoken.runtime import gpu
from freetoken.runtime.cuda_graph import MAX_SPAN, GraphDecoder, StagedGraphDecoder
from freetoken.runtime.expert_profile import load_profile, profile_of_layers
from freetoken.runtime.moe import MoeContext, MoeFFN
from freetoken.runtime.slots import CachePlan, plan_pools

if TYPE_CHECKING:
    from freetoken.models.mtp import MtpHead

__all__ = ["Placement", "place", "place_mtp_head", "place_on_gpu"]

log = logging.getLogger("freetoken")

#: Device memory kept free for activations, cuBLAS and ggml-cuda scratch.
WORKSPACE_BYTES = 1 << 30
_MIB = 1 << 20
#: The plan of a hand-off that serves every MoE layer on the CPU.
NO_SLOTS = CachePlan(
    pools=(),
    budget_bytes=0,
    used_bytes=0,
    min_bytes=0,
    all_bytes=0,
    all_resident=False,
    explanation="no expert slots",
)


@dataclass
class Placement:
    """What :func:`place_on_gpu` did, for logs and benchmarks."""

    strategy: str
    dense: str
    device: torch.device
    dense_bytes: int = 0
    expert_bytes: int = 0
    cpu_layers: list[int] = field(default_factory=list)
    #: Layers without slots whose routes the hybrid hand-off sends to the CPU.
    handoff_cpu_layers: list[int] = field(default_factory=list)
    graphs: bool = False
    notes: list[str] = field(default_factory=list)
    #: The expert pools (Resident-, Offload- or HybridExperts), None when all are on the CPU.
    experts: Any = None
    #: The layer ranges and their GPUs (one range: the whole model on :attr:`device`).
    split: SplitPlan | None = None
    #: Per range, the bytes of its dense weights and of its expert slots.
    range_bytes: list[tuple[int, int]] = field(default_factory=list)

    def describe(self) -> str:
        """The placement log: strategy, bytes, graphs, then with several ranges each range's
        layers, GPU and bytes, then the CPU layers and the notes."""
        lines = [
            f"placement: strategy {self.strategy}, dense weights {self.dense}, "
            f"{self.dense_bytes / _MIB:.0f} MiB dense + {self.expert_bytes / _MIB:.0f} MiB "
            f"experts on {self.device}, decode graphs {'on' if self.graphs else 'off'}"
        ]
        plan = self.split
        if plan is not None and len(plan.ranges) > 1:
            for d, r, (dense, slots) in zip(
                plan.devices, plan.ranges, self.range_bytes, strict=True
            ):
                lines.append(
                    f"  GPU {d}: layers {r.start}-{r.stop - 1}, {dense / _MIB:.0f} MiB dense + "
                    f"{slots / _MIB:.0f} MiB expert cache"
                )
            lines.append(f"  GPU {plan.output_device}: output norm and projection")
        if self.cpu_layers:
            lines.append(f"  MoE layers on the CPU executor: {self.cpu_layers}")
        if self.handoff_cpu_layers:
            lines.append(f"  MoE layers on the CPU through the hand-off: {self.handoff_cpu_layers}")
        lines += [f"  {n}" for n in self.notes]
        return "\n".join(lines)


def _is_model_part(obj: object) -> bool:
    return type(obj).__module__.startswith("freetoken.models") and hasattr(obj, "__dict__")


class _Mover:
    """Moves what the model's parts hold to the device, through lists, tuples and dicts:
    tensors as they are, dense layers as GPU layers. MoE feed-forwards are not entered but
    collected in ``moe`` (their router, shared experts and backend are placed once the expert
    pools are known)."""

    def __init__(self, device: torch.device, dense: str) -> None:
        self.device, self.dense = device, dense
        self.dense_bytes = 0
        self.moe: list[MoeFFN] = []

    def __call__(self, val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            self.dense_bytes += val.numel() * val.element_size()
            return val.to(self.device)
        if isinstance(val, Linear):
            lin = GpuLinear(val, self.device, self.dense)
            self.dense_bytes += lin.nbytes
            return lin
        if isinstance(val, HeadwiseLinear):
            return GpuHeadwise(val, self.device)
        if isinstance(val, MoeFFN):
            self.moe.append(val)
            return val
        if isinstance(val, list):
            return [self(v) for v in val]
        if isinstance(val, tuple):
            return type(val)(*map(self, val)) if hasattr(val, "_fields") else tuple(map(self, val))
        if isinstance(val, dict):
            return {k: self(v) for k, v in val.items()}
        if _is_model_part(val):
            for name, v in vars(val).items():
                moved = self(v)
                if moved is not v:
                    setattr(val, name, moved)
            _fuse(val)
        return val


def _left_on_host(val: Any, where: str, seen: set[int]) -> list[str]:
    """Where the model still holds host tensors or CPU layers after placement."""
    if id(val) in seen or getattr(val, "host_resident", False):
        # Parts read on the host by design (Gemma 4's per-layer token rows) stay there.
        return []
    seen.add(id(val))
    if isinstance(val, torch.Tensor):
        return [where] if val.device.type == "cpu" else []
    if isinstance(val, (Linear, HeadwiseLinear, Embedding)):
        return [where]
    if isinstance(val, (list, tuple)):
        return [w for i, v in enumerate(val) for w in _left_on_host(v, f"{where}[{i}]", seen)]
    if isinstance(val, dict):
        return [w for k, v in val.items() for w in _left_on_host(v, f"{where}[{k!r}]", seen)]
    if isinstance(val, MoeFFN):
        parts: dict[str, Any] = {"router": val.router, "shared": val.shared}
        parts |= {n: v for n, v in vars(val).items() if isinstance(v, torch.Tensor)}
    elif _is_model_part(val):
        parts = vars(val)
    else:
        return []
    return [w for n, v in parts.items() for w in _left_on_host(v, f"{where}.{n}", seen)]


def _fuse(obj: object) -> None:
    """Stacks the weights of layers that share an input (Q/K/V, gate/up, a Gated DeltaNet
    layer's input projections) into one product each."""
    groups = [
        [getattr(obj, n, None) for n in names] for names in (("wq", "wk", "wv"), ("gate", "up"))
    ]
    groups.append(list(getattr(obj, "in_proj", ())))
    for members in groups:
        if all(m is not None for m in members):
            GpuLinearGroup.fuse(members)


def _expert_layers(model: Transformer) -> list[ExpertLayer]:
    return [ExpertLayer.of(blk.ffn) for blk in model.blocks if isinstance(blk.ffn, MoeFFN)]


def _split_plan(
    model: Transformer,
    layers: list[ExpertLayer],
    n_gpus: int,
    mode: str | None,
    tensor_split: tuple[float, ...] | None,
    main_gpu: int,
    cache_mib: int | None,
) -> SplitPlan:
    """The GPUs' layer ranges: ``--split-mode layer`` unless told otherwise (llama.cpp's
    default), which on a host of one GPU is one range on it."""
    sizes = {ex.index: ex.spec().expert_bytes * ex.n_experts for ex in layers}
    n_layers = len(model.blocks)
    free = [torch.cuda.mem_get_info(d)[0] for d in range(n_gpus)]
    plan = plan_split(
        n_layers,
        n_gpus,
        mode=mode or "layer",
        tensor_split=tensor_split,
        main_gpu=main_gpu,
        free_bytes=free,
        cache_mib=cache_mib,
        expert_bytes=[sizes.get(i, 0) for i in range(n_layers)],
    )
    return plan


def place(model: Transformer, opts: EngineOptions, n_ctx: int) -> Placement:
    """Places ``model`` on the GPU per the engine options ``opts`` (the caller has checked
    :func:`~freetoken.engine.options.use_gpu`); returns the placement."""
    return place_on_gpu(
        model,
        strategy=opts.moe_strategy,
        dense=opts.dense_weights,
        n_ctx=n_ctx,
        cache_mib=opts.moe_cache_mib,
        cache_scope=opts.moe_cache_scope,
        cache_profile=opts.moe_cache_profile,
        cache_policy="adaptive" if opts.moe_cache_adaptive else "lru",
        cpu_layers=opts.moe_cpu_layers,
        fetch_share=opts.moe_fetch_share,
        split_mode=opts.split_mode,
        tensor_split=opts.tensor_split,
        main_gpu=opts.main_gpu,
        split_plan=opts.split_plan,
    )


def place_on_gpu(
    model: Transformer,
    *,
    strategy: str = "auto",
    dense: str = "quant",
    n_ctx: int = 4096,
    cache_mib: int | None = None,
    cache_scope: str = "type",
    cache_profile: Any = None,
    cache_policy: str = "lru",
    cpu_layers: str | None = None,
    device: torch.device | str | None = None,
    split_mode: str | None = None,
    tensor_split: tuple[float, ...] | None = None,
    main_gpu: int = 0,
    split_plan: SplitPlan | None = None,
    fetch_share: float | None = None,
) -> Placement:
    """Moves ``model`` to the GPU with its experts per ``strategy`` (see the module docs of
    :mod:`freetoken.engine.gpu_moe`); ``auto`` keeps every expert resident when they fit in
    ``cache_mib`` (default: the free memory left after the dense weights, the KV cache for
    ``n_ctx`` positions and a workspace), else runs hybrid (offload when the layers differ
    in shape, which one hand-off cannot serve). ``cpu_layers`` is ``--moe-cpu-layers``
    (:mod:`freetoken.engine.cpu_layers`); ``split_mode``, ``tensor_split`` and ``main_gpu``
    plan the layers' GPUs (:mod:`freetoken.engine.split`) unless ``device`` names one GPU
    for all or ``split_plan`` gives the ranges as they are (their cache shares in place of
    ``cache_mib``; :meth:`SplitPlan.check` errors); ``fetch_share`` is ``--moe-fetch-share``
    (:class:`~freetoken.engine.hybrid.HybridExperts`). Logs what it did (the placement, the
    pools) on the ``freetoken`` logger at INFO level and returns it."""
    if strategy not in MOE_STRATEGIES:
        raise InvalidInputError(f"--moe-strategy {strategy}: choose one of {MOE_STRATEGIES}")
    if dense not in DENSE_MODES:
        raise InvalidInputError(f"dense weights `{dense}`: choose one of {DENSE_MODES}")
    status = gpu.status()
    if not (status.available and torch.cuda.is_available()):
        raise UnsupportedError(f"no GPU for --moe-strategy {strategy}: {status.detail}")
    layers = _expert_layers(model)
    n_layers = len(model.blocks)
    if device is not None:
        one = torch.device(device)
        index = torch.cuda.current_device() if one.index is None else one.index
        plan = SplitPlan((index,), (range(n_layers),), (cache_mib,), index)
    elif split_plan is not None:
        split_plan.check(n_layers, status.n_devices)
        plan = split_plan
        log.info("split: %s", plan.describe())
    else:
        plan = _split_plan(
            model, layers, status.n_devices, split_mode, tensor_split, main_gpu, cache_mib
        )
        log.info("split: %s", plan.describe())
    devs = [torch.device("cuda", d) for d in plan.devices]
    dev, out_dev = devs[0], torch.device("cuda", plan.output_device)
    wanted = parse_cpu_layers(cpu_layers, [ex.index for ex in layers])
    servable = [
        ex
        for ex in layers
        if strategy != "cpu" and gpu_servable(ex) and (wanted is None or ex.index not in wanted)
    ]
    place = Placement(strategy, dense, dev, split=plan)

    # Dense parts first (MoE feed-forwards are left for below): what they take decides what
    # is left for the experts. Each range's parts go to its GPU through a mover of its own.
    movers = [_Mover(d, dense) for d in devs]
    out_mover = movers[-1] if devs[-1] == out_dev else _Mover(out_dev, dense)
    mover_of = [m for m, r in zip(movers, plan.ranges, strict=True) for _ in r]
    model.blocks = [mover_of[i](blk) for i, blk in enumerate(model.blocks)]
    # The model's own tensors (norm, RoPE factors and masks) as they are: the output norm
    # beside the output projection, the rest beside the embedding.
    for name, val in list(vars(model).items()):
        if isinstance(val, torch.Tensor):
            setattr(model, name, (out_mover if name == "output_norm" else movers[0])(val))
    model.output = out_mover(model.output)
    # A family's own parts beyond the Transformer's (Gemma 4's per-layer inputs), and its
    # lists of one entry per layer, each beside its layer.
    for name in getattr(model, "gpu_parts", ()):
        setattr(model, name, movers[0](getattr(model, name)))
    for name in getattr(model, "gpu_layer_parts", ()):
        parts = getattr(model, name)
        setattr(model, name, [mover_of[i](p) for i, p in enumerate(parts)])
    emb = GpuEmbedding(model.embed, dev)
    model.embed = emb  # type: ignore[assignment]
    movers[0].dense_bytes += emb.table.numel() * emb.table.element_size()
    all_movers = movers if out_mover in movers else [*movers, out_mover]
    place.dense_bytes = sum(m.dense_bytes for m in all_movers)

    ranges = _ranges(plan, layers, servable)
    experts: ResidentExperts | OffloadExperts | HybridExperts | None = None
    if servable:
        opts = _CacheOptions(
            n_ctx,
            cache_scope,
            cache_profile,
            cache_policy,
            cpu_auto=wanted is None,
            fetch_share=fetch_share,
        )
        experts, place.strategy = _experts(ranges, layers, strategy, opts, model, place)
    if experts is None and layers and model.moe is not None and _one_shape(layers):
        # Nothing for the slots (`cpu`, or no GPU kernel serves the experts): every route
        # goes through the hand-off to the CPU, so decode steps stay graphs.
        shares = [PoolShare([], NO_SLOTS, r.device, r.moe) for r in ranges if r.moe]
        experts = HybridExperts(shares, model.moe.executor)
    if experts is not None:
        place.expert_bytes = experts.nbytes
        place.experts = experts
        on_gpu = {ex.index: ex for ex in layers if ex.index in experts.layers}
        if isinstance(experts, HybridExperts):
            on_gpu = dict(experts.all_layers)
            place.handoff_cpu_layers = sorted(experts.cpu_only)
    else:
        on_gpu = {}
    place.cpu_layers = [ex.index for ex in layers if ex.index not in on_gpu]
    place.range_bytes = [
        (m.dense_bytes, experts.nbytes_of(r) if experts is not None else 0)
        for m, r in zip(movers, plan.ranges, strict=True)
    ]
    for m in all_movers:
        for ffn in m.moe:
            _place_moe(ffn, m, on_gpu.get(ffn.layer.index), experts, model.moe)
    left = _left_on_host(model, "model", set())
    if left:
        raise UnsupportedError(f"placement left model parts on the host: {', '.join(left)}")
    model.device, model.output_device = dev, out_dev
    if len(plan.ranges) > 1:
        model.layer_devices = tuple(torch.device("cuda", d) for d in plan.layer_devices())
    model.step_hook = experts if isinstance(experts, HybridExperts) else None
    # Graphs need steps that never wait for Python: no CPU-only experts, no on-demand uploads
    # (hybrid's CPU half answers inside the graph), no inputs read on the host; over several
    # GPUs, a pass that stages can capture (a CUDA graph is captured on one device).
    staged = plan.several_devices
    place.graphs = (
        not place.cpu_layers
        and not getattr(model, "host_inputs", False)
        and (not layers or isinstance(experts, (ResidentExperts, HybridExperts)))
        and (not staged or model.staged_graphs)
    )
    if staged and not model.staged_graphs:
        place.notes.append(f"decode graphs off: {model.cfg.arch}'s pass over several GPUs")
    if place.graphs:
        model.graphs = StagedGraphDecoder(model) if staged else GraphDecoder(model)
    else:
        model.graphs = None
    log.info("%s", place.describe())
    return place


def place_mtp_head(head: MtpHead, place: Placement) -> None:
    """Moves a multi-token-prediction head onto its trunk's output GPU (``place``): the dense
    parts as the trunk's, the layer's experts resident in pools of their own when they fit in
    the free memory beside the workspace (as llama.cpp's ``--n-cpu-moe`` keeps the layers past
    the trunk on the GPU), else on the CPU executor; under ``--moe-strategy cpu`` the
    experts stay on the CPU as the trunk's. Without the CPU executor the head's steps are
    CUDA graphs. The head's experts count in no audit."""
    model = head.model
    dev = model.output_device
    mover = _Mover(dev, place.dense)
    for name in ("eh_proj", "enorm", "hnorm", "head_norm", "block"):
        setattr(head, name, mover(getattr(head, name)))
    if head.head is not model.output:
        head.head = mover(head.head)
        head.head_device = dev
    # The trunk's embedding serves the head where it is on the head's GPU.
    shared = head.embed.name == model.embed.name and model.device == dev
    head.embed = model.embed if shared else GpuEmbedding(head.embed, dev)  # type: ignore[assignment]
    for ffn in mover.moe:
        ex = ExpertLayer.of(ffn)
        experts = None
        if place.strategy != "cpu" and gpu_servable(ex):
            free = torch.cuda.mem_get_info(dev)[0] - WORKSPACE_BYTES
            plan = plan_pools([ex.spec()], 1 << 62)  # every expert resident
            if plan.all_bytes <= free:
                experts = ResidentExperts([PoolShare([ex], plan, dev)])
        _place_moe(ffn, mover, ex if experts is not None else None, experts, None)
        where = "resident on the GPU" if experts is not None else "on the CPU executor"
        log.info("MTP head: layer %d's experts %s", ex.index, where)
    head.device = dev
    # Its steps are graphs unless they wait for the CPU executor.
    if all(isinstance(ffn.backend, GpuExperts) for ffn in mover.moe):
        head.paired = torch.zeros(MAX_SPAN, model.cfg.hidden, device=dev)
        head.graphs = GraphDecoder(head)


def _place_moe(
    ffn: MoeFFN,
    mover: _Mover,
    ex: ExpertLayer | None,
    experts: ResidentExperts | OffloadExperts | HybridExperts | None,
    moe: MoeContext | None,
) -> None:
    """Moves a MoE feed-forward's router, shared experts and tensors (selection bias, a
    family's norms and scales) to the device and gives it its expert backend: the pools when
    they serve the layer, else the CPU executor."""
    if ffn.shared is not None:
        ffn.shared = mover(ffn.shared)
    for name, val in vars(ffn).items():
        if isinstance(val, torch.Tensor):
            setattr(ffn, name, mover(val))
    ffn.router = GpuLinear(ffn.router, mover.device, mover.dense, keep_f32=True)  # type: ignore[arg-type]
    if experts is not None and ex is not None:
        backend = GpuExperts(ex, ffn.routing, experts, ffn.selection_bias)
        ffn.backend = backend
        if moe is not None:
            moe.collectors.append(functools.partial(backend.flush_counts, moe.counters))
    else:
        ffn.backend = HostExperts(ffn.backend.executor)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _CacheOptions:
    n_ctx: int
    scope: str
    profile: Any
    policy: str
    #: ``--moe-cpu-layers auto``: pin layers in order while the host allows.
    cpu_auto: bool
    fetch_share: float | None


@dataclass(frozen=True)
class _Range:
    """One range of the split as the expert placement sees it: its GPU, layers, share of
    the cache in MiB (None: what fits), MoE layers, and of those the ones the slots serve."""

    device: torch.device
    layers: range
    cache_mib: int | None
    moe: list[ExpertLayer]
    servable: list[ExpertLayer]

    @property
    def tag(self) -> str:
        """What the notes of one range of several start with."""
        return f"GPU {self.device.index}, layers {self.layers.start}-{self.layers.stop - 1}: "


def _ranges(
    plan: SplitPlan, layers: list[ExpertLayer], servable: list[ExpertLayer]
) -> list[_Range]:
    """The plan's ranges with their MoE layers and GPU-servable ones."""
    return [
        _Range(
            torch.device("cuda", d),
            r,
            mib,
            [ex for ex in layers if ex.index in r],
            [ex for ex in servable if ex.index in r],
        )
        for d, r, mib in zip(plan.devices, plan.ranges, plan.cache_mib, strict=True)
    ]


def _expert_total(layers: list[ExpertLayer]) -> int:
    return sum(ex.expert_nbytes * ex.n_experts for ex in layers)


def _budgets(
    ranges: list[_Range], o: _CacheOptions, model: Transformer, place: Placement
) -> list[int]:
    """Each range's expert budget in bytes: its ``--moe-cache-mib`` share, else what its GPU
    has free beside the KV cache of the GPU's layers (their share of the model's) and a
    workspace, divided between the ranges on that GPU by their expert bytes. Free memory is
    read once per GPU, before any pool takes it."""
    n_layers = len(model.blocks)
    kv_all = model.kv_bytes(o.n_ctx)
    free = {r.device: torch.cuda.mem_get_info(r.device)[0] for r in ranges if r.cache_mib is None}
    several = len(ranges) > 1
    out = []
    for r in ranges:
        tag = r.tag if several else ""
        total = _expert_total(r.servable)
        if r.cache_mib is not None:
            place.notes.append(
                f"{tag}expert cache: --moe-cache-mib {r.cache_mib} (experts: "
                f"{total / _MIB:.0f} MiB)"
            )
            out.append(r.cache_mib * _MIB)
            continue
        peers = [q for q in ranges if q.device == r.device and q.cache_mib is None]
        kv = kv_all * sum(len(q.layers) for q in peers) // n_layers
        room = max(0, free[r.device] - kv - WORKSPACE_BYTES)
        budget = room * total // sum(_expert_total(q.servable) for q in peers)
        shared = f", {budget / _MIB:.0f} MiB of it for these layers" if len(peers) > 1 else ""
        place.notes.append(
            f"{tag}expert cache: {free[r.device] / _MIB:.0f} MiB free - {kv / _MIB:.0f} MiB "
            f"KV cache ({o.n_ctx} positions) - {WORKSPACE_BYTES / _MIB:.0f} MiB workspace = "
            f"{room / _MIB:.0f} MiB{shared} (experts: {total / _MIB:.0f} MiB)"
        )
        out.append(budget)
    return out


def _pin_auto(
    layers: list[ExpertLayer], place: Placement
) -> tuple[PinnedExperts, list[ExpertLayer]]:
    """``--moe-cpu-layers auto``: pins the layers in order while the host allows; returns
    the pins and the layers pinned."""
    pins = PinnedExperts()
    budget, source = pin_budget()
    by_index = {ex.index: ex for ex in layers}
    kept, dropped = split_for_pinning(
        [(ex.index, ex.expert_nbytes * ex.n_experts) for ex in layers],
        budget,
        lambda li: pins.pin(by_index[li]),
    )
    limit = "no limit" if budget is None else f"{budget / _MIB:.0f} MiB ({source})"
    place.notes.append(
        f"--moe-cpu-layers auto: pinned {len(kept)} of {len(layers)} MoE layers within "
        f"{limit}; CPU only: {dropped or 'none'}"
    )
    return pins, [by_index[li] for li in kept]


def _experts(
    ranges: list[_Range],
    all_layers: list[ExpertLayer],
    strategy: str,
    o: _CacheOptions,
    model: Transformer,
    place: Placement,
) -> tuple[ResidentExperts | OffloadExperts | HybridExperts | None, str]:
    """The expert pools of the ranges' GPU-servable layers per ``strategy``, each range's on
    its GPU within its budget (:func:`_budgets`), and the strategy (``auto`` resolved, one
    for all ranges); None when ``--moe-cpu-layers auto`` could pin none of them, or when
    ``auto`` finds no room for even top-k slots a pool on some range (then ``cpu``: the
    caller serves every layer through the hand-off)."""
    pooled = [r for r in ranges if r.servable]
    several = len(ranges) > 1
    budgets = _budgets(pooled, o, model, place)
    arch, n_layers = model.cfg.arch, model.cfg.n_layers
    if o.profile is not None and len(pooled) > 1:
        # Checked against every pooled layer once; each range plans from its layers' counts.
        load_profile(
            o.profile,
            [ex.spec() for r in pooled for ex in r.servable],
            architecture=arch,
            n_layers=n_layers,
        )

    def plan_for(ls: list[ExpertLayer], within: int) -> CachePlan:
        if not ls:
            return NO_SLOTS
        profile = o.profile
        if profile is not None and len(pooled) > 1:
            profile = profile_of_layers(profile, {ex.index for ex in ls})
        return plan_pools(
            [ex.spec() for ex in ls],
            within,
            scope=o.scope,
            profile=profile,
            architecture=arch,
            n_layers=n_layers,
        )

    if strategy == "auto" and _one_shape(all_layers):
        for r, budget in zip(pooled, budgets, strict=True):
            need = plan_for(r.servable, 1 << 62).min_bytes
            if budget < need:
                place.notes.append(
                    f"--moe-strategy auto: cpu ({r.tag if several else ''}the expert cache's "
                    f"{budget / _MIB:.0f} MiB hold no slots: at least {need / _MIB:.0f} MiB "
                    "needed)"
                )
                return None, "cpu"
    plans = [plan_for(r.servable, b) for r, b in zip(pooled, budgets, strict=True)]
    all_resident = all(p.all_resident for p in plans)
    layers = [ex for r in pooled for ex in r.servable]
    bw = None
    if strategy in ("auto", "hybrid") and not all_resident:
        profile = load_bandwidth_profile(model)
        bw = profile.for_layers(layers) if profile is not None else None
    if strategy == "auto":
        one = _one_shape(all_layers)
        strategy = "gpu" if all_resident else "hybrid" if one else "offload"
        place.notes.append(f"--moe-strategy auto: {strategy} ({_why(strategy, bw)})")
    if strategy == "gpu":
        for r, plan, budget in zip(pooled, plans, budgets, strict=True):
            if not plan.all_resident:
                raise InvalidInputError(
                    f"--moe-strategy gpu needs {plan.all_bytes / _MIB:.0f} MiB for the experts"
                    f"{' of ' + r.tag.rstrip(': ') if several else ''}, "
                    f"{budget / _MIB:.0f} MiB available (use offload)"
                )
        shares = [PoolShare(r.servable, p, r.device) for r, p in zip(pooled, plans, strict=True)]
        return ResidentExperts(shares), strategy
    pins = None
    if o.cpu_auto:
        pins, pinned = _pin_auto(layers, place)
        if not pinned:
            return None, strategy
        if len(pinned) < len(layers):
            kept = {ex.index for ex in pinned}
            pooled = [
                replace(r, servable=[ex for ex in r.servable if ex.index in kept]) for r in pooled
            ]
            plans = [plan_for(r.servable, b) for r, b in zip(pooled, budgets, strict=True)]
            layers = pinned
    for r, plan in zip(pooled, plans, strict=True):
        if r.servable:
            place.notes.append((r.tag if several else "") + plan.explanation)
    plan_of = {r.layers: plan for r, plan in zip(pooled, plans, strict=True)}
    if strategy == "hybrid":
        if model.moe is None:
            raise InvalidInputError("--moe-strategy hybrid: the model has no CPU expert executor")
        # Layers without slots still go through the hand-off when it can serve them.
        slotted = {ex.index for ex in layers}
        one = _one_shape(all_layers)
        shares = [
            PoolShare(
                [ex for ex in r.servable if ex.index in slotted],
                plan_of.get(r.layers, NO_SLOTS),
                r.device,
                [ex for ex in r.moe if ex.index not in slotted] if one else [],
            )
            for r in ranges
        ]
        experts: OffloadExperts = HybridExperts(
            [sh for sh in shares if sh.layers or sh.cpu_only],
            model.moe.executor,
            o.policy,
            bw,
            pins,
            o.fetch_share,
        )
    else:
        shares = [PoolShare(r.servable, plan_of[r.layers], r.device) for r in pooled if r.servable]
        experts = OffloadExperts(shares, o.policy, pinned=pins)
    if not experts.pinned:
        place.notes.append("expert memory could not be pinned: uploads are synchronous")
    return experts, strategy


def _one_shape(layers: list[ExpertLayer]) -> bool:
    """Whether one hand-off serves every layer (hybrid): one width, expert count, top-k."""
    return len({(ex.gate.k, ex.n_experts, ex.top_k) for ex in layers}) == 1


def _why(strategy: str, bw: dict[int, KindBandwidth] | None) -> str:
    """Why ``auto`` chose ``strategy``; ``bw`` is each layer's bench-bw figures, if saved."""
    if strategy == "gpu":
        return "every expert fits the cache"
    if strategy == "offload":
        return "the MoE layers differ in shape"
    if bw is None:
        return "experts exceed the cache; misses computed on the CPU (no bench-bw profile)"
    kinds = {k.key: k for k in bw.values()}.values()
    return "experts exceed the cache; " + "; ".join(
        f"{k.key}: a miss read once costs less on the CPU ({k.b_cpu_gbps:.0f} GB/s) than "
        f"over PCIe ({k.b_pcie_gbps or 0:.0f} GB/s) unless reused "
        f"{k.break_even_reuse or float('inf'):.1f}x"
        for k in kinds
    )
