//! What the kernels of every instruction set read from ggml's block formats, in plain Rust:
//! the E8M0 scale of MXFP4, the IQ4 value table and the packed scales and mins of Q4_K and
//! Q5_K.

/// ggml's `ggml_e8m0_to_fp32_half`: 2^(e - 128), subnormal below e = 2.
pub(super) fn e8m0_half(e: u8) -> f32 {
    f32::from_bits(if e < 2 {
        0x0020_0000 << e
    } else {
        u32::from(e - 1) << 23
    })
}

/// IQ4_XS's (and IQ4_NL's) values of the 16 indices (ggml's `kvalues_iq4nl`).
pub(super) const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The eight scales and eight mins of a Q4_K block's 12 packed bytes, as ggml unpacks them.
pub(super) fn scales_and_mins(p: [u8; 12]) -> [u8; 16] {
    let w = |i: usize| u32::from_le_bytes([p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]]);
    let (k1, k2, k3) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    // Scales of sub-blocks 0-3, 4-7, then mins of 0-3, 4-7.
    let words = [
        u0 & k1,
        (u2 & k2) | (((u0 >> 6) & k3) << 4),
        u1 & k1,
        ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    out
}
