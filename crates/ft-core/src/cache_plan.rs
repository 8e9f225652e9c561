//! Sizing the GPU expert slot pools: how many slots each pool gets out of a byte budget
//! (`--moe-cache-mib`), which layers each pool serves, and which experts to seed it with.
//!
//! Pools. With [`Scope::PerType`] (the default) layers whose experts have the same
//! (gate, up, down) types and shapes share one pool, since one pool tensor per matrix holds
//! slots of one shape; with [`Scope::PerLayer`] each layer has its own. A pool tensor must stay
//! under 2^31 blocks (ggml-cuda's MMQ/MMVQ index blocks with 32-bit integers): a pool that
//! would need more slots than that allows is split into pools of the same key, each serving
//! whole layers.
//!
//! Sizing. Every route that misses costs moving that expert's bytes from host memory (an
//! upload in `offload`, a read by the CPU in `hybrid`), so the cache should minimize the
//! expected missed bytes per token. Caching expert `e` of layer `l` saves `p(l, e) * bytes(l)`
//! per token at a cost of `bytes(l)` of budget, where `p(l, e)` is the expected routes per
//! token to it: the ratio is `p(l, e)`, whatever the pool's expert size. So the experts are
//! ranked by `p` over all layers and taken greedily while the budget lasts, after every pool
//! has first received the `top_k` slots it needs to serve one token; a pool's size is the
//! number of its layers' experts taken. Every layer gets `top_k` routes per token, so
//! `p(l, e) = top_k * (count(l, e) + 1) / (routes(l) + n_experts)`, the profile's share
//! smoothed so that a short profile that never saw an expert still leaves it a chance.
//! Without a profile (or for a layer the profile lacks) `p = top_k / n_experts`, and ties
//! are taken round-robin over layers: every layer gets the same share of its experts (to
//! within one), i.e. pools sized in proportion to layers x experts. With a profile, a layer
//! whose routes concentrate on few experts gives way to flatter ones. The experts taken are
//! also the seeds: each pool starts with its layers' hottest experts, filling it.
//!
//! If the budget holds every expert, every pool holds exactly all its layers' experts in
//! layer-then-expert order (identity placement: the `gpu` strategy, nothing ever evicted).

use crate::{Error, GgmlType, Result};
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Most blocks one pool tensor may hold: ggml-cuda indexes blocks with 32-bit integers
/// (`FT_CUDA_MAX_POOL_BLOCKS`; `cuda/include/freetoken_cuda.h` is the source of this, the
/// padding and [`pool_nbytes`], and ft-cuda's tests compare them with it).
pub const MAX_POOL_BLOCKS: usize = i32::MAX as usize;
/// ggml-cuda reads up to the next multiple of this many elements past a tensor's last row, so
/// each pool tensor carries a zeroed tail of less than one row of this many elements
/// (`FT_CUDA_ROW_PADDING`).
pub const ROW_PADDING: usize = 512;
/// Laplace smoothing of profile counts (see the module comment).
const ALPHA: f64 = 1.0;
const MIB: f64 = 1024.0 * 1024.0;

/// Bytes a pool of `n_slots` matrices of `n` rows of `k` elements needs on the GPU: the
/// matrices, then a zeroed tail covering ggml-cuda's reads past the last row (up to the next
/// multiple of [`ROW_PADDING`] elements). An error when the pool would hold 2^31 blocks or
/// more.
pub fn pool_nbytes(ty: GgmlType, k: usize, n: usize, n_slots: usize) -> Result<usize> {
    if k == 0 || n == 0 || n_slots == 0 {
        return Err(Error::Shape(format!(
            "pool shape [{n_slots}, {n}, {k}] has an empty dimension"
        )));
    }
    let row = ty.row_size(k)?;
    let blocks = (k / ty.block_size())
        .checked_mul(n)
        .and_then(|b| b.checked_mul(n_slots));
    if blocks.is_none_or(|b| b > MAX_POOL_BLOCKS) {
        return Err(Error::Shape(format!(
            "a pool of {n_slots} x {n} x {k} {ty} is 2^31 blocks or more; split it \
             (ggml-cuda indexes blocks with 32-bit integers)"
        )));
    }
    let mut bytes = row * n * n_slots;
    if !k.is_multiple_of(ROW_PADDING) {
        let bs = ty.block_size();
        let pad = (ROW_PADDING - k % ROW_PADDING).div_ceil(bs) * bs;
        bytes += ty.row_size(pad)?;
    }
    Ok(bytes)
}

/// One MoE layer as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    pub layer: usize,
    /// ggml type ids of the gate, up and down matrices.
    pub types: [u32; 3],
    /// Bytes of one expert: its gate, up and down matrices together.
    pub expert_bytes: usize,
    /// Blocks of one expert's gate, up and down matrix.
    pub blocks: [usize; 3],
    pub n_experts: usize,
    pub top_k: usize,
}

/// Whether layers with the same expert types share a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    PerType,
    PerLayer,
}

/// One slot pool: three tensors (gate, up, down) of `n_slots` expert matrices each.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolPlan {
    pub types: [u32; 3],
    pub layers: Vec<usize>,
    pub n_experts: usize,
    pub top_k: usize,
    pub expert_bytes: usize,
    pub blocks: [usize; 3],
    pub n_slots: usize,
    /// Bytes the pool takes out of the budget: its slots and its tensors' zeroed tails.
    pub bytes: usize,
    /// (layer, expert) for slots `0..residents.len()`: hottest first when seeded from a
    /// profile; every expert in layer-then-expert order when all are resident; else empty.
    pub residents: Vec<(usize, usize)>,
    /// Share of the profiled routes of this pool's layers that the residents cover.
    pub coverage: Option<f64>,
}

/// The pools, the arithmetic behind them, and a human-readable account of it.
#[derive(Debug, Clone, PartialEq)]
pub struct CachePlan {
    pub pools: Vec<PoolPlan>,
    pub budget: usize,
    /// Bytes the pools take (at most `budget`).
    pub used: usize,
    /// The smallest budget that gives every pool of this plan `top_k` slots.
    pub min_bytes: usize,
    /// Bytes of every expert of every layer (tails of this plan's pools included).
    pub all_bytes: usize,
    /// Every expert resident: the `gpu` strategy.
    pub all_resident: bool,
    pub explanation: String,
}

/// Plans the pools for `specs` within `budget` bytes. `profile[layer]` holds a layer's routes
/// per expert (empty, or shorter `profile`, for a layer without counts).
pub fn plan_pools(
    specs: &[LayerSpec],
    budget: usize,
    scope: Scope,
    profile: Option<&[Vec<u64>]>,
) -> Result<CachePlan> {
    let mut specs = specs.to_vec();
    specs.sort_by_key(|s| s.layer);
    let infos = check(&specs, profile)?;
    let counts: Vec<Vec<u64>> = specs
        .iter()
        .map(|s| match profile.and_then(|p| p.get(s.layer)) {
            Some(c) if !c.is_empty() => c.clone(),
            _ => vec![0; s.n_experts],
        })
        .collect();
    let cands = rank(&specs, &counts);
    let mut groups = initial_groups(&specs, &infos, scope);
    let n_initial = groups.len();
    let mut sizing = size(&specs, &groups, &cands, budget)?;
    // Split the pools that the block limit held back while budget remained, in halves of
    // whole layers, until none is (a split that no longer fits the budget is not made).
    loop {
        let mut split = Vec::with_capacity(groups.len());
        for (g, grp) in groups.iter().enumerate() {
            if sizing.capped[g] && grp.layers.len() > 1 {
                let (a, b) = grp.layers.split_at(grp.layers.len() / 2);
                split.push(Group::new(a.to_vec(), &specs, &infos));
                split.push(Group::new(b.to_vec(), &specs, &infos));
            } else {
                split.push(grp.clone());
            }
        }
        if split.len() == groups.len() {
            break;
        }
        match size(&specs, &split, &cands, budget) {
            Ok(s) => (groups, sizing) = (split, s),
            Err(_) => break,
        }
    }
    let ctx = Ctx {
        specs: &specs,
        counts: &counts,
        cands: &cands,
        scope,
        profiled: profile.is_some(),
        n_initial,
    };
    Ok(ctx.build(&groups, &sizing, budget))
}

/// Per spec: the largest number of slots a pool tensor of its experts may hold, and the
/// bytes of a pool's three zeroed tails.
#[derive(Clone, Copy)]
struct Info {
    max_slots: usize,
    tail: usize,
}

fn check(specs: &[LayerSpec], profile: Option<&[Vec<u64>]>) -> Result<Vec<Info>> {
    if specs.is_empty() {
        return Err(Error::InvalidInput(
            "no MoE layers to plan a cache for".into(),
        ));
    }
    let mut infos = Vec::with_capacity(specs.len());
    for (i, s) in specs.iter().enumerate() {
        let l = s.layer;
        if i > 0 && specs[i - 1].layer == l {
            return Err(Error::InvalidInput(format!("layer {l} is listed twice")));
        }
        if s.n_experts == 0 || s.top_k == 0 || s.top_k > s.n_experts {
            return Err(Error::InvalidInput(format!(
                "layer {l}: top-k {} of {} experts",
                s.top_k, s.n_experts
            )));
        }
        let types = s.types.map(GgmlType::from_id);
        let mut bytes = 0usize;
        let mut tail = 0;
        for (t, &b) in types.into_iter().zip(&s.blocks) {
            let t = t?;
            if b == 0 {
                return Err(Error::Shape(format!(
                    "layer {l}: an expert matrix of 0 blocks"
                )));
            }
            bytes = b
                .checked_mul(t.type_size())
                .and_then(|m| m.checked_add(bytes))
                .ok_or_else(|| Error::Shape(format!("layer {l}: expert size overflows")))?;
            tail += t.row_size(ROW_PADDING.div_ceil(t.block_size()) * t.block_size())?;
        }
        if bytes != s.expert_bytes {
            return Err(Error::InvalidInput(format!(
                "layer {l}: {} bytes per expert given, but its blocks make {bytes}",
                s.expert_bytes
            )));
        }
        let max_slots = MAX_POOL_BLOCKS / s.blocks.iter().max().copied().unwrap_or(1);
        if max_slots < s.top_k {
            return Err(Error::Shape(format!(
                "layer {l}: {} experts of {:?} blocks exceed 2^31 blocks in one pool tensor",
                s.top_k, s.blocks
            )));
        }
        if let Some(c) = profile.and_then(|p| p.get(l)) {
            if !c.is_empty() && c.len() != s.n_experts {
                return Err(Error::Shape(format!(
                    "layer {l}: the profile has {} counts for {} experts",
                    c.len(),
                    s.n_experts
                )));
            }
        }
        infos.push(Info { max_slots, tail });
    }
    Ok(infos)
}

/// One candidate expert: `value` is its expected routes per token; `rank` its place in its
/// layer, hottest first.
struct Cand {
    value: f64,
    rank: usize,
    spec: usize,
    expert: usize,
}

/// Every expert of every layer, in the order the greedy takes them: by value, then round-robin
/// over layers (rank, then layer). Within a layer this is rank order, so what a layer has
/// taken is always a prefix of its ranking.
fn rank(specs: &[LayerSpec], counts: &[Vec<u64>]) -> Vec<Cand> {
    let mut cands = Vec::with_capacity(specs.iter().map(|s| s.n_experts).sum());
    for (si, (s, c)) in specs.iter().zip(counts).enumerate() {
        let routes: u64 = c.iter().sum();
        let denom = routes as f64 + ALPHA * s.n_experts as f64;
        let mut order: Vec<usize> = (0..s.n_experts).collect();
        order.sort_by_key(|&e| (Reverse(c[e]), e));
        for (rank, e) in order.into_iter().enumerate() {
            let value = s.top_k as f64 * (c[e] as f64 + ALPHA) / denom;
            cands.push(Cand {
                value,
                rank,
                spec: si,
                expert: e,
            });
        }
    }
    cands.sort_by(|a, b| {
        b.value
            .total_cmp(&a.value)
            .then(a.rank.cmp(&b.rank))
            .then(a.spec.cmp(&b.spec))
    });
    cands
}

/// Layers (spec indices, ascending) served by one pool.
#[derive(Clone)]
struct Group {
    layers: Vec<usize>,
    bytes: usize,
    top_k: usize,
    n_experts: usize,
    cap: usize,
    tail: usize,
}

impl Group {
    fn new(layers: Vec<usize>, specs: &[LayerSpec], infos: &[Info]) -> Group {
        let s = &specs[layers[0]];
        let all = layers.len() * s.n_experts;
        Group {
            bytes: s.expert_bytes,
            top_k: s.top_k,
            n_experts: s.n_experts,
            cap: all.min(infos[layers[0]].max_slots),
            tail: infos[layers[0]].tail,
            layers,
        }
    }
}

/// What layers sharing a pool must agree on: types, blocks per matrix, experts, top-k.
type PoolKey = ([u32; 3], [usize; 3], usize, usize);

fn initial_groups(specs: &[LayerSpec], infos: &[Info], scope: Scope) -> Vec<Group> {
    let mut keyed: BTreeMap<PoolKey, Vec<usize>> = BTreeMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        match scope {
            Scope::PerLayer => groups.push(vec![i]),
            Scope::PerType => keyed
                .entry((s.types, s.blocks, s.n_experts, s.top_k))
                .or_default()
                .push(i),
        }
    }
    groups.extend(keyed.into_values());
    // Pools in the order of their first layer.
    groups.sort_by_key(|layers| layers[0]);
    groups
        .into_iter()
        .map(|layers| Group::new(layers, specs, infos))
        .collect()
}

struct Sizing {
    taken: Vec<usize>, // per spec: its experts taken (a prefix of its ranking)
    slots: Vec<usize>, // per group
    capped: Vec<bool>, // per group: the block limit refused an expert the budget allowed
    used: usize,
    min: usize,
}

fn min_bytes(groups: &[Group]) -> usize {
    groups.iter().map(|g| g.top_k * g.bytes + g.tail).sum()
}

fn size(specs: &[LayerSpec], groups: &[Group], cands: &[Cand], budget: usize) -> Result<Sizing> {
    let min = min_bytes(groups);
    if min > budget {
        let top_k = groups.iter().map(|g| g.top_k).max().unwrap_or(0);
        return Err(Error::InvalidInput(format!(
            "an expert cache of {:.1} MiB is too small: its {} pool(s) need at least {} MiB \
             (top-k = {top_k} experts each, to serve one token)",
            budget as f64 / MIB,
            groups.len(),
            min.div_ceil(1 << 20)
        )));
    }
    let mut group_of = vec![0; specs.len()];
    for (g, grp) in groups.iter().enumerate() {
        for &s in &grp.layers {
            group_of[s] = g;
        }
    }
    let mut taken = vec![0; specs.len()];
    let mut slots = vec![0; groups.len()];
    let mut capped = vec![false; groups.len()];
    // Each pool's top-k slots, already paid for in `min`: its best experts.
    for c in cands {
        let g = group_of[c.spec];
        if slots[g] < groups[g].top_k {
            taken[c.spec] += 1;
            slots[g] += 1;
        }
    }
    let mut left = budget - min;
    for c in cands {
        if c.rank < taken[c.spec] {
            continue;
        }
        let (g, grp) = (group_of[c.spec], &groups[group_of[c.spec]]);
        if slots[g] >= grp.cap {
            capped[g] |= left >= grp.bytes && slots[g] < grp.layers.len() * grp.n_experts;
        } else if grp.bytes <= left {
            debug_assert_eq!(c.rank, taken[c.spec]);
            taken[c.spec] += 1;
            slots[g] += 1;
            left -= grp.bytes;
        }
    }
    Ok(Sizing {
        taken,
        slots,
        capped,
        used: budget - left,
        min,
    })
}

/// What the plan's report needs besides the sizing.
struct Ctx<'a> {
    specs: &'a [LayerSpec],
    counts: &'a [Vec<u64>],
    cands: &'a [Cand],
    scope: Scope,
    profiled: bool,
    n_initial: usize,
}

impl Ctx<'_> {
    fn build(&self, groups: &[Group], sizing: &Sizing, budget: usize) -> CachePlan {
        let (specs, counts) = (self.specs, self.counts);
        let all_resident = groups
            .iter()
            .zip(&sizing.slots)
            .all(|(g, &n)| n == g.layers.len() * g.n_experts);
        let mut pools = Vec::with_capacity(groups.len());
        for (g, grp) in groups.iter().enumerate() {
            let residents: Vec<(usize, usize)> = if all_resident {
                let layers = grp.layers.iter().map(|&s| specs[s].layer);
                layers
                    .flat_map(|l| (0..grp.n_experts).map(move |e| (l, e)))
                    .collect()
            } else if self.profiled {
                self.cands
                    .iter()
                    .filter(|c| grp.layers.contains(&c.spec) && c.rank < sizing.taken[c.spec])
                    .map(|c| (specs[c.spec].layer, c.expert))
                    .collect()
            } else {
                Vec::new()
            };
            let routes: u64 = grp
                .layers
                .iter()
                .map(|&s| counts[s].iter().sum::<u64>())
                .sum();
            let covered: u64 = residents
                .iter()
                .map(|&(l, e)| counts[specs.partition_point(|s| s.layer < l)][e])
                .sum();
            let s = &specs[grp.layers[0]];
            pools.push(PoolPlan {
                types: s.types,
                layers: grp.layers.iter().map(|&i| specs[i].layer).collect(),
                n_experts: grp.n_experts,
                top_k: grp.top_k,
                expert_bytes: grp.bytes,
                blocks: s.blocks,
                n_slots: sizing.slots[g],
                bytes: sizing.slots[g] * grp.bytes + grp.tail,
                residents,
                coverage: (self.profiled && routes > 0).then(|| covered as f64 / routes as f64),
            });
        }
        let all_bytes = specs
            .iter()
            .map(|s| s.n_experts * s.expert_bytes)
            .sum::<usize>()
            + groups.iter().map(|g| g.tail).sum::<usize>();
        let mut plan = CachePlan {
            pools,
            budget,
            used: sizing.used,
            min_bytes: sizing.min,
            all_bytes,
            all_resident,
            explanation: String::new(),
        };
        plan.explanation = self.explain(&plan, groups);
        plan
    }

    fn explain(&self, plan: &CachePlan, groups: &[Group]) -> String {
        let mut s = String::new();
        let scope = match self.scope {
            Scope::PerType => "one pool per expert type (gate/up/down)",
            Scope::PerLayer => "one pool per layer",
        };
        let unprofiled = self
            .counts
            .iter()
            .filter(|c| c.iter().all(|&n| n == 0))
            .count();
        let how = match (self.profiled, unprofiled) {
            (false, _) => "equally (no profile): the same share of every layer's experts".into(),
            (true, 0) => "from the profile: hottest experts first over all layers".into(),
            (true, n) => format!(
                "from the profile: hottest experts first over all layers ({n} layer(s) \
                 without counts taken as uniform)"
            ),
        };
        let _ = writeln!(
            s,
            "MoE expert cache: budget {} for {} MoE layers, {scope}, sized {how}",
            mib(plan.budget),
            self.specs.len()
        );
        let _ = writeln!(
            s,
            "  every expert: {}; minimum: {} (top-k slots per pool)",
            mib(plan.all_bytes),
            mib(plan.min_bytes)
        );
        if plan.all_resident {
            let _ = writeln!(
                s,
                "  the budget holds every expert: all resident, slot = layer's place in the \
                 pool x experts + expert (gpu strategy)"
            );
        }
        for (i, (p, g)) in plan.pools.iter().zip(groups).enumerate() {
            let all = g.layers.len() * g.n_experts;
            let _ = writeln!(
                s,
                "  pool {i}: {} layer{} {}: {} per expert ({:?} blocks); {} slots of {all} \
                 experts ({:.1}%) = {}",
                type_names(p.types),
                if p.layers.len() == 1 { "" } else { "s" },
                ranges(&p.layers),
                mib(p.expert_bytes),
                p.blocks,
                p.n_slots,
                100.0 * p.n_slots as f64 / all as f64,
                mib(p.bytes)
            );
            if g.cap < all {
                let _ = writeln!(
                    s,
                    "    at most {} slots per pool tensor (2^31 blocks)",
                    g.cap
                );
            }
            if let Some(c) = p.coverage.filter(|_| !plan.all_resident) {
                let _ = writeln!(
                    s,
                    "    seeded with its {} hottest experts: {:.1}% of its layers' profiled \
                     routes",
                    p.residents.len(),
                    100.0 * c
                );
            }
        }
        if plan.pools.len() > self.n_initial {
            let _ = writeln!(
                s,
                "  split into {} pools of whole layers (instead of {}) to stay under 2^31 \
                 blocks per tensor",
                plan.pools.len(),
                self.n_initial
            );
        }
        let _ = write!(
            s,
            "  total: {} slots, {} of {} used, {} left",
            plan.pools.iter().map(|p| p.n_slots).sum::<usize>(),
            mib(plan.used),
            mib(plan.budget),
            mib(plan.budget - plan.used)
        );
        if !plan.all_resident {
            s.push_str(" (less than one more expert of any pool with room)");
        }
        s
    }
}

fn mib(bytes: usize) -> String {
    let m = bytes as f64 / MIB;
    if m < 10.0 {
        format!("{m:.2} MiB")
    } else {
        format!("{m:.1} MiB")
    }
}

/// "0-3, 5, 7-9".
fn ranges(layers: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

fn type_names(types: [u32; 3]) -> String {
    let name = |t| GgmlType::from_id(t).map_or("?", |t| t.name());
    format!("{}/{}/{}", name(types[0]), name(types[1]), name(types[2]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_bytes_include_the_zeroed_tail() {
        // Q4_0: 32 elements in 18 bytes. K = 768 leaves 256 elements to the next 512.
        let row = 768 / 32 * 18;
        assert_eq!(
            pool_nbytes(GgmlType::Q4_0, 768, 4, 2).unwrap(),
            row * 8 + 256 / 32 * 18
        );
        // K a multiple of 512: no tail.
        assert_eq!(
            pool_nbytes(GgmlType::Q8_0, 1024, 3, 5).unwrap(),
            1024 / 32 * 34 * 15
        );
        // Q4_K: 256-element blocks; K = 256 pads by 256.
        assert_eq!(
            pool_nbytes(GgmlType::Q4_K, 256, 1, 1).unwrap(),
            2 * GgmlType::Q4_K.type_size()
        );
    }

    #[test]
    fn pool_limits() {
        assert!(matches!(
            pool_nbytes(GgmlType::Q4_0, 100, 1, 1),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            pool_nbytes(GgmlType::Q4_0, 4096, 4096, 4096),
            Err(Error::Shape(m)) if m.contains("2^31")
        ));
        // Just under the limit is fine: 2^31 - 128 blocks.
        assert!(pool_nbytes(GgmlType::Q8_0, 32 * 128, 1 << 16, (1 << 8) - 1).is_ok());
        assert!(matches!(
            pool_nbytes(GgmlType::Q4_0, 0, 1, 1),
            Err(Error::Shape(_))
        ));
    }

    const Q4_0: u32 = 2; // 32 elements in 18 bytes
    const Q8_0: u32 = 8; // 32 elements in 34 bytes

    /// A layer of gate/up `[n, k]` and down `[k, n]` experts of one type.
    fn spec(layer: usize, ty: u32, blocks: usize, n_experts: usize, top_k: usize) -> LayerSpec {
        let ts = if ty == Q4_0 { 18 } else { 34 };
        LayerSpec {
            layer,
            types: [ty; 3],
            expert_bytes: 3 * blocks * ts,
            blocks: [blocks; 3],
            n_experts,
            top_k,
        }
    }

    /// A pool's three zeroed tails: 512 elements of each matrix.
    fn tail(ty: u32) -> usize {
        3 * 16 * if ty == Q4_0 { 18 } else { 34 }
    }

    #[test]
    fn equal_sizing_shares_one_pool_per_type() {
        let specs: Vec<_> = (0..4).map(|l| spec(l, Q4_0, 100, 8, 2)).collect();
        let e = specs[0].expert_bytes;
        let p = plan_pools(&specs, tail(Q4_0) + 20 * e + e / 2, Scope::PerType, None).unwrap();
        assert_eq!(p.pools.len(), 1);
        assert_eq!(p.pools[0].n_slots, 20);
        assert_eq!(p.pools[0].layers, [0, 1, 2, 3]);
        assert!(p.pools[0].residents.is_empty());
        assert_eq!(p.used, tail(Q4_0) + 20 * e);
        assert!(!p.all_resident);
        // Per layer: 4 pools, 5 slots each.
        let p = plan_pools(&specs, 4 * tail(Q4_0) + 20 * e, Scope::PerLayer, None).unwrap();
        let n: Vec<_> = p.pools.iter().map(|p| p.n_slots).collect();
        assert_eq!(n, [5, 5, 5, 5]);
    }

    #[test]
    fn equal_sizing_gives_every_type_the_same_share() {
        let specs = [
            spec(0, Q4_0, 100, 8, 2),
            spec(1, Q8_0, 100, 8, 2),
            spec(2, Q4_0, 100, 8, 2),
            spec(3, Q8_0, 100, 8, 2),
        ];
        let (e4, e8) = (specs[0].expert_bytes, specs[1].expert_bytes);
        let budget = tail(Q4_0) + tail(Q8_0) + 8 * e4 + 8 * e8;
        let p = plan_pools(&specs, budget, Scope::PerType, None).unwrap();
        assert_eq!(p.pools.len(), 2);
        assert_eq!((p.pools[0].types, p.pools[0].n_slots), ([Q4_0; 3], 8));
        assert_eq!(
            (p.pools[1].layers.clone(), p.pools[1].n_slots),
            (vec![1, 3], 8)
        );
        assert_eq!(p.used, budget);
    }

    #[test]
    fn too_small_a_budget_says_how_much_is_needed() {
        let specs: Vec<_> = (0..2).map(|l| spec(l, Q8_0, 1 << 16, 8, 4)).collect();
        let min = tail(Q8_0) + 4 * specs[0].expert_bytes;
        let err = plan_pools(&specs, min - 1, Scope::PerType, None).unwrap_err();
        let want = format!("at least {} MiB", min.div_ceil(1 << 20));
        assert!(
            matches!(&err, Error::InvalidInput(m) if m.contains(&want)),
            "{err:?}"
        );
        let p = plan_pools(&specs, min, Scope::PerType, None).unwrap();
        assert_eq!((p.pools[0].n_slots, p.min_bytes), (4, min));
    }

    #[test]
    fn profile_takes_the_hottest_experts_over_all_layers() {
        let specs: Vec<_> = (0..2).map(|l| spec(l, Q4_0, 100, 8, 2)).collect();
        let e = specs[0].expert_bytes;
        let profile = vec![vec![100, 0, 0, 0, 0, 0, 0, 50], vec![10; 8]];
        let budget = 2 * tail(Q4_0) + 6 * e;
        let p = plan_pools(&specs, budget, Scope::PerLayer, Some(&profile)).unwrap();
        // Layer 0's two experts carry all its routes; layer 1 is flat, so it gets the rest.
        assert_eq!(p.pools[0].residents, [(0, 0), (0, 7)]);
        assert_eq!(p.pools[1].residents, [(1, 0), (1, 1), (1, 2), (1, 3)]);
        assert_eq!(p.pools[0].coverage, Some(1.0));
        assert_eq!(p.pools[1].coverage, Some(0.5));
        let p = plan_pools(&specs, tail(Q4_0) + 6 * e, Scope::PerType, Some(&profile)).unwrap();
        assert_eq!(p.pools[0].n_slots, 6);
        assert_eq!(p.pools[0].residents[..2], [(0, 0), (0, 7)]);
    }

    #[test]
    fn pools_split_under_two_to_the_31_blocks() {
        // 10 experts per pool tensor at most.
        let b = 200_000_000;
        let specs: Vec<_> = (0..4).map(|l| spec(l, Q8_0, b, 8, 2)).collect();
        let e = specs[0].expert_bytes;
        let p = plan_pools(&specs, 4 * tail(Q8_0) + 32 * e, Scope::PerType, None).unwrap();
        assert!(p.all_resident);
        let layers: Vec<_> = p.pools.iter().map(|p| p.layers.clone()).collect();
        assert_eq!(layers, [[0], [1], [2], [3]]);
        for pool in &p.pools {
            assert!(pool.n_slots * b <= MAX_POOL_BLOCKS);
        }
        // 18 experts, round-robin over layers: 5 + 5 + 4 + 4, two pools of two layers.
        let p = plan_pools(&specs, 2 * tail(Q8_0) + 18 * e, Scope::PerType, None).unwrap();
        let n: Vec<_> = p
            .pools
            .iter()
            .map(|p| (p.layers.len(), p.n_slots))
            .collect();
        assert_eq!(n, [(2, 10), (2, 8)]);
        assert!(
            p.explanation.contains("split into 2 pools"),
            "{}",
            p.explanation
        );
        // A layer alone over the limit: one pool capped at 10 slots.
        let one = [spec(0, Q8_0, b, 16, 2)];
        let p = plan_pools(&one, tail(Q8_0) + 16 * e, Scope::PerType, None).unwrap();
        assert_eq!(p.pools[0].n_slots, 10);
        assert!(!p.all_resident);
    }

    #[test]
    fn a_budget_for_every_expert_places_them_all() {
        let specs = [spec(3, Q4_0, 10, 4, 2), spec(5, Q4_0, 10, 4, 2)];
        let all = tail(Q4_0) + 8 * specs[0].expert_bytes;
        let p = plan_pools(&specs, all, Scope::PerType, None).unwrap();
        assert!(p.all_resident && p.all_bytes == all);
        let want: Vec<_> = [3, 5]
            .iter()
            .flat_map(|&l| (0..4).map(move |e| (l, e)))
            .collect();
        assert_eq!(p.pools[0].residents, want);
        assert!(p.explanation.contains("every expert: all resident"));
        let p = plan_pools(&specs, all - 1, Scope::PerType, None).unwrap();
        assert!(!p.all_resident && p.pools[0].n_slots == 7);
    }

    #[test]
    fn bad_specs_are_refused() {
        let good = spec(0, Q4_0, 10, 4, 2);
        let mut bytes = good.clone();
        bytes.expert_bytes += 1;
        let mut k = good.clone();
        k.top_k = 5;
        let mut ty = good.clone();
        ty.types[1] = 4; // a removed type id
        for specs in [
            vec![bytes],
            vec![k],
            vec![good.clone(), good.clone()],
            vec![ty],
            vec![],
        ] {
            assert!(plan_pools(&specs, 1 << 30, Scope::PerType, None).is_err());
        }
        let profile = vec![vec![1, 2, 3]];
        assert!(plan_pools(&[good], 1 << 30, Scope::PerType, Some(&profile)).is_err());
    }

    #[test]
    fn ranges_read_well() {
        assert_eq!(ranges(&[0, 1, 2, 3, 5, 7, 8]), "0-3, 5, 7-8");
    }
}
