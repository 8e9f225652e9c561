// Gated DeltaNet decode step (one token per sequence) in two kernels: gdn_step_kernel runs
// the causal conv, SiLU, q/k L2 norms, gates and the delta-rule update of a slice of state
// columns; gdn_finish_kernel runs the gated RMSNorm of each head's output and shifts the conv
// states. The finish kernel shifts the states only after every step block read them (the
// stream orders the two launches). Sizes are the host's: a captured step replays one launch
// geometry.
//
// This file holds the kernels and their parameters, no ggml and no launch syntax, so that the
// CPU emulation under tests/cuda_cpu/gdn/ compiles it with g++; shim.cu checks the arguments
// and launches.
#pragma once

#include "freetoken_cuda.h"

#include <stdint.h>

// State columns per step block: a warp's lanes, so each row's columns are one 128-byte load.
#define GDN_COLS 32
// Warps per block: the head's state rows are split among them.
#define GDN_WARPS 8
#define GDN_THREADS (GDN_COLS * GDN_WARPS)
// The largest head (FT_CUDA_GDN_MAX_DIM) and the state rows a thread keeps in registers.
#define GDN_MAX_DIM 256
#define GDN_ROWS (GDN_MAX_DIM / GDN_WARPS)
// Sequences per launch (FT_CUDA_GDN_MAX_SEQS): their state addresses travel in the parameters.
#define GDN_MAX_SEQS 64

// A launch's parameters, by value (about 1.2 KiB, under the 4 KiB kernel parameter limit).
struct gdn_params {
    int n_seqs, k_heads, v_heads, head_dim, conv_kernel;
    int grouped;   // value head h reads key head h / (v_heads / k_heads), else h % k_heads
    int ba_group;  // value heads per group of b and a
    float eps;
    int64_t mixed_stride, z_stride, ba_stride, ba_group_stride;
    const float *mixed, *z, *b, *a;
    const float *conv_weight, *dt_bias, *ssm_a, *norm;
    float *out;
    float *conv[GDN_MAX_SEQS];
    float *ssm[GDN_MAX_SEQS];
};

// The sum of `v` over the warp, in every lane.
static __device__ __forceinline__ float gdn_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

static __device__ __forceinline__ float gdn_silu(float x) { return x / (1.0f + expf(-x)); }

// SiLU of the causal conv of channel c: the conv state's K-1 rows `channels` apart (oldest
// first) then the token's input x, against taps 0..K-1 of the channel's weights. Plain
// pointers in: a reference to the kernel's parameters would copy them to local memory.
static __device__ __forceinline__ float gdn_conv_silu(const float *state, const float *x, const float *weight,
                                                      int64_t channels, int taps, int64_t c) {
    const float *w = weight + c * taps;
    float acc = 0.0f;
    for (int j = 0; j < taps - 1; ++j) {
        acc += state[j * channels + c] * w[j];
    }
    acc += x[c] * w[taps - 1];
    return gdn_silu(acc);
}

// Grid (column tiles, value heads, sequences), GDN_THREADS threads: lane j owns state column
// c0 + j, warp w the rows w, w + GDN_WARPS, ... With the head's q and k (every block of the
// head computes them: d elements each) and its gates, the gated delta rule over its columns:
//   S' = exp(g) S;  S = S' + k (beta (v - S'^T k))^T;  out = S^T q  (before the norm).
static __global__ void __launch_bounds__(GDN_THREADS) gdn_step_kernel(const gdn_params p) {
    __shared__ float qs[GDN_MAX_DIM], ks[GDN_MAX_DIM];
    __shared__ float kv_part[GDN_WARPS][GDN_COLS], o_part[GDN_WARPS][GDN_COLS];
    const int s = blockIdx.z, h = blockIdx.y, d = p.head_dim;
    const int lane = threadIdx.x % GDN_COLS, warp = threadIdx.x / GDN_COLS;
    const int col = blockIdx.x * GDN_COLS + lane;
    const bool has_col = col < d;
    const int kh = p.grouped ? h / (p.v_heads / p.k_heads) : h % p.k_heads;
    const int64_t channels = (int64_t)(2 * p.k_heads + p.v_heads) * d;
    const float *conv = p.conv[s], *x_in = p.mixed + s * p.mixed_stride, *w = p.conv_weight;
    const int taps = p.conv_kernel;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        qs[i] = gdn_conv_silu(conv, x_in, w, channels, taps, (int64_t)kh * d + i);
        ks[i] = gdn_conv_silu(conv, x_in, w, channels, taps, (int64_t)(p.k_heads + kh) * d + i);
    }
    const int64_t v_channel = (int64_t)(2 * p.k_heads + h) * d + col;
    const float v = has_col ? gdn_conv_silu(conv, x_in, w, channels, taps, v_channel) : 0.0f;
    const int64_t ba = s * p.ba_stride + (int64_t)(h / p.ba_group) * p.ba_group_stride + h % p.ba_group;
    const float beta = 1.0f / (1.0f + expf(-p.b[ba]));
    const float x = p.a[ba] + p.dt_bias[h];
    const float softplus = x > 20.0f ? x : log1pf(expf(x));  // torch's threshold
    const float decay = expf(softplus * p.ssm_a[h]);
    __syncthreads();
    // x / sqrt(sum(x^2) + eps) per head, q also by 1/sqrt(d): every warp sums the staged rows.
    float sq = 0.0f, sk = 0.0f;
    for (int i = lane; i < d; i += GDN_COLS) {
        sq += qs[i] * qs[i];
        sk += ks[i] * ks[i];
    }
    const float q_scale = rsqrtf(gdn_warp_sum(sq) + p.eps) / sqrtf((float)d);
    const float k_scale = rsqrtf(gdn_warp_sum(sk) + p.eps);

    float *state = p.ssm[s] + (int64_t)h * d * d;
    float rows[GDN_ROWS];
    float kv = 0.0f;
#pragma unroll
    for (int m = 0; m < GDN_ROWS; ++m) {
        const int i = warp + m * GDN_WARPS;
        rows[m] = (i < d && has_col) ? state[i * d + col] * decay : 0.0f;
        if (i < d) {
            kv += rows[m] * (ks[i] * k_scale);
        }
    }
    kv_part[warp][lane] = kv;
    __syncthreads();
    kv = 0.0f;
    for (int w = 0; w < GDN_WARPS; ++w) {
        kv += kv_part[w][lane];
    }
    const float delta = beta * (v - kv);
    float o = 0.0f;
#pragma unroll
    for (int m = 0; m < GDN_ROWS; ++m) {
        const int i = warp + m * GDN_WARPS;
        if (i < d) {
            rows[m] += (ks[i] * k_scale) * delta;
            o += rows[m] * (qs[i] * q_scale);
            if (has_col) {
                state[i * d + col] = rows[m];
            }
        }
    }
    o_part[warp][lane] = o;
    __syncthreads();
    if (warp == 0 && has_col) {
        o = 0.0f;
        for (int w = 0; w < GDN_WARPS; ++w) {
            o += o_part[w][lane];
        }
        p.out[((int64_t)s * p.v_heads + h) * d + col] = o;
    }
}

// Grid (value heads, sequences), GDN_THREADS threads: the head's output RMS-normed by `norm`
// times silu(z), in place; then the block shifts its channels' conv state by one token (the
// value head's channels, and the q and k channels of key head h when h < k_heads: value heads
// are at least as many, so every channel has one block).
static __global__ void __launch_bounds__(GDN_THREADS) gdn_finish_kernel(const gdn_params p) {
    __shared__ float os[GDN_MAX_DIM];
    const int s = blockIdx.y, h = blockIdx.x, d = p.head_dim;
    const int lane = threadIdx.x % GDN_COLS;
    float *out = p.out + ((int64_t)s * p.v_heads + h) * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        os[i] = out[i];
    }
    __syncthreads();
    float ss = 0.0f;
    for (int i = lane; i < d; i += GDN_COLS) {
        ss += os[i] * os[i];
    }
    const float r = rsqrtf(gdn_warp_sum(ss) / (float)d + p.eps);
    const float *z = p.z + s * p.z_stride + (int64_t)h * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        out[i] = os[i] * r * p.norm[i] * gdn_silu(z[i]);
    }
    const int64_t channels = (int64_t)(2 * p.k_heads + p.v_heads) * d;
    const int n_groups = h < p.k_heads ? 3 : 1;
    for (int e = threadIdx.x; e < n_groups * d; e += blockDim.x) {
        const int g = e / d;  // 0: the value head's channels, 1: q, 2: k of key head h
        const int64_t c = (g == 0 ? (int64_t)(2 * p.k_heads + h) : (int64_t)(g - 1) * p.k_heads + h) * d + e % d;
        float *state = p.conv[s] + c;
        for (int j = 0; j + 2 < p.conv_kernel; ++j) {
            state[j * channels] = state[(j + 1) * channels];
        }
        state[(p.conv_kernel - 2) * channels] = p.mixed[s * p.mixed_stride + c];
    }
}

// The kernels' parameters from a call's checked arguments.
static gdn_params gdn_params_of(const ft_cuda_gdn_decode_args &a) {
    gdn_params p;
    p.n_seqs = (int)a.n_seqs;
    p.k_heads = (int)a.k_heads;
    p.v_heads = (int)a.v_heads;
    p.head_dim = (int)a.head_dim;
    p.conv_kernel = (int)a.conv_kernel;
    p.grouped = a.grouped != 0;
    p.ba_group = (int)a.ba_group;
    p.eps = a.eps;
    p.mixed_stride = a.mixed_stride;
    p.z_stride = a.z_stride;
    p.ba_stride = a.ba_stride;
    p.ba_group_stride = a.ba_group_stride;
    p.mixed = a.mixed;
    p.z = a.z;
    p.b = a.b;
    p.a = a.a;
    p.conv_weight = a.conv_weight;
    p.dt_bias = a.dt_bias;
    p.ssm_a = a.ssm_a;
    p.norm = a.norm;
    p.out = a.out;
    for (int s = 0; s < GDN_MAX_SEQS; ++s) {
        p.conv[s] = s < p.n_seqs ? a.conv_states[s] : nullptr;
        p.ssm[s] = s < p.n_seqs ? a.ssm_states[s] : nullptr;
    }
    return p;
}

static dim3 gdn_step_grid(const gdn_params &p) {
    return dim3((unsigned)((p.head_dim + GDN_COLS - 1) / GDN_COLS), (unsigned)p.v_heads, (unsigned)p.n_seqs);
}

static dim3 gdn_finish_grid(const gdn_params &p) { return dim3((unsigned)p.v_heads, (unsigned)p.n_seqs); }
