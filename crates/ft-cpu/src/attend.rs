//! One token's attention on the CPU in one call: the heads' RMS norms, RoPE, the store of its
//! key and value into the cache and its query's attention over the cached positions, a long
//! context split over the thread pool. Torch operations instead would each pay their own
//! dispatch (microseconds) on vectors of a few hundred values.
//!
//! RoPE rounds as the torch path does (`x cos` and `x' sin` rounded, then added); the norm
//! sums its squares in f64 as ggml's `rms_norm` does; the dot products sum in eight f32 lanes
//! (under AVX2 four chains of them, with fused multiply-adds); under AVX2 the softmax's
//! exponentials run in eight lanes too (`simd::exp8`, within a few ulp of `exp`).
//!
//! The cache holds float32 or half-precision rows ([`CacheElem`]; llama.cpp's default
//! `--cache-type-k/v f16` halves what a long context reads): a key or value is stored rounded
//! to the nearest half and read back exactly, so a half cache computes what a float32 cache
//! holding the rounded values would.

use crate::isa::{cpu_isa, CpuIsa};
use crate::pool::ThreadPool;
use freetoken_ggml::{Error, Result};
pub use half::f16;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::Mutex;

/// The element type of a cache row: `f32` or [`f16`].
pub trait CacheElem: Copy + Send + Sync {
    /// `x` rounded to this type (to nearest, ties to even).
    fn from_f32(x: f32) -> Self;
    /// The value as float32 (exact).
    fn to_f32(self) -> f32;
    /// Eight values at `p` as float32 lanes.
    ///
    /// # Safety
    /// `p` points at eight values; the caller runs with AVX2, FMA and F16C enabled.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl CacheElem for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: per the contract.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl CacheElem for f16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: per the contract (F16C converts the eight halves).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// RoPE's rotation of one position: `cos` and `sin` of each of the `n_rot / 2` angles.
#[derive(Clone, Copy)]
pub struct Rope<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// NEOX pairs dim `i` with `i + n_rot / 2`; otherwise adjacent dims pair.
    pub neox: bool,
}

/// The sizes and the per-head operations of one layer's attention.
#[derive(Clone, Copy)]
pub struct OneTokenAttention<'a> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// RMS norm weights over each query head and each key head (before RoPE).
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub eps: f32,
    pub rope: Option<Rope<'a>>,
    /// The factor on the queries' scores.
    pub scale: f32,
    /// Per query head, a logit that joins the softmax's denominator and carries no value.
    pub sinks: Option<&'a [f32]>,
}

/// One layer's cache (`rows` positions of `kv_heads` keys and values each, of the element types
/// `K` and `V`), the rows a token is stored at and the rows its query reads.
pub struct LayerCache<'a, K = f32, V = f32> {
    pub keys: &'a mut [K],
    pub values: &'a mut [V],
    pub write: &'a [usize],
    pub read: Range<usize>,
}

impl OneTokenAttention<'_> {
    fn check(&self, q: &[f32], k: &[f32], v: &[f32], out: &[f32]) -> Result<()> {
        let (h, hkv, d, dv) = (self.heads, self.kv_heads, self.head_dim, self.head_dim_v);
        let shape = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(Error::Shape(format!(
                    "{what} has {got} values, expected {want}"
                )))
            }
        };
        if hkv == 0 || d == 0 || !h.is_multiple_of(hkv) {
            return Err(Error::Shape(format!(
                "{h} query heads over {hkv} key heads of {d} dims: the query heads must be a \
                 positive multiple of the key heads"
            )));
        }
        shape("q", q.len(), h * d)?;
        shape("k", k.len(), hkv * d)?;
        shape("v", v.len(), hkv * dv)?;
        shape("out", out.len(), h * dv)?;
        for (what, w) in [("q_norm", self.q_norm), ("k_norm", self.k_norm)] {
            if let Some(w) = w {
                shape(what, w.len(), d)?;
            }
        }
        if let Some(r) = self.rope {
            shape("sin", r.sin.len(), r.cos.len())?;
            if r.cos.is_empty() || 2 * r.cos.len() > d {
                return Err(Error::Shape(format!(
                    "RoPE of {} angles on heads of {d} dims",
                    r.cos.len()
                )));
            }
        }
        if let Some(s) = self.sinks {
            shape("sinks", s.len(), h)?;
        }
        Ok(())
    }

    /// Norms and rotates the token's query `q [heads, head_dim]` and key `k [kv_heads,
    /// head_dim]`, stores the key and `v [kv_heads, head_dim_v]` at each of `cache.write`,
    /// and writes the query's attention over rows `cache.read` (which must include a written
    /// row: the token sees itself) to `out [heads, head_dim_v]`. A long read range is split
    /// over `pool`'s threads, each a run of positions for every head (the parts' softmax
    /// sums and weighted values then merged under their common maximum).
    pub fn run<K: CacheElem, V: CacheElem>(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cache: LayerCache<'_, K, V>,
        out: &mut [f32],
        pool: &ThreadPool,
    ) -> Result<()> {
        let (write, read) = (cache.write, cache.read.clone());
        self.check(q, k, v, out)?;
        let (kw, vw) = (
            self.kv_heads * self.head_dim,
            self.kv_heads * self.head_dim_v,
        );
        let rows = cache.keys.len() / kw;
        if cache.keys.len() != rows * kw || cache.values.len() != rows * vw {
            return Err(Error::Shape(format!(
                "caches of {} keys and {} values are not whole rows of {kw} and {vw}",
                cache.keys.len(),
                cache.values.len()
            )));
        }
        if read.is_empty() || read.end > rows || !write.iter().any(|w| read.contains(w)) {
            return Err(Error::Shape(format!(
                "rows {read:?} read and {write:?} written in a cache of {rows}: the read range \
                 must hold a written row"
            )));
        }
        if let Some(w) = write.iter().find(|&&w| w >= rows) {
            return Err(Error::Shape(format!("row {w} of a cache of {rows}")));
        }
        let mut qh = q.to_vec();
        let mut kh = k.to_vec();
        for x in qh.chunks_exact_mut(self.head_dim) {
            self.head(x, self.q_norm);
        }
        for x in kh.chunks_exact_mut(self.head_dim) {
            self.head(x, self.k_norm);
        }
        for &w in write {
            let (kr, vr) = (
                &mut cache.keys[w * kw..(w + 1) * kw],
                &mut cache.values[w * vw..(w + 1) * vw],
            );
            kr.iter_mut()
                .zip(&kh)
                .for_each(|(c, x)| *c = K::from_f32(*x));
            vr.iter_mut().zip(v).for_each(|(c, x)| *c = V::from_f32(*x));
        }
        let keys = &cache.keys[read.start * kw..read.end * kw];
        let values = &cache.values[read.start * vw..read.end * vw];
        let avx2 = cpu_isa()? >= CpuIsa::Avx2;
        let qs: Vec<f32> = qh.iter().map(|x| x * self.scale).collect();
        let n = read.len();
        let n_tasks = (n / MIN_POSITIONS_PER_TASK).clamp(1, pool.n_threads());
        let per_task = n.div_ceil(n_tasks);
        let parts: Vec<Mutex<Option<Part>>> = (0..n_tasks).map(|_| Mutex::new(None)).collect();
        let task = |t: usize| {
            let rows = t * per_task..((t + 1) * per_task).min(n);
            let (keys, values) = (
                &keys[rows.start * kw..rows.end * kw],
                &values[rows.start * vw..rows.end * vw],
            );
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the level in use runs on this host, so it has AVX2, FMA and F16C.
                let part = unsafe { self.part_avx2(&qs, keys, values) };
                *parts[t].lock().unwrap_or_else(|e| e.into_inner()) = Some(part);
                return;
            }
            let _ = avx2;
            let part = self.part(&qs, keys, values, dot, exp_sum, axpy);
            *parts[t].lock().unwrap_or_else(|e| e.into_inner()) = Some(part);
        };
        if n_tasks == 1 {
            task(0);
        } else {
            pool.run(n_tasks, &task);
        }
        // Every task ran: the pool re-raises a task's panic.
        let parts: Vec<Part> = parts
            .into_iter()
            .map(|p| {
                p.into_inner()
                    .unwrap_or_else(|e| e.into_inner())
                    .expect("each task stores its part")
            })
            .collect();
        self.merge(&parts, out);
        Ok(())
    }

    /// `out` from the parts: per head, each part's sum and values scaled to the largest
    /// maximum (and a sink's logit, which joins the denominator only).
    fn merge(&self, parts: &[Part], out: &mut [f32]) {
        let dv = self.head_dim_v;
        for (h, o) in out.chunks_exact_mut(dv).enumerate() {
            let sink = self.sinks.map(|s| s[h]);
            let max = parts
                .iter()
                .map(|p| p.max[h])
                .chain(sink)
                .fold(f32::NEG_INFINITY, f32::max);
            let mut sum = sink.map_or(0.0, |s| (s - max).exp());
            o.fill(0.0);
            for p in parts {
                let w = (p.max[h] - max).exp();
                sum += w * p.sum[h];
                let acc = &p.acc[h * dv..(h + 1) * dv];
                o.iter_mut().zip(acc).for_each(|(o, a)| *o += w * a);
            }
            o.iter_mut().for_each(|o| *o /= sum);
        }
    }

    /// One head's norm and rotation, in place.
    fn head(&self, x: &mut [f32], weight: Option<&[f32]>) {
        if let Some(w) = weight {
            rms_norm(x, w, self.eps);
        }
        if let Some(r) = self.rope {
            rotate(x, r);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn part_avx2<K: CacheElem, V: CacheElem>(&self, qs: &[f32], keys: &[K], values: &[V]) -> Part {
        // The closures inherit this function's features.
        self.part(
            qs,
            keys,
            values,
            |x, y| simd::dot(x, y),
            |row, max| simd::exp_sum(row, max),
            |o, w, v| simd::axpy(o, w, v),
        )
    }

    /// The scaled queries `qs` over a run of positions' `keys` and `values`. The rows are
    /// read once, in order: each position's keys (then values) serve every query head of
    /// their key head at once, rather than the rows once per head, which a long context
    /// makes a read from memory each time. `dot`, `exp_sum` and `axpy` are the instruction
    /// set's.
    #[inline(always)]
    fn part<K, V>(
        &self,
        qs: &[f32],
        keys: &[K],
        values: &[V],
        dot: impl Fn(&[f32], &[K]) -> f32,
        exp_sum: impl Fn(&mut [f32], f32) -> f32,
        axpy: impl Fn(&mut [f32], f32, &[V]),
    ) -> Part {
        let (d, dv, hkv) = (self.head_dim, self.head_dim_v, self.kv_heads);
        let group = self.heads / hkv;
        let n = keys.len() / (hkv * d);
        let mut p = vec![0f32; self.heads * n];
        for (j, row) in keys.chunks_exact(hkv * d).enumerate() {
            for (h, qh) in qs.chunks_exact(d).enumerate() {
                let g = h / group;
                p[h * n + j] = dot(qh, &row[g * d..(g + 1) * d]);
            }
        }
        let (mut max, mut sum) = (vec![0f32; self.heads], vec![0f32; self.heads]);
        for (h, row) in p.chunks_exact_mut(n).enumerate() {
            max[h] = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            sum[h] = exp_sum(row, max[h]);
        }
        let mut acc = vec![0f32; self.heads * dv];
        for (j, row) in values.chunks_exact(hkv * dv).enumerate() {
            for (h, oh) in acc.chunks_exact_mut(dv).enumerate() {
                let g = h / group;
                axpy(oh, p[h * n + j], &row[g * dv..(g + 1) * dv]);
            }
        }
        Part { max, sum, acc }
    }
}

/// Positions below which a task's rows are too short to be worth a thread: the whole read
/// range is then one task.
const MIN_POSITIONS_PER_TASK: usize = 256;

/// A run of positions' share of every head: its largest score, the sum of the exponentials
/// under it, and their weighted sum of values (`[heads, head_dim_v]`).
struct Part {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// `x . y` in eight lanes, summed pairwise at the end.
#[inline(always)]
fn dot<T: CacheElem>(x: &[f32], y: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let tail: f32 = xc
        .remainder()
        .iter()
        .zip(yc.remainder())
        .map(|(a, b)| a * b.to_f32())
        .sum();
    for (a, b) in xc.zip(yc) {
        for l in 0..8 {
            acc[l] += a[l] * b[l].to_f32();
        }
    }
    let [a, b, c, d, e, f, g, h] = acc;
    ((a + e) + (c + g)) + ((b + f) + (d + h)) + tail
}

/// `row[i] = exp(row[i] - max)`; returns their sum.
#[inline(always)]
fn exp_sum(row: &mut [f32], max: f32) -> f32 {
    let mut sum = 0.0;
    for p in row.iter_mut() {
        *p = (*p - max).exp();
        sum += *p;
    }
    sum
}

/// `o += w y`.
#[inline(always)]
fn axpy<T: CacheElem>(o: &mut [f32], w: f32, y: &[T]) {
    o.iter_mut().zip(y).for_each(|(o, y)| *o += w * y.to_f32());
}

/// The products with AVX2 and FMA: four chains of eight lanes for a dot product (one chain
/// waits on its own additions), fused multiply-adds.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::CacheElem;
    use crate::kernels::hsum_float_8;
    use std::arch::x86_64::*;

    /// `x . y`; the lengths are equal.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot<T: CacheElem>(x: &[f32], y: &[T]) -> f32 {
        let n = x.len().min(y.len());
        let (xp, yp) = (x.as_ptr(), y.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: every load reads 8 values at i + 8 * c <= n - 8.
        unsafe {
            while i + 32 <= n {
                for (c, a) in acc.iter_mut().enumerate() {
                    let (xv, yv) = (xp.add(i + 8 * c), yp.add(i + 8 * c));
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(xv), T::load8(yv), *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                let (xv, yv) = (_mm256_loadu_ps(xp.add(i)), T::load8(yp.add(i)));
                acc[0] = _mm256_fmadd_ps(xv, yv, acc[0]);
                i += 8;
            }
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let tail: f32 = x[i..n]
            .iter()
            .zip(&y[i..n])
            .map(|(a, b)| a * b.to_f32())
            .sum();
        hsum_float_8(s) + tail
    }

    /// `exp` of eight lanes: `2^n e^r` with `n = round(x log2 e)` and `r = x - n ln 2` (ln 2 in
    /// two parts, the first exact in few bits, so that `r` loses nothing), `e^r` by its Taylor
    /// polynomial to degree 7 (its remainder under 5e-9 for |r| <= ln 2 / 2; the result within
    /// a few ulp), `2^n` written into the exponent bits. Below -87.3 (under f32's normal
    /// range) the result is 0; NaN stays NaN. Arguments up to 88 (2^n must stay finite).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn exp8(x: __m256) -> __m256 {
        const TAYLOR: [f32; 8] = [
            1.0,
            1.0,
            1.0 / 2.0,
            1.0 / 6.0,
            1.0 / 24.0,
            1.0 / 120.0,
            1.0 / 720.0,
            1.0 / 5040.0,
        ];
        let x = _mm256_min_ps(_mm256_set1_ps(88.0), x); // NaN passes (the second operand)
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693_359_4), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(TAYLOR[7]);
        for c in TAYLOR[..7].iter().rev() {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
        _mm256_andnot_ps(under, y)
    }

    /// `row[i] = exp(row[i] - max)` ([`exp8`] eight at a time, the last few padded with
    /// -inf, so that every value takes the same function); returns their sum.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn exp_sum(row: &mut [f32], max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut eight = |c: &mut [f32]| {
            // SAFETY: every caller passes 8 values.
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
                _mm256_storeu_ps(c.as_mut_ptr(), e);
                acc = _mm256_add_ps(acc, e);
            }
        };
        let mut chunks = row.chunks_exact_mut(8);
        chunks.by_ref().for_each(&mut eight);
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let mut pad = [f32::NEG_INFINITY; 8];
            pad[..tail.len()].copy_from_slice(tail);
            eight(&mut pad);
            tail.copy_from_slice(&pad[..tail.len()]);
        }
        hsum_float_8(acc)
    }

    /// `o += w y`; the lengths are equal.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn axpy<T: CacheElem>(o: &mut [f32], w: f32, y: &[T]) {
        let n = o.len().min(y.len());
        let (op, yp) = (o.as_mut_ptr(), y.as_ptr());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        // SAFETY: every load and store touches 8 values at i <= n - 8.
        unsafe {
            while i + 8 <= n {
                let v = _mm256_fmadd_ps(wv, T::load8(yp.add(i)), _mm256_loadu_ps(op.add(i)));
                _mm256_storeu_ps(op.add(i), v);
                i += 8;
            }
        }
        o[i..n]
            .iter_mut()
            .zip(&y[i..n])
            .for_each(|(o, y)| *o += w * y.to_f32());
    }
}

/// RMS norm of one row in place, in ggml's order: the squares summed in f64, their mean as
/// f32, `x * (1 / sqrt(mean + eps))`, then the weight.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    x.iter_mut()
        .zip(weight)
        .for_each(|(x, w)| *x = (*x * scale) * w);
}

/// RoPE on the first `2 * cos.len()` dims of one head, in place: `x1 cos - x2 sin` and
/// `x2 cos + x1 sin` for each pair, each product rounded before the sum.
fn rotate(x: &mut [f32], r: Rope<'_>) {
    let half = r.cos.len();
    for (i, (&c, &s)) in r.cos.iter().zip(r.sin).enumerate() {
        let (a, b) = if r.neox {
            (i, i + half)
        } else {
            (2 * i, 2 * i + 1)
        };
        let (x1, x2) = (x[a], x[b]);
        x[a] = x1 * c - x2 * s;
        x[b] = x2 * c + x1 * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    /// The float64 reference of the whole operation, written from its definition.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        a: &OneTokenAttention<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        keys: &[f32],
        vals: &[f32],
        pos: usize,
        n: usize,
    ) -> Vec<f64> {
        let (d, dv, hkv) = (a.head_dim, a.head_dim_v, a.kv_heads);
        let prep = |x: &[f32], w: Option<&[f32]>| -> Vec<f64> {
            let mut x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
            if let Some(w) = w {
                let ms = x.iter().map(|v| v * v).sum::<f64>() / d as f64;
                let r = 1.0 / (ms + f64::from(a.eps)).sqrt();
                x.iter_mut()
                    .zip(w)
                    .for_each(|(x, &w)| *x *= r * f64::from(w));
            }
            if let Some(rope) = a.rope {
                let half = rope.cos.len();
                for i in 0..half {
                    let (p, r) = if rope.neox {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (c, s) = (f64::from(rope.cos[i]), f64::from(rope.sin[i]));
                    let (x1, x2) = (x[p], x[r]);
                    x[p] = x1 * c - x2 * s;
                    x[r] = x2 * c + x1 * s;
                }
            }
            x
        };
        let kh: Vec<Vec<f64>> = k.chunks(d).map(|x| prep(x, a.k_norm)).collect();
        let mut out = vec![0f64; a.heads * dv];
        for h in 0..a.heads {
            let g = h / (a.heads / hkv);
            let qh = prep(&q[h * d..(h + 1) * d], a.q_norm);
            let key = |j: usize| -> Vec<f64> {
                if j == pos {
                    kh[g].clone()
                } else {
                    keys[(j * hkv + g) * d..(j * hkv + g + 1) * d]
                        .iter()
                        .map(|&v| f64::from(v))
                        .collect()
                }
            };
            let val = |j: usize, e: usize| -> f64 {
                f64::from(if j == pos {
                    v[g * dv + e]
                } else {
                    vals[(j * hkv + g) * dv + e]
                })
            };
            let s: Vec<f64> = (0..n)
                .map(|j| {
                    let kj = key(j);
                    f64::from(a.scale) * qh.iter().zip(&kj).map(|(x, y)| x * y).sum::<f64>()
                })
                .collect();
            let sink = a.sinks.map(|s| f64::from(s[h]));
            let m = s
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let z: f64 =
                s.iter().map(|x| (x - m).exp()).sum::<f64>() + sink.map_or(0.0, |x| (x - m).exp());
            for e in 0..dv {
                out[h * dv + e] = (0..n).map(|j| (s[j] - m).exp() / z * val(j, e)).sum();
            }
        }
        out
    }

    #[test]
    fn matches_the_float64_definition() {
        // A short range (one task) and one the pool splits into parts.
        for (n, threads) in [(37, 1), (700, 3)] {
            matches_at(n, &ThreadPool::new(threads));
        }
    }

    fn matches_at(n: usize, pool: &ThreadPool) {
        let (h, hkv, d, dv, pos) = (4, 2, 64, 32, n - 1);
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..24)
            .map(|i| {
                let t = 5.0f32 / 10000f32.powf(i as f32 / 24.0);
                (t.cos(), t.sin())
            })
            .unzip();
        let norm = values(d, 9).iter().map(|x| x + 1.5).collect::<Vec<_>>();
        let sinks = values(h, 10);
        for (neox, with_norm, with_sinks) in [(true, true, false), (false, false, true)] {
            let a = OneTokenAttention {
                heads: h,
                kv_heads: hkv,
                head_dim: d,
                head_dim_v: dv,
                q_norm: with_norm.then_some(&norm[..]),
                k_norm: with_norm.then_some(&norm[..]),
                eps: 1e-6,
                rope: Some(Rope {
                    cos: &cos,
                    sin: &sin,
                    neox,
                }),
                scale: 0.125,
                sinks: with_sinks.then_some(&sinks[..]),
            };
            let (q, k, v) = (values(h * d, 1), values(hkv * d, 2), values(hkv * dv, 3));
            let mut keys = values(n * hkv * d, 4);
            let mut vals = values(n * hkv * dv, 5);
            let want = reference(&a, &q, &k, &v, &keys, &vals, pos, n);
            let mut out = vec![0f32; h * dv];
            let cache = LayerCache {
                keys: &mut keys,
                values: &mut vals,
                write: &[pos],
                read: 0..n,
            };
            a.run(&q, &k, &v, cache, &mut out, pool).unwrap();
            for (o, w) in out.iter().zip(&want) {
                assert!((f64::from(*o) - w).abs() < 1e-5, "{o} against {w}");
            }
            assert_eq!(&vals[pos * hkv * dv..], &v[..]);
        }
    }

    /// A half cache computes what a float32 cache holding the same values rounded to half
    /// computes, to the bit (keys and values read back exactly), and stores the token's key
    /// and value rounded (here already half values: no norm or RoPE changes them).
    #[test]
    fn a_half_cache_is_a_float32_cache_of_rounded_values() {
        let round = |x: Vec<f32>| -> Vec<f32> {
            x.into_iter().map(|v| f16::from_f32(v).to_f32()).collect()
        };
        let half = |x: &[f32]| -> Vec<f16> { x.iter().map(|&v| f16::from_f32(v)).collect() };
        let pool = ThreadPool::new(3);
        for n in [37, 700] {
            let (h, hkv, d, dv, pos) = (4, 2, 64, 32, n - 1);
            let a = OneTokenAttention {
                heads: h,
                kv_heads: hkv,
                head_dim: d,
                head_dim_v: dv,
                q_norm: None,
                k_norm: None,
                eps: 1e-6,
                rope: None,
                scale: 0.125,
                sinks: None,
            };
            let q = values(h * d, 1);
            let (k, v) = (round(values(hkv * d, 2)), round(values(hkv * dv, 3)));
            let (mut keys, mut vals) = (
                round(values(n * hkv * d, 4)),
                round(values(n * hkv * dv, 5)),
            );
            let (mut keys16, mut vals16) = (half(&keys), half(&vals));
            let mut want = vec![0f32; h * dv];
            let cache = LayerCache {
                keys: &mut keys,
                values: &mut vals,
                write: &[pos],
                read: 0..n,
            };
            a.run(&q, &k, &v, cache, &mut want, &pool).unwrap();
            let mut out = vec![0f32; h * dv];
            let cache = LayerCache {
                keys: &mut keys16,
                values: &mut vals16,
                write: &[pos],
                read: 0..n,
            };
            a.run(&q, &k, &v, cache, &mut out, &pool).unwrap();
            assert_eq!(out, want, "{n} positions");
            assert_eq!(keys16[pos * hkv * d..], half(&k)[..]);
            assert_eq!(vals16[pos * hkv * dv..], half(&v)[..]);
        }
    }

    /// The AVX2 exponential against f64's over the softmax's whole range (arguments at most 0
    /// down to the cutoff and below), a few positive ones, and the special values; and the
    /// sum it returns. Hosts without AVX2 have nothing to check.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_exp_matches_float64() {
        if CpuIsa::Avx2.missing().is_some() {
            return;
        }
        let mut xs: Vec<f32> = (0..20011).map(|i| -100.0 * i as f32 / 20011.0).collect();
        xs.extend([
            -0.0, -1e-30, -1e-7, -87.2, -87.29, -87.31, -88.0, 0.5, 3.5, 88.0,
        ]);
        xs.extend([f32::NEG_INFINITY, f32::MIN]);
        let mut row = xs.clone();
        // SAFETY: the host has AVX2, FMA and F16C (checked above).
        let sum = unsafe { simd::exp_sum(&mut row, 0.0) };
        let mut want_sum = 0f64;
        for (x, y) in xs.iter().zip(&row) {
            if *x < -87.3 {
                assert_eq!(*y, 0.0, "exp({x})");
                continue;
            }
            let want = f64::from(*x).exp();
            want_sum += want;
            let err = (f64::from(*y) - want).abs() / want;
            assert!(
                err < 4e-7,
                "exp({x}) = {y}, {want} in f64: relative error {err:e}"
            );
        }
        assert!(
            (f64::from(sum) - want_sum).abs() / want_sum < 1e-5,
            "{sum} against {want_sum}"
        );
        // NaN stays NaN; the arguments are shifted by the maximum first.
        let mut special = [f32::NAN, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        // SAFETY: as above.
        unsafe { simd::exp_sum(&mut special, 8.0) };
        assert!(special[0].is_nan());
        for (i, y) in special[1..].iter().enumerate() {
            let want = (i as f64 + 1.0 - 8.0).exp();
            assert!(
                (f64::from(*y) - want).abs() / want < 4e-7,
                "{y} against {want}"
            );
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let a = OneTokenAttention {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            head_dim_v: 8,
            q_norm: None,
            k_norm: None,
            eps: 1e-6,
            rope: None,
            scale: 1.0,
            sinks: None,
        };
        let (q, k, v) = (vec![0f32; 32], vec![0f32; 16], vec![0f32; 16]);
        let mut out = vec![0f32; 32];
        let (mut keys, mut vals) = (vec![0f32; 64], vec![0f32; 64]);
        let mut run = |write: &[usize], read: Range<usize>, q: &[f32]| {
            let cache = LayerCache {
                keys: &mut keys,
                values: &mut vals,
                write,
                read,
            };
            a.run(q, &k, &v, cache, &mut out, &ThreadPool::new(1))
        };
        assert!(run(&[1], 0..2, &q).is_ok());
        assert!(run(&[4], 0..4, &q).is_err(), "a row past the cache");
        assert!(run(&[1], 2..4, &q).is_err(), "the token's own row unread");
        assert!(run(&[1], 0..5, &q).is_err(), "a read past the cache");
        assert!(run(&[1], 0..2, &q[..24]).is_err(), "a short query");
    }
}
