//! The expert executor: one MoE layer's routed experts for a batch of tokens.
//!
//! Routes are grouped by expert so each expert's weights are read once per step however many
//! tokens chose it; each activation row is quantized once per vec_dot type; work is spread
//! over (expert, row block) pairs on the pool.

use crate::acts::ActCodec;
use crate::kernels::{prefetch, prefetch_l2, RowDots, PACKED_ROWS, PASS_ROWS};
use crate::matmul::{quantize_rows_with, OutPtr};
use crate::packed::dots_over;
use crate::pool::ThreadPool;
use freetoken_ggml::{Error, GgmlType, Result, VecDot};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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

    /// Rows `rows` of expert `e`, contiguous.
    #[inline]
    fn rows(&self, e: usize, rows: std::ops::Range<usize>, kernel: &VecDot) -> &[u8] {
        let b = kernel.weight_row_bytes();
        &self.experts[e][rows.start * b..rows.end * b]
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

/// Tasks per thread a call is cut into at least, so that a thread slowed by other work on the
/// machine delays the call by a small part of it.
const TASKS_PER_THREAD: usize = 4;
/// Rows per task at least, when an expert is split to make enough tasks.
const MIN_TASK_ROWS: usize = 16;

/// A route table grouped by expert: `order` lists route indices (token * top_k + j) expert by
/// expert, in route order within an expert; `groups` gives each used expert's range in it,
/// experts in id order.
struct Grouping {
    order: Vec<usize>,
    groups: Vec<(usize, std::ops::Range<usize>)>,
}

/// The expert id that marks a route not to compute (`ForwardOptions::skip_negative`).
pub const SKIP_ROUTE: i32 = -1;

/// Routes with id `SKIP_ROUTE` are left out when `skip`; any other id out of range is an error.
fn group_routes(ids: &[i32], n_experts: usize, skip: bool) -> Result<Grouping> {
    let mut start = vec![0usize; n_experts + 1];
    let mut skipped = 0;
    for &id in ids {
        if id < 0 || id as usize >= n_experts {
            if skip && id == SKIP_ROUTE {
                skipped += 1;
                continue;
            }
            return Err(Error::InvalidInput(format!(
                "expert id {id} is out of range (0..{n_experts})"
            )));
        }
        start[id as usize + 1] += 1;
    }
    for e in 0..n_experts {
        start[e + 1] += start[e];
    }
    let groups = (0..n_experts)
        .filter(|&e| start[e + 1] > start[e])
        .map(|e| (e, start[e]..start[e + 1]))
        .collect();
    let mut order = vec![0; ids.len() - skipped];
    for (route, &id) in ids.iter().enumerate() {
        // Only skipped routes are negative here.
        if id < 0 {
            continue;
        }
        let slot = &mut start[id as usize];
        order[*slot] = route;
        *slot += 1;
    }
    Ok(Grouping { order, groups })
}

/// Each route's activation row in `acts` (rows of `row_bytes`, one per token).
fn route_rows<'a>(
    acts: &'a [u8],
    row_bytes: usize,
    routes: &[usize],
    top_k: usize,
) -> Vec<&'a [u8]> {
    routes
        .iter()
        .map(|&r| &acts[r / top_k * row_bytes..(r / top_k + 1) * row_bytes])
        .collect()
}

/// One task: a contiguous block of one used expert's gate and up rows (phase 1) or down rows
/// (phase 2).
#[derive(Clone)]
enum Task {
    GateUp(usize, std::ops::Range<usize>),
    Down(usize, std::ops::Range<usize>),
}

/// Each group's `rows` cut into equal contiguous blocks, as few as give every thread
/// `TASKS_PER_THREAD` tasks over all groups. Long blocks matter: each task streams its rows
/// from memory, and short ones (32 rows, 14 KB of a Q4_0 down matrix) left two threads
/// decoding at 18 GB/s where whole experts reach 30 (benches/README.md). Blocks start at a
/// multiple of `PACKED_ROWS`, a group of packed rows.
fn blocks(groups: usize, rows: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    let splits = (TASKS_PER_THREAD * threads)
        .div_ceil(groups)
        .clamp(1, rows.div_ceil(MIN_TASK_ROWS));
    let per = rows.div_ceil(splits).next_multiple_of(PACKED_ROWS);
    (0..rows)
        .step_by(per)
        .map(|r| r..(r + per).min(rows))
        .collect()
}

/// Sets `failed` if its task unwinds: a panicking gate/up task never marks its expert ready,
/// and the down tasks waiting for it must stop instead of spinning for ever.
struct PanicFlag<'a>(&'a AtomicBool);

impl Drop for PanicFlag<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// Waits until `ready` is set (true) or a task has panicked (false). The wait is short: every
/// gate/up task is handed out before any down task, so the ones this waits for are running.
fn wait_ready(ready: &AtomicBool, failed: &AtomicBool) -> bool {
    let mut polls = 0u32;
    loop {
        if ready.load(Ordering::Acquire) {
            return true;
        }
        if failed.load(Ordering::Relaxed) {
            return false;
        }
        // Yield after a while: on a busy machine the thread being waited for may need this CPU.
        if polls < 1 << 12 {
            std::hint::spin_loop();
            polls += 1;
        } else {
            std::thread::yield_now();
        }
    }
}

/// `out[T, hidden] = sum over j of weights[t, j] * expert_{ids[t, j]}(x[t])`.
///
/// `x` is `[T, hidden]`, `ids` and `weights` are `[T, top_k]`. Expert ids out of range and
/// shapes that do not fit are errors; nothing is touched before every size is checked.
///
/// Both phases go to the pool as one job: an expert's down rows start as soon as its own
/// gate/up rows are done (the task that finishes them quantizes that expert's h), not after
/// every expert's, so a step pays one dispatch and no barrier between the phases.
pub fn moe_forward(
    pool: &ThreadPool,
    w: &MoeWeights<'_>,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    out: &mut [f32],
) -> Result<MoeStats> {
    moe_forward_with(pool, w, x, ids, weights, out, ForwardOptions::default())
}

/// How `moe_forward_with` computes; the default is `moe_forward`'s.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ForwardOptions {
    /// The routes whose id is `SKIP_ROUTE` (-1) are not computed: their weights are ignored,
    /// a token with every route skipped gets a zero row, and the stats count the computed
    /// routes only (an expert only skipped routes chose is not read). For the hybrid split,
    /// where the other routes run elsewhere and their rows are added to these. Other
    /// negative ids are still errors.
    pub skip_negative: bool,
    /// Quantize x and h in two passes, the row and its rounding residual (`crate::acts`):
    /// results track float math to about 0.01% instead of carrying ggml's activation rounding
    /// (1-3% per token with q8_K), for a second dot product per row.
    pub residual_acts: bool,
}

/// `moe_forward` with `opts`.
pub fn moe_forward_with(
    pool: &ThreadPool,
    w: &MoeWeights<'_>,
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    out: &mut [f32],
    opts: ForwardOptions,
) -> Result<MoeStats> {
    let skip = opts.skip_negative;
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
    let grouping = group_routes(ids, e, skip)?;
    let n_routes = ids.len();
    let n_groups = grouping.groups.len();
    if n_groups == 0 {
        // Every route skipped.
        out.fill(0.0);
        return Ok(MoeStats::default());
    }

    // Activations, quantized once per vec_dot type (gate and up usually share one).
    let codec = |k: VecDot| ActCodec::new(k, opts.residual_acts);
    let (cg, cu, cd) = (codec(kg), codec(ku), codec(kd));
    let xg = quantize_rows_with(pool, &cg, x)?;
    let xu = if cu.shares_rows_with(&cg) {
        None
    } else {
        Some(quantize_rows_with(pool, &cu, x)?)
    };
    let (agb, aub, adb) = (cg.row_bytes(), cu.row_bytes(), cd.row_bytes());
    let (dg, du, dd) = (RowDots::new(kg)?, RowDots::new(ku)?, RowDots::new(kd)?);

    let threads = pool.n_threads();
    let (up_blocks, down_blocks) = (
        blocks(n_groups, ffn, threads),
        blocks(n_groups, hidden, threads),
    );
    // Experts with the most routes first, so that the longest tasks do not come last and leave
    // one thread working alone; each expert's down blocks after every gate/up block.
    let mut by_load: Vec<usize> = (0..n_groups).collect();
    by_load.sort_by_key(|&g| std::cmp::Reverse(grouping.groups[g].1.len()));
    let tasks: Vec<Task> = by_load
        .iter()
        .flat_map(|&g| up_blocks.iter().map(move |b| Task::GateUp(g, b.clone())))
        .chain(
            by_load
                .iter()
                .flat_map(|&g| down_blocks.iter().map(move |b| Task::Down(g, b.clone()))),
        )
        .collect();
    // Per group: gate/up blocks still running, and whether its h is quantized.
    let pending: Vec<AtomicUsize> = (0..n_groups)
        .map(|_| AtomicUsize::new(up_blocks.len()))
        .collect();
    let ready: Vec<AtomicBool> = (0..n_groups).map(|_| AtomicBool::new(false)).collect();
    let failed = AtomicBool::new(false);

    let mut h = vec![0f32; n_routes * ffn];
    let mut hq = vec![0u8; n_routes * adb];
    let mut y = vec![0f32; n_routes * hidden];
    let (hp, hqp, yp) = (
        OutPtr(h.as_mut_ptr()),
        OutPtr(hq.as_mut_ptr().cast()),
        OutPtr(y.as_mut_ptr()),
    );
    // A task's first pass of weight rows: what it reads before the kernels' own prefetch runs
    // ahead of it. Each thread prefetches its next task's into L2 before it starts the current
    // one (`run_with_ahead`), and each task its own into L1 as it starts.
    let first_pass = |task: &Task, fetch: fn(&[u8])| {
        let first =
            |rows: &std::ops::Range<usize>| rows.start..(rows.start + PASS_ROWS).min(rows.end);
        match *task {
            Task::GateUp(g, ref rows) => {
                let ex = grouping.groups[g].0;
                fetch(w.gate.rows(ex, first(rows), &kg));
                fetch(w.up.rows(ex, first(rows), &ku));
            }
            Task::Down(g, ref rows) => fetch(w.down.rows(grouping.groups[g].0, first(rows), &kd)),
        }
    };
    let run_task = |i: usize| match tasks[i] {
        // h[route] = act(gate . x + bg, up . x + bu) for these rows of the expert.
        Task::GateUp(g, ref rows) => {
            let _flag = PanicFlag(&failed);
            let (ex, ref range) = grouping.groups[g];
            let routes = &grouping.order[range.clone()];
            // The routes' activation rows, so that each pass's weight blocks are unpacked once
            // for several of them (RowDots::dots).
            let ag = route_rows(&xg, agb, routes, top_k);
            // Gate and up share their activation rows unless their types differ.
            let au_own = xu.as_ref().map(|xu| route_rows(xu, aub, routes, top_k));
            let au = au_own.as_ref().unwrap_or(&ag);
            let (dg, du) = (
                dots_over(dg, w.gate.experts[ex]),
                dots_over(du, w.up.experts[ex]),
            );
            let (mut gv, mut uv) = (
                vec![0f32; routes.len() * PASS_ROWS],
                vec![0f32; routes.len() * PASS_ROWS],
            );
            for r0 in rows.clone().step_by(PASS_ROWS) {
                let pass = r0..(r0 + PASS_ROWS).min(rows.end);
                let n = pass.len();
                let (gv, uv) = (&mut gv[..routes.len() * n], &mut uv[..routes.len() * n]);
                dg.dots(w.gate.rows(ex, pass.clone(), &kg), &ag, gv);
                du.dots(w.up.rows(ex, pass.clone(), &ku), au, uv);
                for ((&route, gv), uv) in routes
                    .iter()
                    .zip(gv.chunks_exact(n))
                    .zip(uv.chunks_exact(n))
                {
                    for (i, r) in pass.clone().enumerate() {
                        let gate = gv[i] + w.gate.bias(ex, r);
                        let up = uv[i] + w.up.bias(ex, r);
                        // SAFETY: route < n_routes and r < ffn index inside h; (route, r)
                        // belongs to this task alone (these rows of this expert, whose routes
                        // no other expert has).
                        unsafe { *hp.get().add(route * ffn + r) = w.act.apply(gate, up) };
                    }
                }
            }
            // The last block of this expert quantizes its h rows for the down product.
            if pending[g].fetch_sub(1, Ordering::AcqRel) == 1 {
                for &route in routes {
                    // SAFETY: every block of this expert has finished writing h (the AcqRel
                    // count orders their writes before this read), and hq's row `route`
                    // belongs to this expert's last block alone.
                    let (hr, dst) = unsafe {
                        (
                            std::slice::from_raw_parts(hp.get().add(route * ffn), ffn),
                            std::slice::from_raw_parts_mut(
                                hqp.get().cast::<u8>().add(route * adb),
                                adb,
                            ),
                        )
                    };
                    cd.quantize(hr, dst).expect("sizes checked");
                }
                ready[g].store(true, Ordering::Release);
            }
        }
        // y[route] = down . h[route] + bd for these rows of the expert.
        Task::Down(g, ref rows) => {
            if !wait_ready(&ready[g], &failed) {
                return;
            }
            let (ex, ref range) = grouping.groups[g];
            let routes = &grouping.order[range.clone()];
            // SAFETY: the expert's hq rows are complete (ready, Acquire) and no longer written.
            let a: Vec<&[u8]> = routes
                .iter()
                .map(|&route| unsafe {
                    std::slice::from_raw_parts(hqp.get().cast::<u8>().add(route * adb), adb)
                })
                .collect();
            let dd = dots_over(dd, w.down.experts[ex]);
            let mut yv = vec![0f32; routes.len() * PASS_ROWS];
            for r0 in rows.clone().step_by(PASS_ROWS) {
                let pass = r0..(r0 + PASS_ROWS).min(rows.end);
                let yv = &mut yv[..routes.len() * pass.len()];
                dd.dots(w.down.rows(ex, pass.clone(), &kd), &a, yv);
                for (&route, v) in routes.iter().zip(yv.chunks_exact(pass.len())) {
                    // SAFETY: y[route][pass] belongs to this task alone, as h's rows above.
                    let y = unsafe {
                        std::slice::from_raw_parts_mut(
                            yp.get().add(route * hidden + pass.start),
                            pass.len(),
                        )
                    };
                    for ((y, v), r) in y.iter_mut().zip(v).zip(pass.clone()) {
                        *y = v + w.down.bias(ex, r);
                    }
                }
            }
        }
    };
    pool.run_with_ahead(
        tasks.len(),
        &|i| {
            first_pass(&tasks[i], prefetch);
            run_task(i);
        },
        &|i| first_pass(&tasks[i], prefetch_l2),
    );
    for (tok, o) in out.chunks_exact_mut(hidden).enumerate() {
        o.fill(0.0);
        for j in 0..top_k {
            let route = tok * top_k + j;
            if skip && ids[route] < 0 {
                continue;
            }
            let wt = weights[route];
            for (a, b) in o.iter_mut().zip(&y[route * hidden..(route + 1) * hidden]) {
                *a += wt * b;
            }
        }
    }
    let per_expert =
        (w.gate.experts[0].len() + w.up.experts[0].len() + w.down.experts[0].len()) as u64;
    Ok(MoeStats {
        routes: grouping.order.len() as u64,
        experts: n_groups as u64,
        weight_bytes: per_expert * n_groups as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use freetoken_ggml::quantize;

    const SKIPPING: ForwardOptions = ForwardOptions {
        skip_negative: true,
        residual_acts: false,
    };

    fn floats(n: usize, mut s: u64, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
            })
            .collect()
    }

    fn mats<'a>(
        ty: GgmlType,
        data: &'a [u8],
        n: usize,
        k: usize,
        e: usize,
        bias: Option<&'a [f32]>,
    ) -> ExpertMats<'a> {
        ExpertMats {
            ty,
            n,
            k,
            experts: data.chunks_exact(data.len() / e).collect(),
            bias,
        }
    }

    /// The executor's arithmetic, one row and one route at a time with ggml's dot product;
    /// routes with a negative id are left out.
    fn row_by_row(w: &MoeWeights<'_>, x: &[f32], ids: &[i32], wts: &[f32]) -> Vec<f32> {
        let (kg, ku, kd) = w.validate().unwrap();
        let (hidden, ffn) = (w.gate.k, w.gate.n);
        let top_k = ids.len() / (x.len() / hidden);
        let quant = |k: &VecDot, v: &[f32]| {
            let mut q = vec![0u8; k.act_row_bytes()];
            k.quantize_act(v, &mut q).unwrap();
            q
        };
        let row =
            |m: &ExpertMats<'_>, k: &VecDot, e: usize, r: usize| m.rows(e, r..r + 1, k).to_vec();
        let mut out = vec![0f32; x.len()];
        for (tok, o) in out.chunks_exact_mut(hidden).enumerate() {
            let xt = &x[tok * hidden..(tok + 1) * hidden];
            let (ag, au) = (quant(&kg, xt), quant(&ku, xt));
            let mut ys = vec![];
            for (j, &id) in ids[tok * top_k..(tok + 1) * top_k].iter().enumerate() {
                if id < 0 {
                    continue;
                }
                let e = id as usize;
                let h: Vec<f32> = (0..ffn)
                    .map(|r| {
                        let g = kg.dot(&row(&w.gate, &kg, e, r), &ag).unwrap() + w.gate.bias(e, r);
                        let u = ku.dot(&row(&w.up, &ku, e, r), &au).unwrap() + w.up.bias(e, r);
                        w.act.apply(g, u)
                    })
                    .collect();
                let hq = quant(&kd, &h);
                let y: Vec<f32> = (0..hidden)
                    .map(|r| kd.dot(&row(&w.down, &kd, e, r), &hq).unwrap() + w.down.bias(e, r))
                    .collect();
                ys.push((j, y));
            }
            for (j, y) in &ys {
                for (a, b) in o.iter_mut().zip(y) {
                    *a += wts[tok * top_k + j] * b;
                }
            }
        }
        out
    }

    /// `out` against [`row_by_row`]'s `want`: bit for bit where every kernel of the layer is
    /// bit-identical to ggml's row kernel at this level; where the AVX2 tiles may run
    /// ([`RowDots::tiled`]) or ggml's scalar tail may round apart
    /// ([`crate::kernels::tests::tail_may_round`]), each token's relative distance within
    /// 1e-5. The tiles' bound per product (`kernels/avx2_gemm.rs`) is 2 gamma_(blocks + 3),
    /// the tail's 2u (|p S| + |result|), both under 1e-6 of the terms' magnitudes at these
    /// sizes; measured here: 7e-8.
    fn assert_matches_row_by_row(w: &MoeWeights<'_>, out: &[f32], want: &[f32], what: &str) {
        let (kg, ku, kd) = w.validate().unwrap();
        let tiles = [kg, ku, kd].into_iter().any(|k| {
            RowDots::new(k).unwrap().tiled(usize::MAX) || crate::kernels::tests::tail_may_round(&k)
        });
        if !tiles {
            let same = out
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: not bit for bit");
            return;
        }
        for (tok, (a, b)) in out.chunks(w.gate.k).zip(want.chunks(w.gate.k)).enumerate() {
            let num: f64 = a
                .iter()
                .zip(b)
                .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
                .sum();
            let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
            assert!(
                num <= 1e-10 * den,
                "{what}: token {tok} at {:e}",
                (num / den).sqrt()
            );
        }
    }

    /// Gate, up (`tg`, `ffn x hidden`) and down (`td`, `hidden x ffn`) of `e` experts: seeded
    /// N(0, 1/k)-like weights, quantized.
    fn layer_bytes(
        tg: GgmlType,
        td: GgmlType,
        e: usize,
        hidden: usize,
        ffn: usize,
    ) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let mat = |t, n, k, seed| {
            let v = floats(e * n * k, seed, 1.0 / (k as f32).sqrt());
            quantize(t, &v, k, None).unwrap()
        };
        (
            mat(tg, ffn, hidden, 1),
            mat(tg, ffn, hidden, 2),
            mat(td, hidden, ffn, 3),
        )
    }

    /// Row counts that are not multiples of the 4-row kernels or of a pass (hidden 160, FFN
    /// 96), types with and without row-group kernels, 1 to 3 threads: every output equals the
    /// row-by-row computation ([`assert_matches_row_by_row`]), and bit for bit whatever the
    /// task layout.
    #[test]
    fn equals_the_row_by_row_computation_bit_for_bit() {
        let (e, hidden, ffn) = (6, 160, 96);
        for (tg, td) in [
            (GgmlType::Q4_0, GgmlType::Q8_0),
            (GgmlType::Q8_0, GgmlType::Q4_0),
            (GgmlType::Q5_0, GgmlType::IQ4_NL),
        ] {
            let (g, u, d) = layer_bytes(tg, td, e, hidden, ffn);
            let bias = floats(e * hidden.max(ffn), 4, 0.5);
            let w = MoeWeights {
                n_experts: e,
                gate: mats(tg, &g, ffn, hidden, e, Some(&bias[..e * ffn])),
                up: mats(tg, &u, ffn, hidden, e, None),
                down: mats(td, &d, hidden, ffn, e, Some(&bias[..e * hidden])),
                act: Activation::Silu,
            };
            for t in [1, 5, 33] {
                let k = 3;
                let x = floats(t * hidden, t as u64, 2.0);
                let ids: Vec<i32> = (0..t * k).map(|i| ((i * 7 + i / k) % e) as i32).collect();
                let wts = floats(t * k, 9, 1.0);
                let want = row_by_row(&w, &x, &ids, &wts);
                let mut first: Option<Vec<f32>> = None;
                for threads in 1..=3 {
                    let mut out = vec![f32::NAN; x.len()];
                    moe_forward(&ThreadPool::new(threads), &w, &x, &ids, &wts, &mut out).unwrap();
                    let what = format!("{tg}/{td} T={t} {threads} threads");
                    assert_matches_row_by_row(&w, &out, &want, &what);
                    let one = first.get_or_insert_with(|| out.clone());
                    let same = out.iter().zip(one).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what}: differs from one thread's");
                }
            }
        }
    }

    /// With `residual_acts`, a q8_K layer (Q4_K gate/up, Q6_K down) and a q8_0 one track a
    /// float64 computation of the dequantized weights to 5e-4 per token, where ggml's one
    /// rounding of x and h is over 20 times further off.
    #[test]
    fn residual_acts_track_float_math() {
        let (e, hidden, ffn, k, t) = (4, 256, 512, 2, 6);
        for (tg, td) in [
            (GgmlType::Q4_K, GgmlType::Q6_K),
            (GgmlType::Q4_0, GgmlType::Q8_0),
        ] {
            let (g, u, d) = layer_bytes(tg, td, e, hidden, ffn);
            let w = MoeWeights {
                n_experts: e,
                gate: mats(tg, &g, ffn, hidden, e, None),
                up: mats(tg, &u, ffn, hidden, e, None),
                down: mats(td, &d, hidden, ffn, e, None),
                act: Activation::Silu,
            };
            let deq = |ty, data: &[u8], n: usize| {
                let mut f = vec![0f32; n];
                freetoken_ggml::dequantize(ty, data, &mut f).unwrap();
                f.into_iter().map(f64::from).collect::<Vec<f64>>()
            };
            let (gf, uf, df) = (
                deq(tg, &g, e * ffn * hidden),
                deq(tg, &u, e * ffn * hidden),
                deq(td, &d, e * hidden * ffn),
            );
            let x = floats(t * hidden, 5, 1.7);
            let ids: Vec<i32> = (0..t * k).map(|i| ((i * 3 + i / k) % e) as i32).collect();
            let wts = floats(t * k, 9, 1.0);
            let mut want = vec![0f64; x.len()];
            for (i, &id) in ids.iter().enumerate() {
                let (tok, ex) = (i / k, id as usize);
                let xt = &x[tok * hidden..(tok + 1) * hidden];
                let dot = |m: &[f64], r: usize, v: &[f64]| -> f64 {
                    m[r * v.len()..(r + 1) * v.len()]
                        .iter()
                        .zip(v)
                        .map(|(a, b)| a * b)
                        .sum()
                };
                let xd: Vec<f64> = xt.iter().map(|&v| f64::from(v)).collect();
                let h: Vec<f64> = (0..ffn)
                    .map(|r| {
                        let (gv, uv) = (
                            dot(&gf[ex * ffn * hidden..], r, &xd),
                            dot(&uf[ex * ffn * hidden..], r, &xd),
                        );
                        gv / (1.0 + (-gv).exp()) * uv
                    })
                    .collect();
                for r in 0..hidden {
                    want[tok * hidden + r] +=
                        f64::from(wts[i]) * dot(&df[ex * hidden * ffn..], r, &h);
                }
            }
            let err = |residual_acts: bool| {
                let mut out = vec![0f32; x.len()];
                let opts = ForwardOptions {
                    residual_acts,
                    ..ForwardOptions::default()
                };
                moe_forward_with(&ThreadPool::new(2), &w, &x, &ids, &wts, &mut out, opts).unwrap();
                (0..t)
                    .map(|tok| {
                        let r = tok * hidden..(tok + 1) * hidden;
                        let num: f64 = out[r.clone()]
                            .iter()
                            .zip(&want[r.clone()])
                            .map(|(a, b)| (f64::from(*a) - b).powi(2))
                            .sum();
                        let den: f64 = want[r].iter().map(|b| b * b).sum();
                        (num / den).sqrt()
                    })
                    .fold(0f64, f64::max)
            };
            let (plain, precise) = (err(false), err(true));
            // Measured: 8e-5 and 4e-5 against 1.8e-2 and 1.1e-2 without.
            assert!(precise <= 5e-4, "{tg}/{td}: {precise}");
            assert!(plain > 20.0 * precise, "{tg}/{td}: {plain} vs {precise}");
        }
    }

    /// Routes marked `SKIP_ROUTE` (weights NaN, so a weight used shows): the output equals the
    /// row-by-row computation over the other routes ([`assert_matches_row_by_row`]), tokens
    /// with every route skipped get zeros, and the stats count only the computed routes; -1 without the flag
    /// and other negative ids with it are errors that leave the output untouched.
    #[test]
    fn skipped_routes_are_not_computed() {
        let (e, hidden, ffn, k) = (6, 160, 96, 4);
        let ty = GgmlType::Q8_0;
        let (g, u, d) = layer_bytes(ty, ty, e, hidden, ffn);
        let w = MoeWeights {
            n_experts: e,
            gate: mats(ty, &g, ffn, hidden, e, None),
            up: mats(ty, &u, ffn, hidden, e, None),
            down: mats(ty, &d, hidden, ffn, e, None),
            act: Activation::Silu,
        };
        let expert_bytes = (g.len() + u.len() + d.len()) as u64 / e as u64;
        for t in [1, 5, 33] {
            let x = floats(t * hidden, 7 + t as u64, 2.0);
            let all: Vec<i32> = (0..t * k).map(|i| ((i * 5 + i / k) % e) as i32).collect();
            let mut ids = all.clone();
            let mut wts = floats(t * k, 11, 1.0);
            for (i, id) in ids.iter_mut().enumerate() {
                // Expert 0 only on skipped routes, token 0 all skipped, others at random.
                if *id == 0 || i < k || (i * 7919) % 3 == 0 {
                    *id = SKIP_ROUTE;
                    wts[i] = f32::NAN;
                }
            }
            let want = row_by_row(&w, &x, &ids, &wts);
            assert!(want[..hidden].iter().all(|&v| v == 0.0));
            let pool = ThreadPool::new(2);
            let mut out = vec![f32::NAN; x.len()];
            let s = moe_forward_with(&pool, &w, &x, &ids, &wts, &mut out, SKIPPING).unwrap();
            assert_matches_row_by_row(&w, &out, &want, &format!("T={t}"));
            let computed: Vec<i32> = ids.iter().copied().filter(|&i| i >= 0).collect();
            let mut distinct = computed.clone();
            distinct.sort();
            distinct.dedup();
            assert!(!distinct.contains(&0) && all.contains(&0), "T={t}");
            assert_eq!(
                s,
                MoeStats {
                    routes: computed.len() as u64,
                    experts: distinct.len() as u64,
                    weight_bytes: distinct.len() as u64 * expert_bytes,
                },
                "T={t}"
            );

            // Every route skipped: zeros, nothing read.
            let none = vec![SKIP_ROUTE; t * k];
            let mut out = vec![f32::NAN; x.len()];
            let s = moe_forward_with(&pool, &w, &x, &none, &wts, &mut out, SKIPPING).unwrap();
            assert!(out.iter().all(|&v| v == 0.0) && s == MoeStats::default());

            // -1 without the flag, -2 with it: errors, the output untouched.
            let mut out = vec![7.0; x.len()];
            assert!(matches!(
                moe_forward(&pool, &w, &x, &ids, &wts, &mut out),
                Err(Error::InvalidInput(_))
            ));
            let mut bad = ids.clone();
            bad[t * k - 1] = -2;
            assert!(matches!(
                moe_forward_with(&pool, &w, &x, &bad, &wts, &mut out, SKIPPING),
                Err(Error::InvalidInput(_))
            ));
            assert!(out.iter().all(|&v| v == 7.0));
        }
    }
}
