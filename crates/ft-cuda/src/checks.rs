//! Argument checks shared by the calls: pools, token counts, strides, addresses, slot ids.

use crate::{pool_nbytes, Handoff};
use freetoken_ggml::{Error, GgmlType, Result};

/// A hand-off's counter and block: non-null and 8-byte aligned (the library checks that the
/// block is mapped host memory).
pub(crate) fn check_handoff(h: &Handoff) -> Result<()> {
    for (what, a) in [("counter", h.counter), ("block", h.block)] {
        if a == 0 || !a.is_multiple_of(8) {
            return Err(Error::InvalidInput(format!(
                "hand-off {what}: address {a:#x} is null or not 8-byte aligned"
            )));
        }
    }
    Ok(())
}

pub(crate) fn check_pool(
    what: &str,
    ty: GgmlType,
    k: usize,
    n: usize,
    n_slots: usize,
    addr: usize,
    bytes: usize,
) -> Result<()> {
    if !ty.is_storage() {
        return Err(Error::Unsupported(format!(
            "{what}: {ty} is an activation type"
        )));
    }
    let need = pool_nbytes(ty, k, n, n_slots).map_err(|e| match e {
        Error::Shape(m) => Error::Shape(format!("{what}: {m}")),
        e => e,
    })?;
    if bytes < need {
        return Err(Error::Shape(format!(
            "{what}: {bytes} bytes for {n_slots} x {n} x {k} {ty}; it needs {need} \
             (the matrices and a zeroed tail)"
        )));
    }
    check_addrs(&[(what, addr)])
}

pub(crate) fn check_tokens(what: &str, n_tokens: usize, n_used: usize, width: usize) -> Result<()> {
    if n_tokens == 0 || n_used == 0 {
        return Err(Error::Shape(format!(
            "{what}: n_tokens={n_tokens} and n_used={n_used} must be positive"
        )));
    }
    let elems = n_tokens
        .checked_mul(n_used)
        .and_then(|e| e.checked_mul(width));
    if elems.is_none_or(|e| e > i32::MAX as usize) {
        return Err(Error::Shape(format!(
            "{what}: {n_tokens} tokens x {n_used} slots x {width} is 2^31 elements or more; \
             split the batch"
        )));
    }
    Ok(())
}

/// Whether `n_rows` rows `row_stride` floats apart hold `width` floats each and stay within
/// the kernels' 32-bit element offsets.
pub(crate) fn strided_rows_fit(n_rows: usize, row_stride: usize, width: usize) -> bool {
    row_stride >= width
        && n_rows
            .checked_mul(row_stride)
            .is_some_and(|t| t <= i32::MAX as usize)
}

pub(crate) fn check_addrs(addrs: &[(&str, usize)]) -> Result<()> {
    for &(what, a) in addrs {
        if a == 0 || !a.is_multiple_of(4) {
            return Err(Error::InvalidInput(format!(
                "{what}: device address {a:#x} is null or not 4-byte aligned"
            )));
        }
    }
    Ok(())
}

/// Checks host-side slot ids (`[n_tokens, n_used]`, row-major): each in `[0, n_slots)` and
/// distinct within its token. A token naming one slot twice makes MMQ produce non-finite
/// output (llama.cpp #24591), so callers that build ids on the host check them here for free.
pub fn check_ids(ids: &[i32], n_used: usize, n_slots: usize) -> Result<()> {
    if n_used == 0 || !ids.len().is_multiple_of(n_used) {
        return Err(Error::Shape(format!(
            "{} ids are not a whole number of tokens of {n_used}",
            ids.len()
        )));
    }
    for (t, row) in ids.chunks_exact(n_used).enumerate() {
        for (i, &s) in row.iter().enumerate() {
            if s < 0 || s as usize >= n_slots {
                return Err(Error::InvalidInput(format!(
                    "token {t}: slot id {s} is outside [0, {n_slots})"
                )));
            }
            if row[..i].contains(&s) {
                return Err(Error::InvalidInput(format!(
                    "token {t}: names slot {s} twice (each token's slots must be distinct)"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ids_are_checked() {
        assert!(check_ids(&[0, 1, 2, 2, 1, 0], 3, 3).is_ok());
        let dup = check_ids(&[0, 1, 2, 3, 3, 0], 3, 4).unwrap_err();
        assert!(
            matches!(&dup, Error::InvalidInput(m) if m.contains("token 1") && m.contains("twice"))
        );
        assert!(matches!(
            check_ids(&[0, 4], 2, 4),
            Err(Error::InvalidInput(m)) if m.contains("outside")
        ));
        assert!(matches!(
            check_ids(&[0, -1], 2, 4),
            Err(Error::InvalidInput(_))
        ));
        assert!(matches!(check_ids(&[0, 1, 2], 2, 4), Err(Error::Shape(_))));
    }

    #[test]
    fn token_limits() {
        assert!(check_tokens("t", 1, 8, 2048).is_ok());
        assert!(check_tokens("t", 0, 8, 2048).is_err());
        assert!(check_tokens("t", 1 << 16, 8, 1 << 13).is_err());
    }

    #[test]
    fn addresses_are_checked() {
        assert!(check_addrs(&[("x", 0x1000)]).is_ok());
        assert!(matches!(
            check_addrs(&[("x", 0)]),
            Err(Error::InvalidInput(m)) if m.starts_with("x:")
        ));
        assert!(check_addrs(&[("y", 0x1002)]).is_err());
    }
}
