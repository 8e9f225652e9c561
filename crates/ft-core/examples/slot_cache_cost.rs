//! What the slot cache's bookkeeping costs per decode step under hybrid decode: `lookup` and
//! `admit` for every layer of one pool, LRU against adaptive, on skewed routes (weights
//! rank^-0.55 per layer, top-8 distinct of 128).
//!
//!     cargo run --release -p ft-core --example slot_cache_cost [layers] [pool fraction]

use ft_core::slot_policy::Policy;
use ft_core::slots::SlotCache;
use std::time::Instant;

const EXPERTS: usize = 128;
const TOP_K: usize = 8;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let layers: usize = args.get(1).map_or(48, |a| a.parse().expect("layers"));
    let frac: f64 = args.get(2).map_or(0.25, |a| a.parse().expect("fraction"));
    let n_slots = ((layers * EXPERTS) as f64 * frac).round() as usize;
    let tokens = 4000;
    // Routes: per layer a rotation of the ranks; draws without replacement by rejection.
    let weights: Vec<f64> = (1..=EXPERTS).map(|r| (r as f64).powf(-0.55)).collect();
    let total: f64 = weights.iter().sum();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut routes = vec![0i32; tokens * layers * TOP_K];
    for (i, tok) in routes.chunks_mut(TOP_K).enumerate() {
        let layer = i % layers;
        let mut n = 0;
        while n < TOP_K {
            let mut u = uniform() * total;
            let mut rank = 0;
            while rank + 1 < EXPERTS && u >= weights[rank] {
                u -= weights[rank];
                rank += 1;
            }
            let e = ((rank + layer * 37) % EXPERTS) as i32;
            if !tok[..n].contains(&e) {
                tok[n] = e;
                n += 1;
            }
        }
    }
    println!("{layers} layers x {EXPERTS} experts, top-{TOP_K}, {n_slots} slots, {tokens} tokens");
    for policy in [Policy::Lru, Policy::adaptive()] {
        let mut c = SlotCache::with_policy(n_slots, EXPERTS, policy).unwrap();
        let mut out = [0i32; TOP_K];
        let mut missed: Vec<Vec<usize>> = vec![Vec::new(); layers];
        let (mut hits, mut uploads) = (0usize, 0usize);
        let t0 = Instant::now();
        for step in routes.chunks(layers * TOP_K) {
            for (layer, ids) in step.chunks(TOP_K).enumerate() {
                hits += c.lookup(layer, ids, TOP_K, &mut out).unwrap();
                missed[layer].clear();
                missed[layer].extend(
                    ids.iter()
                        .zip(&out)
                        .filter(|(_, &s)| s < 0)
                        .map(|(&e, _)| e as usize),
                );
            }
            for (layer, m) in missed.iter().enumerate() {
                uploads += c.admit(layer, m, TOP_K).unwrap().len();
            }
        }
        let dt = t0.elapsed().as_secs_f64();
        println!(
            "{:<8} {:6.1} us per token ({:.2} us per layer), hit rate {:.3}, {:.1} uploads per token",
            policy.name(),
            dt / tokens as f64 * 1e6,
            dt / (tokens * layers) as f64 * 1e6,
            hits as f64 / routes.len() as f64,
            uploads as f64 / tokens as f64
        );
    }
}
