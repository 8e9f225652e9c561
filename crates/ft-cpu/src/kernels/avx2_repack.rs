//! Q4_0 and Q8_0 rows against Q8_0 activation rows and Q4_K rows against Q8_K ones (the
//! activations ggml pairs them with), with AVX2, FMA and F16C, over rows repacked once at
//! load time: eight rows interleaved per block.
//!
//! A packed block of eight rows holds the same bytes as the eight rows' blocks: their eight
//! fp16 scales (one 128-bit load, converted and multiplied by the activation's scale for all
//! eight rows at once), then registers of 32 bytes whose 32-bit lane r holds four bytes of row
//! r: Q4_0's register j (of four) bytes 4j..4j+4 of each row's nibbles (values 4j..4j+4 in
//! the low nibbles, 16+4j.. in the high ones), Q8_0's register j (of eight) values 4j..4j+4.
//! Each register then feeds a `maddubs` with a broadcast word of the activation for all eight
//! rows, and a `madd` leaves each row's exact block sum in its own 32-bit lane: one
//! conversion and one fused multiply-add per block for eight rows, where ggml's row kernel
//! spends them per row. Rows past the last whole eight stay as they are and go through the
//! row kernels; a packed matrix has the size of the original.
//!
//! Q4_0's nibbles are multiplied unsigned (16-bit sums of eight registers: 8 x 2 x 15 x 127 <
//! 2^15) and 8 x the activation's block sum comes off, the same integer as ggml's offset
//! values; Q8_0's with ggml's sign trick (|w| times a with w's sign, each register's pairs
//! widened by `madd`). The integer per row and block is exact, as in ggml, and the f32
//! operations are d_w * d_a (ggml's product) and one fused multiply-add per block into the
//! row's lane. ggml's kernel spreads each block over eight lanes of four values and adds the
//! lanes at the end, so the two are recursive sums of the same terms in a different order:
//! |here - ggml| <= 2 gamma_(blocks + 3) x sum_b |fl(d_w d_a)_b| x sum_i |w_i a_i| with
//! gamma_n = n u / (1 - n u), u = 2^-24, the bound `avx2_gemm` derives for its tiles (one
//! lane per row there too) and the tests check.
//!
//! Q4_K's packed block of eight rows: the eight d, the eight dmin (fp16), the three words of
//! each row's packed 6-bit scales and mins (word i of every row in one register: the 8 rows'
//! scales and mins unpack together, ggml's bit layout), then the nibbles' 32 words as Q4_0's
//! (word j of a 32-byte run: sub-block 2p's values 4j..4j+4 low, 2p + 1's high). Per
//! sub-block eight `maddubs` into 16-bit sums (8 x 2 x 15 x 127 < 2^15) and one `madd` with
//! the rows' scales; per 256 values the mins against the activation's sub-block sums and two
//! fused multiply-adds (d_w d_a, then -dmin_w d_a), `avx2_gemm`'s Q4_K arithmetic, whose
//! bound 2 gamma_(2 blocks + 4) x ... it states.

use super::avx2::fp16_at;
use super::avx2_gemm::{self, block_sums, sub_block_sums};
use super::PackedFns;
use freetoken_ggml::{GgmlType, VecDot};
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Rows interleaved per packed block.
pub(crate) const ROWS: usize = 8;
/// Tokens one pass over a packed group serves: their accumulators and sums stay in the
/// sixteen vector registers.
const PASS_TOKENS: usize = 4;
/// Bytes of a Q8_0 activation block: fp16 scale, 32 signed values.
const Q8_0_BLOCK: usize = 34;
/// Bytes of a Q8_K activation block: f32 d, 256 int8 values, 16 int16 sums of 16 values.
const Q8_K_BLOCK: usize = 292;

/// The weight types (const generic parameters).
pub(super) const Q4: u8 = 0;
pub(super) const Q8: u8 = 1;
pub(super) const Q4K: u8 = 2;

/// Bytes of a block of the type, values per block, bytes of the activation's block and
/// activation sums per block the kernels take (Q4_0: the offset's, Q4_K: the mins' pairs).
const fn layout(kind: u8) -> (usize, usize, usize, usize) {
    match kind {
        Q4 => (18, 32, Q8_0_BLOCK, 1),
        Q4K => (144, 256, Q8_K_BLOCK, 4),
        _ => (Q8_0_BLOCK, 32, Q8_0_BLOCK, 0),
    }
}

/// A block's fields as a packed block of eight rows holds them, in order: (offset in the
/// block, bytes per row and part, parts); part c of row r goes `8 x width x c + width x r`
/// after the field's start. Q4_0 and Q8_0: the fp16 scales, then the values' words. Q4_K:
/// d, dmin, the three words of packed 6-bit scales and mins, the nibbles' 32 words.
const fn fields(kind: u8) -> &'static [(usize, usize, usize)] {
    match kind {
        Q4 => &[(0, 2, 1), (2, 4, 4)],
        Q4K => &[(0, 2, 1), (2, 2, 1), (4, 4, 3), (16, 4, 32)],
        _ => &[(0, 2, 1), (2, 4, 8)],
    }
}

/// The packed kernels for `kernel`'s types, on a CPU with AVX2, FMA and F16C (the caller
/// checks).
pub(super) fn packed_fns(kernel: &VecDot) -> Option<PackedFns> {
    let fns = |pack, dots| Some(PackedFns { pack, dots });
    match (kernel.weight_type(), kernel.act_type()) {
        (GgmlType::Q4_0, GgmlType::Q8_0) => fns(pack::<Q4>, dots::<Q4>),
        (GgmlType::Q8_0, GgmlType::Q8_0) => fns(pack::<Q8>, dots::<Q8>),
        (GgmlType::Q4_K, GgmlType::Q8_K) => fns(pack::<Q4K>, dots::<Q4K>),
        _ => None,
    }
}

/// Packs the first `ROWS * (n / ROWS)` rows of `src` (`n` rows of `blocks` 32-value blocks)
/// into `dst` group by group; the tail rows are copied as they are.
fn pack<const KIND: u8>(src: &[u8], blocks: usize, dst: &mut [u8]) {
    let (block, values, _, _) = layout(KIND);
    let rb = blocks * 32 / values * block;
    assert!(
        dst.len() == src.len() && src.len().is_multiple_of(rb),
        "{} bytes into {}: not whole rows of {rb}",
        src.len(),
        dst.len()
    );
    let whole = src.len() / rb / ROWS * ROWS * rb;
    dst[whole..].copy_from_slice(&src[whole..]);
    for (rows, group) in src[..whole]
        .chunks_exact(ROWS * rb)
        .zip(dst[..whole].chunks_exact_mut(ROWS * rb))
    {
        for (b, out) in group.chunks_exact_mut(ROWS * block).enumerate() {
            let x = |r: usize| &rows[r * rb + b * block..r * rb + (b + 1) * block];
            let mut at = 0;
            for &(offset, width, parts) in fields(KIND) {
                for c in 0..parts {
                    for r in 0..ROWS {
                        let from = offset + c * width;
                        out[at..at + width].copy_from_slice(&x(r)[from..from + width]);
                        at += width;
                    }
                }
            }
            debug_assert_eq!(at, out.len());
        }
    }
}

thread_local! {
    /// Each thread's activation block sums, reused across calls.
    static SUMS: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
}

/// `out[t * n + r]` = row r of `packed` (a whole number of packed groups, `n` rows of `rb`
/// bytes, `blocks` 32-value blocks) against token t's activation row `acts[t]` (Q8_0, or
/// Q4_K's Q8_K). The CPU's AVX2, FMA and F16C were checked when the kernels were chosen
/// ([`super::RowDots::with_isa`]).
fn dots<const KIND: u8>(packed: &[u8], rb: usize, blocks: usize, acts: &[&[u8]], out: &mut [f32]) {
    let (block, values, act_block, per_sums) = layout(KIND);
    let units = blocks * 32 / values;
    let gb = ROWS * units * block;
    let n = packed.len() / gb * ROWS;
    assert!(
        rb == units * block
            && packed.len() == n / ROWS * gb
            && acts.iter().all(|a| a.len() == units * act_block)
            && out.len() == n * acts.len(),
        "{} packed bytes of groups of {gb}, {} tokens, {} outputs: not whole groups",
        packed.len(),
        acts.len(),
        out.len()
    );
    SUMS.with_borrow_mut(|sums| {
        let per_token = units * per_sums;
        sums.resize(acts.len() * per_token, 0);
        for (a, s) in acts.iter().zip(sums.chunks_exact_mut(per_token.max(1))) {
            // SAFETY: `a` holds `units` activation blocks (checked above); AVX2 as above.
            unsafe {
                match KIND {
                    Q4 => block_sums::<{ avx2_gemm::Q4 }>(a.as_ptr(), s),
                    Q4K => sub_block_sums(a.as_ptr(), s),
                    _ => {}
                }
            }
        }
        for (g, group) in packed.chunks_exact(gb).enumerate() {
            for t0 in (0..acts.len()).step_by(PASS_TOKENS) {
                let tokens = (acts.len() - t0).min(PASS_TOKENS);
                let a: [*const u8; PASS_TOKENS] =
                    std::array::from_fn(|t| acts[t0 + t.min(tokens - 1)].as_ptr());
                let s: [*const i32; PASS_TOKENS] = std::array::from_fn(|t| {
                    let t = t0 + t.min(tokens - 1);
                    sums.get(t * per_token..)
                        .map_or(std::ptr::null(), <[i32]>::as_ptr)
                });
                let p = group.as_ptr();
                let mut o = [[0f32; ROWS]; PASS_TOKENS];
                // SAFETY: one packed group of `units` blocks, `tokens` activation rows of as
                // many blocks and their sums, all checked above.
                unsafe {
                    match (KIND, tokens) {
                        (Q4K, 4) => q4_k::<4>(p, units, a, s, &mut o),
                        (Q4K, 3) => q4_k::<3>(p, units, a, s, &mut o),
                        (Q4K, 2) => q4_k::<2>(p, units, a, s, &mut o),
                        (Q4K, _) => q4_k::<1>(p, units, a, s, &mut o),
                        (_, 4) => legacy::<KIND, 4>(p, blocks, a, s, &mut o),
                        (_, 3) => legacy::<KIND, 3>(p, blocks, a, s, &mut o),
                        (_, 2) => legacy::<KIND, 2>(p, blocks, a, s, &mut o),
                        _ => legacy::<KIND, 1>(p, blocks, a, s, &mut o),
                    }
                }
                for (t, o) in o[..tokens].iter().enumerate() {
                    let at = (t0 + t) * n + g * ROWS;
                    out[at..at + ROWS].copy_from_slice(o);
                }
            }
        }
    });
}

/// One packed group of Q4_0 or Q8_0 rows (`KIND`) against `T` Q8_0 activation rows (`a`;
/// Q4_0: their block sums times 8, `s`).
///
/// # Safety
/// `p` points at `blocks` packed blocks of the type, each of the first `T` of `a` at `blocks`
/// Q8_0 blocks and (Q4_0) of `s` at `blocks` sums; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const KIND: u8, const T: usize>(
    p: *const u8,
    blocks: usize,
    a: [*const u8; PASS_TOKENS],
    s: [*const i32; PASS_TOKENS],
    out: &mut [[f32; ROWS]; PASS_TOKENS],
) {
    let (block, ..) = layout(KIND);
    let (m4, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..blocks {
        // SAFETY: packed block b and block b of each token, per the contract.
        unsafe {
            let x = p.add(b * ROWS * block);
            let y: [*const u8; T] = std::array::from_fn(|t| a[t].add(b * Q8_0_BLOCK + 2));
            // Word i of each token's values, in every lane.
            let word = |y: *const u8, i: usize| {
                _mm256_set1_epi32(y.add(4 * i).cast::<i32>().read_unaligned())
            };
            let mut sum = [_mm256_setzero_si256(); T];
            if KIND == Q4 {
                let mut s16 = [_mm256_setzero_si256(); T];
                for j in 0..4 {
                    let v = _mm256_loadu_si256(x.add(2 * ROWS + 32 * j).cast());
                    let lo = _mm256_and_si256(v, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    for (s16, &y) in s16.iter_mut().zip(&y) {
                        let l = _mm256_maddubs_epi16(lo, word(y, j));
                        let h = _mm256_maddubs_epi16(hi, word(y, 4 + j));
                        *s16 = _mm256_add_epi16(*s16, _mm256_add_epi16(l, h));
                    }
                }
                for ((sum, s16), s) in sum.iter_mut().zip(s16).zip(s) {
                    let off = _mm256_set1_epi32(s.add(b).read());
                    *sum = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), off);
                }
            } else {
                for j in 0..8 {
                    let v = _mm256_loadu_si256(x.add(2 * ROWS + 32 * j).cast());
                    let abs = _mm256_sign_epi8(v, v);
                    for (sum, &y) in sum.iter_mut().zip(&y) {
                        let p = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(word(y, j), v));
                        *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(p, ones));
                    }
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(x.cast()));
            for ((acc, sum), y) in acc.iter_mut().zip(sum).zip(y) {
                let dd = _mm256_mul_ps(dw, _mm256_set1_ps(fp16_at(y.sub(2))));
                *acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sum), *acc);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: eight f32 into eight.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

/// Bytes `i0` and `i1` of each 32-bit lane of `v` as that lane's two 16-bit halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pick(v: __m256i, i0: i32, i1: i32) -> __m256i {
    let lane = |l: i32| (4 * l + i0) | (0x80 << 8) | ((4 * l + i1) << 16) | (0x80 << 24);
    let half = _mm_setr_epi32(lane(0), lane(1), lane(2), lane(3));
    _mm256_shuffle_epi8(v, _mm256_set_m128i(half, half))
}

/// One packed group of Q4_K rows against `T` Q8_K activation rows (`a`, their sub-block sums
/// two to a word, `s`): per block each row's exact sums of scale x value x activation and of
/// min x the activation's sub-block sums in its lane, added times d_w * d_a and
/// -dmin_w * d_a with two fused multiply-adds, as `avx2_gemm`'s tiles (whose bound holds).
///
/// # Safety
/// `p` points at `supers` packed blocks, each of the first `T` of `a` at `supers` Q8_K blocks
/// and of `s` at `4 * supers` words; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const T: usize>(
    p: *const u8,
    supers: usize,
    a: [*const u8; PASS_TOKENS],
    s: [*const i32; PASS_TOKENS],
    out: &mut [[f32; ROWS]; PASS_TOKENS],
) {
    let (block, ..) = layout(Q4K);
    let m4 = _mm256_set1_epi8(0x0f);
    let (k1, k2, k3) = (
        _mm256_set1_epi8(0x3f),
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(0x03),
    );
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..supers {
        // SAFETY: packed block b and block b of each token, per the contract.
        unsafe {
            let x = p.add(b * ROWS * block);
            let y: [*const u8; T] = std::array::from_fn(|t| a[t].add(b * Q8_K_BLOCK));
            let word = |y: *const u8, at: usize| {
                _mm256_set1_epi32(y.add(at).cast::<i32>().read_unaligned())
            };
            // Each row's 6-bit scales and mins unpacked in its lane (ggml's bit layout, as
            // `blocks::scales_and_mins`): scales 0-3, 4-7, mins 0-3, 4-7, a byte each.
            let u = [1, 2, 3].map(|i| _mm256_loadu_si256(x.add(32 * i).cast()));
            let high = |w: __m256i| {
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(w), k3))
            };
            let sc = [
                _mm256_and_si256(u[0], k1),
                _mm256_or_si256(_mm256_and_si256(u[2], k2), high(u[0])),
            ];
            let mins = [
                _mm256_and_si256(u[1], k1),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi32::<4>(u[2]), k2),
                    high(u[1]),
                ),
            ];
            let mut sum = [_mm256_setzero_si256(); T];
            for sb in 0..8 {
                // Sub-block sb: the low (even) or high (odd) nibbles of pair sb / 2's words.
                let scale = pick(sc[sb / 4], (sb % 4) as i32, (sb % 4) as i32);
                let mut s16 = [_mm256_setzero_si256(); T];
                for j in 0..8 {
                    let v = _mm256_loadu_si256(x.add(128 + 256 * (sb / 2) + 32 * j).cast());
                    let v = if sb % 2 == 0 {
                        _mm256_and_si256(v, m4)
                    } else {
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4)
                    };
                    for (s16, &y) in s16.iter_mut().zip(&y) {
                        let w = word(y, 4 + 32 * sb + 4 * j);
                        *s16 = _mm256_add_epi16(*s16, _mm256_maddubs_epi16(v, w));
                    }
                }
                for (sum, s16) in sum.iter_mut().zip(s16) {
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(s16, scale));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(x.cast()));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(x.add(2 * ROWS).cast()));
            // Pair q's mins, sub-blocks 2q and 2q + 1, as each lane's two 16-bit halves.
            let pairs: [__m256i; 4] = std::array::from_fn(|q| {
                let i = 2 * (q % 2) as i32;
                pick(mins[q / 2], i, i + 1)
            });
            for (((acc, sum), y), s) in acc.iter_mut().zip(sum).zip(y).zip(s) {
                let mut m = _mm256_setzero_si256();
                for (q, pair) in pairs.iter().enumerate() {
                    let sums = _mm256_set1_epi32(s.add(4 * b + q).read());
                    m = _mm256_add_epi32(m, _mm256_madd_epi16(*pair, sums));
                }
                let yd = _mm256_set1_ps(y.cast::<f32>().read_unaligned());
                *acc = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(sum), *acc);
                let dm = _mm256_mul_ps(dmin, _mm256_sub_ps(_mm256_setzero_ps(), yd));
                *acc = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(m), *acc);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: eight f32 into eight.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::random_blocks;
    use super::super::tile_tests::gemm_bound;
    use super::super::RowDots;
    use super::ROWS;
    use crate::isa::CpuIsa;
    use freetoken_ggml::{quantize, GgmlType, VecDot};

    /// Tokens per call: one, the passes and their neighbours, 64.
    const TOKENS: [usize; 7] = [1, 2, 7, 8, 9, 33, 64];

    /// Every (token, row) of packed rows, quantized and random, is ggml's row kernel's value
    /// within the bound the module states (the rows past the last whole group: bit for bit,
    /// through the group kernels), at K of one block (Q4_K: of 256 values), two, three and
    /// 64 (Q4_K: 8), for whole packed
    /// matrices of 1 to 33 rows and for runs of them that start at a later group; with two
    /// passes per token (residual activations), within both passes' bounds and the sum's
    /// rounding.
    #[test]
    fn packed_rows_equal_ggml_within_the_bound() {
        if CpuIsa::Avx2.missing().is_some() {
            return;
        }
        let legacy = [GgmlType::Q4_0, GgmlType::Q8_0].map(|t| (t, [32, 64, 96, 2048]));
        for (t, k) in legacy
            .into_iter()
            .chain([(GgmlType::Q4_K, [256, 512, 768, 2048])])
            .flat_map(|(t, ks)| ks.map(|k| (t, k)))
        {
            let kernel = VecDot::new(t, k).unwrap();
            let dots = RowDots::with_isa(kernel, CpuIsa::Avx2);
            let (ab, rb) = (kernel.act_row_bytes(), kernel.weight_row_bytes());
            let wf: Vec<f32> = (0..33 * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let quantized = quantize(t, &wf, k, None).unwrap();
            let random = random_blocks(t, 33, k, 11);
            for (w, n_tok) in [&quantized, &random]
                .into_iter()
                .flat_map(|w| TOKENS.map(|n| (w, n)))
            {
                let mut acts = vec![0u8; n_tok * ab];
                for (tok, a) in acts.chunks_exact_mut(ab).enumerate() {
                    let x: Vec<f32> = (0..k)
                        .map(|i| ((i * 13 + tok * 7) % 29) as f32 / 9.0 - 1.5)
                        .collect();
                    kernel.quantize_act(&x, a).unwrap();
                }
                let one: Vec<&[u8]> = acts.chunks_exact(ab).collect();
                let two: Vec<Vec<u8>> = (0..n_tok)
                    .map(|t| [one[t], one[(t + 1) % n_tok]].concat())
                    .collect();
                let two: Vec<&[u8]> = two.iter().map(Vec::as_slice).collect();
                for n_rows in [1, 7, 8, 9, 17, 33] {
                    let w = &w[..n_rows * rb];
                    let mut packed = vec![0u8; w.len()];
                    dots.pack(w, &mut packed);
                    let whole = n_rows / ROWS * ROWS;
                    // Whole matrices, and runs from a later group to the end.
                    for first in (0..n_rows).step_by(ROWS).take(2) {
                        let rows = n_rows - first;
                        let p = &packed[first * rb..];
                        let case = format!("{t} k={k}, {n_tok} tokens, rows {first}..{n_rows}");
                        let mut got = vec![f32::NAN; n_tok * rows];
                        dots.packed().dots(p, &one, &mut got);
                        let mut sum = vec![f32::NAN; n_tok * rows];
                        dots.packed().dots(p, &two, &mut sum);
                        let at = |i: usize| (i / rows, first + i % rows);
                        let want = |i: usize| {
                            let (tok, r) = at(i);
                            kernel.dot(&w[r * rb..(r + 1) * rb], one[tok]).unwrap()
                        };
                        // None: bit for bit.
                        let bound = |i: usize| {
                            let (tok, r) = at(i);
                            (r < whole).then(|| gemm_bound(t, &w[r * rb..(r + 1) * rb], one[tok]))
                        };
                        for (i, v) in got.iter().enumerate() {
                            let (tok, r) = at(i);
                            match bound(i) {
                                Some(b) => assert!(
                                    (v - want(i)).abs() <= b,
                                    "{case}: token {tok} row {r}: {v} {}",
                                    want(i)
                                ),
                                None => assert_eq!(
                                    v.to_bits(),
                                    want(i).to_bits(),
                                    "{case}: token {tok} row {r}"
                                ),
                            }
                        }
                        for (i, v) in sum.iter().enumerate() {
                            let (tok, r) = at(i);
                            let next = (tok + 1) % n_tok * rows + i % rows;
                            let want_sum = want(i) + want(next);
                            match (bound(i), bound(next)) {
                                (Some(a), Some(b)) => {
                                    let b = a + b + v.abs() * f32::EPSILON / 2.0;
                                    let err = (v - want_sum).abs();
                                    assert!(err <= b, "{case}, 2 passes: {tok} {r}");
                                }
                                _ => assert_eq!(
                                    v.to_bits(),
                                    want_sum.to_bits(),
                                    "{case}, 2 passes: {tok} {r}"
                                ),
                            }
                        }
                    }
                }
            }
        }
    }
}
