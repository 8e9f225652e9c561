//! Quantization entry points: type queries, dequantize, quantize, the quantized product.

use crate::errors::{to_py, IntoPy};
use crate::host::{check_disjoint, Dtype, HostArray};
use crate::threads::pool;
use freetoken_ggml::{Error, GgmlType, Result};
use ft_cpu::QuantWeight;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A ggml type's name and block geometry, as `type_info` reports it.
#[pyclass(frozen, get_all, name = "TypeInfo")]
pub struct PyTypeInfo {
    /// The type's name ("Q4_K").
    name: String,
    /// Elements per block.
    block_size: usize,
    /// Bytes per block.
    type_size: usize,
    /// Whether weights may be stored in it (not an activation-only type).
    is_storage: bool,
    /// Whether the CPU has a dot product for it.
    has_vec_dot: bool,
    /// The activation type its dot product takes (its own id when it has none).
    vec_dot_type: u32,
    /// Whether quantizing to it needs an importance matrix.
    requires_imatrix: bool,
}

/// The name and block geometry of a type id.
#[pyfunction]
pub fn type_info(id: u32) -> PyResult<PyTypeInfo> {
    let t = GgmlType::from_id(id).py_err()?;
    let has_vec_dot = t.has_vec_dot();
    Ok(PyTypeInfo {
        name: t.name().to_string(),
        block_size: t.block_size(),
        type_size: t.type_size(),
        is_storage: t.is_storage(),
        has_vec_dot,
        vec_dot_type: if has_vec_dot {
            t.vec_dot_type().id()
        } else {
            t.id()
        },
        requires_imatrix: t.requires_imatrix(),
    })
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

/// Dequantizes `src` (uint8, whole blocks of `qtype`) into `dst` (float32, as many elements
/// as `src` holds); `dst` may not overlap `src`.
#[pyfunction]
pub fn dequantize(
    py: Python<'_>,
    qtype: u32,
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let t = GgmlType::from_id(qtype).py_err()?;
    let s = HostArray::input(src, Dtype::U8, "src")?;
    let d = HostArray::output(dst, Dtype::F32, "dst")?;
    check_disjoint(&[&d], &[&s])?;
    let (vs, vd) = (s.raw::<u8>(), d.raw::<f32>());
    // SAFETY: both arrays outlive the call; `dst` is writable and disjoint from `src`.
    py.detach(|| freetoken_ggml::dequantize(t, unsafe { vs.slice() }, unsafe { vd.slice_mut() }))
        .py_err()
}

/// Quantizes float32 `src` (rows of `n_per_row`) to `qtype`; `imatrix`: `n_per_row` float32
/// importance weights, or None.
#[pyfunction]
#[pyo3(signature = (qtype, src, n_per_row, imatrix=None))]
pub fn quantize<'py>(
    py: Python<'py>,
    qtype: u32,
    src: &Bound<'py, PyAny>,
    n_per_row: usize,
    imatrix: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let t = GgmlType::from_id(qtype).py_err()?;
    let s = HostArray::input(src, Dtype::F32, "src")?;
    let im = imatrix
        .map(|m| HostArray::input(m, Dtype::F32, "imatrix"))
        .transpose()?;
    if let Some(m) = &im {
        m.expect_len(n_per_row, "n_per_row")?;
    }
    let (vs, vim) = (s.raw::<f32>(), im.as_ref().map(HostArray::raw::<f32>));
    let out = py
        .detach(|| {
            // SAFETY: the arrays outlive the call and are only read.
            let im = vim.map(|v| unsafe { v.slice() });
            freetoken_ggml::quantize(t, unsafe { vs.slice() }, n_per_row, im)
        })
        .py_err()?;
    Ok(PyBytes::new(py, &out))
}

/// A quantized weight from Python: `(qtype, bytes, rows)`, its bytes a uint8 host array of
/// whole rows of `k` elements.
type WeightSpec<'py> = (u32, Bound<'py, PyAny>, usize);

/// y[T, N] = x[T, K] . W^T for `n` x `k` weights of `qtype` in `w` (uint8), float32 `x` of
/// `T * k` elements and `y` of `T * n`; `y` may not overlap `w` or `x`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    py: Python<'_>,
    qtype: u32,
    w: &Bound<'_, PyAny>,
    n: usize,
    k: usize,
    x: &Bound<'_, PyAny>,
    y: &Bound<'_, PyAny>,
) -> PyResult<()> {
    matmul_group(py, vec![(qtype, w.clone(), n)], k, x, vec![y.clone()])
}

/// `ys[i] = x . W_i^T` for weights `(qtype, bytes, n_i)` sharing float32 `x` (`T` rows of
/// `k`); `ys[i]` float32 of `T * n_i` elements. No output may overlap another, a weight or
/// `x`. One quantization of x per activation type and one pool dispatch for the whole group.
#[pyfunction]
pub fn matmul_group(
    py: Python<'_>,
    weights: Vec<WeightSpec<'_>>,
    k: usize,
    x: &Bound<'_, PyAny>,
    ys: Vec<Bound<'_, PyAny>>,
) -> PyResult<()> {
    if ys.len() != weights.len() {
        return Err(to_py(Error::Shape(format!(
            "{} weights but {} outputs",
            weights.len(),
            ys.len()
        ))));
    }
    if k == 0 {
        return Err(to_py(Error::Shape("rows of 0 elements".into())));
    }
    let x = HostArray::input(x, Dtype::F32, "x")?;
    let mut ws = Vec::with_capacity(weights.len());
    for (qtype, w, n) in &weights {
        let ty = GgmlType::from_id(*qtype).py_err()?;
        ws.push((ty, HostArray::input(w, Dtype::U8, "weights")?, *n));
    }
    let ys = ys
        .iter()
        .map(|y| HostArray::output(y, Dtype::F32, "y"))
        .collect::<PyResult<Vec<_>>>()?;
    let outs: Vec<&HostArray> = ys.iter().collect();
    let mut ins: Vec<&HostArray> = ws.iter().map(|w| &w.1).collect();
    ins.push(&x);
    check_disjoint(&outs, &ins)?;
    let vx = x.raw::<f32>();
    let vws: Vec<_> = ws.iter().map(|(t, w, n)| (*t, w.raw::<u8>(), *n)).collect();
    let vys: Vec<_> = ys.iter().map(HostArray::raw::<f32>).collect();
    py.detach(|| -> Result<()> {
        // SAFETY: every array outlives the call; the outputs are writable and disjoint from
        // each other and the inputs (checked above).
        let xd = unsafe { vx.slice() };
        let qws = vws
            .iter()
            .map(|&(t, w, n)| QuantWeight::new(unsafe { w.slice() }, t, n, k))
            .collect::<Result<Vec<_>>>()?;
        let mut outs: Vec<&mut [f32]> = vys.iter().map(|y| unsafe { y.slice_mut() }).collect();
        ft_cpu::matmul_group(&pool(), &qws, xd, &mut outs)
    })
    .py_err()
}
