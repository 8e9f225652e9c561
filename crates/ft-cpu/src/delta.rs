//! One token of the gated delta rule (Gated DeltaNet's recurrence) on the CPU, the state
//! updated in place.
//!
//! Per head, with the state `S [d_k, d_v]`, decay `a = exp(g)`, key `k`, value `v`, query `q`
//! and `beta`: `S' = a S + k (beta (v - a S^T k))^T` and the output `o = S'^T q`. `a S^T k` is
//! taken as `a (S^T k)`, so that the state is read twice (once for `S^T k`, once to update it
//! and take the output) rather than scaled into a copy first.

/// The sizes of one step: `heads` heads with keys of `dk` and values of `dv` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The step over every head: `q, k [heads * dk]` (the query already scaled), `v [heads *
/// dv]`, `g, beta [heads]`, `state [heads * dk * dv]` (row-major `[head][k][v]`), updated in
/// place, and the output `out [heads * dv]`. The caller checks the lengths
/// ([`DeltaShape::from_lengths`]); others end in a bounds-check panic.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(
    shape: DeltaShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let DeltaShape { heads, dk, dv } = shape;
    let mut delta = vec![0.0f32; dv];
    for h in 0..heads {
        let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
        let (qh, kh) = (&q[h * dk..(h + 1) * dk], &k[h * dk..(h + 1) * dk]);
        let (vh, oh) = (&v[h * dv..(h + 1) * dv], &mut out[h * dv..(h + 1) * dv]);
        let decay = g[h].exp();
        delta.fill(0.0);
        for (row, &kj) in s.chunks_exact(dv).zip(kh) {
            for (d, &x) in delta.iter_mut().zip(row) {
                *d += x * kj;
            }
        }
        for (d, &x) in delta.iter_mut().zip(vh) {
            *d = (x - decay * *d) * beta[h];
        }
        oh.fill(0.0);
        for ((row, &kj), &qj) in s.chunks_exact_mut(dv).zip(kh).zip(qh) {
            for ((x, &d), o) in row.iter_mut().zip(&delta).zip(oh.iter_mut()) {
                *x = *x * decay + kj * d;
                *o += *x * qj;
            }
        }
    }
}

impl DeltaShape {
    /// The shape of a step's arrays from their lengths (`q, k, v, g, beta, state, out`, in
    /// that order): heads from `g`, key and value sizes from `q` and `v`; a description of
    /// the first length that does not fit, if any.
    pub fn from_lengths(lengths: [usize; 7]) -> Result<DeltaShape, String> {
        let [q, _, v, g, ..] = lengths;
        if g == 0 || !q.is_multiple_of(g) || !v.is_multiple_of(g) {
            return Err(format!("q of {q} and v of {v} values over {g} heads"));
        }
        let shape = DeltaShape {
            heads: g,
            dk: q / g,
            dv: v / g,
        };
        shape.check(lengths)?;
        Ok(shape)
    }

    /// A description of the first length that does not fit the shape, if any: `q, k, v, g,
    /// beta, state, out` in that order.
    pub fn check(&self, lengths: [usize; 7]) -> Result<(), String> {
        let [q, k, v, g, beta, state, out] = lengths;
        let Self { heads, dk, dv } = *self;
        let want = [
            ("q", q, heads * dk),
            ("k", k, heads * dk),
            ("v", v, heads * dv),
            ("g", g, heads),
            ("beta", beta, heads),
            ("state", state, heads * dk * dv),
            ("out", out, heads * dv),
        ];
        for (name, got, need) in want {
            if got != need {
                return Err(format!(
                    "{name} has {got} values, {need} expected ({heads} heads, keys of {dk}, values of {dv})"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    /// The rule as written, in float64: decay the state, then the delta and the update.
    /// Besides the output and the state, each one's magnitude scale: the sum of the
    /// absolute terms it is computed from (the state's through `|a S| + |k| |delta|`, the
    /// delta's through `|v| + a sum |S k|`), which bounds float32 rounding below.
    #[allow(clippy::type_complexity)]
    fn reference(
        shape: DeltaShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &[f32],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let DeltaShape { heads, dk, dv } = shape;
        let mut s: Vec<f64> = state.iter().map(|&x| x as f64).collect();
        let mut s_scale = vec![0.0f64; s.len()];
        let (mut out, mut out_scale) = (vec![0.0f64; heads * dv], vec![0.0f64; heads * dv]);
        for h in 0..heads {
            let a = (g[h] as f64).exp();
            let base = h * dk * dv;
            let (kh, qh) = (&k[h * dk..(h + 1) * dk], &q[h * dk..(h + 1) * dk]);
            for c in 0..dv {
                let col = |j: usize| a * s[base + j * dv + c];
                let sk: f64 = (0..dk).map(|j| col(j) * kh[j] as f64).sum();
                let sk_abs: f64 = (0..dk).map(|j| (col(j) * kh[j] as f64).abs()).sum();
                let b = beta[h] as f64;
                let d = (v[h * dv + c] as f64 - sk) * b;
                let d_abs = ((v[h * dv + c] as f64).abs() + sk_abs) * b;
                for (j, &kj) in kh.iter().enumerate() {
                    let i = base + j * dv + c;
                    s_scale[i] = (a * s[i]).abs() + (kj as f64).abs() * d_abs;
                    s[i] = a * s[i] + kj as f64 * d;
                }
                out[h * dv + c] = (0..dk).map(|j| s[base + j * dv + c] * qh[j] as f64).sum();
                out_scale[h * dv + c] = (0..dk)
                    .map(|j| s_scale[base + j * dv + c] * (qh[j] as f64).abs())
                    .sum();
            }
        }
        (out, out_scale, s, s_scale)
    }

    #[test]
    fn step_matches_the_float64_rule() {
        for (heads, dk, dv) in [(1, 1, 1), (2, 3, 5), (4, 128, 128), (3, 16, 64)] {
            let shape = DeltaShape { heads, dk, dv };
            let (q, k, v) = (
                values(heads * dk, 1),
                values(heads * dk, 2),
                values(heads * dv, 3),
            );
            let g: Vec<f32> = values(heads, 4).iter().map(|x| -x.abs() - 0.01).collect();
            let beta: Vec<f32> = values(heads, 5).iter().map(|x| x.abs()).collect();
            let state0 = values(heads * dk * dv, 6);
            let (out_ref, out_scale, state_ref, state_scale) =
                reference(shape, &q, &k, &v, &g, &beta, &state0);
            let mut state = state0.clone();
            let mut out = vec![0.0f32; heads * dv];
            delta_rule_step(shape, &q, &k, &v, &g, &beta, &mut state, &mut out);
            // Rounding: each value comes through a chain of at most 2 dk + 8 float32
            // operations (the dk-term sum S^T k, the delta's three, the update's two, the
            // dk-term output sum), so it is within (2 dk + 8) u of its magnitude scale
            // (u = 2^-24, the usual bound on a sum's rounding, times the sum of |terms|).
            let gamma = (2 * dk + 8) as f64 * 2f64.powi(-24);
            let got = out.iter().chain(&state);
            let want = out_ref
                .iter()
                .chain(&state_ref)
                .zip(out_scale.iter().chain(&state_scale));
            for (got, (want, scale)) in got.zip(want) {
                let err = (*got as f64 - want).abs();
                assert!(
                    err <= gamma * scale,
                    "{got} vs {want}: {err} > {gamma} * {scale}"
                );
            }
        }
    }

    #[test]
    fn lengths_are_checked() {
        let shape = DeltaShape {
            heads: 2,
            dk: 4,
            dv: 3,
        };
        assert!(shape.check([8, 8, 6, 2, 2, 24, 6]).is_ok());
        let err = shape.check([8, 8, 6, 2, 2, 23, 6]).unwrap_err();
        assert!(err.contains("state has 23 values, 24 expected"), "{err}");
        assert!(shape
            .check([8, 7, 6, 2, 2, 24, 6])
            .unwrap_err()
            .starts_with("k has 7"));
        let from = DeltaShape::from_lengths([8, 8, 6, 2, 2, 24, 6]).unwrap();
        assert_eq!((from.heads, from.dk, from.dv), (2, 4, 3));
        for (lens, says) in [
            ([8, 8, 6, 0, 2, 24, 6], "over 0 heads"),
            ([9, 8, 6, 2, 2, 24, 6], "q of 9"),
            ([8, 8, 6, 2, 3, 24, 6], "beta has 3"),
        ] {
            let err = DeltaShape::from_lengths(lens).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }
}
