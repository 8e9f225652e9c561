//! The mapped GGUF file: metadata as Python values, tensors as read-only buffers over the
//! mapping that the Python layer wraps zero-copy.

use crate::errors::IntoPy;
use ft_core::gguf::{GgufFile, Value};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::IntoPyObjectExt;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

/// One tensor of a GGUF file.
#[pyclass(frozen, get_all, name = "TensorInfo")]
pub struct PyTensorInfo {
    /// The tensor's name.
    name: String,
    /// Its shape in numpy order (the row last).
    shape: Vec<usize>,
    /// Its ggml type id.
    qtype: u32,
    /// Its size in bytes.
    nbytes: usize,
}

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

    /// Every tensor, in file order.
    fn tensors(&self) -> Vec<PyTensorInfo> {
        self.inner
            .tensors()
            .iter()
            .map(|t| PyTensorInfo {
                name: t.name.clone(),
                shape: t.shape.clone(),
                qtype: t.ggml_type.id(),
                nbytes: t.nbytes,
            })
            .collect()
    }

    /// A tensor's bytes in the mapping, as a read-only buffer that keeps the mapping alive.
    fn tensor_data(&self, name: &str) -> PyResult<MappedBytes> {
        let t = self.inner.tensor(name).py_err()?;
        let data = self.inner.data(t);
        Ok(MappedBytes {
            file: Arc::clone(&self.inner),
            addr: data.as_ptr() as usize,
            len: data.len(),
        })
    }
}

/// Bytes of a mapped GGUF file, exported read-only through the buffer protocol
/// (`numpy.frombuffer`, `memoryview`); holds the mapping while it or a view of it lives.
#[pyclass(frozen, name = "MappedBytes")]
pub struct MappedBytes {
    #[allow(dead_code)] // held: the mapping must outlive every exported view
    file: Arc<GgufFile>,
    addr: usize,
    len: usize,
}

#[pymethods]
impl MappedBytes {
    fn __len__(&self) -> usize {
        self.len
    }

    /// # Safety
    /// Called by Python's buffer protocol with a view to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (addr, len) = (slf.get().addr, slf.get().len);
        let len = isize::try_from(len).expect("a mapping is smaller than isize::MAX");
        // SAFETY: `view` is the caller's; the bytes stay mapped while `slf` (which the view
        // references) lives; read-only, so a writable request fails with BufferError.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(view, slf.as_ptr(), addr as *mut c_void, len, 1, flags)
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}
