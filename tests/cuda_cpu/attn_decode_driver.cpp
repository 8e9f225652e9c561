// Runs cuda/src/attn_decode.cuh's kernels on the CPU (tests/cuda_cpu/cuda_emu.h) for
// tests/test_attn_decode_cpu.py, launched as ft_cuda_attn_decode launches them:
//
//   attn_decode_driver DIR n_heads n_kv_heads head_dim head_dim_v n_keys k_stride v_stride
//                      v_dim_stride window pos scale sinks pos_dev n_sm
//
// reads float32 files DIR/q, DIR/k, DIR/v (whole strided buffers) and, with sinks 1,
// DIR/sinks; writes DIR/out and prints the plan ("chunks N group G chunk C"). pos_dev 1 reads
// the position through a pointer, as a captured step does. The workspace and the output start
// as NaNs, so an element the kernels leave unwritten shows.
#include "cuda_emu.h"

#include "../../cuda/src/attn_decode.cuh"

#include <fstream>
#include <string>

alignas(16) float attn_smem[48 * 1024 / sizeof(float)];

static std::vector<float> read_floats(const std::string &path) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) {
        emu::die(("cannot read " + path).c_str());
    }
    std::vector<float> v((size_t)f.tellg() / sizeof(float));
    f.seekg(0);
    f.read(reinterpret_cast<char *>(v.data()), (std::streamsize)(v.size() * sizeof(float)));
    return v;
}

int main(int argc, char **argv) {
    if (argc != 16) {
        emu::die("usage: DIR n_heads n_kv_heads head_dim head_dim_v n_keys k_stride v_stride v_dim_stride "
                 "window pos scale sinks pos_dev n_sm");
    }
    const std::string dir = argv[1];
    const auto arg = [&](int i) { return (int64_t)std::stoll(argv[i]); };
    ft_cuda_attn_decode_args a{};
    a.struct_size = sizeof(a);
    a.n_heads = arg(2);
    a.n_kv_heads = arg(3);
    a.head_dim = arg(4);
    a.head_dim_v = arg(5);
    a.n_keys = arg(6);
    a.k_stride = arg(7);
    a.v_stride = arg(8);
    a.v_dim_stride = arg(9);
    a.window = arg(10);
    const int64_t pos = arg(11);
    a.scale = std::stof(argv[12]);
    const bool with_sinks = arg(13) != 0, pos_dev = arg(14) != 0;
    const int64_t n_sm = arg(15);

    const std::vector<float> q = read_floats(dir + "/q"), k = read_floats(dir + "/k"), v = read_floats(dir + "/v");
    const std::vector<float> sinks = with_sinks ? read_floats(dir + "/sinks") : std::vector<float>();
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.sinks = with_sinks ? sinks.data() : nullptr;
    a.pos_value = pos_dev ? 0 : pos;
    a.pos_dev = pos_dev ? &pos : nullptr;

    const attn_plan p = attn_plan_for(a.n_heads, a.n_kv_heads, a.head_dim, a.head_dim_v, a.n_keys, n_sm);
    if (p.shared > sizeof(attn_smem)) {
        emu::die("the plan's shared memory is over 48 KiB");
    }
    if (p.work_bytes > attn_work_bound(a.n_heads, a.n_kv_heads, a.head_dim_v, a.n_keys, n_sm)) {
        emu::die("the plan's workspace is over the bound ft_cuda_attn_decode_work reports");
    }
    if (p.n_groups > 65535) {
        emu::die("gridDim.y over 65535");
    }
    std::vector<float> out((size_t)(a.n_heads * a.head_dim_v), NAN), work(p.work_bytes / sizeof(float), NAN);
    a.out = out.data();
    a.work = work.empty() ? nullptr : work.data();
    a.work_bytes = p.work_bytes;
    emu_launch(dim3{(unsigned)p.n_chunks, (unsigned)p.n_groups, 1}, dim3{ATTN_THREADS, 1, 1}, attn_smem, p.shared,
               [&] { attn_chunk_kernel(a, p); });
    if (p.n_chunks > 1) {
        const unsigned dim_blocks = (unsigned)attn_ceil_div(a.head_dim_v, ATTN_MERGE_THREADS);
        emu_launch(dim3{(unsigned)a.n_heads, dim_blocks, 1}, dim3{ATTN_MERGE_THREADS, 1, 1}, attn_smem, 0,
                   [&] { attn_merge_kernel(a, p); });
    }
    std::ofstream f(dir + "/out", std::ios::binary);
    f.write(reinterpret_cast<const char *>(out.data()), (std::streamsize)(out.size() * sizeof(float)));
    printf("chunks %lld group %lld chunk %lld\n", (long long)p.n_chunks, (long long)p.group, (long long)p.chunk);
    return 0;
}
