//! Raw declarations of the few ggml-base / ggml-cpu symbols we call. Layouts follow
//! `ggml.h` and `ggml-cpu.h` of the pinned source (ggml 0.25.3).

use std::os::raw::{c_char, c_int, c_void};

pub type ToFloat = unsafe extern "C" fn(x: *const c_void, y: *mut f32, k: i64);
pub type FromFloat = unsafe extern "C" fn(x: *const f32, y: *mut c_void, k: i64);
pub type VecDot = unsafe extern "C" fn(
    n: c_int,
    s: *mut f32,
    bs: usize,
    x: *const c_void,
    bx: usize,
    y: *const c_void,
    by: usize,
    nrc: c_int,
);

#[repr(C)]
pub struct TypeTraits {
    pub type_name: *const c_char,
    pub blck_size: i64,
    pub blck_size_interleave: i64,
    pub type_size: usize,
    pub is_quantized: bool,
    pub to_float: Option<ToFloat>,
    pub from_float_ref: Option<FromFloat>,
}

#[repr(C)]
pub struct TypeTraitsCpu {
    pub from_float: Option<FromFloat>,
    pub vec_dot: Option<VecDot>,
    pub vec_dot_type: c_int,
    pub nrows: i64,
}

extern "C" {
    pub fn ggml_get_type_traits(t: c_int) -> *const TypeTraits;
    pub fn ggml_get_type_traits_cpu(t: c_int) -> *const TypeTraitsCpu;
    pub fn ggml_cpu_init();
    pub fn ggml_quantize_chunk(
        t: c_int,
        src: *const f32,
        dst: *mut c_void,
        start: i64,
        nrows: i64,
        n_per_row: i64,
        imatrix: *const f32,
    ) -> usize;
    pub fn ggml_quantize_requires_imatrix(t: c_int) -> bool;
    pub fn ggml_cpu_has_avx2() -> c_int;
}
