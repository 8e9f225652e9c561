//! Q4_0 and Q8_0 rows against Q8_0 activation rows, with AVX2, FMA and F16C, over rows
//! repacked once at load time: eight rows interleaved per 32-value block.
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

use super::avx2::fp16_at;
use super::avx2_gemm::{self, block_sums};
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

/// The weight types (const generic parameters).
pub(super) const Q4: u8 = 0;
pub(super) const Q8: u8 = 1;

/// Bytes of a block of the type, and of its values.
const fn layout(kind: u8) -> (usize, usize) {
    match kind {
        Q4 => (18, 16),
        _ => (Q8_0_BLOCK, 32),
    }
}

/// The packed kernels for `kernel`'s types, on a CPU with AVX2, FMA and F16C (the caller
/// checks).
pub(super) fn packed_fns(kernel: &VecDot) -> Option<PackedFns> {
    let fns = |pack, dots| Some(PackedFns { pack, dots });
    match (kernel.weight_type(), kernel.act_type()) {
        (GgmlType::Q4_0, GgmlType::Q8_0) => fns(pack::<Q4>, dots::<Q4>),
        (GgmlType::Q8_0, GgmlType::Q8_0) => fns(pack::<Q8>, dots::<Q8>),
        _ => None,
    }
}

/// Packs the first `ROWS * (n / ROWS)` rows of `src` (`n` rows of `blocks` blocks of the
/// type) into `dst` group by group; the tail rows are copied as they are.
pub(super) fn pack<const KIND: u8>(src: &[u8], blocks: usize, dst: &mut [u8]) {
    let (block, values) = layout(KIND);
    let rb = blocks * block;
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
            let (scales, regs) = out.split_at_mut(2 * ROWS);
            for (r, s) in scales.chunks_exact_mut(2).enumerate() {
                s.copy_from_slice(&x(r)[..2]);
            }
            for (i, word) in regs.chunks_exact_mut(4).enumerate() {
                let (j, r) = (i / ROWS, i % ROWS);
                word.copy_from_slice(&x(r)[2 + 4 * j..2 + 4 * j + 4]);
            }
            debug_assert_eq!(regs.len(), ROWS * values);
        }
    }
}

thread_local! {
    /// Each thread's activation block sums, reused across calls.
    static SUMS: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
}

/// `out[t * n + r]` = row r of `packed` (a whole number of packed groups, `n` rows of `rb`
/// bytes, `blocks` blocks) against token t's Q8_0 row `acts[t]`. The CPU's AVX2, FMA and F16C were
/// checked when the kernels were chosen ([`super::RowDots::with_isa`]).
fn dots<const KIND: u8>(packed: &[u8], rb: usize, blocks: usize, acts: &[&[u8]], out: &mut [f32]) {
    let (block, _) = layout(KIND);
    let gb = ROWS * blocks * block;
    let n = packed.len() / gb * ROWS;
    assert!(
        rb == blocks * block
            && packed.len() == n / ROWS * gb
            && acts.iter().all(|a| a.len() == blocks * Q8_0_BLOCK)
            && out.len() == n * acts.len(),
        "{} packed bytes of groups of {gb}, {} tokens, {} outputs: not whole groups",
        packed.len(),
        acts.len(),
        out.len()
    );
    SUMS.with_borrow_mut(|sums| {
        if KIND == Q4 {
            sums.resize(acts.len() * blocks, 0);
            for (a, s) in acts.iter().zip(sums.chunks_exact_mut(blocks)) {
                // SAFETY: `a` holds `blocks` Q8_0 blocks (checked above); AVX2 as above.
                unsafe { block_sums::<{ avx2_gemm::Q4 }>(a.as_ptr(), s) };
            }
        }
        for (g, group) in packed.chunks_exact(gb).enumerate() {
            for t0 in (0..acts.len()).step_by(PASS_TOKENS) {
                let tokens = (acts.len() - t0).min(PASS_TOKENS);
                let a: [*const u8; PASS_TOKENS] =
                    std::array::from_fn(|t| acts[t0 + t.min(tokens - 1)].as_ptr());
                let s: [*const i32; PASS_TOKENS] = std::array::from_fn(|t| {
                    let t = t0 + t.min(tokens - 1);
                    sums.get(t * blocks..)
                        .map_or(std::ptr::null(), <[i32]>::as_ptr)
                });
                let p = group.as_ptr();
                let mut o = [[0f32; ROWS]; PASS_TOKENS];
                // SAFETY: one packed group of `blocks` blocks, `tokens` activation rows of as
                // many blocks and (Q4_0) their sums, all checked above.
                unsafe {
                    match tokens {
                        4 => legacy::<KIND, 4>(p, blocks, a, s, &mut o),
                        3 => legacy::<KIND, 3>(p, blocks, a, s, &mut o),
                        2 => legacy::<KIND, 2>(p, blocks, a, s, &mut o),
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
    let (block, _) = layout(KIND);
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
    /// through the group kernels), at K of one block, two, three and 64, for whole packed
    /// matrices of 1 to 33 rows and for runs of them that start at a later group; with two
    /// passes per token (residual activations), within both passes' bounds and the sum's
    /// rounding.
    #[test]
    fn packed_rows_equal_ggml_within_the_bound() {
        if CpuIsa::Avx2.missing().is_some() {
            return;
        }
        for (t, blocks) in [GgmlType::Q4_0, GgmlType::Q8_0]
            .into_iter()
            .flat_map(|t| [1, 2, 3, 64].map(|b| (t, b)))
        {
            let k = 32 * blocks;
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
