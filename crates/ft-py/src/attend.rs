//! One token's attention on the CPU (`ft_cpu::OneTokenAttention`) and the RMS norm it uses.

use crate::errors::{to_py, IntoPy};
use crate::host::{check_disjoint, Dtype, Element, HostArray};
use freetoken_ggml::Error;
use ft_cpu::{f16, CacheElem, LayerCache, OneTokenAttention, Rope};
use pyo3::prelude::*;

/// Optional float32 arrays, checked.
fn optional(obj: Option<&Bound<'_, PyAny>>, what: &'static str) -> PyResult<Option<HostArray>> {
    obj.map(|o| HostArray::input(o, Dtype::F32, what))
        .transpose()
}

/// One token of one sequence through a layer's attention: the query `q [heads * head_dim]`
/// and key `k [kv_heads * head_dim]` RMS-normed per head (`q_norm`, `k_norm`: `[head_dim]`
/// weights, or None) and rotated (`cos`, `sin`: the position's `n_rot / 2` angles, NEOX pairs
/// or adjacent ones; None: no RoPE), the key and `v [kv_heads * head_dim_v]` stored at rows
/// `write` of the layer's caches (`k_cache [rows, kv_heads, head_dim]`, `v_cache [rows,
/// kv_heads, head_dim_v]`), and the query's attention (scores times `scale`, softmax, with
/// `sinks [heads]` in its denominator) over rows `read_lo..read_hi` written to `out [heads *
/// head_dim_v]`. All float32 but the caches, float32 or float16 each (stored rounded, read
/// exactly); the caches and `out` are written and may overlap nothing else.
#[pyfunction]
#[pyo3(signature = (
    q, k, v, k_cache, v_cache, write, read_lo, read_hi, heads, kv_heads, q_norm, k_norm, eps,
    cos, sin, neox, scale, sinks, out
))]
#[allow(clippy::too_many_arguments)]
pub fn attend_one(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    write: Vec<usize>,
    read_lo: usize,
    read_hi: usize,
    heads: usize,
    kv_heads: usize,
    q_norm: Option<&Bound<'_, PyAny>>,
    k_norm: Option<&Bound<'_, PyAny>>,
    eps: f32,
    cos: Option<&Bound<'_, PyAny>>,
    sin: Option<&Bound<'_, PyAny>>,
    neox: bool,
    scale: f32,
    sinks: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let q = HostArray::input(q, Dtype::F32, "q")?;
    let k = HostArray::input(k, Dtype::F32, "k")?;
    let v = HostArray::input(v, Dtype::F32, "v")?;
    let kc = HostArray::output_of(k_cache, &[Dtype::F32, Dtype::F16], "k_cache")?;
    let vc = HostArray::output_of(v_cache, &[Dtype::F32, Dtype::F16], "v_cache")?;
    let out = HostArray::output(out, Dtype::F32, "out")?;
    let (qn, kn) = (optional(q_norm, "q_norm")?, optional(k_norm, "k_norm")?);
    let (cos, sin) = (optional(cos, "cos")?, optional(sin, "sin")?);
    let sinks = optional(sinks, "sinks")?;
    if cos.is_some() != sin.is_some() {
        return Err(to_py(Error::InvalidInput(
            "cos and sin come together (or neither)".into(),
        )));
    }
    if heads == 0 || kv_heads == 0 || !q.len().is_multiple_of(heads) {
        return Err(to_py(Error::Shape(format!(
            "q of {} values over {heads} heads ({kv_heads} key heads)",
            q.len()
        ))));
    }
    let head_dim = q.len() / heads;
    let head_dim_v = v.len() / kv_heads;
    let rest: Vec<&HostArray> = [&q, &k, &v]
        .into_iter()
        .chain([&qn, &kn, &cos, &sin, &sinks].into_iter().flatten())
        .collect();
    check_disjoint(&[&kc, &vc, &out], &rest)?;
    let raw = |a: &Option<HostArray>| a.as_ref().map(HostArray::raw::<f32>);
    let (rq, rk, rv) = (q.raw::<f32>(), k.raw::<f32>(), v.raw::<f32>());
    let rout = out.raw::<f32>();
    let (rqn, rkn, rcos, rsin, rsinks) = (raw(&qn), raw(&kn), raw(&cos), raw(&sin), raw(&sinks));
    let pool = crate::threads::pool();
    py.detach(|| {
        // SAFETY: every array outlives the call; the caches and `out` are writable and
        // disjoint from each other and the inputs (checked above).
        unsafe {
            let rope = rcos.zip(rsin).map(|(c, s)| Rope {
                cos: c.slice(),
                sin: s.slice(),
                neox,
            });
            let a = OneTokenAttention {
                heads,
                kv_heads,
                head_dim,
                head_dim_v,
                q_norm: rqn.map(|w| w.slice()),
                k_norm: rkn.map(|w| w.slice()),
                eps,
                rope,
                scale,
                sinks: rsinks.map(|s| s.slice()),
            };
            let (q, k, v, out) = (rq.slice(), rk.slice(), rv.slice(), rout.slice_mut());
            let read = read_lo..read_hi;
            // The cache's element types, as checked.
            macro_rules! typed {
                ($k:ty, $v:ty) => {
                    a.run(q, k, v, cache::<$k, $v>(&kc, &vc, &write, read), out, &pool)
                };
            }
            match (kc.dtype(), vc.dtype()) {
                (Dtype::F32, Dtype::F32) => typed!(f32, f32),
                (Dtype::F16, Dtype::F16) => typed!(f16, f16),
                (Dtype::F32, _) => typed!(f32, f16),
                _ => typed!(f16, f32),
            }
        }
    })
    .py_err()
}

/// The layer cache over `kc` and `vc`, of the element types they were checked to hold.
///
/// # Safety
/// The arrays outlive the cache and overlap nothing else in use.
unsafe fn cache<'a, K: Element + CacheElem, V: Element + CacheElem>(
    kc: &HostArray,
    vc: &HostArray,
    write: &'a [usize],
    read: std::ops::Range<usize>,
) -> LayerCache<'a, K, V> {
    // SAFETY: per the contract.
    unsafe {
        LayerCache {
            keys: kc.raw::<K>().slice_mut(),
            values: vc.raw::<V>().slice_mut(),
            write,
            read,
        }
    }
}

/// `out = x / rms(x) * weight` over each row of `x` (float32, rows of `weight.len()`), in
/// ggml's order (`ft_cpu::rms_norm`). `out` is as large as `x` and overlaps nothing.
#[pyfunction]
pub fn rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = HostArray::input(x, Dtype::F32, "x")?;
    let w = HostArray::input(weight, Dtype::F32, "weight")?;
    let out = HostArray::output(out, Dtype::F32, "out")?;
    let n = w.len();
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(to_py(Error::Shape(format!(
            "x of {} values is not a whole number of rows of {n}",
            x.len()
        ))));
    }
    out.expect_len(x.len(), "x's shape")?;
    check_disjoint(&[&out], &[&x, &w])?;
    let (rx, rw, rout) = (x.raw::<f32>(), w.raw::<f32>(), out.raw::<f32>());
    py.detach(|| {
        // SAFETY: the arrays outlive the call; `out` is writable and overlaps neither input.
        let (x, w, out) = unsafe { (rx.slice(), rw.slice(), rout.slice_mut()) };
        out.copy_from_slice(x);
        for row in out.chunks_exact_mut(n) {
            ft_cpu::rms_norm(row, w, eps);
        }
    });
    Ok(())
}
