//! `GgmlType`: every tensor type of the pinned ggml, with its block geometry.

use crate::error::{Error, Result};
use crate::ffi;

macro_rules! ggml_types {
    ($($variant:ident = $id:literal, $name:literal;)*) => {
        /// A ggml tensor type: the storage types a GGUF file may hold, plus the activation-only
        /// types Q8_1 and Q8_K that vec_dot pairs with.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[allow(non_camel_case_types)]
        #[repr(u32)]
        pub enum GgmlType {
            $($variant = $id,)*
        }

        impl GgmlType {
            /// Every type, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant,)*];

            /// The name GGUF tools print ("Q4_K", "IQ2_XXS", "BF16").
            pub fn name(self) -> &'static str {
                match self {
                    $(GgmlType::$variant => $name,)*
                }
            }

            fn from_known_id(id: u32) -> Option<GgmlType> {
                match id {
                    $($id => Some(GgmlType::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "F32";
    F16 = 1, "F16";
    Q4_0 = 2, "Q4_0";
    Q4_1 = 3, "Q4_1";
    Q5_0 = 6, "Q5_0";
    Q5_1 = 7, "Q5_1";
    Q8_0 = 8, "Q8_0";
    Q8_1 = 9, "Q8_1";
    Q2_K = 10, "Q2_K";
    Q3_K = 11, "Q3_K";
    Q4_K = 12, "Q4_K";
    Q5_K = 13, "Q5_K";
    Q6_K = 14, "Q6_K";
    Q8_K = 15, "Q8_K";
    IQ2_XXS = 16, "IQ2_XXS";
    IQ2_XS = 17, "IQ2_XS";
    IQ3_XXS = 18, "IQ3_XXS";
    IQ1_S = 19, "IQ1_S";
    IQ4_NL = 20, "IQ4_NL";
    IQ3_S = 21, "IQ3_S";
    IQ2_S = 22, "IQ2_S";
    IQ4_XS = 23, "IQ4_XS";
    IQ1_M = 29, "IQ1_M";
    BF16 = 30, "BF16";
    TQ1_0 = 34, "TQ1_0";
    TQ2_0 = 35, "TQ2_0";
    MXFP4 = 39, "MXFP4";
    NVFP4 = 40, "NVFP4";
    Q1_0 = 41, "Q1_0";
    Q2_0 = 42, "Q2_0";
}

impl GgmlType {
    /// The type for a GGUF / ggml type id; ids that name no storage type are errors.
    pub fn from_id(id: u32) -> Result<GgmlType> {
        if let Some(t) = Self::from_known_id(id) {
            return Ok(t);
        }
        let why = match id {
            24..=27 => "an integer type, not a weight type FreeToken computes with",
            28 => "F64, which ggml does not compute with",
            4 | 5 | 31..=33 | 36..=38 => "a type id that ggml has removed",
            _ => "not a ggml type id",
        };
        Err(Error::Unsupported(format!(
            "tensor type id {id} is unsupported: {why}"
        )))
    }

    /// The type named `name`, in any case ("q4_k", "Q4_K").
    pub fn from_name(name: &str) -> Result<GgmlType> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| Error::Unsupported(format!("unknown tensor type name `{name}`")))
    }

    /// The ggml / GGUF id.
    pub fn id(self) -> u32 {
        self as u32
    }

    fn traits(self) -> &'static ffi::TypeTraits {
        // SAFETY: ggml returns a pointer into its static table for every id below GGML_TYPE_COUNT.
        unsafe { &*ffi::ggml_get_type_traits(self as i32) }
    }

    pub(crate) fn cpu_traits(self) -> &'static ffi::TypeTraitsCpu {
        crate::init();
        // SAFETY: as above, a static table entry.
        unsafe { &*ffi::ggml_get_type_traits_cpu(self as i32) }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.traits().blck_size as usize
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.traits().type_size
    }

    /// True for the types a GGUF file may store; false for Q8_1 and Q8_K.
    pub fn is_storage(self) -> bool {
        !matches!(self, GgmlType::Q8_1 | GgmlType::Q8_K)
    }

    /// Bytes of a row of `k` elements; an error when `k` is not a whole number of blocks.
    pub fn row_size(self, k: usize) -> Result<usize> {
        let bs = self.block_size();
        if !k.is_multiple_of(bs) {
            return Err(Error::Shape(format!(
                "row length {k} is not a multiple of {}'s block size {bs}",
                self.name()
            )));
        }
        Ok(k / bs * self.type_size())
    }

    /// Bytes of a `rows` x `k` matrix, checked for overflow.
    pub fn matrix_size(self, rows: usize, k: usize) -> Result<usize> {
        self.row_size(k)?
            .checked_mul(rows)
            .ok_or_else(|| Error::Shape(format!("{rows} x {k} {} overflows", self.name())))
    }

    /// The type the activations are quantized to for this type's dot product.
    pub fn vec_dot_type(self) -> GgmlType {
        GgmlType::from_id(self.cpu_traits().vec_dot_type as u32)
            .expect("ggml names a known vec_dot type")
    }

    /// Whether ggml-cpu has a dot product for rows of this type.
    pub fn has_vec_dot(self) -> bool {
        self.is_storage() && self.cpu_traits().vec_dot.is_some()
    }

    /// Whether quantizing to this type needs an importance matrix.
    pub fn requires_imatrix(self) -> bool {
        // SAFETY: a pure query on a valid type id.
        unsafe { ffi::ggml_quantize_requires_imatrix(self as i32) }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
