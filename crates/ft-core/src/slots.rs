//! The GPU expert slot cache's bookkeeping for one slot pool: which (layer, expert) sits in
//! which slot, which resident to evict (least recently used, or the adaptive policy of
//! [`crate::slot_policy`], chosen at construction), and the uploads a call needs. Nothing here
//! touches a GPU; the engine performs the uploads this module asks for.
//!
//! Two ways to use a pool:
//! - `offload`: [`SlotCache::place`] gives every expert of a call a slot, uploading the misses
//!   on the critical path.
//! - `hybrid`: [`SlotCache::lookup`] says which routes hit (the GPU runs them; the CPU the
//!   misses); then, off the critical path, [`SlotCache::admit`] picks which missed experts to
//!   upload and which residents they replace. It never evicts an expert that the latest
//!   `lookup` or `place` of any layer of the pool named (the current step, which may still be
//!   running). Under [`Policy::Lru`] every miss is admitted (up to the caller's cap), evicting
//!   the least recently used; under [`Policy::Adaptive`] only misses whose aged route count
//!   beats the coldest resident's. Both `lookup` and `place` count every route for the
//!   adaptive scores, hits and misses alike.
//!
//! Data structures, and why:
//! - Expert ids are small dense integers, so each layer the pool has seen gets a dense row of
//!   `n_experts` entries (its experts' slots): no hashing per route, and a whole model's table
//!   is tiny (94 layers x 256 experts x 8 bytes is under 200 KB).
//! - Recency is an intrusive doubly linked list over slot indices (`prev`/`next` arrays):
//!   touching a slot and evicting the least recently used one are O(1), with no heap or scan.
//! - Each call removes duplicate experts with a generation stamp per expert instead of
//!   clearing a set, so a call costs O(routes) to check and O(distinct experts) to place.
//!   A second stamp per expert and one per layer (`mark`, `last_call`) remember what each
//!   layer's latest successful call named: what `admit` must not evict.
//! - The adaptive policy adds a score per expert and a min-heap over the slots
//!   ([`crate::slot_policy`]): a hit or an upload costs O(log n_slots) more, and finding the
//!   coldest resident O(1) (more only when protected residents are the coldest).
//!
//! Order within one call (the reference the tests check against): the call's distinct experts
//! are taken in order of first appearance; hits are touched first, in that order; then each
//! miss takes the lowest-numbered free slot, else the least recently used slot, and becomes the
//! most recently used. Since every hit of the call was touched before any eviction and every
//! placed miss is at the recent end, the least recently used slot is never one this call named
//! while the call has at most `n_slots` distinct experts (checked first): a slot is never given
//! to two experts in one call, and a token (whose top-k ids are distinct, also checked) never
//! names one slot twice, the guard ggml-cuda's MMQ needs (llama.cpp #24591). Under the
//! adaptive policy a miss takes the lowest free slot, else the slot with the lowest score
//! (ties: least recently used) among those the call does not name: the same guarantees.

use crate::slot_policy::{admits, Policy, Scores, SlotHeap};
use crate::{Error, Result};
use std::collections::HashMap;

const NONE: u32 = u32::MAX;

/// One expert the caller must copy into a slot before the GPU reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upload {
    pub layer: usize,
    pub expert: usize,
    pub slot: usize,
    /// The (layer, expert) that held the slot before, if any.
    pub evicted: Option<(usize, usize)>,
}

/// One layer's counters. `hits` and `misses` count distinct experts per call (an expert named
/// by several tokens of one call is read or computed once, so that is the unit of work);
/// `uploads` counts experts copied into slots (misses of `place`, `insert`, `seed`);
/// `evictions` counts this layer's experts pushed out (by any layer's call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotStats {
    pub calls: u64,
    pub hits: u64,
    pub misses: u64,
    pub uploads: u64,
    pub evictions: u64,
}

/// The slot bookkeeping of one pool of `n_slots` slots shared by any number of layers whose
/// experts are numbered `0..n_experts`.
#[derive(Debug, Clone)]
pub struct SlotCache {
    n_slots: usize,
    n_experts: usize,
    rows: HashMap<usize, usize>, // layer -> row index
    row_layer: Vec<usize>,       // row index -> layer
    stats: Vec<SlotStats>,       // per row
    slot_of: Vec<u32>,           // row * n_experts + expert -> slot, or NONE
    seen: Vec<u32>,              // same index -> stamp of the last call naming it
    owner: Vec<u32>,             // slot -> row * n_experts + expert, or NONE
    prev: Vec<u32>,              // recency list: towards the least recently used end
    next: Vec<u32>,              // towards the most recently used end
    lru: u32,
    mru: u32,
    filled: usize, // slots 0..filled have held an expert; filled.. are free
    stamp: u32,
    distinct: Vec<u32>, // scratch: this call's distinct keys, in order of first appearance
    mark: Vec<u32>,     // key -> stamp of the last successful place/lookup naming it
    last_call: Vec<u32>, // row -> stamp of its last successful place/lookup, 0 for none
    policy: Policy,
    adaptive: Option<Adaptive>,
}

/// The adaptive policy's state.
#[derive(Debug, Clone)]
struct Adaptive {
    scores: Scores, // per key
    heap: SlotHeap, // occupied slots by (score, last use)
    clock: u64,     // last-use ticks
    margin: f64,    // routes
}

/// Which residents an eviction must spare.
#[derive(Clone, Copy)]
enum Protect<'a> {
    Nothing,
    /// Those the call with this stamp names.
    Call(u32),
    /// Those the latest call of their layer names, and these keys.
    Steps(&'a [u32]),
}

impl SlotCache {
    /// An empty LRU pool of `n_slots` slots for layers of `n_experts` experts each.
    pub fn new(n_slots: usize, n_experts: usize) -> Result<SlotCache> {
        SlotCache::with_policy(n_slots, n_experts, Policy::Lru)
    }

    /// An empty pool with the replacement policy `policy`.
    pub fn with_policy(n_slots: usize, n_experts: usize, policy: Policy) -> Result<SlotCache> {
        policy.check()?;
        // Slots travel as i32 (ggml's ids); keys as u32 with u32::MAX reserved.
        if n_slots == 0 || n_slots > i32::MAX as usize {
            return Err(Error::InvalidInput(format!(
                "a slot pool needs 1 to 2^31-1 slots, not {n_slots}"
            )));
        }
        if n_experts == 0 || n_experts >= NONE as usize {
            return Err(Error::InvalidInput(format!(
                "a slot pool needs layers of at least one expert, not {n_experts}"
            )));
        }
        Ok(SlotCache {
            n_slots,
            n_experts,
            rows: HashMap::new(),
            row_layer: Vec::new(),
            stats: Vec::new(),
            slot_of: Vec::new(),
            seen: Vec::new(),
            owner: vec![NONE; n_slots],
            prev: vec![NONE; n_slots],
            next: vec![NONE; n_slots],
            lru: NONE,
            mru: NONE,
            filled: 0,
            stamp: 0,
            distinct: Vec::new(),
            mark: Vec::new(),
            last_call: Vec::new(),
            policy,
            adaptive: match policy {
                Policy::Lru => None,
                Policy::Adaptive { half_life, margin } => Some(Adaptive {
                    scores: Scores::new(half_life),
                    heap: SlotHeap::new(n_slots),
                    clock: 0,
                    margin,
                }),
            },
        })
    }

    /// The replacement policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Slots in the pool.
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Experts per layer.
    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    /// Offload: gives every expert that `ids` names a slot, uploading the misses. `ids` are
    /// one layer call's routes, `n_used` per token (tokens x top-k, flattened); `slots_out`
    /// receives each route's slot. Returns the uploads to perform before the GPU reads the
    /// slots. An error, with nothing changed, when the lengths disagree, an id is out of range,
    /// a token names an expert twice, or the call names more distinct experts than the pool
    /// has slots (split the batch: [`SlotCache::split_tokens`]).
    pub fn place(
        &mut self,
        layer: usize,
        ids: &[i32],
        n_used: usize,
        slots_out: &mut [i32],
    ) -> Result<Vec<Upload>> {
        let row = self.begin_call(layer, ids, n_used, slots_out.len())?;
        let distinct = std::mem::take(&mut self.distinct);
        if distinct.len() > self.n_slots {
            let n = distinct.len();
            self.distinct = distinct;
            return Err(Error::Shape(format!(
                "layer {layer}: one call names {n} distinct experts but the slot pool has {} \
                 slots; split the batch",
                self.n_slots
            )));
        }
        self.end_call(row, ids, n_used, &distinct);
        let mut hits = 0;
        for &key in &distinct {
            let slot = self.slot_of[key as usize];
            if slot != NONE {
                self.use_slot(slot);
                hits += 1;
            }
        }
        let mut uploads = Vec::with_capacity(distinct.len() - hits);
        let protect = Protect::Call(self.stamp);
        for &key in &distinct {
            if self.slot_of[key as usize] == NONE {
                // At most n_slots distinct experts: a slot this call does not name is left.
                let up = self.fill(key, protect).expect("an unnamed slot is left");
                uploads.push(up);
            }
        }
        self.distinct = distinct;
        let s = &mut self.stats[row];
        s.calls += 1;
        s.hits += hits as u64;
        s.misses += uploads.len() as u64; // fill() counted the uploads
        let base = row * self.n_experts;
        for (out, &id) in slots_out.iter_mut().zip(ids) {
            *out = self.slot_of[base + id as usize] as i32;
        }
        Ok(uploads)
    }

    /// Hybrid: the slots of the resident experts `ids` names (touched as recently used), -1
    /// for the others; nothing is inserted. Returns how many routes hit (entries of
    /// `slots_out` that are not -1). The same checks as [`SlotCache::place`], except that any
    /// number of distinct experts is fine.
    pub fn lookup(
        &mut self,
        layer: usize,
        ids: &[i32],
        n_used: usize,
        slots_out: &mut [i32],
    ) -> Result<usize> {
        let row = self.begin_call(layer, ids, n_used, slots_out.len())?;
        let distinct = std::mem::take(&mut self.distinct);
        self.end_call(row, ids, n_used, &distinct);
        let mut hits = 0u64;
        for &key in &distinct {
            let slot = self.slot_of[key as usize];
            if slot != NONE {
                self.use_slot(slot);
                hits += 1;
            }
        }
        let s = &mut self.stats[row];
        s.calls += 1;
        s.hits += hits;
        s.misses += distinct.len() as u64 - hits;
        self.distinct = distinct;
        let base = row * self.n_experts;
        let mut route_hits = 0;
        for (out, &id) in slots_out.iter_mut().zip(ids) {
            let slot = self.slot_of[base + id as usize];
            *out = if slot == NONE {
                -1
            } else {
                route_hits += 1;
                slot as i32
            };
        }
        Ok(route_hits)
    }

    /// Makes `expert` of `layer` resident: None when it already is (it is then touched), else
    /// the upload to perform, evicting by the policy (the least recently used slot, or the
    /// lowest score) with no admission test. Nothing is protected from eviction here: the
    /// caller must not insert while a computation still reads the slot this may evict
    /// ([`SlotCache::admit`] protects the current step).
    pub fn insert(&mut self, layer: usize, expert: usize) -> Result<Option<Upload>> {
        self.check_expert(layer, expert)?;
        let row = self.row(layer)?;
        let key = (row * self.n_experts + expert) as u32;
        let slot = self.slot_of[key as usize];
        if slot != NONE {
            self.use_slot(slot);
            return Ok(None);
        }
        Ok(self.fill(key, Protect::Nothing))
    }

    /// Hybrid fill, after a step's [`SlotCache::lookup`] of `layer`: which of `experts` (its
    /// misses; residents and repeats are skipped) to upload, at most `max_uploads`, and into
    /// which slots. A free slot (the lowest) is always taken. Once the pool is full:
    /// - [`Policy::Lru`]: each expert in the order given replaces the least recently used
    ///   resident;
    /// - [`Policy::Adaptive`]: the experts with the highest scores first, each replacing the
    ///   resident with the lowest score (ties: least recently used) if its own score is
    ///   higher by more than the margin; the others are refused.
    ///
    /// Never evicted: an expert that the latest `lookup` or `place` of its layer named, or
    /// that this call uploads. An error, with nothing changed, for an expert out of range.
    pub fn admit(
        &mut self,
        layer: usize,
        experts: &[usize],
        max_uploads: usize,
    ) -> Result<Vec<Upload>> {
        for &e in experts {
            self.check_expert(layer, e)?;
        }
        let row = self.row(layer)?;
        let base = row * self.n_experts;
        let mut cand: Vec<u32> = Vec::with_capacity(experts.len());
        for &e in experts {
            let key = (base + e) as u32;
            if self.slot_of[key as usize] == NONE && !cand.contains(&key) {
                cand.push(key);
            }
        }
        if let Some(a) = &self.adaptive {
            // Stable: equal scores keep the caller's order.
            cand.sort_by(|&x, &y| {
                let (x, y) = (a.scores.stored(x as usize), a.scores.stored(y as usize));
                y.total_cmp(&x)
            });
        }
        let mut admitted: Vec<u32> = Vec::with_capacity(cand.len().min(max_uploads));
        let mut uploads = Vec::with_capacity(admitted.capacity());
        for key in cand {
            if uploads.len() >= max_uploads {
                break;
            }
            let up = if self.filled < self.n_slots {
                self.put(key, self.filled as u32, None)
            } else {
                let Some(victim) = self.victim(Protect::Steps(&admitted)) else {
                    break;
                };
                if let Some(a) = &self.adaptive {
                    let (new, old) = (
                        a.scores.count(key as usize),
                        a.scores.count(self.owner[victim as usize] as usize),
                    );
                    if !admits(new, old, a.margin) {
                        break; // sorted: no later candidate beats this victim either
                    }
                }
                let evicted = self.evict(victim);
                self.put(key, victim, Some(evicted))
            };
            admitted.push(key);
            uploads.push(up);
        }
        Ok(uploads)
    }

    /// The adaptive policy's aged route count of `expert` of `layer` (zero for a layer never
    /// seen); None under LRU or for an expert out of range.
    pub fn score(&self, layer: usize, expert: usize) -> Option<f64> {
        let a = self.adaptive.as_ref()?;
        if expert >= self.n_experts {
            return None;
        }
        Some(
            self.rows
                .get(&layer)
                .map_or(0.0, |&r| a.scores.count(r * self.n_experts + expert)),
        )
    }

    /// [`SlotCache::score`] of every expert of `layer`; None under LRU.
    pub fn scores(&self, layer: usize) -> Option<Vec<f64>> {
        (0..self.n_experts)
            .map(|e| self.score(layer, e))
            .collect::<Option<Vec<f64>>>()
    }

    /// Fills an empty pool from a profile: `residents[i]` goes to slot `i`, `residents[0]`
    /// most recently used (list them hottest first, so the coldest is evicted first). Returns
    /// the uploads. An error, with nothing changed, on a non-empty pool, too many residents,
    /// an expert out of range or listed twice.
    pub fn seed(&mut self, residents: &[(usize, usize)]) -> Result<Vec<Upload>> {
        self.seed_with_rates(residents, None)
    }

    /// [`SlotCache::seed`], and under the adaptive policy each resident's score starts at
    /// the aged count of an expert routed `rates[i]` times per token for ever (from the
    /// profile: its routes over the profiled tokens), so that the profile's experts are not
    /// replaced by the first misses before their own routes have been counted. Without
    /// rates (or under LRU) scores are left as they are (zero on a new pool). An error, too,
    /// when `rates` is not one finite non-negative number per resident.
    pub fn seed_with_rates(
        &mut self,
        residents: &[(usize, usize)],
        rates: Option<&[f64]>,
    ) -> Result<Vec<Upload>> {
        if let Some(r) = rates {
            if r.len() != residents.len() {
                return Err(Error::Shape(format!(
                    "{} rates for {} residents",
                    r.len(),
                    residents.len()
                )));
            }
            if let Some(bad) = r.iter().find(|x| !(x.is_finite() && **x >= 0.0)) {
                return Err(Error::InvalidInput(format!(
                    "a resident's rate must be a non-negative number of routes per token, not \
                     {bad}"
                )));
            }
        }
        if self.filled != 0 {
            return Err(Error::InvalidInput(
                "seed needs an empty slot pool; clear() it first".into(),
            ));
        }
        if residents.len() > self.n_slots {
            return Err(Error::Shape(format!(
                "{} residents do not fit a pool of {} slots",
                residents.len(),
                self.n_slots
            )));
        }
        for &(layer, expert) in residents {
            self.check_expert(layer, expert)?;
        }
        let mut keys = Vec::with_capacity(residents.len());
        let stamp = self.next_stamp();
        for &(layer, expert) in residents {
            let key = self.row(layer)? * self.n_experts + expert;
            if self.seen[key] == stamp {
                return Err(Error::InvalidInput(format!(
                    "expert {expert} of layer {layer} is listed twice"
                )));
            }
            self.seen[key] = stamp;
            keys.push(key as u32);
        }
        let mut uploads = Vec::with_capacity(keys.len());
        for (slot, &key) in keys.iter().enumerate() {
            self.slot_of[key as usize] = slot as u32;
            self.owner[slot] = key;
            self.stats[key as usize / self.n_experts].uploads += 1;
            let (layer, expert) = self.layer_expert(key);
            uploads.push(Upload {
                layer,
                expert,
                slot,
                evicted: None,
            });
        }
        if let (Some(a), Some(rates)) = (&mut self.adaptive, rates) {
            for (&key, &rate) in keys.iter().zip(rates) {
                a.scores.set_steady(key as usize, rate);
            }
        }
        // Pushed coldest first, so residents[0] ends most recently used.
        for slot in (0..keys.len()).rev() {
            self.push_mru(slot as u32);
            self.heap_use(slot as u32);
        }
        self.filled = keys.len();
        Ok(uploads)
    }

    /// Token ranges `[start, end)` of `ids` (`n_used` per token) that each name at most
    /// `n_slots` distinct experts, greedily as long as possible: how to split a batch that
    /// [`SlotCache::place`] refuses. Independent of what is resident.
    pub fn split_tokens(&self, ids: &[i32], n_used: usize) -> Result<Vec<(usize, usize)>> {
        self.check_ids(None, ids, n_used, ids.len())?;
        if n_used > self.n_slots {
            return Err(Error::Shape(format!(
                "one token names {n_used} experts but the slot pool has {} slots",
                self.n_slots
            )));
        }
        let mut mark = vec![0u32; self.n_experts]; // chunk number + 1 that last named it
        let (mut chunk, mut start, mut distinct) = (1u32, 0, 0);
        let mut ranges = Vec::new();
        for (t, tok) in ids.chunks(n_used).enumerate() {
            let new = tok.iter().filter(|&&e| mark[e as usize] != chunk).count();
            if distinct + new > self.n_slots {
                ranges.push((start, t));
                (chunk, start, distinct) = (chunk + 1, t, 0);
            }
            for &e in tok {
                if mark[e as usize] != chunk {
                    mark[e as usize] = chunk;
                    distinct += 1;
                }
            }
        }
        let n_tokens = ids.len() / n_used;
        if n_tokens > start {
            ranges.push((start, n_tokens));
        }
        Ok(ranges)
    }

    /// The slot holding `expert` of `layer`, if resident (no touch).
    pub fn slot_of(&self, layer: usize, expert: usize) -> Option<usize> {
        let row = *self.rows.get(&layer)?;
        if expert >= self.n_experts {
            return None;
        }
        let slot = self.slot_of[row * self.n_experts + expert];
        (slot != NONE).then_some(slot as usize)
    }

    /// Per slot, the (layer, expert) it holds.
    pub fn residents(&self) -> Vec<Option<(usize, usize)>> {
        self.owner
            .iter()
            .map(|&key| (key != NONE).then(|| self.layer_expert(key)))
            .collect()
    }

    /// The occupied slots, least recently used first.
    pub fn recency(&self) -> Vec<usize> {
        let mut order = Vec::with_capacity(self.filled);
        let mut s = self.lru;
        while s != NONE {
            order.push(s as usize);
            s = self.next[s as usize];
        }
        order
    }

    /// `layer`'s counters (zero for a layer never seen).
    pub fn stats(&self, layer: usize) -> SlotStats {
        self.rows
            .get(&layer)
            .map_or_else(SlotStats::default, |&r| self.stats[r])
    }

    /// Every layer seen, with its counters, by layer.
    pub fn all_stats(&self) -> Vec<(usize, SlotStats)> {
        let mut all: Vec<_> = self
            .row_layer
            .iter()
            .zip(&self.stats)
            .map(|(&l, &s)| (l, s))
            .collect();
        all.sort_by_key(|&(l, _)| l);
        all
    }

    /// Zeroes every layer's counters.
    pub fn reset_stats(&mut self) {
        self.stats.fill(SlotStats::default());
    }

    /// Empties the pool (counters kept).
    pub fn clear(&mut self) {
        self.slot_of.fill(NONE);
        self.owner.fill(NONE);
        self.prev.fill(NONE);
        self.next.fill(NONE);
        (self.lru, self.mru, self.filled) = (NONE, NONE, 0);
        if let Some(a) = &mut self.adaptive {
            a.heap.clear();
        }
    }

    fn layer_expert(&self, key: u32) -> (usize, usize) {
        let key = key as usize;
        (self.row_layer[key / self.n_experts], key % self.n_experts)
    }

    /// The dense row of `layer`, added on first sight.
    fn row(&mut self, layer: usize) -> Result<usize> {
        if let Some(&r) = self.rows.get(&layer) {
            return Ok(r);
        }
        let r = self.row_layer.len();
        let end = (r + 1) * self.n_experts;
        if end >= NONE as usize {
            return Err(Error::InvalidInput(format!(
                "a slot pool cannot track {} layers of {} experts",
                r + 1,
                self.n_experts
            )));
        }
        self.rows.insert(layer, r);
        self.row_layer.push(layer);
        self.stats.push(SlotStats::default());
        self.slot_of.resize(end, NONE);
        self.seen.resize(end, 0);
        self.mark.resize(end, 0);
        self.last_call.push(0);
        if let Some(a) = &mut self.adaptive {
            a.scores.resize(end);
        }
        Ok(r)
    }

    fn check_expert(&self, layer: usize, expert: usize) -> Result<()> {
        if expert >= self.n_experts {
            return Err(Error::InvalidInput(format!(
                "layer {layer}: expert id {expert} is out of range 0..{}",
                self.n_experts
            )));
        }
        Ok(())
    }

    /// Checks lengths, ranges and per-token distinctness, all before any change.
    fn check_ids(
        &self,
        layer: Option<usize>,
        ids: &[i32],
        n_used: usize,
        out_len: usize,
    ) -> Result<()> {
        let at = layer.map_or(String::new(), |l| format!("layer {l}: "));
        if ids.len() != out_len {
            return Err(Error::Shape(format!(
                "{at}{} ids but {out_len} output slots",
                ids.len()
            )));
        }
        if n_used == 0 || !ids.len().is_multiple_of(n_used) {
            return Err(Error::Shape(format!(
                "{at}{} ids are not whole tokens of {n_used} experts",
                ids.len()
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&e| e < 0 || e as usize >= self.n_experts) {
            return Err(Error::InvalidInput(format!(
                "{at}expert id {bad} is out of range 0..{}",
                self.n_experts
            )));
        }
        // Top-k is small (<= 16 in practice): pairwise beats any set here.
        for (t, tok) in ids.chunks(n_used).enumerate() {
            for (i, &e) in tok.iter().enumerate() {
                if tok[..i].contains(&e) {
                    return Err(Error::InvalidInput(format!(
                        "{at}token {t} names expert {e} twice"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Checks a call and collects its distinct experts into `self.distinct`.
    fn begin_call(
        &mut self,
        layer: usize,
        ids: &[i32],
        n_used: usize,
        out_len: usize,
    ) -> Result<usize> {
        self.check_ids(Some(layer), ids, n_used, out_len)?;
        let row = self.row(layer)?;
        let stamp = self.next_stamp();
        let base = row * self.n_experts;
        self.distinct.clear();
        for &e in ids {
            let key = base + e as usize;
            if self.seen[key] != stamp {
                self.seen[key] = stamp;
                self.distinct.push(key as u32);
            }
        }
        Ok(row)
    }

    fn next_stamp(&mut self) -> u32 {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            // Wrapped after 2^32 calls: old stamps could collide, so forget them.
            self.seen.fill(0);
            self.mark.fill(0);
            self.last_call.fill(0);
            self.stamp = 1;
        }
        self.stamp
    }

    /// After a call's checks passed: records what it names (protection) and, under the
    /// adaptive policy, moves the clock on by its tokens (a token of every layer of the pool
    /// is one tick) and counts each route.
    fn end_call(&mut self, row: usize, ids: &[i32], n_used: usize, distinct: &[u32]) {
        for &key in distinct {
            self.mark[key as usize] = self.stamp;
        }
        self.last_call[row] = self.stamp;
        let Some(a) = &mut self.adaptive else {
            return;
        };
        let tokens = (ids.len() / n_used) as f64 / self.row_layer.len() as f64;
        if a.scores.advance(tokens) {
            let (scores, owner) = (&a.scores, &self.owner);
            a.heap
                .rebuild(|slot, old| (scores.stored(owner[slot] as usize), old.1));
        }
        let base = row * self.n_experts;
        for &e in ids {
            a.scores.add(base + e as usize, 1.0);
        }
    }

    /// Whether an eviction under `protect` must spare the expert `key`.
    fn protected(&self, key: u32, protect: Protect) -> bool {
        match protect {
            Protect::Nothing => false,
            Protect::Call(stamp) => self.seen[key as usize] == stamp,
            Protect::Steps(extra) => {
                let last = self.last_call[key as usize / self.n_experts];
                (last != 0 && self.mark[key as usize] == last) || extra.contains(&key)
            }
        }
    }

    /// The slot to evict: the least recently used, or the lowest (score, last use), that
    /// `protect` does not spare. Needs a full pool.
    fn victim(&self, protect: Protect) -> Option<u32> {
        match &self.adaptive {
            None => {
                let mut s = self.lru;
                while s != NONE && self.protected(self.owner[s as usize], protect) {
                    s = self.next[s as usize];
                }
                (s != NONE).then_some(s)
            }
            Some(a) => a
                .heap
                .min_where(|s| self.protected(self.owner[s], protect))
                .map(|s| s as u32),
        }
    }

    /// Puts the miss `key` into the lowest free slot, else the victim under `protect`.
    fn fill(&mut self, key: u32, protect: Protect) -> Option<Upload> {
        if self.filled < self.n_slots {
            return Some(self.put(key, self.filled as u32, None));
        }
        let slot = self.victim(protect)?;
        let evicted = self.evict(slot);
        Some(self.put(key, slot, Some(evicted)))
    }

    /// Empties the occupied `slot`; returns what it held.
    fn evict(&mut self, slot: u32) -> (usize, usize) {
        self.unlink(slot);
        if let Some(a) = &mut self.adaptive {
            a.heap.remove(slot as usize);
        }
        let old = self.owner[slot as usize];
        self.slot_of[old as usize] = NONE;
        self.owner[slot as usize] = NONE;
        self.stats[old as usize / self.n_experts].evictions += 1;
        self.layer_expert(old)
    }

    /// Puts `key` into the empty `slot` (the next free one, or one just evicted) as the most
    /// recently used.
    fn put(&mut self, key: u32, slot: u32, evicted: Option<(usize, usize)>) -> Upload {
        if slot as usize == self.filled {
            self.filled += 1;
        }
        self.slot_of[key as usize] = slot;
        self.owner[slot as usize] = key;
        self.push_mru(slot);
        self.heap_use(slot);
        self.stats[key as usize / self.n_experts].uploads += 1;
        let (layer, expert) = self.layer_expert(key);
        Upload {
            layer,
            expert,
            slot: slot as usize,
            evicted,
        }
    }

    /// A hit: most recently used, and its heap key refreshed.
    fn use_slot(&mut self, slot: u32) {
        self.touch(slot);
        self.heap_use(slot);
    }

    /// Under the adaptive policy, (re)keys the occupied `slot` by its score and a new tick.
    fn heap_use(&mut self, slot: u32) {
        if let Some(a) = &mut self.adaptive {
            a.clock += 1;
            let key = (a.scores.stored(self.owner[slot as usize] as usize), a.clock);
            a.heap.set(slot as usize, key);
        }
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NONE {
            self.lru = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NONE {
            self.mru = p;
        } else {
            self.prev[n as usize] = p;
        }
    }

    fn push_mru(&mut self, s: u32) {
        self.prev[s as usize] = self.mru;
        self.next[s as usize] = NONE;
        if self.mru == NONE {
            self.lru = s;
        } else {
            self.next[self.mru as usize] = s;
        }
        self.mru = s;
    }

    fn touch(&mut self, s: u32) {
        if self.mru != s {
            self.unlink(s);
            self.push_mru(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    fn place(
        c: &mut SlotCache,
        layer: usize,
        ids: &[i32],
        n_used: usize,
    ) -> (Vec<i32>, Vec<Upload>) {
        let mut slots = vec![0; ids.len()];
        let up = c.place(layer, ids, n_used, &mut slots).unwrap();
        (slots, up)
    }

    #[test]
    fn fills_free_slots_then_evicts_least_recent() {
        let mut c = SlotCache::new(3, 8).unwrap();
        let (s, up) = place(&mut c, 0, &[5, 1], 2);
        assert_eq!(s, [0, 1]);
        assert_eq!(up.len(), 2);
        let (s, up) = place(&mut c, 0, &[2], 1);
        assert_eq!((s[0], up[0].evicted), (2, None));
        // Touch 5 so that 1 is now least recently used.
        let (s, up) = place(&mut c, 0, &[5], 1);
        assert_eq!((s[0], up.len()), (0, 0));
        let (s, up) = place(&mut c, 0, &[7], 1);
        assert_eq!(s, [1]);
        assert_eq!(up[0].evicted, Some((0, 1)));
        assert_eq!(c.recency(), [2, 0, 1]);
        assert_eq!(c.slot_of(0, 1), None);
        assert_eq!(c.slot_of(0, 7), Some(1));
    }

    #[test]
    fn a_call_never_evicts_its_own_experts() {
        // 4 slots, least recently used first: experts 0, 1, 2, 3 of layer 0.
        let mut c = SlotCache::new(4, 16).unwrap();
        for e in 0..4 {
            place(&mut c, 0, &[e], 1);
        }
        // Experts 0 and 1 hit (the two oldest); the misses 9 and 10 must evict 2 and 3.
        let (s, up) = place(&mut c, 0, &[9, 0, 10, 1], 2);
        assert_eq!(s, [2, 0, 3, 1]);
        let ev: Vec<_> = up.iter().map(|u| u.evicted).collect();
        assert_eq!(ev, [Some((0, 2)), Some((0, 3))]);
    }

    #[test]
    fn layers_share_the_pool() {
        let mut c = SlotCache::new(2, 4).unwrap();
        place(&mut c, 3, &[1], 1);
        place(&mut c, 7, &[1], 1);
        let (s, up) = place(&mut c, 9, &[0], 1);
        assert_eq!(s, [0]);
        assert_eq!(up[0].evicted, Some((3, 1)));
        assert_eq!(c.stats(3).evictions, 1);
        assert_eq!(c.stats(9).uploads, 1);
        assert_eq!(c.residents(), [Some((9, 0)), Some((7, 1))]);
    }

    #[test]
    fn errors_change_nothing() {
        let mut c = SlotCache::new(2, 4).unwrap();
        place(&mut c, 0, &[0], 1);
        let before = (c.residents(), c.recency(), c.stats(0));
        let mut out = [0; 4];
        let bad: [(&[i32], usize, usize); 6] = [
            (&[0, 1, 2, 3], 2, 4), // 4 distinct > 2 slots
            (&[0, 4], 2, 2),       // out of range
            (&[-1, 0], 2, 2),      // negative
            (&[1, 1], 2, 2),       // a token names 1 twice
            (&[0, 1, 2], 2, 3),    // not whole tokens
            (&[0, 1], 2, 3),       // length mismatch
        ];
        for (ids, n_used, n_out) in bad {
            assert!(
                c.place(0, ids, n_used, &mut out[..n_out]).is_err(),
                "{ids:?}"
            );
        }
        assert!(c.lookup(0, &[1, 1], 2, &mut out[..2]).is_err());
        assert_eq!(before, (c.residents(), c.recency(), c.stats(0)));
        assert!(matches!(
            c.place(0, &[0, 1, 2, 3], 2, &mut out),
            Err(Error::Shape(m)) if m.contains("split the batch")
        ));
    }

    #[test]
    fn lookup_inserts_nothing() {
        let mut c = SlotCache::new(2, 4).unwrap();
        place(&mut c, 0, &[2, 3], 2);
        let mut out = [0; 4];
        assert_eq!(c.lookup(0, &[3, 0, 3, 1], 2, &mut out).unwrap(), 2);
        assert_eq!(out, [1, -1, 1, -1]);
        assert_eq!(c.recency(), [0, 1]); // 3 touched
        let s = c.stats(0);
        assert_eq!((s.calls, s.hits, s.misses, s.uploads), (2, 1, 4, 2));
    }

    #[test]
    fn insert_and_seed() {
        let mut c = SlotCache::new(3, 4).unwrap();
        let up = c.seed(&[(0, 3), (1, 2)]).unwrap();
        assert_eq!(up.iter().map(|u| u.slot).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(c.recency(), [1, 0]); // hottest (0, 3) most recent
        assert!(c.seed(&[(0, 0)]).is_err()); // not empty
        assert_eq!(c.insert(0, 3).unwrap(), None);
        let u = c.insert(1, 0).unwrap().unwrap();
        assert_eq!((u.slot, u.evicted), (2, None));
        let u = c.insert(1, 1).unwrap().unwrap();
        assert_eq!((u.slot, u.evicted), (1, Some((1, 2))));
        assert!(c.insert(0, 4).is_err());
        c.clear();
        assert!(c.seed(&[(0, 1), (0, 1)]).is_err());
        assert!(c.seed(&[(0, 0), (0, 1), (0, 2), (0, 3)]).is_err());
        assert_eq!(c.residents(), [None, None, None]);
        c.reset_stats();
        assert!(c.all_stats().iter().all(|s| s.1 == SlotStats::default()));
    }

    #[test]
    fn split_tokens_respects_the_pool() {
        let c = SlotCache::new(3, 8).unwrap();
        let ids = [0, 1, 1, 2, 3, 4, 4, 0, 5, 6];
        assert_eq!(c.split_tokens(&ids, 2).unwrap(), [(0, 2), (2, 4), (4, 5)]);
        assert!(c.split_tokens(&[0, 1, 2, 3], 4).is_err());
        assert_eq!(c.split_tokens(&[], 2).unwrap(), []);
    }

    #[test]
    fn stamps_survive_wrapping() {
        let mut c = SlotCache::new(2, 4).unwrap();
        c.stamp = u32::MAX - 1;
        for _ in 0..4 {
            let (s, _) = place(&mut c, 0, &[1, 2, 1, 2], 2);
            assert_eq!(s, [0, 1, 0, 1]);
        }
    }

    // ---- Policies and admit ----

    fn adaptive(half_life: f64, margin: f64) -> Policy {
        Policy::Adaptive { half_life, margin }
    }

    /// One hybrid step of one layer: lookup, then admit every miss. Returns the misses and
    /// the uploads.
    fn step(c: &mut SlotCache, layer: usize, ids: &[i32], cap: usize) -> (Vec<usize>, Vec<Upload>) {
        let mut slots = vec![0; ids.len()];
        c.lookup(layer, ids, ids.len(), &mut slots).unwrap();
        let missed: Vec<usize> = ids
            .iter()
            .zip(&slots)
            .filter(|(_, &s)| s < 0)
            .map(|(&e, _)| e as usize)
            .collect();
        let up = c.admit(layer, &missed, cap).unwrap();
        (missed, up)
    }

    fn evicted(up: &[Upload]) -> Vec<Option<(usize, usize)>> {
        up.iter().map(|u| u.evicted).collect()
    }

    #[test]
    fn lru_admit_spares_the_current_steps() {
        let mut c = SlotCache::new(3, 16).unwrap();
        let (_, up) = step(&mut c, 0, &[0, 1, 2], 8);
        assert_eq!(up.iter().map(|u| u.slot).collect::<Vec<_>>(), [0, 1, 2]);
        // 0 hits (touched); 3 evicts 1, the least recently used.
        let (_, up) = step(&mut c, 0, &[0, 3], 8);
        assert_eq!(evicted(&up), [Some((0, 1))]);
        // Layer 0's step names 2 (the least recently used after this), then layer 1's
        // admits may evict only 0 and 3: its third expert finds nothing unprotected.
        step(&mut c, 0, &[2, 9], 0);
        assert_eq!(c.recency(), [0, 1, 2]); // slots: 0 (expert 0), 1 (expert 3), 2 (expert 2)
        let mut out = [0; 3];
        c.lookup(1, &[5, 6, 7], 3, &mut out).unwrap();
        let up = c.admit(1, &[5, 6, 7], 8).unwrap();
        assert_eq!(evicted(&up), [Some((0, 0)), Some((0, 3))]);
        assert_eq!(c.residents(), [Some((1, 5)), Some((1, 6)), Some((0, 2))]);
        // The cap, repeats and residents.
        c.lookup(1, &[8, 9, 10], 3, &mut out).unwrap();
        let up = c.admit(1, &[8, 8, 5, 9, 10], 1).unwrap();
        assert_eq!((up.len(), up[0].expert), (1, 8));
        assert!(c.admit(1, &[16], 1).is_err());
        assert_eq!(c.stats(1).uploads, 3);
    }

    #[test]
    fn adaptive_admits_on_evidence_only() {
        // Decay negligible: scores are route counts.
        let mut c = SlotCache::with_policy(2, 8, adaptive(1e12, 2.0)).unwrap();
        let (_, up) = step(&mut c, 0, &[0, 1], 8);
        assert_eq!(up.len(), 2); // free slots: no test
                                 // Expert 2 must beat expert 1 (one route) by more than two routes plus 1.5 spreads:
                                 // n > 1 + 2 + 1.5 sqrt(n + 1) first holds at n = 8 (7 <= 7.24, 8 > 7.5).
        for n in 1..=8 {
            let (missed, up) = step(&mut c, 0, &[0, 2], 8);
            assert_eq!(missed, [2]);
            if n < 8 {
                assert!(up.is_empty(), "route {n}");
            } else {
                assert_eq!(evicted(&up), [Some((0, 1))]);
            }
        }
        for (e, n) in [(0, 9.0), (2, 8.0), (1, 1.0)] {
            assert!((c.score(0, e).unwrap() - n).abs() < 1e-6, "{e}");
        }
        assert_eq!(SlotCache::new(2, 8).unwrap().score(0, 0), None);
    }

    #[test]
    fn adaptive_evicts_the_lowest_unprotected_score() {
        let mut c = SlotCache::with_policy(3, 16, adaptive(1e12, 0.0)).unwrap();
        c.seed(&[(0, 1), (0, 2), (0, 3)]).unwrap();
        let mut out = [0; 1];
        // Counts large enough to clear the significance test: 40 > 10 + 1.5 sqrt(50) = 20.6.
        for (e, n) in [(1, 50), (2, 10), (3, 30), (9, 40)] {
            for _ in 0..n {
                c.lookup(0, &[e], 1, &mut out).unwrap();
            }
        }
        // Layer 0's current step names 9 only: 2 (ten routes) goes.
        let up = c.admit(0, &[9], 1).unwrap();
        assert_eq!(evicted(&up), [Some((0, 2))]);
        // Now the step names 9 (resident, 41 routes): expert 10 (50 routes, > 30 + 1.5 sqrt(80)
        // = 43.4) must take 3 (30).
        for _ in 0..50 {
            c.lookup(0, &[10], 1, &mut out).unwrap();
        }
        c.lookup(0, &[9], 1, &mut out).unwrap();
        let up = c.admit(0, &[10], 1).unwrap();
        assert_eq!(evicted(&up), [Some((0, 3))]);
        // The step names 3 (31 routes now) and the lowest resident is 9 (41): 3 does not beat it.
        c.lookup(0, &[3], 1, &mut out).unwrap();
        assert_eq!(c.admit(0, &[3], 1).unwrap(), []);
        // Equal scores: the least recently used goes; seed order breaks the first tie.
        let mut c = SlotCache::with_policy(2, 8, adaptive(64.0, 0.0)).unwrap();
        c.seed(&[(0, 0), (0, 1)]).unwrap();
        for _ in 0..6 {
            c.lookup(0, &[5], 1, &mut out).unwrap(); // about 5.8 > 1.5 sqrt(5.8) = 3.6
        }
        assert_eq!(evicted(&c.admit(0, &[5], 1).unwrap()), [Some((0, 1))]);
    }

    #[test]
    fn seed_rates_start_the_adaptive_scores() {
        let mut c = SlotCache::with_policy(3, 8, adaptive(16.0, 2.0)).unwrap();
        assert!(c.seed_with_rates(&[(0, 1)], Some(&[1.0, 2.0])).is_err());
        assert!(c.seed_with_rates(&[(0, 1)], Some(&[-1.0])).is_err());
        assert!(c.seed_with_rates(&[(0, 1)], Some(&[f64::NAN])).is_err());
        assert_eq!(c.residents(), [None, None, None]);
        // The rated resident is the least recently used: without its rate it would go first.
        c.seed_with_rates(&[(2, 3), (0, 1)], Some(&[0.0, 0.5]))
            .unwrap();
        // 0.5 routes a token for ever, aged by 2^(-1/16) a token: sum of 0.5 * 2^(-j/16).
        let want: f64 = (0..4000).map(|j| 0.5 * (-(j as f64) / 16.0).exp2()).sum();
        assert!((c.score(0, 1).unwrap() - want).abs() < 1e-9);
        assert_eq!(c.score(2, 3), Some(0.0));
        // A miss with 10 routes (about 8.7 > 2 + 1.5 sqrt(8.7) = 6.4) replaces the unrated one.
        let mut out = [0; 1];
        for _ in 0..10 {
            c.lookup(0, &[6], 1, &mut out).unwrap();
        }
        c.admit(0, &[6], 8).unwrap(); // the free slot
        for _ in 0..10 {
            c.lookup(0, &[7], 1, &mut out).unwrap();
        }
        let up = c.admit(0, &[7], 8).unwrap();
        assert_eq!(evicted(&up), [Some((2, 3))]);
        // Rates are ignored under LRU.
        let mut c = SlotCache::new(2, 8).unwrap();
        c.seed_with_rates(&[(0, 1)], Some(&[3.0])).unwrap();
        assert_eq!(c.score(0, 1), None);
    }

    #[test]
    fn adaptive_holds_the_hot_set() {
        // Each token names 3 of the 6 hot experts 0..6 and 3 of the 58 others: 8 slots, so
        // a frequency policy ends holding 0..6 and LRU does not.
        let mut rng = Rng(7);
        let mut run = |policy| {
            let mut c = SlotCache::with_policy(8, 64, policy).unwrap();
            let mut hits = 0;
            for t in 0..3000 {
                let mut ids = Vec::new();
                rng.distinct(3, 0, 6, &mut ids);
                rng.distinct(6, 6, 64, &mut ids);
                let (missed, _) = step(&mut c, 0, &ids, 8);
                if t >= 1000 {
                    hits += 6 - missed.len();
                }
            }
            let mut held: Vec<usize> = c.residents().iter().map(|r| r.unwrap().1).collect();
            held.sort();
            (held, hits as f64 / (2000.0 * 6.0))
        };
        let (held, ada) = run(Policy::adaptive());
        assert_eq!(held[..6], [0, 1, 2, 3, 4, 5]);
        let (held, lru) = run(Policy::Lru);
        assert_ne!(held[..6], [0, 1, 2, 3, 4, 5]);
        // The best fixed set (0..6 and two others) hits 3 + 2 * 3 / 58 routes of 6 per token.
        let best = (3.0 + 6.0 / 58.0) / 6.0;
        assert!(ada > 0.97 * best && ada > lru + 0.1, "{ada} {lru} {best}");
    }

    #[test]
    fn adaptive_victims_are_the_coldest_through_rescaling() {
        // A half-life of 8 tokens rescales every 4096 tokens (10000 here); 4 layers share 20
        // slots, their popularity shifting. After every admit, each eviction took the lowest score among the
        // unprotected residents.
        let mut rng = Rng(11);
        let mut c = SlotCache::with_policy(20, 32, adaptive(8.0, 0.5)).unwrap();
        let mut named: Vec<Vec<i32>> = vec![Vec::new(); 4];
        let mut evictions = 0;
        for t in 0..40000 {
            let layer = t % 4;
            let mut ids = Vec::new();
            // Each layer's experts shift every 1000 steps, so that scores keep changing.
            let lo = (t / 1000) % 3 * 4;
            rng.distinct(4, lo, lo + 6 + layer * 6, &mut ids);
            let mut out = [0; 4];
            c.lookup(layer, &ids, 4, &mut out).unwrap();
            named[layer] = ids.clone();
            let missed: Vec<usize> = (0..4)
                .filter(|&i| out[i] < 0)
                .map(|i| ids[i] as usize)
                .collect();
            let before: Vec<(usize, usize, f64)> = c
                .residents()
                .into_iter()
                .flatten()
                .map(|(l, e)| (l, e, c.score(l, e).unwrap()))
                .collect();
            let up = c.admit(layer, &missed, 2).unwrap();
            let mut gone: Vec<(usize, usize)> = Vec::new();
            for u in &up {
                assert!(missed.contains(&u.expert));
                let Some(v) = u.evicted else { continue };
                evictions += 1;
                let open = |&&(l, e, _): &&(usize, usize, f64)| {
                    !named[l].contains(&(e as i32)) && !gone.contains(&(l, e))
                };
                let lowest = before
                    .iter()
                    .filter(open)
                    .map(|r| r.2)
                    .fold(f64::INFINITY, f64::min);
                let vs = before.iter().find(|r| (r.0, r.1) == v).unwrap();
                assert!(
                    open(&vs),
                    "step {t}: evicted {v:?}, named by a current step"
                );
                assert_eq!(vs.2, lowest, "step {t}: evicted {v:?}");
                let cand = c.score(layer, u.expert).unwrap();
                assert!(admits(cand * (1.0 + 1e-9), vs.2, 0.5), "step {t}");
                gone.push(v);
            }
        }
        assert!(evictions > 100, "{evictions}");
    }

    #[test]
    fn adaptive_place_keeps_the_call_guarantees() {
        // Offload under the adaptive policy: every expert placed, a token never names one
        // slot twice, and a call never evicts what it names.
        let mut rng = Rng(5);
        let mut c = SlotCache::with_policy(10, 40, adaptive(16.0, 2.0)).unwrap();
        for t in 0..2000 {
            let mut ids = Vec::new();
            for _ in 0..2 {
                let mut tok = Vec::new();
                rng.distinct(4, 0, if t % 2 == 0 { 12 } else { 40 }, &mut tok);
                ids.extend(tok);
            }
            let layer = t % 3;
            let (slots, up) = place(&mut c, layer, &ids, 4);
            for tok in slots.chunks(4) {
                assert!(tok.iter().all(|&s| s >= 0));
                assert!((1..4).all(|i| !tok[..i].contains(&tok[i])));
            }
            for u in &up {
                if let Some((l, e)) = u.evicted {
                    assert!(l != layer || !ids.contains(&(e as i32)), "step {t}");
                }
            }
            for (&e, &s) in ids.iter().zip(&slots) {
                assert_eq!(c.slot_of(layer, e as usize), Some(s as usize));
            }
        }
    }
}
