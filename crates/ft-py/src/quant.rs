//! Quantization entry points: type queries, dequantize, quantize, the quantized product.

use crate::errors::{to_py, IntoPy};
use crate::gguf::PyGgufFile;
use crate::host::{check_disjoint, Dtype, HostArray};
use crate::pack::pack_releasing;
use crate::threads::pool;
use freetoken_ggml::{Error, GgmlType, Result};
use ft_cpu::{PackedRows, QuantWeight};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::OnceLock;

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

/// A quantized weight matrix over host bytes: `n` rows of `k` elements of `qtype`, its size
/// checked once here, its bytes held (and their buffer kept exported) while it lives; once
/// packed, the products read the packed copy.
#[pyclass(frozen, name = "QuantWeight")]
pub struct PyQuantWeight {
    ty: GgmlType,
    bytes: HostArray,
    n: usize,
    k: usize,
    packed: OnceLock<PackedRows>,
}

impl PyQuantWeight {
    /// # Safety
    /// `self` outlives the returned weight.
    unsafe fn weight<'a>(&self) -> Result<QuantWeight<'a>> {
        let data: &[u8] = match self.packed.get() {
            // SAFETY: the packed copy lives as long as `self`, which outlives the view.
            Some(p) => unsafe { &*std::ptr::from_ref(p.matrix(0)) },
            // SAFETY: the held array outlives the view per the contract; it is only read.
            None => unsafe { self.bytes.raw::<u8>().slice() },
        };
        QuantWeight::new(data, self.ty, self.n, self.k)
    }
}

#[pymethods]
impl PyQuantWeight {
    /// `raw`: uint8 host bytes of exactly `n` rows of `k` elements of `qtype`.
    #[new]
    fn new(qtype: u32, raw: &Bound<'_, PyAny>, n: usize, k: usize) -> PyResult<Self> {
        let w = PyQuantWeight {
            ty: GgmlType::from_id(qtype).py_err()?,
            bytes: HostArray::input(raw, Dtype::U8, "weights")?,
            n,
            k,
            packed: OnceLock::new(),
        };
        // SAFETY: `w` is alive for the check.
        unsafe { w.weight() }.py_err()?;
        Ok(w)
    }

    /// Rows (output features).
    #[getter]
    fn n(&self) -> usize {
        self.n
    }

    /// Row length (input features).
    #[getter]
    fn k(&self) -> usize {
        self.k
    }

    /// Packs the rows for the CPU kernels in use where they read a packed layout faster
    /// (AVX2: Q4_0, Q8_0, Q4_K), for engines whose products of this weight all run on the
    /// CPU; later products read the copy. With `mapping`, the file whose mapping holds the
    /// bytes, their pages are dropped as they are copied (an error if the bytes are not in
    /// it). Returns whether the weight is packed and the mapped bytes dropped.
    #[pyo3(signature = (mapping=None))]
    fn pack(&self, py: Python<'_>, mapping: Option<&PyGgufFile>) -> PyResult<(bool, usize)> {
        let mut released = 0;
        if self.packed.get().is_none() {
            // SAFETY: the held array outlives the call; it is only read.
            let data = unsafe { self.bytes.raw::<u8>().slice() };
            let file = mapping.map(|m| &*m.inner);
            let (made, dropped) = py
                .detach(|| pack_releasing(&pool(), file, data, self.ty, self.n, self.k))
                .py_err()?;
            released = dropped;
            if let Some(p) = made {
                // Two callers packing at once: the first copy stays, the other is dropped.
                let _ = self.packed.set(p);
            }
        }
        Ok((self.packed.get().is_some(), released))
    }

    /// Whether the products read a packed copy (`pack`).
    #[getter]
    fn packed(&self) -> bool {
        self.packed.get().is_some()
    }
}

/// y[T, n] = x[T, k] . W^T for float32 `x` of `T * k` elements and `y` of `T * n`; `y` may not
/// overlap the weight's bytes or `x`.
#[pyfunction]
pub fn matmul(
    py: Python<'_>,
    weight: Bound<'_, PyQuantWeight>,
    x: &Bound<'_, PyAny>,
    y: &Bound<'_, PyAny>,
) -> PyResult<()> {
    matmul_group(py, vec![weight], x, vec![y.clone()])
}

/// `ys[i] = x . W_i^T` for weights sharing their `k` and float32 `x` (`T` rows of `k`); `ys[i]`
/// float32 of `T * n_i` elements. No output may overlap another, a weight or `x`. One
/// quantization of x per activation type and one pool dispatch for the whole group.
#[pyfunction]
pub fn matmul_group(
    py: Python<'_>,
    weights: Vec<Bound<'_, PyQuantWeight>>,
    x: &Bound<'_, PyAny>,
    ys: Vec<Bound<'_, PyAny>>,
) -> PyResult<()> {
    if ys.len() != weights.len() || weights.is_empty() {
        return Err(to_py(Error::Shape(format!(
            "{} weights and {} outputs: one output per weight, at least one",
            weights.len(),
            ys.len()
        ))));
    }
    let k = weights[0].get().k;
    if let Some(w) = weights.iter().find(|w| w.get().k != k) {
        return Err(to_py(Error::Shape(format!(
            "weights of rows of {k} and {} elements share one input",
            w.get().k
        ))));
    }
    let x = HostArray::input(x, Dtype::F32, "x")?;
    let ys = ys
        .iter()
        .map(|y| HostArray::output(y, Dtype::F32, "y"))
        .collect::<PyResult<Vec<_>>>()?;
    let outs: Vec<&HostArray> = ys.iter().collect();
    let mut ins: Vec<&HostArray> = weights.iter().map(|w| &w.get().bytes).collect();
    ins.push(&x);
    check_disjoint(&outs, &ins)?;
    let vx = x.raw::<f32>();
    let ws: Vec<&PyQuantWeight> = weights.iter().map(Bound::get).collect();
    let vys: Vec<_> = ys.iter().map(HostArray::raw::<f32>).collect();
    py.detach(|| -> Result<()> {
        // SAFETY: every array and weight outlives the call; the outputs are writable and
        // disjoint from each other and the inputs (checked above).
        let xd = unsafe { vx.slice() };
        let qws = ws
            .iter()
            .map(|w| unsafe { w.weight() })
            .collect::<Result<Vec<_>>>()?;
        let mut outs: Vec<&mut [f32]> = vys.iter().map(|y| unsafe { y.slice_mut() }).collect();
        ft_cpu::matmul_group(&pool(), &qws, xd, &mut outs)
    })
    .py_err()
}
