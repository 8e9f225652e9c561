use super::avx2::hsum_float_8;
use super::blocks::e8m0_half;
use super::{GroupFns, GROUP, TILES};
use freetoken_ggml::{GgmlType, VecDot};
use std::arch::x86_64::*;

/// How far ahead rows are prefetched: one pass. With the executor's gate and up rows read
/// alternately, a pass at a time, four rows ahead reached 18 GB/s on one thread and
/// sixteen 24.
pub(super) const PREFETCH_ROWS: usize = super::PASS_ROWS;
/// Bytes of a Q8_0 block: fp16 scale, 32 signed values.
const Q8_0_BLOCK: usize = 34;
/// Bytes of a Q4_0 block: fp16 scale, 32 4-bit values (v - 8) packed low nibbles first.
const Q4_0_BLOCK: usize = 18;
/// Bytes of a Q5_0 block: fp16 scale, the 32 values' fifth bits (a little-endian u32, bit
/// j for value j), their low 4 bits packed as Q4_0's; value = (bits | fifth << 4) - 16.
const Q5_0_BLOCK: usize = 22;
/// Bytes of a Q8_1 block (Q4_1's and Q5_1's activations): fp16 scale d, fp16 s = d * the
/// sum of the values, 32 signed values.
const Q8_1_BLOCK: usize = 36;
/// Bytes of a Q4_1 block: fp16 scale d and minimum m, 32 4-bit values packed as Q4_0's;
/// value = d * bits + m.
const Q4_1_BLOCK: usize = 20;
/// Bytes of a Q5_1 block: fp16 d and m, then Q5_0's fifth bits and nibbles.
const Q5_1_BLOCK: usize = 24;
/// Bytes of an MXFP4 block: an E8M0 scale, 32 4-bit indices into ggml's `kvalues_mxfp4`
/// packed as Q4_0's values.
const MXFP4_BLOCK: usize = 17;
/// Bytes of an IQ4_NL block: fp16 scale, 32 4-bit indices into ggml's `kvalues_iq4nl`
/// packed as Q4_0's values.
const IQ4_NL_BLOCK: usize = 18;
/// ggml's `kvalues_mxfp4` (e2m1 values, doubled) plus 12 and `kvalues_iq4nl` plus 128:
/// unsigned bytes for dpbusd, the offset taken off through the activation's sum as the
/// other types' offsets.
const MXFP4_PLUS_12: [u8; 16] = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];
const IQ4_NL_PLUS_128: [u8; 16] = [
    1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241,
];

/// The weight types of the group kernels (const generic parameters).
pub(super) const Q4: u8 = 0;
const Q5: u8 = 1;
const Q8: u8 = 2;
const MX: u8 = 3;
const NL: u8 = 4;
const Q41: u8 = 5;
const Q51: u8 = 6;

/// Q4_1 and Q5_1: a minimum per block, activations in Q8_1 whose block sums ggml adds
/// times the minima, one scalar chain per row, after the vector sum.
const fn with_min(kind: u8) -> bool {
    kind == Q41 || kind == Q51
}

/// Bytes of an activation block: Q8_1 for the types with a minimum, else Q8_0.
const fn act_block(kind: u8) -> usize {
    if with_min(kind) {
        Q8_1_BLOCK
    } else {
        Q8_0_BLOCK
    }
}

/// The table-valued types (MXFP4, IQ4_NL): their values' table, offset included. ggml's
/// dots for these keep two accumulators (even and odd blocks) and a scalar tail.
const fn table(kind: u8) -> Option<&'static [u8; 16]> {
    match kind {
        MX => Some(&MXFP4_PLUS_12),
        NL => Some(&IQ4_NL_PLUS_128),
        _ => None,
    }
}

/// Where a block's values start: after its fp16 scale, MXFP4's scale byte, or Q4_1's and
/// Q5_1's scale and minimum.
const fn values_at(kind: u8) -> usize {
    match kind {
        MX => 1,
        Q41 | Q51 => 4,
        _ => 2,
    }
}

/// A block's bytes and the offset its values are stored with (as unsigned bytes).
const fn layout(kind: u8) -> (usize, i8) {
    match kind {
        Q4 => (Q4_0_BLOCK, 8),
        Q5 => (Q5_0_BLOCK, 16),
        MX => (MXFP4_BLOCK, 12),
        NL => (IQ4_NL_BLOCK, i8::MIN),
        Q41 => (Q4_1_BLOCK, 0),
        Q51 => (Q5_1_BLOCK, 0),
        _ => (Q8_0_BLOCK, i8::MIN),
    }
}

/// The legacy-block group kernels for `kernel`'s types (the K-quants' and IQ types':
/// `avx512_k::group_fns`), on a CPU with AVX-512 F/BW/VL and VNNI and a ggml whose row kernels
/// take their AVX2 paths (the caller checks both).
pub(super) fn group_fns(kernel: &VecDot) -> Option<GroupFns> {
    const _: () = assert!(TILES[0] == 8 && TILES[1] == 4);
    match (kernel.weight_type(), kernel.act_type()) {
        (GgmlType::Q4_1, GgmlType::Q8_1) => Some(legacy::<Q41>()),
        (GgmlType::Q5_1, GgmlType::Q8_1) => Some(legacy::<Q51>()),
        _ if kernel.act_type() != GgmlType::Q8_0 || !kernel.k().is_multiple_of(32) => None,
        (GgmlType::Q4_0, _) => Some(legacy::<Q4>()),
        (GgmlType::Q5_0, _) => Some(legacy::<Q5>()),
        (GgmlType::Q8_0, _) => Some(legacy::<Q8>()),
        (GgmlType::MXFP4, _) => Some(legacy::<MX>()),
        (GgmlType::IQ4_NL, _) => Some(legacy::<NL>()),
        _ => None,
    }
}

/// `KIND`'s legacy-block kernels: tiles of 8 and 4 tokens, and one token.
fn legacy<const KIND: u8>() -> GroupFns {
    GroupFns {
        tiles: [tile::<KIND, 8>, tile::<KIND, 4>],
        one: Some(tile::<KIND, 1>),
    }
}

/// # Safety
/// As [`group`], `TOK` activation rows (`acts` and `out` hold `TOK`: checked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn tile<const KIND: u8, const TOK: usize>(
    w: *const u8,
    rb: usize,
    acts: &[*const u8],
    blocks: usize,
    out: &mut [[f32; GROUP]],
) {
    assert!(
        acts.len() == TOK && out.len() == TOK,
        "a tile of {TOK} tokens"
    );
    let acts: [*const u8; TOK] = std::array::from_fn(|t| acts[t]);
    // SAFETY: forwarded.
    out.copy_from_slice(&unsafe { group::<KIND, TOK>(w, rb, acts, blocks) });
}

/// The upper eight lanes (avx512dq's `extractf32x8` through an avx512f one).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
fn high_half(x: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)))
}

/// Block values of two rows as unsigned bytes, the first row in the low 256 bits, each in
/// element order; the caller subtracts the offset ([`layout`]) through the activation's
/// sum.
///
/// # Safety
/// `a` and `b` point at the values (past the scale) of a block of the type.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
pub(super) unsafe fn pair<const KIND: u8>(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: 16 (Q4_0), 20 (Q5_0) or 32 (Q8_0) readable bytes at each, per the contract.
    unsafe {
        if KIND != Q8 {
            // Q5_0's and Q5_1's nibbles follow their 4 bytes of fifth bits.
            let (qa, qb) = if KIND == Q5 || KIND == Q51 {
                (a.add(4), b.add(4))
            } else {
                (a, b)
            };
            // [a, b] then [a >> 4, b >> 4]: each row's low nibbles are elements 0..16,
            // its high nibbles 16..32.
            let lo = _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(qa.cast())),
                _mm_loadu_si128(qb.cast()),
            );
            let hi = _mm256_srli_epi16::<4>(lo);
            // 128-bit lanes [a, b, a >> 4, b >> 4] reordered to [a, a >> 4, b, b >> 4].
            let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
            let z = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
            let z = _mm512_and_si512(z, _mm512_set1_epi8(0x0f));
            if KIND == Q4 || KIND == Q41 {
                return z;
            }
            if let Some(table) = table(KIND) {
                let table = _mm_loadu_si128(table.as_ptr().cast());
                return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), z);
            }
            // Byte j of the register is element j of a (j < 32), j - 32 of b: bit j of
            // the two fifth-bit words adds 16.
            let fifth = |p: *const u8| u64::from(p.cast::<u32>().read_unaligned());
            let mask = fifth(a) | fifth(b) << 32;
            _mm512_or_si512(z, _mm512_maskz_mov_epi8(mask, _mm512_set1_epi8(0x10)))
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

/// Four rows of Q4_0, Q5_0, Q8_0 or MXFP4 (`KIND`) against `TOK` Q8_0 activation rows, each
/// block of the rows unpacked once for all of them.
///
/// Per block and 4-value lane, ggml computes the exact integer sum of weight * activation
/// (whichever instructions it uses, nothing saturates at these magnitudes), converts it to
/// f32 (exact: at most 65024 in magnitude), and adds d_w * d_a times it to an f32
/// accumulator with one fused multiply-add; the eight lanes are summed at the end. Here the
/// integer sum is dpbusd's sum of (w + offset) * a started from -offset * sum(a), which is
/// the same integer; the rest is the same operations on the same values. ggml's MXFP4 dot
/// keeps two accumulators, even and odd blocks, adds them lane by lane before the sum, and
/// leaves an odd last block to a scalar tail added after it: so does this.
///
/// # Safety
/// `w` points at four rows of `row_bytes` bytes, each `blocks` blocks of the weight type,
/// `acts` at `TOK` activation rows of `blocks` Q8_0 blocks each; the CPU has the enabled
/// features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn group<const KIND: u8, const TOK: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: [*const u8; TOK],
    blocks: usize,
) -> [[f32; GROUP]; TOK] {
    let (block, offset) = layout(KIND);
    let offset = _mm512_set1_epi8(offset);
    // Per token: the even blocks' accumulators (every block's but MXFP4's) and the odd's.
    let mut acc = [[[_mm512_setzero_ps(); 2]; 2]; TOK];
    // Per token, the four rows' sums of minimum * activation block sum (Q4_1, Q5_1).
    let mut summs = [_mm_setzero_ps(); TOK];
    // Where an activation block's values start.
    let ab = act_block(KIND) - 32;
    let paired = table(KIND).is_some();
    let parity = usize::from(paired);
    let vector_blocks = if paired { blocks & !1 } else { blocks };
    // Four rows read side by side are four short streams that the hardware prefetcher
    // does not follow (5.8 GB/s from DRAM on one thread, against 16 row by row), so the
    // rows PREFETCH_ROWS ahead are prefetched as one sequential stream, a group's share
    // per block. Past the end of the weights a prefetch is a no-op, never a fault.
    let next = w.wrapping_add(PREFETCH_ROWS * row_bytes);
    for b in 0..vector_blocks {
        // SAFETY: block b of each activation row and of each of the four weight rows is in
        // bounds (b < blocks, rows 0..4 of row_bytes each), per the contract.
        unsafe {
            let x = [0, 1, 2, 3].map(|r| w.add(r * row_bytes + b * block));
            // This block's share of the four rows PREFETCH_ROWS ahead.
            let ahead = next.wrapping_add(b * GROUP * block);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
            if KIND == Q8 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128).cast());
            }
            // d_0..d_3 as f32, shared by the tokens.
            let dw = weight_scales::<KIND>(x);
            let v = values_at(KIND);
            let p01 = pair::<KIND>(x[0].add(v), x[1].add(v));
            let p23 = pair::<KIND>(x[2].add(v), x[3].add(v));
            // The four rows' minima, for the types that have them.
            let mw = if with_min(KIND) {
                fp16_x4(x.map(|p| p.add(2)))
            } else {
                _mm_setzero_ps()
            };
            for ((acc, summs), a) in acc.iter_mut().zip(&mut summs).zip(acts) {
                let y = a.add(b * act_block(KIND));
                let ya = _mm512_broadcast_i64x4(_mm256_loadu_si256(y.add(ab).cast()));
                let start = _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, ya),
                );
                // d_r * d_a in lanes 0..4, as ggml's f32 product of the two scales.
                let da = _mm_cvtph_ps(_mm_set1_epi16(fp16_at(y)));
                let dd = _mm512_castps128_ps512(_mm_mul_ps(dw, da));
                let s01 = _mm512_dpbusd_epi32(start, p01, ya);
                let s23 = _mm512_dpbusd_epi32(start, p23, ya);
                scaled_add(dd, [s01, s23], &mut acc[b & parity]);
                if with_min(KIND) {
                    // ggml's `summs += m * s`: a product, then a sum, per row.
                    let sy = _mm_cvtph_ps(_mm_set1_epi16(fp16_at(y.add(2))));
                    *summs = _mm_add_ps(*summs, _mm_mul_ps(mw, sy));
                }
            }
        }
    }
    let mut out = acc.map(|[even, odd]| {
        row_sums([
            _mm512_add_ps(even[0], odd[0]),
            _mm512_add_ps(even[1], odd[1]),
        ])
    });
    if with_min(KIND) {
        for (o, s) in out.iter_mut().zip(summs) {
            let mut m = [0f32; GROUP];
            // SAFETY: four floats' room.
            unsafe { _mm_storeu_ps(m.as_mut_ptr(), s) };
            for (o, m) in o.iter_mut().zip(m) {
                *o += m;
            }
        }
    }
    if vector_blocks < blocks {
        // SAFETY: the last block of each row and activation, per the contract.
        unsafe { table_tail::<KIND, TOK>(w, row_bytes, &acts, blocks - 1, &mut out) };
    }
    out
}

/// An fp16 scale's bits.
///
/// # Safety
/// Two readable bytes at `p`.
#[inline]
unsafe fn fp16_at(p: *const u8) -> i16 {
    // SAFETY: per the contract.
    unsafe { p.cast::<i16>().read_unaligned() }
}

/// The four rows' block scales as f32 in lanes 0..4: fp16, or MXFP4's E8M0 halved (as
/// ggml's `GGML_E8M0_TO_FP32_HALF`: 2^(e - 128)).
///
/// # Safety
/// Each of `x` points at a block of the type.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn weight_scales<const KIND: u8>(x: [*const u8; GROUP]) -> __m128 {
    // SAFETY: a block starts with its scale, per the contract.
    unsafe {
        if KIND == MX {
            let [a, b, c, d] = x.map(|p| e8m0_half(p.read()));
            _mm_set_ps(d, c, b, a)
        } else {
            fp16_x4(x)
        }
    }
}

/// The fp16 values at the four addresses as f32, lanes 0..4.
///
/// # Safety
/// Two readable bytes at each.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn fp16_x4(x: [*const u8; GROUP]) -> __m128 {
    // SAFETY: per the contract.
    let [a, b, c, d] = x.map(|p| unsafe { fp16_at(p) });
    _mm_cvtph_ps(_mm_set_epi16(0, 0, 0, 0, d, c, b, a))
}

/// ggml's scalar tail of the MXFP4 and IQ4_NL dots for block `b` (an odd last one): per
/// row and token, the block's exact integer sum times d_a * d_w, added to the vector
/// part's sum.
///
/// # Safety
/// As [`group`], for block `b`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
unsafe fn table_tail<const KIND: u8, const TOK: usize>(
    w: *const u8,
    row_bytes: usize,
    acts: &[*const u8; TOK],
    b: usize,
    out: &mut [[f32; GROUP]; TOK],
) {
    let (block, offset) = layout(KIND);
    let table = table(KIND).expect("a table type");
    let value = |i: u8| i32::from(table[usize::from(i)]) - i32::from(offset as u8);
    let x = [0, 1, 2, 3].map(|r| w.wrapping_add(r * row_bytes + b * block));
    let mut dw = [0f32; GROUP];
    // SAFETY: block b of the four rows and of each activation row, per the contract.
    unsafe {
        _mm_storeu_ps(dw.as_mut_ptr(), weight_scales::<KIND>(x));
        for (o, a) in out.iter_mut().zip(acts) {
            let y = a.add(b * Q8_0_BLOCK);
            let ya = std::slice::from_raw_parts(y.add(2).cast::<i8>(), 32);
            let da = _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(fp16_at(y))));
            for ((o, x), dw) in o.iter_mut().zip(x).zip(dw) {
                let qs = std::slice::from_raw_parts(x.add(values_at(KIND)), 16);
                let sum: i32 = qs
                    .iter()
                    .zip(ya.iter().zip(&ya[16..]))
                    .map(|(&q, (&lo, &hi))| {
                        i32::from(lo) * value(q & 0xf) + i32::from(hi) * value(q >> 4)
                    })
                    .sum();
                // As ggml's `sumf += d * (sumi1 + sumi2)`, which C compilers contract into one
                // fused multiply-add when ggml is built with FMA (its AVX2 paths are).
                *o = (da * dw).mul_add(sum as f32, *o);
            }
        }
    }
}

/// `acc[p] += d * s[p]` per lane with one fused multiply-add, for the row pairs (0, 1) and
/// (2, 3): `d` holds the four rows' scales in lanes 0..4, `s` each pair's int32 lane sums,
/// row 2p in the low eight lanes and 2p + 1 in the high ones.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
pub(super) fn scaled_add(d: __m512, s: [__m512i; 2], acc: &mut [__m512; 2]) {
    let lanes = [
        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
    ];
    for ((acc, s), lanes) in acc.iter_mut().zip(s).zip(lanes) {
        *acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes, d), _mm512_cvtepi32_ps(s), *acc);
    }
}

/// The four rows' sums of [`scaled_add`]'s accumulators, each ggml's `hsum_float_8`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
pub(super) fn row_sums([a01, a23]: [__m512; 2]) -> [f32; GROUP] {
    [
        hsum_float_8(_mm512_castps512_ps256(a01)),
        hsum_float_8(high_half(a01)),
        hsum_float_8(_mm512_castps512_ps256(a23)),
        hsum_float_8(high_half(a23)),
    ]
}
