//! Four rows of Q4_0, Q5_0, Q8_0, IQ4_NL or MXFP4 against Q8_0 activation rows, and of Q4_K,
//! Q5_K, Q6_K or IQ4_XS against Q8_K ones, with AVX2, FMA and F16C: bit-identical to ggml's
//! AVX2 `ggml_vec_dot_q4_0_q8_0` / `_q5_0_q8_0` / `_q8_0_q8_0` / `_iq4_nl_q8_0` /
//! `_mxfp4_q8_0` / `_q4_K_q8_K` / `_q5_K_q8_K` / `_q6_K_q8_K` / `_iq4_xs_q8_K` row by row.
//!
//! A 256-bit register holds one row's eight 4-value lanes, so the four rows go one after
//! another; what they share is each activation block's loads, its scale and (for the legacy
//! types) its offset sum, and with several activation rows each weight block is unpacked once
//! for all of them. Per block and lane the integer sum is exact in ggml's kernels and here
//! (nothing saturates at these magnitudes); ggml's Q4_0 and Q5_0 take their offset (8, 16)
//! off each value before a sign-trick product, these take (offset x the activation's lane sum)
//! off the lane sum of the unsigned values, the same integer. The f32 operations and their
//! order are ggml's: the product of the two block scales, one fused multiply-add per block
//! into eight lanes, `hsum_float_8` at the end (Q4_K: plus its four min lanes' sum; Q5_K:
//! plus a scalar chain of the mins' integer sums, one fused multiply-add per block; IQ4_NL and
//! MXFP4: of two accumulators, even and odd blocks, an odd last block added after it by a
//! scalar tail). The K-quants' and IQ4_XS's fused multiply-add is one per 256 values.

use super::blocks::{e8m0_half, scales_and_mins, IQ4_VALUES};
use super::{GroupFns, GROUP, PASS_ROWS};
use freetoken_ggml::{GgmlType, VecDot};
use std::arch::x86_64::*;

/// The weight types (const generic parameters).
pub(super) const Q4: u8 = 0;
pub(super) const Q5: u8 = 1;
const Q8: u8 = 2;
const Q4K: u8 = 3;
const Q6K: u8 = 4;
pub(super) const NL: u8 = 5;
pub(super) const MX: u8 = 6;
const Q5K: u8 = 7;
const IQ4XS: u8 = 8;

/// ggml's `kvalues_mxfp4`: MXFP4's values of the 16 indices (e2m1, doubled).
pub(super) const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Bytes of a Q8_0 block: fp16 scale, 32 signed values.
const Q8_0_BLOCK: usize = 34;
/// Bytes of a Q8_K block: f32 d, 256 int8 values, 16 int16 sums of 16 values.
const Q8_K_BLOCK: usize = 292;
/// Offset of a Q8_K block's sums.
const Q8_K_SUMS: usize = 4 + 256;
/// Bytes of a Q4_K block: fp16 d and dmin, 12 bytes of packed 6-bit scales and mins, 128
/// bytes of 4-bit values (each 32-byte run: a sub-block in the low nibbles, the next in the
/// high ones).
const Q4_K_BLOCK: usize = 144;
/// Bytes of a Q5_K block: Q4_K's fields, with 32 bytes of fifth bits (bit s of byte e: value
/// e of sub-block s) before the 4-bit values.
const Q5_K_BLOCK: usize = 176;
/// Bytes of an IQ4_XS block: fp16 d, 16 bits of scale high bits, 4 bytes of scale low bits,
/// 128 bytes of 4-bit table indices packed as Q4_0's (per 32-value sub-block).
const IQ4_XS_BLOCK: usize = 136;
/// Bytes of a Q6_K block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one
/// per 16 values), fp16 d.
const Q6_K_BLOCK: usize = 210;

/// A legacy block's bytes and the offset its stored values carry: Q4_0 (fp16 scale, 16 bytes
/// of nibbles, value v - 8), Q5_0 (fp16 scale, 4 bytes of fifth bits, the nibbles, value
/// v - 16), Q8_0 (signed values, no offset), IQ4_NL (fp16 scale, nibbles indexing its table),
/// MXFP4 (an E8M0 scale, nibbles indexing its table).
const fn layout(kind: u8) -> (usize, i8) {
    match kind {
        Q4 => (18, 8),
        Q5 => (22, 16),
        NL => (18, 0),
        MX => (17, 0),
        _ => (Q8_0_BLOCK, 0),
    }
}

/// Where a legacy block's values start.
const fn values_at(kind: u8) -> usize {
    match kind {
        Q5 => 6,
        MX => 1,
        _ => 2,
    }
}

/// The table-valued types' tables.
const fn table(kind: u8) -> Option<&'static [i8; 16]> {
    match kind {
        NL => Some(&IQ4_VALUES),
        MX => Some(&MXFP4_VALUES),
        _ => None,
    }
}

/// The types whose values are signed (ggml's sign-trick product), not unsigned with an offset.
const fn signed(kind: u8) -> bool {
    kind == Q8 || table(kind).is_some()
}

/// The types of 256-value blocks, with Q8_K activations.
const fn super_blocks(kind: u8) -> bool {
    matches!(kind, Q4K | Q5K | Q6K | IQ4XS)
}

/// Activation rows one pass over the four weight rows serves: its accumulators stay in the
/// sixteen vector registers (legacy types: a fused multiply-add per block and row), or nearly
/// (K-quants: one per 256 values).
const fn pass_tokens(kind: u8) -> usize {
    if super_blocks(kind) {
        4
    } else {
        2
    }
}

/// The group kernels for `kernel`'s types, on a CPU with AVX2, FMA and F16C and a ggml whose
/// row kernels take their AVX2 paths (the caller checks both).
pub(super) fn group_fns(kernel: &VecDot) -> Option<GroupFns> {
    match (kernel.weight_type(), kernel.act_type()) {
        (GgmlType::Q4_K, GgmlType::Q8_K) => Some(kernels::<Q4K>()),
        (GgmlType::Q5_K, GgmlType::Q8_K) => Some(kernels::<Q5K>()),
        (GgmlType::Q6_K, GgmlType::Q8_K) => Some(kernels::<Q6K>()),
        (GgmlType::IQ4_XS, GgmlType::Q8_K) => Some(kernels::<IQ4XS>()),
        _ if kernel.act_type() != GgmlType::Q8_0 || !kernel.k().is_multiple_of(32) => None,
        (GgmlType::Q4_0, _) => Some(kernels::<Q4>()),
        (GgmlType::Q5_0, _) => Some(kernels::<Q5>()),
        (GgmlType::Q8_0, _) => Some(kernels::<Q8>()),
        (GgmlType::IQ4_NL, _) => Some(kernels::<NL>()),
        (GgmlType::MXFP4, _) => Some(kernels::<MX>()),
        _ => None,
    }
}

/// `KIND`'s kernels: tiles of 8 and 4 tokens, and one token.
fn kernels<const KIND: u8>() -> GroupFns {
    GroupFns {
        tiles: [tile::<KIND, 8>, tile::<KIND, 4>],
        one: Some(tile::<KIND, 1>),
    }
}

/// `TOK` activation rows in passes of [`pass_tokens`].
///
/// # Safety
/// `w` points at four rows of `row_bytes` bytes, each `blocks` 32-value blocks of the weight
/// type (`KIND`), `acts` at `TOK` activation rows of the paired type as long; the CPU has
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
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
    for (a, o) in acts
        .chunks(pass_tokens(KIND))
        .zip(out.chunks_mut(pass_tokens(KIND)))
    {
        // SAFETY: forwarded, for a part of the activation rows.
        unsafe {
            match a.len() {
                4 => pass::<KIND, 4>(w, row_bytes, a, blocks, o),
                3 => pass::<KIND, 3>(w, row_bytes, a, blocks, o),
                2 => pass::<KIND, 2>(w, row_bytes, a, blocks, o),
                _ => pass::<KIND, 1>(w, row_bytes, a, blocks, o),
            }
        }
    }
}

/// # Safety
/// As [`tile`], `T` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass<const KIND: u8, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &[*const u8],
    blocks: usize,
    out: &mut [[f32; GROUP]],
) {
    let acts: [*const u8; T] = std::array::from_fn(|t| acts[t]);
    // SAFETY: forwarded.
    let sums = unsafe {
        match KIND {
            Q4K => q45_k::<false, T>(w, row_bytes, acts, blocks / 8),
            Q5K => q45_k::<true, T>(w, row_bytes, acts, blocks / 8),
            IQ4XS => iq4_xs::<T>(w, row_bytes, acts, blocks / 8),
            Q6K => q6_k::<T>(w, row_bytes, acts, blocks / 8),
            _ => legacy::<KIND, T>(w, row_bytes, acts, blocks),
        }
    };
    out.copy_from_slice(&sums);
}

/// Prefetches one block's share of the four rows [`PASS_ROWS`] ahead: four rows read side by
/// side are four short streams the hardware prefetcher does not follow. Past the end of the
/// weights a prefetch is a no-op, never a fault.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_ahead(w: *const u8, row_bytes: usize, b: usize, block: usize) {
    let ahead = w.wrapping_add(PASS_ROWS * row_bytes + b * GROUP * block);
    for line in 0..(GROUP * block).div_ceil(64) {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
    }
}

/// An fp16 value at `p` as f32.
///
/// # Safety
/// Two readable bytes at `p`; the CPU has F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn fp16_at(p: *const u8) -> f32 {
    // SAFETY: per the contract.
    let bits = unsafe { p.cast::<i16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(bits)))
}

/// ggml's `hsum_float_8`, in its order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_float_8(x: __m256) -> f32 {
    let mut r = _mm256_extractf128_ps::<1>(x);
    r = _mm_add_ps(r, _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// A legacy block's 32 values in element order: Q4_0's and Q5_0's unsigned (offset
/// included), the others' signed.
///
/// # Safety
/// `x` points at a block of the type; the CPU has AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_values<const KIND: u8>(x: *const u8) -> __m256i {
    // SAFETY: within the block, per the contract.
    unsafe {
        if KIND == Q8 {
            return _mm256_loadu_si256(x.add(2).cast());
        }
        // Low nibbles are elements 0..16, high ones 16..32.
        let q = _mm_loadu_si128(x.add(values_at(KIND)).cast());
        let v = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16::<4>(q), q),
            _mm256_set1_epi8(0x0f),
        );
        if let Some(table) = table(KIND) {
            let table = _mm_loadu_si128(table.as_ptr().cast());
            return _mm256_shuffle_epi8(_mm256_set_m128i(table, table), v);
        }
        if KIND == Q4 {
            return v;
        }
        // Byte j becomes 0xff where bit j of the fifth-bit word is set: byte j / 8 of the
        // word spread over eight bytes, each with all bits but bit j % 8 set.
        let bits = x.add(2).cast::<i32>().read_unaligned();
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let set = _mm256_cmpeq_epi8(
            _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe)),
            _mm256_set1_epi8(-1),
        );
        _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }
}

/// The four rows' block scales as f32: fp16, or MXFP4's E8M0 halved.
///
/// # Safety
/// Each of `x` points at a block of the type; the CPU has F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weight_scales<const KIND: u8>(x: [*const u8; GROUP]) -> __m128 {
    // SAFETY: a block starts with its scale, per the contract.
    unsafe {
        if KIND == MX {
            let [a, b, c, d] = x.map(|p| e8m0_half(p.read()));
            return _mm_set_ps(d, c, b, a);
        }
        let bits = x.iter().rev().fold(0i64, |v, x| {
            (v << 16) | i64::from(x.cast::<u16>().read_unaligned())
        });
        _mm_cvtph_ps(_mm_set_epi64x(0, bits))
    }
}

/// Four rows of Q4_0, Q5_0, Q8_0, IQ4_NL or MXFP4 (`KIND`) against `T` Q8_0 activation rows.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const KIND: u8, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: [*const u8; T],
    blocks: usize,
) -> [[f32; GROUP]; T] {
    let (block, offset) = layout(KIND);
    let ones = _mm256_set1_epi16(1);
    // Per token the even blocks' accumulators (every block's but the table types') and the
    // odd ones'.
    let mut acc = [[[_mm256_setzero_ps(); GROUP]; 2]; T];
    let paired = table(KIND).is_some();
    let parity = usize::from(paired);
    let vector_blocks = if paired { blocks & !1 } else { blocks };
    for b in 0..vector_blocks {
        prefetch_ahead(w, row_bytes, b, block);
        // SAFETY: block b of the four rows and of each activation row, per the contract.
        unsafe {
            let x = [0, 1, 2, 3].map(|r| w.add(r * row_bytes + b * block));
            let dw = weight_scales::<KIND>(x);
            let v = x.map(|x| legacy_values::<KIND>(x));
            // ggml's sign trick for signed values, |w| times a with w's sign; |w| is the
            // tokens' to share.
            let abs = if signed(KIND) {
                v.map(|v| _mm256_sign_epi8(v, v))
            } else {
                v
            };
            for (acc, y) in acc.iter_mut().zip(acts) {
                let y = y.add(b * Q8_0_BLOCK);
                let qy = _mm256_loadu_si256(y.add(2).cast());
                // d_w * d_a per row, as ggml's f32 product.
                let mut dd = [0f32; GROUP];
                _mm_storeu_ps(dd.as_mut_ptr(), _mm_mul_ps(dw, _mm_set1_ps(fp16_at(y))));
                let off =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(offset), qy), ones);
                let acc = &mut acc[b & parity];
                for (((acc, v), abs), dd) in acc.iter_mut().zip(v).zip(abs).zip(&dd) {
                    let lanes = if signed(KIND) {
                        let p = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(qy, v));
                        _mm256_madd_epi16(p, ones)
                    } else {
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, qy), ones);
                        _mm256_sub_epi32(p, off)
                    };
                    *acc =
                        _mm256_fmadd_ps(_mm256_broadcast_ss(dd), _mm256_cvtepi32_ps(lanes), *acc);
                }
            }
        }
    }
    let mut out = acc.map(|[even, odd]| {
        std::array::from_fn(|r| {
            if paired {
                hsum_float_8(_mm256_add_ps(even[r], odd[r]))
            } else {
                hsum_float_8(even[r])
            }
        })
    });
    if vector_blocks < blocks {
        // SAFETY: the last block of each row and activation row, per the contract.
        unsafe { table_tail::<KIND, T>(w, row_bytes, acts, blocks - 1, &mut out) };
    }
    out
}

/// ggml's scalar tail of the IQ4_NL and MXFP4 dots for block `b` (an odd last one): per row
/// and token the block's exact integer sum times d_a * d_w, added with one fused multiply-add
/// (ggml's `sumf += d * (sumi1 + sumi2)`, which its compiler fuses or not by its target:
/// the tests bound the difference, `kernels::tests::tail_bound`).
///
/// # Safety
/// As [`tile`], for block `b`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn table_tail<const KIND: u8, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: [*const u8; T],
    b: usize,
    out: &mut [[f32; GROUP]; T],
) {
    let (block, _) = layout(KIND);
    let table = table(KIND).expect("a table type");
    let x = [0, 1, 2, 3].map(|r| w.wrapping_add(r * row_bytes + b * block));
    let mut dw = [0f32; GROUP];
    // SAFETY: block b of the four rows and of each activation row, per the contract.
    unsafe {
        _mm_storeu_ps(dw.as_mut_ptr(), weight_scales::<KIND>(x));
        for (o, a) in out.iter_mut().zip(acts) {
            let y = a.add(b * Q8_0_BLOCK);
            let ya = std::slice::from_raw_parts(y.add(2).cast::<i8>(), 32);
            let da = fp16_at(y);
            for ((o, x), dw) in o.iter_mut().zip(x).zip(dw) {
                let qs = std::slice::from_raw_parts(x.add(values_at(KIND)), 16);
                let value = |i: u8| i32::from(table[usize::from(i)]);
                let sum: i32 = qs
                    .iter()
                    .zip(ya.iter().zip(&ya[16..]))
                    .map(|(&q, (&lo, &hi))| {
                        i32::from(lo) * value(q & 0xf) + i32::from(hi) * value(q >> 4)
                    })
                    .sum();
                *o = (da * dw).mul_add(sum as f32, *o);
            }
        }
    }
}

/// Four rows of Q4_K (Q5_K with `FIFTH`) against `T` Q8_K activation rows, `supers` blocks
/// each.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k<const FIFTH: bool, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: [*const u8; T],
    supers: usize,
) -> [[f32; GROUP]; T] {
    let m4 = _mm256_set1_epi8(0x0f);
    let (block, qs) = if FIFTH {
        (Q5_K_BLOCK, 48)
    } else {
        (Q4_K_BLOCK, 16)
    };
    let mut acc = [[_mm256_setzero_ps(); GROUP]; T];
    // Q4_K: four min lanes per row; Q5_K: ggml's scalar chain, in lane 0.
    let mut acc_m = [[_mm_setzero_ps(); GROUP]; T];
    for b in 0..supers {
        prefetch_ahead(w, row_bytes, b, block);
        // SAFETY: block b of the four rows and of each activation row, per the contract.
        unsafe {
            let y = acts.map(|a| a.add(b * Q8_K_BLOCK));
            let yd = y.map(|y| y.cast::<f32>().read_unaligned());
            // The activation's sums of each 32 values.
            let q8s = y.map(|y| {
                _mm_hadd_epi16(
                    _mm_loadu_si128(y.add(Q8_K_SUMS).cast()),
                    _mm_loadu_si128(y.add(Q8_K_SUMS + 16).cast()),
                )
            });
            for r in 0..GROUP {
                let x = w.add(r * row_bytes + b * block);
                let sm = scales_and_mins(x.add(4).cast::<[u8; 12]>().read());
                let ms = _mm256_cvtepu8_epi16(_mm_loadu_si128(sm.as_ptr().cast()));
                let (xd, xdmin) = (fp16_at(x), fp16_at(x.add(2)));
                let mins = _mm256_extracti128_si256::<1>(ms);
                let sc = _mm256_castsi256_si128(ms);
                let scales = _mm256_set_m128i(sc, sc);
                for t in 0..T {
                    let mut prod = _mm_madd_epi16(mins, q8s[t]);
                    let dmin = -yd[t] * xdmin;
                    if FIFTH {
                        // ggml's hadds: the four lanes' integer sum, one fused multiply-add.
                        let z = _mm_setzero_si128();
                        prod = _mm_hadd_epi32(_mm_hadd_epi32(prod, z), z);
                        let m = _mm_cvtss_f32(acc_m[t][r]);
                        let m = dmin.mul_add(_mm_cvtsi128_si32(prod) as f32, m);
                        acc_m[t][r] = _mm_set_ss(m);
                    } else {
                        acc_m[t][r] =
                            _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[t][r]);
                    }
                }
                let hbits = if FIFTH {
                    _mm256_loadu_si256(x.add(16).cast())
                } else {
                    _mm256_setzero_si256()
                };
                // Sub-block s's fifth bits: 16 where bit s of the byte is set.
                let fifth = |v: __m256i, s: i32| {
                    if !FIFTH {
                        return v;
                    }
                    let bit = _mm256_and_si256(hbits, _mm256_set1_epi8(1 << s));
                    let set = _mm256_cmpeq_epi8(bit, _mm256_setzero_si256());
                    _mm256_or_si256(v, _mm256_andnot_si256(set, _mm256_set1_epi8(16)))
                };
                let mut sumi = [_mm256_setzero_si256(); T];
                for j in 0..4 {
                    // Sub-blocks 2j and 2j + 1: their scales as int16 in every lane.
                    let shuffle = |s: i16| _mm256_set1_epi16(((2 * s + 1) << 8) | (2 * s));
                    let sl = _mm256_shuffle_epi8(scales, shuffle(2 * j as i16));
                    let sh = _mm256_shuffle_epi8(scales, shuffle(2 * j as i16 + 1));
                    let q4 = _mm256_loadu_si256(x.add(qs + 32 * j).cast());
                    let q4l = fifth(_mm256_and_si256(q4, m4), 2 * j as i32);
                    let q4h = fifth(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4),
                        2 * j as i32 + 1,
                    );
                    for (s, y) in sumi.iter_mut().zip(y) {
                        let q8l = _mm256_loadu_si256(y.add(4 + 64 * j).cast());
                        let q8h = _mm256_loadu_si256(y.add(4 + 64 * j + 32).cast());
                        let pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(q4l, q8l));
                        let ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(q4h, q8h));
                        *s = _mm256_add_epi32(*s, _mm256_add_epi32(pl, ph));
                    }
                }
                for t in 0..T {
                    let d = _mm256_set1_ps(yd[t] * xd);
                    acc[t][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[t]), acc[t][r]);
                }
            }
        }
    }
    std::array::from_fn(|t| {
        std::array::from_fn(|r| {
            let m = acc_m[t][r];
            let m = if FIFTH {
                _mm_cvtss_f32(m)
            } else {
                // ggml's reduction of its four min lanes.
                let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
                _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)))
            };
            hsum_float_8(acc[t][r]) + m
        })
    })
}

/// Four rows of IQ4_XS against `T` Q8_K activation rows, `supers` blocks each.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_xs<const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: [*const u8; T],
    supers: usize,
) -> [[f32; GROUP]; T] {
    let m4 = _mm_set1_epi8(0x0f);
    let table = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
    let mut acc = [[_mm256_setzero_ps(); GROUP]; T];
    for b in 0..supers {
        prefetch_ahead(w, row_bytes, b, IQ4_XS_BLOCK);
        // SAFETY: block b of the four rows and of each activation row, per the contract.
        unsafe {
            let y = acts.map(|a| a.add(b * Q8_K_BLOCK));
            for r in 0..GROUP {
                let x = w.add(r * row_bytes + b * IQ4_XS_BLOCK);
                let high = x.add(2).cast::<u16>().read_unaligned();
                let mut sumi = [_mm256_setzero_si256(); T];
                for s in 0..8 {
                    // The sub-block's signed 6-bit scale: a nibble and two high bits, less 32.
                    let lo = (x.add(4 + s / 2).read() >> (4 * (s % 2))) & 0xf;
                    let ls = (i16::from(lo) | (((high >> (2 * s)) & 3) << 4) as i16) - 32;
                    let q = _mm_loadu_si128(x.add(8 + 16 * s).cast());
                    // Low nibbles are values 0..16, high ones 16..32.
                    let v = _mm256_set_m128i(
                        _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(q), m4)),
                        _mm_shuffle_epi8(table, _mm_and_si128(q, m4)),
                    );
                    let abs = _mm256_sign_epi8(v, v);
                    let ls = _mm256_set1_epi16(ls);
                    for (acc, y) in sumi.iter_mut().zip(y) {
                        let q8 = _mm256_loadu_si256(y.add(4 + 32 * s).cast());
                        let p = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(q8, v));
                        *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, ls));
                    }
                }
                let xd = fp16_at(x);
                for (t, y) in y.iter().enumerate() {
                    let d = _mm256_set1_ps(xd * y.cast::<f32>().read_unaligned());
                    acc[t][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[t]), acc[t][r]);
                }
            }
        }
    }
    acc.map(|a| a.map(|v| hsum_float_8(v)))
}

/// Four rows of Q6_K against `T` Q8_K activation rows, `supers` blocks each.
///
/// # Safety
/// As [`tile`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const T: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: [*const u8; T],
    supers: usize,
) -> [[f32; GROUP]; T] {
    let m15 = _mm256_set1_epi8(15);
    let mut acc = [[_mm256_setzero_ps(); GROUP]; T];
    for b in 0..supers {
        prefetch_ahead(w, row_bytes, b, Q6_K_BLOCK);
        // SAFETY: block b of the four rows and of each activation row, per the contract.
        unsafe {
            let y = acts.map(|a| a.add(b * Q8_K_BLOCK));
            let yd = y.map(|y| y.cast::<f32>().read_unaligned());
            let bsums = y.map(|y| _mm256_loadu_si256(y.add(Q8_K_SUMS).cast()));
            for r in 0..GROUP {
                let x = w.add(r * row_bytes + b * Q6_K_BLOCK);
                let xd = fp16_at(x.add(208));
                let scales = _mm_loadu_si128(x.add(192).cast());
                let scales16 = _mm256_cvtepi8_epi16(scales);
                // The offset of 32: 32 x scale x the activation's 16-value sums.
                let mut sumi = bsums.map(|s| {
                    _mm256_sub_epi32(
                        _mm256_setzero_si256(),
                        _mm256_slli_epi32::<5>(_mm256_madd_epi16(s, scales16)),
                    )
                });
                for j in 0..2 {
                    let q1 = _mm256_loadu_si256(x.add(64 * j).cast());
                    let q2 = _mm256_loadu_si256(x.add(64 * j + 32).cast());
                    let qh = _mm256_loadu_si256(x.add(128 + 32 * j).cast());
                    let high = [
                        _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(3))),
                        _mm256_slli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(12))),
                        _mm256_and_si256(qh, _mm256_set1_epi8(48)),
                        _mm256_srli_epi16::<2>(_mm256_and_si256(qh, _mm256_set1_epi8(-64))),
                    ];
                    let low = [
                        _mm256_and_si256(q1, m15),
                        _mm256_and_si256(q2, m15),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(q1), m15),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(q2), m15),
                    ];
                    for k in 0..4 {
                        let q = _mm256_or_si256(low[k], high[k]);
                        // The scales of the run's first and last 16 values, as int16.
                        let s = (4 * j + k) as i64 * 2;
                        let pick = _mm_set_epi64x(
                            (s + 1) * 0x0101_0101_0101_0101,
                            s * 0x0101_0101_0101_0101,
                        );
                        let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
                        for (acc, y) in sumi.iter_mut().zip(y) {
                            let q8 = _mm256_loadu_si256(y.add(4 + 128 * j + 32 * k).cast());
                            let p = _mm256_madd_epi16(sc, _mm256_maddubs_epi16(q, q8));
                            *acc = _mm256_add_epi32(*acc, p);
                        }
                    }
                }
                for t in 0..T {
                    let d = _mm256_set1_ps(yd[t] * xd);
                    acc[t][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[t]), acc[t][r]);
                }
            }
        }
    }
    acc.map(|a| a.map(|v| hsum_float_8(v)))
}
