//! The one place where Rust errors become `freetoken.errors` exceptions.

use freetoken_ggml::Error;
use pyo3::prelude::*;

fn class_name(e: &Error) -> &'static str {
    match e {
        Error::Unsupported(_) => "UnsupportedError",
        Error::Shape(_) => "ShapeError",
        Error::InvalidInput(_) => "InvalidInputError",
        Error::Gguf(_) => "GGUFError",
        Error::Io(_) => "FileAccessError",
        Error::OutOfMemory(_) => "OutOfMemoryError",
        Error::Device(_) => "DeviceError",
    }
}

/// The `freetoken.errors` exception for `e`.
pub fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let class = py
            .import("freetoken.errors")
            .and_then(|m| m.getattr(class_name(&e)));
        match class {
            Ok(class) => match class.call1((e.message(),)) {
                Ok(exc) => PyErr::from_value(exc),
                Err(err) => err,
            },
            Err(err) => err,
        }
    })
}

/// `Result` for pyfunctions, with the error already mapped.
pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for freetoken_ggml::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
