//! Permanent MoE counters (not a debug switch): routes, distinct experts and expert weight
//! bytes read, per layer, cumulative and for the last step; and routes per expert, the
//! expert-use statistics that profiles are made from.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Default)]
struct LayerCounters {
    steps: AtomicU64,
    routes: AtomicU64,
    experts: AtomicU64,
    bytes: AtomicU64,
    last_routes: AtomicU64,
    last_experts: AtomicU64,
    last_bytes: AtomicU64,
    per_expert: Mutex<Vec<u64>>,
}

/// Per-layer MoE counters, updated lock-free by the executors.
pub struct MoeCounters {
    layers: Vec<LayerCounters>,
}

/// A snapshot of one layer's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerSnapshot {
    pub steps: u64,
    pub routes: u64,
    pub experts: u64,
    pub bytes: u64,
    pub last_routes: u64,
    pub last_experts: u64,
    pub last_bytes: u64,
}

impl MoeCounters {
    /// Counters for `n_layers` layers, all zero.
    pub fn new(n_layers: usize) -> MoeCounters {
        MoeCounters {
            layers: (0..n_layers).map(|_| LayerCounters::default()).collect(),
        }
    }

    /// Layers counted.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Records one step of `layer`.
    pub fn record(&self, layer: usize, routes: u64, experts: u64, bytes: u64) {
        if let Some(c) = self.layers.get(layer) {
            c.steps.fetch_add(1, Ordering::Relaxed);
            c.routes.fetch_add(routes, Ordering::Relaxed);
            c.experts.fetch_add(experts, Ordering::Relaxed);
            c.bytes.fetch_add(bytes, Ordering::Relaxed);
            c.last_routes.store(routes, Ordering::Relaxed);
            c.last_experts.store(experts, Ordering::Relaxed);
            c.last_bytes.store(bytes, Ordering::Relaxed);
        }
    }

    /// Adds one step's routes (expert ids, already checked in range) to `layer`'s per-expert
    /// use counts; ids outside `0..n_experts` (-1, a route the executor skipped) are not
    /// counted.
    pub fn record_routes(&self, layer: usize, ids: &[i32], n_experts: usize) {
        if let Some(c) = self.layers.get(layer) {
            let mut counts = c.per_expert.lock().unwrap_or_else(|e| e.into_inner());
            if counts.len() < n_experts {
                counts.resize(n_experts, 0);
            }
            for &id in ids {
                if let Some(n) = counts.get_mut(id as usize) {
                    *n += 1;
                }
            }
        }
    }

    /// Adds per-expert route counts gathered elsewhere (on the GPU, where routes are counted
    /// on the device and read back now and then) to `layer`'s, and their sum to its routes.
    pub fn add_expert_counts(&self, layer: usize, counts: &[u64]) {
        if let Some(c) = self.layers.get(layer) {
            let mut per = c.per_expert.lock().unwrap_or_else(|e| e.into_inner());
            if per.len() < counts.len() {
                per.resize(counts.len(), 0);
            }
            for (p, n) in per.iter_mut().zip(counts) {
                *p += n;
            }
            c.routes
                .fetch_add(counts.iter().sum::<u64>(), Ordering::Relaxed);
        }
    }

    /// Routes per expert, per layer, since the start (empty for layers never run).
    pub fn expert_counts(&self) -> Vec<Vec<u64>> {
        self.layers
            .iter()
            .map(|c| {
                c.per_expert
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
            })
            .collect()
    }

    /// Every layer's counters.
    pub fn snapshot(&self) -> Vec<LayerSnapshot> {
        self.layers
            .iter()
            .map(|c| LayerSnapshot {
                steps: c.steps.load(Ordering::Relaxed),
                routes: c.routes.load(Ordering::Relaxed),
                experts: c.experts.load(Ordering::Relaxed),
                bytes: c.bytes.load(Ordering::Relaxed),
                last_routes: c.last_routes.load(Ordering::Relaxed),
                last_experts: c.last_experts.load(Ordering::Relaxed),
                last_bytes: c.last_bytes.load(Ordering::Relaxed),
            })
            .collect()
    }
}
