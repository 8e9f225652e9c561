//! The GPU expert slot cache's bookkeeping for one slot pool: which (layer, expert) sits in
//! which slot, least-recently-used eviction, and the uploads a call needs. Nothing here touches
//! a GPU; the engine performs the uploads this module asks for.
//!
//! Data structures, and why:
//! - Expert ids are small dense integers, so each layer the pool has seen gets a dense row of
//!   `n_experts` entries (its experts' slots): no hashing per route, and a whole model's table
//!   is tiny (94 layers x 256 experts x 8 bytes is under 200 KB).
//! - Recency is an intrusive doubly linked list over slot indices (`prev`/`next` arrays):
//!   touching a slot and evicting the least recently used one are O(1), with no heap or scan.
//! - Each call removes duplicate experts with a generation stamp per expert instead of
//!   clearing a set, so a call costs O(routes) to check and O(distinct experts) to place.
//!
//! Order within one call (the reference the tests check against): the call's distinct experts
//! are taken in order of first appearance; hits are touched first, in that order; then each
//! miss takes the lowest-numbered free slot, else the least recently used slot, and becomes the
//! most recently used. Since every hit of the call was touched before any eviction and every
//! placed miss is at the recent end, the least recently used slot is never one this call named
//! while the call has at most `n_slots` distinct experts (checked first): a slot is never given
//! to two experts in one call, and a token (whose top-k ids are distinct, also checked) never
//! names one slot twice, the guard ggml-cuda's MMQ needs (llama.cpp #24591).

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
}

impl SlotCache {
    /// An empty pool of `n_slots` slots for layers of `n_experts` experts each.
    pub fn new(n_slots: usize, n_experts: usize) -> Result<SlotCache> {
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
        })
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
        let mut hits = 0;
        for &key in &distinct {
            let slot = self.slot_of[key as usize];
            if slot != NONE {
                self.touch(slot);
                hits += 1;
            }
        }
        let mut uploads = Vec::with_capacity(distinct.len() - hits);
        for &key in &distinct {
            if self.slot_of[key as usize] == NONE {
                uploads.push(self.fill(key));
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
        let mut hits = 0u64;
        for &key in &distinct {
            let slot = self.slot_of[key as usize];
            if slot != NONE {
                self.touch(slot);
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

    /// Makes `expert` of `layer` resident (adaptive fill): None when it already is (it is then
    /// touched), else the upload to perform. Nothing is protected from eviction here: the
    /// caller must not insert while a computation still reads the slot this may evict.
    pub fn insert(&mut self, layer: usize, expert: usize) -> Result<Option<Upload>> {
        self.check_expert(layer, expert)?;
        let row = self.row(layer)?;
        let key = (row * self.n_experts + expert) as u32;
        let slot = self.slot_of[key as usize];
        if slot != NONE {
            self.touch(slot);
            return Ok(None);
        }
        Ok(Some(self.fill(key)))
    }

    /// Fills an empty pool from a profile: `residents[i]` goes to slot `i`, `residents[0]`
    /// most recently used (list them hottest first, so the coldest is evicted first). Returns
    /// the uploads. An error, with nothing changed, on a non-empty pool, too many residents,
    /// an expert out of range or listed twice.
    pub fn seed(&mut self, residents: &[(usize, usize)]) -> Result<Vec<Upload>> {
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
        // Pushed coldest first, so residents[0] ends most recently used.
        for slot in (0..keys.len()).rev() {
            self.push_mru(slot as u32);
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
            self.stamp = 1;
        }
        self.stamp
    }

    /// Puts the miss `key` into the lowest free slot, else the least recently used one.
    fn fill(&mut self, key: u32) -> Upload {
        let (slot, evicted) = if self.filled < self.n_slots {
            self.filled += 1;
            ((self.filled - 1) as u32, None)
        } else {
            let slot = self.lru;
            self.unlink(slot);
            let old = self.owner[slot as usize];
            self.slot_of[old as usize] = NONE;
            self.stats[old as usize / self.n_experts].evictions += 1;
            (slot, Some(self.layer_expert(old)))
        };
        self.slot_of[key as usize] = slot;
        self.owner[slot as usize] = key;
        self.push_mru(slot);
        self.stats[key as usize / self.n_experts].uploads += 1;
        let (layer, expert) = self.layer_expert(key);
        Upload {
            layer,
            expert,
            slot: slot as usize,
            evicted,
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
}
