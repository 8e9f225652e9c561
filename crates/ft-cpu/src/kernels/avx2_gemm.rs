//! Q4_0, Q5_0, Q8_0, IQ4_NL and MXFP4 rows against many Q8_0 activation rows, and Q4_K, Q5_K
//! and Q6_K rows against Q8_K ones, with AVX2, FMA and F16C: a prompt chunk's product, or an
//! expert's routes, as tiles of eight rows by four tokens over rows repacked into an
//! interleaved layout.
//!
//! The rows a call gets (a pass of the callers', which stays in the L1 cache) are repacked
//! once for all its tokens: per 32-value block and group of eight rows, eight registers, the
//! j-th holding values 4j..4j+4 of each row, unpacked to unsigned bytes (the offset of 8 or 16
//! included; MXFP4's table values plus 12; Q8_0's and IQ4_NL's values plus 128 as two planes
//! of nibbles, the high one worth 16), and the eight rows' scales as f32. A token's block then
//! costs one broadcast and one `maddubs` per register; the 16-bit sums of four registers
//! (values up to 31) or eight (the planes, up to 15) cannot overflow (|a| <= 128: 4 x 2 x 31 x
//! 128 and 8 x 2 x 15 x 128 are below 2^15), a `madd` gives each row's exact block sum in its
//! own 32-bit lane, the activation's block sum times the offset comes off, and one fused
//! multiply-add per block adds d_w * d_a (ggml's f32 product) times it to the row's lane.
//! Nothing is read from the memory-mapped weights but the rows themselves, so peak memory does
//! not grow.
//!
//! ggml's row kernel sums the same exact block integers, but split into eight lanes of four
//! values each, and adds the lanes at the end (IQ4_NL and MXFP4: two accumulators and a scalar
//! tail, no more roundings); here each row's chain is one lane. Both are recursive sums of the
//! same terms t_b = fl(d_w d_a)_b x S_b with one rounding per step, so with u = 2^-24 and
//! gamma_n = n u / (1 - n u), over `blocks` blocks
//! |here - exact| <= gamma_blocks x sum_b |t_b| and
//! |ggml - exact| <= gamma_(blocks + 3) x sum_b sum_lanes |lane terms| <= gamma_(blocks + 3) x
//! sum_b |fl(d_w d_a)_b| x sum_i |w_i a_i|, hence
//! |here - ggml| <= 2 gamma_(blocks + 3) x sum_b |fl(d_w d_a)_b| x sum_i |w_i a_i|,
//! the bound the tests check. Q6_K's rows are unpacked to bytes 0..64 (registers as above,
//! per 32 values) with their 16-value scales as 16-bit pairs per row lane; two registers'
//! 16-bit sums (2 x 2 x 63 x 128 < 2^15) go through a `madd` with their scale, and 32 x each
//! scale x the activation's 16-value sum comes off: the block's exact integer, one fused
//! multiply-add per 256 values as in ggml, whose lanes split sum_i scale_i q_i a_i and
//! 32 sum_s scale_s bsum_s between them, so sum_i |w_i a_i| above becomes the sum of those two
//! magnitudes. Q4_K's rows keep their nibbles (register j of a pair of sub-blocks: bytes
//! 4j..4j+4 of each row's 32, the first sub-block in the low nibbles), Q5_K's are unpacked to
//! bytes 0..32 per sub-block (its 16-bit sums: of four registers), and both get their scales
//! and mins as 16-bit pairs per row lane; per 256-value block each row's lane gets the exact
//! sum of scale x value x activation and of min x the activation's sub-block sums, and two
//! fused multiply-adds (d_w d_a, then -dmin_w d_a): a chain of 2 x blocks roundings against
//! ggml's blocks + 4 (two accumulators or a scalar chain of the mins, and their reductions),
//! so |here - ggml| <= 2 gamma_(2 blocks + 4) x sum_b (|fl(d_w d_a)| sum_i |scale_i w_i a_i|
//! + |fl(dmin_w d_a)| sum_s min_s |sum_(i in s) a_i|).

use super::avx2::fp16_at;
use super::blocks::{e8m0_half, scales_and_mins};
use super::{GemmFn, GEMM_ROWS as ROWS};
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Tokens a tile's accumulators hold.
const TILE_TOKENS: usize = 4;
/// Bytes of a Q8_0 activation block: fp16 scale, 32 signed values.
const Q8_0_BLOCK: usize = 34;

/// The weight types (const generic parameters).
pub(super) const Q4: u8 = 0;
pub(super) const Q5: u8 = 1;
pub(super) const Q8: u8 = 2;
pub(super) const Q4K: u8 = 3;
pub(super) const NL: u8 = 4;
pub(super) const MX: u8 = 5;
pub(super) const Q5K: u8 = 6;
pub(super) const Q6K: u8 = 7;

/// Bytes of a Q8_K activation block: f32 d, 256 int8 values, 16 int16 sums of 16 values.
const Q8_K_BLOCK: usize = 292;
/// Offset of a Q8_K block's sums.
const Q8_K_SUMS: usize = 4 + 256;

/// A type's block bytes and the offset its packed values carry.
const fn layout(kind: u8) -> (usize, i32) {
    match kind {
        Q5 => (22, 16),
        Q8 => (Q8_0_BLOCK, 128),
        NL => (18, 128),
        MX => (17, 12),
        Q4K => (144, 0),
        Q5K => (176, 0),
        Q6K => (210, 32),
        _ => (18, 8),
    }
}

/// The types of 256-value blocks, with Q8_K activations.
const fn super_blocks(kind: u8) -> bool {
    matches!(kind, Q4K | Q5K | Q6K)
}

/// Values per block of the type, and bytes of its activation block.
const fn unit(kind: u8) -> (usize, usize) {
    if super_blocks(kind) {
        (256, Q8_K_BLOCK)
    } else {
        (32, Q8_0_BLOCK)
    }
}

/// Activation sums per block: the offset's (the 32-value types), or the pairs of sub-block
/// sums the K-quants' mins (Q4_K, Q5_K: 4) or offset (Q6_K: 8) take.
const fn sums_per_block(kind: u8) -> usize {
    match kind {
        Q4K | Q5K => 4,
        Q6K => 8,
        _ => 1,
    }
}

/// The types whose values, plus 128, are packed as two planes of nibbles (Q8_0's range).
const fn planes(kind: u8) -> bool {
    matches!(kind, Q8 | NL)
}

/// Registers of values per packed block of a 32-value type: one per word of a row (two
/// planes: of each).
const fn registers(kind: u8) -> usize {
    if planes(kind) {
        16
    } else {
        8
    }
}

/// Where a packed K-quant block's registers start: values, then (Q4_K, Q5_K) sub-block
/// scales, mins, d and dmin, or (Q6_K) 16-value scales, their pairs, d.
const fn k_scales(kind: u8) -> usize {
    if kind == Q4K {
        32
    } else {
        64
    }
}

/// 32-byte units of a packed block of eight rows: the registers, then eight f32 scales (Q4_K:
/// the registers of four sub-block pairs' nibbles, Q5_K: of its eight sub-blocks' values;
/// then eight of sub-block scales and four of mins as 16-bit pairs per row, d and dmin as f32.
/// Q6_K: 64 of values, 16 of 16-value scales twice per row, 8 of pairs of them, d).
const fn packed_block(kind: u8) -> usize {
    match kind {
        Q4K | Q5K => k_scales(kind) + 8 + 4 + 2,
        Q6K => 64 + 16 + 8 + 1,
        _ => registers(kind) + 1,
    }
}

/// The kernel for `KIND`.
pub(super) fn gemm_fn(kind: u8) -> GemmFn {
    match kind {
        Q5 => gemm::<Q5>,
        Q8 => gemm::<Q8>,
        Q4K => gemm::<Q4K>,
        NL => gemm::<NL>,
        MX => gemm::<MX>,
        Q5K => gemm::<Q5K>,
        Q6K => gemm::<Q6K>,
        _ => gemm::<Q4>,
    }
}

thread_local! {
    /// Each thread's repacked rows and activation block sums, reused across calls.
    static SCRATCH: RefCell<(Vec<__m256i>, Vec<i32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The safe entry: checks the sizes, then repacks and runs the tiles. The CPU's AVX2, FMA and
/// F16C were checked when the kernels were chosen ([`super::RowDots::with_isa`]).
fn gemm<const KIND: u8>(w: &[u8], rb: usize, blocks: usize, acts: &[&[u8]], out: &mut [f32]) {
    let ((block, _), (values, act_block)) = (layout(KIND), unit(KIND));
    let (n, blocks) = (w.len() / rb, blocks * 32 / values);
    let per_sums = sums_per_block(KIND);
    assert!(
        rb == blocks * block
            && w.len() == n * rb
            && acts.iter().all(|a| a.len() == blocks * act_block)
            && out.len() == n * acts.len(),
        "{} weight bytes of rows of {rb}, {} tokens, {} outputs: not whole rows",
        w.len(),
        acts.len(),
        out.len()
    );
    SCRATCH.with_borrow_mut(|(packed, sums)| {
        let per_group = blocks * packed_block(KIND);
        // SAFETY: zero bits are a valid vector.
        packed.resize(n.div_ceil(ROWS) * per_group, unsafe { std::mem::zeroed() });
        sums.resize(acts.len() * blocks * per_sums, 0);
        // SAFETY: the sizes are checked above and the CPU features when the kernel was
        // chosen; `packed` holds n / ROWS groups (rounded up) of `blocks` packed blocks.
        unsafe {
            for (g, dst) in packed.chunks_exact_mut(per_group).enumerate() {
                // A last group of fewer rows repeats its last row.
                let rows: [*const u8; ROWS] =
                    std::array::from_fn(|r| w[(g * ROWS + r).min(n - 1) * rb..].as_ptr());
                match KIND {
                    Q4K | Q5K => pack_q45_k::<KIND>(rows, blocks, dst.as_mut_ptr()),
                    Q6K => pack_q6_k(rows, blocks, dst.as_mut_ptr()),
                    _ => pack::<KIND>(rows, blocks, dst.as_mut_ptr()),
                }
            }
            for (a, s) in acts.iter().zip(sums.chunks_exact_mut(blocks * per_sums)) {
                match KIND {
                    Q4K | Q5K => sub_block_sums(a.as_ptr(), s),
                    // The 16-value sums as they are, two to a word.
                    Q6K => {
                        for (b, s) in s.chunks_exact_mut(8).enumerate() {
                            let at = a.as_ptr().add(b * Q8_K_BLOCK + Q8_K_SUMS);
                            s.copy_from_slice(&at.cast::<[i32; 8]>().read_unaligned());
                        }
                    }
                    _ => block_sums::<KIND>(a.as_ptr(), s),
                }
            }
            let tokens = acts.len();
            for (g, group) in packed.chunks_exact(per_group).enumerate() {
                let mut t0 = 0;
                while t0 < tokens {
                    let tile = (tokens - t0).min(TILE_TOKENS);
                    let a: [*const u8; TILE_TOKENS] =
                        std::array::from_fn(|t| acts[t0 + t.min(tile - 1)].as_ptr());
                    let s: [*const i32; TILE_TOKENS] = std::array::from_fn(|t| {
                        sums[(t0 + t.min(tile - 1)) * blocks * per_sums..].as_ptr()
                    });
                    let mut o = [[0f32; ROWS]; TILE_TOKENS];
                    let p = group.as_ptr();
                    match (KIND, tile) {
                        (Q4K | Q5K, 4) => tile_q45_k::<KIND, 4>(p, blocks, a, s, &mut o),
                        (Q4K | Q5K, 3) => tile_q45_k::<KIND, 3>(p, blocks, a, s, &mut o),
                        (Q4K | Q5K, 2) => tile_q45_k::<KIND, 2>(p, blocks, a, s, &mut o),
                        (Q4K | Q5K, _) => tile_q45_k::<KIND, 1>(p, blocks, a, s, &mut o),
                        (Q6K, 4) => tile_q6_k::<4>(p, blocks, a, s, &mut o),
                        (Q6K, 3) => tile_q6_k::<3>(p, blocks, a, s, &mut o),
                        (Q6K, 2) => tile_q6_k::<2>(p, blocks, a, s, &mut o),
                        (Q6K, _) => tile_q6_k::<1>(p, blocks, a, s, &mut o),
                        (_, 4) => tile_fn::<KIND, 4>(p, blocks, a, s, &mut o),
                        (_, 3) => tile_fn::<KIND, 3>(p, blocks, a, s, &mut o),
                        (_, 2) => tile_fn::<KIND, 2>(p, blocks, a, s, &mut o),
                        _ => tile_fn::<KIND, 1>(p, blocks, a, s, &mut o),
                    }
                    let rows = (n - g * ROWS).min(ROWS);
                    for (t, o) in o[..tile].iter().enumerate() {
                        let at = (t0 + t) * n + g * ROWS;
                        out[at..at + rows].copy_from_slice(&o[..rows]);
                    }
                    t0 += tile;
                }
            }
        }
    });
}

/// Repacks eight rows into `blocks` packed blocks at `dst`.
///
/// # Safety
/// Each of `w` points at a row of `blocks` blocks of the type, `dst` at room for `blocks`
/// packed blocks; the CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack<const KIND: u8>(w: [*const u8; ROWS], blocks: usize, dst: *mut __m256i) {
    let (block, _) = layout(KIND);
    for b in 0..blocks {
        // SAFETY: block b of the eight rows, packed block b of `dst`, per the contract.
        unsafe {
            let x = w.map(|w| w.add(b * block));
            let out = dst.add(b * packed_block(KIND));
            let v = x.map(|x| values::<KIND>(x));
            if planes(KIND) {
                let m4 = _mm256_set1_epi8(0x0f);
                let u = v.map(|v| _mm256_xor_si256(v, _mm256_set1_epi8(i8::MIN)));
                transpose(u.map(|u| _mm256_and_si256(u, m4)), out);
                let high = u.map(|u| _mm256_and_si256(_mm256_srli_epi16::<4>(u), m4));
                transpose(high, out.add(8));
            } else {
                transpose(v, out);
            }
            let scales: [f32; ROWS] = if KIND == MX {
                x.map(|x| e8m0_half(x.read()))
            } else {
                x.map(|x| fp16_at(x))
            };
            let at = out.add(registers(KIND));
            at.cast::<[f32; ROWS]>().write_unaligned(scales);
        }
    }
}

/// Writes the 8 x 8 transpose of `v`'s 32-bit words to `out`: register j gets word j of each
/// row.
///
/// # Safety
/// Room for eight registers at `out`; the CPU has AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose(v: [__m256i; ROWS], out: *mut __m256i) {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, c) = (v[i & !1], v[i | 1]);
        if i & 1 == 0 {
            _mm256_unpacklo_epi32(a, c)
        } else {
            _mm256_unpackhi_epi32(a, c)
        }
    });
    // u[i]: rows 4(i / 4)..+4, words i % 4 (low lanes) and i % 4 + 4 (high lanes).
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (h, q) = (i / 4 * 4, i % 4);
        let (a, c) = (t[h + q / 2], t[h + 2 + q / 2]);
        if q % 2 == 0 {
            _mm256_unpacklo_epi64(a, c)
        } else {
            _mm256_unpackhi_epi64(a, c)
        }
    });
    for j in 0..4 {
        // SAFETY: within the eight registers, per the contract.
        unsafe {
            out.add(j)
                .write(_mm256_permute2x128_si256::<0x20>(u[j], u[4 + j]));
            out.add(4 + j)
                .write(_mm256_permute2x128_si256::<0x31>(u[j], u[4 + j]));
        }
    }
}

/// A block's 32 values in element order: unsigned bytes, offset included (Q8_0's and
/// IQ4_NL's: signed).
///
/// # Safety
/// `x` points at a block of the type; the CPU has AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values<const KIND: u8>(x: *const u8) -> __m256i {
    // SAFETY: per the contract.
    unsafe {
        match KIND {
            Q5 => super::avx2::legacy_values::<{ super::avx2::Q5 }>(x),
            Q8 => _mm256_loadu_si256(x.add(2).cast()),
            NL => super::avx2::legacy_values::<{ super::avx2::NL }>(x),
            MX => _mm256_add_epi8(
                super::avx2::legacy_values::<{ super::avx2::MX }>(x),
                _mm256_set1_epi8(12),
            ),
            _ => super::avx2::legacy_values::<{ super::avx2::Q4 }>(x),
        }
    }
}

/// The offset times each block's sum of the 32 activation values.
///
/// # Safety
/// `a` points at `sums.len()` Q8_0 blocks; the CPU has AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_sums<const KIND: u8>(a: *const u8, sums: &mut [i32]) {
    let (_, offset) = layout(KIND);
    let ones = _mm256_set1_epi16(1);
    for (b, s) in sums.iter_mut().enumerate() {
        // SAFETY: block b, per the contract.
        let q = unsafe { _mm256_loadu_si256(a.add(b * Q8_0_BLOCK + 2).cast()) };
        let l = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), ones);
        let l = _mm_add_epi32(_mm256_castsi256_si128(l), _mm256_extracti128_si256::<1>(l));
        let l = _mm_add_epi32(l, _mm_unpackhi_epi64(l, l));
        let l = _mm_add_epi32(l, _mm_shuffle_epi32::<1>(l));
        *s = offset * _mm_cvtsi128_si32(l);
    }
}

/// One group of eight packed rows against `T` tokens (`a`, their block sums `s`).
///
/// # Safety
/// `p` points at `blocks` packed blocks, each of `a` at `blocks` Q8_0 blocks and each of `s`
/// at `blocks` sums; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_fn<const KIND: u8, const T: usize>(
    p: *const __m256i,
    blocks: usize,
    a: [*const u8; TILE_TOKENS],
    s: [*const i32; TILE_TOKENS],
    out: &mut [[f32; ROWS]; TILE_TOKENS],
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..blocks {
        // SAFETY: packed block b and block b of each token, per the contract.
        unsafe {
            let p = p.add(b * packed_block(KIND));
            let y: [*const u8; T] = std::array::from_fn(|t| a[t].add(b * Q8_0_BLOCK));
            // Two sums of registers whose 16-bit sums stay in range: Q8_0's planes, the other
            // types' halves.
            let mut lo = [_mm256_setzero_si256(); T];
            let mut hi = [_mm256_setzero_si256(); T];
            for j in 0..registers(KIND) {
                let wj = p.add(j).read();
                let word = 2 + 4 * (j % 8);
                for t in 0..T {
                    let aj = _mm256_set1_epi32(y[t].add(word).cast::<i32>().read_unaligned());
                    let prod = _mm256_maddubs_epi16(wj, aj);
                    if (planes(KIND) && j >= 8) || (!planes(KIND) && j >= 4) {
                        hi[t] = _mm256_add_epi16(hi[t], prod);
                    } else {
                        lo[t] = _mm256_add_epi16(lo[t], prod);
                    }
                }
            }
            let dw = _mm256_loadu_ps(p.add(registers(KIND)).cast());
            for t in 0..T {
                let mut high = _mm256_madd_epi16(hi[t], ones);
                if planes(KIND) {
                    high = _mm256_slli_epi32::<4>(high);
                }
                let sum = _mm256_add_epi32(_mm256_madd_epi16(lo[t], ones), high);
                let sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(s[t].add(b).read()));
                let dd = _mm256_mul_ps(dw, _mm256_set1_ps(fp16_at(y[t])));
                acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sum), acc[t]);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: eight f32 into eight.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

/// Repacks eight Q4_K or Q5_K rows into `supers` packed blocks at `dst`.
///
/// # Safety
/// Each of `w` points at a row of `supers` blocks of the type, `dst` at room for `supers`
/// packed blocks; the CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_q45_k<const KIND: u8>(w: [*const u8; ROWS], supers: usize, dst: *mut __m256i) {
    let (block, _) = layout(KIND);
    let (m4, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    for b in 0..supers {
        // SAFETY: block b of the eight rows, packed block b of `dst`, per the contract.
        unsafe {
            let x = w.map(|w| w.add(b * block));
            let out = dst.add(b * packed_block(KIND));
            for p in 0..4 {
                if KIND == Q4K {
                    let v = x.map(|x| _mm256_loadu_si256(x.add(16 + 32 * p).cast()));
                    transpose(v, out.add(8 * p));
                    continue;
                }
                // Sub-blocks 2p (low nibbles, fifth bits 2p) and 2p + 1 as bytes of 0..32.
                let q = x.map(|x| _mm256_loadu_si256(x.add(48 + 32 * p).cast()));
                let h = x.map(|x| _mm256_loadu_si256(x.add(16).cast()));
                let fifth = |h: __m256i, s: usize| {
                    let bit = _mm256_srl_epi16(h, _mm_cvtsi64_si128(s as i64));
                    _mm256_slli_epi16::<4>(_mm256_and_si256(bit, one))
                };
                let lo: [__m256i; ROWS] = std::array::from_fn(|r| {
                    _mm256_or_si256(_mm256_and_si256(q[r], m4), fifth(h[r], 2 * p))
                });
                let hi: [__m256i; ROWS] = std::array::from_fn(|r| {
                    let v = _mm256_and_si256(_mm256_srli_epi16::<4>(q[r]), m4);
                    _mm256_or_si256(v, fifth(h[r], 2 * p + 1))
                });
                transpose(lo, out.add(16 * p));
                transpose(hi, out.add(16 * p + 8));
            }
            let sm = x.map(|x| scales_and_mins(x.add(4).cast::<[u8; 12]>().read()));
            // Per row r, 16-bit lanes 2r and 2r + 1: a sub-block's scale twice; a pair of
            // sub-blocks' mins.
            let scales: [[i16; 16]; 8] =
                std::array::from_fn(|s| std::array::from_fn(|i| i16::from(sm[i / 2][s])));
            let mins: [[i16; 16]; 4] = std::array::from_fn(|p| {
                std::array::from_fn(|i| i16::from(sm[i / 2][8 + 2 * p + i % 2]))
            });
            let at = out.add(k_scales(KIND));
            for (i, v) in scales.iter().chain(&mins).enumerate() {
                at.add(i).cast::<[i16; 16]>().write_unaligned(*v);
            }
            let d: [f32; ROWS] = x.map(|x| fp16_at(x));
            let dmin: [f32; ROWS] = x.map(|x| fp16_at(x.add(2)));
            at.add(12).cast::<[f32; ROWS]>().write_unaligned(d);
            at.add(13).cast::<[f32; ROWS]>().write_unaligned(dmin);
        }
    }
}

/// Each Q8_K block's sub-block sums (of 32 values, from its sums of 16), two to a 32-bit word
/// as the packed mins pair them.
///
/// # Safety
/// `a` points at `sums.len() / 4` Q8_K blocks.
pub(super) unsafe fn sub_block_sums(a: *const u8, sums: &mut [i32]) {
    for (b, s) in sums.chunks_exact_mut(4).enumerate() {
        // SAFETY: block b's sums, per the contract.
        let bs: [i16; 16] = unsafe {
            a.add(b * Q8_K_BLOCK + Q8_K_SUMS)
                .cast::<[i16; 16]>()
                .read_unaligned()
        };
        for (p, s) in s.iter_mut().enumerate() {
            let lo = bs[4 * p] + bs[4 * p + 1];
            let hi = bs[4 * p + 2] + bs[4 * p + 3];
            *s = i32::from(lo as u16) | i32::from(hi as u16) << 16;
        }
    }
}

/// One group of eight packed Q4_K or Q5_K rows against `T` tokens (`a`, their sub-block sums
/// `s`): per block the exact sums of scale x value x activation and of min x activation sum,
/// each row in its lane, added times d_w * d_a and -dmin_w * d_a with two fused
/// multiply-adds.
///
/// # Safety
/// `p` points at `supers` packed blocks, each of `a` at `supers` Q8_K blocks and each of `s`
/// at `4 * supers` sums; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q45_k<const KIND: u8, const T: usize>(
    p: *const __m256i,
    supers: usize,
    a: [*const u8; TILE_TOKENS],
    s: [*const i32; TILE_TOKENS],
    out: &mut [[f32; ROWS]; TILE_TOKENS],
) {
    let m4 = _mm256_set1_epi8(0x0f);
    // 16-bit sums of registers that stay in range: eight of values up to 15 (2 x 15 x 128
    // each), four of values up to 31.
    let run = if KIND == Q4K { 8 } else { 4 };
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..supers {
        // SAFETY: packed block b and block b of each token, per the contract.
        unsafe {
            let p = p.add(b * packed_block(KIND));
            let at = p.add(k_scales(KIND));
            let y: [*const u8; T] = std::array::from_fn(|t| a[t].add(b * Q8_K_BLOCK));
            let mut sum = [_mm256_setzero_si256(); T];
            for sb in 0..8 {
                let scale = at.add(sb).read();
                let mut s16 = [_mm256_setzero_si256(); T];
                for j in 0..8 {
                    // Q4_K: sub-block sb is the low (even) or high (odd) nibbles of pair
                    // sb / 2; Q5_K: its own registers.
                    let v = if KIND == Q5K {
                        p.add(8 * sb + j).read()
                    } else if sb % 2 == 0 {
                        _mm256_and_si256(p.add(8 * (sb / 2) + j).read(), m4)
                    } else {
                        let wj = p.add(8 * (sb / 2) + j).read();
                        _mm256_and_si256(_mm256_srli_epi16::<4>(wj), m4)
                    };
                    for t in 0..T {
                        let at = y[t].add(4 + 32 * sb + 4 * j);
                        let aj = _mm256_set1_epi32(at.cast::<i32>().read_unaligned());
                        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(v, aj));
                    }
                    if (j + 1) % run == 0 {
                        for t in 0..T {
                            sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(s16[t], scale));
                            s16[t] = _mm256_setzero_si256();
                        }
                    }
                }
            }
            let (d, dmin) = (
                _mm256_loadu_ps(at.add(12).cast()),
                _mm256_loadu_ps(at.add(13).cast()),
            );
            for t in 0..T {
                let mut mins = _mm256_setzero_si256();
                for q in 0..4 {
                    let pair = _mm256_set1_epi32(s[t].add(4 * b + q).read());
                    mins = _mm256_add_epi32(mins, _mm256_madd_epi16(at.add(8 + q).read(), pair));
                }
                let yd = _mm256_set1_ps(y[t].cast::<f32>().read_unaligned());
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(sum[t]), acc[t]);
                let dm = _mm256_mul_ps(dmin, _mm256_sub_ps(_mm256_setzero_ps(), yd));
                acc[t] = _mm256_fmadd_ps(dm, _mm256_cvtepi32_ps(mins), acc[t]);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: eight f32 into eight.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

/// Repacks eight Q6_K rows into `supers` packed blocks at `dst`: each 32 values of a row as
/// unsigned bytes (0..64, the offset of 32 included), transposed; the 16-value scales as
/// 16-bit pairs per row lane, each twice, then as pairs of consecutive ones; d as f32.
///
/// # Safety
/// Each of `w` points at a row of `supers` Q6_K blocks, `dst` at room for `supers` packed
/// blocks; the CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack_q6_k(w: [*const u8; ROWS], supers: usize, dst: *mut __m256i) {
    let (block, _) = layout(Q6K);
    let m15 = _mm256_set1_epi8(15);
    for b in 0..supers {
        // SAFETY: block b of the eight rows, packed block b of `dst`, per the contract.
        unsafe {
            let x = w.map(|w| w.add(b * block));
            let out = dst.add(b * packed_block(Q6K));
            for j in 0..2 {
                // Values 128j + 32k.. of each row: low 4 bits from ql, high 2 from qh.
                let runs = x.map(|x| {
                    let q1 = _mm256_loadu_si256(x.add(64 * j).cast());
                    let q2 = _mm256_loadu_si256(x.add(64 * j + 32).cast());
                    let qh = _mm256_loadu_si256(x.add(128 + 32 * j).cast());
                    let m3 = _mm256_set1_epi8(3);
                    [
                        _mm256_or_si256(
                            _mm256_and_si256(q1, m15),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m3)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(q2, m15),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(
                                _mm256_srli_epi16::<2>(qh),
                                m3,
                            )),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q1), m15),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(
                                _mm256_srli_epi16::<4>(qh),
                                m3,
                            )),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q2), m15),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(
                                _mm256_srli_epi16::<6>(qh),
                                m3,
                            )),
                        ),
                    ]
                });
                for k in 0..4 {
                    transpose(runs.map(|r| r[k]), out.add(8 * (4 * j + k)));
                }
            }
            let sc: [[i8; 16]; ROWS] = x.map(|x| x.add(192).cast::<[i8; 16]>().read());
            // Per row r, 16-bit lanes 2r and 2r + 1: a scale twice; two consecutive scales.
            let twice: [[i16; 16]; 16] =
                std::array::from_fn(|s| std::array::from_fn(|i| i16::from(sc[i / 2][s])));
            let pairs: [[i16; 16]; 8] = std::array::from_fn(|q| {
                std::array::from_fn(|i| i16::from(sc[i / 2][2 * q + i % 2]))
            });
            for (i, v) in twice.iter().chain(&pairs).enumerate() {
                out.add(64 + i).cast::<[i16; 16]>().write_unaligned(*v);
            }
            let d: [f32; ROWS] = x.map(|x| fp16_at(x.add(208)));
            out.add(88).cast::<[f32; ROWS]>().write_unaligned(d);
        }
    }
}

/// One group of eight packed Q6_K rows against `T` tokens (`a`, their 16-value sums `s`, two
/// to a word): per block each row's exact sum of scale x (value - 32) x activation in its
/// lane, added times d_w * d_a with one fused multiply-add.
///
/// # Safety
/// `p` points at `supers` packed blocks, each of `a` at `supers` Q8_K blocks and each of `s`
/// at `8 * supers` words; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_q6_k<const T: usize>(
    p: *const __m256i,
    supers: usize,
    a: [*const u8; TILE_TOKENS],
    s: [*const i32; TILE_TOKENS],
    out: &mut [[f32; ROWS]; TILE_TOKENS],
) {
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..supers {
        // SAFETY: packed block b and block b of each token, per the contract.
        unsafe {
            let p = p.add(b * packed_block(Q6K));
            let y: [*const u8; T] = std::array::from_fn(|t| a[t].add(b * Q8_K_BLOCK));
            let mut sum = [_mm256_setzero_si256(); T];
            // Two registers of values up to 63 per 16-bit sum (2 x 2 x 63 x 128 < 2^15), each
            // sum times its 16 values' scale.
            for pair in 0..32 {
                let scale = p.add(64 + pair / 2).read();
                let mut s16 = [_mm256_setzero_si256(); T];
                for j in 2 * pair..2 * pair + 2 {
                    let wj = p.add(j).read();
                    for t in 0..T {
                        let at = y[t].add(4 + 4 * j);
                        let aj = _mm256_set1_epi32(at.cast::<i32>().read_unaligned());
                        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(wj, aj));
                    }
                }
                for t in 0..T {
                    sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(s16[t], scale));
                }
            }
            let d = _mm256_loadu_ps(p.add(88).cast());
            for t in 0..T {
                // The offset: 32 x each scale x its 16 values' activation sum.
                let mut off = _mm256_setzero_si256();
                for q in 0..8 {
                    let pair = _mm256_set1_epi32(s[t].add(8 * b + q).read());
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(p.add(80 + q).read(), pair));
                }
                let sum = _mm256_sub_epi32(sum[t], _mm256_slli_epi32::<5>(off));
                let yd = _mm256_set1_ps(y[t].cast::<f32>().read_unaligned());
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(sum), acc[t]);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        // SAFETY: eight f32 into eight.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc) };
    }
}
