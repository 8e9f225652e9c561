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

/// The ids of every type this build knows, in id order.
#[pyfunction]
pub fn type_ids() -> Vec<u32> {
    GgmlType::ALL.iter().map(|t| t.id()).collect()
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

/// `ys[i] = x . W_i^T` for weights `(qtype, address, bytes, n)` sharing `t` rows of `k`
/// float32 at `x`; `ys[i]` addresses `t * n_i` float32. One quantization of x per activation
/// type and one pool dispatch for the whole group.
#[pyfunction]
pub fn matmul_group(
    py: Python<'_>,
    weights: Vec<(u32, usize, usize, usize)>,
    k: usize,
    x: usize,
    t: usize,
    ys: Vec<usize>,
) -> PyResult<()> {
    let types = weights
        .iter()
        .map(|w| GgmlType::from_id(w.0))
        .collect::<Result<Vec<_>>>()
        .py_err()?;
    let x_len = t.checked_mul(k).ok_or_else(|| {
        crate::errors::to_py(freetoken_ggml::Error::Shape(format!("{t} x {k} overflows")))
    })?;
    if ys.len() != weights.len() {
        return Err(crate::errors::to_py(freetoken_ggml::Error::Shape(format!(
            "{} weights but {} outputs",
            weights.len(),
            ys.len()
        ))));
    }
    py.detach(|| -> Result<()> {
        // SAFETY: the Python caller holds every buffer alive for the call (memory.rs).
        let xd = unsafe { slice::<f32>(x, x_len, "x")? };
        let mut qws = Vec::with_capacity(weights.len());
        let mut outs = Vec::with_capacity(weights.len());
        let mut y_lens = Vec::with_capacity(ys.len());
        let mut ranges = vec![(x, x_len * 4)];
        for (&(_, _, _, n), &y) in weights.iter().zip(&ys) {
            let y_len = t
                .checked_mul(n)
                .ok_or_else(|| freetoken_ggml::Error::Shape(format!("{t} x {n} overflows")))?;
            y_lens.push(y_len);
            ranges.push((y, y_len * 4));
        }
        // Outputs become &mut slices: none may overlap another or the input.
        ranges.sort_unstable();
        if ranges.windows(2).any(|p| p[0].0 + p[0].1 > p[1].0) {
            return Err(freetoken_ggml::Error::InvalidInput(
                "matmul_group outputs overlap each other or the input".into(),
            ));
        }
        for (i, &(_, addr, len, n)) in weights.iter().enumerate() {
            let wd = unsafe { slice::<u8>(addr, len, "weights")? };
            qws.push(QuantWeight::new(wd, types[i], n, k)?);
            outs.push(unsafe { slice_mut::<f32>(ys[i], y_lens[i], "y")? });
        }
        ft_cpu::matmul_group(&pool(), &qws, xd, &mut outs)
    })
    .py_err()
}
