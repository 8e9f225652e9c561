// A hybrid layer's fetch on the device (include/freetoken_cuda.h, "fetch share"):
// fetch_plan_kernel chooses which missed experts to upload and where each route goes;
// fetch_gather_kernel copies them from mapped host memory into the staging slots.
//
// This file holds the kernels, no ggml and no launch syntax, so that the CPU emulation under
// tests/cuda_cpu/ compiles it with g++; shim.cu checks the arguments and launches. The
// includer defines ft_clock_ns(), the device's nanosecond timer.
#pragma once

#include "freetoken_cuda.h"

#include <math.h>
#include <stdint.h>

// One thread per expert and per candidate count in the plan (FT_CUDA_FETCH_MAX_EXPERTS).
#define FETCH_PLAN_THREADS 1024
#define FETCH_GATHER_THREADS 256

// The modelled seconds of fetching the first nf of n missed experts, the CPU reading `left`
// times what is not fetched: the larger side plus the fixed cost, in freetoken.engine.fetch's
// order of operations with no fused multiply-add, so that both give the same choice.
static __device__ __forceinline__ void fetch_times(const ft_cuda_fetch_plan_args &a, int64_t nf, int64_t n,
                                                   double left, double *upload, double *cpu) {
    const bool both = nf > 0 && nf < n;
    const double b_pcie = both ? a.b_pcie_with_cpu : a.b_pcie;
    const double b_cpu = both ? a.b_cpu_with_pcie : a.b_cpu;
    const double per_byte = __dadd_rn(__ddiv_rn(1.0, b_pcie), __ddiv_rn(1.0, a.b_gpu));
    *upload = __ddiv_rn(__dmul_rn(__dmul_rn((double)nf, a.expert_bytes), per_byte), 1e9);
    *cpu = __ddiv_rn(__ddiv_rn(__dmul_rn(left, a.expert_bytes), b_cpu), 1e9);
}

// One block of FETCH_PLAN_THREADS threads; the launcher has checked the sizes.
static __global__ void __launch_bounds__(FETCH_PLAN_THREADS) fetch_plan_kernel(ft_cuda_fetch_plan_args a) {
    __shared__ int32_t count[FT_CUDA_FETCH_MAX_EXPERTS];  // missed routes of each expert
    __shared__ int32_t rank[FT_CUDA_FETCH_MAX_EXPERTS];   // a missed expert's place, else -1
    __shared__ int32_t order[FT_CUDA_FETCH_MAX_EXPERTS];  // the missed experts in order
    __shared__ int32_t reads[FT_CUDA_FETCH_MAX_EXPERTS];  // the CPU's reads, prefix-summed in order
    __shared__ double best_t[FETCH_PLAN_THREADS];
    __shared__ int32_t best_n[FETCH_PLAN_THREADS];
    __shared__ int32_t n_missed, missed_routes, fetched_routes, n_fetch;
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const int64_t n_e = a.n_experts, n_r = a.n_tokens * a.top_k;
    for (int64_t e = tid; e < n_e; e += nt) {
        count[e] = 0;
    }
    if (tid == 0) {
        n_missed = missed_routes = fetched_routes = 0;
    }
    __syncthreads();
    for (int64_t i = tid; i < n_r; i += nt) {
        const int32_t e = a.ids[i];
        if (e >= 0 && e < n_e && a.resident[e] < 0) {
            atomicAdd(&count[e], 1);
        }
    }
    __syncthreads();
    for (int64_t e = tid; e < n_e; e += nt) {
        const int32_t c = count[e];
        int32_t r = -1;
        if (c > 0) {
            r = 0;
            for (int64_t f = 0; f < n_e; ++f) {
                const int32_t d = count[f];
                r += d > c || (d == c && f < e);
            }
            order[r] = (int32_t)e;
            atomicAdd(&n_missed, 1);
            atomicAdd(&missed_routes, c);
        }
        rank[e] = r;
    }
    __syncthreads();
    const int32_t n = n_missed;
    // Inclusive prefix sums of the reads (n <= FETCH_PLAN_THREADS: one entry per thread).
    if (tid < n) {
        reads[tid] = a.price_routes ? count[order[tid]] : 1;
    }
    __syncthreads();
    for (int off = 1; off < n; off <<= 1) {
        const int32_t add = tid < n && tid >= off ? reads[tid - off] : 0;
        __syncthreads();
        if (tid < n) {
            reads[tid] += add;
        }
        __syncthreads();
    }
    const double total_reads = n > 0 ? (double)reads[n - 1] : 0.0;
    const int64_t cap = n < a.max_fetch ? n : a.max_fetch;
    if (a.share >= 0.0) {
        if (tid == 0) {
            const int64_t want = (int64_t)floor(__dadd_rn(__dmul_rn(a.share, (double)n), 0.5));
            n_fetch = (int32_t)(want < cap ? want : cap);
        }
    } else {
        double t = INFINITY;
        int32_t nf = INT32_MAX;
        if (tid <= cap) {
            const double left = total_reads - (tid > 0 ? (double)reads[tid - 1] : 0.0);
            double up = 0.0, cpu = 0.0;
            fetch_times(a, tid, n, left, &up, &cpu);
            t = up > cpu ? up : cpu;
            if (tid > 0) {
                t = __dadd_rn(t, a.overhead_s);
            }
            nf = tid;
        }
        best_t[tid] = t;
        best_n[tid] = nf;
        __syncthreads();
        for (int s = nt / 2; s > 0; s >>= 1) {
            if (tid < s) {
                const double o = best_t[tid + s];
                const int32_t on = best_n[tid + s];
                if (o < best_t[tid] || (o == best_t[tid] && on < best_n[tid])) {
                    best_t[tid] = o;
                    best_n[tid] = on;
                }
            }
            __syncthreads();
        }
        if (tid == 0) {
            n_fetch = best_n[0];
        }
    }
    __syncthreads();
    const int32_t nf = n_fetch;
    // The whole host row: a mark left by an earlier pass over the same step (a graph's
    // warm-up) must not make the host skip an expert this pass does not fetch.
    for (int64_t e = tid; e < n_e; e += nt) {
        const int32_t r = rank[e];
        const bool fetched = r >= 0 && r < nf;
        a.resident_host[e] = fetched ? FT_CUDA_FETCHED : a.resident[e];
        if (fetched) {
            a.fetched[r] = (int32_t)e;
            atomicAdd(&fetched_routes, count[e]);
        }
    }
    for (int64_t i = tid; i < n_r; i += nt) {
        const int32_t e = a.ids[i];
        const int32_t r = e >= 0 && e < n_e ? rank[e] : -1;
        const bool fetched = r >= 0 && r < nf;
        a.slots[i] = fetched ? r : (int32_t)(a.dummy_base + i % a.top_k);
        a.fetch_weights[i] = fetched ? a.weights[i] : 0.0f;
    }
    __threadfence_system();  // the host's marks before the layer's request that follows
    __syncthreads();
    if (tid == 0) {
        const double left = total_reads - (nf > 0 ? (double)reads[nf - 1] : 0.0);
        double up = 0.0, cpu = 0.0;
        fetch_times(a, nf, n, left, &up, &cpu);
        a.stats[FT_CUDA_FETCH_N] = nf;
        a.stats[FT_CUDA_FETCH_MISSED] = n;
        a.stats[FT_CUDA_FETCH_ROUTES] = fetched_routes;
        a.stats[FT_CUDA_FETCH_MISSED_ROUTES] = missed_routes;
        a.stats[FT_CUDA_FETCH_START_NS] = INT64_MAX;
        a.stats[FT_CUDA_FETCH_END_NS] = 0;
        a.stats[FT_CUDA_FETCH_UPLOAD_NS] = (int64_t)llround(up * 1e9);
        a.stats[FT_CUDA_FETCH_CPU_NS] = (int64_t)llround(cpu * 1e9);
    }
}

// The widest access (16, 8, 4 or 1 bytes) that every address and size of a copy allows.
static __device__ __forceinline__ int fetch_width(const void *src, int64_t stride, int64_t nbytes, const void *dst) {
    const uint64_t m = (uint64_t)(uintptr_t)src | (uint64_t)stride | (uint64_t)nbytes | (uint64_t)(uintptr_t)dst;
    return m % 16 == 0 ? 16 : m % 8 == 0 ? 8 : m % 4 == 0 ? 4 : 1;
}

// `n` elements from `src` (null: zeros) to `dst` by the block, four loads in flight per thread:
// a read of mapped host memory waits a PCIe round trip.
template <typename T> static __device__ __forceinline__ void fetch_copy(const T *src, T *dst, int64_t n) {
    const int64_t step = blockDim.x;
    int64_t i = threadIdx.x;
    if (src == nullptr) {
        const T zero{};
        for (; i < n; i += step) {
            dst[i] = zero;
        }
        return;
    }
    for (; i + 3 * step < n; i += 4 * step) {
        const T v0 = src[i], v1 = src[i + step], v2 = src[i + 2 * step], v3 = src[i + 3 * step];
        dst[i] = v0;
        dst[i + step] = v1;
        dst[i + 2 * step] = v2;
        dst[i + 3 * step] = v3;
    }
    for (; i < n; i += step) {
        dst[i] = src[i];
    }
}

// Grid (max_fetch + top_k, n_kinds): block x copies the x-th fetched expert of kind y into
// slot x, or zeroes dummy slot x - n_fetch; the blocks past n_fetch + top_k return (the grid is
// the host's, so that a captured step replays one geometry).
static __global__ void __launch_bounds__(FETCH_GATHER_THREADS) fetch_gather_kernel(ft_cuda_fetch_gather_args a) {
    const int64_t nf = a.stats[FT_CUDA_FETCH_N];
    const int64_t u = blockIdx.x;
    const int kind = (int)blockIdx.y;
    if (u >= nf + a.top_k) {
        return;
    }
    unsigned long long *span = (unsigned long long *)(a.stats + FT_CUDA_FETCH_START_NS);
    if (threadIdx.x == 0) {
        atomicMin(span, (unsigned long long)ft_clock_ns());
    }
    const int64_t nbytes = a.nbytes[kind];
    const char *src = nullptr;
    int64_t slot = a.dummy_base + (u - nf);
    if (u < nf) {
        src = (const char *)a.src[kind] + (int64_t)a.fetched[u] * a.src_stride[kind];
        slot = u;
    }
    char *dst = (char *)a.dst[kind] + slot * nbytes;
    switch (fetch_width(a.src[kind], a.src_stride[kind], nbytes, a.dst[kind])) {
        case 16: fetch_copy((const uint4 *)src, (uint4 *)dst, nbytes / 16); break;
        case 8: fetch_copy((const uint2 *)src, (uint2 *)dst, nbytes / 8); break;
        case 4: fetch_copy((const uint32_t *)src, (uint32_t *)dst, nbytes / 4); break;
        default: fetch_copy((const uint8_t *)src, (uint8_t *)dst, nbytes); break;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicMax(span + 1, (unsigned long long)ft_clock_ns());
    }
}
