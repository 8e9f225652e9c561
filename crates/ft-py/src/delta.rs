//! One token of the gated delta rule on the CPU (`ft_cpu::delta_rule_step`).

use crate::errors::to_py;
use crate::host::{check_disjoint, Dtype, HostArray};
use freetoken_ggml::Error;
use ft_cpu::DeltaShape;
use pyo3::prelude::*;

/// One token through every head of a Gated DeltaNet layer's recurrence: `q, k [heads *
/// dk]` (the query already scaled), `v [heads * dv]`, the log decay `g [heads]` and `beta
/// [heads]`; `state [heads, dk, dv]` is updated in place and the output written to `out
/// [heads * dv]`. All float32, contiguous; `state` and `out` overlap nothing else.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    state: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let q = HostArray::input(q, Dtype::F32, "q")?;
    let k = HostArray::input(k, Dtype::F32, "k")?;
    let v = HostArray::input(v, Dtype::F32, "v")?;
    let g = HostArray::input(g, Dtype::F32, "g")?;
    let beta = HostArray::input(beta, Dtype::F32, "beta")?;
    let state = HostArray::output(state, Dtype::F32, "state")?;
    let out = HostArray::output(out, Dtype::F32, "out")?;
    let lengths = [&q, &k, &v, &g, &beta, &state, &out].map(HostArray::len);
    let shape = DeltaShape::from_lengths(lengths)
        .map_err(|e| to_py(Error::Shape(format!("delta_rule_step: {e}"))))?;
    check_disjoint(&[&state, &out], &[&q, &k, &v, &g, &beta])?;
    let (rq, rk, rv, rg, rb) = (
        q.raw::<f32>(),
        k.raw::<f32>(),
        v.raw::<f32>(),
        g.raw::<f32>(),
        beta.raw::<f32>(),
    );
    let (rs, ro) = (state.raw::<f32>(), out.raw::<f32>());
    py.detach(|| {
        // SAFETY: every array outlives the call and has the checked length; `state` and
        // `out` are writable and disjoint from each other and the inputs (checked above).
        unsafe {
            ft_cpu::delta_rule_step(
                shape,
                rq.slice(),
                rk.slice(),
                rv.slice(),
                rg.slice(),
                rb.slice(),
                rs.slice_mut(),
                ro.slice_mut(),
            )
        }
    });
    Ok(())
}
