//! ft-core: no Python, no CUDA. The GGUF file, parsed and mapped once, with every offset
//! and size checked against the file before use.

pub mod cache_plan;
pub mod counters;
pub mod experts;
pub mod gguf;
pub mod slot_policy;
pub mod slots;

#[cfg(test)]
mod test_rng;

pub use freetoken_ggml::{Error, GgmlType, Result};
