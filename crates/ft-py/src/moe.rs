//! MoE layers over the expert store and the CPU expert executor, with synchronous and
//! background (submit / wait) calls that release the GIL.

use crate::errors::{to_py, IntoPy};
use crate::gguf::PyGgufFile;
use crate::host::{check_disjoint, Dtype, HostArray, Raw};
use crate::pack::pack_releasing;
use freetoken_ggml::{Error, GgmlType, Result};
use ft_core::counters::MoeCounters;
use ft_core::experts::ExpertTensor;
use ft_core::gguf::GgufFile;
use ft_cpu::{
    missed_routes, moe_forward_with, Activation, Background, ExpertMats, ForwardOptions,
    HandoffBlock, MoeWeights, PackedRows, ThreadPool, Ticket,
};
use pyo3::prelude::*;
use std::sync::{Arc, Mutex, OnceLock};

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

    /// Each layer's counts.
    fn snapshot(&self) -> Vec<PyLayerCounts> {
        self.inner
            .snapshot()
            .iter()
            .map(|s| PyLayerCounts {
                steps: s.steps,
                routes: s.routes,
                experts: s.experts,
                bytes: s.bytes,
                last_routes: s.last_routes,
                last_experts: s.last_experts,
                last_bytes: s.last_bytes,
            })
            .collect()
    }
}

/// One layer's counts since the start, and those of its last step.
#[pyclass(frozen, get_all, name = "LayerCounts")]
pub struct PyLayerCounts {
    /// Steps that routed at least one token.
    steps: u64,
    /// Routes computed.
    routes: u64,
    /// Distinct experts per step, summed.
    experts: u64,
    /// Expert weight bytes read.
    bytes: u64,
    /// Routes of the last step.
    last_routes: u64,
    /// Distinct experts of the last step.
    last_experts: u64,
    /// Expert weight bytes of the last step.
    last_bytes: u64,
}

/// One kind of a layer's expert matrices, for engines that copy experts elsewhere (GPU
/// slots).
#[pyclass(frozen, get_all, name = "ExpertMatrices")]
pub struct PyExpertMatrices {
    /// The ggml type id.
    qtype: u32,
    /// Rows per expert matrix.
    rows: usize,
    /// Row length.
    k: usize,
    /// Each expert's matrix as an (address, bytes) range of the mapping, valid while the
    /// layer lives (for `cudaHostRegister` and copies to the GPU).
    ranges: Vec<(usize, usize)>,
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

/// One MoE layer: its experts' weights in the mapping (or packed copies of them), biases,
/// activation, counter slot.
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
    /// Per kind (gate, up, down), the experts' packed matrices in expert order (one buffer of
    /// all, or one per expert); empty for a kind not packed.
    packed: OnceLock<[Vec<PackedRows>; 3]>,
}

impl PyMoeLayer {
    fn kinds(&self) -> [&ExpertTensor; 3] {
        [&self.gate, &self.up, &self.down]
    }

    fn mats(&self, kind: usize) -> ExpertMats<'_> {
        let t = self.kinds()[kind];
        let bias = self.biases[kind].map(|(f, off, len)| {
            let b = self.file.bytes(f, off, len);
            // SAFETY: checked at construction: F32, in bounds, 4-byte aligned.
            unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), len / 4) }
        });
        let experts = match self.packed.get().map(|p| &p[kind]) {
            Some(packed) if !packed.is_empty() => packed
                .iter()
                .flat_map(|p| (0..p.matrices()).map(|i| p.matrix(i)))
                .collect(),
            _ => t.slices(&self.file),
        };
        ExpertMats {
            ty: t.ty,
            n: t.rows,
            k: t.k,
            experts,
            bias,
        }
    }

    fn weights(&self) -> MoeWeights<'_> {
        MoeWeights {
            n_experts: self.up.n_experts(),
            gate: self.mats(0),
            up: self.mats(1),
            down: self.mats(2),
            act: self.act,
        }
    }

    /// The layer on `x`, `ids`, `weights` into `out` (their shapes checked by the forward).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        ids: &[i32],
        weights: &[f32],
        out: &mut [f32],
        opts: ForwardOptions,
        record: bool,
    ) -> Result<()> {
        let s = moe_forward_with(pool, &self.weights(), x, ids, weights, out, opts)?;
        // An empty batch (or one whose routes were all skipped) is not a step; skipped ids
        // (-1) are not counted per expert.
        if record && s.routes > 0 {
            self.counters
                .record(self.index, s.routes, s.experts, s.weight_bytes);
            self.counters
                .record_routes(self.index, ids, self.up.n_experts());
        }
        Ok(())
    }

    /// Each kind's experts packed on `pool` where the kernels in use pack its type (one
    /// buffer for a stacked tensor, else one per expert), their mapped pages dropped as they
    /// are copied; and the bytes dropped.
    fn pack_with(&self, pool: &ThreadPool) -> Result<([Vec<PackedRows>; 3], usize)> {
        let mut released = 0;
        let mut pack = |t: &ExpertTensor| -> Result<Vec<PackedRows>> {
            let runs = match t.stacked(&self.file) {
                Some(all) => vec![all],
                None => t.slices(&self.file),
            };
            let mut packed = Vec::new();
            for run in runs {
                let (p, dropped) = pack_releasing(pool, Some(&self.file), run, t.ty, t.rows, t.k)?;
                released += dropped;
                match p {
                    Some(p) => packed.push(p),
                    None => return Ok(Vec::new()),
                }
            }
            Ok(packed)
        };
        let kinds = [pack(&self.gate)?, pack(&self.up)?, pack(&self.down)?];
        Ok((kinds, released))
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
        // Shape errors name the layer's tensors.
        let names = gate
            .iter()
            .chain(gate_up.iter())
            .chain([&up, &down])
            .filter_map(|n| n.first().map(|s| format!("`{s}`")))
            .collect::<Vec<_>>()
            .join(", ");
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
            packed: OnceLock::new(),
        };
        // Check every shape now, not at the first token.
        layer
            .weights()
            .validate()
            .map_err(|e| match e {
                Error::Shape(m) => Error::Shape(format!("MoE layer {index} ({names}): {m}")),
                other => other,
            })
            .py_err()?;
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

    /// One kind ("gate", "up", "down") of the layer's expert matrices.
    fn matrices(&self, kind: &str) -> PyResult<PyExpertMatrices> {
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
        Ok(PyExpertMatrices {
            qtype: t.ty.id(),
            rows: t.rows,
            k: t.k,
            ranges,
        })
    }

    /// Packs each kind's experts for the CPU kernels in use where they read a packed layout
    /// faster (AVX2: Q4_0, Q8_0, Q4_K), for engines that compute this layer's experts on the
    /// CPU only: the executor then reads the copies, and the originals' mapped pages are
    /// dropped as they are copied (`matrices` keeps giving the mapping's ranges, read from
    /// the file again if touched). Returns the kinds packed (`packed`) and the bytes dropped.
    fn pack(&self, py: Python<'_>) -> PyResult<(Vec<&'static str>, usize)> {
        let mut released = 0;
        if self.packed.get().is_none() {
            let (made, dropped) = py
                .detach(|| self.pack_with(&crate::threads::pool()))
                .py_err()?;
            released = dropped;
            // Two callers packing at once: the first copies stay, the others are dropped.
            let _ = self.packed.set(made);
        }
        Ok((self.packed(), released))
    }

    /// The kinds ("gate", "up", "down") whose experts the executor reads packed.
    #[getter]
    fn packed(&self) -> Vec<&'static str> {
        let Some(packed) = self.packed.get() else {
            return Vec::new();
        };
        ["gate", "up", "down"]
            .into_iter()
            .zip(packed)
            .filter(|(_, p)| !p.is_empty())
            .map(|(name, _)| name)
            .collect()
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

/// One call's arrays from Python, checked: dtypes, contiguity, the output writable and
/// disjoint from the inputs (shapes are the forward's to check).
struct CallArrays {
    x: HostArray,
    ids: HostArray,
    weights: HostArray,
    out: HostArray,
}

impl CallArrays {
    fn new(
        x: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let a = CallArrays {
            x: HostArray::input(x, Dtype::F32, "x")?,
            ids: HostArray::input(ids, Dtype::I32, "ids")?,
            weights: HostArray::input(weights, Dtype::F32, "weights")?,
            out: HostArray::output(out, Dtype::F32, "out")?,
        };
        check_disjoint(&[&a.out], &[&a.x, &a.ids, &a.weights])?;
        Ok(a)
    }

    fn views(&self) -> CallViews {
        CallViews {
            x: self.x.raw(),
            ids: self.ids.raw(),
            weights: self.weights.raw(),
            out: self.out.raw(),
        }
    }
}

/// [`CallArrays`] as views for the work without the GIL.
#[derive(Clone, Copy)]
struct CallViews {
    x: Raw<f32>,
    ids: Raw<i32>,
    weights: Raw<f32>,
    out: Raw<f32>,
}

impl CallViews {
    /// # Safety
    /// The [`CallArrays`] these views came from are alive until the call returns.
    unsafe fn run(self, layer: &PyMoeLayer, pool: &ThreadPool, opts: ForwardOptions) -> Result<()> {
        // SAFETY: per the contract; `out` is writable and disjoint from the inputs (checked).
        let (x, ids, w, out) = unsafe {
            (
                self.x.slice(),
                self.ids.slice(),
                self.weights.slice(),
                self.out.slice_mut(),
            )
        };
        layer.run(pool, x, ids, w, out, opts, true)
    }
}

/// The CPU expert executor: its own thread pool (`--moe-cpu-threads`) and a background thread
/// for asynchronous calls.
#[pyclass(frozen, name = "MoeExecutor")]
pub struct PyMoeExecutor {
    pool: Arc<ThreadPool>,
    background: Background,
    residual_acts: bool,
    shared: bool,
}

/// A submitted call; `wait()` returns when it is done. Holds the call's arrays alive.
#[pyclass(name = "MoeTicket")]
pub struct PyMoeTicket {
    ticket: Mutex<Option<Ticket<Result<()>>>>,
    _arrays: Vec<HostArray>,
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
        // The job reads the arrays' memory: never release them before it is done.
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
    /// How calls from Python (`run`, `submit`) run: with the executor's activation rounding.
    fn options(&self, skip_negative: bool) -> ForwardOptions {
        ForwardOptions {
            skip_negative,
            residual_acts: self.residual_acts,
        }
    }
}

#[pymethods]
impl PyMoeExecutor {
    /// `residual_acts`: quantize each activation in two passes, the row and its rounding
    /// residual (`ft_cpu::ForwardOptions`): results track float math instead of carrying
    /// ggml's activation rounding, for a second dot product per row. `poll_us`: how long
    /// idle workers poll for the next job before they sleep (default: ft_cpu's). `shared`:
    /// run on the process pool (`set_num_threads`), whose `n_threads` it must have, instead
    /// of a pool of its own, for engines whose dense products and experts take turns on the
    /// same cores (the CPU engine): the idle pool's spinning workers would otherwise take
    /// cores from the busy one's; `poll_us` is then the process pool's.
    #[new]
    #[pyo3(signature = (n_threads, residual_acts=false, poll_us=None, shared=false))]
    fn new(
        n_threads: usize,
        residual_acts: bool,
        poll_us: Option<u64>,
        shared: bool,
    ) -> PyResult<Self> {
        let pool = if shared {
            let pool = crate::threads::pool();
            if pool.n_threads() != n_threads {
                return Err(to_py(Error::InvalidInput(format!(
                    "a shared expert executor runs on the process pool's {} threads, not {n_threads}",
                    pool.n_threads()
                ))));
            }
            pool
        } else {
            Arc::new(crate::threads::new_pool(n_threads, poll_us))
        };
        Ok(PyMoeExecutor {
            pool,
            background: Background::new("ft-moe"),
            residual_acts,
            shared,
        })
    }

    /// Whether it runs on the process pool.
    #[getter]
    fn shared(&self) -> bool {
        self.shared
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

    /// out[T, H] = the layer's routed experts on x[T, H] (float32), ids (int32) and weights
    /// (float32) `[T, k]`, synchronously, without the GIL. Host arrays: numpy arrays or CPU
    /// torch tensors, C-contiguous; `out` may not overlap the inputs. With `skip_negative`,
    /// routes whose id is -1 are not computed (their weights ignored, a token with none left
    /// gets zeros; the counters count the computed routes only); without it every id out of
    /// range, -1 included, is an error.
    #[pyo3(signature = (layer, x, ids, weights, out, skip_negative=false))]
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        py: Python<'_>,
        layer: &PyMoeLayer,
        x: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        skip_negative: bool,
    ) -> PyResult<()> {
        let arrays = CallArrays::new(x, ids, weights, out)?;
        let (views, opts) = (arrays.views(), self.options(skip_negative));
        // SAFETY: `arrays` outlives the call.
        py.detach(|| unsafe { views.run(layer, &self.pool, opts) })
            .py_err()
    }

    /// As `run`, on the background thread; the arrays stay alive (and held) until the ticket
    /// is waited for or dropped.
    #[pyo3(signature = (layer, x, ids, weights, out, skip_negative=false))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        layer: Py<PyMoeLayer>,
        x: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        skip_negative: bool,
    ) -> PyResult<PyMoeTicket> {
        let arrays = CallArrays::new(x, ids, weights, out)?;
        let (views, opts) = (arrays.views(), self.options(skip_negative));
        let pool = Arc::clone(&self.pool);
        // SAFETY: the ticket holds `arrays` until the job is done (its drop waits).
        let ticket = self
            .background
            .submit(move || unsafe { views.run(layer.get(), &pool, opts) });
        let CallArrays {
            x,
            ids,
            weights,
            out,
        } = arrays;
        Ok(PyMoeTicket {
            ticket: Mutex::new(Some(ticket)),
            _arrays: vec![x, ids, weights, out],
        })
    }

    /// Serves GPU hand-off requests (`ft_cpu::HandoffBlock`, docs/hybrid.md) on the background
    /// thread until the block's stop word is set: request (layer `l`, `t` tokens) computes
    /// `layers[l]`'s routes whose expert is not resident (`resident[l, e]` < 0) on
    /// `x[:t]` into `out[:t]`. Host arrays, held until the ticket is done: `block` int64
    /// `[HANDOFF_WORDS]`; `x`, `out` float32 `[max_tokens, hidden]`; `ids` int32 and `weights`
    /// float32 `[len(layers), max_tokens, top_k]`; `resident` int32 `[len(layers), n_experts]`,
    /// not changed while serving. `out` may not overlap the others.
    #[pyo3(signature = (layers, block, x, out, ids, weights, resident, max_tokens, top_k))]
    #[allow(clippy::too_many_arguments)]
    fn serve_handoffs(
        &self,
        py: Python<'_>,
        layers: Vec<Py<PyMoeLayer>>,
        block: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        resident: &Bound<'_, PyAny>,
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
        // The buffers, checked once here (the job takes sub-slices of them). The block is
        // written through atomics only, so it counts as an output.
        let block = HostArray::output(block, Dtype::I64, "block")?;
        let x = HostArray::input(x, Dtype::F32, "x")?;
        let out = HostArray::output(out, Dtype::F32, "out")?;
        let ids = HostArray::input(ids, Dtype::I32, "ids")?;
        let weights = HostArray::input(weights, Dtype::F32, "weights")?;
        let resident = HostArray::input(resident, Dtype::I32, "resident")?;
        block.expect_len(ft_cpu::HANDOFF_WORDS, "the hand-off block")?;
        x.expect_len(max_tokens * hidden, "max_tokens x hidden")?;
        out.expect_len(max_tokens * hidden, "max_tokens x hidden")?;
        ids.expect_len(n_layers * per_layer, "layers x max_tokens x top_k")?;
        weights.expect_len(n_layers * per_layer, "layers x max_tokens x top_k")?;
        resident.expect_len(n_layers * n_experts, "layers x n_experts")?;
        check_disjoint(&[&out, &block], &[&x, &ids, &weights, &resident])?;
        let (vb, vx, vout, vids, vw, vres) = (
            block.raw::<i64>(),
            x.raw::<f32>(),
            out.raw::<f32>(),
            ids.raw::<i32>(),
            weights.raw::<f32>(),
            resident.raw::<i32>(),
        );
        let layers: Vec<Py<PyMoeLayer>> = layers.into_iter().map(|l| l.clone_ref(py)).collect();
        let pool = Arc::clone(&self.pool);
        let opts = ForwardOptions {
            skip_negative: true,
            residual_acts: self.residual_acts,
        };
        let job = move || -> Result<()> {
            // SAFETY: the ticket holds every array until the job is done; the block is
            // shared with the GPU through whole-word atomics, and `out` is disjoint from the
            // rest (checked above).
            let hb = unsafe { HandoffBlock::from_raw(vb.addr())? };
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
                let at = r.layer * per_layer;
                let rows = r.n_tokens * hidden;
                // SAFETY: sub-views of the checked arrays; the GPU wrote the inputs before the
                // request and reads `out` only after the answer.
                let (x, req, w, out) = unsafe {
                    (
                        vx.sub(0, rows)?.slice(),
                        vids.sub(at, n)?.slice(),
                        vw.sub(at, n)?.slice(),
                        vout.sub(0, rows)?.slice_mut(),
                    )
                };
                // SAFETY: the engine writes a layer's row of `resident` only while none of
                // that layer's requests is being answered (a step marks the experts it
                // fetches before the layer's request: engine/hybrid.py), and this view of
                // the row lives for one answer.
                let row = unsafe { vres.sub(r.layer * n_experts, n_experts)?.slice() };
                if missed_routes(req, row, &mut routes[..n])? == 0 {
                    // Every route hit a slot: zeros, without waking the pool.
                    out.fill(0.0);
                    return Ok(());
                }
                layers[r.layer]
                    .get()
                    .run(&pool, x, &routes[..n], w, out, opts, false)
            })
            .map(|_| ())
        };
        Ok(PyMoeTicket {
            ticket: Mutex::new(Some(self.background.submit(job))),
            _arrays: vec![block, x, out, ids, weights, resident],
        })
    }
}
