//! The process-wide CPU thread pool, sized once by `set_num_threads` (`-t`) or to the
//! machine's parallelism.

use ft_cpu::ThreadPool;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

static POOL: Mutex<Option<Arc<ThreadPool>>> = Mutex::new(None);

/// The shared pool, created on first use.
pub fn pool() -> Arc<ThreadPool> {
    let mut slot = POOL.lock().unwrap_or_else(|e| e.into_inner());
    slot.get_or_insert_with(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        Arc::new(ThreadPool::new(n))
    })
    .clone()
}

/// Replaces the pool with one of `n` threads (the caller included).
#[pyfunction]
pub fn set_num_threads(n: usize) {
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(ThreadPool::new(n.max(1))));
}

/// Threads of the current pool.
#[pyfunction]
pub fn num_threads() -> usize {
    pool().n_threads()
}
