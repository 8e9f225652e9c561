//! The replacement policies of the GPU expert slot cache ([`crate::slots::SlotCache`]) and
//! the two structures the adaptive one runs on: decayed route counts per (layer, expert) and
//! an indexed min-heap over the slots.
//!
//! # The policies
//!
//! - [`Policy::Lru`]: every expert a call needs is made resident, evicting the least recently
//!   used slot. What `offload` (`place`) has always done, and the baseline below.
//! - [`Policy::Adaptive`]: least-frequently-used with exponential aging, behind an admission
//!   test (the idea of TinyLFU, with exact counts: a model's experts are few and dense, so
//!   no sketch is needed). Every route any call names, hit or miss, adds 1 to its expert's
//!   score, and every score halves over `half_life` tokens (a token: one call of each layer
//!   of the pool, so layers sharing a pool are compared on one clock). While a slot is free a
//!   missed expert takes it; once the pool is full a missed expert replaces the resident with
//!   the lowest score (ties: the least recently used), among those no layer's current step
//!   names, only if its own score is higher by more than `margin` routes plus
//!   [`SIGNIFICANCE`] standard deviations of the difference. Otherwise it stays on the CPU.
//!
//! Why: MoE expert popularity is skewed and stable per layer over thousands of tokens. LRU
//! spends slots on the cold experts that were merely named last, so under a stable skewed
//! popularity it keeps fewer hot ones than a frequency count does; the aging lets the count
//! follow a popularity that drifts, within a few half-lives. Under uniform routing no policy
//! can beat the pool's share of the experts, and this one matches it while uploading far
//! less than LRU (a swap needs evidence, `margin`). Simulated hybrid decode (4 layers of 128
//! experts, top-8, sharing a pool of 10 / 25 / 50% of their experts; benches/README.md,
//! "Expert cache policy (simulation)"): the hit rate is 1.92x / 1.38x / 1.14x LRU's under the
//! Zipf 0.55 popularity of `make-test-model`, within 1 point of the best fixed set of
//! experts, and 0.99x to 1.00x LRU's under uniform routing, with 0.01 to 0.1 uploads a token
//! against LRU's 12 to 29.
//!
//! # How it is computed
//!
//! Scores are stored inflated: a route at time `t` (tokens) adds `2^(t / half_life)` instead
//! of decaying every other score, so a call touches only the scores of its own routes and the
//! order of the stored values is the order of the decayed counts. When the inflation reaches
//! `2^RESCALE_LOG2` every stored value is multiplied by `2^-RESCALE_LOG2` (exact in floating
//! point, order kept, but for scores so old that they underflow towards zero) and the heap is
//! rebuilt: once per `RESCALE_LOG2` half-lives.
//!
//! The heap holds the occupied slots keyed by (stored score, last use), so the coldest
//! resident is found in O(1) and a hit or an upload costs O(log slots). Protected residents
//! (named by a current step) are skipped by a best-first walk of the heap from its root, which
//! visits only protected slots and their children.

use crate::{Error, Result};

/// Default half-life of the adaptive scores, in tokens. Chosen on the simulation of
/// `benches/cache_policy.py` (benches/README.md): shorter ones lose hit rate to noise on
/// stable skewed routing, longer ones adapt too slowly after a popularity change.
pub const DEFAULT_HALF_LIFE: f64 = 128.0;
/// Default admission margin, in routes. On the same simulation margins of 0 to 4 routes give
/// hit rates within half a point of each other, and the uploads fall with the margin (uniform
/// routing, pool of 25%: 4.6 experts a token at 0, 0.9 at 2); 2 keeps a swap for real
/// evidence without slowing the response to a popularity change.
pub const DEFAULT_MARGIN: f64 = 2.0;
/// Standard deviations by which a candidate's count must beat the victim's, on top of the
/// margin: route counts are Poisson-like, so their difference has a spread of about
/// sqrt(sum). Without it, under uniform routing the best of ~100 missed experts beats the
/// worst of the residents by chance every few tokens: swaps that gain nothing and cost an
/// upload each (host bandwidth the CPU half needs).
pub const SIGNIFICANCE: f64 = 1.5;
/// The adaptive admission test: a candidate with decayed route count `new` may replace a
/// resident with `old` when it beats it by more than `margin` plus [`SIGNIFICANCE`] spreads.
pub(crate) fn admits(new: f64, old: f64, margin: f64) -> bool {
    new > old + margin + SIGNIFICANCE * (new + old).sqrt()
}

/// log2 of the inflation at which stored scores are rescaled.
const RESCALE_LOG2: f64 = 512.0;

const NONE: u32 = u32::MAX;

/// A slot cache's replacement policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// Least recently used; every needed expert is admitted.
    Lru,
    /// Aged route counts with an admission test (module documentation).
    Adaptive {
        /// Tokens over which a score halves; finite and positive.
        half_life: f64,
        /// Routes by which a missed expert's score must exceed its victim's; finite, >= 0.
        margin: f64,
    },
}

impl Policy {
    /// The adaptive policy with the default half-life and margin.
    pub fn adaptive() -> Policy {
        Policy::Adaptive {
            half_life: DEFAULT_HALF_LIFE,
            margin: DEFAULT_MARGIN,
        }
    }

    /// The policy called `name` ("lru" or "adaptive"), with `half_life` and `margin` for
    /// the adaptive one (defaults when None; an error when given for "lru").
    pub fn from_name(name: &str, half_life: Option<f64>, margin: Option<f64>) -> Result<Policy> {
        let p = match name {
            "lru" if half_life.is_none() && margin.is_none() => Policy::Lru,
            "lru" => {
                return Err(Error::InvalidInput(
                    "half_life and margin apply to the adaptive policy only".into(),
                ))
            }
            "adaptive" => Policy::Adaptive {
                half_life: half_life.unwrap_or(DEFAULT_HALF_LIFE),
                margin: margin.unwrap_or(DEFAULT_MARGIN),
            },
            other => {
                return Err(Error::InvalidInput(format!(
                    "slot cache policy `{other}` is not `lru` or `adaptive`"
                )))
            }
        };
        p.check()?;
        Ok(p)
    }

    /// "lru" or "adaptive".
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Adaptive { .. } => "adaptive",
        }
    }

    /// An error for a half-life that is not finite and positive or a margin that is not
    /// finite and non-negative.
    pub fn check(&self) -> Result<()> {
        if let Policy::Adaptive { half_life, margin } = *self {
            if !(half_life.is_finite() && half_life > 0.0) {
                return Err(Error::InvalidInput(format!(
                    "the adaptive policy's half-life must be a positive number of tokens, not \
                     {half_life}"
                )));
            }
            if !(margin.is_finite() && margin >= 0.0) {
                return Err(Error::InvalidInput(format!(
                    "the adaptive policy's margin must be a non-negative number of routes, not \
                     {margin}"
                )));
            }
        }
        Ok(())
    }
}

/// Exponentially aged route counts per key, stored inflated (module documentation).
#[derive(Debug, Clone)]
pub(crate) struct Scores {
    value: Vec<f64>,
    rate: f64, // 1 / half-life: log2 of the inflation per token
    log2_unit: f64,
    unit: f64, // 2^log2_unit: what one route adds now
}

impl Scores {
    pub(crate) fn new(half_life: f64) -> Scores {
        Scores {
            value: Vec::new(),
            rate: 1.0 / half_life,
            log2_unit: 0.0,
            unit: 1.0,
        }
    }

    pub(crate) fn resize(&mut self, n: usize) {
        self.value.resize(n, 0.0);
    }

    /// Moves the clock on by `tokens`. True when the stored values were rescaled (their
    /// order is kept, but a copy of them, the heap's, must be refreshed).
    pub(crate) fn advance(&mut self, tokens: f64) -> bool {
        self.log2_unit += tokens * self.rate;
        let rescale = self.log2_unit >= RESCALE_LOG2;
        if rescale {
            let f = (-RESCALE_LOG2).exp2();
            self.value.iter_mut().for_each(|v| *v *= f);
            self.log2_unit -= RESCALE_LOG2;
        }
        self.unit = self.log2_unit.exp2();
        rescale
    }

    /// Counts `routes` routes of `key` now.
    pub(crate) fn add(&mut self, key: usize, routes: f64) {
        self.value[key] += routes * self.unit;
    }

    /// Sets the score of `key` to the aged count of a key routed `rate` times per token at
    /// every token up to now: rate / (1 - 2^(-1 / half-life)).
    pub(crate) fn set_steady(&mut self, key: usize, rate: f64) {
        self.value[key] = rate / (1.0 - (-self.rate).exp2()) * self.unit;
    }

    /// The stored (inflated) score: comparable with any other key's at any time.
    pub(crate) fn stored(&self, key: usize) -> f64 {
        self.value[key]
    }

    /// The decayed route count of `key` now.
    pub(crate) fn count(&self, key: usize) -> f64 {
        self.value[key] / self.unit
    }
}

/// A heap key: (stored score, last use), lower is colder.
pub(crate) type HeapKey = (f64, u64);

fn less(a: HeapKey, b: HeapKey) -> bool {
    a.0 < b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// An indexed binary min-heap over slots `0..n`, each with a key.
#[derive(Debug, Clone)]
pub(crate) struct SlotHeap {
    heap: Vec<u32>,
    pos: Vec<u32>, // slot -> index in `heap`, or NONE
    key: Vec<HeapKey>,
}

impl SlotHeap {
    pub(crate) fn new(n: usize) -> SlotHeap {
        SlotHeap {
            heap: Vec::with_capacity(n),
            pos: vec![NONE; n],
            key: vec![(0.0, 0); n],
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, slot: usize) -> bool {
        self.pos[slot] != NONE
    }

    pub(crate) fn clear(&mut self) {
        self.heap.clear();
        self.pos.fill(NONE);
    }

    /// Inserts `slot` or changes its key.
    pub(crate) fn set(&mut self, slot: usize, key: HeapKey) {
        if self.pos[slot] == NONE {
            self.key[slot] = key;
            self.pos[slot] = self.heap.len() as u32;
            self.heap.push(slot as u32);
            self.up(self.heap.len() - 1);
        } else {
            let old = self.key[slot];
            self.key[slot] = key;
            let i = self.pos[slot] as usize;
            if less(key, old) {
                self.up(i);
            } else {
                self.down(i);
            }
        }
    }

    pub(crate) fn remove(&mut self, slot: usize) {
        let i = self.pos[slot];
        if i == NONE {
            return;
        }
        let i = i as usize;
        let last = self.heap.len() - 1;
        self.swap(i, last);
        self.heap.pop();
        self.pos[slot] = NONE;
        if i < self.heap.len() {
            self.down(i);
            self.up(i);
        }
    }

    /// Gives every slot the key `key_of(slot, old key)` and restores the heap order: O(n).
    pub(crate) fn rebuild(&mut self, mut key_of: impl FnMut(usize, HeapKey) -> HeapKey) {
        for &s in &self.heap {
            self.key[s as usize] = key_of(s as usize, self.key[s as usize]);
        }
        for i in (0..self.heap.len() / 2).rev() {
            self.down(i);
        }
    }

    /// The slot with the lowest key among those `skip` refuses, if any: best-first from the
    /// root, so only skipped slots and their children are visited.
    pub(crate) fn min_where(&self, mut skip: impl FnMut(usize) -> bool) -> Option<usize> {
        if self.heap.is_empty() {
            return None;
        }
        let mut frontier: Vec<usize> = vec![0]; // heap indices
        while !frontier.is_empty() {
            let (j, &i) = frontier
                .iter()
                .enumerate()
                .min_by(|a, b| {
                    let (ka, kb) = (self.key_at(*a.1), self.key_at(*b.1));
                    if less(ka, kb) {
                        std::cmp::Ordering::Less
                    } else if less(kb, ka) {
                        std::cmp::Ordering::Greater
                    } else {
                        std::cmp::Ordering::Equal
                    }
                })
                .expect("non-empty");
            frontier.swap_remove(j);
            let slot = self.heap[i] as usize;
            if !skip(slot) {
                return Some(slot);
            }
            for c in [2 * i + 1, 2 * i + 2] {
                if c < self.heap.len() {
                    frontier.push(c);
                }
            }
        }
        None
    }

    fn key_at(&self, i: usize) -> HeapKey {
        self.key[self.heap[i] as usize]
    }

    fn swap(&mut self, i: usize, j: usize) {
        self.heap.swap(i, j);
        self.pos[self.heap[i] as usize] = i as u32;
        self.pos[self.heap[j] as usize] = j as u32;
    }

    fn up(&mut self, mut i: usize) {
        while i > 0 {
            let p = (i - 1) / 2;
            if !less(self.key_at(i), self.key_at(p)) {
                break;
            }
            self.swap(i, p);
            i = p;
        }
    }

    fn down(&mut self, mut i: usize) {
        let n = self.heap.len();
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut m = i;
            if l < n && less(self.key_at(l), self.key_at(m)) {
                m = l;
            }
            if r < n && less(self.key_at(r), self.key_at(m)) {
                m = r;
            }
            if m == i {
                break;
            }
            self.swap(i, m);
            i = m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    #[test]
    fn scores_halve_every_half_life_and_survive_rescaling() {
        let mut s = Scores::new(10.0);
        s.resize(2);
        s.add(0, 3.0);
        s.advance(10.0);
        assert!((s.count(0) - 1.5).abs() < 1e-12);
        s.add(1, 1.0);
        assert!((s.count(1) - 1.0).abs() < 1e-12);
        // Past several rescalings: 2000 half-lives in steps of 7 tokens.
        let mut rescaled = 0;
        for _ in 0..(20_000 / 7) {
            rescaled += s.advance(7.0) as usize;
            s.add(1, 1.0);
        }
        assert!(rescaled >= 3, "{rescaled}");
        // One route every 7 tokens, aged by 2^(-1/10) per token: the sum of a geometric series.
        let q = (-0.7f64).exp2();
        assert!(
            (s.count(1) - 1.0 / (1.0 - q)).abs() < 1e-9,
            "{}",
            s.count(1)
        );
        assert_eq!(s.count(0), 0.0); // 2000 half-lives: underflowed
        assert!(s.stored(1) > s.stored(0));
    }

    #[test]
    fn heap_matches_a_scan() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let n = 37;
        let mut h = SlotHeap::new(n);
        let mut keys: Vec<Option<HeapKey>> = vec![None; n];
        for step in 0..20_000u64 {
            let slot = rng.below(n);
            match rng.below(4) {
                0 => {
                    h.remove(slot);
                    keys[slot] = None;
                }
                _ => {
                    // Few distinct scores, so that ties on the score are common.
                    let k = (rng.below(8) as f64, step);
                    h.set(slot, k);
                    keys[slot] = Some(k);
                }
            }
            if step % 997 == 0 {
                let f = 0.5;
                h.rebuild(|s, old| {
                    assert_eq!(Some(old), keys[s]);
                    (old.0 * f, old.1)
                });
                keys.iter_mut().flatten().for_each(|k| k.0 *= f);
            }
            let skip = |s: usize| s % 3 == step as usize % 3;
            let want = (0..n)
                .filter(|&s| keys[s].is_some() && !skip(s))
                .min_by(|&a, &b| keys[a].partial_cmp(&keys[b]).unwrap());
            assert_eq!(h.min_where(skip), want, "step {step}");
            assert_eq!(h.len(), keys.iter().flatten().count());
            assert!((0..n).all(|s| h.contains(s) == keys[s].is_some()));
        }
    }

    #[test]
    fn policy_names_and_checks() {
        assert_eq!(Policy::from_name("lru", None, None).unwrap(), Policy::Lru);
        assert_eq!(
            Policy::from_name("adaptive", Some(64.0), None).unwrap(),
            Policy::Adaptive {
                half_life: 64.0,
                margin: DEFAULT_MARGIN
            }
        );
        assert!(Policy::from_name("lfu", None, None).is_err());
        assert!(Policy::from_name("lru", Some(1.0), None).is_err());
        for (h, m) in [
            (0.0, 1.0),
            (f64::NAN, 1.0),
            (f64::INFINITY, 1.0),
            (8.0, -1.0),
        ] {
            assert!(
                Policy::from_name("adaptive", Some(h), Some(m)).is_err(),
                "{h} {m}"
            );
        }
        assert_eq!(Policy::adaptive().name(), "adaptive");
    }
}
