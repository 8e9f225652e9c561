// The few CUDA constructs the Gated DeltaNet and fetch kernels use, on the CPU, so that g++
// compiles cuda/src/gdn_decode.cuh and fetch.cuh as they are: a launch runs one std::thread
// per CUDA thread of a block, the blocks one after another (so function-static arrays stand
// in for shared memory); __syncthreads is a barrier of the block's threads, a warp shuffle an
// exchange through memory between two barriers of the warp's 32 threads, an atomic a
// std::atomic_ref, the round-to-nearest intrinsics the plain operations (g++ contracts no
// multiply-add here: x86-64 without -mfma).
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

struct alignas(16) uint4 {
    uint32_t x, y, z, w;
};
struct alignas(8) uint2 {
    uint32_t x, y;
};

inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

inline int atomicAdd(int *p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) {
    std::atomic_ref<unsigned long long> r(*p);
    unsigned long long old = r.load();
    while (v < old && !r.compare_exchange_weak(old, v)) {
    }
    return old;
}
inline unsigned long long atomicMax(unsigned long long *p, unsigned long long v) {
    std::atomic_ref<unsigned long long> r(*p);
    unsigned long long old = r.load();
    while (v > old && !r.compare_exchange_weak(old, v)) {
    }
    return old;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

namespace emu {
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<float> lanes;
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

// Every lane of the warp calls it (the kernels shuffle with the full mask only).
inline float __shfl_xor_sync(unsigned, float v, int offset) {
    const unsigned t = threadIdx.x, warp = t / 32;
    emu::lanes[t] = v;
    emu::warp_barriers[warp]->arrive_and_wait();
    const float other = emu::lanes[warp * 32 + ((t % 32) ^ (unsigned)offset)];
    emu::warp_barriers[warp]->arrive_and_wait();
    return other;
}

// kernel<<<grid, threads>>>(p), synchronously; `threads` a multiple of 32.
template <typename P>
void emulate_launch(void (*kernel)(P), dim3 grid, unsigned threads, const P &p) {
    gridDim = grid;
    blockDim = dim3(threads);
    emu::block_barrier = std::make_unique<std::barrier<>>(threads);
    emu::warp_barriers.clear();
    for (unsigned w = 0; w < threads / 32; ++w) {
        emu::warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    }
    emu::lanes.assign(threads, 0.0f);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([=] {
            threadIdx = dim3(t);
            for (unsigned z = 0; z < grid.z; ++z) {
                for (unsigned y = 0; y < grid.y; ++y) {
                    for (unsigned x = 0; x < grid.x; ++x) {
                        blockIdx = dim3(x, y, z);
                        kernel(p);
                        // The next block reuses the shared arrays: all of this one is done.
                        emu::block_barrier->arrive_and_wait();
                    }
                }
            }
        });
    }
    for (auto &th : pool) {
        th.join();
    }
}
