//! Weight matrices packed once, at load time, into the layout the CPU kernels in use read
//! fastest (AVX2: eight rows interleaved per block, `kernels/avx2_repack.rs`), for engines
//! whose products all run on the CPU.
//!
//! A packed matrix has the original's size and shape, so it stands wherever the original's
//! bytes would: [`crate::QuantWeight::new`] and [`crate::ExpertMats::experts`] take its
//! [`PackedRows::matrix`] slices, and the products recognize them through a registry of
//! the live packed buffers (each buffer is entered when packed and removed when dropped),
//! so callers keep their types. Engines that hand experts to a GPU keep the mapped
//! originals: the GPU reads those bytes.

use crate::kernels::{RowDots, PACKED_ROWS};
use crate::pool::ThreadPool;
use freetoken_ggml::{Error, GgmlType, Result, VecDot};
use memmap2::{Advice, MmapMut};
use std::sync::{Mutex, RwLock};

/// Where packed buffers live: (first byte's address, bytes, bytes per matrix), by address.
static LIVE: RwLock<Vec<(usize, usize, usize)>> = RwLock::new(Vec::new());

/// Whether `bytes` is one whole matrix of a live packed buffer.
fn is_packed(bytes: &[u8]) -> bool {
    let at = bytes.as_ptr() as usize;
    let live = LIVE.read().unwrap_or_else(|e| e.into_inner());
    let i = live.partition_point(|&(start, _, _)| start <= at);
    i > 0 && {
        let (start, len, matrix) = live[i - 1];
        bytes.len() == matrix && at + matrix <= start + len && (at - start).is_multiple_of(matrix)
    }
}

/// `dots` over `matrix`'s rows: packed ones if `matrix` is a packed buffer's (packed for the
/// same kernels: the level in use is the process's).
pub(crate) fn dots_over(dots: RowDots, matrix: &[u8]) -> RowDots {
    if is_packed(matrix) {
        dots.packed()
    } else {
        dots
    }
}

/// Matrices of one type and shape, each packed for the kernels in use, in anonymous memory
/// (page-aligned) that the kernel may back with 2 MiB pages: the products stream these
/// bytes every step, and huge pages spare them the TLB misses of 4 KiB ones (the same
/// reason as `--no-mmap`'s copy).
pub struct PackedRows {
    map: MmapMut,
    len: usize,
    matrix: usize,
}

impl PackedRows {
    /// `data`'s matrices (each `n` rows of `k` values of `t`, back to back) packed, on `pool`,
    /// where the kernels of the level in use have a packed layout for `t` (AVX2, not
    /// AVX-512: Q4_0, Q8_0 and Q4_K); None where they do not.
    pub fn new(
        pool: &ThreadPool,
        data: &[u8],
        t: GgmlType,
        n: usize,
        k: usize,
    ) -> Result<Option<PackedRows>> {
        Self::new_then(pool, data, t, n, k, &|_| {})
    }

    /// As [`PackedRows::new`], calling `packed(src)` with each run of `data` once it is
    /// copied (from the pool's threads), so that a caller can let the source go piece by
    /// piece (dropping mapped pages) instead of holding both copies whole.
    pub fn new_then(
        pool: &ThreadPool,
        data: &[u8],
        t: GgmlType,
        n: usize,
        k: usize,
        packed: &(dyn Fn(&[u8]) + Sync),
    ) -> Result<Option<PackedRows>> {
        let dots = RowDots::new(VecDot::new(t, k)?)?;
        if !dots.packs() {
            return Ok(None);
        }
        let matrix = t.matrix_size(n, k)?;
        if matrix == 0 || !data.len().is_multiple_of(matrix) {
            return Err(Error::Shape(format!(
                "{} bytes are not whole {n} x {k} {t} matrices",
                data.len()
            )));
        }
        let mut map = MmapMut::map_anon(data.len().max(1))
            .map_err(|e| Error::OutOfMemory(format!("cannot allocate packed rows: {e}")))?;
        // Advice only: without transparent huge pages the buffer still works.
        let _ = map.advise(Advice::HugePage);
        let bytes = &mut map[..data.len()];
        // Tasks of whole groups of one matrix, a matrix's tail in its last task.
        let rb = t.row_size(k)?;
        let per = (PACKED_ROWS * rb * 64).min(matrix);
        let tasks: Vec<Mutex<(&[u8], &mut [u8])>> = data
            .chunks_exact(matrix)
            .zip(bytes.chunks_exact_mut(matrix))
            .flat_map(|(src, dst)| src.chunks(per).zip(dst.chunks_mut(per)))
            .map(Mutex::new)
            .collect();
        pool.run(tasks.len(), &|i| {
            let mut task = tasks[i].lock().unwrap_or_else(|e| e.into_inner());
            let (src, dst) = &mut *task;
            dots.pack(src, dst);
            packed(src);
        });
        drop(tasks);
        let packed = PackedRows {
            map,
            len: data.len(),
            matrix,
        };
        let entry = (packed.bytes().as_ptr() as usize, packed.len, matrix);
        if packed.len > 0 {
            let mut live = LIVE.write().unwrap_or_else(|e| e.into_inner());
            let i = live.partition_point(|&(start, _, _)| start < entry.0);
            live.insert(i, entry);
        }
        Ok(Some(packed))
    }

    /// Every matrix's bytes, back to back.
    pub fn bytes(&self) -> &[u8] {
        &self.map[..self.len]
    }

    /// Matrix `i`'s bytes: what the products take in place of the original's.
    pub fn matrix(&self, i: usize) -> &[u8] {
        &self.bytes()[i * self.matrix..(i + 1) * self.matrix]
    }

    /// Matrices held.
    pub fn matrices(&self) -> usize {
        self.len / self.matrix
    }
}

impl Drop for PackedRows {
    fn drop(&mut self) {
        let at = self.bytes().as_ptr() as usize;
        let mut live = LIVE.write().unwrap_or_else(|e| e.into_inner());
        live.retain(|&(start, _, _)| start != at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{moe_forward, Activation, ExpertMats, MoeWeights, QuantWeight};
    use freetoken_ggml::quantize;

    fn floats(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104729) % 211) as f32 / 105.0 - 1.0)
            .collect()
    }

    fn split(data: &[u8], e: usize) -> Vec<&[u8]> {
        data.chunks_exact(data.len() / e).collect()
    }

    /// A SiLU layer of `e` experts: gate and up of `[tg, td][0]`, down of `[1]`.
    fn layer<'a>(
        [tg, td]: [GgmlType; 2],
        hidden: usize,
        ffn: usize,
        e: usize,
        [g, u, d]: [&'a [u8]; 3],
    ) -> MoeWeights<'a> {
        let mats = |ty, n, k, data| ExpertMats {
            ty,
            n,
            k,
            experts: split(data, e),
            bias: None,
        };
        MoeWeights {
            n_experts: e,
            gate: mats(tg, ffn, hidden, g),
            up: mats(tg, ffn, hidden, u),
            down: mats(td, hidden, ffn, d),
            act: Activation::Silu,
        }
    }

    /// Relative distance of `a` from `b` per `k`-value run (token), at most.
    fn worst(a: &[f32], b: &[f32], k: usize) -> f64 {
        a.chunks(k)
            .zip(b.chunks(k))
            .map(|(a, b)| {
                let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
                let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
                (num / den).sqrt()
            })
            .fold(0.0, f64::max)
    }

    /// Packed matrices (where the level in use packs: run under `FREETOKEN_CPU_ISA=avx2`)
    /// give the dense product and the expert executor the originals' results within the
    /// packed kernels' bound (`kernels/avx2_repack.rs`: below 1e-6 of the terms at these
    /// sizes; checked here per token at 1e-5), with 1 to 3 threads and row counts that
    /// leave tails; only whole packed matrices count as packed, and none once dropped.
    #[test]
    fn packed_matrices_stand_for_the_originals() {
        // Expert rows are multiples of the blocks (32), so the dense product's matrices take
        // the tails (37 rows).
        let (e, hidden, ffn, rows) = (3, 96, 64, 37);
        let quant =
            |t, n: usize, k: usize, seed| quantize(t, &floats(e * n * k, seed), k, None).unwrap();
        let (tg, td) = (GgmlType::Q4_0, GgmlType::Q8_0);
        let (g, u, d) = (
            &quant(tg, ffn, hidden, 1)[..],
            &quant(tg, ffn, hidden, 2)[..],
            &quant(td, hidden, ffn, 3)[..],
        );
        let pool = ThreadPool::new(2);
        let pack = |data: &[u8], t, n, k| PackedRows::new(&pool, data, t, n, k).unwrap();
        // `new_then` hands back every byte of the source once, in runs.
        let runs = Mutex::new(Vec::new());
        let seen = |run: &[u8]| {
            let at = run.as_ptr() as usize - g.as_ptr() as usize;
            runs.lock().unwrap().push((at, run.len()));
        };
        let then = PackedRows::new_then(&pool, g, tg, ffn, hidden, &seen).unwrap();
        let mut runs = runs.into_inner().unwrap();
        runs.sort_unstable();
        let ends = runs.iter().fold(0, |end, &(at, len)| {
            assert_eq!(at, end, "runs {runs:?}");
            at + len
        });
        assert_eq!(ends, if then.is_some() { g.len() } else { 0 });
        drop(then);
        let Some(pg) = pack(g, tg, ffn, hidden) else {
            let dots = RowDots::new(VecDot::new(tg, hidden).unwrap()).unwrap();
            assert!(!dots.packs(), "packed kernels, no packed rows");
            return;
        };
        let (pu, pd) = (
            pack(u, tg, ffn, hidden).unwrap(),
            pack(d, td, hidden, ffn).unwrap(),
        );
        let dense = [tg, td].map(|t| quant(t, rows, hidden, 4));
        let packed_dense = [tg, td].map(|t| {
            let i = usize::from(t == td);
            pack(&dense[i], t, rows, hidden).unwrap()
        });
        assert_eq!((pg.matrices(), pd.matrix(1).len()), (e, d.len() / e));
        assert!(is_packed(pg.matrix(2)) && !is_packed(&pg.matrix(2)[1..]));
        assert!(!is_packed(&pg.bytes()[..pg.matrix(0).len() - 1]) && !is_packed(split(g, e)[0]));
        for (threads, tokens) in (1..=3).flat_map(|p| [1, 5, 33].map(|t| (p, t))) {
            let pool = ThreadPool::new(threads);
            let x = floats(tokens * hidden, tokens);
            let case = format!("{threads} threads, {tokens} tokens");
            for ((t, data), packed) in [tg, td].into_iter().zip(&dense).zip(&packed_dense) {
                for i in 0..e {
                    let mut y = [vec![0f32; tokens * rows], vec![0f32; tokens * rows]];
                    for (y, data) in y.iter_mut().zip([split(data, e)[i], packed.matrix(i)]) {
                        let w = QuantWeight::new(data, t, rows, hidden).unwrap();
                        w.matmul(&pool, &x, y).unwrap();
                    }
                    assert!(worst(&y[1], &y[0], rows) <= 1e-5, "{case}: {t} {i}");
                }
            }
            let ids: Vec<i32> = (0..tokens * 2)
                .map(|i| ((i * 5 + i / 2) % e) as i32)
                .collect();
            let wts = floats(tokens * 2, 9);
            let mut out = [vec![0f32; x.len()], vec![0f32; x.len()]];
            for (out, w) in out.iter_mut().zip([
                layer([tg, td], hidden, ffn, e, [g, u, d]),
                layer(
                    [tg, td],
                    hidden,
                    ffn,
                    e,
                    [pg.bytes(), pu.bytes(), pd.bytes()],
                ),
            ]) {
                moe_forward(&pool, &w, &x, &ids, &wts, out).unwrap();
            }
            assert!(worst(&out[1], &out[0], hidden) <= 1e-5, "{case}: experts");
        }
        let at = pg.matrix(0).as_ptr() as usize;
        drop(pg);
        let live = LIVE.read().unwrap();
        assert!(live.iter().all(|&(start, _, _)| start != at));
    }
}
