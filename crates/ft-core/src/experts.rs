//! The expert store: each MoE layer's expert weights as views into the mapped GGUF, no copy.
//! Layers of one file may differ in type (Unsloth "UD" files, `--tensor-type` files).

use crate::gguf::{GgufFile, TensorInfo};
use freetoken_ggml::{Error, GgmlType, Result};

/// One kind of expert matrix (gate, up or down) of one layer: `n_experts` matrices of
/// `rows x k` elements of `ty`, each a contiguous range of the mapping.
#[derive(Debug, Clone)]
pub struct ExpertTensor {
    pub ty: GgmlType,
    pub rows: usize,
    pub k: usize,
    parts: Vec<(usize, usize, usize)>, // (file, offset, bytes) per expert
}

impl ExpertTensor {
    /// From one stacked tensor `[n_experts, rows, k]` or from one `[rows, k]` tensor per
    /// expert (Mixtral's older per-expert layout); every expert must agree in type and shape.
    pub fn resolve(file: &GgufFile, names: &[String]) -> Result<ExpertTensor> {
        match names {
            [] => Err(Error::Shape("no expert tensors named".into())),
            [one] => {
                let t = file.tensor(one)?;
                let [e, rows, k] = t.shape[..] else {
                    return Err(Error::Gguf(format!(
                        "expert tensor `{one}` has shape {:?}, expected [experts, rows, k]",
                        t.shape
                    )));
                };
                let bytes = t.nbytes / e.max(1);
                let parts = (0..e)
                    .map(|i| (t.file, t.offset + i * bytes, bytes))
                    .collect();
                Ok(ExpertTensor {
                    ty: t.ggml_type,
                    rows,
                    k,
                    parts,
                })
            }
            many => {
                let infos: Vec<&TensorInfo> =
                    many.iter().map(|n| file.tensor(n)).collect::<Result<_>>()?;
                let first = infos[0];
                let [rows, k] = first.shape[..] else {
                    return Err(Error::Gguf(format!(
                        "expert tensor `{}` has shape {:?}, expected [rows, k]",
                        first.name, first.shape
                    )));
                };
                if let Some(bad) = infos
                    .iter()
                    .find(|t| t.shape != first.shape || t.ggml_type != first.ggml_type)
                {
                    return Err(Error::Gguf(format!(
                        "expert tensor `{}` ({:?} {}) differs from `{}` ({:?} {})",
                        bad.name,
                        bad.shape,
                        bad.ggml_type,
                        first.name,
                        first.shape,
                        first.ggml_type
                    )));
                }
                Ok(ExpertTensor {
                    ty: first.ggml_type,
                    rows,
                    k,
                    parts: infos.iter().map(|t| (t.file, t.offset, t.nbytes)).collect(),
                })
            }
        }
    }

    /// Splits a fused tensor (gate and up stacked along the rows) into `n` equal row ranges.
    pub fn split_rows(&self, n: usize) -> Result<Vec<ExpertTensor>> {
        if n == 0 || !self.rows.is_multiple_of(n) {
            return Err(Error::Shape(format!(
                "{} rows do not split in {n}",
                self.rows
            )));
        }
        let rows = self.rows / n;
        let bytes = self.ty.matrix_size(rows, self.k)?;
        Ok((0..n)
            .map(|i| ExpertTensor {
                ty: self.ty,
                rows,
                k: self.k,
                parts: self
                    .parts
                    .iter()
                    .map(|&(f, off, _)| (f, off + i * bytes, bytes))
                    .collect(),
            })
            .collect())
    }

    /// Experts in this tensor.
    pub fn n_experts(&self) -> usize {
        self.parts.len()
    }

    /// Bytes of one expert's matrix.
    pub fn expert_bytes(&self) -> usize {
        self.parts.first().map_or(0, |p| p.2)
    }

    /// Every expert's bytes as one run of `file` when they lie back to back in one part (a
    /// stacked tensor), expert order; None otherwise (per-expert tensors, fused halves).
    pub fn stacked<'a>(&self, file: &'a GgufFile) -> Option<&'a [u8]> {
        let &(f, first, _) = self.parts.first()?;
        let mut end = first;
        for &(pf, off, len) in &self.parts {
            if pf != f || off != end {
                return None;
            }
            end += len;
        }
        Some(file.bytes(f, first, end - first))
    }

    /// Each expert's bytes, borrowed from `file` (the file this tensor was resolved in).
    pub fn slices<'a>(&self, file: &'a GgufFile) -> Vec<&'a [u8]> {
        self.parts
            .iter()
            .map(|&(f, off, len)| file.bytes(f, off, len))
            .collect()
    }
}
