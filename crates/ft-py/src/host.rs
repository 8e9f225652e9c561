//! Host arrays handed over from Python, checked before any slice is made.
//!
//! An array is an object exporting the buffer protocol (a numpy array, bytes, a memoryview)
//! or a torch CPU tensor, which exports none and is read through its own accessors. Each is
//! checked for its element type, C-contiguity, alignment, writability (outputs) and element
//! count; the object (or its buffer) is held by the [`HostArray`], so the memory stays
//! alive, and for a buffer unresizable, for as long as the array is.
//! Raw integer addresses cross only for device memory (`cuda.rs`).

use crate::errors::to_py;
use freetoken_ggml::Error;
use pyo3::buffer::{ElementType, PyUntypedBuffer};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The element types that cross.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    U8,
    I32,
    I64,
    F32,
    F16,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::U8 => "uint8",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
            Dtype::F32 => "float32",
            Dtype::F16 => "float16",
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F16 => 2,
            Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }

    fn of_buffer(b: &PyUntypedBuffer) -> Option<Dtype> {
        match ElementType::from_format(b.format()) {
            ElementType::UnsignedInteger { bytes: 1 } => Some(Dtype::U8),
            ElementType::SignedInteger { bytes: 4 } => Some(Dtype::I32),
            ElementType::SignedInteger { bytes: 8 } => Some(Dtype::I64),
            ElementType::Float { bytes: 4 } => Some(Dtype::F32),
            ElementType::Float { bytes: 2 } => Some(Dtype::F16),
            _ => None,
        }
    }
}

/// A Rust element type of a [`Dtype`].
pub trait Element: Copy {
    const DTYPE: Dtype;
}

impl Element for u8 {
    const DTYPE: Dtype = Dtype::U8;
}
impl Element for i32 {
    const DTYPE: Dtype = Dtype::I32;
}
impl Element for i64 {
    const DTYPE: Dtype = Dtype::I64;
}
impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl Element for ft_cpu::f16 {
    const DTYPE: Dtype = Dtype::F16;
}

/// How a buffer's element type reads in an error: numpy's names where there is one.
fn describe(b: &PyUntypedBuffer) -> String {
    match ElementType::from_format(b.format()) {
        ElementType::Float { bytes } => format!("float{}", bytes * 8),
        ElementType::SignedInteger { bytes } => format!("int{}", bytes * 8),
        ElementType::UnsignedInteger { bytes } => format!("uint{}", bytes * 8),
        ElementType::Bool => "bool".into(),
        ElementType::Unknown => format!("format {:?}", b.format()),
    }
}

/// torch's tensor type and the dtypes that cross, looked up once.
struct Torch {
    tensor: Py<PyType>,
    dtypes: [(Dtype, Py<PyAny>); 5],
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

impl Torch {
    /// The [`Dtype`] of a tensor's `dtype`, if it is one that crosses.
    fn dtype_of(&self, got: &Bound<'_, PyAny>) -> Option<Dtype> {
        self.dtypes.iter().find(|(_, d)| got.is(d)).map(|(d, _)| *d)
    }
}

fn torch(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || {
        let m = py.import("torch")?;
        let dtype = |name: &str| m.getattr(name).map(Bound::unbind);
        Ok(Torch {
            tensor: m.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            dtypes: [
                (Dtype::U8, dtype("uint8")?),
                (Dtype::I32, dtype("int32")?),
                (Dtype::I64, dtype("int64")?),
                (Dtype::F32, dtype("float32")?),
                (Dtype::F16, dtype("float16")?),
            ],
        })
    })
}

/// What keeps an array's memory alive: its buffer (released on drop) or its tensor.
type Hold = Box<dyn std::any::Any + Send + Sync>;

/// A checked host array: `len` elements of `dtype` at `addr`, held alive by this value.
pub struct HostArray {
    addr: usize,
    len: usize,
    dtype: Dtype,
    writable: bool,
    what: &'static str,
    _hold: Hold,
}

fn invalid(msg: String) -> PyErr {
    to_py(Error::InvalidInput(msg))
}

impl HostArray {
    /// `obj` as an array of `dtype` to read.
    pub fn input(obj: &Bound<'_, PyAny>, dtype: Dtype, what: &'static str) -> PyResult<Self> {
        Self::new(obj, dtype, what, false)
    }

    /// `obj` as an array of `dtype` to write.
    pub fn output(obj: &Bound<'_, PyAny>, dtype: Dtype, what: &'static str) -> PyResult<Self> {
        Self::new(obj, dtype, what, true)
    }

    /// `obj` as an array to write of whichever of `dtypes` it holds (its element type is
    /// then [`HostArray::dtype`]).
    pub fn output_of(
        obj: &Bound<'_, PyAny>,
        dtypes: &[Dtype],
        what: &'static str,
    ) -> PyResult<Self> {
        let py = obj.py();
        // SAFETY: as in `new`.
        let held = if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 {
            Dtype::of_buffer(&PyUntypedBuffer::get(obj)?)
        } else {
            let got = obj.getattr(intern!(py, "dtype")).ok();
            torch(py)
                .ok()
                .zip(got)
                .and_then(|(t, got)| t.dtype_of(&got))
        };
        match held.filter(|d| dtypes.contains(d)) {
            Some(d) => Self::new(obj, d, what, true),
            // The first type's checks say what is wrong.
            None => Self::new(obj, dtypes[0], what, true),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn new(
        obj: &Bound<'_, PyAny>,
        dtype: Dtype,
        what: &'static str,
        write: bool,
    ) -> PyResult<Self> {
        // SAFETY: `obj` is a live object; the call only reads its type's slots.
        let array = if unsafe { ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 {
            Self::of_buffer(PyUntypedBuffer::get(obj)?, dtype, what)?
        } else {
            Self::of_tensor(obj, dtype, what)?
        };
        if write && !array.writable {
            return Err(invalid(format!("{what} is read-only")));
        }
        if !array.addr.is_multiple_of(dtype.size()) {
            return Err(invalid(format!(
                "{what} is not aligned for {} (address {:#x})",
                dtype.name(),
                array.addr
            )));
        }
        Ok(array)
    }

    fn of_buffer(b: PyUntypedBuffer, dtype: Dtype, what: &'static str) -> PyResult<Self> {
        if Dtype::of_buffer(&b) != Some(dtype) || b.item_size() != dtype.size() {
            return Err(invalid(format!(
                "{what} must be {}, got {}",
                dtype.name(),
                describe(&b)
            )));
        }
        if !b.is_c_contiguous() {
            return Err(invalid(format!("{what} must be C-contiguous")));
        }
        Ok(HostArray {
            addr: b.buf_ptr() as usize,
            len: b.item_count(),
            dtype,
            writable: !b.readonly(),
            what,
            _hold: Box::new(b),
        })
    }

    fn of_tensor(obj: &Bound<'_, PyAny>, dtype: Dtype, what: &'static str) -> PyResult<Self> {
        let py = obj.py();
        let not_an_array = || {
            invalid(format!(
                "{what} must be a numpy array or a CPU torch tensor, not {}",
                obj.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        };
        let Ok(t) = torch(py) else {
            return Err(not_an_array());
        };
        if !obj.is_instance(t.tensor.bind(py))? {
            return Err(not_an_array());
        }
        let got = obj.getattr(intern!(py, "dtype"))?;
        if t.dtype_of(&got) != Some(dtype) {
            return Err(invalid(format!(
                "{what} must be {}, got {got}",
                dtype.name()
            )));
        }
        if !obj.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            return Err(invalid(format!(
                "{what} must be in host memory, got a tensor on {}",
                obj.getattr("device")?
            )));
        }
        if !obj
            .call_method0(intern!(py, "is_contiguous"))?
            .is_truthy()?
        {
            return Err(invalid(format!("{what} must be contiguous")));
        }
        Ok(HostArray {
            addr: obj.call_method0(intern!(py, "data_ptr"))?.extract()?,
            len: obj.call_method0(intern!(py, "numel"))?.extract()?,
            dtype,
            writable: true,
            what,
            _hold: Box::new(obj.clone().unbind()),
        })
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// A ShapeError unless the array has exactly `n` elements (`shape` says what they are).
    pub fn expect_len(&self, n: usize, shape: &str) -> PyResult<()> {
        if self.len != n {
            return Err(to_py(Error::Shape(format!(
                "{} has {} elements, expected {n} ({shape})",
                self.what, self.len
            ))));
        }
        Ok(())
    }

    /// A raw view of the array for code that runs after the GIL is released; the array must
    /// outlive every slice made from it.
    pub fn raw<T: Element>(&self) -> Raw<T> {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "{}: viewed as another element type",
            self.what
        );
        Raw {
            addr: self.addr,
            len: self.len,
            _t: std::marker::PhantomData,
        }
    }
}

/// An InvalidInputError when an output overlaps another array (outputs become `&mut`
/// slices). Empty arrays overlap nothing.
pub fn check_disjoint(outputs: &[&HostArray], others: &[&HostArray]) -> PyResult<()> {
    let spans = |arrays: &[&HostArray]| -> Vec<(usize, usize, &'static str)> {
        arrays
            .iter()
            .filter(|a| a.len > 0)
            .map(|a| (a.addr, a.addr + a.len * a.dtype.size(), a.what))
            .collect()
    };
    let outs = spans(outputs);
    let rest = spans(others);
    for (i, &(s, e, w)) in outs.iter().enumerate() {
        for &(s2, e2, w2) in outs[i + 1..].iter().chain(&rest) {
            if s < e2 && s2 < e {
                return Err(invalid(format!("{w} overlaps {w2}")));
            }
        }
    }
    Ok(())
}

/// A view of a checked [`HostArray`] that is `Send`, for work without the GIL.
#[derive(Debug)]
pub struct Raw<T> {
    addr: usize,
    len: usize,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T> Clone for Raw<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Raw<T> {}

impl<T> Raw<T> {
    /// The elements.
    ///
    /// # Safety
    /// The [`HostArray`] this view came from is alive for `'a`, and no `&mut` slice of the
    /// same memory exists meanwhile.
    pub unsafe fn slice<'a>(self) -> &'a [T] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: checked at construction: aligned, `len` elements, alive per the contract.
        unsafe { std::slice::from_raw_parts(self.addr as *const T, self.len) }
    }

    /// The elements, writable.
    ///
    /// # Safety
    /// As [`Raw::slice`], the array was checked writable ([`HostArray::output`]), and no other
    /// slice of the same memory exists meanwhile ([`check_disjoint`]).
    pub unsafe fn slice_mut<'a>(self) -> &'a mut [T] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above, and exclusive per the contract.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.len) }
    }

    /// Elements `start..start + n` (within the array: a ShapeError otherwise).
    pub fn sub(self, start: usize, n: usize) -> freetoken_ggml::Result<Raw<T>> {
        if start.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(Error::Shape(format!(
                "elements {start}..{} of an array of {}",
                start.saturating_add(n),
                self.len
            )));
        }
        Ok(Raw {
            addr: self.addr + start * std::mem::size_of::<T>(),
            len: n,
            _t: std::marker::PhantomData,
        })
    }

    /// The element address, for the device ABI (mapped host memory that a kernel reads).
    pub fn addr(self) -> usize {
        self.addr
    }
}
