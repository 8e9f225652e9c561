//! MoE layers over the expert store and the CPU expert executor, with synchronous and
//! background (submit / wait) calls that release the GIL.

use crate::errors::{to_py, IntoPy};
use crate::gguf::PyGgufFile;
use crate::memory::{slice, slice_mut};
use freetoken_ggml::{Error, GgmlType, Result};
use ft_core::counters::MoeCounters;
use ft_core::experts::ExpertTensor;
use ft_core::gguf::GgufFile;
use ft_cpu::{
    missed_routes, moe_forward_with, Activation, Background, ExpertMats, ForwardOptions,
    HandoffBlock, MoeWeights, ThreadPool, Ticket,
};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// Per-layer counters shared by a model's MoE layers.
#[pyclass(frozen, name = "MoeCounters")]
pub struct PyMoeCounters {
    inner: Arc<MoeCounters>,
}

#[pymethods]
impl PyMoeCounters {
    #[new]
    fn new(n_layers: usize) -> Self {
        PyMoeCounters {
            inner: Arc::new(MoeCounters::new(n_layers)),
        }
    }

    /// Routes per expert, per layer, since the start.
    fn expert_counts(&self) -> Vec<Vec<u64>> {
        self.inner.expert_counts()
    }

    /// Adds per-expert route counts of `layer` counted elsewhere (the GPU path).
    fn add_expert_counts(&self, layer: usize, counts: Vec<u64>) -> PyResult<()> {
        if layer >= self.inner.n_layers() {
            return Err(to_py(Error::Shape(format!(
                "layer {layer} is outside the counters' {} layers",
                self.inner.n_layers()
            ))));
        }
        self.inner.add_expert_counts(layer, &counts);
        Ok(())
    }

    /// Per layer: (steps, routes, distinct experts, weight bytes, and the same three for the
    /// last step).
    fn snapshot(&self) -> Vec<(u64, u64, u64, u64, u64, u64, u64)> {
        self.inner
            .snapshot()
            .iter()
            .map(|s| {
                (
                    s.steps,
                    s.routes,
                    s.experts,
                    s.bytes,
                    s.last_routes,
                    s.last_experts,
                    s.last_bytes,
                )
            })
            .collect()
    }
}

fn f32_bias(
    file: &GgufFile,
    name: Option<String>,
    n_experts: usize,
    n: usize,
) -> Result<Option<(usize, usize, usize)>> {
    let Some(name) = name else { return Ok(None) };
    let t = file.tensor(&name)?;
    if t.ggml_type != GgmlType::F32 || t.shape.iter().product::<usize>() != n_experts * n {
        return Err(Error::Gguf(format!(
            "expert bias `{name}` is {:?} {}, expected F32 [{n_experts}, {n}]",
            t.shape, t.ggml_type
        )));
    }
    if file
        .bytes(t.file, t.offset, t.nbytes)
        .as_ptr()
        .align_offset(4)
        != 0
    {
        return Err(Error::Gguf(format!(
            "expert bias `{name}` is not 4-byte aligned"
        )));
    }
    Ok(Some((t.file, t.offset, t.nbytes)))
}

/// (type id, rows, k, each expert's (address, bytes)): one kind of a layer's expert matrices.
type ExpertMatrices = (u32, usize, usize, Vec<(usize, usize)>);

/// One MoE layer: its experts' weights in the mapping, biases, activation, counter slot.
#[pyclass(frozen, name = "MoeLayer")]
pub struct PyMoeLayer {
    file: Arc<GgufFile>,
    index: usize,
    counters: Arc<MoeCounters>,
    gate: ExpertTensor,
    up: ExpertTensor,
    down: ExpertTensor,
    biases: [Option<(usize, usize, usize)>; 3],
    act: Activation,
}

impl PyMoeLayer {
    fn mats(&self, t: &ExpertTensor, bias: Option<(usize, usize, usize)>) -> ExpertMats<'_> {
        let bias = bias.map(|(f, off, len)| {
            let b = self.file.bytes(f, off, len);
            // SAFETY: checked at construction: F32, in bounds, 4-byte aligned.
            unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), len / 4) }
        });
        ExpertMats {
            ty: t.ty,
            n: t.rows,
            k: t.k,
            experts: t.slices(&self.file),
            bias,
        }
    }

    fn weights(&self) -> MoeWeights<'_> {
        MoeWeights {
            n_experts: self.up.n_experts(),
            gate: self.mats(&self.gate, self.biases[0]),
            up: self.mats(&self.up, self.biases[1]),
            down: self.mats(&self.down, self.biases[2]),
            act: self.act,
        }
    }

    fn run(&self, pool: &ThreadPool, args: &CallArgs) -> Result<()> {
        // `out` becomes a &mut slice: it may not overlap the inputs.
        let out_end = args.out + args.x_len * 4;
        let inputs = [
            (args.x, args.x_len * 4),
            (args.ids, args.n_routes * 4),
            (args.weights, args.n_routes * 4),
        ];
        if args.x_len > 0
            && inputs
                .iter()
                .any(|&(a, n)| n > 0 && a < out_end && args.out < a + n)
        {
            return Err(Error::InvalidInput(
                "the MoE output overlaps an input".into(),
            ));
        }
        // SAFETY: the Python wrapper derives each address from a live tensor of the stated
        // length and keeps it alive until the call (or the ticket) is done.
        let (x, ids, w, out) = unsafe {
            (
                slice::<f32>(args.x, args.x_len, "x")?,
                slice::<i32>(args.ids, args.n_routes, "ids")?,
                slice::<f32>(args.weights, args.n_routes, "weights")?,
                slice_mut::<f32>(args.out, args.x_len, "out")?,
            )
        };
        let opts = ForwardOptions {
            skip_negative: args.skip_negative,
            residual_acts: args.residual_acts,
        };
        let s = moe_forward_with(pool, &self.weights(), x, ids, w, out, opts)?;
        // An empty batch (or one whose routes were all skipped) is not a step; skipped ids
        // (-1) are not counted per expert.
        if args.record && s.routes > 0 {
            self.counters
                .record(self.index, s.routes, s.experts, s.weight_bytes);
            self.counters
                .record_routes(self.index, ids, self.up.n_experts());
        }
        Ok(())
    }
}

#[pymethods]
impl PyMoeLayer {
    /// `gate`, `up`, `down`: one stacked tensor name each, or one name per expert; or
    /// `gate_up` for a fused tensor (gate rows first). `act`: "silu", "gelu", "swiglu_oai".
    #[new]
    #[pyo3(signature = (file, index, counters, up, down, gate=None, gate_up=None, gate_bias=None, up_bias=None, down_bias=None, act="silu", alpha=1.702, limit=7.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        file: &PyGgufFile,
        index: usize,
        counters: &PyMoeCounters,
        up: Vec<String>,
        down: Vec<String>,
        gate: Option<Vec<String>>,
        gate_up: Option<Vec<String>>,
        gate_bias: Option<String>,
        up_bias: Option<String>,
        down_bias: Option<String>,
        act: &str,
        alpha: f32,
        limit: f32,
    ) -> PyResult<Self> {
        let f = &file.inner;
        let (gate, up) = match (gate, gate_up) {
            (Some(g), None) => (ExpertTensor::resolve(f, &g), ExpertTensor::resolve(f, &up)),
            (None, Some(gu)) => {
                let mut halves = ExpertTensor::resolve(f, &gu)
                    .and_then(|t| t.split_rows(2))
                    .py_err()?;
                let up = halves.pop().expect("two halves");
                (Ok(halves.pop().expect("two halves")), Ok(up))
            }
            _ => {
                return Err(to_py(Error::InvalidInput(
                    "give exactly one of gate and gate_up".into(),
                )))
            }
        };
        let (gate, up) = (gate.py_err()?, up.py_err()?);
        let down = ExpertTensor::resolve(f, &down).py_err()?;
        let e = up.n_experts();
        if index >= counters.inner.n_layers() {
            return Err(to_py(Error::Shape(format!(
                "MoE layer {index} is outside the counters' {} layers",
                counters.inner.n_layers()
            ))));
        }
        let act = match act {
            "silu" => Activation::Silu,
            "gelu" => Activation::Gelu,
            "swiglu_oai" => Activation::SwigluOai { alpha, limit },
            other => {
                return Err(to_py(Error::Unsupported(format!(
                    "expert activation `{other}`"
                ))))
            }
        };
        let biases = [
            f32_bias(f, gate_bias, e, gate.rows).py_err()?,
            f32_bias(f, up_bias, e, up.rows).py_err()?,
            f32_bias(f, down_bias, e, down.rows).py_err()?,
        ];
        let layer = PyMoeLayer {
            file: Arc::clone(f),
            index,
            counters: Arc::clone(&counters.inner),
            gate,
            up,
            down,
            biases,
            act,
        };
        // Check every shape now, not at the first token.
        layer.weights().validate().py_err()?;
        Ok(layer)
    }

    #[getter]
    fn n_experts(&self) -> usize {
        self.up.n_experts()
    }

    /// The layer's index in the model (its counters' slot).
    #[getter]
    fn index(&self) -> usize {
        self.index
    }

    /// (gate, up, down) type ids.
    #[getter]
    fn types(&self) -> (u32, u32, u32) {
        (self.gate.ty.id(), self.up.ty.id(), self.down.ty.id())
    }

    /// Bytes of one expert (gate + up + down).
    #[getter]
    fn expert_bytes(&self) -> usize {
        self.gate.expert_bytes() + self.up.expert_bytes() + self.down.expert_bytes()
    }

    /// Per kind ("gate", "up", "down"): (type id, rows, k, and each expert's matrix as an
    /// (address, bytes) range of the mapping), for engines that copy experts elsewhere (GPU
    /// slots). The addresses stay valid while this layer lives.
    fn matrices(&self, kind: &str) -> PyResult<ExpertMatrices> {
        let t = match kind {
            "gate" => &self.gate,
            "up" => &self.up,
            "down" => &self.down,
            other => {
                return Err(to_py(Error::InvalidInput(format!(
                    "expert matrix kind `{other}` (gate, up or down)"
                ))))
            }
        };
        let ranges = t
            .slices(&self.file)
            .iter()
            .map(|s| (s.as_ptr() as usize, s.len()))
            .collect();
        Ok((t.ty.id(), t.rows, t.k, ranges))
    }

    /// The activation between gate/up and down: "silu", "gelu" or "swiglu_oai".
    #[getter]
    fn act(&self) -> &'static str {
        match self.act {
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
            Activation::SwigluOai { .. } => "swiglu_oai",
        }
    }

    /// Whether the experts have biases (gpt-oss).
    #[getter]
    fn has_biases(&self) -> bool {
        self.biases.iter().any(Option::is_some)
    }
}

#[derive(Clone, Copy)]
struct CallArgs {
    x: usize,
    x_len: usize,
    ids: usize,
    weights: usize,
    n_routes: usize,
    out: usize,
    skip_negative: bool,
    /// The executor's `residual_acts`.
    residual_acts: bool,
    /// Count the call in the layer's counters (the hybrid hand-off does not: the GPU counts
    /// every route of its layers).
    record: bool,
}

/// The CPU expert executor: its own thread pool (`--moe-cpu-threads`) and a background thread
/// for asynchronous calls.
#[pyclass(frozen, name = "MoeExecutor")]
pub struct PyMoeExecutor {
    pool: Arc<ThreadPool>,
    background: Background,
    residual_acts: bool,
}

/// A submitted call; `wait()` returns when it is done. Holds the call's tensors alive.
#[pyclass(name = "MoeTicket")]
pub struct PyMoeTicket {
    ticket: Mutex<Option<Ticket<Result<()>>>>,
    _owners: Py<PyAny>,
}

#[pymethods]
impl PyMoeTicket {
    /// Blocks (without the GIL) until the call is done; raises its error.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let t = self.ticket.lock().unwrap_or_else(|e| e.into_inner()).take();
        match t {
            Some(t) => py.detach(|| t.wait()).py_err(),
            None => Ok(()),
        }
    }
}

impl Drop for PyMoeTicket {
    fn drop(&mut self) {
        // The job reads the owners' memory: never release them before it is done.
        if let Some(t) = self
            .ticket
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = t.wait();
        }
    }
}

impl PyMoeExecutor {
    /// The arguments of a call from Python (`run`, `submit`): counted in the layer's counters,
    /// with the executor's activation rounding.
    #[allow(clippy::too_many_arguments)]
    fn counted(
        &self,
        x: usize,
        x_len: usize,
        ids: usize,
        weights: usize,
        n_routes: usize,
        out: usize,
        skip_negative: bool,
    ) -> CallArgs {
        CallArgs {
            x,
            x_len,
            ids,
            weights,
            n_routes,
            out,
            skip_negative,
            residual_acts: self.residual_acts,
            record: true,
        }
    }
}

#[pymethods]
impl PyMoeExecutor {
    /// `residual_acts`: quantize each activation in two passes, the row and its rounding
    /// residual (`ft_cpu::ForwardOptions`): results track float math instead of carrying
    /// ggml's activation rounding, for a second dot product per row. `poll_us`: how long
    /// idle workers poll for the next job before they sleep (default: ft_cpu's).
    #[new]
    #[pyo3(signature = (n_threads, residual_acts=false, poll_us=None))]
    fn new(n_threads: usize, residual_acts: bool, poll_us: Option<u64>) -> Self {
        PyMoeExecutor {
            pool: Arc::new(crate::threads::new_pool(n_threads, poll_us)),
            background: Background::new("ft-moe"),
            residual_acts,
        }
    }

    #[getter]
    fn n_threads(&self) -> usize {
        self.pool.n_threads()
    }

    #[getter]
    fn poll_us(&self) -> u64 {
        self.pool.poll().as_micros() as u64
    }

    #[getter]
    fn residual_acts(&self) -> bool {
        self.residual_acts
    }

    /// out[T, H] = the layer's routed experts on x[T, H] (`x_len` = T*H floats), ids and
    /// weights `[T, k]` (`n_routes` = T*k), synchronously, without the GIL. With
    /// `skip_negative`, routes whose id is -1 are not computed (their weights ignored, a token
    /// with none left gets zeros; the counters count the computed routes only); without it
    /// every id out of range, -1 included, is an error.
    #[pyo3(signature = (layer, x, x_len, ids, weights, n_routes, out, skip_negative=false))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        layer: &PyMoeLayer,
        x: usize,
        x_len: usize,
        ids: usize,
        weights: usize,
        n_routes: usize,
        out: usize,
        skip_negative: bool,
    ) -> PyResult<()> {
        let args = self.counted(x, x_len, ids, weights, n_routes, out, skip_negative);
        py.detach(|| layer.run(&self.pool, &args)).py_err()
    }

    /// As `run`, on the background thread; `owners` (the tensors behind the addresses) stay
    /// alive until the ticket is waited for or dropped.
    #[pyo3(signature = (layer, owners, x, x_len, ids, weights, n_routes, out, skip_negative=false))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        layer: Py<PyMoeLayer>,
        owners: Py<PyAny>,
        x: usize,
        x_len: usize,
        ids: usize,
        weights: usize,
        n_routes: usize,
        out: usize,
        skip_negative: bool,
    ) -> PyMoeTicket {
        let args = self.counted(x, x_len, ids, weights, n_routes, out, skip_negative);
        let pool = Arc::clone(&self.pool);
        let ticket = self
            .background
            .submit(move || layer.get().run(&pool, &args));
        PyMoeTicket {
            ticket: Mutex::new(Some(ticket)),
            _owners: owners,
        }
    }

    /// Serves GPU hand-off requests (`ft_cpu::HandoffBlock`, docs/hybrid.md) on the background
    /// thread until the block's stop word is set: request (layer `l`, `t` tokens) computes
    /// `layers[l]`'s routes whose expert is not resident (`resident[l, e]` < 0) on
    /// `x[:t]` into `out[:t]`. Buffers (addresses of memory `owners` keeps alive): `block`
    /// int64[8]; `x`, `out` float32 `[max_tokens, hidden]`; `ids` int32 and `weights` float32
    /// `[len(layers), max_tokens, top_k]`; `resident` int32 `[len(layers), n_experts]`, not
    /// changed while serving.
    #[pyo3(signature = (layers, owners, block, x, out, ids, weights, resident, max_tokens, top_k))]
    #[allow(clippy::too_many_arguments)]
    fn serve_handoffs(
        &self,
        py: Python<'_>,
        layers: Vec<Py<PyMoeLayer>>,
        owners: Py<PyAny>,
        block: usize,
        x: usize,
        out: usize,
        ids: usize,
        weights: usize,
        resident: usize,
        max_tokens: usize,
        top_k: usize,
    ) -> PyResult<PyMoeTicket> {
        let first = layers
            .first()
            .ok_or_else(|| to_py(Error::InvalidInput("no layers to serve".into())))?;
        let (hidden, n_experts) = (first.get().up.k, first.get().up.n_experts());
        for l in &layers {
            let l = l.get();
            if l.up.k != hidden || l.up.n_experts() != n_experts {
                return Err(to_py(Error::Shape(format!(
                    "layer {} is hidden {} x {} experts, layer {} {hidden} x {n_experts}: one \
                     hand-off serves layers of one shape",
                    l.index,
                    l.up.k,
                    l.up.n_experts(),
                    first.get().index
                ))));
            }
        }
        if max_tokens == 0 || top_k == 0 {
            return Err(to_py(Error::Shape(
                "max_tokens and top_k must be positive".into(),
            )));
        }
        let n_layers = layers.len();
        let per_layer = max_tokens * top_k;
        // The buffers' sizes, checked once here (the job takes sub-slices of them).
        // SAFETY: the addresses come from live arrays `owners` keeps until the ticket is done.
        unsafe {
            slice::<i64>(block, ft_cpu::HANDOFF_WORDS, "block").py_err()?;
            slice::<f32>(x, max_tokens * hidden, "x").py_err()?;
            slice::<f32>(out, max_tokens * hidden, "out").py_err()?;
            slice::<i32>(ids, n_layers * per_layer, "ids").py_err()?;
            slice::<f32>(weights, n_layers * per_layer, "weights").py_err()?;
            slice::<i32>(resident, n_layers * n_experts, "resident").py_err()?;
        }
        let layers: Vec<Py<PyMoeLayer>> = layers.into_iter().map(|l| l.clone_ref(py)).collect();
        let pool = Arc::clone(&self.pool);
        let residual_acts = self.residual_acts;
        let job = move || -> Result<()> {
            // SAFETY: checked above; the owners outlive the job.
            let (hb, resident) = unsafe {
                (
                    HandoffBlock::from_raw(block)?,
                    slice::<i32>(resident, n_layers * n_experts, "resident")?,
                )
            };
            let mut routes = vec![0i32; per_layer];
            hb.serve(|r| {
                if r.layer >= n_layers || r.n_tokens == 0 || r.n_tokens > max_tokens {
                    return Err(Error::InvalidInput(format!(
                        "hand-off request for layer {} with {} tokens ({n_layers} layers, at \
                         most {max_tokens} tokens)",
                        r.layer, r.n_tokens
                    )));
                }
                let n = r.n_tokens * top_k;
                let at = (r.layer * per_layer) * 4;
                // SAFETY: within the checked `ids` buffer; the GPU wrote it before the request.
                let req = unsafe { slice::<i32>(ids + at, n, "ids")? };
                let row = &resident[r.layer * n_experts..(r.layer + 1) * n_experts];
                if missed_routes(req, row, &mut routes[..n])? == 0 {
                    // Every route hit a slot: zeros, without waking the pool.
                    // SAFETY: within the checked `out` buffer, which the GPU reads only after
                    // the answer.
                    unsafe { slice_mut::<f32>(out, r.n_tokens * hidden, "out")? }.fill(0.0);
                    return Ok(());
                }
                let args = CallArgs {
                    x,
                    x_len: r.n_tokens * hidden,
                    ids: routes.as_ptr() as usize,
                    weights: weights + at,
                    n_routes: n,
                    out,
                    skip_negative: true,
                    residual_acts,
                    record: false,
                };
                layers[r.layer].get().run(&pool, &args)
            })
            .map(|_| ())
        };
        Ok(PyMoeTicket {
            ticket: Mutex::new(Some(self.background.submit(job))),
            _owners: owners,
        })
    }
}
