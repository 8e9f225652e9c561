//! Quantization entry points: type queries, dequantize, quantize, the quantized product.

use crate::errors::IntoPy;
use crate::memory::{slice, slice_mut};
use crate::threads::pool;
use freetoken_ggml::{GgmlType, Result};
use ft_cpu::QuantWeight;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// (name, block size, type size, storage type?, has a CPU dot product?, vec_dot type id,
/// requires an importance matrix?) for a type id.
#[pyfunction]
pub fn type_info(id: u32) -> PyResult<(String, usize, usize, bool, bool, u32, bool)> {
    let t = GgmlType::from_id(id).py_err()?;
    let has_dot = t.has_vec_dot();
    let vdt = if has_dot {
        t.vec_dot_type().id()
    } else {
        t.id()
    };
    Ok((
        t.name().to_string(),
        t.block_size(),
        t.type_size(),
        t.is_storage(),
        has_dot,
        vdt,
        t.requires_imatrix(),
    ))
}

/// The id of the type named `name` (any case).
#[pyfunction]
pub fn type_from_name(name: &str) -> PyResult<u32> {
    GgmlType::from_name(name).map(GgmlType::id).py_err()
}

/// Dequantizes `src_len` bytes at `src` into `n` float32 at `dst`.
#[pyfunction]
pub fn dequantize(
    py: Python<'_>,
    qtype: u32,
    src: usize,
    src_len: usize,
    dst: usize,
    n: usize,
) -> PyResult<()> {
    let t = GgmlType::from_id(qtype).py_err()?;
    py.detach(|| -> Result<()> {
        // SAFETY: the Python caller holds both buffers alive for the call (memory.rs).
        let (s, d) = unsafe {
            (
                slice::<u8>(src, src_len, "src")?,
                slice_mut::<f32>(dst, n, "dst")?,
            )
        };
        freetoken_ggml::dequantize(t, s, d)
    })
    .py_err()
}

/// Quantizes `n` float32 at `src` (rows of `n_per_row`) to `qtype`; `imatrix` is an address of
/// `n_per_row` float32, or 0 for none.
#[pyfunction]
pub fn quantize<'py>(
    py: Python<'py>,
    qtype: u32,
    src: usize,
    n: usize,
    n_per_row: usize,
    imatrix: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let t = GgmlType::from_id(qtype).py_err()?;
    let out = py
        .detach(|| -> Result<Vec<u8>> {
            // SAFETY: the Python caller holds both buffers alive for the call (memory.rs).
            let s = unsafe { slice::<f32>(src, n, "src")? };
            let im = if imatrix == 0 {
                None
            } else {
                Some(unsafe { slice::<f32>(imatrix, n_per_row, "imatrix")? })
            };
            freetoken_ggml::quantize(t, s, n_per_row, im)
        })
        .py_err()?;
    Ok(PyBytes::new(py, &out))
}

/// y[T, N] = x[T, K] . W^T for `n` x `k` weights of `qtype` at `w` (`w_len` bytes), `t` rows
/// of float32 at `x`, output `t` x `n` float32 at `y`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    py: Python<'_>,
    qtype: u32,
    w: usize,
    w_len: usize,
    n: usize,
    k: usize,
    x: usize,
    t: usize,
    y: usize,
) -> PyResult<()> {
    let qt = GgmlType::from_id(qtype).py_err()?;
    let len = t.checked_mul(k).zip(t.checked_mul(n));
    let Some((x_len, y_len)) = len else {
        return Err(crate::errors::to_py(freetoken_ggml::Error::Shape(format!(
            "{t} x {k} input overflows"
        ))));
    };
    py.detach(|| -> Result<()> {
        // SAFETY: the Python caller holds all three buffers alive for the call (memory.rs).
        let (wd, xd, yd) = unsafe {
            (
                slice::<u8>(w, w_len, "weights")?,
                slice::<f32>(x, x_len, "x")?,
                slice_mut::<f32>(y, y_len, "y")?,
            )
        };
        QuantWeight::new(wd, qt, n, k)?.matmul(&pool(), xd, yd)
    })
    .py_err()
}
