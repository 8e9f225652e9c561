//! The quantized product y[T, N] = x[T, K] . W^T for W in any type with a CPU dot product.

use crate::acts::ActCodec;
use crate::kernels::{RowDots, PACKED_ROWS};
use crate::packed::dots_over;
use crate::pool::ThreadPool;
use freetoken_ggml::{Error, GgmlType, Result, VecDot};

/// A shared output pointer: tasks write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);

impl OutPtr {
    /// The pointer; a method, so closures capture the Sync wrapper, not the raw field.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
// SAFETY: every task writes a disjoint set of indices, and `run` joins before the borrow ends.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Tasks per thread: enough that a thread slowed by other work delays the product by a small
/// part of it.
const TASKS_PER_THREAD: usize = 4;

/// Weight rows per task: as many as give each thread `TASKS_PER_THREAD` tasks, and no fewer,
/// since a task is one contiguous stream of rows and short ones read memory slowly (the
/// 151936 x 2048 Q8_0 output head of README.md's MoE model: 37 GB/s on two threads in tasks
/// of 64 rows, 44 in tasks of a quarter of each thread's share). A multiple of
/// `PACKED_ROWS`, so that tasks over packed rows start at a group.
fn rows_per_task(n: usize, threads: usize) -> usize {
    n.div_ceil(threads * TASKS_PER_THREAD)
        .next_multiple_of(PACKED_ROWS)
        .max(PACKED_ROWS)
}

/// A borrowed quantized weight matrix of `n` rows by `k` columns: the type's rows, or a
/// [`crate::PackedRows`] matrix of them.
#[derive(Clone, Copy)]
pub struct QuantWeight<'a> {
    data: &'a [u8],
    n: usize,
    kernel: VecDot,
}

impl<'a> QuantWeight<'a> {
    /// Checks that `data` holds exactly `n` rows of `k` elements of `t` and that `t` has a dot
    /// product.
    pub fn new(data: &'a [u8], t: GgmlType, n: usize, k: usize) -> Result<QuantWeight<'a>> {
        let kernel = VecDot::new(t, k)?;
        let want = t.matrix_size(n, k)?;
        if data.len() != want {
            return Err(Error::Shape(format!(
                "{n} x {k} {t} weights need {want} bytes, got {}",
                data.len()
            )));
        }
        Ok(QuantWeight { data, n, kernel })
    }

    /// Rows (output features).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Columns (input features).
    pub fn k(&self) -> usize {
        self.kernel.k()
    }

    /// The dot-product kernel of this weight.
    pub fn kernel(&self) -> &VecDot {
        &self.kernel
    }

    /// Row `r`'s bytes (of a packed matrix: its bytes at that row's place).
    pub fn row(&self, r: usize) -> &'a [u8] {
        let b = self.kernel.weight_row_bytes();
        &self.data[r * b..(r + 1) * b]
    }

    /// y[T, N] = x[T, K] . W^T. Each activation row is quantized once; the rows of W are
    /// split across the pool, each row read once for all T tokens.
    pub fn matmul(&self, pool: &ThreadPool, x: &[f32], y: &mut [f32]) -> Result<()> {
        matmul_group(pool, std::slice::from_ref(self), x, &mut [y])
    }
}

/// `ys[i] = x . ws[i]^T` for weights sharing the input (Q, K and V; gate and up): the input is
/// quantized once per distinct activation type and all the weights' rows go to the pool as
/// one job, so a group costs one dispatch instead of one per weight.
pub fn matmul_group(
    pool: &ThreadPool,
    ws: &[QuantWeight<'_>],
    x: &[f32],
    ys: &mut [&mut [f32]],
) -> Result<()> {
    let Some(first) = ws.first() else {
        return Ok(());
    };
    let k = first.k();
    if ys.len() != ws.len() || ws.iter().any(|w| w.k() != k) {
        return Err(Error::Shape(format!(
            "{} weights, {} outputs, row lengths {:?}: a group shares one input",
            ws.len(),
            ys.len(),
            ws.iter().map(QuantWeight::k).collect::<Vec<_>>()
        )));
    }
    if !x.len().is_multiple_of(k) {
        return Err(Error::Shape(format!(
            "input of {} values is not a whole number of rows of {k}",
            x.len()
        )));
    }
    let t = x.len() / k;
    if let Some((w, y)) = ws.iter().zip(ys.iter()).find(|(w, y)| y.len() != t * w.n) {
        return Err(Error::Shape(format!(
            "output has {} values, expected {t} x {}",
            y.len(),
            w.n
        )));
    }
    // One quantized copy of x per activation type, shared by the weights that use it.
    let mut acts: Vec<(GgmlType, Vec<u8>)> = Vec::new();
    for w in ws {
        let at = w.kernel.act_type();
        if !acts.iter().any(|(t, _)| *t == at) {
            acts.push((at, quantize_rows(pool, &w.kernel, x)?));
        }
    }
    let act_of: Vec<&[u8]> = ws
        .iter()
        .map(|w| {
            let at = w.kernel.act_type();
            acts.iter()
                .find(|(t, _)| *t == at)
                .expect("quantized above")
                .1
                .as_slice()
        })
        .collect();
    let total: usize = ws.iter().map(|w| w.n).sum();
    let per = rows_per_task(total, pool.n_threads());
    // (weight, first row) per task.
    let tasks: Vec<(usize, usize)> = ws
        .iter()
        .enumerate()
        .flat_map(|(i, w)| (0..w.n).step_by(per).map(move |r| (i, r)))
        .collect();
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
    let dots = ws
        .iter()
        .map(|w| Ok(dots_over(RowDots::new(w.kernel)?, w.data)))
        .collect::<Result<Vec<_>>>()?;
    let act_rows: Vec<Vec<&[u8]>> = ws
        .iter()
        .zip(&act_of)
        .map(|(w, a)| a.chunks_exact(w.kernel.act_row_bytes()).collect())
        .collect();
    pool.run(tasks.len(), &|task| {
        let (i, r0) = tasks[task];
        let (w, acts, out) = (&ws[i], &act_rows[i], outs[i]);
        let rb = w.kernel.weight_row_bytes();
        let rows = r0..(r0 + per).min(w.n);
        if t == 1 {
            // One token reads each row once: no pass needs to stay in the L1 cache, so the
            // task's rows go in one call, straight into the output.
            // SAFETY: rows < n index inside ys[i] (n values, checked above), and these rows
            // of weight i belong to this task alone.
            let y =
                unsafe { std::slice::from_raw_parts_mut(out.get().add(rows.start), rows.len()) };
            dots[i].dots(&w.data[rows.start * rb..rows.end * rb], acts, y);
            return;
        }
        let pass_rows = dots[i].pass_rows(t);
        let mut v = vec![0f32; t * pass_rows];
        // A pass's rows stay in the L1 cache while every token reads them.
        for p0 in rows.clone().step_by(pass_rows) {
            let pass = p0..(p0 + pass_rows).min(rows.end);
            let v = &mut v[..t * pass.len()];
            dots[i].dots(&w.data[pass.start * rb..pass.end * rb], acts, v);
            for (tok, v) in v.chunks_exact(pass.len()).enumerate() {
                // SAFETY: tok < T and pass < n index inside ys[i] (T * n values, checked
                // above), and these rows of weight i belong to this task alone.
                let y = unsafe {
                    std::slice::from_raw_parts_mut(out.get().add(tok * w.n + pass.start), v.len())
                };
                y.copy_from_slice(v);
            }
        }
    });
    Ok(())
}

/// Quantizes each row of `x` (a whole number of rows of `kernel.k()`) to the kernel's
/// activation type, rows in parallel.
pub fn quantize_rows(pool: &ThreadPool, kernel: &VecDot, x: &[f32]) -> Result<Vec<u8>> {
    quantize_rows_with(pool, &ActCodec::new(*kernel, false), x)
}

/// As `quantize_rows`, each row as `codec` quantizes it (`codec.row_bytes()` per row).
pub(crate) fn quantize_rows_with(
    pool: &ThreadPool,
    codec: &ActCodec,
    x: &[f32],
) -> Result<Vec<u8>> {
    let k = codec.k();
    if !x.len().is_multiple_of(k) {
        return Err(Error::Shape(format!(
            "input of {} values is not a whole number of rows of {k}",
            x.len()
        )));
    }
    let t = x.len() / k;
    let ab = codec.row_bytes();
    let mut acts = vec![0u8; t * ab];
    let out = OutPtr(acts.as_mut_ptr().cast());
    pool.run(t, &|tok| {
        // SAFETY: row tok of acts is [tok * ab, (tok + 1) * ab), inside the buffer and written
        // by this task alone.
        let dst =
            unsafe { std::slice::from_raw_parts_mut(out.get().cast::<u8>().add(tok * ab), ab) };
        codec
            .quantize(&x[tok * k..(tok + 1) * k], dst)
            .expect("row sizes checked above");
    });
    Ok(acts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(w: &[f32], x: &[f32], n: usize, k: usize) -> Vec<f64> {
        let t = x.len() / k;
        let mut y = vec![0f64; t * n];
        for tok in 0..t {
            for r in 0..n {
                y[tok * n + r] = (0..k)
                    .map(|i| w[r * k + i] as f64 * x[tok * k + i] as f64)
                    .sum();
            }
        }
        y
    }

    #[test]
    fn q8_0_matches_float64_product_of_dequantized_weights() {
        let (n, k, t) = (37, 256, 5);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 113) as f32 / 56.0 - 1.0)
            .collect();
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 104729) % 97) as f32 / 48.0 - 1.0)
            .collect();
        let q = freetoken_ggml::quantize(GgmlType::Q8_0, &w, k, None).unwrap();
        let mut wd = vec![0f32; n * k];
        freetoken_ggml::dequantize(GgmlType::Q8_0, &q, &mut wd).unwrap();
        let pool = ThreadPool::new(3);
        let mut y = vec![0f32; t * n];
        QuantWeight::new(&q, GgmlType::Q8_0, n, k)
            .unwrap()
            .matmul(&pool, &x, &mut y)
            .unwrap();
        let r = reference(&wd, &x, n, k);
        let err: f64 = y.iter().zip(&r).map(|(a, b)| (*a as f64 - b).powi(2)).sum();
        let norm: f64 = r.iter().map(|b| b * b).sum();
        assert!((err / norm).sqrt() < 1e-2);
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let q = vec![0u8; 34];
        assert!(QuantWeight::new(&q, GgmlType::Q8_0, 2, 32).is_err());
        assert!(QuantWeight::new(&q, GgmlType::Q8_0, 1, 33).is_err());
        let w = QuantWeight::new(&q, GgmlType::Q8_0, 1, 32).unwrap();
        let pool = ThreadPool::new(1);
        assert!(w.matmul(&pool, &[0.0; 31], &mut [0.0; 1]).is_err());
        assert!(w.matmul(&pool, &[0.0; 32], &mut [0.0; 2]).is_err());
    }
}
