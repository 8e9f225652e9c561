"""Type stubs of the Rust extension. Buffers cross as (address, length) pairs that the
Python layer derives from objects it keeps alive for the call."""

from collections.abc import Callable

__version__: str

def type_info(id: int) -> tuple[str, int, int, bool, bool, int, bool]: ...
def type_from_name(name: str) -> int: ...
def type_ids() -> list[int]: ...
def dequantize(qtype: int, src: int, src_len: int, dst: int, n: int) -> None: ...
def quantize(qtype: int, src: int, n: int, n_per_row: int, imatrix: int) -> bytes: ...
def matmul(qtype: int, w: int, w_len: int, n: int, k: int, x: int, t: int, y: int) -> None: ...
def matmul_group(
    weights: list[tuple[int, int, int, int]], k: int, x: int, t: int, ys: list[int]
) -> None: ...
def set_num_threads(n: int, poll_us: int | None = None) -> None: ...
def num_threads() -> int: ...
def poll_us() -> int: ...
def cpu_kernel_isa() -> str: ...

class GGUFFile:
    def __init__(
        self, path: str, mmap: bool = True, progress: Callable[[int, int], None] | None = None
    ) -> None: ...
    @property
    def version(self) -> int: ...
    @property
    def paths(self) -> list[str]: ...
    def metadata(self) -> dict[str, object]: ...
    def tensors(self) -> list[tuple[str, list[int], int, int]]: ...
    def tensor_address(self, name: str) -> tuple[int, int]: ...

class MoeCounters:
    def __init__(self, n_layers: int) -> None: ...
    def expert_counts(self) -> list[list[int]]: ...
    def snapshot(self) -> list[tuple[int, int, int, int, int, int, int]]: ...
    def add_expert_counts(self, layer: int, counts: list[int]) -> None: ...

class MoeLayer:
    def __init__(
        self,
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
    ) -> None: ...
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
    def matrices(self, kind: str) -> tuple[int, int, int, list[tuple[int, int]]]: ...

class MoeTicket:
    def wait(self) -> None: ...

class MoeExecutor:
    def __init__(
        self, n_threads: int, residual_acts: bool = False, poll_us: int | None = None
    ) -> None: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def poll_us(self) -> int: ...
    @property
    def residual_acts(self) -> bool: ...
    def run(
        self,
        layer: MoeLayer,
        x: int,
        x_len: int,
        ids: int,
        weights: int,
        n_routes: int,
        out: int,
        skip_negative: bool = False,
    ) -> None: ...
    def submit(
        self,
        layer: MoeLayer,
        owners: object,
        x: int,
        x_len: int,
        ids: int,
        weights: int,
        n_routes: int,
        out: int,
        skip_negative: bool = False,
    ) -> MoeTicket: ...
    def serve_handoffs(
        self,
        layers: list[MoeLayer],
        owners: object,
        block: int,
        x: int,
        out: int,
        ids: int,
        weights: int,
        resident: int,
        max_tokens: int,
        top_k: int,
    ) -> MoeTicket: ...

def cuda_status() -> tuple[bool, str, int, bool]: ...
def cuda_device_info(device: int) -> tuple[str, int, int, int, int]: ...
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
    block: int,
    stream: int,
    tag: int,
    sizes: tuple[int, int, int, int, int],
    device_ptrs: tuple[int, int, int, int, int, int],
    host_ptrs: tuple[int, int, int],
) -> None: ...
def cuda_handoff_wait_add(
    device: int,
    counter: int,
    block: int,
    stream: int,
    src: int,
    dst: int,
    n: int,
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
) -> None: ...

CUDA_ATTN_MAX_KEYS: int
CUDA_ABI_VERSION: int

class SlotCache:
    def __init__(
        self,
        n_slots: int,
        n_experts: int,
        policy: str = "lru",
        half_life: float | None = None,
        margin: float | None = None,
    ) -> None: ...
    @property
    def policy(self) -> str: ...
    @property
    def policy_params(self) -> tuple[float, float] | None: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    def place(
        self, layer: int, ids: int, n_ids: int, n_used: int, out: int, n_out: int
    ) -> list[tuple[int, int, int, tuple[int, int] | None]]: ...
    def lookup(
        self, layer: int, ids: int, n_ids: int, n_used: int, out: int, n_out: int
    ) -> int: ...
    def insert(
        self, layer: int, expert: int
    ) -> tuple[int, int, int, tuple[int, int] | None] | None: ...
    def admit(
        self, layer: int, experts: list[int], max_uploads: int
    ) -> list[tuple[int, int, int, tuple[int, int] | None]]: ...
    def score(self, layer: int, expert: int) -> float | None: ...
    def scores(self, layer: int) -> list[float] | None: ...
    def seed(
        self, residents: list[tuple[int, int]], rates: list[float] | None = None
    ) -> list[tuple[int, int, int, tuple[int, int] | None]]: ...
    def split_tokens(self, ids: int, n_ids: int, n_used: int) -> list[tuple[int, int]]: ...
    def slot_of(self, layer: int, expert: int) -> int | None: ...
    def residents(self) -> list[tuple[int, int] | None]: ...
    def recency(self) -> list[int]: ...
    def stats(self, layer: int) -> tuple[int, int, int, int, int]: ...
    def all_stats(self) -> list[tuple[int, tuple[int, int, int, int, int]]]: ...
    def reset_stats(self) -> None: ...
    def clear(self) -> None: ...

def plan_pools(
    layers: list[tuple[int, tuple[int, int, int], int, tuple[int, int, int], int, int]],
    budget: int,
    scope: str,
    profile: list[list[int]] | None = None,
) -> tuple[
    list[
        tuple[
            list[int],
            list[int],
            int,
            int,
            int,
            list[int],
            int,
            int,
            list[tuple[int, int]],
            float | None,
        ]
    ],
    int,
    int,
    int,
    bool,
    str,
]: ...
