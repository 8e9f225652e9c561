// One query per head over a layer's cached keys (a decode step), split over the keys
// ("flash-decoding"). Included by shim.cu; g++ compiles it too, through the CPU emulation of
// tests/cuda_cpu/cuda_emu.h, so that its logic is tested without a GPU.
//
// A chunk block takes a group of up to ATTN_MAX_GROUP query heads that share one kv head (each
// key and value row is read once for the whole group) and one chunk of consecutive keys. Per
// head it finds the chunk's largest score m, the sum l of exp(s - m) and the unnormalized sum
// of exp(s - m) v, and writes them to the workspace; the merge kernel rescales each head's
// chunks to their largest m, adds the sink logit to the denominator and writes the output.
// With one chunk the block writes the output itself. The launch geometry depends on the key
// count (the cache length read) only, never on the position: a captured step reads that from
// device memory at replay.
#pragma once

#include "freetoken_cuda.h"

#include <cmath>
#include <cstdint>

// Threads per chunk block; its score pass gives each key ATTN_KEY_LANES lanes of a warp.
static constexpr int ATTN_THREADS = 256;
static constexpr int ATTN_KEY_LANES = 8;
static constexpr int ATTN_KEY_PASS = ATTN_THREADS / ATTN_KEY_LANES;  // keys per score pass
// Query heads per block: the score pass keeps one accumulator per head in registers.
static constexpr int ATTN_MAX_GROUP = 8;
// A chunk reads at least this many bytes of keys and values (enough loads in flight to pay
// for its block), and the grid aims at this many blocks per SM.
static constexpr int64_t ATTN_MIN_CHUNK_BYTES = 64 * 1024;
static constexpr int64_t ATTN_BLOCKS_PER_SM = 2;
// Keys per chunk at most: the chunk's scores live in shared memory (with the group's queries
// this keeps a block under the 48 KiB that needs no opt-in).
static constexpr int64_t ATTN_MAX_CHUNK_KEYS = 512;
// Value dimensions (threads) per merge block.
static constexpr int ATTN_MERGE_THREADS = 64;

// The split of one call, from its sizes alone.
struct attn_plan {
    int64_t group;       // query heads per block (the last block of a kv head may have fewer)
    int64_t n_groups;    // blocks along y: kv heads times blocks per kv head
    int64_t chunk;       // keys per block, a multiple of ATTN_KEY_PASS
    int64_t n_chunks;    // blocks along x
    int64_t v_threads;   // threads across value dimensions; ATTN_THREADS / v_threads key slices
    uint64_t shared;     // dynamic shared bytes of a chunk block
    uint64_t work_bytes; // workspace: n_heads * n_chunks (m, l) pairs, then the sums; 0 for one chunk
};

static __host__ __device__ inline int64_t attn_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static __host__ __device__ inline int64_t attn_round_up(int64_t a, int64_t b) { return attn_ceil_div(a, b) * b; }

static __host__ __device__ inline int64_t attn_min(int64_t a, int64_t b) { return a < b ? a : b; }

static __host__ __device__ inline int64_t attn_max(int64_t a, int64_t b) { return a > b ? a : b; }

// Blocks per kv head, and chunks per group that give about ATTN_BLOCKS_PER_SM blocks per SM.
static inline void attn_grid_targets(int64_t n_heads, int64_t n_kv_heads, int64_t n_sm, int64_t *subs,
                                     int64_t *per_group) {
    *subs = attn_ceil_div(n_heads / n_kv_heads, ATTN_MAX_GROUP);
    *per_group = attn_max(1, attn_ceil_div(ATTN_BLOCKS_PER_SM * n_sm, n_kv_heads * *subs));
}

// Sizes as ft_cuda_attn_decode checks them: n_heads a multiple of n_kv_heads, dims 1..512,
// n_keys >= 1.
static inline attn_plan attn_plan_for(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t head_dim_v,
                                      int64_t n_keys, int64_t n_sm) {
    attn_plan p{};
    int64_t subs = 0, per_group = 0;
    attn_grid_targets(n_heads, n_kv_heads, n_sm, &subs, &per_group);
    p.group = attn_ceil_div(n_heads / n_kv_heads, subs);  // even groups: 12 heads are 6 + 6
    p.n_groups = n_kv_heads * subs;
    const int64_t min_keys = attn_ceil_div(ATTN_MIN_CHUNK_BYTES, (head_dim + head_dim_v) * (int64_t)sizeof(float));
    int64_t chunk = attn_max(min_keys, attn_ceil_div(n_keys, per_group));
    chunk = attn_min(attn_min(chunk, ATTN_MAX_CHUNK_KEYS), attn_round_up(n_keys, ATTN_KEY_PASS));
    p.chunk = attn_round_up(chunk, ATTN_KEY_PASS);
    p.n_chunks = attn_ceil_div(n_keys, p.chunk);
    // One value dimension per thread (two above 256), the spare threads over slices of keys.
    p.v_threads = 32;
    while (p.v_threads < ATTN_THREADS && p.v_threads < head_dim_v) {
        p.v_threads *= 2;
    }
    const int64_t floats = 2 * ATTN_MAX_GROUP + p.group * attn_round_up(head_dim, 4) + p.group * p.chunk +
                           (p.v_threads < ATTN_THREADS ? p.group * ATTN_THREADS : 0);
    p.shared = (uint64_t)floats * sizeof(float);
    p.work_bytes = p.n_chunks > 1 ? (uint64_t)(n_heads * p.n_chunks * (2 + head_dim_v)) * sizeof(float) : 0;
    return p;
}

// Workspace bytes that serve every key count up to n_keys: a plan's chunks never exceed the
// target per group (chunks are at least n_keys / per_group long) or n_keys / ATTN_MAX_CHUNK_KEYS.
static inline uint64_t attn_work_bound(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim_v, int64_t n_keys,
                                       int64_t n_sm) {
    int64_t subs = 0, per_group = 0;
    attn_grid_targets(n_heads, n_kv_heads, n_sm, &subs, &per_group);
    const int64_t chunks =
        attn_min(attn_ceil_div(n_keys, ATTN_KEY_PASS), attn_max(per_group, attn_ceil_div(n_keys, ATTN_MAX_CHUNK_KEYS)));
    return chunks > 1 ? (uint64_t)(n_heads * chunks * (2 + head_dim_v)) * sizeof(float) : 0;
}

static_assert(ATTN_THREADS / 32 == ATTN_MAX_GROUP, "the softmax takes a warp per head of the group");

// The dynamic shared memory of a chunk block: the group's (m, l), its queries (rows rounded to
// float4s), the chunk's scores (then probabilities), and the key slices' partial sums.
extern __shared__ __align__(16) float attn_smem[];

// exp(m - top) for a part whose largest score is m, 0 for a part with no visible key.
static __device__ __forceinline__ float attn_rescale(float m, float top) { return m == -INFINITY ? 0.0f : expf(m - top); }

// 1 / (sum + the sink's share), all rescaled to `top`; 0 when nothing is visible (zeros, not NaN).
static __device__ __forceinline__ float attn_inv_denominator(float sum, float top, const ft_cuda_attn_decode_args &a,
                                                             int64_t h) {
    if (a.sinks != nullptr) {
        sum += attn_rescale(a.sinks[h], top);
    }
    return sum > 0.0f ? 1.0f / sum : 0.0f;
}

// Visible keys of chunk [j0, j0 + n) as chunk offsets [*lo, *hi): j <= pos and, with a window,
// pos - j < window (written without overflow for any int64 position).
static __device__ __forceinline__ void attn_visible(const ft_cuda_attn_decode_args &a, int64_t pos, int64_t j0,
                                                    int64_t n, int64_t *lo, int64_t *hi) {
    *lo = 0;
    *hi = 0;
    if (pos >= j0) {
        *hi = pos - j0 >= n ? n : pos - j0 + 1;
        if (a.window > 0) {
            const int64_t first = pos - a.window + 1;
            *lo = first <= j0 ? 0 : attn_min(first - j0, *hi);
        }
    }
}

static __device__ __forceinline__ float attn_warp_sum(float v, int width) {
    for (int o = width / 2; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

static __device__ __forceinline__ float attn_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// Adds p[j] * value(j, d) over offsets j in [b, e) of this thread's key slice, one key at a time.
static __device__ __forceinline__ void attn_values_scalar(const float *vrow0, int64_t v_stride, int64_t v_dim_stride,
                                                          const float *ps, int64_t chunk, int gs, int64_t dl,
                                                          int64_t v_threads, int64_t dims, int64_t b, int64_t e,
                                                          int64_t slice, int64_t slices, float (&acc)[ATTN_MAX_GROUP][2]) {
    for (int64_t j = b + slice; j < e; j += slices) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int64_t d = dl + i * v_threads;
            if (d < dims) {
                const float x = vrow0[j * v_stride + d * v_dim_stride];
#pragma unroll
                for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
                    if (gh < gs) {
                        acc[gh][i] += ps[gh * chunk + j] * x;
                    }
                }
            }
        }
    }
}

static __global__ void __launch_bounds__(ATTN_THREADS) attn_chunk_kernel(ft_cuda_attn_decode_args a, attn_plan p) {
    const int64_t per_kv = a.n_heads / a.n_kv_heads, subs = attn_ceil_div(per_kv, p.group);
    const int64_t g = blockIdx.y / subs;                        // the kv head
    const int64_t h0 = g * per_kv + (blockIdx.y % subs) * p.group;  // the group's first query head
    const int gs = (int)attn_min(p.group, (g + 1) * per_kv - h0);
    const int64_t c = blockIdx.x, j0 = c * p.chunk, n = attn_min(p.chunk, a.n_keys - j0);
    const int64_t pos = a.pos_dev != nullptr ? *a.pos_dev : a.pos_value;
    int64_t lo = 0, hi = 0;
    attn_visible(a, pos, j0, n, &lo, &hi);
    const int64_t hd = a.head_dim, dv = a.head_dim_v, q_row = attn_round_up(hd, 4);
    float *stat = attn_smem;                        // [2][ATTN_MAX_GROUP]: m, then l
    float *qs = stat + 2 * ATTN_MAX_GROUP;          // [gs][q_row]
    float *ps = qs + p.group * q_row;               // [gs][chunk]
    float *red = ps + p.group * p.chunk;            // [gs][ATTN_THREADS] with key slices
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    for (int i = threadIdx.x; i < gs * hd; i += blockDim.x) {
        qs[i / hd * q_row + i % hd] = a.q[h0 * hd + i];
    }
    __syncthreads();

    // Scores: ATTN_KEY_LANES lanes per key read its row (float4s where aligned) against every
    // head of the group, then sum across those lanes. Whole warps iterate together (shuffles).
    const float *kg = a.k + (g * hd + j0 * a.k_stride);
    const bool k_vec = hd % 4 == 0 && a.k_stride % 4 == 0 && (uintptr_t)kg % 16 == 0;
    const int team = threadIdx.x / ATTN_KEY_LANES, tl = threadIdx.x % ATTN_KEY_LANES;
    for (int64_t base = 0; base < n; base += ATTN_KEY_PASS) {
        const int64_t j = base + team;
        const bool seen = j >= lo && j < hi;
        float acc[ATTN_MAX_GROUP] = {};
        if (seen && k_vec) {
            const float4 *k4 = reinterpret_cast<const float4 *>(kg + j * a.k_stride);
#pragma unroll 4
            for (int d4 = tl; d4 < (int)(hd / 4); d4 += ATTN_KEY_LANES) {
                const float4 x = k4[d4];
#pragma unroll
                for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
                    if (gh < gs) {
                        const float4 y = reinterpret_cast<const float4 *>(qs + gh * q_row)[d4];
                        acc[gh] += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
                    }
                }
            }
        } else if (seen) {
            const float *kr = kg + j * a.k_stride;
#pragma unroll 4
            for (int d = tl; d < (int)hd; d += ATTN_KEY_LANES) {
                const float x = kr[d];
#pragma unroll
                for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
                    if (gh < gs) {
                        acc[gh] += x * qs[gh * q_row + d];
                    }
                }
            }
        }
#pragma unroll
        for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
            if (gh < gs) {  // gs is the block's: every lane shuffles
                acc[gh] = attn_warp_sum(acc[gh], ATTN_KEY_LANES);
                if (tl == 0 && j < n) {
                    ps[gh * p.chunk + j] = seen ? acc[gh] * a.scale : -INFINITY;
                }
            }
        }
    }
    __syncthreads();

    // The chunk's softmax statistics, a warp per head (ATTN_THREADS / 32 == ATTN_MAX_GROUP).
    if (warp < gs) {
        float *s = ps + warp * p.chunk;
        float m = -INFINITY;
        for (int64_t j = lane; j < n; j += 32) {
            m = fmaxf(m, s[j]);
        }
        m = attn_warp_max(m);
        float l = 0.0f;
        for (int64_t j = lane; j < n; j += 32) {
            const float e = s[j] == -INFINITY ? 0.0f : expf(s[j] - m);
            s[j] = e;
            l += e;
        }
        l = attn_warp_sum(l, 32);
        if (lane == 0) {
            stat[warp] = m;
            stat[ATTN_MAX_GROUP + warp] = l;
        }
    }
    __syncthreads();

    // Values: a thread per dimension (and its twin 256 further), over this thread's slice of
    // the visible keys. The transposed cache (v_stride 1) reads four positions at once where
    // aligned: chunks start at multiples of ATTN_KEY_PASS.
    const int64_t slices = ATTN_THREADS / p.v_threads, slice = threadIdx.x / p.v_threads,
                  dl = threadIdx.x % p.v_threads;
    const float *vg = a.v + (g * dv * a.v_dim_stride + j0 * a.v_stride);
    float acc[ATTN_MAX_GROUP][2] = {};
    const bool v_vec = a.v_stride == 1 && a.v_dim_stride % 4 == 0 && (uintptr_t)vg % 16 == 0;
    if (v_vec) {
        const int64_t qa = (lo + 3) / 4, qb = attn_max(qa, hi / 4);  // whole quads inside [lo, hi)
        attn_values_scalar(vg, a.v_stride, a.v_dim_stride, ps, p.chunk, gs, dl, p.v_threads, dv, lo,
                           attn_min(4 * qa, hi), slice, slices, acc);
#pragma unroll 4
        for (int64_t qi = qa + slice; qi < qb; qi += slices) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int64_t d = dl + i * p.v_threads;
                if (d < dv) {
                    const float4 x = reinterpret_cast<const float4 *>(vg + d * a.v_dim_stride)[qi];
#pragma unroll
                    for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
                        if (gh < gs) {
                            const float4 w = reinterpret_cast<const float4 *>(ps + gh * p.chunk)[qi];
                            acc[gh][i] += w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w;
                        }
                    }
                }
            }
        }
        attn_values_scalar(vg, a.v_stride, a.v_dim_stride, ps, p.chunk, gs, dl, p.v_threads, dv,
                           attn_max(4 * qb, lo), hi, slice, slices, acc);
    } else {
        attn_values_scalar(vg, a.v_stride, a.v_dim_stride, ps, p.chunk, gs, dl, p.v_threads, dv, lo, hi, slice,
                           slices, acc);
    }
    if (slices > 1) {  // one dimension per thread here: sum the slices in the first
#pragma unroll
        for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
            if (gh < gs) {
                red[gh * ATTN_THREADS + threadIdx.x] = acc[gh][0];
            }
        }
        __syncthreads();
        if (slice == 0) {
#pragma unroll
            for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
                if (gh < gs) {
                    for (int64_t s = 1; s < slices; ++s) {
                        acc[gh][0] += red[gh * ATTN_THREADS + s * p.v_threads + dl];
                    }
                }
            }
        }
    }
    if (slice != 0) {
        return;
    }
#pragma unroll
    for (int gh = 0; gh < ATTN_MAX_GROUP; ++gh) {
        if (gh < gs) {
            const int64_t h = h0 + gh;
            const float m = stat[gh], l = stat[ATTN_MAX_GROUP + gh];
            // One chunk: the output. Else the chunk's part of the workspace, for the merge.
            float *dst = a.out + h * dv, scale = 1.0f;
            if (p.n_chunks == 1) {
                const float top = a.sinks != nullptr ? fmaxf(m, a.sinks[h]) : m;
                scale = attn_rescale(m, top) * attn_inv_denominator(l * attn_rescale(m, top), top, a, h);
            } else {
                float *ml = static_cast<float *>(a.work) + 2 * (h * p.n_chunks + c);
                dst = static_cast<float *>(a.work) + 2 * a.n_heads * p.n_chunks + (h * p.n_chunks + c) * dv;
                if (dl == 0) {
                    ml[0] = m;
                    ml[1] = l;
                }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int64_t d = dl + i * p.v_threads;
                if (d < dv) {
                    dst[d] = acc[gh][i] * scale;
                }
            }
        }
    }
}

// Per head (blockIdx.x) and ATTN_MERGE_THREADS value dimensions (blockIdx.y): the chunks'
// sums rescaled to the largest score (or sink) and divided by the whole denominator.
static __global__ void __launch_bounds__(ATTN_MERGE_THREADS) attn_merge_kernel(ft_cuda_attn_decode_args a, attn_plan p) {
    const int64_t h = blockIdx.x, d = (int64_t)blockIdx.y * ATTN_MERGE_THREADS + threadIdx.x, dv = a.head_dim_v;
    if (d >= dv) {
        return;
    }
    const float *ml = static_cast<const float *>(a.work) + 2 * h * p.n_chunks;
    const float *sums = static_cast<const float *>(a.work) + 2 * a.n_heads * p.n_chunks + h * p.n_chunks * dv + d;
    float top = a.sinks != nullptr ? a.sinks[h] : -INFINITY;
    for (int64_t c = 0; c < p.n_chunks; ++c) {
        top = fmaxf(top, ml[2 * c]);
    }
    float l = 0.0f, acc = 0.0f;
    for (int64_t c = 0; c < p.n_chunks; ++c) {
        const float w = attn_rescale(ml[2 * c], top);
        l += w * ml[2 * c + 1];
        acc += w * sums[c * dv];
    }
    a.out[h * dv + d] = acc * attn_inv_denominator(l, top, a, h);
}
