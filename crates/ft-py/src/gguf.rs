//! The mapped GGUF file: metadata as Python values, tensors as (address, length) views that
//! the Python layer wraps zero-copy and ties to this object's lifetime.

use crate::errors::IntoPy;
use ft_core::gguf::{GgufFile, Value};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::IntoPyObjectExt;
use std::sync::Arc;

#[pyclass(frozen, name = "GGUFFile")]
pub struct PyGgufFile {
    pub(crate) inner: Arc<GgufFile>,
}

fn to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    match v {
        Value::U64(x) => x.into_py_any(py),
        Value::I64(x) => x.into_py_any(py),
        Value::F64(x) => x.into_py_any(py),
        Value::Bool(x) => x.into_py_any(py),
        Value::Str(s) => s.into_py_any(py),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            list.into_py_any(py)
        }
    }
}

#[pymethods]
impl PyGgufFile {
    /// Parses and maps `path` (the first part of a split model opens every part); with
    /// `mmap=False` the data is then read into anonymous memory backed by huge pages where the
    /// kernel allows (`GgufFile::read_into_memory`), calling `progress(done, total)` per chunk.
    #[new]
    #[pyo3(signature = (path, mmap=true, progress=None))]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        mmap: bool,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let mut inner = py.detach(|| GgufFile::open(&path)).py_err()?;
        if !mmap {
            // The GIL stays held for the progress calls; nothing else runs during a load.
            let mut failed = None;
            inner
                .read_into_memory(|done, total| {
                    if let (Some(cb), None) = (&progress, &failed) {
                        failed = cb.call1(py, (done, total)).err();
                    }
                })
                .py_err()?;
            if let Some(e) = failed {
                return Err(e);
            }
        }
        Ok(PyGgufFile {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn version(&self) -> u32 {
        self.inner.version()
    }

    #[getter]
    fn paths(&self) -> Vec<String> {
        self.inner
            .paths()
            .iter()
            .map(|p| p.display().to_string())
            .collect()
    }

    /// Every metadata key and value, in file order.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.inner.metadata() {
            d.set_item(k, to_py(py, v)?)?;
        }
        Ok(d)
    }

    /// (name, shape in numpy order, type id, bytes) for every tensor, in file order.
    fn tensors(&self) -> Vec<(String, Vec<usize>, u32, usize)> {
        self.inner
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), t.ggml_type.id(), t.nbytes))
            .collect()
    }

    /// (address, length) of a tensor's bytes in the mapping; valid while this object lives.
    fn tensor_address(&self, name: &str) -> PyResult<(usize, usize)> {
        let t = self.inner.tensor(name).py_err()?;
        let data = self.inner.data(t);
        Ok((data.as_ptr() as usize, data.len()))
    }
}
