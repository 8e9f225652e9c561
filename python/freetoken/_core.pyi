"""Type stubs of the Rust extension (``crates/ft-py``), checked against the built module by
``stubtest`` in the test command.

Host arrays cross through the buffer protocol (numpy arrays, bytes) or as CPU torch tensors,
checked in Rust for dtype, C-contiguity, alignment, size and (outputs) writability and
overlap; raw integer addresses cross only for device memory (the ``cuda_*`` functions)."""

from collections.abc import Callable, Sequence
from typing import Any, final

import numpy as np
import torch
from typing_extensions import Buffer

#: A host array: a numpy array or other buffer (bytes, memoryview), or a CPU torch tensor.
_HostArray = Buffer | np.ndarray[Any, Any] | torch.Tensor

__all__ = [
    "CUDA_ABI_VERSION",
    "CUDA_ATTN_MAX_KEYS",
    "CUDA_FETCHED",
    "CUDA_FETCH_MAX_EXPERTS",
    "CUDA_FETCH_STATS",
    "CUDA_GDN_MAX_DIM",
    "CUDA_GDN_MAX_SEQS",
    "CUDA_TOPK_MAX_EXPERTS",
    "CUDA_TOPK_MAX_K",
    "HANDOFF_ANSWERED",
    "HANDOFF_BUSY_NS",
    "HANDOFF_CPU_SEQ",
    "HANDOFF_ERROR",
    "HANDOFF_GPU_SEQ",
    "HANDOFF_STOP",
    "HANDOFF_TAG",
    "HANDOFF_TIMEOUT",
    "HANDOFF_WORDS",
    "AdaptiveParams",
    "CachePlan",
    "CudaDevice",
    "CudaStatus",
    "ExpertMatrices",
    "GGUFFile",
    "LayerCounts",
    "MappedBytes",
    "MoeCounters",
    "MoeExecutor",
    "MoeLayer",
    "MoeTicket",
    "PoolPlan",
    "QuantWeight",
    "SlotCache",
    "SlotStats",
    "TensorInfo",
    "TypeInfo",
    "Upload",
    "__version__",
    "attend_one",
    "cpu_kernel_isa",
    "cuda_attn_decode",
    "cuda_attn_decode_work",
    "cuda_device_info",
    "cuda_expert_matmul",
    "cuda_fetch_gather",
    "cuda_fetch_plan",
    "cuda_gdn_decode",
    "cuda_handoff_routes",
    "cuda_handoff_wait_add",
    "cuda_kernel_for",
    "cuda_moe_layer",
    "cuda_norm_rope",
    "cuda_pool_nbytes",
    "cuda_status",
    "cuda_topk_softmax",
    "delta_rule_step",
    "dequantize",
    "matmul",
    "matmul_group",
    "num_threads",
    "plan_pools",
    "poll_us",
    "quantize",
    "rms_norm",
    "set_num_threads",
    "type_from_name",
    "type_ids",
    "type_info",
]
__version__: str

HANDOFF_WORDS: int
HANDOFF_GPU_SEQ: int
HANDOFF_CPU_SEQ: int
HANDOFF_TAG: int
HANDOFF_TIMEOUT: int
HANDOFF_ERROR: int
HANDOFF_STOP: int
HANDOFF_ANSWERED: int
HANDOFF_BUSY_NS: int
CUDA_ATTN_MAX_KEYS: int
CUDA_ABI_VERSION: int
CUDA_TOPK_MAX_EXPERTS: int
CUDA_TOPK_MAX_K: int
CUDA_GDN_MAX_SEQS: int
CUDA_GDN_MAX_DIM: int
CUDA_FETCH_MAX_EXPERTS: int
CUDA_FETCHED: int
CUDA_FETCH_STATS: int

@final
class TypeInfo:
    @property
    def name(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def type_size(self) -> int: ...
    @property
    def is_storage(self) -> bool: ...
    @property
    def has_vec_dot(self) -> bool: ...
    @property
    def vec_dot_type(self) -> int: ...
    @property
    def requires_imatrix(self) -> bool: ...

def type_info(id: int) -> TypeInfo: ...
def type_from_name(name: str) -> int: ...
def type_ids() -> list[int]: ...
def dequantize(qtype: int, src: _HostArray, dst: _HostArray) -> None: ...
def quantize(
    qtype: int, src: _HostArray, n_per_row: int, imatrix: _HostArray | None = None
) -> bytes: ...

@final
class QuantWeight:
    def __new__(cls, qtype: int, raw: _HostArray, n: int, k: int) -> QuantWeight: ...
    @property
    def n(self) -> int: ...
    @property
    def k(self) -> int: ...
    def pack(self, mapping: GGUFFile | None = None) -> tuple[bool, int]: ...
    @property
    def packed(self) -> bool: ...

def matmul(weight: QuantWeight, x: _HostArray, y: _HostArray) -> None: ...
def matmul_group(
    weights: Sequence[QuantWeight], x: _HostArray, ys: Sequence[_HostArray]
) -> None: ...
def attend_one(
    q: _HostArray,
    k: _HostArray,
    v: _HostArray,
    k_cache: _HostArray,
    v_cache: _HostArray,
    write: Sequence[int],
    read_lo: int,
    read_hi: int,
    heads: int,
    kv_heads: int,
    q_norm: _HostArray | None,
    k_norm: _HostArray | None,
    eps: float,
    cos: _HostArray | None,
    sin: _HostArray | None,
    neox: bool,
    scale: float,
    sinks: _HostArray | None,
    out: _HostArray,
) -> None: ...
def rms_norm(x: _HostArray, weight: _HostArray, eps: float, out: _HostArray) -> None: ...
def delta_rule_step(
    q: _HostArray,
    k: _HostArray,
    v: _HostArray,
    g: _HostArray,
    beta: _HostArray,
    state: _HostArray,
    out: _HostArray,
) -> None: ...
def set_num_threads(n: int, poll_us: int | None = None) -> None: ...
def num_threads() -> int: ...
def poll_us() -> int: ...
def cpu_kernel_isa() -> str: ...

@final
class TensorInfo:
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def qtype(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class MappedBytes:
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class GGUFFile:
    def __new__(
        cls,
        path: str,
        mmap: bool = True,
        progress: Callable[[int, int], object] | None = None,
    ) -> GGUFFile: ...
    @property
    def version(self) -> int: ...
    @property
    def paths(self) -> list[str]: ...
    def metadata(self) -> dict[str, Any]: ...
    def tensors(self) -> list[TensorInfo]: ...
    def tensor_data(self, name: str) -> MappedBytes: ...

@final
class LayerCounts:
    @property
    def steps(self) -> int: ...
    @property
    def routes(self) -> int: ...
    @property
    def experts(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def last_routes(self) -> int: ...
    @property
    def last_experts(self) -> int: ...
    @property
    def last_bytes(self) -> int: ...

@final
class MoeCounters:
    def __new__(cls, n_layers: int) -> MoeCounters: ...
    def expert_counts(self) -> list[list[int]]: ...
    def snapshot(self) -> list[LayerCounts]: ...
    def add_expert_counts(self, layer: int, counts: list[int]) -> None: ...

@final
class ExpertMatrices:
    @property
    def qtype(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def k(self) -> int: ...
    @property
    def ranges(self) -> list[tuple[int, int]]: ...

@final
class MoeLayer:
    def __new__(
        cls,
        file: GGUFFile,
        index: int,
        counters: MoeCounters,
        up: list[str],
        down: list[str],
        gate: list[str] | None = None,
        gate_up: list[str] | None = None,
        gate_bias: str | None = None,
        up_bias: str | None = None,
        down_bias: str | None = None,
        act: str = "silu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> MoeLayer: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def types(self) -> tuple[int, int, int]: ...
    @property
    def expert_bytes(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def act(self) -> str: ...
    @property
    def has_biases(self) -> bool: ...
    def matrices(self, kind: str) -> ExpertMatrices: ...
    def pack(self) -> tuple[list[str], int]: ...
    @property
    def packed(self) -> list[str]: ...

@final
class MoeTicket:
    def wait(self) -> None: ...

@final
class MoeExecutor:
    def __new__(
        cls,
        n_threads: int,
        residual_acts: bool = False,
        poll_us: int | None = None,
        shared: bool = False,
    ) -> MoeExecutor: ...
    @property
    def shared(self) -> bool: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def poll_us(self) -> int: ...
    @property
    def residual_acts(self) -> bool: ...
    def run(
        self,
        layer: MoeLayer,
        x: _HostArray,
        ids: _HostArray,
        weights: _HostArray,
        out: _HostArray,
        skip_negative: bool = False,
    ) -> None: ...
    def submit(
        self,
        layer: MoeLayer,
        x: _HostArray,
        ids: _HostArray,
        weights: _HostArray,
        out: _HostArray,
        skip_negative: bool = False,
    ) -> MoeTicket: ...
    def serve_handoffs(
        self,
        layers: list[MoeLayer],
        block: _HostArray,
        x: _HostArray,
        out: _HostArray,
        ids: _HostArray,
        weights: _HostArray,
        resident: _HostArray,
        max_tokens: int,
        top_k: int,
    ) -> MoeTicket: ...

@final
class AdaptiveParams:
    @property
    def half_life(self) -> float: ...
    @property
    def margin(self) -> float: ...

@final
class CudaStatus:
    @property
    def available(self) -> bool: ...
    @property
    def detail(self) -> str: ...
    @property
    def n_devices(self) -> int: ...
    @property
    def library_present(self) -> bool: ...

@final
class CudaDevice:
    @property
    def name(self) -> str: ...
    @property
    def cc(self) -> int: ...
    @property
    def n_sm(self) -> int: ...
    @property
    def total_mem(self) -> int: ...
    @property
    def free_mem(self) -> int: ...

def cuda_status() -> CudaStatus: ...
def cuda_device_info(device: int) -> CudaDevice: ...
def cuda_kernel_for(device: int, qtype: int, n_tokens: int) -> str | None: ...
def cuda_pool_nbytes(qtype: int, k: int, n: int, n_slots: int) -> int: ...
def cuda_expert_matmul(
    device: int,
    qtype: int,
    w: int,
    w_bytes: int,
    k: int,
    n: int,
    n_slots: int,
    x: int,
    n_b: int,
    n_tokens: int,
    ids: int,
    n_used: int,
    y: int,
    stream: int,
    check_ids: bool,
) -> None: ...
def cuda_moe_layer(
    device: int,
    act: str,
    hidden: int,
    ffn: int,
    n_slots: int,
    n_tokens: int,
    n_used: int,
    pools: tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]],
    x: int,
    ids: int,
    weights: int,
    y: int,
    stream: int,
    check_ids: bool,
    accumulate: bool,
) -> None: ...
def cuda_handoff_routes(
    device: int,
    counter: int,
    block: _HostArray,
    stream: int,
    tag: int,
    sizes: tuple[int, int, int, int, int],
    device_ptrs: tuple[int, int, int, int, int, int],
    host: tuple[_HostArray, _HostArray, _HostArray],
) -> None: ...
def cuda_handoff_wait_add(
    device: int,
    counter: int,
    block: _HostArray,
    stream: int,
    src: _HostArray,
    dst: int,
    timeout_ns: int,
) -> None: ...
def cuda_topk_softmax(
    device: int,
    stream: int,
    sizes: tuple[int, int, int, int],
    scale: float,
    ptrs: tuple[int, int, int, int],
) -> None: ...
def cuda_norm_rope(
    device: int,
    stream: int,
    sizes: tuple[int, int, int, int],
    eps: float,
    ptrs: tuple[int, int, int, int, int],
) -> None: ...
def cuda_attn_decode(
    device: int,
    stream: int,
    sizes: tuple[int, int, int, int, int, int, int, int],
    where_: tuple[int, int],
    scale: float,
    ptrs: tuple[int, int, int, int, int, int],
    work: tuple[int, int],
) -> None: ...
def cuda_attn_decode_work(device: int, sizes: tuple[int, int, int, int, int]) -> int: ...
def cuda_gdn_decode(
    device: int,
    stream: int,
    heads: tuple[int, int, int, int, bool],
    strides: tuple[int, int, int, int],
    ba_group: int,
    eps: float,
    inputs: tuple[int, int, int, int],
    weights: tuple[int, int, int, int],
    states: list[tuple[int, int]],
    out: int,
) -> None: ...
def cuda_fetch_plan(
    device: int,
    stream: int,
    sizes: tuple[int, int, int, int, int],
    price_routes: bool,
    rule: tuple[float, float, float | None],
    links: tuple[float, float, float, float, float],
    device_ptrs: tuple[int, int, int, int, int, int, int],
    resident_host: _HostArray,
) -> None: ...
def cuda_fetch_gather(
    device: int,
    stream: int,
    sizes: tuple[int, int, int, int],
    fetched: int,
    stats: int,
    kinds: list[tuple[int, int, int, int]],
) -> None: ...

@final
class Upload:
    @property
    def layer(self) -> int: ...
    @property
    def expert(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def evicted(self) -> tuple[int, int] | None: ...

@final
class SlotStats:
    @property
    def calls(self) -> int: ...
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def uploads(self) -> int: ...
    @property
    def evictions(self) -> int: ...

@final
class SlotCache:
    def __new__(
        cls,
        n_slots: int,
        n_experts: int,
        policy: str = "lru",
        half_life: float | None = None,
        margin: float | None = None,
    ) -> SlotCache: ...
    @property
    def policy(self) -> str: ...
    @property
    def policy_params(self) -> AdaptiveParams | None: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    def place(self, layer: int, ids: _HostArray, n_used: int, out: _HostArray) -> list[Upload]: ...
    def lookup(self, layer: int, ids: _HostArray, n_used: int, out: _HostArray) -> int: ...
    def insert(self, layer: int, expert: int) -> Upload | None: ...
    def admit(self, layer: int, experts: list[int], max_uploads: int) -> list[Upload]: ...
    def score(self, layer: int, expert: int) -> float | None: ...
    def scores(self, layer: int) -> list[float] | None: ...
    def seed(
        self, residents: list[tuple[int, int]], rates: list[float] | None = None
    ) -> list[Upload]: ...
    def split_tokens(self, ids: _HostArray, n_used: int) -> list[tuple[int, int]]: ...
    def slot_of(self, layer: int, expert: int) -> int | None: ...
    def residents(self) -> list[tuple[int, int] | None]: ...
    def recency(self) -> list[int]: ...
    def stats(self, layer: int) -> SlotStats: ...
    def all_stats(self) -> list[tuple[int, SlotStats]]: ...
    def reset_stats(self) -> None: ...
    def clear(self) -> None: ...

@final
class PoolPlan:
    @property
    def types(self) -> list[int]: ...
    @property
    def layers(self) -> list[int]: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def expert_bytes(self) -> int: ...
    @property
    def blocks(self) -> list[int]: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def residents(self) -> list[tuple[int, int]]: ...
    @property
    def coverage(self) -> float | None: ...

@final
class CachePlan:
    @property
    def pools(self) -> list[PoolPlan]: ...
    @property
    def used(self) -> int: ...
    @property
    def min_bytes(self) -> int: ...
    @property
    def all_bytes(self) -> int: ...
    @property
    def all_resident(self) -> bool: ...
    @property
    def explanation(self) -> str: ...

def plan_pools(
    layers: list[tuple[int, tuple[int, int, int], int, tuple[int, int, int], int, int]],
    budget: int,
    scope: str,
    profile: list[list[int]] | None = None,
) -> CachePlan: ...
