//! Four rows of Q4_K against one to eight Q8_K activation rows, bit-identical to ggml's AVX2
//! `ggml_vec_dot_q4_K_q8_K` row by row.
//!
//! Per 256-value super-block ggml sums, exactly in int32, each sub-block's 6-bit scale times
//! its 4-value partial dot products into eight lanes (lane l: values 4l..4l+4 of every
//! 32-value sub-block), converts the lanes to f32 and adds d_y * d_x times them to an f32
//! accumulator with one fused multiply-add; the mins go through a second, four-lane
//! accumulator (pairs of sub-blocks' min times the activation's sub-block sum, times
//! -d_y * dmin_x). Here two rows share each 512-bit register and the weights' nibbles are
//! unpacked once for every activation row; the integers, the f32 operations and their order
//! are ggml's.

use super::avx512::{high_half, hsum_float_8, PREFETCH_ROWS};
use super::GROUP;
use std::arch::x86_64::*;

/// Bytes of a Q4_K block: fp16 d and dmin, 12 bytes of packed 6-bit scales and mins, 128
/// bytes of 4-bit values (each 32-byte run: a sub-block in the low nibbles, the next in the
/// high ones).
const Q4_K_BLOCK: usize = 144;
/// Bytes of a Q8_K block: f32 d, 256 int8 values, 16 int16 sums of 16 values.
const Q8_K_BLOCK: usize = 292;
/// Activation rows one pass over the weights serves: eight per-row accumulators of each kind
/// for four rows fit the vector registers, more would spill.
const PASS_TOKENS: usize = 4;

/// The eight scales and eight mins of a Q4_K block's 12 packed bytes, as ggml unpacks them.
fn scales_and_mins(p: [u8; 12]) -> [u8; 16] {
    let w = |i: usize| u32::from_le_bytes([p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]]);
    let (k1, k2, k3) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    // Scales of sub-blocks 0-3, 4-7, then mins of 0-3, 4-7.
    let words = [
        u0 & k1,
        (u2 & k2) | (((u0 >> 6) & k3) << 4),
        u1 & k1,
        ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// `TOK` activation rows through [`pass`] in runs of [`PASS_TOKENS`].
///
/// # Safety
/// `w` points at four rows of `row_bytes` bytes, each `blocks / 8` Q4_K blocks, `acts` at
/// `TOK` rows of as many Q8_K blocks; the CPU has the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
pub(super) unsafe fn tile<const TOK: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &[*const u8],
    blocks: usize,
    out: &mut [[f32; GROUP]],
) {
    assert!(
        acts.len() == TOK && out.len() == TOK,
        "a tile of {TOK} tokens"
    );
    for (a, o) in acts.chunks(PASS_TOKENS).zip(out.chunks_mut(PASS_TOKENS)) {
        // SAFETY: forwarded, for a part of the rows.
        unsafe {
            match a.len() {
                4 => pass::<4>(w, row_bytes, a, blocks / 8, o),
                3 => pass::<3>(w, row_bytes, a, blocks / 8, o),
                2 => pass::<2>(w, row_bytes, a, blocks / 8, o),
                _ => pass::<1>(w, row_bytes, a, blocks / 8, o),
            }
        }
    }
}

/// # Safety
/// As [`tile`], `T` activation rows and `supers` Q4_K blocks per row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn pass<const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &[*const u8],
    supers: usize,
    out: &mut [[f32; GROUP]],
) {
    let m4 = _mm512_set1_epi8(0x0f);
    // Per row pair, the lanes of each row's scale: row 0 (2) low, row 1 (3) high.
    let lanes01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let lanes23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    // Row r's four min lanes are 4r..4r+4.
    let lanes_m = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let mut acc = [[_mm512_setzero_ps(); 2]; T];
    let mut acc_m = [_mm512_setzero_ps(); T];
    let next = w.wrapping_add(PREFETCH_ROWS * row_bytes);
    for b in 0..supers {
        // SAFETY: block b of each weight and activation row is in bounds (b < supers), per
        // the contract.
        unsafe {
            let x = [0, 1, 2, 3].map(|r| w.add(r * row_bytes + b * Q4_K_BLOCK));
            let ahead = next.wrapping_add(b * GROUP * Q4_K_BLOCK);
            for line in 0..(GROUP * Q4_K_BLOCK).div_ceil(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
            }
            let sm = x.map(|x| scales_and_mins(x.add(4).cast::<[u8; 12]>().read_unaligned()));
            let h = |p: *const u8, o: usize| p.add(o).cast::<i16>().read_unaligned();
            // d and dmin of rows 0..4 as f32.
            let xd = _mm256_cvtph_ps(_mm_set_epi16(
                h(x[3], 2),
                h(x[2], 2),
                h(x[1], 2),
                h(x[0], 2),
                h(x[3], 0),
                h(x[2], 0),
                h(x[1], 0),
                h(x[0], 0),
            ));
            let (xd, xdmin) = (_mm256_castps256_ps128(xd), _mm256_extractf128_ps::<1>(xd));
            // The four rows' mins as int16, row r in the r-th 128 bits.
            let mins = _mm512_cvtepu8_epi16(_mm256_set_m128i(
                _mm_set_epi64x(
                    i64::from_le_bytes(sm[3][8..].try_into().expect("8 bytes")),
                    i64::from_le_bytes(sm[2][8..].try_into().expect("8 bytes")),
                ),
                _mm_set_epi64x(
                    i64::from_le_bytes(sm[1][8..].try_into().expect("8 bytes")),
                    i64::from_le_bytes(sm[0][8..].try_into().expect("8 bytes")),
                ),
            ));
            let mut sumi = [[_mm512_setzero_si512(); 2]; T];
            for j in 0..4 {
                for (p, rows) in [(0, [0, 1]), (1, [2, 3])] {
                    let [ra, rb] = rows;
                    let q = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(x[ra].add(16 + 32 * j).cast())),
                        _mm256_loadu_si256(x[rb].add(16 + 32 * j).cast()),
                    );
                    let lo = _mm512_and_si512(q, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
                    let scale = |s: usize| {
                        _mm512_mask_blend_epi16(
                            0xffff_0000,
                            _mm512_set1_epi16(i16::from(sm[ra][s])),
                            _mm512_set1_epi16(i16::from(sm[rb][s])),
                        )
                    };
                    let (sl, sh) = (scale(2 * j), scale(2 * j + 1));
                    for (s, y) in sumi.iter_mut().zip(acts) {
                        let y = y.add(b * Q8_K_BLOCK + 4 + 64 * j);
                        let yl = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.cast()));
                        let yh = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(32).cast()));
                        let pl = _mm512_madd_epi16(sl, _mm512_maddubs_epi16(lo, yl));
                        let ph = _mm512_madd_epi16(sh, _mm512_maddubs_epi16(hi, yh));
                        s[p] = _mm512_add_epi32(s[p], _mm512_add_epi32(pl, ph));
                    }
                }
            }
            for (t, y) in acts.iter().enumerate() {
                let y = y.add(b * Q8_K_BLOCK);
                let yd = y.cast::<f32>().read_unaligned();
                // d_y * d_x and -d_y * dmin_x per row, as ggml's f32 products.
                let d = _mm512_castps128_ps512(_mm_mul_ps(_mm_set1_ps(yd), xd));
                let dmin = _mm512_castps128_ps512(_mm_mul_ps(_mm_set1_ps(-yd), xdmin));
                let [s01, s23] = sumi[t];
                acc[t][0] = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(lanes01, d),
                    _mm512_cvtepi32_ps(s01),
                    acc[t][0],
                );
                acc[t][1] = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(lanes23, d),
                    _mm512_cvtepi32_ps(s23),
                    acc[t][1],
                );
                // The sums of each 32-value sub-block (ggml's hadd of the 16-value sums),
                // against every row's mins.
                let bsums = _mm256_loadu_si256(y.add(4 + 256).cast());
                let q8s = _mm_hadd_epi16(
                    _mm256_castsi256_si128(bsums),
                    _mm256_extracti128_si256::<1>(bsums),
                );
                let prod = _mm512_madd_epi16(mins, _mm512_broadcast_i32x4(q8s));
                acc_m[t] = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(lanes_m, dmin),
                    _mm512_cvtepi32_ps(prod),
                    acc_m[t],
                );
            }
        }
    }
    for ((o, [a01, a23]), m) in out.iter_mut().zip(acc).zip(acc_m) {
        let sums = [
            hsum_float_8(_mm512_castps512_ps256(a01)),
            hsum_float_8(high_half(a01)),
            hsum_float_8(_mm512_castps512_ps256(a23)),
            hsum_float_8(high_half(a23)),
        ];
        let m = [
            _mm512_extractf32x4_ps::<0>(m),
            _mm512_extractf32x4_ps::<1>(m),
            _mm512_extractf32x4_ps::<2>(m),
            _mm512_extractf32x4_ps::<3>(m),
        ];
        for ((o, s), m) in o.iter_mut().zip(sums).zip(m) {
            // ggml's reduction of its four min lanes, then its final sum.
            let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_add_ss(m, _mm_movehdup_ps(m));
            *o = s + _mm_cvtss_f32(m);
        }
    }
}
