// The few CUDA constructs the Gated DeltaNet kernels use, on the CPU, so that g++ compiles
// cuda/src/gdn_decode.cuh as it is: a launch runs one std::thread per CUDA thread of a block,
// the blocks one after another (so function-static arrays stand in for shared memory);
// __syncthreads is a barrier of the block's threads, a warp shuffle an exchange through
// memory between two barriers of the warp's 32 threads.
#pragma once

#include <barrier>
#include <cmath>
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
