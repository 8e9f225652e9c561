//! Dot products of runs of consecutive weight rows with one quantized activation row, or with
//! several (a prompt's tokens, an expert's routes: [`RowDots::dots`]).
//!
//! ggml-cpu's x86 dot products take one row per call (its `nrows` trait is 1 for every type on
//! x86), and for Q4_0 and Q8_0 a call spends about a nanosecond per 32-value block whatever the
//! type's size: one thread computes Q4_0 rows at ~16 GB/s, so two threads could not read
//! experts faster than ~30 GB/s however the rows were laid out (benches/README.md). On CPUs
//! with AVX-512 VNNI the kernels here hold two rows side by side in each 512-bit register, four
//! rows per call, and share the activation's loads and scale between them: one thread computes
//! Q4_0 rows at ~28 GB/s. Each row's result is bit-identical to ggml's own AVX2
//! `ggml_vec_dot_q4_0_q8_0` / `_q5_0_q8_0` / `_q8_0_q8_0` / `_mxfp4_q8_0` / `_iq4_nl_q8_0` /
//! `_q4_1_q8_1` / `_q5_1_q8_1` (the K-quants' and IQ4_XS's: `avx512_k`): the same exact integer
//! sum per 4-value
//! lane, the same f32 product of the two block scales, the same chain of fused
//! multiply-adds over the blocks and the same horizontal sum, only for two rows per
//! instruction; with several activation rows each weight block is unpacked once for all of
//! them. Other types and CPUs, and a ggml built without AVX2 (whose kernels round
//! differently), use ggml's kernel row by row. At the AVX2 level the group kernels (`avx2`)
//! are bit-identical too, and the products of several tokens for Q4_0, Q5_0, Q8_0, IQ4_NL,
//! MXFP4, Q4_K, Q5_K and Q6_K run as tiles over interleaved rows (`avx2_gemm`), within a
//! derived bound of ggml's; rows packed at load time (`crate::PackedRows`: Q4_0, Q8_0, Q4_K)
//! run, for any number of tokens, through kernels over eight rows interleaved per block
//! (`avx2_repack`), within the same bound.

use crate::isa::{cpu_isa, CpuIsa};
use freetoken_ggml::{GgmlType, Result, VecDot};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::hsum_float_8;
#[cfg(target_arch = "x86_64")]
mod avx2_gemm;
#[cfg(target_arch = "x86_64")]
mod avx2_repack;
#[cfg(target_arch = "x86_64")]
mod avx512_k;
#[cfg(target_arch = "x86_64")]
mod blocks;

/// Rows per pass of a group kernel.
const GROUP: usize = 4;

/// Rows the callers compute for every activation row (token, route) before they move on to the
/// next rows: the pass's rows stay in the L1 cache (16 gate and 16 up rows of Q4_0 at hidden
/// 2048: 36 KB) while every activation reads them, and the group kernels prefetch one pass
/// ahead.
pub(crate) const PASS_ROWS: usize = 16;

/// Asks for `bytes` (a task's first pass of weight rows) to be brought into the caches. The
/// group kernels prefetch one pass ahead, so a task's later passes arrive in time, and on one
/// thread so does the next task's first (the blocks are adjacent); with several threads a
/// task's first pass is a block another thread did not stream, and four interleaved rows are
/// streams the hardware prefetcher does not follow: its misses came one after another.
pub(crate) fn prefetch(bytes: &[u8]) {
    prefetch_hint::<{ HINT_L1 }>(bytes);
}

/// `prefetch` into the second-level cache only: for a task's reads that come after another
/// task's, which would push them out of the first level before they are used.
pub(crate) fn prefetch_l2(bytes: &[u8]) {
    prefetch_hint::<{ HINT_L2 }>(bytes);
}

#[cfg(target_arch = "x86_64")]
const HINT_L1: i32 = std::arch::x86_64::_MM_HINT_T0;
#[cfg(target_arch = "x86_64")]
const HINT_L2: i32 = std::arch::x86_64::_MM_HINT_T1;
#[cfg(not(target_arch = "x86_64"))]
const HINT_L1: i32 = 0;
#[cfg(not(target_arch = "x86_64"))]
const HINT_L2: i32 = 0;

fn prefetch_hint<const HINT: i32>(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch of a valid address only hints the caches.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Activation rows (tokens) the multi-token group kernels take at once, largest first: each
/// group of weight blocks is unpacked once for all of them. 128-token products on the 2-core
/// dev machine (AMD EPYC): Q5_0 160 -> 380 GFLOP/s, Q4_0 200 -> 410, Q8_0 230 -> 420 with 8
/// against 1 (310-400 with 4). Each token holds two accumulators: 16 of the 32 vector
/// registers at 8.
pub(crate) const TILES: [usize; 2] = [8, 4];

/// `out[t][r]` = row r of the `GROUP` rows at `w`, `w + row_bytes`, ... against the activation
/// row `acts[t]`, each `blocks` 32-value blocks long, for the kernel's number of tokens
/// (`acts.len()` and `out.len()`: one of [`TILES`], or 1).
type GroupFn = unsafe fn(
    w: *const u8,
    row_bytes: usize,
    acts: &[*const u8],
    blocks: usize,
    out: &mut [[f32; GROUP]],
);

/// Rows of one group of the interleaved tiled kernels.
const GEMM_ROWS: usize = 8;

/// Rows per call where the interleaved tiled kernel runs ([`RowDots::pass_rows`]).
pub(crate) const GEMM_PASS_ROWS: usize = 64;

/// `out[t * n + r]` = row r of `w` (n rows of `rb` bytes) against token t's activation row
/// `acts[t]`, each `blocks` 32-value blocks.
type GemmFn = fn(w: &[u8], rb: usize, blocks: usize, acts: &[&[u8]], out: &mut [f32]);

/// Rows per group of a packed matrix ([`RowDots::packed`]): tasks over one start at a multiple.
#[cfg(target_arch = "x86_64")]
pub(crate) const PACKED_ROWS: usize = avx2_repack::ROWS;
#[cfg(not(target_arch = "x86_64"))]
pub(crate) const PACKED_ROWS: usize = 8;

/// A weight type's kernels over rows packed at load time: `pack(src, blocks, dst)` packs
/// whole groups of [`PACKED_ROWS`] (the tail rows copied as they are) into as many bytes,
/// `dots` computes whole packed groups as a [`GemmFn`] does rows.
#[derive(Clone, Copy)]
struct PackedFns {
    pack: fn(src: &[u8], blocks: usize, dst: &mut [u8]),
    dots: GemmFn,
}

/// A weight type's group kernels on this CPU: one per [`TILES`] size, and one for a single
/// token where it beats ggml's row kernel (tokens left over go one by one).
#[derive(Clone, Copy)]
struct GroupFns {
    tiles: [GroupFn; 2],
    one: Option<GroupFn>,
}

/// A weight type's dot product, applied to runs of consecutive rows.
#[derive(Clone, Copy)]
pub(crate) struct RowDots {
    kernel: VecDot,
    group: Option<GroupFns>,
    /// The interleaved tiled kernel, and the tokens from which a call's rows go through it
    /// (its repacking of the rows is shared by them).
    gemm: Option<(GemmFn, usize)>,
    /// The kernels over packed rows, where the level has them for the types.
    pack: Option<PackedFns>,
    /// Whether the rows [`RowDots::dots`] gets are packed ([`RowDots::packed`]).
    packed: bool,
}

impl RowDots {
    /// The kernels of the level in use ([`cpu_isa`]: an unknown or unrunnable cap is the
    /// error).
    pub(crate) fn new(kernel: VecDot) -> Result<RowDots> {
        Ok(RowDots::with_isa(kernel, cpu_isa()?))
    }

    /// The kernels of `level`, which the caller has checked this host runs.
    pub(crate) fn with_isa(kernel: VecDot, level: CpuIsa) -> RowDots {
        debug_assert!(level.missing().is_none(), "{level:?} on this host");
        let group = match level {
            CpuIsa::Generic => None,
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 => avx2::group_fns(&kernel),
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx512 => avx512::group_fns(&kernel).or_else(|| avx512_k::group_fns(&kernel)),
            #[cfg(not(target_arch = "x86_64"))]
            _ => None,
        };
        // From 4 tokens (Q8_0, IQ4_NL: 8; Q4_K, Q5_K, Q6_K: 16) the tiles beat the group
        // kernels: 16 rows of 2048, one thread, Q4_0 95 against 55 GFLOP/s at 4 tokens, 132
        // against 54 at 128; Q5_0 81 against 47 and 133 against 45; Q8_0 54 against 55 at 4,
        // 64 against 55 at 8; Q4_K 100 against 104 at 8, 126 against 100 at 16, 179 against
        // 100 at 128; Q5_K 85 against 85 at 8, 119 against 75 at 16, 187 against 84 at 128;
        // Q6_K 79 against 83 at 8, 105 against 81 at 16, 157 against 85 at 128; IQ4_NL 36
        // against 48 at 4, 56 against 52 at 8, 77 against 56 at 128; MXFP4 78 against 43 at
        // 4, 131 against 46 at 128. IQ4_XS keeps the group kernels.
        let gemm = match level {
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 => match (kernel.weight_type(), kernel.act_type()) {
                (GgmlType::Q4_0, GgmlType::Q8_0) => Some((avx2_gemm::gemm_fn(avx2_gemm::Q4), 4)),
                (GgmlType::Q5_0, GgmlType::Q8_0) => Some((avx2_gemm::gemm_fn(avx2_gemm::Q5), 4)),
                (GgmlType::Q8_0, GgmlType::Q8_0) => Some((avx2_gemm::gemm_fn(avx2_gemm::Q8), 8)),
                (GgmlType::Q4_K, GgmlType::Q8_K) => Some((avx2_gemm::gemm_fn(avx2_gemm::Q4K), 16)),
                (GgmlType::Q5_K, GgmlType::Q8_K) => Some((avx2_gemm::gemm_fn(avx2_gemm::Q5K), 16)),
                (GgmlType::Q6_K, GgmlType::Q8_K) => Some((avx2_gemm::gemm_fn(avx2_gemm::Q6K), 16)),
                (GgmlType::IQ4_NL, GgmlType::Q8_0) => Some((avx2_gemm::gemm_fn(avx2_gemm::NL), 8)),
                (GgmlType::MXFP4, GgmlType::Q8_0) => Some((avx2_gemm::gemm_fn(avx2_gemm::MX), 4)),
                _ => None,
            },
            _ => None,
        };
        // AVX2 only: the AVX-512 group kernels read the original rows faster.
        let pack = match level {
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 => avx2_repack::packed_fns(&kernel),
            _ => None,
        };
        RowDots {
            kernel,
            group,
            gemm,
            pack,
            packed: false,
        }
    }

    /// Whether the kernels have a packed layout for the type ([`RowDots::pack`]).
    pub(crate) fn packs(&self) -> bool {
        self.pack.is_some()
    }

    /// Packs `src` (whole rows) into `dst` (as many bytes): each group of [`PACKED_ROWS`]
    /// rows from the first interleaved, the rows after the last whole group as they are.
    pub(crate) fn pack(&self, src: &[u8], dst: &mut [u8]) {
        let pack = self.pack.expect("a type with a packed layout");
        (pack.pack)(src, self.kernel.k() / 32, dst);
    }

    /// These kernels over packed rows ([`RowDots::pack`]): the rows [`RowDots::dots`] gets
    /// then start at a group and end at one or at the packed matrix's end.
    pub(crate) fn packed(self) -> RowDots {
        assert!(self.packs(), "a type with a packed layout");
        RowDots {
            packed: true,
            ..self
        }
    }

    /// Whether [`RowDots::dots`] computes every row through the interleaved tiled kernel for
    /// `tokens` activation rows (else through the group kernels or ggml's, bit-identical to
    /// ggml's row kernel). It depends on the count alone, so a row's value does not depend on
    /// how the rows are split across tasks.
    pub(crate) fn tiled(&self, tokens: usize) -> bool {
        matches!(self.gemm, Some((_, min)) if tokens >= min)
    }

    /// Rows per call of [`RowDots::dots`] for `tokens` activation rows: [`PASS_ROWS`], which
    /// stay in the L1 cache while every token reads them, or where the tiled kernel runs
    /// [`GEMM_PASS_ROWS`], whose repacking keeps them there (a call's repacking and activation
    /// sums are then shared by more rows: Q5_0, 640 columns, 128 tokens, one thread, 138
    /// GFLOP/s in calls of 16 rows, 161 in calls of 64).
    pub(crate) fn pass_rows(&self, tokens: usize) -> usize {
        if self.tiled(tokens) {
            GEMM_PASS_ROWS
        } else {
            PASS_ROWS
        }
    }

    /// `out[t * n + i]` = row i of `w` (n consecutive rows) . `acts[t]`, where each `acts[t]`
    /// holds one or more quantized rows of one activation ([`crate::acts::ActCodec`]'s passes,
    /// the same number for all) and the result is the sum over them; with one pass each value
    /// is exactly what `VecDot::dot` gives for that row (but where [`RowDots::tiled`], or
    /// over packed rows ([`RowDots::packed`]) but for those past the last whole group: within
    /// the bound `avx2_gemm` states), and with several the passes' values added in order.
    pub(crate) fn dots(&self, w: &[u8], acts: &[&[u8]], out: &mut [f32]) {
        let (ab, rb) = (self.kernel.act_row_bytes(), self.kernel.weight_row_bytes());
        let passes = acts.first().map_or(1, |a| a.len() / ab);
        assert!(
            passes > 0
                && acts.iter().all(|a| a.len() == passes * ab)
                && w.len().is_multiple_of(rb)
                && out.len() == acts.len() * (w.len() / rb),
            "{} weight bytes, activations of {:?} bytes and {} outputs: not whole rows of {rb} \
             and {ab}",
            w.len(),
            acts.iter().map(|a| a.len()).collect::<Vec<_>>(),
            out.len()
        );
        let (n, blocks) = (w.len() / rb, self.kernel.k() / 32);
        // Packed rows: every whole group through the packed kernel, the tail as it is.
        let packed = self.pack.filter(|_| self.packed);
        let whole = packed.map_or(0, |_| n / PACKED_ROWS * PACKED_ROWS);
        if let ([act], 1) = (acts, passes) {
            // One token: every row straight into `out`, whatever the count (the per-call
            // work of a pass, next to the twenty blocks of a 640-column row, had weighed).
            if let Some(pk) = packed {
                (pk.dots)(&w[..whole * rb], rb, blocks, acts, &mut out[..whole]);
            }
            return self.dots_one(&w[whole * rb..], act, &mut out[whole..]);
        }
        // The rows from 0 that one kernel takes for every token at once: the packed groups,
        // or all where the tiles run.
        let wide = match packed {
            Some(pk) => Some((pk.dots, whole)),
            None => self
                .gemm
                .filter(|_| self.tiled(acts.len()))
                .map(|(gemm, _)| (gemm, n)),
        };
        for p in 0..passes {
            let pass = |t: usize| &acts[t][p * ab..(p + 1) * ab];
            // The first pass writes, the others add: the order `VecDot::dot` sums would take.
            let mut put = |t: usize, r0: usize, v: &[f32]| {
                let o = &mut out[t * n + r0..t * n + r0 + v.len()];
                if p == 0 {
                    o.copy_from_slice(v);
                } else {
                    o.iter_mut().zip(v).for_each(|(o, v)| *o += v);
                }
            };
            let mut done = 0;
            if let Some((f, m)) = wide.filter(|&(_, m)| m > 0) {
                let a: Vec<&[u8]> = (0..acts.len()).map(pass).collect();
                let mut v = vec![0f32; acts.len() * m];
                f(&w[..m * rb], rb, blocks, &a, &mut v);
                for (t, v) in v.chunks_exact(m).enumerate() {
                    put(t, 0, v);
                }
                done = m;
            }
            if done < n {
                let put = |t: usize, r0: usize, v: &[f32]| put(t, done + r0, v);
                self.group_dots(&w[done * rb..], acts.len(), pass, put);
            }
        }
    }

    /// `put(t, r0, values)` for the rows of `w` from r0 on against `act(t)`, `tokens` of them,
    /// through the group kernels (in tiles of tokens) or ggml's.
    fn group_dots<'a>(
        &self,
        w: &[u8],
        tokens: usize,
        act: impl Fn(usize) -> &'a [u8],
        mut put: impl FnMut(usize, usize, &[f32]),
    ) {
        let rb = self.kernel.weight_row_bytes();
        let (n, blocks) = (w.len() / rb, self.kernel.k() / 32);
        let whole = n / GROUP * GROUP;
        let mut t0 = 0;
        let tiles = self.group.map(|g| g.tiles);
        for (size, f) in TILES.into_iter().zip(tiles.into_iter().flatten()) {
            while t0 + size <= tokens {
                let a: [*const u8; TILES[0]] =
                    std::array::from_fn(|t| act(t0 + t.min(size - 1)).as_ptr());
                let mut r = [[0f32; GROUP]; TILES[0]];
                for r0 in (0..whole).step_by(GROUP) {
                    // SAFETY: GROUP rows of `rb` bytes from r0 (r0 + GROUP <= n) and `size`
                    // activation rows of the kernel's bytes (checked by `dots`), of the
                    // kernel's types, which `group_fns` chose for this CPU.
                    unsafe {
                        f(
                            w[r0 * rb..].as_ptr(),
                            rb,
                            &a[..size],
                            blocks,
                            &mut r[..size],
                        )
                    };
                    for (t, v) in r[..size].iter().enumerate() {
                        put(t0 + t, r0, v);
                    }
                }
                for t in t0..t0 + size {
                    self.put_rows(&w[whole * rb..], act(t), |r0, v| put(t, whole + r0, v));
                }
                t0 += size;
            }
        }
        for t in t0..tokens {
            self.put_rows(w, act(t), |r0, v| put(t, r0, v));
        }
    }

    /// `put(r0, values)` for the rows of `w` from r0 on against `act`, a group at a time.
    fn put_rows(&self, w: &[u8], act: &[u8], mut put: impl FnMut(usize, &[f32])) {
        let rb = self.kernel.weight_row_bytes();
        for (g, rows) in w.chunks(GROUP * rb).enumerate() {
            let mut v = [0f32; GROUP];
            let v = &mut v[..rows.len() / rb];
            self.dots_one(rows, act, v);
            put(g * GROUP, v);
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
        if let Some(one) = self.group.and_then(|g| g.one) {
            let blocks = self.kernel.k() / 32;
            for (o, rows) in out.chunks_exact_mut(GROUP).zip(w.chunks_exact(GROUP * rb)) {
                let mut r = [[0f32; GROUP]];
                // SAFETY: `rows` holds GROUP rows of `rb` bytes and `act` one activation row
                // (checked above), both of `blocks` blocks of the group kernel's types, which
                // `group_fns` chose for this CPU.
                unsafe { one(rows.as_ptr(), rb, &[act.as_ptr()], blocks, &mut r) };
                o.copy_from_slice(&r[0]);
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
mod avx512;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use freetoken_ggml::{quantize, GgmlType};

    /// Where `row . act` may differ from ggml's row kernel by its scalar tail: IQ4_NL and
    /// MXFP4 rows of an odd number of blocks, whose last block ggml adds as
    /// `sumf += d * (sumi1 + sumi2)`. Ours fuses that multiply-add; ggml's compiler contracts
    /// it or not by its target (contracted in the Intel hosts' native builds, not in a Zen 4
    /// one). Fused, the sum is fl(s + p S); unfused fl(s + fl(p S)): they differ by at most
    /// u |p S| + u |s + fl(p S)| + u |s + p S| <= 2u (|p S| + |result|) with u = 2^-24, and
    /// fl(p S) is the last block's dot alone. The bound, or None where the two are the same
    /// arithmetic.
    pub(crate) fn tail_bound(kernel: &VecDot, row: &[u8], act: &[u8], result: f32) -> Option<f32> {
        if !tail_may_round(kernel) {
            return None;
        }
        let blocks = kernel.k() / 32;
        let (wb, ab) = (row.len() / blocks, act.len() / blocks);
        let last = VecDot::new(kernel.weight_type(), 32).unwrap();
        let ps = last
            .dot(&row[row.len() - wb..], &act[act.len() - ab..])
            .unwrap();
        Some(f32::EPSILON * (ps.abs() + result.abs()))
    }

    /// Whether a kernel's products may differ from ggml's by [`tail_bound`].
    pub(crate) fn tail_may_round(kernel: &VecDot) -> bool {
        matches!(kernel.weight_type(), GgmlType::IQ4_NL | GgmlType::MXFP4)
            && !(kernel.k() / 32).is_multiple_of(2)
    }

    /// The types with group kernels on AVX-512 VNNI CPUs.
    pub(super) const GROUP_TYPES: [GgmlType; 20] = [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_0,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::MXFP4,
        GgmlType::IQ4_NL,
        GgmlType::Q4_1,
        GgmlType::Q5_1,
        GgmlType::IQ2_XXS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ1_M,
    ];

    /// The kernel levels this host runs.
    pub(super) fn levels() -> impl Iterator<Item = CpuIsa> + Clone {
        CpuIsa::ALL.into_iter().filter(|l| l.missing().is_none())
    }

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

    /// Blocks of random values (and K-quants' sub-block scales) under random finite fp16
    /// scales (both signs, from subnormal to large; Q4_K's d and dmin, Q6_K's d), so that
    /// every lane and scale path is exercised.
    pub(super) fn random_blocks(t: GgmlType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
        let bs = t.type_size();
        if t == GgmlType::MXFP4 {
            // E8M0 scales from 2^-28 to 2^1: finite products, every exponent path but the
            // subnormal ones (scales 0 and 1 are too small to matter next to the rest).
            let mut data = bytes(rows * k / 32 * 17, seed);
            for (i, block) in data.chunks_exact_mut(17).enumerate() {
                block[0] = 100 + (i * 7 % 30) as u8;
            }
            return data;
        }
        let fp16_at: &[usize] = match t {
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            _ => &[0],
        };
        let mut data = bytes(rows * k / t.block_size() * bs, seed);
        for (i, block) in data.chunks_exact_mut(bs).enumerate() {
            for (f, &at) in fp16_at.iter().enumerate() {
                let i = i * fp16_at.len() + f;
                let exp = (i * 7 % 30) as u16; // below 31: never inf or NaN
                let bits =
                    ((i as u16 & 1) << 15) | (exp << 10) | ((i as u16).wrapping_mul(37) & 0x3ff);
                block[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        data
    }

    #[test]
    fn runs_of_rows_equal_ggml_row_by_row_bit_for_bit() {
        for t in GROUP_TYPES {
            for k in [32usize, 96, 256, 2048] {
                if !k.is_multiple_of(t.block_size()) {
                    continue;
                }
                let rows = 11; // two groups of four and a tail of three
                let kernel = VecDot::new(t, k).unwrap();
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
                let flat = vec![1f32; k]; // the IQ types need an importance matrix
                let im = t.requires_imatrix().then_some(&flat[..]);
                let mut weights = vec![quantize(t, &w, k, im).unwrap()];
                if t.block_size() == 32
                    || matches!(
                        t,
                        GgmlType::Q2_K
                            | GgmlType::Q3_K
                            | GgmlType::Q4_K
                            | GgmlType::Q5_K
                            | GgmlType::Q6_K
                            | GgmlType::IQ4_XS
                            | GgmlType::IQ2_XXS
                            | GgmlType::IQ3_XXS
                            | GgmlType::IQ1_S
                            | GgmlType::IQ2_XS
                            | GgmlType::IQ3_S
                            | GgmlType::IQ2_S
                            | GgmlType::IQ1_M
                    )
                {
                    weights.push(random_blocks(t, rows, k, 7 + k as u64));
                }
                for (w, level) in weights.iter().flat_map(|w| levels().map(move |l| (w, l))) {
                    let dots = RowDots::with_isa(kernel, level);
                    let rb = kernel.weight_row_bytes();
                    for n in [1, 4, 5, rows] {
                        let mut out = vec![f32::NAN; n];
                        dots.dots(&w[..n * rb], &[&act], &mut out);
                        for (i, o) in out.iter().enumerate() {
                            let row = &w[i * rb..(i + 1) * rb];
                            let want = kernel.dot(row, &act).unwrap();
                            let case = format!("{t} {level:?} k={k} row {i} of {n}");
                            match tail_bound(&kernel, row, &act, want) {
                                Some(b) => assert!((o - want).abs() <= b, "{case}: {o} {want}"),
                                None => assert_eq!(o.to_bits(), want.to_bits(), "{case}"),
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tile_tests {
    use super::*;
    use freetoken_ggml::quantize;

    /// An fp16 value.
    fn fp16(bits: u16) -> f64 {
        let (exp, mant) = (i32::from(bits >> 10 & 0x1f), f64::from(bits & 0x3ff));
        assert!(exp < 31, "a finite scale");
        let v = if exp == 0 {
            mant * 2f64.powi(-24)
        } else {
            (1024.0 + mant) * 2f64.powi(exp - 25)
        };
        if bits >> 15 == 1 {
            -v
        } else {
            v
        }
    }

    /// MXFP4's E8M0 scale as ggml halves it.
    fn e8m0_half(e: u8) -> f32 {
        f32::from_bits(if e < 2 {
            0x0020_0000 << e
        } else {
            u32::from(e - 1) << 23
        })
    }

    /// The bound `avx2_gemm` derives on its distance from ggml's row kernel: for a row of a
    /// 32-value type against a Q8_0 activation row, 2 gamma_(blocks + 3) x the sum over blocks
    /// of |fl(d_w d_a)| x sum_i |w_i a_i|; for Q6_K against Q8_K the same with sum_i |scale_i
    /// q_i a_i| + 32 sum_s |scale_s bsum_s| (q_i unsigned, bsum_s the activation's 16-value
    /// sums: ggml's lanes split both); for Q4_K and Q5_K, 2 gamma_(2 blocks + 4) x the sum
    /// over blocks of |fl(d_w d_a)| x sum_i |scale_i w_i a_i| + |fl(dmin_w d_a)| x sum_s
    /// min_s |sum_(i in s) a_i|; the values decoded here from the formats.
    pub(super) fn gemm_bound(t: GgmlType, w: &[u8], a: &[u8]) -> f32 {
        let scale = |p: &[u8]| fp16(u16::from_le_bytes([p[0], p[1]]));
        let gamma = |n: usize| {
            let nu = n as f64 * 2f64.powi(-24);
            nu / (1.0 - nu)
        };
        if matches!(t, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K) {
            let supers = a.len() / 292;
            let mut total = 0f64;
            for (x, y) in w.chunks_exact(t.type_size()).zip(a.chunks_exact(292)) {
                let yd = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                let ya = |i: usize| i32::from(y[4 + i] as i8);
                if t == GgmlType::Q6_K {
                    let dd = (scale(&x[208..]) as f32 * yd).abs() as f64;
                    let sc = |i: usize| i32::from(x[192 + i / 16] as i8);
                    let mut sum = 0i64;
                    for i in 0..256 {
                        let (j, k, e) = (i / 128, i % 128 / 32, i % 32);
                        let low = x[64 * j + 32 * (k % 2) + e] >> (4 * (k / 2)) & 0xf;
                        let high = x[128 + 32 * j + e] >> (2 * k) & 3;
                        let q = i32::from(low | high << 4);
                        sum += i64::from((sc(i) * q * ya(i)).abs());
                    }
                    for s in 0..16 {
                        let bsum = i16::from_le_bytes([y[260 + 2 * s], y[261 + 2 * s]]);
                        sum += 32 * i64::from((sc(16 * s) * i32::from(bsum)).abs());
                    }
                    total += dd * sum as f64;
                    continue;
                }
                let dd = (scale(x) as f32 * yd).abs() as f64;
                let dm = (scale(&x[2..]) as f32 * yd).abs() as f64;
                let q = &x[4..16];
                let (qs, fifth) = if t == GgmlType::Q5_K {
                    (&x[48..], Some(&x[16..48]))
                } else {
                    (&x[16..], None)
                };
                for sb in 0..8 {
                    let (sc, m) = if sb < 4 {
                        (q[sb] & 63, q[sb + 4] & 63)
                    } else {
                        let sc = (q[sb + 4] & 0xf) | (q[sb - 4] >> 6) << 4;
                        (sc, (q[sb + 4] >> 4) | (q[sb] >> 6) << 4)
                    };
                    let (mut prod, mut sum) = (0i32, 0i32);
                    for e in 0..32 {
                        let byte = qs[32 * (sb / 2) + e];
                        let mut v = if sb % 2 == 0 { byte & 0xf } else { byte >> 4 };
                        if let Some(h) = fifth {
                            v |= (h[e] >> sb & 1) << 4;
                        }
                        prod += (i32::from(v) * ya(32 * sb + e)).abs();
                        sum += ya(32 * sb + e);
                    }
                    total += dd * f64::from(sc) * f64::from(prod);
                    total += dm * f64::from(m) * f64::from(sum.abs());
                }
            }
            let n = if t == GgmlType::Q6_K {
                supers + 3
            } else {
                2 * supers + 4
            };
            return (2.0 * gamma(n) * total) as f32;
        }
        let wb = t.type_size();
        let blocks = a.len() / 34;
        let mut total = 0f64;
        for (x, y) in w.chunks_exact(wb).zip(a.chunks_exact(34)) {
            let dw = if t == GgmlType::MXFP4 {
                e8m0_half(x[0])
            } else {
                scale(x) as f32
            };
            let dd = (dw * scale(y) as f32).abs() as f64;
            let (qs, fifth, offset) = match t {
                GgmlType::Q5_0 => (&x[6..22], u32::from_le_bytes([x[2], x[3], x[4], x[5]]), 16),
                GgmlType::Q8_0 => (&x[2..34], 0, 0),
                GgmlType::MXFP4 => (&x[1..17], 0, 0),
                GgmlType::IQ4_NL => (&x[2..18], 0, 0),
                _ => (&x[2..18], 0, 8),
            };
            let sum: f64 = (0..32)
                .map(|i| {
                    let nibble = if i < 16 { qs[i] & 0xf } else { qs[i - 16] >> 4 };
                    let v = match t {
                        GgmlType::Q8_0 => i32::from(qs[i] as i8),
                        GgmlType::MXFP4 => i32::from(MXFP4_VALUES[usize::from(nibble)]),
                        GgmlType::IQ4_NL => i32::from(IQ4_NL_VALUES[usize::from(nibble)]),
                        _ => i32::from(nibble) | ((fifth >> i & 1) as i32) << 4,
                    };
                    f64::from(((v - offset) * i32::from(y[2 + i] as i8)).abs())
                })
                .sum();
            total += dd * sum;
        }
        (2.0 * gamma(blocks + 3) * total) as f32
    }

    /// ggml's `kvalues_mxfp4` and `kvalues_iq4nl`, the two table types' values.
    const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    const IQ4_NL_VALUES: [i8; 16] = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];

    /// Tokens per call: one, the tiles and their neighbours, tiles with every tail, 64.
    const TOKEN_COUNTS: [usize; 11] = [1, 2, 3, 4, 7, 8, 9, 13, 19, 33, 64];

    /// Every (token, row) of `dots` over many tokens, on quantized and on random blocks, is
    /// ggml's own dot product, bit for bit (the interleaved tiled kernel's rows: within its
    /// bound): tiles of tokens, groups of rows and both kinds of tails, at K of one block and
    /// of three (an odd count: the table types' scalar tail); with two passes per token, the
    /// two passes' products added.
    #[test]
    fn tokens_times_rows_equal_ggml_or_within_the_tiles_bound() {
        for (t, blocks) in super::tests::GROUP_TYPES
            .into_iter()
            .flat_map(|t| [1, 3].map(|b| (t, b)))
        {
            let k = blocks * t.block_size();
            let kernel = VecDot::new(t, k).unwrap();
            let (ab, rb) = (kernel.act_row_bytes(), kernel.weight_row_bytes());
            let wf: Vec<f32> = (0..17 * k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let flat = vec![1f32; k]; // the IQ types need an importance matrix
            let quantized = quantize(t, &wf, k, t.requires_imatrix().then_some(&flat[..])).unwrap();
            let random = super::tests::random_blocks(t, 17, k, 5);
            for ((w, n_tok), level) in [&quantized, &random]
                .into_iter()
                .flat_map(|w| TOKEN_COUNTS.map(|n| (w, n)))
                .flat_map(|c| super::tests::levels().map(move |l| (c, l)))
            {
                let dots = RowDots::with_isa(kernel, level);
                let mut acts = vec![0u8; n_tok * ab];
                for (tok, a) in acts.chunks_exact_mut(ab).enumerate() {
                    let x: Vec<f32> = (0..k)
                        .map(|i| ((i * 13 + tok * 7) % 29) as f32 / 9.0 - 1.5)
                        .collect();
                    kernel.quantize_act(&x, a).unwrap();
                }
                for n_rows in [1, 4, 5, 11, 17] {
                    let w = &w[..n_rows * rb];
                    let one: Vec<&[u8]> = acts.chunks_exact(ab).collect();
                    let mut got = vec![f32::NAN; n_tok * n_rows];
                    dots.dots(w, &one, &mut got);
                    // Two passes: each token's row, then the next token's as its "residual".
                    let two: Vec<Vec<u8>> = (0..n_tok)
                        .map(|t| [one[t], one[(t + 1) % n_tok]].concat())
                        .collect();
                    let two: Vec<&[u8]> = two.iter().map(Vec::as_slice).collect();
                    let mut sum = vec![f32::NAN; n_tok * n_rows];
                    dots.dots(w, &two, &mut sum);
                    let case = format!("{t} {level:?} k={k}, {n_tok} tokens, {n_rows} rows");
                    let want: Vec<f32> = (0..n_tok * n_rows)
                        .map(|i| {
                            let (tok, r) = (i / n_rows, i % n_rows);
                            kernel.dot(&w[r * rb..(r + 1) * rb], one[tok]).unwrap()
                        })
                        .collect();
                    // Each pass's bound (the two passes' sum: both, and its rounding): the
                    // interleaved tiled kernel's, the one it states; else the row kernels'
                    // scalar tail where ggml's compiler may not fuse it; None: bit for bit.
                    let tiled = dots.tiled(n_tok);
                    let limit = |i: usize| {
                        let (tok, r) = (i / n_rows, i % n_rows);
                        let row = &w[r * rb..(r + 1) * rb];
                        if tiled {
                            Some(gemm_bound(t, row, one[tok]))
                        } else {
                            super::tests::tail_bound(&kernel, row, one[tok], want[i])
                        }
                    };
                    for (i, (v, want)) in got.iter().zip(&want).enumerate() {
                        let (tok, r) = (i / n_rows, i % n_rows);
                        match limit(i) {
                            Some(b) => assert!(
                                (v - want).abs() <= b,
                                "{case}: token {tok} row {r}: {v} {want}"
                            ),
                            None => assert_eq!(
                                v.to_bits(),
                                want.to_bits(),
                                "{case}: token {tok} row {r}"
                            ),
                        }
                    }
                    for (i, v) in sum.iter().enumerate() {
                        let (tok, r) = (i / n_rows, i % n_rows);
                        let next = (tok + 1) % n_tok * n_rows + r;
                        let want_sum = want[i] + want[next];
                        if let (Some(a), Some(b)) = (limit(i), limit(next)) {
                            let err = (v - want_sum).abs();
                            let b = a + b + v.abs() * f32::EPSILON / 2.0;
                            assert!(err <= b, "{case}, 2 passes: {tok} {r}: {v} {want_sum}");
                        } else {
                            let (v, w) = (v.to_bits(), want_sum.to_bits());
                            assert_eq!(v, w, "{case}, 2 passes: {tok} {r}");
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

    /// The types with group kernels at the AVX2 level.
    const AVX2_TYPES: [GgmlType; 9] = [
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::IQ4_NL,
        GgmlType::MXFP4,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
    ];

    /// The tests above compare the group kernels only where they run: say where that is.
    #[test]
    fn group_kernels_run_at_their_levels() {
        let types = super::tests::GROUP_TYPES
            .into_iter()
            .chain([GgmlType::TQ2_0]);
        for (t, level) in types.flat_map(|t| super::tests::levels().map(move |l| (t, l))) {
            let dots = RowDots::with_isa(VecDot::new(t, 256).unwrap(), level);
            let fast = match level {
                CpuIsa::Generic => false,
                CpuIsa::Avx2 => AVX2_TYPES.contains(&t),
                CpuIsa::Avx512 => t != GgmlType::TQ2_0,
            };
            assert_eq!(dots.group.is_some(), fast, "{t} {level:?}");
        }
    }

    /// The tile tests check the bound only where the tiles run, bit-identity elsewhere: say
    /// which types take them (at 64 tokens, past every type's threshold: every type with AVX2
    /// group kernels but IQ4_XS) and that one token never does.
    #[test]
    fn tiles_run_for_their_types_at_the_avx2_level() {
        for (t, level) in super::tests::GROUP_TYPES
            .into_iter()
            .flat_map(|t| super::tests::levels().map(move |l| (t, l)))
        {
            let dots = RowDots::with_isa(VecDot::new(t, 256).unwrap(), level);
            let want = level == CpuIsa::Avx2 && AVX2_TYPES.contains(&t) && t != GgmlType::IQ4_XS;
            assert_eq!(dots.tiled(64), want, "{t} {level:?}");
            assert!(!dots.tiled(1), "{t} {level:?}");
        }
    }
}
