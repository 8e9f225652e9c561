//! The expert executor: one MoE layer's routed experts for a batch of tokens.
//!
//! Routes are grouped by expert so each expert's weights are read once per step however many
//! tokens chose it; each activation row is quantized once per vec_dot type; work is spread
//! over (expert, row block) pairs on the pool.

use crate::matmul::OutPtr;
use crate::pool::ThreadPool;
use freetoken_ggml::{Error, GgmlType, Result, VecDot};
use std::collections::HashMap;

/// The gated activation between the gate/up and down products.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// silu(gate) * up
    Silu,
    /// gelu_tanh(gate) * up
    Gelu,
    /// gpt-oss: clamp(gate, max = limit) * sigmoid(alpha * .) * (clamp(up, ±limit) + 1)
    SwigluOai { alpha: f32, limit: f32 },
}

impl Activation {
    #[inline]
    fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Activation::Silu => g / (1.0 + (-g).exp()) * u,
            Activation::Gelu => {
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                let inner = SQRT_2_OVER_PI * g * (1.0 + 0.044_715 * g * g);
                0.5 * g * (1.0 + inner.tanh()) * u
            }
            Activation::SwigluOai { alpha, limit } => {
                let x = g.min(limit);
                let y = u.clamp(-limit, limit);
                x / (1.0 + (-alpha * x).exp()) * (y + 1.0)
            }
        }
    }
}

/// One expert weight of every expert: `experts[e]` is expert e's `n x k` matrix of `ty`,
/// with an optional per-expert bias `[n_experts, n]`.
pub struct ExpertMats<'a> {
    pub ty: GgmlType,
    pub n: usize,
    pub k: usize,
    pub experts: Vec<&'a [u8]>,
    pub bias: Option<&'a [f32]>,
}

impl ExpertMats<'_> {
    fn check(&self, what: &str, n_experts: usize) -> Result<VecDot> {
        let kernel = VecDot::new(self.ty, self.k)?;
        let want = self.ty.matrix_size(self.n, self.k)?;
        if self.experts.len() != n_experts {
            return Err(Error::Shape(format!(
                "{what}: {} experts, expected {n_experts}",
                self.experts.len()
            )));
        }
        if let Some(e) = self.experts.iter().position(|m| m.len() != want) {
            return Err(Error::Shape(format!(
                "{what}: expert {e} has {} bytes, expected {want} ({} x {} {})",
                self.experts[e].len(),
                self.n,
                self.k,
                self.ty
            )));
        }
        if let Some(b) = self.bias {
            if b.len() != n_experts * self.n {
                return Err(Error::Shape(format!(
                    "{what}: bias has {} values, expected {n_experts} x {}",
                    b.len(),
                    self.n
                )));
            }
        }
        Ok(kernel)
    }

    #[inline]
    fn row(&self, e: usize, r: usize, kernel: &VecDot) -> &[u8] {
        let b = kernel.weight_row_bytes();
        &self.experts[e][r * b..(r + 1) * b]
    }

    #[inline]
    fn bias(&self, e: usize, r: usize) -> f32 {
        self.bias.map_or(0.0, |b| b[e * self.n + r])
    }
}

/// One MoE layer's routed experts: gate and up (`n = ffn`, `k = hidden`) and down
/// (`n = hidden`, `k = ffn`).
pub struct MoeWeights<'a> {
    pub n_experts: usize,
    pub gate: ExpertMats<'a>,
    pub up: ExpertMats<'a>,
    pub down: ExpertMats<'a>,
    pub act: Activation,
}

impl MoeWeights<'_> {
    /// Checks every expert's size and that the shapes chain; returns the gate, up and down
    /// dot-product kernels.
    pub fn validate(&self) -> Result<(VecDot, VecDot, VecDot)> {
        let e = self.n_experts;
        let kernels = (
            self.gate.check("gate", e)?,
            self.up.check("up", e)?,
            self.down.check("down", e)?,
        );
        let (hidden, ffn) = (self.gate.k, self.gate.n);
        if self.up.k != hidden || self.up.n != ffn || self.down.k != ffn || self.down.n != hidden {
            return Err(Error::Shape(format!(
                "expert shapes do not chain: gate {}x{}, up {}x{}, down {}x{}",
                self.gate.n, self.gate.k, self.up.n, self.up.k, self.down.n, self.down.k
            )));
        }
        Ok(kernels)
    }
}

/// What one call read: for the permanent counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MoeStats {
    pub routes: u64,
    pub experts: u64,
    pub weight_bytes: u64,
}

/// Rows of one weight per task.
const ROW_BLOCK: usize = 32;

/// A route table grouped by expert: `order` lists route indices (token * top_k + j) expert by
/// expert; `groups` gives each used expert's range in it.
struct Grouping {
    order: Vec<usize>,
    groups: Vec<(usize, std::ops::Range<usize>)>,
}

fn group_routes(ids: &[i32], n_experts: usize) -> Result<Grouping> {
    let mut per: HashMap<usize, Vec<usize>> = HashMap::new();
    for (route, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= n_experts {
            return Err(Error::InvalidInput(format!(
                "expert id {id} is out of range (0..{n_experts})"
            )));
        }
        per.entry(id as usize).or_default().push(route);
    }
    let mut experts: Vec<_> = per.into_iter().collect();
    experts.sort_unstable_by_key(|(e, _)| *e);
    let mut order = Vec::with_capacity(ids.len());
    let mut groups = Vec::with_capacity(experts.len());
    for (e, routes) in experts {
        let start = order.len();
        order.extend(routes);
        groups.push((e, start..order.len()));
    }
    Ok(Grouping { order, groups })
}

/// Tasks of (group index, first row) covering `rows` rows of every used expert.
fn row_tasks(groups: usize, rows: usize) -> Vec<(usize, usize)> {
    (0..groups)
        .flat_map(|g| (0..rows).step_by(ROW_BLOCK).map(move |r| (g, r)))
        .collect()
}

/// out[T, hidden] = sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]).
///
/// `x` is `[T, hidden]`, `ids` and `weights` are `[T, top_k]`. Expert ids out of range and
/// shapes that do not fit are errors; nothing is touched before every size is checked.
pub fn moe_forward(
    pool: &ThreadPool,
    w: &MoeWeights<'_>,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    out: &mut [f32],
) -> Result<MoeStats> {
    let e = w.n_experts;
    let (kg, ku, kd) = w.validate()?;
    let (hidden, ffn) = (w.gate.k, w.gate.n);
    if !x.len().is_multiple_of(hidden) || out.len() != x.len() {
        return Err(Error::Shape(format!(
            "x has {} values and out {}, expected equal multiples of hidden {hidden}",
            x.len(),
            out.len()
        )));
    }
    let t = x.len() / hidden;
    if t == 0 {
        return Ok(MoeStats::default());
    }
    if !ids.len().is_multiple_of(t) || weights.len() != ids.len() || ids.is_empty() {
        return Err(Error::Shape(format!(
            "{} ids and {} weights for {t} tokens",
            ids.len(),
            weights.len()
        )));
    }
    let top_k = ids.len() / t;
    let grouping = group_routes(ids, e)?;
    let n_routes = ids.len();

    // Activations, quantized once per vec_dot type (gate and up usually share one).
    let xg = crate::quantize_rows(pool, &kg, x)?;
    let xu = if ku.act_type() == kg.act_type() {
        None
    } else {
        Some(crate::quantize_rows(pool, &ku, x)?)
    };
    let (agb, aub) = (kg.act_row_bytes(), ku.act_row_bytes());

    // Phase 1: h[route] = act(gate . x + bg, up . x + bu), rows split per expert.
    let mut h = vec![0f32; n_routes * ffn];
    let hp = OutPtr(h.as_mut_ptr());
    let tasks = row_tasks(grouping.groups.len(), ffn);
    pool.run(tasks.len(), &|i| {
        let (g, r0) = tasks[i];
        let (ex, ref range) = grouping.groups[g];
        for r in r0..(r0 + ROW_BLOCK).min(ffn) {
            let (wg, wu) = (w.gate.row(ex, r, &kg), w.up.row(ex, r, &ku));
            let (bg, bu) = (w.gate.bias(ex, r), w.up.bias(ex, r));
            for &route in &grouping.order[range.clone()] {
                let tok = route / top_k;
                let ag = &xg[tok * agb..(tok + 1) * agb];
                let au = xu.as_ref().map_or(ag, |xu| &xu[tok * aub..(tok + 1) * aub]);
                let gv = kg.dot(wg, ag).expect("sizes checked") + bg;
                let uv = ku.dot(wu, au).expect("sizes checked") + bu;
                // SAFETY: route < n_routes and r < ffn index inside h; (route, r) belongs to
                // this task alone (rows r0.. of this expert, whose routes no other expert has).
                unsafe { *hp.get().add(route * ffn + r) = w.act.apply(gv, uv) };
            }
        }
    });

    // Phase 2: y[route] = down . h[route] + bd, then the weighted sum per token.
    let hq = crate::quantize_rows(pool, &kd, &h)?;
    let adb = kd.act_row_bytes();
    let mut y = vec![0f32; n_routes * hidden];
    let yp = OutPtr(y.as_mut_ptr());
    let tasks = row_tasks(grouping.groups.len(), hidden);
    pool.run(tasks.len(), &|i| {
        let (g, r0) = tasks[i];
        let (ex, ref range) = grouping.groups[g];
        for r in r0..(r0 + ROW_BLOCK).min(hidden) {
            let wd = w.down.row(ex, r, &kd);
            let bd = w.down.bias(ex, r);
            for &route in &grouping.order[range.clone()] {
                let v = kd
                    .dot(wd, &hq[route * adb..(route + 1) * adb])
                    .expect("sizes checked");
                // SAFETY: as in phase 1, for y.
                unsafe { *yp.get().add(route * hidden + r) = v + bd };
            }
        }
    });
    for (tok, o) in out.chunks_exact_mut(hidden).enumerate() {
        o.fill(0.0);
        for j in 0..top_k {
            let route = tok * top_k + j;
            let wt = weights[route];
            for (a, b) in o.iter_mut().zip(&y[route * hidden..(route + 1) * hidden]) {
                *a += wt * b;
            }
        }
    }
    let per_expert =
        (w.gate.experts[0].len() + w.up.experts[0].len() + w.down.experts[0].len()) as u64;
    Ok(MoeStats {
        routes: n_routes as u64,
        experts: grouping.groups.len() as u64,
        weight_bytes: per_expert * grouping.groups.len() as u64,
    })
}
