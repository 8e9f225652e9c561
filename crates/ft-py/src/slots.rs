//! The GPU expert slot cache's bookkeeping and the pool plan (`freetoken.engine.slots` wraps
//! them): thin glue over ft-core. Route ids and slots cross as (address, length) pairs of int32
//! arrays that the Python layer has checked for dtype and contiguity and keeps alive for the
//! call. No GIL release: a call is microseconds of bookkeeping.

use crate::errors::IntoPy;
use crate::memory::{slice, slice_mut};
use freetoken_ggml::{Error, Result};
use ft_core::cache_plan::{self, LayerSpec, Scope};
use ft_core::slot_policy::Policy;
use ft_core::slots::{SlotCache, SlotStats, Upload};
use pyo3::prelude::*;

/// Registers this module's class and function on `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySlotCache>()?;
    m.add_function(wrap_pyfunction!(plan_pools, m)?)?;
    Ok(())
}

/// (layer, expert, slot, evicted (layer, expert) or None).
type PyUpload = (usize, usize, usize, Option<(usize, usize)>);
/// (calls, hits, misses, uploads, evictions).
type PyStats = (u64, u64, u64, u64, u64);

fn upload(u: Upload) -> PyUpload {
    (u.layer, u.expert, u.slot, u.evicted)
}

fn stats(s: SlotStats) -> PyStats {
    (s.calls, s.hits, s.misses, s.uploads, s.evictions)
}

/// The ids and the output slots of one call, which may not overlap (the output becomes a
/// mutable slice).
///
/// # Safety
/// As [`slice`] and [`slice_mut`]: live int32 buffers of the stated lengths.
unsafe fn routes<'a>(
    ids: usize,
    n_ids: usize,
    out: usize,
    n_out: usize,
) -> Result<(&'a [i32], &'a mut [i32])> {
    if n_ids > 0 && n_out > 0 && ids < out + n_out * 4 && out < ids + n_ids * 4 {
        return Err(Error::InvalidInput(
            "the slots output overlaps the ids".into(),
        ));
    }
    Ok((slice(ids, n_ids, "ids")?, slice_mut(out, n_out, "slots")?))
}

/// The bookkeeping of one slot pool, LRU or adaptive.
#[pyclass(name = "SlotCache")]
pub struct PySlotCache {
    inner: SlotCache,
}

#[pymethods]
impl PySlotCache {
    #[new]
    #[pyo3(signature = (n_slots, n_experts, policy="lru", half_life=None, margin=None))]
    fn new(
        n_slots: usize,
        n_experts: usize,
        policy: &str,
        half_life: Option<f64>,
        margin: Option<f64>,
    ) -> PyResult<Self> {
        let policy = Policy::from_name(policy, half_life, margin).py_err()?;
        Ok(PySlotCache {
            inner: SlotCache::with_policy(n_slots, n_experts, policy).py_err()?,
        })
    }

    /// "lru" or "adaptive".
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy().name()
    }

    /// The adaptive policy's (half_life, margin); None under LRU.
    #[getter]
    fn policy_params(&self) -> Option<(f64, f64)> {
        match self.inner.policy() {
            Policy::Lru => None,
            Policy::Adaptive { half_life, margin } => Some((half_life, margin)),
        }
    }

    #[getter]
    fn n_slots(&self) -> usize {
        self.inner.n_slots()
    }

    #[getter]
    fn n_experts(&self) -> usize {
        self.inner.n_experts()
    }

    /// Offload placement of one call's routes; returns the uploads.
    fn place(
        &mut self,
        layer: usize,
        ids: usize,
        n_ids: usize,
        n_used: usize,
        out: usize,
        n_out: usize,
    ) -> PyResult<Vec<PyUpload>> {
        // SAFETY: the Python wrapper passes live, contiguous int32 arrays of these lengths.
        let (ids, out) = unsafe { routes(ids, n_ids, out, n_out) }.py_err()?;
        let uploads = self.inner.place(layer, ids, n_used, out).py_err()?;
        Ok(uploads.into_iter().map(upload).collect())
    }

    /// Hybrid lookup of one call's routes; returns the routes that hit.
    fn lookup(
        &mut self,
        layer: usize,
        ids: usize,
        n_ids: usize,
        n_used: usize,
        out: usize,
        n_out: usize,
    ) -> PyResult<usize> {
        // SAFETY: as in `place`.
        let (ids, out) = unsafe { routes(ids, n_ids, out, n_out) }.py_err()?;
        self.inner.lookup(layer, ids, n_used, out).py_err()
    }

    fn insert(&mut self, layer: usize, expert: usize) -> PyResult<Option<PyUpload>> {
        Ok(self.inner.insert(layer, expert).py_err()?.map(upload))
    }

    fn admit(
        &mut self,
        layer: usize,
        experts: Vec<usize>,
        max_uploads: usize,
    ) -> PyResult<Vec<PyUpload>> {
        let uploads = self.inner.admit(layer, &experts, max_uploads).py_err()?;
        Ok(uploads.into_iter().map(upload).collect())
    }

    fn score(&self, layer: usize, expert: usize) -> Option<f64> {
        self.inner.score(layer, expert)
    }

    fn scores(&self, layer: usize) -> Option<Vec<f64>> {
        self.inner.scores(layer)
    }

    #[pyo3(signature = (residents, rates=None))]
    fn seed(
        &mut self,
        residents: Vec<(usize, usize)>,
        rates: Option<Vec<f64>>,
    ) -> PyResult<Vec<PyUpload>> {
        let uploads = self
            .inner
            .seed_with_rates(&residents, rates.as_deref())
            .py_err()?;
        Ok(uploads.into_iter().map(upload).collect())
    }

    fn split_tokens(
        &self,
        ids: usize,
        n_ids: usize,
        n_used: usize,
    ) -> PyResult<Vec<(usize, usize)>> {
        // SAFETY: as in `place`.
        let ids = unsafe { slice::<i32>(ids, n_ids, "ids") }.py_err()?;
        self.inner.split_tokens(ids, n_used).py_err()
    }

    fn slot_of(&self, layer: usize, expert: usize) -> Option<usize> {
        self.inner.slot_of(layer, expert)
    }

    fn residents(&self) -> Vec<Option<(usize, usize)>> {
        self.inner.residents()
    }

    fn recency(&self) -> Vec<usize> {
        self.inner.recency()
    }

    fn stats(&self, layer: usize) -> PyStats {
        stats(self.inner.stats(layer))
    }

    fn all_stats(&self) -> Vec<(usize, PyStats)> {
        let all = self.inner.all_stats();
        all.into_iter().map(|(l, s)| (l, stats(s))).collect()
    }

    fn reset_stats(&mut self) {
        self.inner.reset_stats();
    }

    fn clear(&mut self) {
        self.inner.clear();
    }
}

/// (types, layers, n_experts, top_k, expert_bytes, blocks, n_slots, bytes, residents,
/// coverage).
type PyPool = (
    [u32; 3],
    Vec<usize>,
    usize,
    usize,
    usize,
    [usize; 3],
    usize,
    usize,
    Vec<(usize, usize)>,
    Option<f64>,
);

/// (layer, types, expert_bytes, blocks, n_experts, top_k).
type PyLayer = (usize, [u32; 3], usize, [usize; 3], usize, usize);
/// (pools, used, min_bytes, all_bytes, all_resident, explanation).
type PyPlan = (Vec<PyPool>, usize, usize, usize, bool, String);

/// Plans the slot pools. `layers`: (layer, types, expert_bytes, blocks, n_experts, top_k);
/// `scope`: "type" or "per-layer"; `profile[layer]`: routes per expert (empty for none).
/// Returns (pools, used, min_bytes, all_bytes, all_resident, explanation).
#[pyfunction]
#[pyo3(signature = (layers, budget, scope, profile=None))]
fn plan_pools(
    layers: Vec<PyLayer>,
    budget: usize,
    scope: &str,
    profile: Option<Vec<Vec<u64>>>,
) -> PyResult<PyPlan> {
    let scope = match scope {
        "type" => Scope::PerType,
        "per-layer" => Scope::PerLayer,
        other => {
            return Err(Error::InvalidInput(format!(
                "cache scope `{other}` is not `type` or `per-layer`"
            )))
            .py_err()
        }
    };
    let specs: Vec<LayerSpec> = layers
        .into_iter()
        .map(
            |(layer, types, expert_bytes, blocks, n_experts, top_k)| LayerSpec {
                layer,
                types,
                expert_bytes,
                blocks,
                n_experts,
                top_k,
            },
        )
        .collect();
    let plan = cache_plan::plan_pools(&specs, budget, scope, profile.as_deref()).py_err()?;
    let pools = plan
        .pools
        .into_iter()
        .map(|p| {
            (
                p.types,
                p.layers,
                p.n_experts,
                p.top_k,
                p.expert_bytes,
                p.blocks,
                p.n_slots,
                p.bytes,
                p.residents,
                p.coverage,
            )
        })
        .collect();
    Ok((
        pools,
        plan.used,
        plan.min_bytes,
        plan.all_bytes,
        plan.all_resident,
        plan.explanation,
    ))
}
