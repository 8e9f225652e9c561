//! Q4_0, Q5_0 and Q8_0 rows against many Q8_0 activation rows with AVX2, FMA and F16C: a
//! prompt chunk's product, or an expert's routes, as tiles of eight rows by four tokens over
//! rows repacked into an interleaved layout.
//!
//! The rows a call gets (a pass of the callers', which stays in the L1 cache) are repacked
//! once for all its tokens: per 32-value block and group of eight rows, eight registers, the
//! j-th holding values 4j..4j+4 of each row, unpacked to unsigned bytes (the offset of 8 or 16
//! included; Q8_0's values plus 128 as two planes of nibbles, the high one worth 16), and the
//! eight rows' scales as f32. A token's block then costs one broadcast and one `maddubs` per
//! register; the 16-bit sums of four registers (Q5_0, values up to 31) or eight (Q8_0's
//! planes, up to 15) cannot overflow (|a| <= 128: 4 x 2 x 31 x 128 and 8 x 2 x 15 x 128 are
//! below 2^15), a `madd` gives each row's exact block sum in its own 32-bit
//! lane, the activation's block sum times the offset comes off, and one fused multiply-add per
//! block
//! adds d_w * d_a (ggml's f32 product) times it to the row's lane. Nothing is read from the
//! memory-mapped weights but the rows themselves, so peak memory does not grow.
//!
//! ggml's row kernel sums the same exact block integers, but split into eight lanes of four
//! values each, and adds the lanes at the end; here each row's chain is one lane. Both are
//! recursive sums of the same terms t_b = fl(d_w d_a)_b x S_b with one rounding per step, so
//! with u = 2^-24 and gamma_n = n u / (1 - n u), over `blocks` blocks
//! |here - exact| <= gamma_blocks x sum_b |t_b| and
//! |ggml - exact| <= gamma_(blocks + 3) x sum_b sum_lanes |lane terms| <= gamma_(blocks + 3) x
//! sum_b |fl(d_w d_a)_b| x sum_i |w_i a_i|, hence
//! |here - ggml| <= 2 gamma_(blocks + 3) x sum_b |fl(d_w d_a)_b| x sum_i |w_i a_i|,
//! the bound the tests check.

use super::avx2::fp16_at;
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

/// A type's block bytes and value offset.
const fn layout(kind: u8) -> (usize, i32) {
    match kind {
        Q5 => (22, 16),
        Q8 => (Q8_0_BLOCK, 128),
        _ => (18, 8),
    }
}

/// Registers of values per packed block: one per word of a row (Q8_0: of each plane).
const fn registers(kind: u8) -> usize {
    if kind == Q8 {
        16
    } else {
        8
    }
}

/// 32-byte units of a packed block of eight rows: the registers, then eight f32 scales.
const fn packed_block(kind: u8) -> usize {
    registers(kind) + 1
}

/// The kernel for `KIND`.
pub(super) fn gemm_fn(kind: u8) -> GemmFn {
    match kind {
        Q5 => gemm::<Q5>,
        Q8 => gemm::<Q8>,
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
    let (block, _) = layout(KIND);
    let n = w.len() / rb;
    assert!(
        rb == blocks * block
            && w.len() == n * rb
            && n.is_multiple_of(ROWS)
            && acts.iter().all(|a| a.len() == blocks * Q8_0_BLOCK)
            && out.len() == n * acts.len(),
        "{} weight bytes of rows of {rb}, {} tokens, {} outputs: not whole groups",
        w.len(),
        acts.len(),
        out.len()
    );
    SCRATCH.with_borrow_mut(|(packed, sums)| {
        let per_group = blocks * packed_block(KIND);
        // SAFETY: zero bits are a valid vector.
        packed.resize(n / ROWS * per_group, unsafe { std::mem::zeroed() });
        sums.resize(acts.len() * blocks, 0);
        // SAFETY: the sizes are checked above and the CPU features when the kernel was
        // chosen; `packed` holds n / ROWS groups of `blocks` packed blocks.
        unsafe {
            for (g, dst) in packed.chunks_exact_mut(per_group).enumerate() {
                pack::<KIND>(w[g * ROWS * rb..].as_ptr(), rb, blocks, dst.as_mut_ptr());
            }
            for (a, s) in acts.iter().zip(sums.chunks_exact_mut(blocks)) {
                block_sums::<KIND>(a.as_ptr(), s);
            }
            let tokens = acts.len();
            for (g, group) in packed.chunks_exact(per_group).enumerate() {
                let mut t0 = 0;
                while t0 < tokens {
                    let tile = (tokens - t0).min(TILE_TOKENS);
                    let a: [*const u8; TILE_TOKENS] =
                        std::array::from_fn(|t| acts[t0 + t.min(tile - 1)].as_ptr());
                    let s: [*const i32; TILE_TOKENS] =
                        std::array::from_fn(|t| sums[(t0 + t.min(tile - 1)) * blocks..].as_ptr());
                    let mut o = [[0f32; ROWS]; TILE_TOKENS];
                    match tile {
                        4 => tile_fn::<KIND, 4>(group.as_ptr(), blocks, a, s, &mut o),
                        3 => tile_fn::<KIND, 3>(group.as_ptr(), blocks, a, s, &mut o),
                        2 => tile_fn::<KIND, 2>(group.as_ptr(), blocks, a, s, &mut o),
                        _ => tile_fn::<KIND, 1>(group.as_ptr(), blocks, a, s, &mut o),
                    }
                    for (t, o) in o[..tile].iter().enumerate() {
                        let at = (t0 + t) * n + g * ROWS;
                        out[at..at + ROWS].copy_from_slice(o);
                    }
                    t0 += tile;
                }
            }
        }
    });
}

/// Repacks eight rows at `w` (`rb` bytes apart) into `blocks` packed blocks at `dst`.
///
/// # Safety
/// `w` points at eight rows of `blocks` blocks of the type, `dst` at room for `blocks`
/// packed blocks; the CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pack<const KIND: u8>(w: *const u8, rb: usize, blocks: usize, dst: *mut __m256i) {
    let (block, _) = layout(KIND);
    for b in 0..blocks {
        // SAFETY: block b of the eight rows, packed block b of `dst`, per the contract.
        unsafe {
            let x: [*const u8; ROWS] = std::array::from_fn(|r| w.add(r * rb + b * block));
            let out = dst.add(b * packed_block(KIND));
            let v = x.map(|x| values::<KIND>(x));
            if KIND == Q8 {
                let m4 = _mm256_set1_epi8(0x0f);
                let u = v.map(|v| _mm256_xor_si256(v, _mm256_set1_epi8(i8::MIN)));
                transpose(u.map(|u| _mm256_and_si256(u, m4)), out);
                let high = u.map(|u| _mm256_and_si256(_mm256_srli_epi16::<4>(u), m4));
                transpose(high, out.add(8));
            } else {
                transpose(v, out);
            }
            let scales: [f32; ROWS] = x.map(|x| fp16_at(x));
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

/// A block's 32 values in element order: unsigned bytes, offset included (Q8_0: signed).
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
            _ => super::avx2::legacy_values::<{ super::avx2::Q4 }>(x),
        }
    }
}

/// The offset times each block's sum of the 32 activation values.
///
/// # Safety
/// `a` points at `sums.len()` Q8_0 blocks; the CPU has AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_sums<const KIND: u8>(a: *const u8, sums: &mut [i32]) {
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
                    if (KIND == Q8 && j >= 8) || (KIND != Q8 && j >= 4) {
                        hi[t] = _mm256_add_epi16(hi[t], prod);
                    } else {
                        lo[t] = _mm256_add_epi16(lo[t], prod);
                    }
                }
            }
            let dw = _mm256_loadu_ps(p.add(registers(KIND)).cast());
            for t in 0..T {
                let mut high = _mm256_madd_epi16(hi[t], ones);
                if KIND == Q8 {
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
