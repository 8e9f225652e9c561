//! Four rows of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! IQ1_S or IQ1_M against one to eight Q8_K activation rows, bit-identical to ggml's AVX2
//! `ggml_vec_dot_q2_K_q8_K` / `_q3_K_q8_K` / `_q4_K_q8_K` / `_q5_K_q8_K` / `_q6_K_q8_K` /
//! `ggml_vec_dot_iq4_xs_q8_K` / `_iq2_xxs_q8_K` / `_iq2_xs_q8_K` / `_iq2_s_q8_K` /
//! `_iq3_xxs_q8_K` / `_iq3_s_q8_K` / `_iq1_s_q8_K` / `_iq1_m_q8_K` row by row.
//!
//! Per 256-value super-block ggml sums, exactly in int32, each sub-block's scale times its
//! 4-value partial dot products into eight lanes (lane l: values 4l..4l+4 of every 32-value
//! run), converts the lanes to f32 and adds d_y * d_x times them to an f32 accumulator with
//! one fused multiply-add. Q4_K's mins go through a second, four-lane accumulator (pairs of
//! sub-blocks' min times the activation's sub-block sum, times -d_y * dmin_x); Q5_K's (the
//! values of Q4_K with a fifth bit) through one scalar per row, the four lanes' integer sum
//! times -d_y * dmin_x added with a fused multiply-add; Q6_K's offset
//! of 32 is taken off the int32 lanes first (32 x scale x the activation's 16-value sums,
//! two sub-blocks a lane); IQ4_XS's values come from a 16-entry table and its signed 6-bit
//! scales multiply the lanes directly; Q2_K's mins (one per 16 values) go into the main
//! accumulator first, times -d_y * dmin_x; Q3_K's values are two low bits less 4 where the
//! high bit is clear, its signed 6-bit scales one per 16 values; IQ2_XXS's, IQ2_XS's and
//! IQ3_XXS's values are grid points (8 or 4 unsigned values each) with signs applied to the
//! activation, their scales 2s + 1 per 32 values (IQ2_XS: per 16), and the result 0.125 or
//! 0.25 x the sum; IQ3_S's the same with 9-bit indices, a sign bit per value and no factor,
//! IQ2_S's with 10-bit indices, sign bits and IQ2_XS's scales; IQ1_S's grid
//! values are -1, 0 or 1 and its deltas (+-0.125 per 32 values) go through ggml's scalar
//! chain of d x the activation's sub-block sums, added at the end; IQ1_M's deltas (one sign
//! per 8 values) through a second lane accumulator, as ggml's. Here two rows share each 512-bit register and the weights are
//! unpacked once for every activation row; the integers, the f32 operations and their order
//! are ggml's.

use super::avx512::{pair, row_sums, scaled_add, PREFETCH_ROWS, Q4};
use super::blocks::{scales_and_mins, IQ4_VALUES};
use super::{GroupFn, GroupFns, GROUP, TILES};
use freetoken_ggml::{GgmlType, VecDot};
use std::arch::x86_64::*;

/// Bytes of a Q2_K block: 16 bytes of 4-bit scales (low) and mins (high), one per 16 values;
/// 64 bytes of 2-bit values (each 32-byte run: four 32-value runs, two bits each); fp16 d and
/// dmin.
const Q2_K_BLOCK: usize = 84;
/// Bytes of a Q3_K block: 32 bytes of high bits (bit b of byte e: value e of 32-value run b),
/// 64 bytes of 2-bit values (as Q2_K's), 12 bytes of packed 6-bit scales, fp16 d.
const Q3_K_BLOCK: usize = 110;
/// Bytes of a Q4_K block: fp16 d and dmin, 12 bytes of packed 6-bit scales and mins, 128
/// bytes of 4-bit values (each 32-byte run: a sub-block in the low nibbles, the next in the
/// high ones).
const Q4_K_BLOCK: usize = 144;
/// Bytes of a Q5_K block: Q4_K's fields, with 32 bytes of fifth bits (bit s of byte e: value e
/// of sub-block s) before the 4-bit values.
const Q5_K_BLOCK: usize = 176;
/// Bytes of a Q6_K block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one
/// per 16 values), fp16 d.
const Q6_K_BLOCK: usize = 210;
/// Bytes of an IQ4_XS block: fp16 d, 16 bits of scale high bits, 4 bytes of scale low bits,
/// 128 bytes of 4-bit table indices packed as Q4_0's (per 32-value sub-block).
const IQ4_XS_BLOCK: usize = 136;
/// Bytes of an IQ2_XXS block: fp16 d, then per 32-value sub-block 8 bytes: four indices into
/// its 256-point grid (8 values each) and a word of four 7-bit sign indices and a 4-bit scale.
const IQ2_XXS_BLOCK: usize = 66;
/// Bytes of an IQ3_XXS block: fp16 d, 64 bytes of indices into its 256-point grid (4 values
/// each, eight a sub-block), then per sub-block a word of four 7-bit sign indices and a 4-bit
/// scale.
const IQ3_XXS_BLOCK: usize = 98;
/// Bytes of an IQ2_XS block: fp16 d, per 32-value sub-block four u16 (a 9-bit index into its
/// 512-point grid, 8 values each, and a 7-bit sign index), then a byte of two 4-bit scales
/// per sub-block (its first and last 16 values).
const IQ2_XS_BLOCK: usize = 74;
/// Bytes of an IQ3_S block: fp16 d, 64 bytes of the low 8 bits of indices into its 512-point
/// grid (4 values each, eight a sub-block), 8 bytes of their ninth bits (one byte a
/// sub-block), 32 bytes of sign bits (one a value), 4 bytes of 4-bit scales (one a
/// sub-block).
const IQ3_S_BLOCK: usize = 110;
/// Bytes of an IQ2_S block: fp16 d, 32 bytes of the low 8 bits of indices into its
/// 1024-point grid (8 values each, four a sub-block), 32 bytes of sign bits (one a value), 8
/// bytes of the indices' two high bits, 8 bytes of two 4-bit scales a sub-block.
const IQ2_S_BLOCK: usize = 82;
/// Bytes of an IQ1_S block: fp16 d, 32 bytes of the low 8 bits of grid indices (four a
/// sub-block), then per sub-block a u16: the indices' high 3 bits, a 3-bit scale and the sign
/// of its delta (bit 15).
const IQ1_S_BLOCK: usize = 50;
/// ggml's `IQ1S_DELTA` (and `IQ1M_DELTA`): IQ1_S's and IQ1_M's values are grid + or - this.
const IQ1S_DELTA: f32 = 0.125;
/// Bytes of an IQ1_M block: 32 bytes of the low 8 bits of indices into IQ1_S's grid (four a
/// sub-block), 16 bytes of their high 3 bits and delta signs (a nibble an index), 8 bytes of
/// 3-bit scales (one per 16 values) whose top nibbles make the fp16 d.
const IQ1_M_BLOCK: usize = 56;
/// Bytes of a Q8_K block: f32 d, 256 int8 values, 16 int16 sums of 16 values.
const Q8_K_BLOCK: usize = 292;
/// Offset of a Q8_K block's sums.
const Q8_K_SUMS: usize = 4 + 256;

/// The weight types (const generic parameters).
const Q4K: u8 = 0;
const Q5K: u8 = 1;
const Q6K: u8 = 2;
const IQ4XS: u8 = 3;
const Q2K: u8 = 4;
const Q3K: u8 = 5;
const IQ2XXS: u8 = 6;
const IQ3XXS: u8 = 7;
const IQ1S: u8 = 8;
const IQ2XS: u8 = 9;
const IQ3S: u8 = 10;
const IQ2S: u8 = 11;
const IQ1M: u8 = 12;
/// Activation rows one pass over the weights serves: eight per-row accumulators of each kind
/// for four rows fit the vector registers, more would spill.
const PASS_TOKENS: usize = 4;

/// The K-quants' and IQ types' group kernels for `kernel`'s types (Q8_K activations), on a CPU
/// with AVX-512 F/BW/VL and VNNI and a ggml whose row kernels take their AVX2 paths (the
/// caller checks both).
pub(super) fn group_fns(kernel: &VecDot) -> Option<GroupFns> {
    const _: () = assert!(TILES[0] == 8 && TILES[1] == 4);
    let fns = |tiles: [GroupFn; 2], one| Some(GroupFns { tiles, one });
    // The tiles, and the one-token kernel where it is the faster.
    macro_rules! k_quant {
        ($kind:ident, one) => {
            fns([tile::<$kind, 8>, tile::<$kind, 4>], Some(tile::<$kind, 1>))
        };
        ($kind:ident) => {
            fns([tile::<$kind, 8>, tile::<$kind, 4>], None)
        };
    }
    match (kernel.weight_type(), kernel.act_type()) {
        // One token: ggml's Q2_K and IQ4_XS row kernels are as fast (80 against 86 µs,
        // 130 against 133 at 2048 x 2048; benches/README.md).
        (GgmlType::Q2_K, GgmlType::Q8_K) => k_quant!(Q2K),
        (GgmlType::IQ4_XS, GgmlType::Q8_K) => k_quant!(IQ4XS),
        // One token: ggml's IQ2_XXS row kernel is faster (0.22 against 0.24 ms at 2048 x
        // 2048): its grid lookups are the work, and four rows share none of them.
        (GgmlType::IQ2_XXS, GgmlType::Q8_K) => k_quant!(IQ2XXS),
        (GgmlType::IQ3_XXS, GgmlType::Q8_K) => k_quant!(IQ3XXS),
        (GgmlType::IQ1_S, GgmlType::Q8_K) => k_quant!(IQ1S),
        (GgmlType::IQ2_XS, GgmlType::Q8_K) => k_quant!(IQ2XS),
        (GgmlType::IQ3_S, GgmlType::Q8_K) => k_quant!(IQ3S),
        (GgmlType::IQ2_S, GgmlType::Q8_K) => k_quant!(IQ2S),
        (GgmlType::IQ1_M, GgmlType::Q8_K) => k_quant!(IQ1M),
        (GgmlType::Q3_K, GgmlType::Q8_K) => k_quant!(Q3K, one),
        (GgmlType::Q4_K, GgmlType::Q8_K) => k_quant!(Q4K, one),
        (GgmlType::Q5_K, GgmlType::Q8_K) => k_quant!(Q5K, one),
        (GgmlType::Q6_K, GgmlType::Q8_K) => k_quant!(Q6K, one),
        _ => None,
    }
}

/// `TOK` activation rows through [`pass`] in runs of [`PASS_TOKENS`].
///
/// # Safety
/// `w` points at four rows of `row_bytes` bytes, each `blocks / 8` blocks of the weight type
/// (`KIND`), `acts` at `TOK` rows of as many Q8_K blocks; the CPU has the enabled features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn tile<const KIND: u8, const TOK: usize>(
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
                4 => pass::<KIND, 4>(w, row_bytes, a, blocks / 8, o),
                3 => pass::<KIND, 3>(w, row_bytes, a, blocks / 8, o),
                2 => pass::<KIND, 2>(w, row_bytes, a, blocks / 8, o),
                _ => pass::<KIND, 1>(w, row_bytes, a, blocks / 8, o),
            }
        }
    }
}

/// # Safety
/// As [`tile`], `T` activation rows and `supers` blocks per row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn pass<const KIND: u8, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &[*const u8],
    supers: usize,
    out: &mut [[f32; GROUP]],
) {
    let block = match KIND {
        Q4K => Q4_K_BLOCK,
        Q5K => Q5_K_BLOCK,
        IQ4XS => IQ4_XS_BLOCK,
        Q2K => Q2_K_BLOCK,
        Q3K => Q3_K_BLOCK,
        IQ2XXS => IQ2_XXS_BLOCK,
        IQ3XXS => IQ3_XXS_BLOCK,
        IQ1S => IQ1_S_BLOCK,
        IQ2XS => IQ2_XS_BLOCK,
        IQ3S => IQ3_S_BLOCK,
        IQ2S => IQ2_S_BLOCK,
        IQ1M => IQ1_M_BLOCK,
        _ => Q6_K_BLOCK,
    };
    // Row r's four min lanes are 4r..4r+4.
    let lanes_m = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let mut acc = [[_mm512_setzero_ps(); 2]; T];
    let mut acc_m = [_mm512_setzero_ps(); T];
    // IQ1_S: per token and row, ggml's scalar sum of d x the deltas' integer share.
    let mut acc1 = [[0f32; GROUP]; T];
    // IQ1_M: the deltas' lanes, a second accumulator as ggml's.
    let mut acc2 = [[_mm512_setzero_ps(); 2]; T];
    let next = w.wrapping_add(PREFETCH_ROWS * row_bytes);
    for b in 0..supers {
        // SAFETY: block b of each weight and activation row is in bounds (b < supers), per
        // the contract.
        unsafe {
            let x = [0, 1, 2, 3].map(|r| w.add(r * row_bytes + b * block));
            let ahead = next.wrapping_add(b * GROUP * block);
            for line in 0..(GROUP * block).div_ceil(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
            }
            let y: [*const u8; T] = std::array::from_fn(|t| acts[t].add(b * Q8_K_BLOCK));
            let mut sumi = [[_mm512_setzero_si512(); 2]; T];
            let mut isum1 = [[0i32; GROUP]; T];
            let mut sumi2 = [[_mm512_setzero_si512(); 2]; T];
            let xd = match KIND {
                Q4K => q45_k_sums::<false, T>(x, &y, &mut sumi, &mut acc_m, lanes_m),
                Q5K => q45_k_sums::<true, T>(x, &y, &mut sumi, &mut acc_m, lanes_m),
                IQ4XS => iq4_xs_sums(x, &y, &mut sumi),
                Q2K => q2_k_sums(x, &y, &mut sumi, &mut acc),
                Q3K => q3_k_sums(x, &y, &mut sumi),
                IQ2XXS | IQ3XXS | IQ2XS | IQ3S | IQ2S => grid_sums::<KIND, T>(x, &y, &mut sumi),
                IQ1S => iq1_s_sums(x, &y, &mut sumi, &mut isum1),
                IQ1M => iq1_m_sums(x, &y, &mut sumi, &mut sumi2),
                _ => q6_k_sums(x, &y, &mut sumi),
            };
            for (t, y) in y.iter().enumerate() {
                let yd = y.cast::<f32>().read_unaligned();
                // d_y * d_x per row, as ggml's f32 product.
                let dr = _mm_mul_ps(_mm_set1_ps(yd), xd);
                scaled_add(_mm512_castps128_ps512(dr), sumi[t], &mut acc[t]);
                if KIND == IQ1M {
                    scaled_add(_mm512_castps128_ps512(dr), sumi2[t], &mut acc2[t]);
                }
                if KIND == IQ1S {
                    let mut d = [0f32; GROUP];
                    _mm_storeu_ps(d.as_mut_ptr(), dr);
                    for ((a, d), i) in acc1[t].iter_mut().zip(d).zip(isum1[t]) {
                        // ggml's `accum1 += d * sumi1`, contracted to a fused multiply-add as
                        // ggml is built with FMA.
                        *a = d.mul_add(i as f32, *a);
                    }
                }
            }
        }
    }
    for ((((o, acc), m), a1), a2) in out.iter_mut().zip(acc).zip(acc_m).zip(acc1).zip(acc2) {
        let sums = row_sums(acc);
        if KIND == IQ1M {
            let deltas = row_sums(a2);
            *o = std::array::from_fn(|r| sums[r] + IQ1S_DELTA * deltas[r]);
            continue;
        }
        if KIND == IQ1S {
            *o = std::array::from_fn(|r| sums[r] + IQ1S_DELTA * a1[r]);
            continue;
        }
        if matches!(KIND, IQ2XXS | IQ3XXS | IQ2XS | IQ2S) {
            // ggml's final 0.125 (IQ2_XXS, IQ2_XS, IQ2_S) or 0.25 (IQ3_XXS) x the sum (IQ3_S:
            // none).
            let f = if KIND == IQ3XXS { 0.25 } else { 0.125 };
            *o = sums.map(|s| f * s);
            continue;
        }
        if !matches!(KIND, Q4K | Q5K) {
            *o = sums;
            continue;
        }
        if KIND == Q5K {
            // ggml's scalar sum of the mins' share (each row's four lanes hold it).
            let mut m4 = [0f32; 16];
            _mm512_storeu_ps(m4.as_mut_ptr(), m);
            for (r, (o, s)) in o.iter_mut().zip(sums).enumerate() {
                *o = s + m4[4 * r];
            }
            continue;
        }
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

/// A Q4_K block (Q5_K with `FIFTH`) of four rows (`x`) against `T` Q8_K blocks (`y`): the
/// scaled lane sums into `sumi`, the mins' share into `acc_m`; returns d of the four rows.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn q45_k_sums<const FIFTH: bool, const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
    acc_m: &mut [__m512; T],
    lanes_m: __m512i,
) -> __m128 {
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let m4 = _mm512_set1_epi8(0x0f);
        let sm = x.map(|x| scales_and_mins(x.add(4).cast::<[u8; 12]>().read_unaligned()));
        let (xd, xdmin) = (fp16_of_rows(x, 0), fp16_of_rows(x, 2));
        // The four rows' mins as int16, row r in the r-th 128 bits.
        let half = |r: usize| i64::from_le_bytes(sm[r][8..].try_into().expect("8 bytes"));
        let mins = _mm512_cvtepu8_epi16(_mm256_set_m128i(
            _mm_set_epi64x(half(3), half(2)),
            _mm_set_epi64x(half(1), half(0)),
        ));
        // Per row pair, both rows' scales (and mins) as int16: row a low, row b high; the
        // scale vector of sub-block s is [a[s] x 16, b[s] x 16].
        let both = [[0, 1], [2, 3]].map(|[ra, rb]| {
            _mm512_cvtepu8_epi16(_mm256_set_m128i(
                _mm_loadu_si128(sm[rb].as_ptr().cast()),
                _mm_loadu_si128(sm[ra].as_ptr().cast()),
            ))
        });
        let base = _mm512_set_epi64(
            0x0010_0010_0010_0010,
            0x0010_0010_0010_0010,
            0x0010_0010_0010_0010,
            0x0010_0010_0010_0010,
            0,
            0,
            0,
            0,
        );
        // Q5_K: each pair's fifth bits; sub-block s's adds 16 where bit s is set.
        let qs = if FIFTH { 48 } else { 16 };
        let fifth = [[0, 1], [2, 3]].map(|[ra, rb]| load_pair(x[ra].add(16), x[rb].add(16)));
        let add_fifth = |v: __m512i, p: usize, s: usize| {
            if !FIFTH {
                return v;
            }
            let set = _mm512_test_epi8_mask(fifth[p], _mm512_set1_epi8(1 << s));
            _mm512_or_si512(v, _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(16)))
        };
        for j in 0..4 {
            for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
                let q = load_pair(x[ra].add(qs + 32 * j), x[rb].add(qs + 32 * j));
                let lo = add_fifth(_mm512_and_si512(q, m4), p, 2 * j);
                let hi = add_fifth(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4),
                    p,
                    2 * j + 1,
                );
                let scale = |s: i16| {
                    let idx = _mm512_add_epi16(base, _mm512_set1_epi16(s));
                    _mm512_permutexvar_epi16(idx, both[p])
                };
                let (sl, sh) = (scale(2 * j as i16), scale(2 * j as i16 + 1));
                for (s, y) in sumi.iter_mut().zip(y) {
                    let y = y.add(4 + 64 * j);
                    let yl = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.cast()));
                    let yh = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(32).cast()));
                    let pl = _mm512_madd_epi16(sl, _mm512_maddubs_epi16(lo, yl));
                    let ph = _mm512_madd_epi16(sh, _mm512_maddubs_epi16(hi, yh));
                    s[p] = _mm512_add_epi32(s[p], _mm512_add_epi32(pl, ph));
                }
            }
        }
        for (acc_m, y) in acc_m.iter_mut().zip(y) {
            let yd = y.cast::<f32>().read_unaligned();
            // -d_y * dmin_x per row, as ggml's f32 product.
            let dmin = _mm512_castps128_ps512(_mm_mul_ps(_mm_set1_ps(-yd), xdmin));
            // The sums of each 32-value sub-block (ggml's hadd of the 16-value sums), against
            // every row's mins.
            let bsums = _mm256_loadu_si256(y.add(Q8_K_SUMS).cast());
            let q8s = _mm_hadd_epi16(
                _mm256_castsi256_si128(bsums),
                _mm256_extracti128_si256::<1>(bsums),
            );
            let mut prod = _mm512_madd_epi16(mins, _mm512_broadcast_i32x4(q8s));
            if FIFTH {
                // Q5_K: each row's four lanes summed as integers first (ggml's hadds).
                prod = _mm512_add_epi32(prod, _mm512_shuffle_epi32::<0b10_11_00_01>(prod));
                prod = _mm512_add_epi32(prod, _mm512_shuffle_epi32::<0b01_00_11_10>(prod));
            }
            *acc_m = _mm512_fmadd_ps(
                _mm512_permutexvar_ps(lanes_m, dmin),
                _mm512_cvtepi32_ps(prod),
                *acc_m,
            );
        }
        xd
    }
}

/// A Q6_K block of four rows (`x`) against `T` Q8_K blocks (`y`): the scaled lane sums,
/// less the offset's share, into `sumi`; returns d of the four rows.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn q6_k_sums<const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
) -> __m128 {
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let (m15, m3) = (_mm512_set1_epi8(15), _mm512_set1_epi8(3));
        let xd = fp16_of_rows(x, 208);
        // Per row pair, its two rows' 16 scales as int16 (row a low, row b high).
        let scales = [[0, 1], [2, 3]].map(|[ra, rb]| {
            _mm512_cvtepi8_epi16(_mm256_set_m128i(
                _mm_loadu_si128(x[rb].add(192).cast()),
                _mm_loadu_si128(x[ra].add(192).cast()),
            ))
        });
        for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
            // 32 x (the activation's 16-value sums . the row's scales), two a lane, as
            // ggml's madd and shift.
            for (s, y) in sumi[..].iter_mut().zip(y) {
                let bsums = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(Q8_K_SUMS).cast()));
                let sub = _mm512_slli_epi32::<5>(_mm512_madd_epi16(bsums, scales[p]));
                s[p] = _mm512_sub_epi32(s[p], sub);
            }
            for j in 0..2 {
                let q1 = load_pair(x[ra].add(64 * j), x[rb].add(64 * j));
                let q2 = load_pair(x[ra].add(64 * j + 32), x[rb].add(64 * j + 32));
                let qh = load_pair(x[ra].add(128 + 32 * j), x[rb].add(128 + 32 * j));
                // The four 32-value runs of these 128 values: low bits | high bits << 4.
                let runs = [
                    _mm512_or_si512(
                        _mm512_and_si512(q1, m15),
                        _mm512_slli_epi16::<4>(_mm512_and_si512(qh, m3)),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(q2, m15),
                        _mm512_slli_epi16::<2>(_mm512_and_si512(qh, _mm512_set1_epi8(12))),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(q1), m15),
                        _mm512_and_si512(qh, _mm512_set1_epi8(48)),
                    ),
                    _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(q2), m15),
                        _mm512_srli_epi16::<2>(_mm512_and_si512(qh, _mm512_set1_epi8(-64))),
                    ),
                ];
                add_runs::<T, false>(runs, runs, scales[p], j, p, y, sumi);
            }
        }
        xd
    }
}

/// An IQ4_XS block of four rows (`x`) against `T` Q8_K blocks (`y`): the scaled lane sums into
/// `sumi`; returns d of the four rows.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn iq4_xs_sums<const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
) -> __m128 {
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let xd = fp16_of_rows(x, 0);
        let table = _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4_VALUES.as_ptr().cast()));
        // Per row, the eight sub-blocks' signed scales: 6 bits from a low nibble and two high
        // bits, less 32.
        let scales = x.map(|x| {
            let high = x.add(2).cast::<u16>().read_unaligned();
            let low = x.add(4).cast::<[u8; 4]>().read_unaligned();
            let mut ls = [0i16; 16];
            for (ib, l) in ls.iter_mut().take(8).enumerate() {
                let lo = (low[ib / 2] >> (4 * (ib % 2))) & 0xf;
                let hi = (high >> (2 * ib)) & 3;
                *l = i16::from(lo) | (hi << 4) as i16;
                *l -= 32;
            }
            ls
        });
        // Per row pair, both rows' scales as int16 (row a in lanes 0..8, b in 16..24); the
        // scale vector of sub-block s is [a[s] x 16, b[s] x 16].
        let both = [[0, 1], [2, 3]]
            .map(|[ra, rb]| load_pair(scales[ra].as_ptr().cast(), scales[rb].as_ptr().cast()));
        let base = _mm512_set_epi64(
            0x0010_0010_0010_0010,
            0x0010_0010_0010_0010,
            0x0010_0010_0010_0010,
            0x0010_0010_0010_0010,
            0,
            0,
            0,
            0,
        );
        for s in 0..8 {
            for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
                // The two rows' 32 values as signed bytes, then ggml's |x| and y * sign(x) for
                // the unsigned-by-signed product.
                let idx = pair::<Q4>(x[ra].add(8 + 16 * s), x[rb].add(8 + 16 * s));
                let v = _mm512_shuffle_epi8(table, idx);
                let neg = _mm512_movepi8_mask(v);
                let av = _mm512_abs_epi8(v);
                let sc = _mm512_permutexvar_epi16(
                    _mm512_add_epi16(base, _mm512_set1_epi16(s as i16)),
                    both[p],
                );
                for (acc, y) in sumi.iter_mut().zip(y) {
                    let q8 = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(4 + 32 * s).cast()));
                    let sy = _mm512_mask_sub_epi8(q8, neg, _mm512_setzero_si512(), q8);
                    let p16 = _mm512_maddubs_epi16(av, sy);
                    acc[p] = _mm512_add_epi32(acc[p], _mm512_madd_epi16(p16, sc));
                }
            }
        }
        xd
    }
}

/// A Q2_K block of four rows (`x`) against `T` Q8_K blocks (`y`): the mins' share straight
/// into `acc` (before the caller adds the scaled sums, ggml's order), the scaled lane sums
/// into `sumi`; returns d of the four rows.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn q2_k_sums<const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
    acc: &mut [[__m512; 2]; T],
) -> __m128 {
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let m4 = _mm_set1_epi8(0x0f);
        let (xd, xdmin) = (fp16_of_rows(x, 80), fp16_of_rows(x, 82));
        // Per row pair, the two rows' 16 scales and 16 mins as int16, row a low, row b high.
        let nibbles = |r: usize, shift: bool| {
            let b = _mm_loadu_si128(x[r].cast());
            let b = if shift { _mm_srli_epi16::<4>(b) } else { b };
            _mm256_cvtepu8_epi16(_mm_and_si128(b, m4))
        };
        let both = |shift: bool| {
            [[0, 1], [2, 3]].map(|[ra, rb]| join(nibbles(ra, shift), nibbles(rb, shift)))
        };
        let (scales, mins) = (both(false), both(true));
        for (t, y) in y.iter().enumerate() {
            let yd = y.cast::<f32>().read_unaligned();
            // -d_y * dmin_x per row, as ggml's f32 product; the mins against the
            // activation's 16-value sums, two a lane.
            let dmin = _mm512_castps128_ps512(_mm_mul_ps(_mm_set1_ps(-yd), xdmin));
            let bsums = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(Q8_K_SUMS).cast()));
            let prod = mins.map(|m| _mm512_madd_epi16(m, bsums));
            scaled_add(dmin, prod, &mut acc[t]);
        }
        for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
            for j in 0..2 {
                let runs = two_bit_runs(load_pair(x[ra].add(16 + 32 * j), x[rb].add(16 + 32 * j)));
                add_runs::<T, false>(runs, runs, scales[p], j, p, y, sumi);
            }
        }
        xd
    }
}

/// Adds a row pair's four 32-value runs `runs` (unsigned values, values 128j.. of the block;
/// with `MINUS`, less `minus`, also unsigned: ggml's two products subtracted in int16)
/// times `T` activations into `sumi[..][p]`, each run's 16-value halves scaled by the pair's
/// int16 `scales` (16 per row, row a in lanes 0..16, row b in 16..32; Q2_K, Q3_K, Q6_K): run m
/// uses
/// [a[2m] x 8, a[2m + 1] x 8, b[2m] x 8, b[2m + 1] x 8], as ggml's madd of the scales.
///
/// # Safety
/// `y` point at whole Q8_K blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn add_runs<const T: usize, const MINUS: bool>(
    runs: [__m512i; 4],
    minus: [__m512i; 4],
    scales: __m512i,
    j: usize,
    p: usize,
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
) {
    let base = _mm512_set_epi16(
        17, 17, 17, 17, 17, 17, 17, 17, 16, 16, 16, 16, 16, 16, 16, 16, 1, 1, 1, 1, 1, 1, 1, 1, 0,
        0, 0, 0, 0, 0, 0, 0,
    );
    for (k, q) in runs.into_iter().enumerate() {
        let m = (4 * j + k) as i16;
        let sc = _mm512_permutexvar_epi16(_mm512_add_epi16(base, _mm512_set1_epi16(2 * m)), scales);
        for (s, y) in sumi.iter_mut().zip(y) {
            // SAFETY: within the activation block, per the contract.
            let yq = unsafe {
                _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(4 + 128 * j + 32 * k).cast()))
            };
            let mut p16 = _mm512_maddubs_epi16(q, yq);
            if MINUS {
                p16 = _mm512_sub_epi16(p16, _mm512_maddubs_epi16(minus[k], yq));
            }
            s[p] = _mm512_add_epi32(s[p], _mm512_madd_epi16(sc, p16));
        }
    }
}

/// The fp16 at byte `at` of each of the four blocks `x` (a scale), as f32 (exact).
///
/// # Safety
/// Two bytes at `at` of each block are readable; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn fp16_of_rows(x: [*const u8; 4], at: usize) -> __m128 {
    // SAFETY: per the contract.
    let h = |r: usize| unsafe { x[r].add(at).cast::<i16>().read_unaligned() };
    _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, h(3), h(2), h(1), h(0)))
}

/// The grids of IQ2_XXS (eight unsigned values a point, as a little-endian u64), IQ3_XXS
/// (four, as a u32), IQ2_XS, IQ2_S, IQ3_S and IQ1_S (its int8 values), and the sign masks
/// (bit j: value j negated) of the 128 sign indices IQ2_XXS, IQ2_XS and IQ3_XXS share, read
/// once from ggml's own dequantization (no table is copied).
struct GridTables {
    grid2: Vec<u64>,
    grid3: Vec<u32>,
    signs: [u8; 128],
    grid1: Vec<u64>,
    grid2x: Vec<u64>,
    grid3s: Vec<u32>,
    grid2s: Vec<u64>,
}

/// The `n` points of `t`'s grid, `N` values each, read through ggml's dequantization of
/// blocks of `size` bytes whose fp16 d is `d` and whose scales, signs and deltas are zero,
/// so that each value is the point's plus `delta`; `place(block, i, index)` writes point
/// `index` as the block's i-th.
fn read_grid<const N: usize>(
    t: freetoken_ggml::GgmlType,
    size: usize,
    d: u16,
    n: usize,
    delta: f32,
    place: impl Fn(&mut [u8], usize, usize),
) -> Vec<[u8; N]> {
    let per_block = 256 / N;
    let mut points = Vec::with_capacity(n);
    for first in (0..n).step_by(per_block) {
        let mut b = vec![0u8; size];
        b[..2].copy_from_slice(&d.to_le_bytes());
        for i in 0..per_block {
            place(&mut b, i, first + i);
        }
        let mut y = [0f32; 256];
        freetoken_ggml::dequantize(t, &b, &mut y).expect("one block");
        points.extend(
            y.chunks_exact(N)
                .map(|v| std::array::from_fn(|j| ((v[j] - delta) as i8) as u8)),
        );
    }
    points
}

/// The sign masks of the 128 sign indices, from IQ2_XXS blocks of grid point 0 (all values
/// positive) whose sub-block s takes sign index `first + s` for its four groups.
fn read_signs() -> [u8; 128] {
    let mut signs = [0u8; 128];
    for first in (0..128).step_by(8) {
        let mut b = [0u8; IQ2_XXS_BLOCK];
        b[..2].copy_from_slice(&0x4800u16.to_le_bytes());
        for s in 0..8 {
            let word = (first + s) as u32 * 0x0020_4081; // the same index for all four groups
            b[6 + 8 * s..10 + 8 * s].copy_from_slice(&word.to_le_bytes());
        }
        let mut y = [0f32; 256];
        freetoken_ggml::dequantize(freetoken_ggml::GgmlType::IQ2_XXS, &b, &mut y)
            .expect("one block");
        for s in 0..8 {
            let v = &y[32 * s..32 * s + 8];
            signs[first + s] = (0..8).fold(0, |m, j| m | u8::from(v[j] < 0.0) << j);
        }
    }
    signs
}

fn grid_tables() -> &'static GridTables {
    use freetoken_ggml::GgmlType;
    static TABLES: std::sync::OnceLock<GridTables> = std::sync::OnceLock::new();
    // fp16 8, 4 and 1: with zero scales, d x ggml's scale factor is 1 (IQ3_XXS's is 1/4).
    let (eight, four, one) = (0x4800u16, 0x4400u16, 0x3c00u16);
    let low = |b: &mut [u8], i: usize, index: usize| b[2 + i] = index as u8;
    let wide = |points: Vec<[u8; 8]>| points.into_iter().map(u64::from_le_bytes).collect();
    let narrow = |points: Vec<[u8; 4]>| points.into_iter().map(u32::from_le_bytes).collect();
    TABLES.get_or_init(|| GridTables {
        // Four indices a sub-block, then its word.
        grid2: wide(read_grid(
            GgmlType::IQ2_XXS,
            IQ2_XXS_BLOCK,
            eight,
            256,
            0.0,
            |b, i, x| {
                b[2 + 8 * (i / 4) + i % 4] = x as u8;
            },
        )),
        grid3: narrow(read_grid(
            GgmlType::IQ3_XXS,
            IQ3_XXS_BLOCK,
            four,
            256,
            0.0,
            low,
        )),
        signs: read_signs(),
        // The low 8 bits, then three high bits an index in its sub-block's u16.
        grid1: wide(read_grid(
            GgmlType::IQ1_S,
            IQ1_S_BLOCK,
            one,
            2048,
            IQ1S_DELTA,
            |b, i, x| {
                low(b, i, x);
                let at = 34 + 2 * (i / 4);
                let qh =
                    u16::from_le_bytes([b[at], b[at + 1]]) | ((x >> 8) as u16) << (3 * (i % 4));
                b[at..at + 2].copy_from_slice(&qh.to_le_bytes());
            },
        )),
        // Index and sign index in one u16.
        grid2x: wide(read_grid(
            GgmlType::IQ2_XS,
            IQ2_XS_BLOCK,
            eight,
            512,
            0.0,
            |b, i, x| {
                b[2 + 2 * i..4 + 2 * i].copy_from_slice(&(x as u16).to_le_bytes());
            },
        )),
        // The ninth bit of index i, bit i % 8 of its sub-block's byte.
        grid3s: narrow(read_grid(
            GgmlType::IQ3_S,
            IQ3_S_BLOCK,
            one,
            512,
            0.0,
            |b, i, x| {
                low(b, i, x);
                b[66 + i / 8] |= ((x >> 8) as u8) << (i % 8);
            },
        )),
        // Two high bits an index, four indices a byte.
        grid2s: wide(read_grid(
            GgmlType::IQ2_S,
            IQ2_S_BLOCK,
            eight,
            1024,
            0.0,
            |b, i, x| {
                low(b, i, x);
                b[66 + i / 4] |= ((x >> 8) as u8) << (2 * (i % 4));
            },
        )),
    })
}

/// An IQ2_XXS or IQ3_XXS (`KIND`) block of four rows (`x`) against `T` Q8_K blocks (`y`): per
/// 32-value sub-block ggml's unsigned grid values times the activation with the weights'
/// signs, scaled by 2 x the 4-bit scale + 1, into `sumi`; returns d of the four rows.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn grid_sums<const KIND: u8, const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
) -> __m128 {
    let tables = grid_tables();
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let xd = fp16_of_rows(x, 0);
        for s in 0..8 {
            // Per row: the sub-block's word of signs and scale, and its 32 values as four
            // u64 (IQ2_XXS: four points of eight) built from the grid.
            // IQ2_XXS and IQ3_XXS: a word of four sign indices and the scale; IQ2_XS: four
            // u16 of index and sign index, and a byte of two scales.
            let word_at = if KIND == IQ3XXS {
                66 + 4 * s
            } else {
                6 + 8 * s
            };
            let word = x.map(|x| x.add(word_at).cast::<u32>().read_unaligned());
            let q = x.map(|x| x.add(2 + 8 * s).cast::<[u16; 4]>().read_unaligned());
            let values = |r: usize| -> [i64; 4] {
                let idx = x[r].add(2 + 8 * s).cast::<[u8; 8]>().read_unaligned();
                // IQ3_S: the ninth bit of index i is bit i of the sub-block's byte.
                let high = usize::from(x[r].add(66 + s).read());
                let g3s =
                    |i: usize| u64::from(tables.grid3s[usize::from(idx[i]) | (high >> i & 1) << 8]);
                std::array::from_fn(|j| match KIND {
                    IQ2XXS => tables.grid2[usize::from(idx[j])] as i64,
                    IQ2S => {
                        // Four indices a sub-block, their high two bits in its qh byte.
                        let low = usize::from(x[r].add(2 + 4 * s + j).read());
                        let high = usize::from(x[r].add(66 + s).read()) >> (2 * j) & 3;
                        tables.grid2s[low | high << 8] as i64
                    }
                    IQ2XS => tables.grid2x[usize::from(q[r][j] & 511)] as i64,
                    IQ3S => (g3s(2 * j) | g3s(2 * j + 1) << 32) as i64,
                    _ => {
                        let g = |i: usize| u64::from(tables.grid3[usize::from(idx[i])]);
                        (g(2 * j) | g(2 * j + 1) << 32) as i64
                    }
                })
            };
            let signs = |r: usize| {
                if matches!(KIND, IQ3S | IQ2S) {
                    // One bit a value, in order.
                    let at = if KIND == IQ3S { 74 + 4 * s } else { 34 + 4 * s };
                    return u64::from(x[r].add(at).cast::<u32>().read_unaligned());
                }
                (0..4).fold(0u64, |m, j| {
                    let k = if KIND == IQ2XS {
                        usize::from(q[r][j] >> 9)
                    } else {
                        (word[r] >> (7 * j)) as usize & 127
                    };
                    m | u64::from(tables.signs[k]) << (8 * j)
                })
            };
            let scales = |r: usize| -> [i16; 2] {
                if matches!(KIND, IQ2XS | IQ2S) {
                    let at = if KIND == IQ2XS { 66 + s } else { 74 + s };
                    let b = i16::from(x[r].add(at).read());
                    [2 * (b & 15) + 1, 2 * (b >> 4) + 1]
                } else if KIND == IQ3S {
                    let b = i16::from(x[r].add(106 + s / 2).read()) >> (4 * (s % 2)) & 15;
                    [2 * b + 1; 2]
                } else {
                    [(2 * (word[r] >> 28) + 1) as i16; 2]
                }
            };
            for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
                let (a, b) = (values(ra), values(rb));
                let v = _mm512_set_epi64(b[3], b[2], b[1], b[0], a[3], a[2], a[1], a[0]);
                let neg = signs(ra) | signs(rb) << 32;
                signed_products(v, neg, [scales(ra), scales(rb)], y, s, sumi, p);
            }
        }
        xd
    }
}

/// For each token, `sumi[t][p] += madd(maddubs(v, y with the `neg` bytes negated), scales)`
/// over sub-block `s` of the Q8_K blocks `y`: ggml's sign-trick product of unsigned weight
/// magnitudes `v` (row pair `p`, row a in the low 256 bits) and signed activations, in int16
/// pairs, times each row's scales of the sub-block's first and last 16 values.
///
/// # Safety
/// `y` points at whole Q8_K blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn signed_products<const T: usize>(
    v: __m512i,
    neg: u64,
    scales: [[i16; 2]; 2],
    y: &[*const u8; T],
    s: usize,
    sumi: &mut [[__m512i; 2]; T],
    p: usize,
) {
    let [a, b] = scales.map(|[lo, hi]| {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_set1_epi16(lo)),
            _mm_set1_epi16(hi),
        )
    });
    let sc = join(a, b);
    for (acc, y) in sumi.iter_mut().zip(y) {
        // SAFETY: sub-block s of a Q8_K block, per the contract.
        let q8 = unsafe { _mm256_loadu_si256(y.add(4 + 32 * s).cast()) };
        let q8 = _mm512_broadcast_i64x4(q8);
        let sy = _mm512_mask_sub_epi8(q8, neg, _mm512_setzero_si512(), q8);
        let p16 = _mm512_maddubs_epi16(v, sy);
        acc[p] = _mm512_add_epi32(acc[p], _mm512_madd_epi16(p16, sc));
    }
}

/// An IQ1_M block of four rows (`x`) against `T` Q8_K blocks (`y`): per 32-value sub-block
/// the grid values (-1, 0, 1) times the activation into `sumi`, and the deltas' signs (one per
/// 8 values) times the activation into `sumi2`, both scaled by 2 x the 3-bit scale + 1 of
/// each 16 values; returns each row's d, the fp16 its scales' top nibbles make.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn iq1_m_sums<const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
    sumi2: &mut [[__m512i; 2]; T],
) -> __m128 {
    let tables = grid_tables();
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let sc = x.map(|x| x.add(48).cast::<[u16; 4]>().read_unaligned());
        let d = sc.map(|w| {
            (w[0] >> 12 | (w[1] >> 8) & 0x00f0 | (w[2] >> 4) & 0x0f00 | w[3] & 0xf000) as i16
        });
        let xd = _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, d[3], d[2], d[1], d[0]));
        let ones = _mm512_set1_epi8(1);
        for s in 0..8 {
            // Index l's nibble: bits 0-2 its high index bits, bit 3 its delta's sign.
            let nibble = |r: usize, l: usize| x[r].add(32 + 2 * s + l / 2).read() >> (4 * (l % 2));
            let values = |r: usize| -> [i64; 4] {
                std::array::from_fn(|l| {
                    let low = usize::from(x[r].add(4 * s + l).read());
                    tables.grid1[low | usize::from(nibble(r, l) & 7) << 8] as i64
                })
            };
            let deltas = |r: usize| {
                (0..4).fold(0u64, |m, l| {
                    m | (u64::from(nibble(r, l) >> 3 & 1) * (0xff << (8 * l)))
                })
            };
            let scales = |r: usize| -> [i16; 2] {
                let w = sc[r][s / 2] >> (6 * (s % 2));
                [(2 * (w & 7) + 1) as i16, (2 * (w >> 3 & 7) + 1) as i16]
            };
            for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
                let (a, b) = (values(ra), values(rb));
                let v = _mm512_set_epi64(b[3], b[2], b[1], b[0], a[3], a[2], a[1], a[0]);
                let sc = [scales(ra), scales(rb)];
                let neg = _mm512_movepi8_mask(v);
                signed_products(_mm512_abs_epi8(v), neg, sc, y, s, sumi, p);
                let delta_neg = deltas(ra) | deltas(rb) << 32;
                signed_products(ones, delta_neg, sc, y, s, sumi2, p);
            }
        }
        xd
    }
}

/// An IQ1_S block of four rows (`x`) against `T` Q8_K blocks (`y`): per 32-value sub-block
/// the grid values (-1, 0, 1) times the activation, scaled by 2 x the 3-bit scale + 1, into
/// `sumi`, and ggml's integer share of the deltas (the activation's sub-block sums times the
/// delta's sign and the scale) into `isum1`; returns d of the four rows.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn iq1_s_sums<const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
    isum1: &mut [[i32; GROUP]; T],
) -> __m128 {
    let tables = grid_tables();
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let xd = fp16_of_rows(x, 0);
        for s in 0..8 {
            let qh = x.map(|x| x.add(34 + 2 * s).cast::<u16>().read_unaligned());
            let values = |r: usize| -> [i64; 4] {
                std::array::from_fn(|l| {
                    let low = usize::from(x[r].add(2 + 4 * s + l).read());
                    let high = usize::from((qh[r] >> (3 * l)) & 7);
                    tables.grid1[low | high << 8] as i64
                })
            };
            let scale = |r: usize| (2 * ((qh[r] >> 12) & 7) + 1) as i16;
            for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
                let (a, b) = (values(ra), values(rb));
                let v = _mm512_set_epi64(b[3], b[2], b[1], b[0], a[3], a[2], a[1], a[0]);
                let neg = _mm512_movepi8_mask(v);
                let sc = [[scale(ra); 2], [scale(rb); 2]];
                signed_products(_mm512_abs_epi8(v), neg, sc, y, s, sumi, p);
            }
            for (isum, y) in isum1.iter_mut().zip(y) {
                let bs = y.add(Q8_K_SUMS + 4 * s).cast::<[i16; 2]>().read_unaligned();
                let bsum = i32::from(bs[0]) + i32::from(bs[1]);
                for (r, i) in isum.iter_mut().enumerate() {
                    let sign = if qh[r] & 0x8000 != 0 { -1 } else { 1 };
                    *i += bsum * sign * i32::from(scale(r));
                }
            }
        }
        xd
    }
}

/// A Q3_K block of four rows (`x`) against `T` Q8_K blocks (`y`): the scaled lane sums into
/// `sumi`; returns d of the four rows.
///
/// # Safety
/// `x` and `y` point at whole blocks; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn q3_k_sums<const T: usize>(
    x: [*const u8; 4],
    y: &[*const u8; T],
    sumi: &mut [[__m512i; 2]; T],
) -> __m128 {
    // SAFETY: within the blocks, per the contract.
    unsafe {
        let xd = fp16_of_rows(x, 108);
        // Per row, the 16 signed 6-bit scales, unpacked as ggml does (low nibbles from the first
        // 8 bytes, high two bits from the last 4), less 32.
        let scales = x.map(|x| {
            let w = |i: usize| x.add(96 + 4 * i).cast::<u32>().read_unaligned();
            let (a0, a1, a2) = (w(0), w(1), w(2));
            let (k1, k2) = (0x0303_0303_u32, 0x0f0f_0f0f_u32);
            let words = [
                (a0 & k2) | ((a2 & k1) << 4),
                (a1 & k2) | (((a2 >> 2) & k1) << 4),
                ((a0 >> 4) & k2) | (((a2 >> 4) & k1) << 4),
                ((a1 >> 4) & k2) | (((a2 >> 6) & k1) << 4),
            ];
            let v = _mm_set_epi32(
                words[3] as i32,
                words[2] as i32,
                words[1] as i32,
                words[0] as i32,
            );
            _mm_sub_epi8(v, _mm_set1_epi8(32))
        });
        let both = [[0, 1], [2, 3]].map(|[ra, rb]| {
            join(
                _mm256_cvtepi8_epi16(scales[ra]),
                _mm256_cvtepi8_epi16(scales[rb]),
            )
        });
        for (p, [ra, rb]) in [(0, [0, 1]), (1, [2, 3])] {
            let high = load_pair(x[ra], x[rb]);
            for j in 0..2 {
                let runs = two_bit_runs(load_pair(x[ra].add(32 + 32 * j), x[rb].add(32 + 32 * j)));
                // 4 where run b's high bit is clear.
                let minus: [__m512i; 4] = std::array::from_fn(|k| {
                    let bit = _mm512_set1_epi8(1 << (4 * j + k));
                    _mm512_maskz_mov_epi8(_mm512_testn_epi8_mask(high, bit), _mm512_set1_epi8(4))
                });
                add_runs::<T, true>(runs, minus, both[p], j, p, y, sumi);
            }
        }
        xd
    }
}

/// `lo` in the low 256 bits, `hi` in the high ones (a row pair's values).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// 32 bytes at `a`, then 32 at `b`.
///
/// # Safety
/// 32 bytes are readable at each; the CPU has the enabled features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn load_pair(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: per the contract.
    unsafe { join(_mm256_loadu_si256(a.cast()), _mm256_loadu_si256(b.cast())) }
}

/// The four 32-value runs packed two bits each in `q`'s bytes (Q2_K, Q3_K): run k in bits
/// 2k..2k+2.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
fn two_bit_runs(q: __m512i) -> [__m512i; 4] {
    let m3 = _mm512_set1_epi8(3);
    [
        _mm512_and_si512(q, m3),
        _mm512_and_si512(_mm512_srli_epi16::<2>(q), m3),
        _mm512_and_si512(_mm512_srli_epi16::<4>(q), m3),
        _mm512_and_si512(_mm512_srli_epi16::<6>(q), m3),
    ]
}
