//! Quantized GEMV throughput measured against the machine's read bandwidth.
//!
//! `bandwidth/read/<T>t` streams a buffer far larger than the last-level cache; `gemv/<type>/<T>t`
//! runs y[1, N] = x[1, K] . W^T through ft-cpu on a weight matrix also far larger than the cache.
//! `moe/{decode,miss2,prefill64}/<T>t` runs the expert executor on Qwen3-30B-A3B's MoE layer
//! shape. `prompt/<type>/<T>t` runs a 128-token product on one of the default model's shapes,
//! in the weights' cache-resident regime a prompt chunk is in (FLOP/s, not bytes).
//! The others report bytes read per second (GB/s, 1e9 bytes). A summary after criterion's report divides
//! each figure by the probe's at the same thread count: decode is bound by streaming the
//! weights, so that fraction says how much of the machine's bandwidth the kernels use.

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, Bencher, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use freetoken_ggml::{quantize, GgmlType};
use ft_cpu::{
    moe_forward, moe_forward_with, Activation, ExpertMats, ForwardOptions, MoeWeights, PackedRows,
    QuantWeight, ThreadPool,
};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// 16 times the 32 MiB L3 of the machine these figures were first taken on.
const PROBE_BYTES: usize = 512 << 20;
/// u64 values per probe task: enough tasks to balance the threads, each long enough to stream.
const PROBE_CHUNK: usize = (8 << 20) / 8;
// `sum` reads whole groups of four per half, so every chunk must be a multiple of eight values
// for the probe to read every byte it counts.
const _: () = assert!(PROBE_BYTES.is_multiple_of(8 * PROBE_CHUNK) && PROBE_CHUNK.is_multiple_of(8));

/// Output rows: with K = 4096 even IQ2_XXS (2.06 bits per weight) is 69 MB of weights.
const N: usize = 65536;
/// Input features, a multiple of every block size (32 and 256).
const K: usize = 4096;
/// Rows actually quantized; the matrix repeats them, since quantizing all N rows (IQ2_XXS above
/// all) would dominate the run time and the kernels' speed does not depend on the values (Q4_0,
/// Q8_0 and Q6_K ran as fast on a matrix of 256 distinct tiles as on this one).
const TILE_ROWS: usize = 256;

/// The seven types, plus Q4_1, Q5_0, Q2_K, Q3_K and IQ2_XXS (which needs an imatrix).
const TYPES: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// A prompt chunk's tokens, and the product's shape: Gemma 3 270M's down projection (2048 to
/// 640), K a multiple of every block size.
const PROMPT_TOKENS: usize = 128;
const PROMPT_N: usize = 640;
const PROMPT_K: usize = 2048;

/// Qwen3-30B-A3B's MoE layer: 128 experts of hidden 2048 and expert FFN 768, top-8.
const MOE_EXPERTS: usize = 128;
const MOE_HIDDEN: usize = 2048;
const MOE_FFN: usize = 768;
const MOE_TOP_K: usize = 8;
/// Distinct quantized experts; the others repeat their bytes (as `TILE_ROWS` above).
const MOE_TILES: usize = 4;
/// A hybrid step's CPU job: one token whose `MOE_MISSES` routes missed the GPU cache. One-token
/// calls cycle through disjoint sets of experts (16 sets of 8, 21 MB each; 64 pairs), so that a
/// call reads experts the previous ones did not and none comes from the 32 MiB L3, as in a
/// decode step of the 8-layer model in README.md.
const MOE_MISSES: usize = 2;
/// Prefill: a 64-token batch.
const MOE_PREFILL_TOKENS: usize = 64;

/// Every timed call of one case, kept for the summary.
struct Record {
    case: String,
    threads: usize,
    bytes: u64,
    calls: Vec<(u64, Duration)>,
}

static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

/// One thread, and every thread the machine offers.
fn thread_counts() -> Vec<usize> {
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut counts = vec![1, all];
    counts.dedup();
    counts
}

/// Flat sampling: every iteration streams tens of MB, so criterion's linear sampling would only
/// stretch the run time.
fn configure(group: &mut BenchmarkGroup<'_, WallTime>, bytes: usize) {
    group.sampling_mode(SamplingMode::Flat);
    group.throughput(Throughput::BytesDecimal(bytes as u64));
}

/// Times `iters` calls of `f` for criterion and records the same timing for the summary.
fn timed(b: &mut Bencher<'_>, case: &str, threads: usize, bytes: usize, mut f: impl FnMut()) {
    b.iter_custom(|iters| {
        let start = Instant::now();
        for _ in 0..iters {
            f();
        }
        let elapsed = start.elapsed();
        let mut records = RECORDS.lock().unwrap();
        let i = match records
            .iter()
            .position(|r| r.case == case && r.threads == threads)
        {
            Some(i) => i,
            None => {
                records.push(Record {
                    case: case.to_string(),
                    threads,
                    bytes: bytes as u64,
                    calls: Vec::new(),
                });
                records.len() - 1
            }
        };
        records[i].calls.push((iters, elapsed));
        elapsed
    });
}

/// Sums `values` as two sequential streams, its halves, read side by side: one core reads about
/// a fifth faster from two streams than from one (33 vs 40 GB/s on the machine in README.md), and
/// the probe is meant as the ceiling. Four lanes per stream let the compiler vectorize the adds.
fn sum(values: &[u64]) -> u64 {
    let (a, b) = values.split_at(values.len() / 2);
    let mut lanes = [0u64; 8];
    let (la, lb) = lanes.split_at_mut(4);
    for (ca, cb) in a.chunks_exact(4).zip(b.chunks_exact(4)) {
        for (l, v) in la.iter_mut().zip(ca) {
            *l = l.wrapping_add(*v);
        }
        for (l, v) in lb.iter_mut().zip(cb) {
            *l = l.wrapping_add(*v);
        }
    }
    lanes.iter().fold(0, |s, v| s.wrapping_add(*v))
}

fn bandwidth(c: &mut Criterion) {
    // Written, not only allocated: untouched pages all map the one shared zero page, which
    // would be read from cache.
    let buf: Vec<u64> = (0..PROBE_BYTES as u64 / 8).collect();
    let mut group = c.benchmark_group("bandwidth");
    configure(&mut group, PROBE_BYTES);
    for threads in thread_counts() {
        let pool = ThreadPool::new(threads);
        group.bench_function(BenchmarkId::new("read", format!("{threads}t")), |b| {
            timed(b, "bandwidth/read", threads, PROBE_BYTES, || {
                let total = AtomicU64::new(0);
                pool.run(buf.len() / PROBE_CHUNK, &|i| {
                    let chunk = &buf[i * PROBE_CHUNK..(i + 1) * PROBE_CHUNK];
                    total.fetch_add(sum(chunk), Ordering::Relaxed);
                });
                black_box(total.into_inner());
            })
        });
    }
    group.finish();
}

/// Uniform floats in [-1, 1) from a fixed xorshift sequence.
fn random_floats(n: usize, mut state: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn gemv(c: &mut Criterion) {
    let pools: Vec<ThreadPool> = thread_counts().into_iter().map(ThreadPool::new).collect();
    let tile = random_floats(TILE_ROWS * K, 0x9e37_79b9_7f4a_7c15);
    let x = random_floats(K, 0x2545_f491_4f6c_dd1d);
    let imatrix = vec![1.0f32; K];
    let mut y = vec![0f32; N];
    let mut group = c.benchmark_group("gemv");
    for &t in TYPES {
        let im = t.requires_imatrix().then_some(&imatrix[..]);
        let w = quantize(t, &tile, K, im)
            .expect("quantize the weight tile")
            .repeat(N / TILE_ROWS);
        // `<type>-packed`: the rows packed at load for the kernels in use, where they have a
        // packed layout for the type (AVX2: Q4_0, Q8_0 and Q4_K).
        let packed = PackedRows::new(&pools[0], &w, t, N, K).expect("a valid weight matrix");
        let weights = [(t.name().to_string(), &w[..])].into_iter().chain(
            packed
                .as_ref()
                .map(|p| (format!("{t}-packed"), p.matrix(0))),
        );
        configure(&mut group, w.len());
        for (name, data) in weights {
            let weight = QuantWeight::new(data, t, N, K).expect("a valid weight matrix");
            let case = format!("gemv/{name}");
            for pool in &pools {
                let threads = pool.n_threads();
                group.bench_function(BenchmarkId::new(&name, format!("{threads}t")), |b| {
                    timed(b, &case, threads, w.len(), || {
                        weight
                            .matmul(pool, black_box(&x), &mut y)
                            .expect("shapes match");
                        black_box(&y);
                    })
                });
            }
        }
    }
    group.finish();
}

/// `prompt/<type>/<T>t`: y[128, 640] = x[128, 2048] . W^T, as a prompt chunk's products run
/// (activations quantized once, every row read for all tokens). The figure is 2 x T x N x K
/// FLOP per second.
fn prompt(c: &mut Criterion) {
    let pools: Vec<ThreadPool> = thread_counts().into_iter().map(ThreadPool::new).collect();
    let wf: Vec<f32> = random_floats(PROMPT_N * PROMPT_K, 0x4528_21e6_38d0_1377)
        .iter()
        .map(|v| v / (PROMPT_K as f32).sqrt())
        .collect();
    let x = random_floats(PROMPT_TOKENS * PROMPT_K, 0xbe54_66cf_34e9_0c6c);
    let imatrix = vec![1.0f32; PROMPT_K];
    let mut y = vec![0f32; PROMPT_TOKENS * PROMPT_N];
    let flop = 2 * PROMPT_TOKENS * PROMPT_N * PROMPT_K;
    let mut group = c.benchmark_group("prompt");
    for &t in TYPES {
        let im = t.requires_imatrix().then_some(&imatrix[..]);
        let w = quantize(t, &wf, PROMPT_K, im).expect("quantize the weight");
        // `<type>-packed` as in `gemv`.
        let packed =
            PackedRows::new(&pools[0], &w, t, PROMPT_N, PROMPT_K).expect("a valid weight matrix");
        let weights = [(t.name().to_string(), &w[..])].into_iter().chain(
            packed
                .as_ref()
                .map(|p| (format!("{t}-packed"), p.matrix(0))),
        );
        configure(&mut group, flop);
        for (name, data) in weights {
            let weight =
                QuantWeight::new(data, t, PROMPT_N, PROMPT_K).expect("a valid weight matrix");
            let case = format!("prompt/{name}");
            for pool in &pools {
                let threads = pool.n_threads();
                group.bench_function(BenchmarkId::new(&name, format!("{threads}t")), |b| {
                    timed(b, &case, threads, flop, || {
                        weight
                            .matmul(pool, black_box(&x), &mut y)
                            .expect("shapes match");
                        black_box(&y);
                    })
                });
            }
        }
    }
    group.finish();
}

/// One expert matrix of every expert, `data` holding them back to back.
fn expert_mats(t: GgmlType, data: &[u8], n: usize, k: usize) -> ExpertMats<'_> {
    ExpertMats {
        ty: t,
        n,
        k,
        experts: data.chunks_exact(data.len() / MOE_EXPERTS).collect(),
        bias: None,
    }
}

/// `moe/decode/<T>t`: one token through the layer (`MOE_TOP_K` experts, each read once),
/// `moe/miss2/<T>t`: one token's two routes (a small job, whose fixed costs show),
/// `moe/prefill64/<T>t`: 64 tokens with random routes (nearly every expert read once); each
/// also `-packed` over the experts packed at load, where the kernels in use pack. All
/// in Q4_0, counting the bytes of the distinct experts a call reads, as the executor's
/// counters do.
fn moe(c: &mut Criterion) {
    let pools: Vec<ThreadPool> = thread_counts().into_iter().map(ThreadPool::new).collect();
    let t = GgmlType::Q4_0;
    let quantized = |rows: usize, k: usize, seed: u64| {
        let w = random_floats(MOE_TILES * rows * k, seed);
        let scaled: Vec<f32> = w.iter().map(|v| v / (k as f32).sqrt()).collect();
        quantize(t, &scaled, k, None)
            .expect("quantize the expert tiles")
            .repeat(MOE_EXPERTS / MOE_TILES)
    };
    let gate = quantized(MOE_FFN, MOE_HIDDEN, 0x243f_6a88_85a3_08d3);
    let up = quantized(MOE_FFN, MOE_HIDDEN, 0x1319_8a2e_0370_7344);
    let down = quantized(MOE_HIDDEN, MOE_FFN, 0xa409_3822_299f_31d0);
    let layer = |gate, up, down| MoeWeights {
        n_experts: MOE_EXPERTS,
        gate: expert_mats(t, gate, MOE_FFN, MOE_HIDDEN),
        up: expert_mats(t, up, MOE_FFN, MOE_HIDDEN),
        down: expert_mats(t, down, MOE_HIDDEN, MOE_FFN),
        act: Activation::Silu,
    };
    let w = layer(&gate, &up, &down);
    // The same experts packed at load for the kernels in use, where they have a packed
    // layout (AVX2): the `-packed` cases.
    let pack = |data: &[u8], n, k| {
        PackedRows::new(&pools[0], data, t, n, k).expect("whole expert matrices")
    };
    let packed = (
        pack(&gate, MOE_FFN, MOE_HIDDEN),
        pack(&up, MOE_FFN, MOE_HIDDEN),
        pack(&down, MOE_HIDDEN, MOE_FFN),
    );
    let wp = match &packed {
        (Some(g), Some(u), Some(d)) => Some(layer(g.bytes(), u.bytes(), d.bytes())),
        _ => None,
    };
    let layers = [("", &w)]
        .into_iter()
        .chain(wp.as_ref().map(|w| ("-packed", w)));
    let expert_bytes = (gate.len() + up.len() + down.len()) / MOE_EXPERTS;

    // One token: call s takes the disjoint set s of `k` experts, s, s + n, s + 2n, ... (n sets).
    let disjoint_sets = |k: usize| -> Vec<Vec<i32>> {
        let n = MOE_EXPERTS / k;
        (0..n)
            .map(|s| (0..k).map(|j| (s + j * n) as i32).collect())
            .collect()
    };
    // Prefill: distinct experts per token from a fixed xorshift sequence.
    let mut state = 0x8553_4f1b_27a1_9e03u64;
    let mut prefill_ids = Vec::with_capacity(MOE_PREFILL_TOKENS * MOE_TOP_K);
    for _ in 0..MOE_PREFILL_TOKENS {
        let mut chosen = Vec::with_capacity(MOE_TOP_K);
        while chosen.len() < MOE_TOP_K {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let e = (state % MOE_EXPERTS as u64) as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        prefill_ids.extend(chosen);
    }
    let mut distinct = prefill_ids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let route_weights = vec![1.0 / MOE_TOP_K as f32; MOE_PREFILL_TOKENS * MOE_TOP_K];
    let x = random_floats(MOE_PREFILL_TOKENS * MOE_HIDDEN, 0x0801_f2e2_8580_07c3);
    let mut out = vec![0f32; MOE_PREFILL_TOKENS * MOE_HIDDEN];

    let mut group = c.benchmark_group("moe");
    // `decode-precise`: the same with residual activations (--moe-cpu-precise); `miss2`: the
    // two routes of a hybrid step's CPU job.
    for (name, k, residual_acts, (suffix, w)) in [
        ("decode", MOE_TOP_K, false),
        ("decode-precise", MOE_TOP_K, true),
        ("miss2", MOE_MISSES, false),
    ]
    .into_iter()
    .flat_map(|c| layers.clone().map(move |l| (c.0, c.1, c.2, l)))
    {
        let name = format!("{name}{suffix}");
        let opts = ForwardOptions {
            residual_acts,
            ..ForwardOptions::default()
        };
        let sets = disjoint_sets(k);
        for pool in &pools {
            let threads = pool.n_threads();
            let bytes = k * expert_bytes;
            configure(&mut group, bytes);
            group.bench_function(BenchmarkId::new(&name, format!("{threads}t")), |b| {
                let mut step = 0;
                timed(b, &format!("moe/{name}"), threads, bytes, || {
                    let ids = &sets[step % sets.len()];
                    step += 1;
                    let o = &mut out[..MOE_HIDDEN];
                    moe_forward_with(
                        pool,
                        w,
                        black_box(&x[..MOE_HIDDEN]),
                        ids,
                        &route_weights[..k],
                        o,
                        opts,
                    )
                    .expect("shapes match");
                    black_box(o);
                })
            });
        }
    }
    for ((suffix, w), pool) in layers.flat_map(|l| pools.iter().map(move |p| (l, p))) {
        let threads = pool.n_threads();
        let bytes = distinct.len() * expert_bytes;
        let name = format!("prefill64{suffix}");
        configure(&mut group, bytes);
        group.bench_function(BenchmarkId::new(&name, format!("{threads}t")), |b| {
            timed(b, &format!("moe/{name}"), threads, bytes, || {
                moe_forward(
                    pool,
                    w,
                    black_box(&x),
                    &prefill_ids,
                    &route_weights,
                    &mut out,
                )
                .expect("shapes match");
                black_box(&out);
            })
        });
    }
    group.finish();
}

/// GB/s of one case over criterion's measurement: in flat sampling every sample runs the same
/// number of iterations, unlike the warm-up's doubling counts, so the trailing calls with the
/// last call's count are the samples (the mean over them is criterion's point estimate).
fn gbps(r: &Record) -> f64 {
    let last = r.calls.last().expect("a recorded case has a call").0;
    let (iters, secs) = r
        .calls
        .iter()
        .rev()
        .take_while(|(n, _)| *n == last)
        .fold((0u64, 0f64), |(n, s), (i, d)| (n + i, s + d.as_secs_f64()));
    (r.bytes * iters) as f64 / secs / 1e9
}

fn summary() {
    let records = RECORDS.lock().unwrap();
    if records.is_empty() {
        return;
    }
    let probe = |threads| {
        records
            .iter()
            .find(|r| r.case == "bandwidth/read" && r.threads == threads)
            .map(gbps)
    };
    println!("\nsummary: bytes read per second (prompt: GFLOP/s); GEMV as a fraction of the read probe at the same thread count");
    println!(
        "{:<16} {:>7} {:>8} {:>9}",
        "case", "threads", "GB/s", "of probe"
    );
    for r in records.iter() {
        let rate = gbps(r);
        let fraction = match probe(r.threads) {
            _ if r.case.starts_with("prompt/") => "-".to_string(),
            Some(p) if r.case != "bandwidth/read" => format!("{:.0}%", 100.0 * rate / p),
            _ => "-".to_string(),
        };
        println!(
            "{:<16} {:>7} {:>8.2} {:>9}",
            r.case, r.threads, rate, fraction
        );
    }
}

criterion_group! {
    name = benches;
    // Ten samples over three seconds: each case streams 70-290 MB per iteration, so this is
    // still dozens of passes, and the whole run stays within a few minutes on two cores.
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bandwidth, gemv, moe, prompt
}

// criterion_main! with the summary after criterion's own report.
fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // Criterion measures only under `--bench` (which cargo bench passes); under `cargo test
    // --benches` or `--list` it runs each case once at most, too little for a summary.
    let args: Vec<String> = std::env::args().collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    if has("--bench") && !has("--test") && !has("--list") {
        summary();
    }
}
