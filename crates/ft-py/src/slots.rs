//! The GPU expert slot cache's bookkeeping and the pool plan (`freetoken.engine.slots` wraps
//! them): thin glue over ft-core. Route ids and slots cross as int32 host arrays (`host.rs`).
//! No GIL release: a call is microseconds of bookkeeping.

use crate::errors::IntoPy;
use crate::host::{check_disjoint, Dtype, HostArray};
use freetoken_ggml::Error;
use ft_core::cache_plan::{self, LayerSpec, Scope};
use ft_core::slot_policy::Policy;
use ft_core::slots::{SlotCache, SlotStats, Upload};
use pyo3::prelude::*;

/// Registers this module's class and function on `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySlotCache>()?;
    m.add_class::<PyAdaptiveParams>()?;
    m.add_class::<PyUpload>()?;
    m.add_class::<PyStats>()?;
    m.add_class::<PyPoolPlan>()?;
    m.add_class::<PyCachePlan>()?;
    m.add_function(wrap_pyfunction!(plan_pools, m)?)?;
    Ok(())
}

/// The adaptive policy's parameters: scores halve over `half_life` tokens, and a candidate
/// replaces a slot's expert when its score beats the held one's by `margin`.
#[pyclass(frozen, get_all, name = "AdaptiveParams")]
pub struct PyAdaptiveParams {
    half_life: f64,
    margin: f64,
}

/// An expert to copy into `slot` before the GPU reads it; `evicted` is the (layer, expert)
/// the slot held before, if any.
#[pyclass(frozen, get_all, name = "Upload")]
pub struct PyUpload {
    layer: usize,
    expert: usize,
    slot: usize,
    evicted: Option<(usize, usize)>,
}

fn upload(u: Upload) -> PyUpload {
    PyUpload {
        layer: u.layer,
        expert: u.expert,
        slot: u.slot,
        evicted: u.evicted,
    }
}

/// One layer's slot counters (`ft_core::slots::SlotStats`).
#[pyclass(frozen, get_all, name = "SlotStats")]
pub struct PyStats {
    calls: u64,
    hits: u64,
    misses: u64,
    uploads: u64,
    evictions: u64,
}

fn stats(s: SlotStats) -> PyStats {
    PyStats {
        calls: s.calls,
        hits: s.hits,
        misses: s.misses,
        uploads: s.uploads,
        evictions: s.evictions,
    }
}

/// The ids (int32, read) and the output slots (int32, written, not overlapping the ids) of
/// one call, checked.
fn routes(ids: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<(HostArray, HostArray)> {
    let ids = HostArray::input(ids, Dtype::I32, "ids")?;
    let out = HostArray::output(out, Dtype::I32, "slots")?;
    check_disjoint(&[&out], &[&ids])?;
    Ok((ids, out))
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

    /// The adaptive policy's parameters; None under LRU.
    #[getter]
    fn policy_params(&self) -> Option<PyAdaptiveParams> {
        match self.inner.policy() {
            Policy::Lru => None,
            Policy::Adaptive { half_life, margin } => Some(PyAdaptiveParams { half_life, margin }),
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

    /// Offload placement of one call's routes `ids` (int32 `[T, n_used]`) into `out` (int32,
    /// one slot per route); returns the uploads.
    fn place(
        &mut self,
        layer: usize,
        ids: &Bound<'_, PyAny>,
        n_used: usize,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<PyUpload>> {
        let (ids, out) = routes(ids, out)?;
        // SAFETY: both arrays live through the call (the GIL is held); `out` is writable and
        // disjoint from `ids`.
        let (ids, out) = unsafe { (ids.raw::<i32>().slice(), out.raw::<i32>().slice_mut()) };
        let uploads = self.inner.place(layer, ids, n_used, out).py_err()?;
        Ok(uploads.into_iter().map(upload).collect())
    }

    /// Hybrid lookup of one call's routes (as `place`); returns the routes that hit.
    fn lookup(
        &mut self,
        layer: usize,
        ids: &Bound<'_, PyAny>,
        n_used: usize,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let (ids, out) = routes(ids, out)?;
        // SAFETY: as in `place`.
        let (ids, out) = unsafe { (ids.raw::<i32>().slice(), out.raw::<i32>().slice_mut()) };
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

    fn split_tokens(&self, ids: &Bound<'_, PyAny>, n_used: usize) -> PyResult<Vec<(usize, usize)>> {
        let ids = HostArray::input(ids, Dtype::I32, "ids")?;
        // SAFETY: the array lives through the call and is only read.
        let ids = unsafe { ids.raw::<i32>().slice() };
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

/// One planned slot pool (`ft_core::cache_plan::PoolPlan`).
#[pyclass(frozen, get_all, name = "PoolPlan")]
pub struct PyPoolPlan {
    types: [u32; 3],
    layers: Vec<usize>,
    n_experts: usize,
    top_k: usize,
    expert_bytes: usize,
    blocks: [usize; 3],
    n_slots: usize,
    bytes: usize,
    residents: Vec<(usize, usize)>,
    coverage: Option<f64>,
}

/// The planned pools and the arithmetic behind them (`ft_core::cache_plan::CachePlan`).
#[pyclass(frozen, get_all, name = "CachePlan")]
pub struct PyCachePlan {
    pools: Vec<Py<PyPoolPlan>>,
    used: usize,
    min_bytes: usize,
    all_bytes: usize,
    all_resident: bool,
    explanation: String,
}

/// (layer, types, expert_bytes, blocks, n_experts, top_k).
type PyLayer = (usize, [u32; 3], usize, [usize; 3], usize, usize);

/// Plans the slot pools. `layers`: (layer, types, expert_bytes, blocks, n_experts, top_k);
/// `scope`: "type" or "per-layer"; `profile[layer]`: routes per expert (empty for none).
#[pyfunction]
#[pyo3(signature = (layers, budget, scope, profile=None))]
fn plan_pools(
    py: Python<'_>,
    layers: Vec<PyLayer>,
    budget: usize,
    scope: &str,
    profile: Option<Vec<Vec<u64>>>,
) -> PyResult<PyCachePlan> {
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
            Py::new(
                py,
                PyPoolPlan {
                    types: p.types,
                    layers: p.layers,
                    n_experts: p.n_experts,
                    top_k: p.top_k,
                    expert_bytes: p.expert_bytes,
                    blocks: p.blocks,
                    n_slots: p.n_slots,
                    bytes: p.bytes,
                    residents: p.residents,
                    coverage: p.coverage,
                },
            )
        })
        .collect::<PyResult<_>>()?;
    Ok(PyCachePlan {
        pools,
        used: plan.used,
        min_bytes: plan.min_bytes,
        all_bytes: plan.all_bytes,
        all_resident: plan.all_resident,
        explanation: plan.explanation,
    })
}
