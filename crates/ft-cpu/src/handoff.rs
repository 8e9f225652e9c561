//! The host half of the GPU hand-off (hybrid MoE; the protocol is in
//! `cuda/include/freetoken_cuda.h`, "hand-off", and docs/hybrid.md).
//!
//! A block of [`WORDS`] int64 words in page-locked host memory that the GPU maps: the GPU's
//! `signal` kernel writes a tag, then the request's sequence number; [`HandoffBlock::serve`]
//! sees it, answers (computes the layer's missed routes into host memory the GPU reads), and
//! writes the same number back, which the GPU's `wait_add` kernel spins on. Requests come one
//! at a time and in order, so one pair of sequence words is the whole protocol; the host
//! thread returns when the stop word is set and nothing is pending.

use freetoken_ggml::{Error, Result};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use crate::moe::SKIP_ROUTE;

/// The block's layout: `FT_CUDA_HANDOFF_*` in `cuda/include/freetoken_cuda.h`, which is the
/// source (ft-cuda's tests compare these with it).
pub mod words {
    /// int64 words of a block.
    pub const WORDS: usize = 8;
    /// Written by a request: the latest one.
    pub const GPU_SEQ: usize = 0;
    /// Written by the host: the latest answer.
    pub const CPU_SEQ: usize = 1;
    /// Written by a request: what it is about.
    pub const TAG: usize = 2;
    /// Written by the GPU's wait: the request it gave up on.
    pub const TIMEOUT: usize = 3;
    /// Written by the host: a request it could not answer.
    pub const ERROR: usize = 4;
    /// Written by the host's owner: the host thread may return when idle.
    pub const STOP: usize = 5;
    /// Host only: requests answered.
    pub const ANSWERED: usize = 6;
    /// Host only: nanoseconds spent answering.
    pub const BUSY_NS: usize = 7;
}
use words::*;

/// Spins before the waiting thread starts yielding its core, then sleeping: a request
/// usually follows within microseconds; an idle stretch (a long prompt, the host between
/// steps) should not burn a core.
const SPINS: u32 = 1 << 14;
const YIELD_FOR: Duration = Duration::from_millis(5);
const NAP: Duration = Duration::from_micros(20);

/// A hand-off block in host memory.
pub struct HandoffBlock<'a> {
    words: &'a [AtomicI64],
}

/// What one request carries in its tag: which of the served layers, and its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// The position of the layer in the served list.
    pub layer: usize,
    /// Tokens of the step.
    pub n_tokens: usize,
}

impl Request {
    /// The tag the GPU writes for this request.
    pub fn tag(self) -> i64 {
        ((self.n_tokens as i64) << 32) | self.layer as i64
    }

    fn of_tag(tag: i64) -> Request {
        Request {
            layer: (tag & 0xffff_ffff) as usize,
            n_tokens: (tag >> 32) as usize,
        }
    }
}

impl<'a> HandoffBlock<'a> {
    /// The block at `addr` (checked: non-null, 8-byte aligned).
    ///
    /// # Safety
    /// `addr` must point at [`WORDS`] int64 that stay valid for `'a` and that others (the GPU,
    /// the Python side) only read or write whole words.
    pub unsafe fn from_raw(addr: usize) -> Result<HandoffBlock<'a>> {
        if addr == 0 || !addr.is_multiple_of(8) {
            return Err(Error::InvalidInput(format!(
                "hand-off block address {addr:#x} is null or not 8-byte aligned"
            )));
        }
        // SAFETY: per the contract; AtomicI64 has the layout of i64.
        let words = unsafe { std::slice::from_raw_parts(addr as *const AtomicI64, WORDS) };
        Ok(HandoffBlock { words })
    }

    fn get(&self, i: usize) -> i64 {
        self.words[i].load(Ordering::Acquire)
    }

    fn set(&self, i: usize, v: i64) {
        self.words[i].store(v, Ordering::Release)
    }

    /// Answers requests with `answer` until the stop word is set and every request is
    /// answered. A failed answer is still acknowledged (the GPU must not wait for it) and
    /// recorded in the error word; the first error is returned after stopping. Returns the
    /// requests answered.
    pub fn serve(&self, mut answer: impl FnMut(Request) -> Result<()>) -> Result<u64> {
        let mut served = 0u64;
        let mut first_err = None;
        loop {
            let last = self.get(CPU_SEQ);
            let Some(seq) = self.next_request(last) else {
                break;
            };
            let t0 = Instant::now();
            let r = if seq != last + 1 {
                Err(Error::Device(format!(
                    "hand-off out of step: request {seq} after answer {last}"
                )))
            } else {
                answer(Request::of_tag(self.get(TAG)))
            };
            if let Err(e) = r {
                self.set(ERROR, seq);
                first_err.get_or_insert(e);
            }
            self.set(CPU_SEQ, seq);
            served += 1;
            // Host-only statistics, read by the engine between steps.
            self.words[ANSWERED].fetch_add(1, Ordering::Relaxed);
            let ns = i64::try_from(t0.elapsed().as_nanos()).unwrap_or(i64::MAX);
            self.words[BUSY_NS].fetch_add(ns, Ordering::Relaxed);
        }
        first_err.map_or(Ok(served), Err)
    }

    /// The next request's number, or None once stopped with nothing pending.
    fn next_request(&self, last: i64) -> Option<i64> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = self.get(GPU_SEQ);
            if g != last {
                return Some(g);
            }
            if self.get(STOP) != 0 {
                return None;
            }
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else if start.elapsed() < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }

    /// The request the GPU gave up waiting for (0: none).
    pub fn timed_out(&self) -> i64 {
        self.get(TIMEOUT)
    }
}

/// The routes the host computes: `ids` with every expert that `resident` (expert -> slot, -1
/// when not on the GPU) places in a slot replaced by [`SKIP_ROUTE`]. Returns the routes left.
pub fn missed_routes(ids: &[i32], resident: &[i32], out: &mut [i32]) -> Result<usize> {
    if out.len() != ids.len() {
        return Err(Error::Shape(format!(
            "{} routes into {} outputs",
            ids.len(),
            out.len()
        )));
    }
    let mut left = 0;
    for (o, &id) in out.iter_mut().zip(ids) {
        let slot = usize::try_from(id)
            .ok()
            .and_then(|e| resident.get(e))
            .ok_or_else(|| {
                Error::InvalidInput(format!(
                    "expert id {id} outside [0, {}) in a hand-off",
                    resident.len()
                ))
            })?;
        *o = if *slot >= 0 { SKIP_ROUTE } else { id };
        left += usize::from(*slot < 0);
    }
    Ok(left)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_experts_are_skipped() {
        let resident = [-1, 3, -1, 0];
        let mut out = [0; 5];
        let left = missed_routes(&[0, 1, 2, 3, 2], &resident, &mut out).unwrap();
        assert_eq!(out, [0, SKIP_ROUTE, 2, SKIP_ROUTE, 2]);
        assert_eq!(left, 3);
        assert!(missed_routes(&[4], &resident, &mut out[..1]).is_err());
        assert!(missed_routes(&[-1], &resident, &mut out[..1]).is_err());
        assert!(missed_routes(&[0, 1], &resident, &mut out[..1]).is_err());
    }

    #[test]
    fn tags_round_trip() {
        let r = Request {
            layer: 47,
            n_tokens: 256,
        };
        assert_eq!(Request::of_tag(r.tag()), r);
    }

    #[test]
    fn requests_are_answered_in_order_until_stopped() {
        let words: Vec<AtomicI64> = (0..WORDS).map(|_| AtomicI64::new(0)).collect();
        let addr = words.as_ptr() as usize;
        let gpu = std::thread::spawn(move || {
            // SAFETY: `words` outlives both threads (joined below).
            let b = unsafe { HandoffBlock::from_raw(addr).unwrap() };
            for seq in 1..=3i64 {
                b.set(
                    TAG,
                    Request {
                        layer: seq as usize,
                        n_tokens: 1,
                    }
                    .tag(),
                );
                b.set(GPU_SEQ, seq);
                while b.get(CPU_SEQ) < seq {
                    std::hint::spin_loop();
                }
            }
            b.set(STOP, 1);
        });
        // SAFETY: as above.
        let b = unsafe { HandoffBlock::from_raw(addr).unwrap() };
        let mut seen = vec![];
        let served = b
            .serve(|r| {
                seen.push(r.layer);
                if r.layer == 2 {
                    Err(Error::InvalidInput("layer 2 fails".into()))
                } else {
                    Ok(())
                }
            })
            .unwrap_err();
        gpu.join().unwrap();
        assert!(served.to_string().contains("layer 2 fails"));
        assert_eq!(seen, [1, 2, 3]);
        assert_eq!(b.get(ERROR), 2);
        assert_eq!(b.get(CPU_SEQ), 3);
        assert_eq!(b.timed_out(), 0);
        assert_eq!(b.get(ANSWERED), 3);
    }
}
