//! Borrowed memory handed over from Python as (address, length) pairs.
//!
//! The Python layer derives each pair from an object it keeps alive for the call (a numpy
//! array, a torch tensor, bytes) after checking dtype and contiguity; here we check that the
//! address is non-null and aligned for the element type before making a slice.

use freetoken_ggml::{Error, Result};

fn check(addr: usize, len: usize, align: usize, what: &str) -> Result<()> {
    if len > 0 && (addr == 0 || !addr.is_multiple_of(align)) {
        return Err(Error::InvalidInput(format!(
            "{what}: address {addr:#x} is null or not {align}-byte aligned"
        )));
    }
    Ok(())
}

/// A shared slice of `len` elements at `addr`.
///
/// # Safety
/// The caller guarantees `addr..addr + len * size_of::<T>()` is readable memory that stays
/// alive and unmodified for `'a`.
pub unsafe fn slice<'a, T>(addr: usize, len: usize, what: &str) -> Result<&'a [T]> {
    check(addr, len, std::mem::align_of::<T>(), what)?;
    if len == 0 {
        return Ok(&[]);
    }
    Ok(std::slice::from_raw_parts(addr as *const T, len))
}

/// A mutable slice of `len` elements at `addr`.
///
/// # Safety
/// As [`slice`], and no other reference to the memory exists for `'a`.
pub unsafe fn slice_mut<'a, T>(addr: usize, len: usize, what: &str) -> Result<&'a mut [T]> {
    check(addr, len, std::mem::align_of::<T>(), what)?;
    if len == 0 {
        return Ok(&mut []);
    }
    Ok(std::slice::from_raw_parts_mut(addr as *mut T, len))
}
