//! Activation rows as the dot products take them: quantized to the weight type's activation
//! type once, as ggml does (the default, so results match llama.cpp's), or twice (`residual`):
//! the row, then what its rounding left out, each product being the sum of the two passes'
//! dot products (the kernels are linear in the activation). The second pass rounds a value
//! 1/254 the size of the first's step, so the activations' share of the error against float
//! math falls from 1-3% (q8_K's one scale per 256 values) to about 0.01%, for a second dot
//! product per row while the rows are in cache (benches/README.md).

use freetoken_ggml::{dequantize, dequantize_act, quantize, Error, GgmlType, Result, VecDot};

/// How one weight type's activation rows are quantized.
#[derive(Clone, Copy)]
pub(crate) struct ActCodec {
    kernel: VecDot,
    passes: usize,
}

impl ActCodec {
    /// Two passes when `residual` and the activation type rounds at all (not F32).
    pub(crate) fn new(kernel: VecDot, residual: bool) -> ActCodec {
        let passes = if residual && kernel.act_type() != GgmlType::F32 {
            2
        } else {
            1
        };
        ActCodec { kernel, passes }
    }

    /// Values in a row.
    pub(crate) fn k(&self) -> usize {
        self.kernel.k()
    }

    /// Bytes of one quantized row: every pass's, one after the other.
    pub(crate) fn row_bytes(&self) -> usize {
        self.passes * self.kernel.act_row_bytes()
    }

    /// The same activation type and passes: one quantized row serves both kernels.
    pub(crate) fn shares_rows_with(&self, other: &ActCodec) -> bool {
        self.kernel.act_type() == other.kernel.act_type() && self.passes == other.passes
    }

    /// Quantizes `x` (`k` values) into `dst` (`row_bytes()`).
    pub(crate) fn quantize(&self, x: &[f32], dst: &mut [u8]) -> Result<()> {
        if dst.len() != self.row_bytes() {
            return Err(Error::Shape(format!(
                "activation buffer of {} bytes, expected {}",
                dst.len(),
                self.row_bytes()
            )));
        }
        let (first, rest) = dst.split_at_mut(self.kernel.act_row_bytes());
        self.kernel.quantize_act(x, first)?;
        if self.passes == 2 {
            let mut r = vec![0f32; x.len()];
            dequantize_act(self.kernel.act_type(), first, &mut r)?;
            for (r, &v) in r.iter_mut().zip(x) {
                *r = v - *r;
            }
            self.kernel.quantize_act(&r, rest)?;
            if self.kernel.act_type() == GgmlType::Q8_1 {
                carry_q8_1_sums(x, first, rest)?;
            }
        }
        Ok(())
    }
}

/// The largest finite fp16.
const F16_MAX: f32 = 65504.0;

/// Bytes 2-3 of a Q8_1 block: its fp16 sum, d * sum(q).
const Q8_1_SUM: std::ops::Range<usize> = 2..4;

/// Q4_1 and Q5_1 multiply each Q8_1 block's stored sum by the block's minimum. The first
/// pass's sum is rounded to fp16, an error the residual pass does not see; so the residual
/// pass's sum is set to what makes the two add up to the block's exact sum.
fn carry_q8_1_sums(x: &[f32], first: &[u8], rest: &mut [u8]) -> Result<()> {
    let (bs, n) = (GgmlType::Q8_1.type_size(), GgmlType::Q8_1.block_size());
    let stored: Vec<u8> = first
        .chunks_exact(bs)
        .flat_map(|b| b[Q8_1_SUM].to_vec())
        .collect();
    let mut sums = vec![0f32; stored.len() / 2];
    dequantize(GgmlType::F16, &stored, &mut sums)?;
    for (s, xs) in sums.iter_mut().zip(x.chunks_exact(n)) {
        *s = xs.iter().sum::<f32>() - *s;
    }
    if sums.iter().any(|s| !s.is_finite() || s.abs() > F16_MAX) {
        // Activations beyond fp16's range (or not finite): the first pass's sums are
        // already infinite and the output cannot be right; keep the residual's own sums
        // rather than fail the call.
        return Ok(());
    }
    let fp16 = quantize(GgmlType::F16, &sums, sums.len(), None)?;
    for (b, s) in rest.chunks_exact_mut(bs).zip(fp16.chunks_exact(2)) {
        b[Q8_1_SUM].copy_from_slice(s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every activation type's two passes dequantize to within a small fraction of the first
    /// pass's error, Q8_1's sums add up to the block sums, and values beyond fp16's range
    /// (a diverging model) still quantize.
    #[test]
    fn two_passes_carry_the_residual() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.037)
            .collect();
        for weight in [
            GgmlType::Q4_K,
            GgmlType::Q4_1,
            GgmlType::Q4_0,
            GgmlType::F16,
        ] {
            let kernel = VecDot::new(weight, x.len()).unwrap();
            let (one, two) = (ActCodec::new(kernel, false), ActCodec::new(kernel, true));
            assert_eq!(two.row_bytes(), 2 * one.row_bytes());
            let mut q = vec![0u8; two.row_bytes()];
            two.quantize(&x, &mut q).unwrap();
            let ab = one.row_bytes();
            let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            dequantize_act(kernel.act_type(), &q[..ab], &mut a).unwrap();
            dequantize_act(kernel.act_type(), &q[ab..], &mut b).unwrap();
            let err = |v: &dyn Fn(usize) -> f32| {
                (0..x.len())
                    .map(|i| (x[i] - v(i)).abs())
                    .fold(0f32, f32::max)
            };
            let (e1, e2) = (err(&|i| a[i]), err(&|i| a[i] + b[i]));
            assert!(e2 <= e1 / 50.0, "{weight}: {e1} -> {e2}");
            if kernel.act_type() == GgmlType::Q8_1 {
                let sum_of = |row: &[u8]| {
                    let bytes: Vec<u8> = row
                        .chunks_exact(36)
                        .flat_map(|b| b[2..4].to_vec())
                        .collect();
                    let mut v = vec![0f32; bytes.len() / 2];
                    dequantize(GgmlType::F16, &bytes, &mut v).unwrap();
                    v
                };
                let (s1, s2) = (sum_of(&q[..ab]), sum_of(&q[ab..]));
                for (i, xs) in x.chunks_exact(32).enumerate() {
                    let exact: f32 = xs.iter().sum();
                    assert!((s1[i] + s2[i] - exact).abs() <= 1e-4 * exact.abs().max(1.0));
                }
            }
            assert!(two.quantize(&x, &mut q[1..]).is_err());
            let mut big = x.clone();
            big[3] = 1e30;
            two.quantize(&big, &mut q).unwrap();
        }
    }
}
