//! freetoken._core: thin pyo3 glue over the core crates. Host arrays cross through the buffer
//! protocol (or as CPU torch tensors) and are checked here (`host.rs`); raw addresses cross
//! only for device memory. The GIL is released around all compute.

mod attend;
mod cuda;
mod delta;
mod errors;
mod gguf;
mod host;
mod moe;
mod pack;
mod quant;
mod slots;
mod threads;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<gguf::PyGgufFile>()?;
    m.add_class::<gguf::MappedBytes>()?;
    m.add_class::<gguf::PyTensorInfo>()?;
    m.add_class::<moe::PyMoeCounters>()?;
    m.add_class::<moe::PyLayerCounts>()?;
    m.add_class::<moe::PyExpertMatrices>()?;
    m.add_class::<moe::PyMoeLayer>()?;
    m.add_class::<moe::PyMoeExecutor>()?;
    m.add_class::<moe::PyMoeTicket>()?;
    m.add_class::<quant::PyTypeInfo>()?;
    m.add_class::<quant::PyQuantWeight>()?;
    m.add_function(wrap_pyfunction!(quant::type_info, m)?)?;
    m.add_function(wrap_pyfunction!(quant::type_from_name, m)?)?;
    m.add_function(wrap_pyfunction!(quant::type_ids, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant::matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant::matmul_group, m)?)?;
    m.add_function(wrap_pyfunction!(attend::attend_one, m)?)?;
    m.add_function(wrap_pyfunction!(attend::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(delta::delta_rule_step, m)?)?;
    m.add_function(wrap_pyfunction!(threads::set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(threads::num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(threads::poll_us, m)?)?;
    m.add_function(wrap_pyfunction!(threads::cpu_kernel_isa, m)?)?;
    cuda::register(m)?;
    slots::register(m)?;
    Ok(())
}
