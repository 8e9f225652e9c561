//! freetoken-ggml: ggml-base and ggml-cpu from the pinned llama.cpp source, behind a safe API.
//!
//! Types and their block geometry ([`GgmlType`]), dequantization, quantization (with an
//! optional importance matrix), activation quantization and dot products ([`VecDot`]).

mod error;
mod ffi;
mod quant;
mod types;

pub use error::{Error, Result};
pub use quant::{dequantize, dequantize_act, quantize, VecDot};
pub use types::GgmlType;

/// Initializes ggml-cpu's tables (fp16 and e8m0 conversions) exactly once; without it the dot
/// products are wrong. Every entry point that reaches a CPU kernel calls it.
pub fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: ggml_cpu_init only fills ggml's static tables.
    ONCE.call_once(|| unsafe { ffi::ggml_cpu_init() });
}

/// Whether ggml-cpu was compiled with AVX2, so that its x86 dot products take their AVX2
/// paths (whose rounding a caller reproducing them bit for bit must follow).
pub fn cpu_has_avx2() -> bool {
    // SAFETY: returns a compile-time constant of the library.
    unsafe { ffi::ggml_cpu_has_avx2() != 0 }
}
