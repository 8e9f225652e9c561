//! The process-wide CPU thread pool, sized once by `set_num_threads` (`-t`) or to the
//! machine's parallelism.

use crate::errors::IntoPy;
use ft_cpu::ThreadPool;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// Replaces the pool with one of `n` threads (the caller included) whose idle workers poll
/// for `poll_us` microseconds before they sleep.
#[pyfunction]
#[pyo3(signature = (n, poll_us=None))]
pub fn set_num_threads(n: usize, poll_us: Option<u64>) {
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(new_pool(n, poll_us)));
}

/// A pool of `n` threads (at least one) polling for `poll_us` (default: ft_cpu's).
pub fn new_pool(n: usize, poll_us: Option<u64>) -> ThreadPool {
    let poll = poll_us.map_or(ft_cpu::DEFAULT_POLL, Duration::from_micros);
    ThreadPool::with_poll(n.max(1), poll)
}

/// Threads of the current pool.
#[pyfunction]
pub fn num_threads() -> usize {
    pool().n_threads()
}

/// How long the current pool's idle workers poll, in microseconds.
#[pyfunction]
pub fn poll_us() -> u64 {
    pool().poll().as_micros() as u64
}

/// The level of the CPU kernels in use (`FREETOKEN_CPU_ISA`, or the best this host runs):
/// "avx512", "avx2" or "generic"; an unknown or unrunnable cap raises.
#[pyfunction]
pub fn cpu_kernel_isa() -> PyResult<&'static str> {
    ft_cpu::cpu_isa().map(|l| l.name()).py_err()
}
