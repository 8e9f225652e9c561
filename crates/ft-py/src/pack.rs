//! Weights packed for the CPU kernels from a mapped file, the mapping's pages dropped run by
//! run as they are copied (so the process never holds both copies of a matrix whole).

use freetoken_ggml::{GgmlType, Result};
use ft_core::gguf::{GgufFile, PAGE};
use ft_cpu::{PackedRows, ThreadPool};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// `data` (whole `n` x `k` matrices of `t`) packed on `pool` where the kernels in use pack
/// `t` (None where they do not), each copied run's pages dropped from `file`'s mapping
/// (`data` must lie inside it; no file: nothing dropped), all but the partial pages at
/// `data`'s two ends; and the bytes dropped.
pub(crate) fn pack_releasing(
    pool: &ThreadPool,
    file: Option<&GgufFile>,
    data: &[u8],
    t: GgmlType,
    n: usize,
    k: usize,
) -> Result<(Option<PackedRows>, usize)> {
    let Some(file) = file else {
        return Ok((PackedRows::new(pool, data, t, n, k)?, 0));
    };
    file.check_mapped(data)?;
    let released = AtomicUsize::new(0);
    let failed = Mutex::new(None);
    let base = data.as_ptr() as usize;
    // Each run drops from the page boundary at or before its start (inside `data`), so the
    // page that two runs share goes with the later one.
    let released_run = |run: &[u8]| {
        let start = run.as_ptr() as usize;
        let from = (start / PAGE * PAGE).max(base) - base;
        file.release(&data[from..start - base + run.len()])
    };
    let packed = PackedRows::new_then(pool, data, t, n, k, &|run| match released_run(run) {
        Ok(bytes) => {
            released.fetch_add(bytes, Ordering::Relaxed);
        }
        Err(e) => {
            failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(e);
        }
    })?;
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    Ok((packed, released.into_inner()))
}
