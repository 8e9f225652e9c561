//! ft-cpu: the CPU executor. A persistent thread pool and the quantized product over
//! ggml-cpu's row kernels.

mod matmul;
mod pool;

pub use matmul::{quantize_rows, QuantWeight};
pub use pool::ThreadPool;
