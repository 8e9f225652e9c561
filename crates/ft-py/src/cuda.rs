//! The GPU entry points (`freetoken.engine.gpu` wraps them): thin glue over ft-cuda. Device
//! memory crosses as addresses of torch CUDA tensors that the Python layer keeps alive and has
//! checked for dtype, device and contiguity; the stream is torch's current stream. Host memory
//! the GPU maps (the hand-off's block and buffers) crosses as host arrays (`host.rs`).

use crate::errors::IntoPy;
use crate::host::{check_disjoint, Dtype, HostArray};
use freetoken_ggml::GgmlType;
use ft_cuda::{
    Activation, AttnDecode, AttnDecodeShape, ExpertMatmul, FetchGather, FetchKind, FetchLinks,
    FetchPlan, GdnDecode, Handoff, HandoffRoutes, Kernel, MoeLayer, NormRope, TopkSoftmax,
};
use pyo3::prelude::*;

/// Registers this module's functions on `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCudaStatus>()?;
    m.add_class::<PyCudaDevice>()?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_info, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_kernel_for, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_pool_nbytes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_expert_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_moe_layer, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_handoff_wait_add, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_handoff_routes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_norm_rope, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_topk_softmax, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_attn_decode, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_attn_decode_work, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_gdn_decode, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_fetch_plan, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_fetch_gather, m)?)?;
    m.add("CUDA_ATTN_MAX_KEYS", ft_cuda::ATTN_MAX_KEYS)?;
    m.add("CUDA_TOPK_MAX_EXPERTS", ft_cuda::TOPK_MAX_EXPERTS)?;
    m.add("CUDA_TOPK_MAX_K", ft_cuda::TOPK_MAX_K)?;
    m.add("CUDA_GDN_MAX_SEQS", ft_cuda::GDN_MAX_SEQS)?;
    m.add("CUDA_GDN_MAX_DIM", ft_cuda::GDN_MAX_DIM)?;
    m.add("CUDA_FETCH_MAX_EXPERTS", ft_cuda::FETCH_MAX_EXPERTS)?;
    m.add("CUDA_FETCHED", ft_cuda::FETCHED)?;
    m.add("CUDA_FETCH_STATS", ft_cuda::FETCH_STATS)?;
    use ft_cpu::handoff_words as w;
    for (name, value) in [
        ("HANDOFF_WORDS", w::WORDS),
        ("HANDOFF_GPU_SEQ", w::GPU_SEQ),
        ("HANDOFF_CPU_SEQ", w::CPU_SEQ),
        ("HANDOFF_TAG", w::TAG),
        ("HANDOFF_TIMEOUT", w::TIMEOUT),
        ("HANDOFF_ERROR", w::ERROR),
        ("HANDOFF_STOP", w::STOP),
        ("HANDOFF_ANSWERED", w::ANSWERED),
        ("HANDOFF_BUSY_NS", w::BUSY_NS),
    ] {
        m.add(name, value)?;
    }
    m.add("CUDA_ABI_VERSION", ft_cuda::ABI_VERSION)?;
    Ok(())
}

/// Whether the GPU path is usable: `detail` is the library's path or why there is no GPU;
/// `library_present`: whether a library file is there at all.
#[pyclass(frozen, get_all, name = "CudaStatus")]
pub struct PyCudaStatus {
    available: bool,
    detail: String,
    n_devices: i32,
    library_present: bool,
}

/// A CUDA device: compute capability as major*100+minor*10, memory in bytes.
#[pyclass(frozen, get_all, name = "CudaDevice")]
pub struct PyCudaDevice {
    name: String,
    cc: i32,
    n_sm: i32,
    total_mem: u64,
    free_mem: u64,
}

/// The GPU library's state; loads the library on first call.
#[pyfunction]
pub fn cuda_status(py: Python<'_>) -> PyCudaStatus {
    py.detach(|| match ft_cuda::runtime() {
        Ok(rt) => PyCudaStatus {
            available: true,
            detail: rt.path().display().to_string(),
            n_devices: rt.n_devices(),
            library_present: true,
        },
        Err(e) => PyCudaStatus {
            available: false,
            detail: e.message().to_string(),
            n_devices: 0,
            library_present: ft_cuda::library_present(),
        },
    })
}

/// A device's name, compute capability and memory.
#[pyfunction]
pub fn cuda_device_info(py: Python<'_>, device: i32) -> PyResult<PyCudaDevice> {
    let d = py
        .detach(|| ft_cuda::runtime()?.device_info(device))
        .py_err()?;
    Ok(PyCudaDevice {
        name: d.name,
        cc: d.cc,
        n_sm: d.n_sm,
        total_mem: d.total_mem,
        free_mem: d.free_mem,
    })
}

/// "mmvq", "mmq" or None: the kernel serving `qtype` at `n_tokens` tokens.
#[pyfunction]
pub fn cuda_kernel_for(device: i32, qtype: u32, n_tokens: usize) -> PyResult<Option<&'static str>> {
    let t = GgmlType::from_id(qtype).py_err()?;
    let k = ft_cuda::runtime()
        .and_then(|rt| rt.kernel_for(device, t, n_tokens))
        .py_err()?;
    Ok(k.map(|k| match k {
        Kernel::Mmvq => "mmvq",
        Kernel::Mmq => "mmq",
    }))
}

/// Bytes of a GPU pool of `n_slots` matrices `[n, k]` of `qtype`, zeroed tail included.
#[pyfunction]
pub fn cuda_pool_nbytes(qtype: u32, k: usize, n: usize, n_slots: usize) -> PyResult<usize> {
    let t = GgmlType::from_id(qtype).py_err()?;
    ft_cuda::pool_nbytes(t, k, n, n_slots).py_err()
}

/// `y[t, j] = W[ids[t, j]] @ x[t, j or 0]` on `stream` (see `ft_cuda::ExpertMatmul`).
#[pyfunction]
#[allow(clippy::too_many_arguments)] // mirrors the C ABI's flat argument list
pub fn cuda_expert_matmul(
    py: Python<'_>,
    device: i32,
    qtype: u32,
    w: usize,
    w_bytes: usize,
    k: usize,
    n: usize,
    n_slots: usize,
    x: usize,
    n_b: usize,
    n_tokens: usize,
    ids: usize,
    n_used: usize,
    y: usize,
    stream: usize,
    check_ids: bool,
) -> PyResult<()> {
    let wtype = GgmlType::from_id(qtype).py_err()?;
    let args = ExpertMatmul {
        device,
        wtype,
        k,
        n,
        n_slots,
        w,
        w_bytes,
        n_tokens,
        n_used,
        n_b,
        x,
        ids,
        y,
        stream,
        check_ids,
    };
    py.detach(|| ft_cuda::runtime()?.expert_matmul(&args))
        .py_err()
}

/// One MoE layer on slot pools (see `ft_cuda::MoeLayer`); `act` is "silu" or "gelu".
/// `pools` is ((gate type, address, bytes), (up ...), (down ...)).
#[pyfunction]
#[allow(clippy::too_many_arguments)] // mirrors the C ABI's flat argument list
pub fn cuda_moe_layer(
    py: Python<'_>,
    device: i32,
    act: &str,
    hidden: usize,
    ffn: usize,
    n_slots: usize,
    n_tokens: usize,
    n_used: usize,
    pools: [(u32, usize, usize); 3],
    x: usize,
    ids: usize,
    weights: usize,
    y: usize,
    stream: usize,
    check_ids: bool,
    accumulate: bool,
) -> PyResult<()> {
    let act = match act {
        "silu" => Activation::Silu,
        "gelu" => Activation::Gelu,
        other => {
            return Err(crate::errors::to_py(freetoken_ggml::Error::Unsupported(
                format!("activation {other:?} (the GPU layer has silu and gelu)"),
            )))
        }
    };
    let pool = |(t, a, b): (u32, usize, usize)| GgmlType::from_id(t).map(|t| (t, a, b));
    let args = MoeLayer {
        device,
        act,
        hidden,
        ffn,
        n_slots,
        n_tokens,
        n_used,
        gate: pool(pools[0]).py_err()?,
        up: pool(pools[1]).py_err()?,
        down: pool(pools[2]).py_err()?,
        x,
        ids,
        weights,
        y,
        stream,
        check_ids,
        accumulate,
    };
    py.detach(|| ft_cuda::runtime()?.moe_layer(&args)).py_err()
}

/// The hand-off block: int64 `[HANDOFF_WORDS]` host memory the GPU maps (written by both).
fn handoff_block(block: &Bound<'_, PyAny>) -> PyResult<HostArray> {
    let b = HostArray::output(block, Dtype::I64, "block")?;
    b.expect_len(ft_cpu::HANDOFF_WORDS, "the hand-off block")?;
    Ok(b)
}

/// Queues the wait for the host's answer, then `dst[..n] += src[..n]` for float32 `src` of
/// `n` elements in mapped host memory and device `dst` (`ft_cuda::Cuda::handoff_wait_add`).
/// As with device memory, the caller keeps the block and `src` alive while the work runs.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // mirrors the C ABI's flat argument list
pub fn cuda_handoff_wait_add(
    device: i32,
    counter: usize,
    block: &Bound<'_, PyAny>,
    stream: usize,
    src: &Bound<'_, PyAny>,
    dst: usize,
    timeout_ns: u64,
) -> PyResult<()> {
    let b = handoff_block(block)?;
    let src = HostArray::input(src, Dtype::F32, "src")?;
    check_disjoint(&[&b], &[&src])?;
    let h = Handoff::new(device, counter, b.raw::<i64>().addr(), stream);
    let n = src.len();
    ft_cuda::runtime()
        .and_then(|rt| rt.handoff_wait_add(&h, src.raw::<f32>().addr(), dst, n, timeout_ns))
        .py_err()
}

/// One layer's side of a hand-off request (`ft_cuda::Cuda::handoff_routes`). `sizes` is
/// (n_tokens, hidden, top_k, n_experts, dummy_base); `device_ptrs` (x, ids, weights, resident,
/// slots, gpu_weights); `host` the host arrays (x float32 `[n_tokens, hidden]`, ids int32 and
/// weights float32 `[n_tokens, top_k]`) in registered host memory, written by the GPU.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // mirrors the C ABI's flat argument list
pub fn cuda_handoff_routes(
    device: i32,
    counter: usize,
    block: &Bound<'_, PyAny>,
    stream: usize,
    tag: i64,
    sizes: (usize, usize, usize, usize, usize),
    device_ptrs: (usize, usize, usize, usize, usize, usize),
    host: (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>),
) -> PyResult<()> {
    let b = handoff_block(block)?;
    let (n_tokens, hidden, top_k, n_experts, dummy_base) = sizes;
    let (x, ids, weights, resident, slots, gpu_weights) = device_ptrs;
    let x_host = HostArray::output(&host.0, Dtype::F32, "x_host")?;
    let ids_host = HostArray::output(&host.1, Dtype::I32, "ids_host")?;
    let weights_host = HostArray::output(&host.2, Dtype::F32, "weights_host")?;
    x_host.expect_len(n_tokens * hidden, "n_tokens x hidden")?;
    ids_host.expect_len(n_tokens * top_k, "n_tokens x top_k")?;
    weights_host.expect_len(n_tokens * top_k, "n_tokens x top_k")?;
    check_disjoint(&[&b, &x_host, &ids_host, &weights_host], &[])?;
    let h = Handoff::new(device, counter, b.raw::<i64>().addr(), stream);
    let r = HandoffRoutes {
        tag,
        n_tokens,
        hidden,
        top_k,
        n_experts,
        dummy_base,
        x,
        ids,
        weights,
        resident,
        x_host: x_host.raw::<f32>().addr(),
        ids_host: ids_host.raw::<i32>().addr(),
        weights_host: weights_host.raw::<f32>().addr(),
        slots,
        gpu_weights,
    };
    ft_cuda::runtime()
        .and_then(|rt| rt.handoff_routes(&h, &r))
        .py_err()
}

/// RMSNorm per head and NEOX RoPE over whole heads (`ft_cuda::Cuda::norm_rope`). `sizes` is
/// (n_tokens, n_heads, head_dim, row_stride); `ptrs` (x, weight or 0, cos, sin, y).
#[pyfunction]
pub fn cuda_norm_rope(
    device: i32,
    stream: usize,
    sizes: (usize, usize, usize, usize),
    eps: f32,
    ptrs: (usize, usize, usize, usize, usize),
) -> PyResult<()> {
    let (n_tokens, n_heads, head_dim, row_stride) = sizes;
    let (x, weight, cos, sin, y) = ptrs;
    let a = NormRope {
        device,
        n_tokens,
        n_heads,
        head_dim,
        row_stride,
        eps,
        x,
        weight,
        cos,
        sin,
        y,
        stream,
    };
    ft_cuda::runtime().and_then(|rt| rt.norm_rope(&a)).py_err()
}

/// Top-k softmax routing (`ft_cuda::Cuda::topk_softmax`). `sizes` is (n_tokens, n_experts,
/// top_k, row_stride); `ptrs` (logits, ids, weights, counts or 0).
#[pyfunction]
pub fn cuda_topk_softmax(
    device: i32,
    stream: usize,
    sizes: (usize, usize, usize, usize),
    scale: f32,
    ptrs: (usize, usize, usize, usize),
) -> PyResult<()> {
    let (n_tokens, n_experts, top_k, row_stride) = sizes;
    let (logits, ids, weights, counts) = ptrs;
    let a = TopkSoftmax {
        device,
        n_tokens,
        n_experts,
        top_k,
        row_stride,
        scale,
        logits,
        ids,
        weights,
        counts,
        stream,
    };
    ft_cuda::runtime()
        .and_then(|rt| rt.topk_softmax(&a))
        .py_err()
}

/// One decode step's attention (`ft_cuda::Cuda::attn_decode`). `sizes` is (n_heads, n_kv_heads,
/// head_dim, head_dim_v, n_keys, k_stride, v_stride, v_dim_stride); `where_` (window, pos_value); `ptrs` (q,
/// k, v, pos or 0, sinks or 0, out); `work` (address or 0, bytes).
#[pyfunction]
pub fn cuda_attn_decode(
    device: i32,
    stream: usize,
    sizes: (usize, usize, usize, usize, usize, usize, usize, usize),
    where_: (usize, usize),
    scale: f32,
    ptrs: (usize, usize, usize, usize, usize, usize),
    work: (usize, usize),
) -> PyResult<()> {
    let (n_heads, n_kv_heads, head_dim, head_dim_v, n_keys, k_stride, v_stride, v_dim_stride) =
        sizes;
    let (window, pos_value) = where_;
    let (q, k, v, pos_dev, sinks, out) = ptrs;
    let (work, work_bytes) = work;
    let a = AttnDecode {
        device,
        n_heads,
        n_kv_heads,
        head_dim,
        head_dim_v,
        n_keys,
        k_stride,
        v_stride,
        v_dim_stride,
        window,
        pos_value,
        scale,
        q,
        k,
        v,
        pos_dev,
        sinks,
        out,
        work,
        work_bytes,
        stream,
    };
    ft_cuda::runtime()
        .and_then(|rt| rt.attn_decode(&a))
        .py_err()
}

/// Workspace bytes `cuda_attn_decode` needs (`ft_cuda::Cuda::attn_decode_work`) for `sizes`
/// (n_heads, n_kv_heads, head_dim, head_dim_v, n_keys) with any key count up to n_keys.
#[pyfunction]
pub fn cuda_attn_decode_work(
    device: i32,
    sizes: (usize, usize, usize, usize, usize),
) -> PyResult<usize> {
    let (n_heads, n_kv_heads, head_dim, head_dim_v, n_keys) = sizes;
    let s = AttnDecodeShape {
        device,
        n_heads,
        n_kv_heads,
        head_dim,
        head_dim_v,
        n_keys,
    };
    ft_cuda::runtime()
        .and_then(|rt| rt.attn_decode_work(s))
        .py_err()
}

/// One Gated DeltaNet decode step per sequence (`ft_cuda::Cuda::gdn_decode`). `heads` is
/// (k_heads, v_heads, head_dim, conv_kernel, grouped); `strides` (mixed, z, b/a row, b/a
/// group) with `ba_group`; `inputs` (mixed, z, b, a); `weights` (conv, dt_bias, ssm_a, norm);
/// `states` each sequence's (conv state, delta-rule state).
#[pyfunction]
#[allow(clippy::too_many_arguments)] // mirrors the C ABI's flat argument list
pub fn cuda_gdn_decode(
    device: i32,
    stream: usize,
    heads: (usize, usize, usize, usize, bool),
    strides: (usize, usize, usize, usize),
    ba_group: usize,
    eps: f32,
    inputs: (usize, usize, usize, usize),
    weights: (usize, usize, usize, usize),
    states: Vec<(usize, usize)>,
    out: usize,
) -> PyResult<()> {
    let (k_heads, v_heads, head_dim, conv_kernel, grouped) = heads;
    let (mixed_stride, z_stride, ba_stride, ba_group_stride) = strides;
    let (mixed, z, b, a) = inputs;
    let (conv_weight, dt_bias, ssm_a, norm) = weights;
    let args = GdnDecode {
        device,
        k_heads,
        v_heads,
        grouped,
        head_dim,
        conv_kernel,
        ba_group,
        mixed_stride,
        z_stride,
        ba_stride,
        ba_group_stride,
        eps,
        mixed,
        z,
        b,
        a,
        conv_weight,
        dt_bias,
        ssm_a,
        norm,
        conv_states: states.iter().map(|s| s.0).collect(),
        ssm_states: states.iter().map(|s| s.1).collect(),
        out,
        stream,
    };
    ft_cuda::runtime()
        .and_then(|rt| rt.gdn_decode(&args))
        .py_err()
}

/// One layer's fetch choice on the device (`ft_cuda::Cuda::fetch_plan`). `sizes` is
/// (n_tokens, top_k, n_experts, max_fetch, dummy_base); `rule` (expert bytes, overhead
/// seconds, forced share or None); `links` the GB/s (cpu, pcie, gpu, cpu with pcie, pcie
/// with cpu); `device_ptrs` (ids, weights, resident, fetched, slots, fetch_weights, stats);
/// `resident_host` the host thread's int32 table row of the layer in registered host memory.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // mirrors the C ABI's flat argument list
pub fn cuda_fetch_plan(
    device: i32,
    stream: usize,
    sizes: (usize, usize, usize, usize, usize),
    price_routes: bool,
    rule: (f64, f64, Option<f64>),
    links: (f64, f64, f64, f64, f64),
    device_ptrs: (usize, usize, usize, usize, usize, usize, usize),
    resident_host: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (n_tokens, top_k, n_experts, max_fetch, dummy_base) = sizes;
    let (expert_bytes, overhead_s, share) = rule;
    let (ids, weights, resident, fetched, slots, fetch_weights, stats) = device_ptrs;
    let host = HostArray::output(resident_host, Dtype::I32, "resident_host")?;
    host.expect_len(n_experts, "n_experts")?;
    let p = FetchPlan {
        device,
        stream,
        n_tokens,
        top_k,
        n_experts,
        max_fetch,
        dummy_base,
        price_routes,
        expert_bytes,
        overhead_s,
        share,
        links: FetchLinks {
            cpu: links.0,
            pcie: links.1,
            gpu: links.2,
            cpu_with_pcie: links.3,
            pcie_with_cpu: links.4,
        },
        ids,
        weights,
        resident,
        resident_host: host.raw::<i32>().addr(),
        fetched,
        slots,
        fetch_weights,
        stats,
    };
    ft_cuda::runtime().and_then(|rt| rt.fetch_plan(&p)).py_err()
}

/// The fetched experts into a staging pool (`ft_cuda::Cuda::fetch_gather`). `sizes` is
/// (n_experts, top_k, max_fetch, dummy_base) as the plan's; `kinds` per matrix kind (host
/// address of expert 0 in registered memory, stride, bytes, device address of staging slot 0).
#[pyfunction]
pub fn cuda_fetch_gather(
    device: i32,
    stream: usize,
    sizes: (usize, usize, usize, usize),
    fetched: usize,
    stats: usize,
    kinds: Vec<(usize, usize, usize, usize)>,
) -> PyResult<()> {
    let (n_experts, top_k, max_fetch, dummy_base) = sizes;
    let g = FetchGather {
        device,
        stream,
        n_experts,
        top_k,
        max_fetch,
        dummy_base,
        fetched,
        stats,
        kinds: kinds
            .into_iter()
            .map(|(src, stride, nbytes, dst)| FetchKind {
                src,
                stride,
                nbytes,
                dst,
            })
            .collect(),
    };
    ft_cuda::runtime()
        .and_then(|rt| rt.fetch_gather(&g))
        .py_err()
}
