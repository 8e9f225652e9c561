// Just enough CUDA for g++ to run a kernel on the CPU, for tests: a block's threads are
// std::threads (one per CUDA thread), __syncthreads is a barrier of the block, a warp shuffle
// exchanges through a per-warp buffer between barriers of the warp, and blocks run one after
// another, so shared memory is plain memory the caller provides. Only what the kernels under
// test use is here.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {

// A block's barriers, and two buffers per warp for shuffles (a lane may write the next
// shuffle's values while a slower one still reads this one's: they alternate).
struct block_state {
    explicit block_state(unsigned threads) : block((std::ptrdiff_t)threads), lanes(2 * threads) {
        for (unsigned w = 0; w < threads / 32; ++w) {
            warps.push_back(std::make_unique<std::barrier<>>(32));
        }
    }
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> lanes;
};

inline block_state *g_block = nullptr;
inline thread_local unsigned t_shuffles = 0;

[[noreturn]] inline void die(const char *what) {
    fprintf(stderr, "cuda_emu: %s\n", what);
    abort();
}

}  // namespace emu

inline void __syncthreads() { emu::g_block->block.arrive_and_wait(); }

// Every lane of the warp must call it (the full mask), as on the GPU.
inline float __shfl_xor_sync(unsigned mask, float v, int offset) {
    if (mask != 0xffffffffu || offset < 0 || offset >= 32) {
        emu::die("__shfl_xor_sync: only the full mask and lane offsets 0..31");
    }
    const unsigned t = threadIdx.x, buf = (emu::t_shuffles++ % 2) * blockDim.x;
    emu::g_block->lanes[buf + t] = v;
    emu::g_block->warps[t / 32]->arrive_and_wait();
    return emu::g_block->lanes[buf + ((t & ~31u) | ((t % 32) ^ (unsigned)offset))];
}

// Runs kernel() as a grid of blocks (z = 1), one block at a time. Before each block the shared
// memory (`shared_bytes` at `shared`) is filled with NaNs, so reading what the block did not
// write shows.
template <class Kernel>
void emu_launch(dim3 grid, dim3 block, float *shared, size_t shared_bytes, Kernel kernel) {
    if (block.x % 32 != 0 || block.y != 1 || block.z != 1 || grid.z != 1) {
        emu::die("launch: one-dimensional blocks of whole warps, two-dimensional grids");
    }
    gridDim = grid;
    blockDim = block;
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            for (size_t i = 0; i < shared_bytes / sizeof(float); ++i) {
                shared[i] = NAN;
            }
            emu::block_state state(block.x);
            emu::g_block = &state;
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < block.x; ++t) {
                threads.emplace_back([&, t] {
                    threadIdx = dim3{t, 0, 0};
                    blockIdx = dim3{bx, by, 0};
                    emu::t_shuffles = 0;
                    kernel();
                    // An exited thread no longer holds back its block's barriers, as on the GPU.
                    state.block.arrive_and_drop();
                    state.warps[t / 32]->arrive_and_drop();
                });
            }
            for (auto &th : threads) {
                th.join();
            }
        }
    }
}
