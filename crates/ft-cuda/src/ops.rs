//! The calls: their arguments, checked here before the library sees them, and the raw
//! structs built from them.

use crate::abi::*;
use crate::checks::{check_addrs, check_handoff, check_pool, check_tokens, strided_rows_fit};
use crate::Cuda;
use freetoken_ggml::{Error, GgmlType, Result};
use std::ffi::{c_void, CStr};

/// Most tokens the MMVQ kernels take (`MMVQ_MAX_BATCH_SIZE`); MMQ serves more.
pub const MMVQ_MAX_TOKENS: usize = 8;

/// A GPU kernel family of ggml-cuda.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Matrix-vector kernels, up to [`MMVQ_MAX_TOKENS`] tokens.
    Mmvq,
    /// Matrix-matrix kernels (tensor cores), above that.
    Mmq,
}

/// The activation of a gated expert FFN: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu = 0,
    /// GELU, tanh approximation (as ggml).
    Gelu = 1,
}

/// One CUDA device as the library sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's name.
    pub name: String,
    /// Compute capability as ggml writes it: major * 100 + minor * 10 (900 for Hopper).
    pub cc: i32,
    /// Streaming multiprocessors.
    pub n_sm: i32,
    /// Device memory, bytes.
    pub total_mem: u64,
    /// Free device memory at the time of the call, bytes.
    pub free_mem: u64,
}

/// `y[t, j] = W[ids[t, j]] @ x[t, j or 0]` over a pool of expert matrices: the layout of
/// ggml's `mul_mat_id`. Addresses are device memory, shapes in elements.
#[derive(Debug, Clone)]
pub struct ExpertMatmul {
    /// CUDA device index.
    pub device: i32,
    /// The weights' type.
    pub wtype: GgmlType,
    /// Row length (input width).
    pub k: usize,
    /// Rows per matrix (output width).
    pub n: usize,
    /// Matrices in the pool.
    pub n_slots: usize,
    /// The pool: `n_slots` matrices of `n` rows, then a zeroed tail ([`pool_nbytes`]).
    pub w: usize,
    /// Bytes the caller owns at `w`.
    pub w_bytes: usize,
    /// Tokens.
    pub n_tokens: usize,
    /// Slots each token uses.
    pub n_used: usize,
    /// Activation rows per token: 1 (shared by every slot the token uses) or `n_used`.
    pub n_b: usize,
    /// float32 `[n_tokens, n_b, k]`.
    pub x: usize,
    /// int32 `[n_tokens, n_used]` slot ids, distinct within a token.
    pub ids: usize,
    /// float32 `[n_tokens, n_used, n]`, written.
    pub y: usize,
    /// `cudaStream_t` (0: the legacy default stream).
    pub stream: usize,
    /// Check the ids on the device (range, duplicates) before launching; synchronizes.
    pub check_ids: bool,
}

/// One MoE layer over slot pools:
/// `y[t] (+)= sum_j weights[t, j] * down_s(act(gate_s @ x[t]) * (up_s @ x[t]))`, `s = ids[t, j]`.
#[derive(Debug, Clone)]
pub struct MoeLayer {
    /// CUDA device index.
    pub device: i32,
    /// The gate activation.
    pub act: Activation,
    /// Model width.
    pub hidden: usize,
    /// Expert FFN width.
    pub ffn: usize,
    /// Matrices in each pool.
    pub n_slots: usize,
    /// Tokens.
    pub n_tokens: usize,
    /// Experts each token uses.
    pub n_used: usize,
    /// Gate pool: type, address, bytes; matrices `[ffn, hidden]`.
    pub gate: (GgmlType, usize, usize),
    /// Up pool, as the gate pool.
    pub up: (GgmlType, usize, usize),
    /// Down pool; matrices `[hidden, ffn]`.
    pub down: (GgmlType, usize, usize),
    /// float32 `[n_tokens, hidden]`.
    pub x: usize,
    /// int32 `[n_tokens, n_used]`.
    pub ids: usize,
    /// float32 `[n_tokens, n_used]` routing weights.
    pub weights: usize,
    /// float32 `[n_tokens, hidden]`, written (or added to).
    pub y: usize,
    /// `cudaStream_t`.
    pub stream: usize,
    /// As [`ExpertMatmul::check_ids`].
    pub check_ids: bool,
    /// Add into `y` instead of overwriting it.
    pub accumulate: bool,
}

/// One decode step's attention ([`Cuda::attn_decode`]): `q` `[n_heads, head_dim]`; key `j` of
/// kv head `g` at `k + (j * k_stride + g * head_dim) * 4`; dimension `d` of value `j` at
/// `v + (j * v_stride + (g * head_dim_v + d) * v_dim_stride) * 4` (rows of positions with
/// `v_dim_stride` 1, or the transposed cache's row of positions per dimension with `v_stride`
/// 1); keys `0..n_keys` are positions, visible up to the query's position (`pos_dev`,
/// an int64 in device memory, or `pos_value` when that is 0) and within `window` (0: none);
/// `sinks` (`n_heads` floats, 0 for none) join each softmax's denominator; `out`
/// `[n_heads, head_dim_v]`; `work` a workspace of `work_bytes`, at least what
/// [`Cuda::attn_decode_work`] reports (0 for none when that is 0). Addresses are device
/// memory.
#[derive(Debug, Clone)]
pub struct AttnDecode {
    /// CUDA device index.
    pub device: i32,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Floats per query and key head.
    pub head_dim: usize,
    /// Floats per value head.
    pub head_dim_v: usize,
    /// Cached positions read.
    pub n_keys: usize,
    /// Floats from one position's keys to the next's.
    pub k_stride: usize,
    /// Floats from one position's values to the next's.
    pub v_stride: usize,
    /// Floats from one value dimension to the next, across heads.
    pub v_dim_stride: usize,
    /// Sliding window, 0 for none.
    pub window: usize,
    /// The query's position when `pos_dev` is 0.
    pub pos_value: usize,
    /// Softmax scale.
    pub scale: f32,
    /// Query.
    pub q: usize,
    /// Keys.
    pub k: usize,
    /// Values.
    pub v: usize,
    /// The query's position (int64), or 0.
    pub pos_dev: usize,
    /// Sink logits, or 0.
    pub sinks: usize,
    /// Output.
    pub out: usize,
    /// Workspace, or 0.
    pub work: usize,
    /// Bytes at `work`.
    pub work_bytes: usize,
    /// `cudaStream_t`.
    pub stream: usize,
}

/// The sizes [`Cuda::attn_decode_work`] sizes a workspace for: as in [`AttnDecode`], with
/// `n_keys` the most keys the workspace serves.
#[derive(Debug, Clone, Copy)]
pub struct AttnDecodeShape {
    /// CUDA device index.
    pub device: i32,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Floats per query and key head.
    pub head_dim: usize,
    /// Floats per value head.
    pub head_dim_v: usize,
    /// Cached positions read, at most.
    pub n_keys: usize,
}

impl AttnDecodeShape {
    /// Whether the library takes these sizes (its own check, made here before the call).
    fn fits(&self) -> bool {
        (1..=65535).contains(&self.n_heads)
            && self.n_kv_heads != 0
            && self.n_heads.is_multiple_of(self.n_kv_heads)
            && (1..=512).contains(&self.head_dim)
            && (1..=512).contains(&self.head_dim_v)
            && (1..=ATTN_MAX_KEYS).contains(&self.n_keys)
    }
}

/// A Gated DeltaNet layer's decode step, one token per sequence ([`Cuda::gdn_decode`], the
/// formulas in `freetoken_cuda.h`): the projections `mixed` (`n_seqs` rows `mixed_stride`
/// floats apart, `(2 k_heads + v_heads) head_dim` channels), `z` (rows of `v_heads head_dim`)
/// and the beta/alpha inputs `b`, `a` (value head `h` of row `s` at
/// `s ba_stride + (h / ba_group) ba_group_stride + h % ba_group`); the layer's weights; per
/// sequence its conv state `[conv_kernel - 1, channels]` and delta-rule state
/// `[v_heads, head_dim, head_dim]`, updated in place; `out` `[n_seqs, v_heads, head_dim]`.
/// Addresses are device memory.
#[derive(Debug, Clone)]
pub struct GdnDecode {
    /// CUDA device index.
    pub device: i32,
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads (a multiple of `k_heads`).
    pub v_heads: usize,
    /// Value head `h` reads key head `h / (v_heads / k_heads)`; else `h % k_heads`.
    pub grouped: bool,
    /// Floats per head, keys and values (at most [`GDN_MAX_DIM`]).
    pub head_dim: usize,
    /// The conv's width (at least 2).
    pub conv_kernel: usize,
    /// Value heads per group of `b` and `a` (divides `v_heads`).
    pub ba_group: usize,
    /// Floats from one sequence's `mixed` row to the next.
    pub mixed_stride: usize,
    /// Floats from one sequence's `z` row to the next.
    pub z_stride: usize,
    /// Floats from one sequence's `b` (and `a`) row to the next.
    pub ba_stride: usize,
    /// Floats from one group of `b` (and `a`) to the next.
    pub ba_group_stride: usize,
    /// The L2 norms' and the RMSNorm's epsilon.
    pub eps: f32,
    /// The qkv projection, before the conv.
    pub mixed: usize,
    /// The gate projection.
    pub z: usize,
    /// Beta inputs.
    pub b: usize,
    /// Alpha inputs.
    pub a: usize,
    /// Conv weights `[channels, conv_kernel]`.
    pub conv_weight: usize,
    /// `[v_heads]`.
    pub dt_bias: usize,
    /// `[v_heads]`, `-exp(A_log)`.
    pub ssm_a: usize,
    /// The RMSNorm weight, `[head_dim]`.
    pub norm: usize,
    /// Each sequence's conv state (at most [`GDN_MAX_SEQS`] sequences).
    pub conv_states: Vec<usize>,
    /// Each sequence's delta-rule state, as many as `conv_states`.
    pub ssm_states: Vec<usize>,
    /// Output.
    pub out: usize,
    /// `cudaStream_t`.
    pub stream: usize,
}

/// Softmax routing with renormalized top-k ([`Cuda::topk_softmax`]): `n_tokens` rows of
/// `row_stride` floats of router logits at `logits`, the first `n_experts` of each; outputs
/// `ids` (int32) and `weights` (float32) `[n_tokens, top_k]`; `counts` (`n_experts` int64, 0
/// for none) gets one per route. Addresses are device memory.
#[derive(Debug, Clone)]
pub struct TopkSoftmax {
    /// CUDA device index.
    pub device: i32,
    /// Tokens.
    pub n_tokens: usize,
    /// Experts (at most [`TOPK_MAX_EXPERTS`]).
    pub n_experts: usize,
    /// Routes per token (at most 32).
    pub top_k: usize,
    /// Floats from one token's logits to the next.
    pub row_stride: usize,
    /// Factor on the weights.
    pub scale: f32,
    /// Router logits.
    pub logits: usize,
    /// Output expert ids.
    pub ids: usize,
    /// Output weights.
    pub weights: usize,
    /// Route counts per expert, or 0.
    pub counts: usize,
    /// `cudaStream_t`.
    pub stream: usize,
}

/// Attention's q or k after the fused QKV product ([`Cuda::norm_rope`]): `n_tokens` rows of
/// `row_stride` floats at `x`, the first `n_heads * head_dim` of each the heads; `weight`
/// (`head_dim` floats, 0 for none) the RMSNorm weight; `cos`/`sin` the whole-head tables
/// `[n_tokens, head_dim]`; `y` the contiguous output `[n_tokens, n_heads, head_dim]`.
/// Addresses are device memory.
#[derive(Debug, Clone)]
pub struct NormRope {
    /// CUDA device index.
    pub device: i32,
    /// Tokens.
    pub n_tokens: usize,
    /// Heads per token.
    pub n_heads: usize,
    /// Floats per head (even, at most 1024).
    pub head_dim: usize,
    /// Floats from one token's row to the next.
    pub row_stride: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Input rows.
    pub x: usize,
    /// RMSNorm weight, or 0.
    pub weight: usize,
    /// Cosine table.
    pub cos: usize,
    /// Sine table (negated in the first half).
    pub sin: usize,
    /// Output.
    pub y: usize,
    /// `cudaStream_t`.
    pub stream: usize,
}

/// Where a hand-off lives: a device counter (one int64), a block of
/// `FT_CUDA_HANDOFF_WORDS` int64 words of mapped page-locked host memory, the stream.
#[derive(Debug, Clone, Copy)]
pub struct Handoff {
    /// CUDA device index.
    pub device: i32,
    /// Device address of the int64 sequence counter.
    pub counter: usize,
    /// Host address of the block.
    pub block: usize,
    /// `cudaStream_t`.
    pub stream: usize,
}

impl Handoff {
    /// The hand-off on `device` with these addresses and stream.
    pub fn new(device: i32, counter: usize, block: usize, stream: usize) -> Handoff {
        Handoff {
            device,
            counter,
            block,
            stream,
        }
    }
}

/// One layer's request ([`Cuda::handoff_routes`]): addresses and sizes.
#[derive(Debug, Clone, Copy)]
pub struct HandoffRoutes {
    /// What the request is about (the layer's hand-off position and its tokens).
    pub tag: i64,
    /// Tokens.
    pub n_tokens: usize,
    /// Model width.
    pub hidden: usize,
    /// Routes per token.
    pub top_k: usize,
    /// Experts of the layer.
    pub n_experts: usize,
    /// The first of `top_k` zeroed slots that missed routes point at.
    pub dummy_base: usize,
    /// Device float32 `[n_tokens, hidden]`.
    pub x: usize,
    /// Device int32 `[n_tokens, top_k]`.
    pub ids: usize,
    /// Device float32 `[n_tokens, top_k]`.
    pub weights: usize,
    /// Device int32 `[n_experts]`: slot or -1.
    pub resident: usize,
    /// Registered host float32 `[n_tokens, hidden]`.
    pub x_host: usize,
    /// Registered host int32 `[n_tokens, top_k]`.
    pub ids_host: usize,
    /// Registered host float32 `[n_tokens, top_k]`.
    pub weights_host: usize,
    /// Device int32 `[n_tokens, top_k]`, written.
    pub slots: usize,
    /// Device float32 `[n_tokens, top_k]`, written.
    pub gpu_weights: usize,
}

/// A layer's bandwidths for the fetch rule, GB/s: each link alone and while the other runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FetchLinks {
    /// The CPU expert kernels.
    pub cpu: f64,
    /// Host-to-GPU copies.
    pub pcie: f64,
    /// The GPU expert kernels.
    pub gpu: f64,
    /// The CPU while uploads run.
    pub cpu_with_pcie: f64,
    /// Uploads while the CPU computes.
    pub pcie_with_cpu: f64,
}

/// One layer's fetch choice on the device ([`Cuda::fetch_plan`]; the rule is in
/// `cuda/include/freetoken_cuda.h`, "fetch share").
#[derive(Debug, Clone, Copy)]
pub struct FetchPlan {
    /// CUDA device index.
    pub device: i32,
    /// `cudaStream_t`.
    pub stream: usize,
    /// Tokens.
    pub n_tokens: usize,
    /// Routes per token.
    pub top_k: usize,
    /// Experts of the layer, at most [`FETCH_MAX_EXPERTS`].
    pub n_experts: usize,
    /// Experts fetched at most (below [`FETCH_MAX_EXPERTS`], at most `dummy_base`).
    pub max_fetch: usize,
    /// The first of `top_k` zeroed staging slots that routes not fetched point at.
    pub dummy_base: usize,
    /// Each CPU route priced as one expert read (else each missed expert).
    pub price_routes: bool,
    /// An expert's bytes (its three matrices).
    pub expert_bytes: f64,
    /// Seconds a layer pays when it fetches at all.
    pub overhead_s: f64,
    /// The share of the missed experts forced, or None: the modelled choice.
    pub share: Option<f64>,
    /// The layer kind's bandwidths.
    pub links: FetchLinks,
    /// Device int32 `[n_tokens, top_k]`.
    pub ids: usize,
    /// Device float32 `[n_tokens, top_k]`.
    pub weights: usize,
    /// Device int32 `[n_experts]`: slot or -1.
    pub resident: usize,
    /// Registered host int32 `[n_experts]`: the host thread's table, fetched experts marked.
    pub resident_host: usize,
    /// Device int32 `[n_experts]`, written: the fetched experts, in order.
    pub fetched: usize,
    /// Device int32 `[n_tokens, top_k]`, written: each route's staging slot.
    pub slots: usize,
    /// Device float32 `[n_tokens, top_k]`, written: each route's weight on the staging.
    pub fetch_weights: usize,
    /// Device int64 `[FETCH_STATS]`, written.
    pub stats: usize,
}

/// One matrix kind of a layer's experts for [`Cuda::fetch_gather`]: where expert 0's bytes
/// lie in registered host memory, the distance to the next expert's, an expert's bytes, and
/// slot 0 of the staging pool on the device.
#[derive(Debug, Clone, Copy)]
pub struct FetchKind {
    /// Registered host address of expert 0.
    pub src: usize,
    /// Bytes from one expert to the next.
    pub stride: usize,
    /// An expert's bytes.
    pub nbytes: usize,
    /// Device address of staging slot 0.
    pub dst: usize,
}

/// The upload of a fetch plan's experts into a staging pool ([`Cuda::fetch_gather`]).
#[derive(Debug, Clone)]
pub struct FetchGather {
    /// CUDA device index.
    pub device: i32,
    /// `cudaStream_t`.
    pub stream: usize,
    /// As the plan's.
    pub n_experts: usize,
    /// As the plan's.
    pub top_k: usize,
    /// As the plan's.
    pub max_fetch: usize,
    /// As the plan's.
    pub dummy_base: usize,
    /// The plan's `fetched`.
    pub fetched: usize,
    /// The plan's `stats`.
    pub stats: usize,
    /// One to three matrix kinds.
    pub kinds: Vec<FetchKind>,
}

fn check_fetch_sizes(
    n_experts: usize,
    top_k: usize,
    max_fetch: usize,
    dummy_base: usize,
) -> Result<()> {
    if !(1..=FETCH_MAX_EXPERTS).contains(&n_experts)
        || top_k == 0
        || max_fetch > n_experts
        || max_fetch >= FETCH_MAX_EXPERTS
        || max_fetch > dummy_base
        || dummy_base + top_k > i32::MAX as usize
    {
        return Err(Error::Shape(format!(
            "fetch of at most {max_fetch} of {n_experts} experts (1..={FETCH_MAX_EXPERTS}), \
             top-{top_k}, zeroed slots from {dummy_base}"
        )));
    }
    Ok(())
}

fn check_stats(stats: usize) -> Result<()> {
    if stats == 0 || !stats.is_multiple_of(8) {
        return Err(Error::InvalidInput(format!(
            "fetch stats: device address {stats:#x} is null or not 8-byte aligned"
        )));
    }
    Ok(())
}

impl Cuda {
    fn check_device(&self, device: i32) -> Result<()> {
        if device < 0 || device >= self.n_devices {
            return Err(Error::InvalidInput(format!(
                "device {device} out of range ({} CUDA devices)",
                self.n_devices
            )));
        }
        Ok(())
    }

    /// The device's name, compute capability and memory.
    pub fn device_info(&self, device: i32) -> Result<DeviceInfo> {
        self.check_device(device)?;
        let mut raw = RawDeviceInfo {
            struct_size: std::mem::size_of::<RawDeviceInfo>() as u64,
            name: [0; 256],
            cc: 0,
            n_sm: 0,
            total_mem: 0,
            free_mem: 0,
        };
        // SAFETY: raw is a properly sized, writable struct.
        let rc = unsafe { (self.api.device_info)(device, &mut raw) };
        if rc != OK {
            return Err(self.last_error(rc));
        }
        raw.name[255] = 0;
        // SAFETY: NUL-terminated just above at the latest.
        let name = unsafe { CStr::from_ptr(raw.name.as_ptr()) };
        Ok(DeviceInfo {
            name: name.to_string_lossy().into_owned(),
            cc: raw.cc,
            n_sm: raw.n_sm,
            total_mem: raw.total_mem,
            free_mem: raw.free_mem,
        })
    }

    /// The kernel that serves `ty` at `n_tokens` tokens on `device`, if any.
    pub fn kernel_for(&self, device: i32, ty: GgmlType, n_tokens: usize) -> Result<Option<Kernel>> {
        self.check_device(device)?;
        // SAFETY: plain values in, a plain value out.
        let k = unsafe { (self.api.kernel_for)(device, ty.id() as i32, n_tokens as i64) };
        Ok(match k {
            1 => Some(Kernel::Mmvq),
            2 => Some(Kernel::Mmq),
            _ => None,
        })
    }

    fn require_kernel(&self, device: i32, ty: GgmlType, n_tokens: usize) -> Result<()> {
        if self.kernel_for(device, ty, n_tokens)?.is_none() {
            return Err(Error::Unsupported(format!(
                "ggml-cuda has no MMVQ/MMQ kernel for {ty} at {n_tokens} tokens \
                 (such experts are served by the CPU executor)"
            )));
        }
        Ok(())
    }

    /// Runs an [`ExpertMatmul`] on its stream (asynchronously unless `check_ids`).
    pub fn expert_matmul(&self, a: &ExpertMatmul) -> Result<()> {
        self.check_device(a.device)?;
        check_pool("weights", a.wtype, a.k, a.n, a.n_slots, a.w, a.w_bytes)?;
        check_tokens("expert_matmul", a.n_tokens, a.n_used, a.k.max(a.n))?;
        if a.n_b != 1 && a.n_b != a.n_used {
            return Err(Error::Shape(format!(
                "x has {} rows per token; expected 1 or n_used={}",
                a.n_b, a.n_used
            )));
        }
        check_addrs(&[("x", a.x), ("ids", a.ids), ("y", a.y)])?;
        self.require_kernel(a.device, a.wtype, a.n_tokens)?;
        let raw = RawMatmulArgs {
            struct_size: std::mem::size_of::<RawMatmulArgs>() as u64,
            device: a.device,
            wtype: a.wtype.id() as i32,
            k: a.k as i64,
            n: a.n as i64,
            n_slots: a.n_slots as i64,
            w: a.w as *const c_void,
            w_bytes: a.w_bytes as u64,
            n_tokens: a.n_tokens as i64,
            n_used: a.n_used as i64,
            n_b: a.n_b as i64,
            x: a.x as *const f32,
            ids: a.ids as *const i32,
            y: a.y as *mut f32,
            stream: a.stream as *mut c_void,
            flags: if a.check_ids { FLAG_CHECK_IDS } else { 0 },
            reserved: 0,
        };
        // SAFETY: the arguments were checked above; the memory behind the addresses is the
        // caller's device memory, sized as checked.
        self.status(unsafe { (self.api.expert_matmul)(&raw) })
    }

    /// Runs a [`MoeLayer`] on its stream (asynchronously unless `check_ids`).
    pub fn moe_layer(&self, a: &MoeLayer) -> Result<()> {
        self.check_device(a.device)?;
        let (gt, ga, gb) = a.gate;
        let (ut, ua, ub) = a.up;
        let (dt, da, db) = a.down;
        check_pool("gate", gt, a.hidden, a.ffn, a.n_slots, ga, gb)?;
        check_pool("up", ut, a.hidden, a.ffn, a.n_slots, ua, ub)?;
        check_pool("down", dt, a.ffn, a.hidden, a.n_slots, da, db)?;
        check_tokens("moe_layer", a.n_tokens, a.n_used, a.hidden.max(a.ffn))?;
        check_addrs(&[
            ("x", a.x),
            ("ids", a.ids),
            ("weights", a.weights),
            ("y", a.y),
        ])?;
        for t in [gt, ut, dt] {
            self.require_kernel(a.device, t, a.n_tokens)?;
        }
        let mut flags = 0;
        if a.check_ids {
            flags |= FLAG_CHECK_IDS;
        }
        if a.accumulate {
            flags |= FLAG_ACCUMULATE;
        }
        let raw = RawMoeArgs {
            struct_size: std::mem::size_of::<RawMoeArgs>() as u64,
            device: a.device,
            act: a.act as i32,
            hidden: a.hidden as i64,
            ffn: a.ffn as i64,
            n_slots: a.n_slots as i64,
            n_tokens: a.n_tokens as i64,
            n_used: a.n_used as i64,
            gate_type: gt.id() as i32,
            up_type: ut.id() as i32,
            down_type: dt.id() as i32,
            reserved0: 0,
            gate: ga as *const c_void,
            gate_bytes: gb as u64,
            up: ua as *const c_void,
            up_bytes: ub as u64,
            down: da as *const c_void,
            down_bytes: db as u64,
            x: a.x as *const f32,
            ids: a.ids as *const i32,
            weights: a.weights as *const f32,
            y: a.y as *mut f32,
            stream: a.stream as *mut c_void,
            flags,
            reserved1: 0,
        };
        // SAFETY: as in expert_matmul.
        self.status(unsafe { (self.api.moe_layer)(&raw) })
    }

    /// Queues the wait for the host's answer to the latest request on `h.stream`, then
    /// `dst[..n] += src[..n]` (`src` mapped host memory, `dst` device memory); after
    /// `timeout_ns` without an answer the block's timeout word is set and nothing is added.
    pub fn handoff_wait_add(
        &self,
        h: &Handoff,
        src: usize,
        dst: usize,
        n: usize,
        timeout_ns: u64,
    ) -> Result<()> {
        check_addrs(&[("src", src), ("dst", dst)])?;
        if n == 0 || n > i32::MAX as usize {
            return Err(Error::Shape(format!(
                "hand-off of {n} floats: must be 1..2^31"
            )));
        }
        self.check_device(h.device)?;
        check_handoff(h)?;
        let raw = RawHandoffArgs {
            struct_size: std::mem::size_of::<RawHandoffArgs>() as u64,
            device: h.device,
            reserved: 0,
            counter: h.counter as *mut i64,
            block: h.block as *mut i64,
            src: src as *const f32,
            dst: dst as *mut f32,
            n: n as i64,
            timeout_ns,
            stream: h.stream as *mut c_void,
        };
        // SAFETY: the library checks that the block and src are registered host memory and
        // only queues a kernel; the caller owns the memory for as long as it runs.
        self.status(unsafe { (self.api.handoff_wait_add)(&raw) })
    }

    /// Queues one layer's side of a hand-off request ([`HandoffRoutes`]): copies for the
    /// host, the routes' slots and GPU weights, then the request.
    pub fn handoff_routes(&self, h: &Handoff, r: &HandoffRoutes) -> Result<()> {
        self.check_device(h.device)?;
        check_handoff(h)?;
        check_addrs(&[
            ("x", r.x),
            ("ids", r.ids),
            ("weights", r.weights),
            ("resident", r.resident),
            ("x_host", r.x_host),
            ("ids_host", r.ids_host),
            ("weights_host", r.weights_host),
            ("slots", r.slots),
            ("gpu_weights", r.gpu_weights),
        ])?;
        check_tokens("handoff_routes", r.n_tokens, r.top_k, r.hidden)?;
        if r.n_experts == 0 || r.dummy_base + r.top_k > i32::MAX as usize {
            return Err(Error::Shape(format!(
                "hand-off of {} experts, dummy slots from {}",
                r.n_experts, r.dummy_base
            )));
        }
        let raw = RawHandoffRoutesArgs {
            struct_size: std::mem::size_of::<RawHandoffRoutesArgs>() as u64,
            device: h.device,
            reserved: 0,
            counter: h.counter as *mut i64,
            block: h.block as *mut i64,
            tag: r.tag,
            n_tokens: r.n_tokens as i64,
            hidden: r.hidden as i64,
            top_k: r.top_k as i64,
            n_experts: r.n_experts as i64,
            dummy_base: r.dummy_base as i64,
            x: r.x as *const f32,
            ids: r.ids as *const i32,
            weights: r.weights as *const f32,
            resident: r.resident as *const i32,
            x_host: r.x_host as *mut f32,
            ids_host: r.ids_host as *mut i32,
            weights_host: r.weights_host as *mut f32,
            slots: r.slots as *mut i32,
            gpu_weights: r.gpu_weights as *mut f32,
            stream: h.stream as *mut c_void,
        };
        // SAFETY: the library checks the host buffers are registered and only queues a kernel;
        // the caller owns every buffer of the stated size for as long as it runs.
        self.status(unsafe { (self.api.handoff_routes)(&raw) })
    }

    /// Queues [`NormRope`] on its stream: RMSNorm per head (when a weight is given) and NEOX
    /// RoPE over whole heads, `x` into `y`.
    pub fn norm_rope(&self, a: &NormRope) -> Result<()> {
        self.check_device(a.device)?;
        check_addrs(&[("x", a.x), ("cos", a.cos), ("sin", a.sin), ("y", a.y)])?;
        if a.weight != 0 {
            check_addrs(&[("weight", a.weight)])?;
        }
        let d = a.head_dim;
        if a.n_tokens == 0 || a.n_heads == 0 || !(2..=1024).contains(&d) || !d.is_multiple_of(2) {
            return Err(Error::Shape(format!(
                "norm_rope: {} tokens of {} heads of {d}: head_dim must be even, 2..=1024",
                a.n_tokens, a.n_heads
            )));
        }
        let heads = a.n_heads.checked_mul(d);
        if heads.is_none_or(|h| !strided_rows_fit(a.n_tokens, a.row_stride, h))
            || !a.eps.is_finite()
            || a.eps < 0.0
        {
            return Err(Error::Shape(format!(
                "norm_rope: row stride {} for {} heads of {d}, {} tokens, eps {}",
                a.row_stride, a.n_heads, a.n_tokens, a.eps
            )));
        }
        let raw = RawNormRopeArgs {
            struct_size: std::mem::size_of::<RawNormRopeArgs>() as u64,
            device: a.device,
            reserved: 0,
            n_tokens: a.n_tokens as i64,
            n_heads: a.n_heads as i64,
            head_dim: d as i64,
            row_stride: a.row_stride as i64,
            eps: a.eps,
            reserved1: 0,
            x: a.x as *const f32,
            weight: a.weight as *const f32,
            cos: a.cos as *const f32,
            sin: a.sin as *const f32,
            y: a.y as *mut f32,
            stream: a.stream as *mut c_void,
        };
        // SAFETY: only queues a kernel; the caller owns device buffers of the sizes stated
        // (checked against the tensors by the Python layer) for as long as it runs.
        self.status(unsafe { (self.api.norm_rope)(&raw) })
    }

    /// Queues [`TopkSoftmax`] on its stream: per token the top-k experts by logit and the
    /// softmax over those k, times the scale; route counts added when given.
    pub fn topk_softmax(&self, a: &TopkSoftmax) -> Result<()> {
        self.check_device(a.device)?;
        check_addrs(&[("logits", a.logits), ("ids", a.ids), ("weights", a.weights)])?;
        if a.counts != 0 && !a.counts.is_multiple_of(8) {
            return Err(Error::InvalidInput(format!(
                "counts: device address {:#x} is not 8-byte aligned",
                a.counts
            )));
        }
        if a.n_tokens == 0
            || !(1..=TOPK_MAX_EXPERTS).contains(&a.n_experts)
            || !(1..=TOPK_MAX_K.min(a.n_experts)).contains(&a.top_k)
            || !strided_rows_fit(a.n_tokens, a.row_stride, a.n_experts)
            || !a.scale.is_finite()
        {
            return Err(Error::Shape(format!(
                "topk_softmax: top-{} of {} experts (1..={TOPK_MAX_EXPERTS}, k at most \
                 {TOPK_MAX_K}), {} tokens, \
                 row stride {}, scale {}",
                a.top_k, a.n_experts, a.n_tokens, a.row_stride, a.scale
            )));
        }
        let raw = RawTopkSoftmaxArgs {
            struct_size: std::mem::size_of::<RawTopkSoftmaxArgs>() as u64,
            device: a.device,
            reserved: 0,
            n_tokens: a.n_tokens as i64,
            n_experts: a.n_experts as i64,
            top_k: a.top_k as i64,
            row_stride: a.row_stride as i64,
            scale: a.scale,
            reserved1: 0,
            logits: a.logits as *const f32,
            ids: a.ids as *mut i32,
            weights: a.weights as *mut f32,
            counts: a.counts as *mut i64,
            stream: a.stream as *mut c_void,
        };
        // SAFETY: only queues a kernel; the caller owns device buffers of the sizes stated
        // (checked against the tensors by the Python layer) for as long as it runs.
        self.status(unsafe { (self.api.topk_softmax)(&raw) })
    }

    /// Queues [`AttnDecode`] on its stream: one query per head over a layer's cached keys.
    pub fn attn_decode(&self, a: &AttnDecode) -> Result<()> {
        self.check_device(a.device)?;
        check_addrs(&[("q", a.q), ("k", a.k), ("v", a.v), ("out", a.out)])?;
        if a.sinks != 0 {
            check_addrs(&[("sinks", a.sinks)])?;
        }
        if a.work != 0 || a.work_bytes != 0 {
            check_addrs(&[("work", a.work)])?;
        }
        if a.pos_dev != 0 && !a.pos_dev.is_multiple_of(8) {
            return Err(Error::InvalidInput(format!(
                "pos: device address {:#x} is not 8-byte aligned",
                a.pos_dev
            )));
        }
        let rows_fit = |stride: usize, width: usize| strided_rows_fit(a.n_keys, stride, width);
        // Values in rows of positions, or (the transposed cache) a row of positions per
        // dimension.
        let v_dims = a.n_kv_heads * a.head_dim_v;
        let v_fits = (a.v_dim_stride == 1 && rows_fit(a.v_stride, v_dims))
            || (a.v_stride == 1 && strided_rows_fit(v_dims, a.v_dim_stride, a.n_keys));
        let shape = AttnDecodeShape {
            device: a.device,
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
            head_dim: a.head_dim,
            head_dim_v: a.head_dim_v,
            n_keys: a.n_keys,
        };
        if !shape.fits()
            || !rows_fit(a.k_stride, a.n_kv_heads * a.head_dim)
            || !v_fits
            || !a.scale.is_finite()
        {
            return Err(Error::Shape(format!(
                "attn_decode: {} heads over {} kv heads of {}/{}, {} keys (at most \
                 {ATTN_MAX_KEYS}), strides {}/{}/{}, scale {}",
                a.n_heads,
                a.n_kv_heads,
                a.head_dim,
                a.head_dim_v,
                a.n_keys,
                a.k_stride,
                a.v_stride,
                a.v_dim_stride,
                a.scale
            )));
        }
        let raw = RawAttnDecodeArgs {
            struct_size: std::mem::size_of::<RawAttnDecodeArgs>() as u64,
            device: a.device,
            reserved: 0,
            n_heads: a.n_heads as i64,
            n_kv_heads: a.n_kv_heads as i64,
            head_dim: a.head_dim as i64,
            head_dim_v: a.head_dim_v as i64,
            n_keys: a.n_keys as i64,
            k_stride: a.k_stride as i64,
            v_stride: a.v_stride as i64,
            v_dim_stride: a.v_dim_stride as i64,
            window: a.window as i64,
            pos_value: a.pos_value as i64,
            scale: a.scale,
            reserved1: 0,
            q: a.q as *const f32,
            k: a.k as *const f32,
            v: a.v as *const f32,
            pos_dev: a.pos_dev as *const i64,
            sinks: a.sinks as *const f32,
            out: a.out as *mut f32,
            work: a.work as *mut c_void,
            work_bytes: a.work_bytes as u64,
            stream: a.stream as *mut c_void,
        };
        // SAFETY: only queues kernels (the library checks the workspace's size against the
        // sizes first); the caller owns device buffers of the sizes stated (checked against
        // the tensors by the Python layer) for as long as they run.
        self.status(unsafe { (self.api.attn_decode)(&raw) })
    }

    /// Bytes of workspace [`Cuda::attn_decode`] needs for `s` with any key count up to
    /// `s.n_keys` (0: none).
    pub fn attn_decode_work(&self, s: AttnDecodeShape) -> Result<usize> {
        self.check_device(s.device)?;
        if !s.fits() {
            return Err(Error::Shape(format!(
                "attn_decode_work: {} heads over {} kv heads of {}/{}, {} keys (at most \
                 {ATTN_MAX_KEYS})",
                s.n_heads, s.n_kv_heads, s.head_dim, s.head_dim_v, s.n_keys
            )));
        }
        let mut bytes = 0u64;
        // SAFETY: `bytes` is a live u64 the call writes; the sizes are plain values.
        let rc = unsafe {
            (self.api.attn_decode_work)(
                s.device,
                s.n_heads as i64,
                s.n_kv_heads as i64,
                s.head_dim as i64,
                s.head_dim_v as i64,
                s.n_keys as i64,
                &mut bytes,
            )
        };
        self.status(rc)?;
        usize::try_from(bytes).map_err(|_| Error::Shape(format!("attn_decode_work: {bytes} bytes")))
    }

    /// Queues [`GdnDecode`] on its stream: one Gated DeltaNet decode step per sequence, its
    /// states updated in place.
    pub fn gdn_decode(&self, a: &GdnDecode) -> Result<()> {
        self.check_device(a.device)?;
        check_addrs(&[
            ("mixed", a.mixed),
            ("z", a.z),
            ("b", a.b),
            ("a", a.a),
            ("conv_weight", a.conv_weight),
            ("dt_bias", a.dt_bias),
            ("ssm_a", a.ssm_a),
            ("norm", a.norm),
            ("out", a.out),
        ])?;
        for (&c, &s) in a.conv_states.iter().zip(&a.ssm_states) {
            check_addrs(&[("conv state", c), ("delta-rule state", s)])?;
        }
        let n = a.conv_states.len();
        let (d, heads) = (a.head_dim, a.v_heads);
        let channels = (2 * a.k_heads + heads).checked_mul(d);
        let groups = heads.checked_div(a.ba_group).unwrap_or(0);
        // The last beta/alpha input's offset, within 32-bit element offsets.
        let ba_last = (n.max(1) - 1)
            .checked_mul(a.ba_stride)
            .zip((groups.max(1) - 1).checked_mul(a.ba_group_stride))
            .and_then(|(r, g)| r.checked_add(g)?.checked_add(a.ba_group))
            .is_some_and(|e| e <= i32::MAX as usize);
        let fits = channels.is_some_and(|c| {
            strided_rows_fit(n, a.mixed_stride, c)
                && c.checked_mul(a.conv_kernel)
                    .is_some_and(|e| e <= i32::MAX as usize)
        }) && strided_rows_fit(n, a.z_stride, heads * d);
        if !(1..=GDN_MAX_SEQS).contains(&n)
            || a.ssm_states.len() != n
            || a.k_heads == 0
            || !(1..=65535).contains(&heads)
            || !heads.is_multiple_of(a.k_heads)
            || !(1..=GDN_MAX_DIM).contains(&d)
            || a.conv_kernel < 2
            || a.ba_group == 0
            || !heads.is_multiple_of(a.ba_group)
            || !fits
            || !ba_last
            || !a.eps.is_finite()
            || a.eps < 0.0
        {
            return Err(Error::Shape(format!(
                "gdn_decode: {n} sequences (1..={GDN_MAX_SEQS}, {} delta-rule states), heads \
                 {}/{heads} of {d} (at most {GDN_MAX_DIM}), conv {}, b/a groups of {}, strides \
                 {}/{}/{}/{}, eps {}",
                a.ssm_states.len(),
                a.k_heads,
                a.conv_kernel,
                a.ba_group,
                a.mixed_stride,
                a.z_stride,
                a.ba_stride,
                a.ba_group_stride,
                a.eps
            )));
        }
        let convs: Vec<*mut f32> = a.conv_states.iter().map(|&p| p as *mut f32).collect();
        let ssms: Vec<*mut f32> = a.ssm_states.iter().map(|&p| p as *mut f32).collect();
        let raw = RawGdnDecodeArgs {
            struct_size: std::mem::size_of::<RawGdnDecodeArgs>() as u64,
            device: a.device,
            grouped: a.grouped as i32,
            n_seqs: n as i64,
            k_heads: a.k_heads as i64,
            v_heads: heads as i64,
            head_dim: d as i64,
            conv_kernel: a.conv_kernel as i64,
            ba_group: a.ba_group as i64,
            mixed_stride: a.mixed_stride as i64,
            z_stride: a.z_stride as i64,
            ba_stride: a.ba_stride as i64,
            ba_group_stride: a.ba_group_stride as i64,
            eps: a.eps,
            reserved: 0,
            mixed: a.mixed as *const f32,
            z: a.z as *const f32,
            b: a.b as *const f32,
            a: a.a as *const f32,
            conv_weight: a.conv_weight as *const f32,
            dt_bias: a.dt_bias as *const f32,
            ssm_a: a.ssm_a as *const f32,
            norm: a.norm as *const f32,
            conv_states: convs.as_ptr(),
            ssm_states: ssms.as_ptr(),
            out: a.out as *mut f32,
            stream: a.stream as *mut c_void,
        };
        // SAFETY: only queues two kernels (the state address arrays are read during the call
        // and outlive it); the caller owns device buffers of the sizes stated (checked against
        // the tensors by the Python layer) for as long as they run.
        self.status(unsafe { (self.api.gdn_decode)(&raw) })
    }

    /// Queues [`FetchPlan`] on its stream: which of the layer's missed experts to upload,
    /// each route's staging slot and weight, the host table's marks and the statistics.
    pub fn fetch_plan(&self, p: &FetchPlan) -> Result<()> {
        self.check_device(p.device)?;
        check_addrs(&[
            ("ids", p.ids),
            ("weights", p.weights),
            ("resident", p.resident),
            ("resident_host", p.resident_host),
            ("fetched", p.fetched),
            ("slots", p.slots),
            ("fetch_weights", p.fetch_weights),
        ])?;
        check_stats(p.stats)?;
        check_tokens("fetch_plan", p.n_tokens, p.top_k, 1)?;
        check_fetch_sizes(p.n_experts, p.top_k, p.max_fetch, p.dummy_base)?;
        let l = p.links;
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let figures = [
            l.cpu,
            l.pcie,
            l.gpu,
            l.cpu_with_pcie,
            l.pcie_with_cpu,
            p.expert_bytes,
        ];
        let overhead_ok = p.overhead_s.is_finite() && p.overhead_s >= 0.0;
        let share_ok = p.share.is_none_or(|s| (0.0..=1.0).contains(&s));
        if !(figures.into_iter().all(positive) && overhead_ok && share_ok) {
            return Err(Error::InvalidInput(format!(
                "fetch_plan: bandwidths {l:?} and expert bytes {} must be positive, the \
                 overhead {} s at least 0, a share {:?} within 0-1",
                p.expert_bytes, p.overhead_s, p.share
            )));
        }
        let raw = RawFetchPlanArgs {
            struct_size: std::mem::size_of::<RawFetchPlanArgs>() as u64,
            device: p.device,
            price_routes: i32::from(p.price_routes),
            n_tokens: p.n_tokens as i64,
            top_k: p.top_k as i64,
            n_experts: p.n_experts as i64,
            max_fetch: p.max_fetch as i64,
            dummy_base: p.dummy_base as i64,
            expert_bytes: p.expert_bytes,
            overhead_s: p.overhead_s,
            share: p.share.unwrap_or(-1.0),
            b_cpu: l.cpu,
            b_pcie: l.pcie,
            b_gpu: l.gpu,
            b_cpu_with_pcie: l.cpu_with_pcie,
            b_pcie_with_cpu: l.pcie_with_cpu,
            ids: p.ids as *const i32,
            weights: p.weights as *const f32,
            resident: p.resident as *const i32,
            resident_host: p.resident_host as *mut i32,
            fetched: p.fetched as *mut i32,
            slots: p.slots as *mut i32,
            fetch_weights: p.fetch_weights as *mut f32,
            stats: p.stats as *mut i64,
            stream: p.stream as *mut c_void,
        };
        // SAFETY: the library checks the host table is registered and only queues a kernel;
        // the caller owns every buffer of the stated size for as long as it runs.
        self.status(unsafe { (self.api.fetch_plan)(&raw) })
    }

    /// Queues [`FetchGather`] on its stream: the plan's experts of each kind from registered
    /// host memory into staging slots `0..`, the `top_k` slots from `dummy_base` zeroed.
    pub fn fetch_gather(&self, g: &FetchGather) -> Result<()> {
        self.check_device(g.device)?;
        check_addrs(&[("fetched", g.fetched)])?;
        check_stats(g.stats)?;
        check_fetch_sizes(g.n_experts, g.top_k, g.max_fetch, g.dummy_base)?;
        if g.kinds.is_empty() || g.kinds.len() > 3 {
            return Err(Error::Shape(format!(
                "fetch_gather: {} matrix kinds (1..=3)",
                g.kinds.len()
            )));
        }
        let mut raw = RawFetchGatherArgs {
            struct_size: std::mem::size_of::<RawFetchGatherArgs>() as u64,
            device: g.device,
            n_kinds: g.kinds.len() as i32,
            n_experts: g.n_experts as i64,
            top_k: g.top_k as i64,
            max_fetch: g.max_fetch as i64,
            dummy_base: g.dummy_base as i64,
            fetched: g.fetched as *const i32,
            stats: g.stats as *mut i64,
            src: [std::ptr::null(); 3],
            src_stride: [0; 3],
            nbytes: [0; 3],
            dst: [std::ptr::null_mut(); 3],
            stream: g.stream as *mut c_void,
        };
        for (i, k) in g.kinds.iter().enumerate() {
            let span = (g.n_experts - 1)
                .checked_mul(k.stride)
                .and_then(|s| s.checked_add(k.nbytes));
            if k.src == 0
                || k.dst == 0
                || k.nbytes == 0
                || span.is_none_or(|s| s > i64::MAX as usize)
            {
                return Err(Error::InvalidInput(format!(
                    "fetch_gather: kind {i}: null address or bad sizes ({} bytes every {})",
                    k.nbytes, k.stride
                )));
            }
            raw.src[i] = k.src as *const c_void;
            raw.src_stride[i] = k.stride as i64;
            raw.nbytes[i] = k.nbytes as i64;
            raw.dst[i] = k.dst as *mut c_void;
        }
        // SAFETY: the library checks every kind's experts lie in one registration and only
        // queues a kernel; the caller's staging holds dummy_base + top_k slots of each kind.
        self.status(unsafe { (self.api.fetch_gather)(&raw) })
    }
}
