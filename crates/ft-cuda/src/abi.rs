//! Mirrors of `cuda/include/freetoken_cuda.h`, the source of the C ABI: its constants, its
//! argument structs and the entry points' signatures. The tests compile the header and compare
//! every constant, struct layout and the pool-size formula with these and with what the other
//! crates use (ft-cpu's hand-off words, ft-core's pool size).

use std::ffi::{c_char, c_void};

/// The C ABI version this crate speaks (`FT_CUDA_ABI_VERSION`).
pub const ABI_VERSION: u32 = 8;
/// Keys [`crate::Cuda::attn_decode`] takes at most (`FT_CUDA_ATTN_MAX_KEYS`).
pub const ATTN_MAX_KEYS: usize = 262144;
/// Experts [`crate::Cuda::topk_softmax`] takes at most (`FT_CUDA_TOPK_MAX_EXPERTS`): a thread
/// per expert.
pub const TOPK_MAX_EXPERTS: usize = 1024;
/// Routes per token [`crate::Cuda::topk_softmax`] takes at most (`FT_CUDA_TOPK_MAX_K`).
pub const TOPK_MAX_K: usize = 32;
/// Sequences one [`crate::Cuda::gdn_decode`] launch takes at most (`FT_CUDA_GDN_MAX_SEQS`):
/// their state addresses travel in the kernels' parameters.
pub const GDN_MAX_SEQS: usize = 64;
/// The largest head [`crate::Cuda::gdn_decode`] takes (`FT_CUDA_GDN_MAX_DIM`): a thread keeps
/// its share of a state column in registers.
pub const GDN_MAX_DIM: usize = 256;
/// Experts of a layer [`crate::Cuda::fetch_plan`] takes at most (`FT_CUDA_FETCH_MAX_EXPERTS`):
/// a thread per expert and per candidate count.
pub const FETCH_MAX_EXPERTS: usize = 1024;
/// A fetched expert's entry in the host's resident table (`FT_CUDA_FETCHED`).
pub const FETCHED: i32 = i32::MAX;
/// The int64 words of a fetch plan's statistics (`FT_CUDA_FETCH_STATS`, `FT_CUDA_FETCH_*`):
/// experts fetched and missed, their routes, the gather's span, the model's two times.
pub const FETCH_STATS: usize = 8;
/// The statistics' words, in order.
pub mod fetch_words {
    /// Experts fetched.
    pub const N: usize = 0;
    /// Experts missed.
    pub const MISSED: usize = 1;
    /// Routes of the fetched experts.
    pub const ROUTES: usize = 2;
    /// Routes of the missed experts.
    pub const MISSED_ROUTES: usize = 3;
    /// The gather's first block's start on the GPU's timer (`i64::MAX`: none ran).
    pub const START_NS: usize = 4;
    /// Its last block's end.
    pub const END_NS: usize = 5;
    /// The model's upload and GPU nanoseconds of the choice.
    pub const UPLOAD_NS: usize = 6;
    /// The model's CPU nanoseconds of the choice.
    pub const CPU_NS: usize = 7;
}

pub(crate) const OK: i32 = 0;
pub(crate) const FLAG_CHECK_IDS: u32 = 1;
pub(crate) const FLAG_ACCUMULATE: u32 = 2;

// The argument structs; their sizes are also compared with the library's on load.
#[repr(C)]
pub(crate) struct RawDeviceInfo {
    pub(crate) struct_size: u64,
    pub(crate) name: [c_char; 256],
    pub(crate) cc: i32,
    pub(crate) n_sm: i32,
    pub(crate) total_mem: u64,
    pub(crate) free_mem: u64,
}

#[repr(C)]
pub(crate) struct RawMatmulArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) wtype: i32,
    pub(crate) k: i64,
    pub(crate) n: i64,
    pub(crate) n_slots: i64,
    pub(crate) w: *const c_void,
    pub(crate) w_bytes: u64,
    pub(crate) n_tokens: i64,
    pub(crate) n_used: i64,
    pub(crate) n_b: i64,
    pub(crate) x: *const f32,
    pub(crate) ids: *const i32,
    pub(crate) y: *mut f32,
    pub(crate) stream: *mut c_void,
    pub(crate) flags: u32,
    pub(crate) reserved: u32,
}

#[repr(C)]
pub(crate) struct RawMoeArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) act: i32,
    pub(crate) hidden: i64,
    pub(crate) ffn: i64,
    pub(crate) n_slots: i64,
    pub(crate) n_tokens: i64,
    pub(crate) n_used: i64,
    pub(crate) gate_type: i32,
    pub(crate) up_type: i32,
    pub(crate) down_type: i32,
    pub(crate) reserved0: i32,
    pub(crate) gate: *const c_void,
    pub(crate) gate_bytes: u64,
    pub(crate) up: *const c_void,
    pub(crate) up_bytes: u64,
    pub(crate) down: *const c_void,
    pub(crate) down_bytes: u64,
    pub(crate) x: *const f32,
    pub(crate) ids: *const i32,
    pub(crate) weights: *const f32,
    pub(crate) y: *mut f32,
    pub(crate) stream: *mut c_void,
    pub(crate) flags: u32,
    pub(crate) reserved1: u32,
}

#[repr(C)]
pub(crate) struct RawHandoffArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) reserved: i32,
    pub(crate) counter: *mut i64,
    pub(crate) block: *mut i64,
    pub(crate) src: *const f32,
    pub(crate) dst: *mut f32,
    pub(crate) n: i64,
    pub(crate) timeout_ns: u64,
    pub(crate) stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct RawHandoffRoutesArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) reserved: i32,
    pub(crate) counter: *mut i64,
    pub(crate) block: *mut i64,
    pub(crate) tag: i64,
    pub(crate) n_tokens: i64,
    pub(crate) hidden: i64,
    pub(crate) top_k: i64,
    pub(crate) n_experts: i64,
    pub(crate) dummy_base: i64,
    pub(crate) x: *const f32,
    pub(crate) ids: *const i32,
    pub(crate) weights: *const f32,
    pub(crate) resident: *const i32,
    pub(crate) x_host: *mut f32,
    pub(crate) ids_host: *mut i32,
    pub(crate) weights_host: *mut f32,
    pub(crate) slots: *mut i32,
    pub(crate) gpu_weights: *mut f32,
    pub(crate) stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct RawNormRopeArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) reserved: i32,
    pub(crate) n_tokens: i64,
    pub(crate) n_heads: i64,
    pub(crate) head_dim: i64,
    pub(crate) row_stride: i64,
    pub(crate) eps: f32,
    pub(crate) reserved1: i32,
    pub(crate) x: *const f32,
    pub(crate) weight: *const f32,
    pub(crate) cos: *const f32,
    pub(crate) sin: *const f32,
    pub(crate) y: *mut f32,
    pub(crate) stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct RawTopkSoftmaxArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) reserved: i32,
    pub(crate) n_tokens: i64,
    pub(crate) n_experts: i64,
    pub(crate) top_k: i64,
    pub(crate) row_stride: i64,
    pub(crate) scale: f32,
    pub(crate) reserved1: i32,
    pub(crate) logits: *const f32,
    pub(crate) ids: *mut i32,
    pub(crate) weights: *mut f32,
    pub(crate) counts: *mut i64,
    pub(crate) stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct RawAttnDecodeArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) reserved: i32,
    pub(crate) n_heads: i64,
    pub(crate) n_kv_heads: i64,
    pub(crate) head_dim: i64,
    pub(crate) head_dim_v: i64,
    pub(crate) n_keys: i64,
    pub(crate) k_stride: i64,
    pub(crate) v_stride: i64,
    pub(crate) v_dim_stride: i64,
    pub(crate) window: i64,
    pub(crate) pos_value: i64,
    pub(crate) scale: f32,
    pub(crate) reserved1: i32,
    pub(crate) q: *const f32,
    pub(crate) k: *const f32,
    pub(crate) v: *const f32,
    pub(crate) pos_dev: *const i64,
    pub(crate) sinks: *const f32,
    pub(crate) out: *mut f32,
    pub(crate) work: *mut c_void,
    pub(crate) work_bytes: u64,
    pub(crate) stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct RawGdnDecodeArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) grouped: i32,
    pub(crate) n_seqs: i64,
    pub(crate) k_heads: i64,
    pub(crate) v_heads: i64,
    pub(crate) head_dim: i64,
    pub(crate) conv_kernel: i64,
    pub(crate) ba_group: i64,
    pub(crate) mixed_stride: i64,
    pub(crate) z_stride: i64,
    pub(crate) ba_stride: i64,
    pub(crate) ba_group_stride: i64,
    pub(crate) eps: f32,
    pub(crate) reserved: i32,
    pub(crate) mixed: *const f32,
    pub(crate) z: *const f32,
    pub(crate) b: *const f32,
    pub(crate) a: *const f32,
    pub(crate) conv_weight: *const f32,
    pub(crate) dt_bias: *const f32,
    pub(crate) ssm_a: *const f32,
    pub(crate) norm: *const f32,
    pub(crate) conv_states: *const *mut f32,
    pub(crate) ssm_states: *const *mut f32,
    pub(crate) out: *mut f32,
    pub(crate) stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct RawFetchPlanArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) price_routes: i32,
    pub(crate) n_tokens: i64,
    pub(crate) top_k: i64,
    pub(crate) n_experts: i64,
    pub(crate) max_fetch: i64,
    pub(crate) dummy_base: i64,
    pub(crate) expert_bytes: f64,
    pub(crate) overhead_s: f64,
    pub(crate) share: f64,
    pub(crate) b_cpu: f64,
    pub(crate) b_pcie: f64,
    pub(crate) b_gpu: f64,
    pub(crate) b_cpu_with_pcie: f64,
    pub(crate) b_pcie_with_cpu: f64,
    pub(crate) ids: *const i32,
    pub(crate) weights: *const f32,
    pub(crate) resident: *const i32,
    pub(crate) resident_host: *mut i32,
    pub(crate) fetched: *mut i32,
    pub(crate) slots: *mut i32,
    pub(crate) fetch_weights: *mut f32,
    pub(crate) stats: *mut i64,
    pub(crate) stream: *mut c_void,
}

#[repr(C)]
pub(crate) struct RawFetchGatherArgs {
    pub(crate) struct_size: u64,
    pub(crate) device: i32,
    pub(crate) n_kinds: i32,
    pub(crate) n_experts: i64,
    pub(crate) top_k: i64,
    pub(crate) max_fetch: i64,
    pub(crate) dummy_base: i64,
    pub(crate) fetched: *const i32,
    pub(crate) stats: *mut i64,
    pub(crate) src: [*const c_void; 3],
    pub(crate) src_stride: [i64; 3],
    pub(crate) nbytes: [i64; 3],
    pub(crate) dst: [*mut c_void; 3],
    pub(crate) stream: *mut c_void,
}

pub(crate) type FnAbiVersion = unsafe extern "C" fn() -> u32;
pub(crate) type FnStructSize = unsafe extern "C" fn(i32) -> u64;
pub(crate) type FnInit = unsafe extern "C" fn(*mut i32) -> i32;
pub(crate) type FnDeviceInfo = unsafe extern "C" fn(i32, *mut RawDeviceInfo) -> i32;
pub(crate) type FnKernelFor = unsafe extern "C" fn(i32, i32, i64) -> i32;
pub(crate) type FnMatmul = unsafe extern "C" fn(*const RawMatmulArgs) -> i32;
pub(crate) type FnMoe = unsafe extern "C" fn(*const RawMoeArgs) -> i32;
pub(crate) type FnHandoff = unsafe extern "C" fn(*const RawHandoffArgs) -> i32;
pub(crate) type FnHandoffRoutes = unsafe extern "C" fn(*const RawHandoffRoutesArgs) -> i32;
pub(crate) type FnNormRope = unsafe extern "C" fn(*const RawNormRopeArgs) -> i32;
pub(crate) type FnTopkSoftmax = unsafe extern "C" fn(*const RawTopkSoftmaxArgs) -> i32;
pub(crate) type FnAttnDecode = unsafe extern "C" fn(*const RawAttnDecodeArgs) -> i32;
pub(crate) type FnAttnDecodeWork =
    unsafe extern "C" fn(i32, i64, i64, i64, i64, i64, *mut u64) -> i32;
pub(crate) type FnGdnDecode = unsafe extern "C" fn(*const RawGdnDecodeArgs) -> i32;
pub(crate) type FnFetchPlan = unsafe extern "C" fn(*const RawFetchPlanArgs) -> i32;
pub(crate) type FnFetchGather = unsafe extern "C" fn(*const RawFetchGatherArgs) -> i32;
pub(crate) type FnLastError = unsafe extern "C" fn() -> *const c_char;

/// `(index, C name, size)` of every argument struct, as `ft_cuda_struct_size` numbers them.
pub(crate) fn struct_sizes() -> [(i32, &'static str, usize); 11] {
    use std::mem::size_of;
    [
        (0, "ft_cuda_device_info", size_of::<RawDeviceInfo>()),
        (1, "ft_cuda_matmul_args", size_of::<RawMatmulArgs>()),
        (2, "ft_cuda_moe_args", size_of::<RawMoeArgs>()),
        (3, "ft_cuda_handoff_args", size_of::<RawHandoffArgs>()),
        (
            4,
            "ft_cuda_handoff_routes_args",
            size_of::<RawHandoffRoutesArgs>(),
        ),
        (5, "ft_cuda_norm_rope_args", size_of::<RawNormRopeArgs>()),
        (
            6,
            "ft_cuda_topk_softmax_args",
            size_of::<RawTopkSoftmaxArgs>(),
        ),
        (
            7,
            "ft_cuda_attn_decode_args",
            size_of::<RawAttnDecodeArgs>(),
        ),
        (8, "ft_cuda_gdn_decode_args", size_of::<RawGdnDecodeArgs>()),
        (9, "ft_cuda_fetch_plan_args", size_of::<RawFetchPlanArgs>()),
        (
            10,
            "ft_cuda_fetch_gather_args",
            size_of::<RawFetchGatherArgs>(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{pool_nbytes, Activation, MAX_BLOCKS, ROW_PADDING};
    use freetoken_ggml::GgmlType;
    use ft_cpu::handoff_words as hw;
    use std::collections::HashMap;
    use std::fmt::Write;
    use std::mem::{offset_of, size_of};
    use std::path::PathBuf;
    use std::process::Command;

    /// `(C expression, Rust value)` pairs: the header's constants, every field offset and
    /// struct size, and the pool size of a grid of types and shapes.
    fn expectations() -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = vec![];
        let mut c = |expr: &str, value: u64| v.push((expr.to_string(), value));
        for (name, value) in [
            ("FT_CUDA_ABI_VERSION", ABI_VERSION as u64),
            ("FT_CUDA_ATTN_MAX_KEYS", ATTN_MAX_KEYS as u64),
            ("FT_CUDA_TOPK_MAX_EXPERTS", TOPK_MAX_EXPERTS as u64),
            ("FT_CUDA_TOPK_MAX_K", TOPK_MAX_K as u64),
            ("FT_CUDA_GDN_MAX_SEQS", GDN_MAX_SEQS as u64),
            ("FT_CUDA_GDN_MAX_DIM", GDN_MAX_DIM as u64),
            ("FT_CUDA_FETCH_MAX_EXPERTS", FETCH_MAX_EXPERTS as u64),
            ("FT_CUDA_FETCHED", FETCHED as u64),
            ("FT_CUDA_FETCH_STATS", FETCH_STATS as u64),
            ("FT_CUDA_FETCH_N", fetch_words::N as u64),
            ("FT_CUDA_FETCH_MISSED", fetch_words::MISSED as u64),
            ("FT_CUDA_FETCH_ROUTES", fetch_words::ROUTES as u64),
            (
                "FT_CUDA_FETCH_MISSED_ROUTES",
                fetch_words::MISSED_ROUTES as u64,
            ),
            ("FT_CUDA_FETCH_START_NS", fetch_words::START_NS as u64),
            ("FT_CUDA_FETCH_END_NS", fetch_words::END_NS as u64),
            ("FT_CUDA_FETCH_UPLOAD_NS", fetch_words::UPLOAD_NS as u64),
            ("FT_CUDA_FETCH_CPU_NS", fetch_words::CPU_NS as u64),
            ("FT_CUDA_ROW_PADDING", ROW_PADDING as u64),
            ("FT_CUDA_MAX_POOL_BLOCKS", MAX_BLOCKS as u64),
            ("FT_CUDA_OK", OK as u64),
            ("FT_CUDA_CHECK_IDS", FLAG_CHECK_IDS as u64),
            ("FT_CUDA_ACCUMULATE", FLAG_ACCUMULATE as u64),
            ("FT_CUDA_ACT_SILU", Activation::Silu as u64),
            ("FT_CUDA_ACT_GELU", Activation::Gelu as u64),
            ("FT_CUDA_HANDOFF_WORDS", hw::WORDS as u64),
            ("FT_CUDA_HANDOFF_GPU_SEQ", hw::GPU_SEQ as u64),
            ("FT_CUDA_HANDOFF_CPU_SEQ", hw::CPU_SEQ as u64),
            ("FT_CUDA_HANDOFF_TAG", hw::TAG as u64),
            ("FT_CUDA_HANDOFF_TIMEOUT", hw::TIMEOUT as u64),
            ("FT_CUDA_HANDOFF_ERROR", hw::ERROR as u64),
            ("FT_CUDA_HANDOFF_STOP", hw::STOP as u64),
            ("FT_CUDA_HANDOFF_ANSWERED", hw::ANSWERED as u64),
            ("FT_CUDA_HANDOFF_BUSY_NS", hw::BUSY_NS as u64),
        ] {
            c(name, value);
        }
        macro_rules! layout {
            ($rust:ty, $c:literal, [$($f:ident),* $(,)?]) => {
                c(concat!("sizeof(", $c, ")"), size_of::<$rust>() as u64);
                $(c(concat!("offsetof(", $c, ", ", stringify!($f), ")"),
                    offset_of!($rust, $f) as u64);)*
            };
        }
        layout!(
            RawDeviceInfo,
            "ft_cuda_device_info",
            [struct_size, name, cc, n_sm, total_mem, free_mem]
        );
        layout!(
            RawMatmulArgs,
            "ft_cuda_matmul_args",
            [
                struct_size,
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
                flags,
                reserved
            ]
        );
        layout!(
            RawMoeArgs,
            "ft_cuda_moe_args",
            [
                struct_size,
                device,
                act,
                hidden,
                ffn,
                n_slots,
                n_tokens,
                n_used,
                gate_type,
                up_type,
                down_type,
                reserved0,
                gate,
                gate_bytes,
                up,
                up_bytes,
                down,
                down_bytes,
                x,
                ids,
                weights,
                y,
                stream,
                flags,
                reserved1
            ]
        );
        layout!(
            RawHandoffArgs,
            "ft_cuda_handoff_args",
            [
                struct_size,
                device,
                reserved,
                counter,
                block,
                src,
                dst,
                n,
                timeout_ns,
                stream
            ]
        );
        layout!(
            RawHandoffRoutesArgs,
            "ft_cuda_handoff_routes_args",
            [
                struct_size,
                device,
                reserved,
                counter,
                block,
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
                x_host,
                ids_host,
                weights_host,
                slots,
                gpu_weights,
                stream
            ]
        );
        layout!(
            RawNormRopeArgs,
            "ft_cuda_norm_rope_args",
            [
                struct_size,
                device,
                reserved,
                n_tokens,
                n_heads,
                head_dim,
                row_stride,
                eps,
                reserved1,
                x,
                weight,
                cos,
                sin,
                y,
                stream
            ]
        );
        layout!(
            RawTopkSoftmaxArgs,
            "ft_cuda_topk_softmax_args",
            [
                struct_size,
                device,
                reserved,
                n_tokens,
                n_experts,
                top_k,
                row_stride,
                scale,
                reserved1,
                logits,
                ids,
                weights,
                counts,
                stream
            ]
        );
        layout!(
            RawAttnDecodeArgs,
            "ft_cuda_attn_decode_args",
            [
                struct_size,
                device,
                reserved,
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
                reserved1,
                q,
                k,
                v,
                pos_dev,
                sinks,
                out,
                work,
                work_bytes,
                stream
            ]
        );
        layout!(
            RawGdnDecodeArgs,
            "ft_cuda_gdn_decode_args",
            [
                struct_size,
                device,
                grouped,
                n_seqs,
                k_heads,
                v_heads,
                head_dim,
                conv_kernel,
                ba_group,
                mixed_stride,
                z_stride,
                ba_stride,
                ba_group_stride,
                eps,
                reserved,
                mixed,
                z,
                b,
                a,
                conv_weight,
                dt_bias,
                ssm_a,
                norm,
                conv_states,
                ssm_states,
                out,
                stream
            ]
        );
        layout!(
            RawFetchPlanArgs,
            "ft_cuda_fetch_plan_args",
            [
                struct_size,
                device,
                price_routes,
                n_tokens,
                top_k,
                n_experts,
                max_fetch,
                dummy_base,
                expert_bytes,
                overhead_s,
                share,
                b_cpu,
                b_pcie,
                b_gpu,
                b_cpu_with_pcie,
                b_pcie_with_cpu,
                ids,
                weights,
                resident,
                resident_host,
                fetched,
                slots,
                fetch_weights,
                stats,
                stream
            ]
        );
        layout!(
            RawFetchGatherArgs,
            "ft_cuda_fetch_gather_args",
            [
                struct_size,
                device,
                n_kinds,
                n_experts,
                top_k,
                max_fetch,
                dummy_base,
                fetched,
                stats,
                src,
                src_stride,
                nbytes,
                dst,
                stream
            ]
        );
        for t in GgmlType::ALL.iter().filter(|t| t.is_storage()) {
            let bs = t.block_size();
            for k in [bs, 3 * bs, 512, 768, 2880, 4096, 7 * 512 + bs] {
                let k = k.div_ceil(bs) * bs;
                for (n, slots) in [(1, 1), (3, 5), (128, 9)] {
                    let Ok(bytes) = pool_nbytes(*t, k, n, slots) else {
                        continue;
                    };
                    c(
                        &format!(
                            "ft_cuda_pool_bytes({bs}, {}, {k}, {n}, {slots})",
                            t.type_size()
                        ),
                        bytes as u64,
                    );
                }
            }
        }
        v
    }

    /// Compiles a probe of the header with the system C compiler (`CC`, else `cc`: the
    /// workspace's build needs one) and reads every expression's value from it.
    fn header_values(exprs: &[String]) -> HashMap<String, u64> {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let dir = std::env::temp_dir().join(format!("ft-cuda-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut src = String::from(
            "#include <stddef.h>\n#include <stdio.h>\n#include \"freetoken_cuda.h\"\n\
             int main(void) {\n",
        );
        for e in exprs {
            writeln!(src, "    printf(\"%llu\\n\", (unsigned long long)({e}));").unwrap();
        }
        src.push_str("    return 0;\n}\n");
        let (c, exe) = (dir.join("probe.c"), dir.join("probe"));
        std::fs::write(&c, src).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let status = Command::new(&cc)
            .args(["-std=c11", "-Wall", "-Werror", "-I"])
            .arg(root.join("cuda/include"))
            .arg(&c)
            .arg("-o")
            .arg(&exe)
            .status()
            .unwrap_or_else(|e| panic!("running the C compiler `{cc}`: {e}"));
        assert!(status.success(), "the header probe does not compile");
        let out = Command::new(&exe).output().unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let text = String::from_utf8(out.stdout).unwrap();
        let values: Vec<u64> = text.lines().map(|l| l.parse().unwrap()).collect();
        assert_eq!(values.len(), exprs.len());
        exprs.iter().cloned().zip(values).collect()
    }

    #[test]
    fn the_rust_side_matches_the_header() {
        let want = expectations();
        let exprs: Vec<String> = want.iter().map(|(e, _)| e.clone()).collect();
        let got = header_values(&exprs);
        let wrong: Vec<String> = want
            .iter()
            .filter(|(e, v)| got[e] != *v)
            .map(|(e, v)| format!("{e}: header {}, Rust {v}", got[e]))
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        assert!(
            want.len() > 150,
            "the grid covers every layout and many pools"
        );
    }
}
