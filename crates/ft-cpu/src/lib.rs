//! ft-cpu: the CPU executor. A persistent thread pool, the quantized product over
//! ggml-cpu's row kernels, the expert executor with its background submit / wait, and the
//! host half of the GPU hand-off (hybrid MoE).

mod acts;
mod attend;
mod background;
mod delta;
mod handoff;
mod isa;
mod kernels;
mod matmul;
mod moe;
mod packed;
mod pool;
#[cfg(test)]
mod testing;

pub use attend::{f16, rms_norm, CacheElem, LayerCache, OneTokenAttention, Rope};
pub use background::{Background, Ticket};
pub use delta::{delta_rule_step, DeltaShape};
pub use handoff::{
    missed_routes, words as handoff_words, words::WORDS as HANDOFF_WORDS, HandoffBlock,
    Request as HandoffRequest,
};
pub use isa::{cpu_isa, CpuIsa, ISA_VAR};
pub use matmul::{matmul_group, quantize_rows, QuantWeight};
pub use moe::{
    moe_forward, moe_forward_with, Activation, ExpertMats, ForwardOptions, MoeStats, MoeWeights,
    SKIP_ROUTE,
};
pub use packed::PackedRows;
pub use pool::{ThreadPool, DEFAULT_POLL};
