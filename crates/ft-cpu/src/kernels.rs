//! Dot products of runs of consecutive weight rows with one quantized activation row.
//!
//! ggml-cpu's x86 dot products take one row per call (its `nrows` trait is 1 for every type on
//! x86), and for Q4_0 and Q8_0 a call spends about a nanosecond per 32-value block whatever the
//! type's size: one thread computes Q4_0 rows at ~16 GB/s, so two threads could not read
//! experts faster than ~30 GB/s however the rows were laid out (benches/README.md). On CPUs
//! with AVX-512 VNNI the kernels here hold two rows side by side in each 512-bit register, four
//! rows per call, and share the activation's loads and scale between them: one thread computes
//! Q4_0 rows at ~28 GB/s. Each row's result is bit-identical to ggml's own AVX2
//! `ggml_vec_dot_q4_0_q8_0` / `ggml_vec_dot_q8_0_q8_0`: the same exact integer sum per 4-value
//! lane, the same f32 product of the two fp16 block scales, the same chain of fused
//! multiply-adds over the blocks and the same horizontal sum, only for two rows per
//! instruction. Other types and CPUs, and a ggml built without AVX2 (whose kernels round
//! differently), use ggml's kernel row by row.

use freetoken_ggml::VecDot;

/// Rows per pass of a group kernel.
const GROUP: usize = 4;

/// Rows the callers compute for every activation row (token, route) before they move on to the
/// next rows: the pass's rows stay in the L1 cache (16 gate and 16 up rows of Q4_0 at hidden
/// 2048: 36 KB) while every activation reads them, and the group kernels prefetch one pass
/// ahead.
pub(crate) const PASS_ROWS: usize = 16;

/// `GROUP` dot products: rows at `w`, `w + row_bytes`, ... against the activation row `act`,
/// each `blocks` 32-value blocks long.
type GroupFn =
    unsafe fn(w: *const u8, row_bytes: usize, act: *const u8, blocks: usize) -> [f32; GROUP];

/// A weight type's dot product, applied to runs of consecutive rows.
#[derive(Clone, Copy)]
pub(crate) struct RowDots {
    kernel: VecDot,
    group: Option<GroupFn>,
}

impl RowDots {
    pub(crate) fn new(kernel: VecDot) -> RowDots {
        #[cfg(target_arch = "x86_64")]
        let group = avx512::group_fn(&kernel);
        #[cfg(not(target_arch = "x86_64"))]
        let group = None;
        RowDots { kernel, group }
    }

    /// `out[i]` = row i of `w` (`out.len()` consecutive rows) . `act`, where `act` holds one
    /// or more quantized rows of the activation ([`crate::acts::ActCodec`]'s passes) and the
    /// result is the sum over them; with one pass each value is exactly what `VecDot::dot`
    /// gives for that row.
    pub(crate) fn dots(&self, w: &[u8], act: &[u8], out: &mut [f32]) {
        let ab = self.kernel.act_row_bytes();
        assert!(
            !act.is_empty() && act.len().is_multiple_of(ab),
            "{} activation bytes: not whole rows of {ab}",
            act.len()
        );
        let mut passes = act.chunks_exact(ab);
        self.dots_one(w, passes.next().expect("checked above"), out);
        let rb = self.kernel.weight_row_bytes();
        for a in passes {
            for (o, rows) in out.chunks_mut(GROUP).zip(w.chunks(GROUP * rb)) {
                let mut more = [0f32; GROUP];
                self.dots_one(rows, a, &mut more[..o.len()]);
                for (o, m) in o.iter_mut().zip(more) {
                    *o += m;
                }
            }
        }
    }

    /// `out[i]` = row i of `w` . `act`, one quantized activation row.
    fn dots_one(&self, w: &[u8], act: &[u8], out: &mut [f32]) {
        let rb = self.kernel.weight_row_bytes();
        assert!(
            w.len() == rb * out.len() && act.len() == self.kernel.act_row_bytes(),
            "{} weight bytes and {} activation bytes for {} rows of {rb}",
            w.len(),
            act.len(),
            out.len()
        );
        let mut done = 0;
        if let Some(group) = self.group {
            let blocks = self.kernel.k() / 32;
            for (o, rows) in out.chunks_exact_mut(GROUP).zip(w.chunks_exact(GROUP * rb)) {
                // SAFETY: `rows` holds GROUP rows of `rb` bytes and `act` one activation row
                // (checked above), both of `blocks` blocks of the group kernel's types, which
                // `group_fn` chose for this CPU.
                o.copy_from_slice(&unsafe { group(rows.as_ptr(), rb, act.as_ptr(), blocks) });
            }
            done = out.len() / GROUP * GROUP;
        }
        for (i, o) in out.iter_mut().enumerate().skip(done) {
            *o = self
                .kernel
                .dot(&w[i * rb..(i + 1) * rb], act)
                .expect("sizes checked above");
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{GroupFn, GROUP};
    use freetoken_ggml::{GgmlType, VecDot};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// How far ahead rows are prefetched: one pass. With the executor's gate and up rows read
    /// alternately, a pass at a time, four rows ahead reached 18 GB/s on one thread and
    /// sixteen 24.
    const PREFETCH_ROWS: usize = super::PASS_ROWS;
    /// Bytes of a Q8_0 block: fp16 scale, 32 signed values.
    const Q8_0_BLOCK: usize = 34;
    /// Bytes of a Q4_0 block: fp16 scale, 32 4-bit values (v - 8) packed low nibbles first.
    const Q4_0_BLOCK: usize = 18;

    /// The group kernel for `kernel`'s types on this CPU, if there is one.
    pub(super) fn group_fn(kernel: &VecDot) -> Option<GroupFn> {
        static USABLE: OnceLock<bool> = OnceLock::new();
        let usable = *USABLE.get_or_init(|| {
            freetoken_ggml::cpu_has_avx2()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("f16c")
                && is_x86_feature_detected!("fma")
        });
        if !usable || kernel.act_type() != GgmlType::Q8_0 || !kernel.k().is_multiple_of(32) {
            return None;
        }
        match kernel.weight_type() {
            GgmlType::Q4_0 => Some(q4_0),
            GgmlType::Q8_0 => Some(q8_0),
            _ => None,
        }
    }

    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    unsafe fn q4_0(w: *const u8, row_bytes: usize, act: *const u8, blocks: usize) -> [f32; 4] {
        // SAFETY: forwarded.
        unsafe { group::<true>(w, row_bytes, act, blocks) }
    }

    /// # Safety
    /// As [`group`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    unsafe fn q8_0(w: *const u8, row_bytes: usize, act: *const u8, blocks: usize) -> [f32; 4] {
        // SAFETY: forwarded.
        unsafe { group::<false>(w, row_bytes, act, blocks) }
    }

    /// ggml's `hsum_float_8`, in its order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    fn hsum_float_8(x: __m256) -> f32 {
        let mut r = _mm256_extractf128_ps::<1>(x);
        r = _mm_add_ps(r, _mm256_castps256_ps128(x));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// The upper eight lanes (avx512dq's `extractf32x8` through an avx512f one).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    fn high_half(x: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)))
    }

    /// Block values of two rows as unsigned bytes, the first row in the low 256 bits, each in
    /// element order; the caller subtracts the offset (8 for Q4_0, 128 for Q8_0) through the
    /// activation's sum.
    ///
    /// # Safety
    /// `a` and `b` point at the values (past the scale) of a block of the type.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    unsafe fn pair<const Q4: bool>(a: *const u8, b: *const u8) -> __m512i {
        // SAFETY: 16 (Q4_0) or 32 (Q8_0) readable bytes at each, per the contract.
        unsafe {
            if Q4 {
                // [a, b] then [a >> 4, b >> 4]: each row's low nibbles are elements 0..16,
                // its high nibbles 16..32.
                let lo = _mm256_inserti128_si256::<1>(
                    _mm256_castsi128_si256(_mm_loadu_si128(a.cast())),
                    _mm_loadu_si128(b.cast()),
                );
                let hi = _mm256_srli_epi16::<4>(lo);
                // 128-bit lanes [a, b, a >> 4, b >> 4] reordered to [a, a >> 4, b, b >> 4].
                let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                let z = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
                _mm512_and_si512(z, _mm512_set1_epi8(0x0f))
            } else {
                let z = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(a.cast())),
                    _mm256_loadu_si256(b.cast()),
                );
                // x + 128 as an unsigned byte.
                _mm512_xor_si512(z, _mm512_set1_epi8(i8::MIN))
            }
        }
    }

    /// Four rows of Q4_0 (`Q4`) or Q8_0 against one Q8_0 activation row.
    ///
    /// Per block and 4-value lane, ggml computes the exact integer sum of weight * activation
    /// (whichever instructions it uses, nothing saturates at these magnitudes), converts it to
    /// f32 (exact: at most 65024 in magnitude), and adds d_w * d_a times it to an f32
    /// accumulator with one fused multiply-add; the eight lanes are summed at the end. Here the
    /// integer sum is dpbusd's sum of (w + offset) * a started from -offset * sum(a), which is
    /// the same integer; the rest is the same operations on the same values.
    ///
    /// # Safety
    /// `w` points at four rows of `row_bytes` bytes, each `blocks` blocks of the weight type,
    /// `act` at `blocks` Q8_0 blocks; the CPU has the enabled features.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
    unsafe fn group<const Q4: bool>(
        w: *const u8,
        row_bytes: usize,
        act: *const u8,
        blocks: usize,
    ) -> [f32; GROUP] {
        let block = if Q4 { Q4_0_BLOCK } else { Q8_0_BLOCK };
        // 8 or 128 as unsigned bytes.
        let offset = _mm512_set1_epi8(if Q4 { 8 } else { i8::MIN });
        // Per row pair, the scale lanes: row 0 (2) in the low eight, row 1 (3) in the high.
        let lanes01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let lanes23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
        let (mut acc01, mut acc23) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        // Four rows read side by side are four short streams that the hardware prefetcher
        // does not follow (5.8 GB/s from DRAM on one thread, against 16 row by row), so the
        // rows PREFETCH_ROWS ahead are prefetched as one sequential stream, a group's share
        // per block. Past the end of the weights a prefetch is a no-op, never a fault.
        let next = w.wrapping_add(PREFETCH_ROWS * row_bytes);
        for b in 0..blocks {
            // SAFETY: block b of the activation and of each of the four rows is in bounds
            // (b < blocks, rows 0..4 of row_bytes each), per the contract.
            unsafe {
                let y = act.add(b * Q8_0_BLOCK);
                let x = [0, 1, 2, 3].map(|r| w.add(r * row_bytes + b * block));
                // This block's share of the four rows PREFETCH_ROWS ahead.
                let ahead = next.wrapping_add(b * GROUP * block);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
                if !Q4 {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128).cast());
                }
                let ya = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(2).cast()));
                let start = _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, ya),
                );
                let d = |p: *const u8| p.cast::<i16>().read_unaligned();
                // [d_a, d_0, d_1, d_2, d_3] as f32, then d_r * d_a in lanes 0..4.
                let scales = _mm256_cvtph_ps(_mm_set_epi16(
                    0,
                    0,
                    0,
                    d(x[3]),
                    d(x[2]),
                    d(x[1]),
                    d(x[0]),
                    d(y),
                ));
                let da = _mm256_permutexvar_ps(_mm256_setzero_si256(), scales);
                let dw = _mm256_permutexvar_ps(_mm256_set_epi32(0, 0, 0, 0, 4, 3, 2, 1), scales);
                let dd = _mm512_castps256_ps512(_mm256_mul_ps(dw, da));
                let s01 = _mm512_dpbusd_epi32(start, pair::<Q4>(x[0].add(2), x[1].add(2)), ya);
                let s23 = _mm512_dpbusd_epi32(start, pair::<Q4>(x[2].add(2), x[3].add(2)), ya);
                acc01 = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(lanes01, dd),
                    _mm512_cvtepi32_ps(s01),
                    acc01,
                );
                acc23 = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(lanes23, dd),
                    _mm512_cvtepi32_ps(s23),
                    acc23,
                );
            }
        }
        [
            hsum_float_8(_mm512_castps512_ps256(acc01)),
            hsum_float_8(high_half(acc01)),
            hsum_float_8(_mm512_castps512_ps256(acc23)),
            hsum_float_8(high_half(acc23)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use freetoken_ggml::{quantize, GgmlType};

    /// xorshift64 bytes.
    fn bytes(n: usize, mut s: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    /// Blocks of random values under random finite fp16 scales (both signs, from subnormal
    /// to large), so that every lane and scale path is exercised.
    fn random_blocks(t: GgmlType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
        let bs = t.type_size();
        let mut data = bytes(rows * k / 32 * bs, seed);
        for (i, block) in data.chunks_exact_mut(bs).enumerate() {
            let exp = (i * 7 % 30) as u16; // below 31: never inf or NaN
            let bits = ((i as u16 & 1) << 15) | (exp << 10) | ((i as u16).wrapping_mul(37) & 0x3ff);
            block[..2].copy_from_slice(&bits.to_le_bytes());
        }
        data
    }

    #[test]
    fn runs_of_rows_equal_ggml_row_by_row_bit_for_bit() {
        for t in [
            GgmlType::Q4_0,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_0,
        ] {
            for k in [32usize, 96, 256, 2048] {
                if !k.is_multiple_of(t.block_size()) {
                    continue;
                }
                let rows = 11; // two groups of four and a tail of three
                let kernel = VecDot::new(t, k).unwrap();
                let dots = RowDots::new(kernel);
                let x: Vec<f32> = bytes(k, k as u64)
                    .iter()
                    .map(|&b| b as f32 / 64.0 - 2.0)
                    .collect();
                let mut act = vec![0u8; kernel.act_row_bytes()];
                kernel.quantize_act(&x, &mut act).unwrap();
                let w: Vec<f32> = bytes(rows * k, 3)
                    .iter()
                    .map(|&b| b as f32 / 128.0 - 1.0)
                    .collect();
                let mut weights = vec![quantize(t, &w, k, None).unwrap()];
                if t.block_size() == 32 {
                    weights.push(random_blocks(t, rows, k, 7 + k as u64));
                }
                for w in &weights {
                    let rb = kernel.weight_row_bytes();
                    for n in [1, 4, 5, rows] {
                        let mut out = vec![f32::NAN; n];
                        dots.dots(&w[..n * rb], &act, &mut out);
                        for (i, o) in out.iter().enumerate() {
                            let want = kernel.dot(&w[i * rb..(i + 1) * rb], &act).unwrap();
                            assert_eq!(o.to_bits(), want.to_bits(), "{t} k={k} row {i} of {n}");
                        }
                    }
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod dispatch_tests {
    use super::*;
    use freetoken_ggml::GgmlType;

    /// The test above compares the group kernels only where they run: say where that is.
    #[test]
    fn group_kernels_run_on_avx512_vnni_cpus() {
        let available = freetoken_ggml::cpu_has_avx2()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        for (t, fast) in [
            (GgmlType::Q4_0, true),
            (GgmlType::Q8_0, true),
            (GgmlType::Q4_K, false),
        ] {
            let dots = RowDots::new(VecDot::new(t, 256).unwrap());
            assert_eq!(dots.group.is_some(), fast && available, "{t}");
        }
    }
}
