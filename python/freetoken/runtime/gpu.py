"""The GPU expert path: ggml-cuda's MMVQ/MMQ kernels on torch-owned memory.

Thin wrappers over ``_core.cuda_*`` (``crates/ft-cuda``, which loads ``libfreetoken_cuda.so``
from ``FREETOKEN_CUDA_LIB`` or next to the extension). Tensors are torch CUDA tensors; work is
queued on torch's current stream of their device, and nothing synchronizes unless
``check_ids`` asks for the device-side id check. Shapes are numpy order: a pool of ``n_slots``
matrices ``(n, k)``, activations ``(T, k)``, slot ids ``(T, n_used)``.

Without the library or a GPU, :func:`available` is False (the engine says so in one line and
runs CPU-only); the other calls raise UnsupportedError.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from freetoken import _core
from freetoken.errors import InvalidInputError, ShapeError
from freetoken.quant import QType, qtype_id, type_info

__all__ = [
    "ATTN_MAX_KEYS",
    "GDN_MAX_DIM",
    "GDN_MAX_SEQS",
    "DeviceInfo",
    "ExpertPool",
    "GpuStatus",
    "attn_decode",
    "attn_decode_fits",
    "available",
    "constant",
    "cpu_only_notice",
    "device_info",
    "expert_matmul",
    "fetch_gather",
    "fetch_plan",
    "gdn_decode",
    "gdn_decode_fits",
    "handoff_routes",
    "handoff_wait_add",
    "host_tensor",
    "kernel_for",
    "moe_layer",
    "norm_rope",
    "pool_nbytes",
    "status",
    "to_host",
    "topk_softmax",
]


@dataclass(frozen=True)
class GpuStatus:
    """Whether the GPU path is usable; ``detail`` is the library's path or why not."""

    available: bool
    detail: str
    n_devices: int
    library_present: bool
    """Whether a library file is where the loader looks (loadable or not)."""


@dataclass(frozen=True)
class DeviceInfo:
    """A CUDA device as libfreetoken_cuda sees it."""

    name: str
    cc: int
    """Compute capability, major * 100 + minor * 10 (900 on Hopper)."""
    n_sm: int
    total_mem: int
    free_mem: int


def status() -> GpuStatus:
    """Loads the GPU library on first call and reports what it found."""
    s = _core.cuda_status()
    return GpuStatus(s.available, s.detail, s.n_devices, s.library_present)


def cpu_only_notice(st: GpuStatus, torch_cuda: bool) -> tuple[str, str]:
    """Why FreeToken runs on the CPU: one short line for everyone, and the detail for ``-v``."""
    if not st.library_present:
        return (
            "no GPU library in this install, running on the CPU (`freetoken info` says more)",
            st.detail,
        )
    if st.available and not torch_cuda:
        return "torch sees no CUDA device, running on the CPU", f"library {st.detail}"
    return f"the GPU library cannot be used, running on the CPU: {st.detail}", st.detail


def available() -> bool:
    """True when libfreetoken_cuda is loaded and sees a CUDA device."""
    return status().available


def device_info(device: int = 0) -> DeviceInfo:
    """Name, compute capability and memory of ``device``."""
    d = _core.cuda_device_info(device)
    return DeviceInfo(d.name, d.cc, d.n_sm, d.total_mem, d.free_mem)


def kernel_for(qtype: QType, n_tokens: int, device: int = 0) -> str | None:
    """``"mmvq"``, ``"mmq"``, or None when no GPU kernel serves ``qtype`` at ``n_tokens``."""
    return _core.cuda_kernel_for(device, qtype_id(qtype), n_tokens)


def pool_nbytes(qtype: QType, k: int, n: int, n_slots: int) -> int:
    """Bytes of a pool of ``n_slots`` matrices ``(n, k)``, including the zeroed tail that
    ggml-cuda may read past the last row; ShapeError at 2^31 blocks or more."""
    return _core.cuda_pool_nbytes(qtype_id(qtype), k, n, n_slots)


class ExpertPool:
    """``n_slots`` quantized matrices ``(n, k)`` of one type, back to back in one uint8 CUDA
    tensor, followed by a zeroed tail. Slots are filled with :meth:`set_slot`."""

    def __init__(
        self,
        qtype: QType,
        k: int,
        n: int,
        n_slots: int,
        device: Any = "cuda",
        memory: torch.Tensor | None = None,
    ) -> None:
        self.info = type_info(qtype)
        self.k, self.n, self.n_slots = k, n, n_slots
        self.matrix_nbytes = self.info.row_size(k) * n
        nbytes = pool_nbytes(self.info.id, k, n, n_slots)
        if memory is None:
            memory = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        elif memory.dtype != torch.uint8 or memory.dim() != 1 or memory.numel() < nbytes:
            raise ShapeError(f"pool memory must be at least {nbytes} uint8 bytes")
        else:
            # The zeroed tail after the last slot (ggml-cuda reads up to it).
            memory[self.matrix_nbytes * n_slots : nbytes].zero_()
        #: The pool's bytes: its own, or a prefix of ``memory`` (a staging buffer reused for
        #: layers of different types).
        self.tensor = memory[:nbytes]

    @property
    def qtype(self) -> int:
        """The type id."""
        return self.info.id

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def slot_view(self, slot: int) -> torch.Tensor:
        """The bytes of one slot (a view into the pool)."""
        if not 0 <= slot < self.n_slots:
            raise InvalidInputError(f"slot {slot} outside [0, {self.n_slots})")
        start = slot * self.matrix_nbytes
        return self.tensor[start : start + self.matrix_nbytes]

    def window(self, first_slot: int, n_slots: int) -> ExpertPool:
        """Slots ``first_slot..first_slot + n_slots - 1`` as a pool of their own, sharing this
        one's memory (one layer's experts in a pool of several layers: kernels launch over
        its slots only). What ggml-cuda may read past its last row is the next slots' blocks
        or this pool's zeroed tail."""
        if first_slot < 0 or n_slots < 1 or first_slot + n_slots > self.n_slots:
            raise InvalidInputError(
                f"slots {first_slot}..{first_slot + n_slots - 1} outside [0, {self.n_slots})"
            )
        view = ExpertPool.__new__(ExpertPool)
        view.info, view.k, view.n = self.info, self.k, self.n
        view.n_slots, view.matrix_nbytes = n_slots, self.matrix_nbytes
        start = first_slot * self.matrix_nbytes
        view.tensor = self.tensor[
            start : start + pool_nbytes(self.info.id, self.k, self.n, n_slots)
        ]
        return view

    def load(self, first_slot: int, raw: torch.Tensor, non_blocking: bool = False) -> None:
        """Copies whole matrices (a uint8 tensor of a multiple of ``matrix_nbytes``, or one
        matrix a row ``[count, matrix_nbytes]`` with any strides; host or device) into
        consecutive slots from ``first_slot``."""
        rows = raw.dim() == 2 and raw.shape[1] == self.matrix_nbytes
        if (
            raw.dtype != torch.uint8
            or raw.numel() % self.matrix_nbytes
            or not (rows or raw.dim() == 1)
        ):
            raise ShapeError(f"pool data must be whole {self.matrix_nbytes}-byte matrices")
        count = raw.numel() // self.matrix_nbytes
        if first_slot < 0 or first_slot + count > self.n_slots:
            raise InvalidInputError(
                f"{count} matrices from slot {first_slot} overrun {self.n_slots} slots"
            )
        start = first_slot * self.matrix_nbytes
        dst = self.tensor[start : start + raw.numel()].view(raw.shape)
        dst.copy_(raw, non_blocking=non_blocking)

    def set_slot(self, slot: int, raw: Any) -> None:
        """Copies one matrix (bytes, a uint8 numpy array or tensor of ``matrix_nbytes``) in."""
        if isinstance(raw, (bytes, bytearray, memoryview)):
            # A writable copy: torch warns on (and must not alias) read-only buffers.
            src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        elif isinstance(raw, np.ndarray):
            src = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).copy())
        else:
            src = torch.as_tensor(raw)
        src = src.reshape(-1)
        if src.dtype != torch.uint8 or src.numel() != self.matrix_nbytes:
            raise ShapeError(
                f"slot data must be {self.matrix_nbytes} uint8 bytes, got {src.numel()} {src.dtype}"
            )
        self.slot_view(slot).copy_(src, non_blocking=False)


#: Elements of each tensor :func:`constant` keeps: a 512-token prompt chunk times top-k 32.
_CONSTANT_LEN = 512 * 32
_constants: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def constant(n: int, value: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` elements equal to ``value``: a view of one tensor per (device, dtype, value), made
    once and never freed, so a CUDA graph that captured such a view never reads freed memory
    when a larger batch comes (a per-object buffer grown on demand would be). Beyond its
    length a new tensor is returned: graphs capture one-token steps only."""
    key = (device, dtype, value)
    buf = _constants.get(key)
    if buf is None:
        buf = _constants[key] = torch.full((_CONSTANT_LEN,), value, dtype=dtype, device=device)
    if n <= buf.numel():
        return buf[:n]
    return torch.full((n,), value, dtype=dtype, device=device)


def host_tensor(addr: int, nbytes: int, owner: Any) -> torch.Tensor:
    """A CPU uint8 tensor over ``nbytes`` at ``addr`` (mapped GGUF bytes: never written), which
    keeps ``owner`` alive."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    buf.owner = owner  # type: ignore[attr-defined]
    return torch.frombuffer(buf, dtype=torch.uint8)


def to_host(t: torch.Tensor, wait: bool = True) -> torch.Tensor:
    """A host copy of GPU tensor ``t`` through page-locked memory (``t`` itself on the CPU):
    a pageable copy stages through a driver buffer at a fraction of the link's rate (2.85 ms
    for 16 rows of a 248k-token vocabulary on an H100; torch's host allocator keeps the
    pinned blocks). With ``wait`` the host waits for the copy; without, it is ordered on
    ``t``'s stream before any later work there (a later copy back reads it complete)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    if wait:
        torch.cuda.current_stream(t.device).synchronize()
    return out


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _check(
    t: torch.Tensor, what: str, dtype: torch.dtype, shape: tuple[int, ...], dev: torch.device
) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(f"{what} must be a torch tensor, not {type(t).__name__}")
    if t.dtype != dtype:
        raise InvalidInputError(f"{what} must be {dtype}, got {t.dtype}")
    if t.device != dev:
        raise InvalidInputError(f"{what} must be on {dev}, got {t.device}")
    if not t.is_contiguous():
        raise InvalidInputError(f"{what} must be contiguous")
    if tuple(t.shape) != shape:
        raise ShapeError(f"{what} must have shape {shape}, got {tuple(t.shape)}")


def _stream(dev: torch.device) -> int:
    return torch.cuda.current_stream(dev).cuda_stream


def expert_matmul(
    pool: ExpertPool,
    x: torch.Tensor,
    ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_ids: bool = True,
) -> torch.Tensor:
    """``out[t, j] = pool[ids[t, j]] @ x[t]`` (or ``@ x[t, j]`` for ``x`` of shape
    ``(T, n_used, k)``): MMVQ up to 8 tokens, MMQ above. Returns ``out``, ``(T, n_used, n)``.

    ``check_ids`` checks on the device that every id is a slot and that no token names a slot
    twice (llama.cpp #24591 gives non-finite output), at the price of a stream synchronization;
    pass False for ids distinct by construction (top-k) on the decode path.
    """
    dev = pool.device
    if ids.dim() != 2:
        raise ShapeError(f"ids must have shape (T, n_used), got {tuple(ids.shape)}")
    t, n_used = ids.shape
    _check(ids, "ids", torch.int32, (t, n_used), dev)
    n_b = x.shape[1] if x.dim() == 3 else 1
    _check(x, "x", torch.float32, (t, n_used, pool.k) if x.dim() == 3 else (t, pool.k), dev)
    if out is None:
        out = torch.empty((t, n_used, pool.n), dtype=torch.float32, device=dev)
    _check(out, "out", torch.float32, (t, n_used, pool.n), dev)
    _core.cuda_expert_matmul(
        _device_index(pool.tensor),
        pool.qtype,
        pool.tensor.data_ptr(),
        pool.tensor.numel(),
        pool.k,
        pool.n,
        pool.n_slots,
        x.data_ptr(),
        n_b,
        t,
        ids.data_ptr(),
        n_used,
        out.data_ptr(),
        _stream(dev),
        check_ids,
    )
    return out


def moe_layer(
    gate: ExpertPool,
    up: ExpertPool,
    down: ExpertPool,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    act: str = "silu",
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    check_ids: bool = True,
) -> torch.Tensor:
    """One MoE layer in one call: ``out[t] (+)= sum_j weights[t, j] * down_s(act(gate_s x[t]) *
    up_s x[t])`` with ``s = ids[t, j]``. ``gate``/``up`` hold ``(ffn, hidden)`` matrices and
    ``down`` ``(hidden, ffn)`` ones, slot for slot. Gate and up of one type run as one fused
    MMVQ pass up to 8 tokens. Returns ``out``, ``(T, hidden)``."""
    dev = gate.device
    hidden, ffn = gate.k, gate.n
    for p, what in ((up, "up"), (down, "down")):
        if p.device != dev or p.n_slots != gate.n_slots:
            raise ShapeError(f"{what} pool must match the gate pool's device and slot count")
    if (up.k, up.n) != (hidden, ffn) or (down.k, down.n) != (ffn, hidden):
        raise ShapeError(
            f"pools must be gate/up ({ffn}, {hidden}) and down ({hidden}, {ffn}), got "
            f"up ({up.n}, {up.k}) and down ({down.n}, {down.k})"
        )
    if ids.dim() != 2:
        raise ShapeError(f"ids must have shape (T, n_used), got {tuple(ids.shape)}")
    t, n_used = ids.shape
    _check(ids, "ids", torch.int32, (t, n_used), dev)
    _check(weights, "weights", torch.float32, (t, n_used), dev)
    _check(x, "x", torch.float32, (t, hidden), dev)
    if out is None:
        out = (torch.zeros if accumulate else torch.empty)(
            (t, hidden), dtype=torch.float32, device=dev
        )
    _check(out, "out", torch.float32, (t, hidden), dev)
    g, u, d = ((p.qtype, p.tensor.data_ptr(), p.tensor.numel()) for p in (gate, up, down))
    pools = (g, u, d)
    _core.cuda_moe_layer(
        _device_index(gate.tensor),
        act,
        hidden,
        ffn,
        gate.n_slots,
        t,
        n_used,
        pools,
        x.data_ptr(),
        ids.data_ptr(),
        weights.data_ptr(),
        out.data_ptr(),
        _stream(dev),
        check_ids,
        accumulate,
    )
    return out


def handoff_wait_add(
    counter: torch.Tensor, block: np.ndarray, src: torch.Tensor, dst: torch.Tensor, timeout_s: float
) -> None:
    """Queues, on the current stream, the wait for the host's answer to the latest request,
    then ``dst += src`` (``src`` a CPU tensor in mapped page-locked memory, ``dst`` on the
    device, both float32 of one size). Without an answer in ``timeout_s`` the block's timeout
    word is set and nothing is added."""
    dev = counter.device
    _check(counter, "counter", torch.int64, (1,), dev)
    _check(dst, "dst", torch.float32, tuple(dst.shape), dev)
    if src.shape != dst.shape:
        raise ShapeError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
    _core.cuda_handoff_wait_add(
        _device_index(counter),
        counter.data_ptr(),
        block,
        _stream(dev),
        src,
        dst.data_ptr(),
        int(timeout_s * 1e9),
    )


def handoff_routes(
    counter: torch.Tensor,
    block: np.ndarray,
    tag: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    resident: torch.Tensor,
    dummy_base: int,
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel for a layer's side of a hand-off request, on the current stream: copies
    ``x``, ``ids`` and ``weights`` into ``host`` (CPU tensors in mapped page-locked memory of
    the same shapes), raises the request (``freetoken_cuda.h``, "hand-off") and returns each route's
    slot (``resident[id]``, or ``dummy_base + j`` for a route ``j`` not resident) and its GPU
    weight (0 for those)."""
    dev = counter.device
    _check(counter, "counter", torch.int64, (1,), dev)
    t, k = ids.shape
    hidden = x.shape[1]
    _check(x, "x", torch.float32, (t, hidden), dev)
    _check(ids, "ids", torch.int32, (t, k), dev)
    _check(weights, "weights", torch.float32, (t, k), dev)
    _check(resident, "resident", torch.int32, (resident.numel(),), dev)
    for h, d in zip(host, (x, ids, weights), strict=True):
        if h.shape != d.shape:
            raise ShapeError(f"host buffer {tuple(h.shape)} does not match the data's shape")
    slots = torch.empty((t, k), dtype=torch.int32, device=dev)
    gpu_weights = torch.empty((t, k), dtype=torch.float32, device=dev)
    _core.cuda_handoff_routes(
        _device_index(counter),
        counter.data_ptr(),
        block,
        _stream(dev),
        tag,
        (t, hidden, k, resident.numel(), dummy_base),
        (
            x.data_ptr(),
            ids.data_ptr(),
            weights.data_ptr(),
            resident.data_ptr(),
            slots.data_ptr(),
            gpu_weights.data_ptr(),
        ),
        host,
    )
    return slots, gpu_weights


#: The words of a fetch plan's statistics (``freetoken_cuda.h``, ``FT_CUDA_FETCH_*``).
FETCH_STATS = _core.CUDA_FETCH_STATS
FETCH_N, FETCH_MISSED, FETCH_ROUTES, FETCH_MISSED_ROUTES = 0, 1, 2, 3
FETCH_START_NS, FETCH_END_NS, FETCH_UPLOAD_NS, FETCH_CPU_NS = 4, 5, 6, 7


def fetch_plan(
    ids: torch.Tensor,
    weights: torch.Tensor,
    resident: torch.Tensor,
    resident_host: np.ndarray,
    fetched: torch.Tensor,
    stats: torch.Tensor,
    *,
    max_fetch: int,
    dummy_base: int,
    expert_bytes: int,
    links: tuple[float, float, float, float, float],
    overhead_s: float,
    share: float | None,
    price_routes: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's fetch choice on the device, on the current stream (``freetoken_cuda.h``,
    "fetch share"; :mod:`freetoken.engine.fetch` is the same rule on the host): which of the
    experts that ``resident`` does not place to upload, listed in ``fetched`` and marked
    fetched in ``resident_host`` (the host thread's int32 row in mapped page-locked memory),
    the counts in ``stats`` (int64 ``[FETCH_STATS]``). ``links`` is the layer kind's GB/s
    (cpu, pcie, gpu, cpu with pcie, pcie with cpu). Returns each route's staging slot (its
    expert's place in the list, else ``dummy_base + j``) and its weight there."""
    dev = ids.device
    t, k = ids.shape
    n_experts = resident.numel()
    _check(ids, "ids", torch.int32, (t, k), dev)
    _check(weights, "weights", torch.float32, (t, k), dev)
    _check(resident, "resident", torch.int32, (n_experts,), dev)
    _check(fetched, "fetched", torch.int32, (n_experts,), dev)
    _check(stats, "stats", torch.int64, (FETCH_STATS,), dev)
    slots = torch.empty((t, k), dtype=torch.int32, device=dev)
    fetch_weights = torch.empty((t, k), dtype=torch.float32, device=dev)
    _core.cuda_fetch_plan(
        _device_index(ids),
        _stream(dev),
        (t, k, n_experts, max_fetch, dummy_base),
        price_routes,
        (float(expert_bytes), overhead_s, share),
        links,
        (
            ids.data_ptr(),
            weights.data_ptr(),
            resident.data_ptr(),
            fetched.data_ptr(),
            slots.data_ptr(),
            fetch_weights.data_ptr(),
            stats.data_ptr(),
        ),
        resident_host,
    )
    return slots, fetch_weights


def fetch_gather(
    pools: Sequence[ExpertPool],
    sources: Sequence[tuple[int, int]],
    fetched: torch.Tensor,
    stats: torch.Tensor,
    *,
    top_k: int,
    max_fetch: int,
    dummy_base: int,
) -> None:
    """Copies a :func:`fetch_plan`'s experts into slots ``0..`` of ``pools`` (one per matrix
    kind) and zeroes their ``top_k`` slots from ``dummy_base``, on the current stream:
    expert ``e`` of kind ``i`` is ``pool.matrix_nbytes`` bytes at host address
    ``sources[i][0] + e * sources[i][1]`` in registered (mapped) page-locked memory."""
    dev = fetched.device
    n_experts = fetched.numel()
    _check(fetched, "fetched", torch.int32, (n_experts,), dev)
    _check(stats, "stats", torch.int64, (FETCH_STATS,), dev)
    if len(pools) != len(sources):
        raise InvalidInputError(f"{len(pools)} pools for {len(sources)} matrix kinds")
    for pool in pools:
        if pool.device != dev or pool.n_slots < dummy_base + top_k:
            raise ShapeError(
                f"a staging pool of {pool.n_slots} slots on {pool.device}: {dummy_base + top_k} "
                f"slots on {dev} needed"
            )
    kinds = [
        (addr, stride, pool.matrix_nbytes, pool.tensor.data_ptr())
        for pool, (addr, stride) in zip(pools, sources, strict=True)
    ]
    _core.cuda_fetch_gather(
        _device_index(fetched),
        _stream(dev),
        (n_experts, top_k, max_fetch, dummy_base),
        fetched.data_ptr(),
        stats.data_ptr(),
        kinds,
    )


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Attention's q or k ``x [T, H, D]`` (float32, heads contiguous, rows any stride: a slice
    of the fused QKV product) in one kernel on the current stream: RMSNorm over each head by
    ``weight [D]`` when given, then NEOX RoPE over whole heads with the whole-head tables
    ``cos``/``sin`` of ``[T, 1, D]`` (``cos`` twice, ``-sin`` then ``sin``), as
    ``n * cos + roll(n, D/2) * sin``. Returns a new contiguous ``[T, H, D]``."""
    dev = x.device
    if x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cuda":
        raise InvalidInputError("x must be a 3-D float32 CUDA tensor")
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        raise InvalidInputError("x must have contiguous heads")
    for name, table in (("cos", cos), ("sin", sin)):
        _check(table, name, torch.float32, (t, 1, d), dev)
    if weight is not None:
        _check(weight, "weight", torch.float32, (d,), dev)
    y = torch.empty((t, h, d), dtype=torch.float32, device=dev)
    _core.cuda_norm_rope(
        _device_index(x),
        _stream(dev),
        (t, h, d, x.stride(0) if t > 1 else h * d),  # a lone row's stride is arbitrary
        eps,
        (
            x.data_ptr(),
            0 if weight is None else weight.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            y.data_ptr(),
        ),
    )
    return y


#: Keys :func:`attn_decode` reads at most.
ATTN_MAX_KEYS = _core.CUDA_ATTN_MAX_KEYS

_attn_work_bytes: dict[tuple[int, int, int, int, int, int], int] = {}
_attn_work: dict[tuple[int, int, int], torch.Tensor] = {}


def _attn_workspace(q: torch.Tensor, sizes: tuple[int, int, int, int, int]) -> tuple[int, int]:
    """(address, bytes) of the workspace :func:`attn_decode` needs for ``sizes`` (heads, kv
    heads, dims, value dims, keys) on ``q``'s device and current stream, or (0, 0) for none.
    Sized for the key count rounded up to a power of two (a cache read at growing lengths
    takes a handful of sizes). Made once per (device, stream, bytes) and never freed, as
    :func:`constant`'s buffers: a captured step keeps the address it was captured with, and
    the kernels that share one workspace run in order on its stream."""
    dev, index = q.device, _device_index(q)
    keys = min(ATTN_MAX_KEYS, 1 << (sizes[4] - 1).bit_length())
    shape = (index, *sizes[:4], keys)
    nbytes = _attn_work_bytes.get(shape)
    if nbytes is None:
        nbytes = _attn_work_bytes[shape] = _core.cuda_attn_decode_work(index, shape[1:])
    if nbytes == 0:
        return 0, 0
    key = (index, _stream(dev), nbytes)
    buf = _attn_work.get(key)
    if buf is None:
        buf = _attn_work[key] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return buf.data_ptr(), nbytes


def _heads_uniform(t: torch.Tensor) -> bool:
    """``[L, heads, dim]`` float32 on a GPU whose (head, dim) pairs are one stride apart
    in order (``stride(1) == dim * stride(2)``), positions any stride."""
    return (
        t.dim() == 3
        and t.dtype == torch.float32
        and t.device.type == "cuda"
        and t.stride(1) == t.shape[2] * t.stride(2)
    )


def attn_decode_fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
) -> bool:
    """Whether :func:`attn_decode` takes this one-query attention: float32 throughout on the
    GPU, a contiguous ``q [H, D]``, cached keys ``[L, Hkv, D]`` with contiguous heads, values
    ``[L, Hkv, Dv]`` with contiguous heads or transposed (``KVCache(v_transposed=True)``: a
    row of positions per dimension), ``H`` a multiple of ``Hkv``, 1..ATTN_MAX_KEYS keys,
    float32 sinks if any."""
    return (
        q.dim() == 2
        and q.dtype == torch.float32
        and q.is_cuda
        and q.is_contiguous()
        and _heads_uniform(k)
        and k.stride(2) == 1
        and _heads_uniform(v)
        and (v.stride(2) == 1 or v.stride(0) == 1)
        and k.device == q.device == v.device
        and k.shape[0] == v.shape[0]
        and 1 <= k.shape[0] <= ATTN_MAX_KEYS
        and k.shape[2] == q.shape[1]
        and q.shape[0] % k.shape[1] == 0
        and k.shape[1] == v.shape[1]
        and (sinks is None or (sinks.dtype == torch.float32 and sinks.device == q.device))
    )


def attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: int | torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per head, ``q [H, D]``, over cached keys ``k [L, Hkv, D]`` and values
    ``v [L, Hkv, Dv]`` (row ``j`` is position ``j``; a transposed view as the GPU KV cache
    keeps values) in one kernel on the current stream: keys
    up to position ``pos`` (an int, or a one-element int64 tensor on the GPU, which a captured
    step replays) and within ``window`` (0: none) are seen; ``sinks [H]`` join each softmax's
    denominator (gpt-oss). The keys are split into chunks over the GPU's SMs and merged, through
    a workspace kept per device and stream. Returns ``[1, H * Dv]``, as ``layers.attention``
    does."""
    if not attn_decode_fits(q, k, v, sinks):
        raise ShapeError(
            f"attn_decode: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}: float32 CUDA tensors with contiguous heads, at most "
            f"{ATTN_MAX_KEYS} keys"
        )
    dev = q.device
    if sinks is not None:
        _check(sinks, "sinks", torch.float32, (q.shape[0],), dev)
    if isinstance(pos, torch.Tensor):
        if pos.dtype != torch.int64 or pos.device != dev or pos.numel() != 1:
            raise InvalidInputError("pos must be a one-element int64 tensor on the GPU")
        pos_value, pos_ptr = 0, pos.data_ptr()
    else:
        if pos < 0:
            raise InvalidInputError(f"pos must be non-negative, got {pos}")
        pos_value, pos_ptr = pos, 0
    (h, d), (n_keys, n_kv, dv) = q.shape, v.shape
    out = torch.empty((1, h * dv), dtype=torch.float32, device=dev)
    work = _attn_workspace(q, (h, n_kv, d, dv, n_keys))
    _core.cuda_attn_decode(
        _device_index(q),
        _stream(dev),
        (h, n_kv, d, dv, n_keys, k.stride(0), v.stride(0), v.stride(2)),
        (window, pos_value),
        scale,
        (
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            pos_ptr,
            0 if sinks is None else sinks.data_ptr(),
            out.data_ptr(),
        ),
        work,
    )
    return out


#: Sequences per :func:`gdn_decode` launch (more run in several) and the largest head it takes.
GDN_MAX_SEQS, GDN_MAX_DIM = _core.CUDA_GDN_MAX_SEQS, _core.CUDA_GDN_MAX_DIM


def _rows(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """``t`` has ``shape`` and contiguous rows (the last axis), rows any stride."""
    return tuple(t.shape) == shape and t.stride(-1) == 1


def gdn_decode_fits(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    states: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> bool:
    """Whether :func:`gdn_decode` takes this decode step: float32 throughout on one GPU; per
    sequence (one token each) the rows of ``mixed [S, C]`` (``C = (2 Hk + H) D`` channels)
    and ``z [S, H * D]``, beta and alpha inputs ``b, a [S, G, R]`` of one layout with
    ``G * R = H``; the weights (conv ``[C, K]``, dt bias ``[H]``, ``a [H]``, norm ``[D]``,
    contiguous) with ``D`` at most :data:`GDN_MAX_DIM` and ``H`` a multiple of ``Hk``; each
    sequence's contiguous conv state ``[K - 1, C]`` and delta-rule state ``[H, D, D]``."""
    conv, dt, ssm_a, norm = weights
    tensors = [mixed, z, b, a, *weights, *(t for st in states for t in st)]
    if not all(t.is_cuda and t.dtype == torch.float32 for t in tensors):
        return False
    if any(t.device != mixed.device for t in tensors) or conv.dim() != 2 or norm.dim() != 1:
        return False
    n, (c, k), h, d = len(states), conv.shape, dt.numel(), norm.numel()
    k_heads2 = c // d - h if d and c % d == 0 else 0  # 2 Hk
    return (
        1 <= n
        and 1 <= d <= GDN_MAX_DIM
        and 1 <= h <= 65535
        and k >= 2
        and k_heads2 > 0
        and k_heads2 % 2 == 0
        and h % (k_heads2 // 2) == 0
        and all(t.is_contiguous() for t in weights)
        and tuple(ssm_a.shape) == tuple(dt.shape) == (h,)
        and _rows(mixed, (n, c))
        and _rows(z, (n, h * d))
        and b.dim() == 3
        and _rows(b, (n, b.shape[1], b.shape[2]))
        and b.shape[1] * b.shape[2] == h
        and tuple(a.shape) == tuple(b.shape)
        and a.stride() == b.stride()
        and all(
            cs.is_contiguous()
            and ss.is_contiguous()
            and tuple(cs.shape) == (k - 1, c)
            and tuple(ss.shape) == (h, d, d)
            for cs, ss in states
        )
    )


def gdn_decode(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    states: Sequence[tuple[torch.Tensor, torch.Tensor]],
    grouped: bool,
    eps: float,
) -> torch.Tensor:
    """A Gated DeltaNet layer's decode step between its projections, one token per sequence,
    in two kernels per :data:`GDN_MAX_SEQS` sequences on the current stream (shapes as
    :func:`gdn_decode_fits`; the computation in ``freetoken_cuda.h``): the causal conv of
    ``mixed`` over each conv state, SiLU, the q/k L2 norms, the gates from ``b, a`` and the
    weights ``(conv, dt_bias, ssm_a, norm)``, the delta rule on each delta-rule state, the
    gated RMSNorm by ``silu(z)``. Value head ``h`` reads key head ``h // (H / Hk)`` when
    ``grouped``, else ``h % Hk``; its beta/alpha input is ``b[s, h // R, h % R]``. Both states
    are updated in place. Returns the normed heads ``[S, H, D]``."""
    if not gdn_decode_fits(mixed, z, b, a, weights, states):
        raise ShapeError(
            f"gdn_decode: mixed {tuple(mixed.shape)}, z {tuple(z.shape)}, b/a "
            f"{tuple(b.shape)}, conv {tuple(weights[0].shape)}, {len(states)} states: float32 "
            f"CUDA tensors of one decode step, heads of at most {GDN_MAX_DIM}"
        )
    conv, dt, ssm_a, norm = weights
    dev = mixed.device
    n, (c, k), h, d = len(states), conv.shape, dt.numel(), norm.numel()
    out = torch.empty((n, h, d), dtype=torch.float32, device=dev)
    for i in range(0, n, GDN_MAX_SEQS):
        rows = slice(i, i + GDN_MAX_SEQS)
        m = len(states[rows])
        # A lone row's stride is arbitrary: its width stands in (no next row for b and a).
        rows_apart = (mixed.stride(0), z.stride(0), b.stride(0)) if m > 1 else (c, h * d, 0)
        _core.cuda_gdn_decode(
            _device_index(mixed),
            _stream(dev),
            ((c // d - h) // 2, h, d, k, grouped),
            (*rows_apart, b.stride(1)),
            b.shape[2],
            eps,
            (mixed[rows].data_ptr(), z[rows].data_ptr(), b[rows].data_ptr(), a[rows].data_ptr()),
            (conv.data_ptr(), dt.data_ptr(), ssm_a.data_ptr(), norm.data_ptr()),
            [(cs.data_ptr(), ss.data_ptr()) for cs, ss in states[rows]],
            out[rows].data_ptr(),
        )
    return out


#: The most experts and routes per token :func:`topk_softmax` takes (a thread per expert).
TOPK_MAX_EXPERTS, TOPK_MAX_K = _core.CUDA_TOPK_MAX_EXPERTS, _core.CUDA_TOPK_MAX_K


def topk_softmax(
    logits: torch.Tensor, top_k: int, scale: float = 1.0, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing with renormalized top-k in one kernel on the current stream: per row of
    router ``logits [T, E]`` (float32, rows any stride) the ``top_k`` largest (ties to the
    lower id) as int32 ids ``[T, k]`` and the softmax over those k times ``scale`` as float32
    weights ``[T, k]``; ``counts [E]`` (int64) gets one per route when given."""
    dev = logits.device
    if logits.dim() != 2 or logits.dtype != torch.float32 or dev.type != "cuda":
        raise InvalidInputError("router logits must be a 2-D float32 CUDA tensor")
    if logits.stride(1) != 1:
        raise InvalidInputError("router logits must have contiguous rows")
    t, e = logits.shape
    if counts is not None:
        _check(counts, "counts", torch.int64, (e,), dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    _core.cuda_topk_softmax(
        _device_index(logits),
        _stream(dev),
        (t, e, top_k, logits.stride(0) if t > 1 else e),
        scale,
        (
            logits.data_ptr(),
            ids.data_ptr(),
            weights.data_ptr(),
            0 if counts is None else counts.data_ptr(),
        ),
    )
    return ids, weights
