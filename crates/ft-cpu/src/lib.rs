//! ft-cpu: the CPU executor. A persistent thread pool, the quantized product over
//! ggml-cpu's row kernels, and the expert executor with its background submit / wait.

mod background;
mod kernels;
mod matmul;
mod moe;
mod pool;

pub use background::{Background, Ticket};
pub use matmul::{matmul_group, quantize_rows, QuantWeight};
pub use moe::{
    moe_forward, moe_forward_skipping, Activation, ExpertMats, MoeStats, MoeWeights, SKIP_ROUTE,
};
pub use pool::ThreadPool;
