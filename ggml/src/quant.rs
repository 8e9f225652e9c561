//! Dequantize, quantize, activation quantization and dot products over ggml's CPU kernels.
//! Every function checks lengths before it hands a pointer to C.

use crate::error::{Error, Result};
use crate::ffi;
use crate::types::GgmlType;
use std::os::raw::c_void;

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::Shape(format!(
            "{what} has {got} bytes, expected {want}"
        )));
    }
    Ok(())
}

/// Decodes `src` (whole blocks of `t`) into `dst`; `src` must hold exactly `dst.len()` elements.
pub fn dequantize(t: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    if !t.is_storage() {
        return Err(Error::Unsupported(format!(
            "{t} is an activation type and cannot be dequantized"
        )));
    }
    check_len(&format!("{t} data"), src.len(), t.row_size(dst.len())?)?;
    match t {
        GgmlType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        _ => {
            let to_float = t_to_float(t)?;
            // SAFETY: src holds exactly dst.len() elements of t, checked above.
            unsafe { to_float(src.as_ptr().cast(), dst.as_mut_ptr(), dst.len() as i64) };
        }
    }
    Ok(())
}

/// Decodes activation rows (whole blocks of `t`, a `VecDot`'s activation type) into `dst`.
/// ggml has no `to_float` for Q8_1 and Q8_K; each of their blocks is a scale and signed bytes
/// (Q8_1: fp16 scale, fp16 sum, 32 values; Q8_K: f32 scale, 256 values, 16 int16 sums), so
/// those are decoded here. Other types go through [`dequantize`].
pub fn dequantize_act(t: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let n = t.block_size();
    let scale = match t {
        GgmlType::Q8_1 => |b: &[u8]| {
            let mut d = [0f32];
            dequantize(GgmlType::F16, &b[..2], &mut d).map(|_| d[0])
        },
        GgmlType::Q8_K => |b: &[u8]| Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        _ => return dequantize(t, src, dst),
    };
    check_len(&format!("{t} data"), src.len(), t.row_size(dst.len())?)?;
    for (b, out) in src.chunks_exact(t.type_size()).zip(dst.chunks_exact_mut(n)) {
        let d = scale(b)?;
        for (o, &q) in out.iter_mut().zip(&b[4..4 + n]) {
            *o = d * f32::from(q as i8);
        }
    }
    Ok(())
}

fn t_to_float(t: GgmlType) -> Result<ffi::ToFloat> {
    // SAFETY: a static table entry.
    let traits = unsafe { &*ffi::ggml_get_type_traits(t as i32) };
    traits
        .to_float
        .ok_or_else(|| Error::Unsupported(format!("ggml has no dequantization for {t}")))
}

/// Importance weights beyond this overflow ggml's IQ searches (which then abort).
const MAX_IMPORTANCE: f32 = 1e10;

/// The largest magnitude `t` can represent: block scales of the quantized types are f16
/// (NVFP4's e4m3 times fp4), and ggml's IQ grid searches abort on values far beyond that.
fn max_magnitude(t: GgmlType) -> f32 {
    match t {
        GgmlType::F32 | GgmlType::BF16 => f32::MAX,
        GgmlType::NVFP4 => 448.0 * 6.0,
        _ => 65504.0,
    }
}

/// Quantizes `src`, rows of `n_per_row` floats, to `t`. `imatrix` (one weight per column) is
/// used by the types that take one and ignored by the rest; types that require one fail
/// without it. NaN or infinite input is an error.
pub fn quantize(
    t: GgmlType,
    src: &[f32],
    n_per_row: usize,
    imatrix: Option<&[f32]>,
) -> Result<Vec<u8>> {
    if !t.is_storage() {
        return Err(Error::Unsupported(format!(
            "{t} is an activation type; quantize activations with VecDot::quantize_act"
        )));
    }
    if n_per_row == 0 || !src.len().is_multiple_of(n_per_row) {
        return Err(Error::Shape(format!(
            "{} values do not form rows of {n_per_row}",
            src.len()
        )));
    }
    let nrows = src.len() / n_per_row;
    let size = t.matrix_size(nrows, n_per_row)?;
    if let Some(i) = src.iter().position(|v| !v.is_finite()) {
        return Err(Error::InvalidInput(format!(
            "cannot quantize non-finite value {} at index {i}",
            src[i]
        )));
    }
    let limit = max_magnitude(t);
    if let Some(i) = src.iter().position(|v| v.abs() > limit) {
        return Err(Error::InvalidInput(format!(
            "cannot quantize {} at index {i} to {t}: magnitudes above {limit:e} do not fit \
             its scales",
            src[i]
        )));
    }
    if let Some(im) = imatrix {
        if im.len() != n_per_row {
            return Err(Error::Shape(format!(
                "importance matrix has {} values, expected one per column ({n_per_row})",
                im.len()
            )));
        }
        if im
            .iter()
            .any(|v| !v.is_finite() || *v < 0.0 || *v > MAX_IMPORTANCE)
        {
            return Err(Error::InvalidInput(format!(
                "importance matrix values must be finite and non-negative, at most \
                 {MAX_IMPORTANCE:e}"
            )));
        }
    } else if t.requires_imatrix() {
        return Err(Error::InvalidInput(format!(
            "quantizing to {t} requires an importance matrix"
        )));
    }
    let mut dst = vec![0u8; size];
    let im_ptr = imatrix.map_or(std::ptr::null(), |m| m.as_ptr());
    crate::init();
    // SAFETY: src is nrows * n_per_row finite floats, dst holds exactly nrows rows of t,
    // n_per_row is a whole number of blocks (matrix_size checked it), imatrix has n_per_row
    // values or is null for a type that accepts null.
    let written = unsafe {
        ffi::ggml_quantize_chunk(
            t as i32,
            src.as_ptr(),
            dst.as_mut_ptr().cast::<c_void>(),
            0,
            nrows as i64,
            n_per_row as i64,
            im_ptr,
        )
    };
    debug_assert_eq!(written, size);
    Ok(dst)
}

/// A dot product between rows of a weight type and activations of its vec_dot type, for a
/// fixed row length: sizes are resolved once, so the per-row call only compares lengths.
#[derive(Clone, Copy)]
pub struct VecDot {
    weight: GgmlType,
    act: GgmlType,
    k: usize,
    weight_row: usize,
    act_row: usize,
    from_float: ffi::FromFloat,
    dot: ffi::VecDot,
}

impl VecDot {
    /// The kernel for rows of `k` elements of `weight`.
    pub fn new(weight: GgmlType, k: usize) -> Result<VecDot> {
        let cpu = weight.cpu_traits();
        let dot = match (weight.is_storage(), cpu.vec_dot) {
            (true, Some(d)) => d,
            _ => {
                return Err(Error::Unsupported(format!(
                    "ggml-cpu has no dot product for {weight}"
                )))
            }
        };
        let act = weight.vec_dot_type();
        let from_float = act.cpu_traits().from_float.ok_or_else(|| {
            Error::Unsupported(format!("ggml-cpu cannot quantize activations to {act}"))
        })?;
        // ggml's dot products take the length as a C int.
        if k == 0 || i32::try_from(k).is_err() {
            return Err(Error::Shape(format!("row length {k} is out of range")));
        }
        Ok(VecDot {
            weight,
            act,
            k,
            weight_row: weight.row_size(k)?,
            act_row: act.row_size(k)?,
            from_float,
            dot,
        })
    }

    /// The weight type.
    pub fn weight_type(&self) -> GgmlType {
        self.weight
    }

    /// The activation (vec_dot) type.
    pub fn act_type(&self) -> GgmlType {
        self.act
    }

    /// Row length in elements.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes of one weight row.
    pub fn weight_row_bytes(&self) -> usize {
        self.weight_row
    }

    /// Bytes of one quantized activation row.
    pub fn act_row_bytes(&self) -> usize {
        self.act_row
    }

    /// Quantizes one activation row of `k` floats into `dst` (`act_row_bytes()` long).
    pub fn quantize_act(&self, x: &[f32], dst: &mut [u8]) -> Result<()> {
        if x.len() != self.k {
            return Err(Error::Shape(format!(
                "activation has {} values, expected {}",
                x.len(),
                self.k
            )));
        }
        check_len("activation buffer", dst.len(), self.act_row)?;
        // SAFETY: x has k floats, dst has exactly the row size of k elements of the act type.
        unsafe { (self.from_float)(x.as_ptr(), dst.as_mut_ptr().cast(), self.k as i64) };
        Ok(())
    }

    /// The dot product of one weight row and one quantized activation row.
    #[inline]
    pub fn dot(&self, w: &[u8], a: &[u8]) -> Result<f32> {
        if w.len() != self.weight_row || a.len() != self.act_row {
            return Err(Error::Shape(format!(
                "dot of {} weight bytes and {} activation bytes, expected {} and {}",
                w.len(),
                a.len(),
                self.weight_row,
                self.act_row
            )));
        }
        let mut s = 0.0f32;
        // SAFETY: both rows have exactly the sizes of k elements of their types; nrc = 1.
        unsafe {
            (self.dot)(
                self.k as i32,
                &mut s,
                0,
                w.as_ptr().cast(),
                0,
                a.as_ptr().cast(),
                0,
                1,
            )
        };
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each decoded activation lies within half a quantization step of the value it encodes,
    /// the step being the block's largest magnitude over 127.
    #[test]
    fn dequantize_act_inverts_the_activation_types() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 * (1.0 + (i % 7) as f32))
            .collect();
        for (weight, block) in [
            (GgmlType::Q4_K, 256),
            (GgmlType::Q4_1, 32),
            (GgmlType::Q4_0, 32),
        ] {
            let k = VecDot::new(weight, x.len()).unwrap();
            let mut q = vec![0u8; k.act_row_bytes()];
            k.quantize_act(&x, &mut q).unwrap();
            let mut back = vec![0f32; x.len()];
            dequantize_act(k.act_type(), &q, &mut back).unwrap();
            for (xs, bs) in x.chunks(block).zip(back.chunks(block)) {
                let step = xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                for (a, b) in xs.iter().zip(bs) {
                    assert!((a - b).abs() <= 0.5 * step * 1.01, "{weight}: {a} -> {b}");
                }
            }
            assert!(dequantize_act(k.act_type(), &q[1..], &mut back).is_err());
        }
    }
}
