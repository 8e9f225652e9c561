// ft_cuda_fetch_plan's and ft_cuda_fetch_gather's kernels on the CPU (cuda_emulation.h), behind
// flat C entry points for ctypes: the ABI structs filled and launched as shim.cu does, host
// memory standing in for mapped memory (its device address is its own).
#include <chrono>
#include <cstdint>

#include "cuda_emulation.h"

inline uint64_t ft_clock_ns() {
    return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

#include "fetch.cuh"

// sizes: n_tokens, top_k, n_experts, max_fetch, dummy_base, price_routes; figures: expert
// bytes, overhead_s, share, b_cpu, b_pcie, b_gpu, b_cpu_with_pcie, b_pcie_with_cpu.
extern "C" void fetch_plan_emulate(const int64_t *sizes, const double *figures, const int32_t *ids,
                                   const float *weights, const int32_t *resident, int32_t *resident_host,
                                   int32_t *fetched, int32_t *slots, float *fetch_weights, int64_t *stats) {
    ft_cuda_fetch_plan_args a{};
    a.struct_size = sizeof(a);
    a.n_tokens = sizes[0];
    a.top_k = sizes[1];
    a.n_experts = sizes[2];
    a.max_fetch = sizes[3];
    a.dummy_base = sizes[4];
    a.price_routes = (int32_t)sizes[5];
    a.expert_bytes = figures[0];
    a.overhead_s = figures[1];
    a.share = figures[2];
    a.b_cpu = figures[3];
    a.b_pcie = figures[4];
    a.b_gpu = figures[5];
    a.b_cpu_with_pcie = figures[6];
    a.b_pcie_with_cpu = figures[7];
    a.ids = ids;
    a.weights = weights;
    a.resident = resident;
    a.resident_host = resident_host;
    a.fetched = fetched;
    a.slots = slots;
    a.fetch_weights = fetch_weights;
    a.stats = stats;
    emulate_launch(fetch_plan_kernel, dim3(1), FETCH_PLAN_THREADS, a);
}

// sizes: n_kinds, n_experts, top_k, max_fetch, dummy_base; per kind its source, stride,
// bytes and staging.
extern "C" void fetch_gather_emulate(const int64_t *sizes, const int32_t *fetched, int64_t *stats,
                                     const void *const *src, const int64_t *src_stride, const int64_t *nbytes,
                                     void *const *dst) {
    ft_cuda_fetch_gather_args a{};
    a.struct_size = sizeof(a);
    a.n_kinds = (int32_t)sizes[0];
    a.n_experts = sizes[1];
    a.top_k = sizes[2];
    a.max_fetch = sizes[3];
    a.dummy_base = sizes[4];
    a.fetched = fetched;
    a.stats = stats;
    for (int k = 0; k < a.n_kinds; ++k) {
        a.src[k] = src[k];
        a.src_stride[k] = src_stride[k];
        a.nbytes[k] = nbytes[k];
        a.dst[k] = dst[k];
    }
    emulate_launch(fetch_gather_kernel, dim3((unsigned)(a.max_fetch + a.top_k), (unsigned)a.n_kinds),
                   FETCH_GATHER_THREADS, a);
}
