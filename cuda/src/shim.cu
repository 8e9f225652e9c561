// libfreetoken_cuda: launches ggml-cuda's MMVQ/MMQ expert kernels on engine-owned memory, on
// the caller's stream, plus the few small kernels of a MoE layer (activation, weighted sum,
// id check). The C ABI is in include/freetoken_cuda.h.
//
// How the launch works (checked on the H200, see docs/gpu.md): ggml's launchers take a
// ggml_backend_cuda_context and ggml_tensor descriptors. The descriptors here point at the
// caller's memory and name a zero-interface buffer of the CUDA buffer type (usage ANY, so the
// launchers never clear "padding" past a compute tensor). One context per (device, stream)
// keeps ggml's scratch pool on one stream; its stream slot holds the caller's stream only for
// the call, so the context never owns (or destroys) it.
//
// This file must be compiled with ggml-cuda's own -D flags: the context's layout depends on
// them (USE_CUDA_GRAPH adds members). cuda/CMakeLists.txt copies them from the target.

#include "freetoken_cuda.h"
#include "gdn_decode.cuh"

// The device's nanosecond timer (fetch.cuh and the hand-off's timeout read it).
static __device__ __forceinline__ uint64_t ft_clock_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#include "fetch.cuh"

#include "common.cuh"
#include "ggml-backend-impl.h"
#include "ggml-cuda.h"
#include "mmq.cuh"
#include "mmvq.cuh"

#include "attn_decode.cuh"

#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#define FT_EXPORT extern "C" __attribute__((visibility("default")))

static thread_local std::string g_last_error;

static int32_t fail(int32_t code, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    g_last_error = buf;
    return code;
}

static int32_t cuda_fail(cudaError_t err, const char *what) {
    const int32_t code = err == cudaErrorMemoryAllocation ? FT_CUDA_ENOMEM : FT_CUDA_EDEVICE;
    return fail(code, "%s: CUDA error %d (%s)", what, (int)err, cudaGetErrorString(err));
}

// Blocks per tensor stay under 2^31: MMQ/MMVQ index blocks with 32-bit integers.
static constexpr int64_t MAX_BLOCKS = FT_CUDA_MAX_POOL_BLOCKS;
// Elements per activation or output tensor, for the same reason.
static constexpr int64_t MAX_ELEMENTS = INT32_MAX;

struct device_state {
    ggml_backend_buffer_t buffer = nullptr;
    std::map<cudaStream_t, ggml_backend_cuda_context *> contexts;
};

// Never destroyed: a context's destructor frees CUDA memory, which at process exit may run
// after the CUDA runtime is gone (and ggml aborts on any CUDA error).
static std::mutex g_mutex;
static device_state *g_devices = new device_state[GGML_CUDA_MAX_DEVICES];
static bool g_initialized = false;
static int g_n_devices = 0;
static std::string g_init_error;

static void log_callback(enum ggml_log_level level, const char *text, void *) {
    // ggml's info lines (device list, pool sizes) are noise inside an engine; keep the rest.
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) {
        fprintf(stderr, "freetoken_cuda: %s", text);
    }
}

static int32_t init_locked() {
    if (g_initialized) {
        return g_n_devices > 0 ? FT_CUDA_OK : fail(FT_CUDA_EDEVICE, "%s", g_init_error.c_str());
    }
    g_initialized = true;
    ggml_log_set(log_callback, nullptr);
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();
        g_init_error = std::string("no CUDA device: ") + cudaGetErrorString(err);
        return fail(FT_CUDA_EDEVICE, "%s", g_init_error.c_str());
    }
    if (n == 0) {
        g_init_error = "no CUDA device";
        return fail(FT_CUDA_EDEVICE, "%s", g_init_error.c_str());
    }
    g_n_devices = std::min(ggml_cuda_info().device_count, GGML_CUDA_MAX_DEVICES);
    if (g_n_devices == 0) {
        g_init_error = "ggml-cuda found no usable device";
        return fail(FT_CUDA_EDEVICE, "%s", g_init_error.c_str());
    }
    return FT_CUDA_OK;
}

static int32_t check_device(int32_t device) {
    const int32_t rc = init_locked();
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (device < 0 || device >= g_n_devices) {
        return fail(FT_CUDA_EINVAL, "device %d out of range (%d devices)", device, g_n_devices);
    }
    return FT_CUDA_OK;
}

// Makes `device` current for the call and restores the caller's device after it.
struct device_guard {
    int prev = -1;
    explicit device_guard(int device) {
        if (cudaGetDevice(&prev) != cudaSuccess) {
            prev = -1;
        }
        ggml_cuda_set_device(device);
    }
    ~device_guard() {
        int cur = -1;
        if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) {
            cudaSetDevice(prev);
        }
    }
};

// The caller's stream in the context's stream slot for one call.
struct stream_binding {
    ggml_backend_cuda_context *ctx;
    int device;
    stream_binding(ggml_backend_cuda_context *ctx, int device, cudaStream_t stream) : ctx(ctx), device(device) {
        ctx->curr_stream_no = 0;
        ctx->streams[device][0] = stream;
    }
    ~stream_binding() { ctx->streams[device][0] = nullptr; }
};

static cudaStream_t as_stream(void *stream) {
    // torch reports the legacy default stream as 0; ggml treats a null slot as "create one".
    return stream == nullptr ? cudaStreamLegacy : (cudaStream_t)stream;
}

static ggml_backend_cuda_context *context_for(int device, cudaStream_t stream) {
    device_state &ds = g_devices[device];
    if (ds.buffer == nullptr) {
        ds.buffer = ggml_backend_buffer_init(ggml_backend_cuda_buffer_type(device), {}, nullptr, 0);
    }
    auto it = ds.contexts.find(stream);
    if (it != ds.contexts.end()) {
        return it->second;
    }
    auto *ctx = new ggml_backend_cuda_context(device);
    ds.contexts.emplace(stream, ctx);
    return ctx;
}

static bool has_mmvq(ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q1_0: case GGML_TYPE_Q2_0:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0:
        case GGML_TYPE_MXFP4: case GGML_TYPE_NVFP4:
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S: case GGML_TYPE_IQ3_XXS:
        case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ1_M: case GGML_TYPE_IQ4_NL:
        case GGML_TYPE_IQ4_XS:
            return true;
        default:
            return false;
    }
}

// The types of mmq.cu's switch: MMVQ's less IQ1_M.
static bool has_mmq(ggml_type t) { return has_mmvq(t) && t != GGML_TYPE_IQ1_M; }

static int32_t kernel_for_locked(int device, ggml_type t, int64_t n_tokens) {
    if (n_tokens < 1) {
        return FT_CUDA_KERNEL_NONE;
    }
    const int cc = ggml_cuda_info().devices[device].cc;
    // As ggml's mul_mat_id: MMVQ up to its per-type batch limit (8 on Volta and Ada+), MMQ above.
    if (has_mmvq(t) && n_tokens <= MMVQ_MAX_BATCH_SIZE &&
        (n_tokens <= get_mmvq_mmid_max_batch(t, cc) || !has_mmq(t))) {
        return FT_CUDA_KERNEL_MMVQ;
    }
    if (has_mmq(t) && ggml_cuda_should_use_mmq(t, cc, n_tokens, /*n_experts=*/1)) {
        return FT_CUDA_KERNEL_MMQ;
    }
    return FT_CUDA_KERNEL_NONE;
}

static int32_t check_type(int32_t id, ggml_type *out) {
    if (id < 0 || id >= GGML_TYPE_COUNT || ggml_type_size((ggml_type)id) == 0) {
        return fail(FT_CUDA_EUNSUPPORTED, "type id %d is not a ggml type", id);
    }
    *out = (ggml_type)id;
    return FT_CUDA_OK;
}

static_assert(FT_CUDA_ROW_PADDING == MATRIX_ROW_PADDING, "the ABI's row padding is ggml-cuda's");

// Bytes a pool tensor of `n_slots` matrices [k, n] needs, zeroed tail included.
static int64_t pool_bytes(ggml_type t, int64_t k, int64_t n, int64_t n_slots) {
    return ft_cuda_pool_bytes(ggml_blck_size(t), (int64_t)ggml_type_size(t), k, n, n_slots);
}

static int32_t check_pool(const char *what, ggml_type t, int64_t k, int64_t n, int64_t n_slots, const void *p,
                   uint64_t bytes) {
    if (p == nullptr) {
        return fail(FT_CUDA_EINVAL, "%s: null pointer", what);
    }
    if (k <= 0 || n <= 0 || n_slots <= 0) {
        return fail(FT_CUDA_ESHAPE, "%s: shape [%lld, %lld, %lld] has an empty dimension", what, (long long)k,
                    (long long)n, (long long)n_slots);
    }
    const int64_t blck = ggml_blck_size(t);
    if (k % blck != 0) {
        return fail(FT_CUDA_ESHAPE, "%s: K=%lld is not a multiple of %s's block size %lld", what, (long long)k,
                    ggml_type_name(t), (long long)blck);
    }
    if (n_slots > MAX_BLOCKS / n || (k / blck) > MAX_BLOCKS / (n * n_slots)) {
        return fail(FT_CUDA_ESHAPE, "%s: %lld x %lld x %lld %s is 2^31 blocks or more (32-bit block offsets)",
                    what, (long long)k, (long long)n, (long long)n_slots, ggml_type_name(t));
    }
    const int64_t need = pool_bytes(t, k, n, n_slots);
    if ((int64_t)bytes < need) {
        return fail(FT_CUDA_ESHAPE, "%s: %llu bytes, need %lld (%lld x %lld x %lld %s and a zeroed tail)", what,
                    (unsigned long long)bytes, (long long)need, (long long)k, (long long)n, (long long)n_slots,
                    ggml_type_name(t));
    }
    return FT_CUDA_OK;
}

// A descriptor of `data` as a contiguous [ne0, ne1, ne2] tensor.
static ggml_tensor make_tensor(ggml_type t, int64_t ne0, int64_t ne1, int64_t ne2, const void *data,
                        ggml_backend_buffer_t buffer) {
    ggml_tensor x;
    memset(&x, 0, sizeof(x));
    x.type = t;
    x.buffer = buffer;
    x.ne[0] = ne0;
    x.ne[1] = ne1;
    x.ne[2] = ne2;
    x.ne[3] = 1;
    x.nb[0] = ggml_type_size(t);
    x.nb[1] = ggml_row_size(t, ne0);
    x.nb[2] = x.nb[1] * ne1;
    x.nb[3] = x.nb[2] * ne2;
    x.data = const_cast<void *>(data);
    return x;
}

static __global__ void check_ids_kernel(const int32_t *ids, int n_used, int n_tokens, int n_slots, int *flag) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tokens) {
        return;
    }
    const int32_t *row = ids + (int64_t)t * n_used;
    for (int i = 0; i < n_used; ++i) {
        const int32_t v = row[i];
        if (v < 0 || v >= n_slots) {
            atomicOr(flag, 1);
        }
        for (int j = 0; j < i; ++j) {
            if (row[j] == v) {
                atomicOr(flag, 2);
            }
        }
    }
}

// Range and duplicate check of device ids; synchronizes the stream to read the verdict.
static int32_t check_ids_device(ggml_backend_cuda_context &ctx, cudaStream_t stream, const int32_t *ids, int64_t n_used,
                         int64_t n_tokens, int64_t n_slots) {
    ggml_cuda_pool_alloc<int> flag(ctx.pool(), 1);
    int host = 0;
    cudaError_t err = cudaMemsetAsync(flag.get(), 0, sizeof(int), stream);
    if (err == cudaSuccess) {
        check_ids_kernel<<<(unsigned)((n_tokens + 127) / 128), 128, 0, stream>>>(ids, (int)n_used, (int)n_tokens,
                                                                                 (int)n_slots, flag.get());
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) {
        err = cudaMemcpyAsync(&host, flag.get(), sizeof(int), cudaMemcpyDeviceToHost, stream);
    }
    if (err == cudaSuccess) {
        err = cudaStreamSynchronize(stream);
    }
    if (err != cudaSuccess) {
        return cuda_fail(err, "id check");
    }
    if (host & 1) {
        return fail(FT_CUDA_EINVAL, "ids: a slot id is outside [0, %lld)", (long long)n_slots);
    }
    if (host & 2) {
        // llama.cpp #24591: MMQ gives non-finite output when a token names one slot twice.
        return fail(FT_CUDA_EINVAL, "ids: a token names the same slot twice (each token's slots must be distinct)");
    }
    return FT_CUDA_OK;
}

// y = W[ids] x through MMVQ or MMQ; descriptors already built and checked.
static void launch_matmul(ggml_backend_cuda_context &ctx, int32_t kernel, const ggml_tensor &w, const ggml_tensor &x,
                   const ggml_tensor &ids, ggml_tensor &y) {
    if (kernel == FT_CUDA_KERNEL_MMVQ) {
        ggml_cuda_mul_mat_vec_q(ctx, &w, &x, &ids, &y);
    } else {
        ggml_cuda_mul_mat_q(ctx, &w, &x, &ids, &y);
    }
}

static __device__ __forceinline__ float act_value(int act, float g) {
    if (act == FT_CUDA_ACT_GELU) {
        const float c = 0.79788456080286535587989211986876f;
        return 0.5f * g * (1.0f + tanhf(c * g * (1.0f + 0.044715f * g * g)));
    }
    return g / (1.0f + expf(-g));
}

static __global__ void glu_kernel(const float *gate, float *up, int64_t n, int act) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        up[i] *= act_value(act, gate[i]);
    }
}

// y[t, h] (+)= sum_j w[t, j] * d[t, j, h]
static __global__ void weighted_sum_kernel(const float *d, const float *w, float *y, int64_t hidden, int n_used,
                                    int64_t n_tokens, bool accumulate) {
    const int64_t h = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= hidden) {
        return;
    }
    for (int64_t t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        const float *dt = d + t * n_used * hidden;
        const float *wt = w + t * n_used;
        float s = 0.0f;
        for (int j = 0; j < n_used; ++j) {
            s += wt[j] * dt[(int64_t)j * hidden + h];
        }
        float *out = y + t * hidden + h;
        *out = accumulate ? *out + s : s;
    }
}

static int32_t check_tokens(int64_t n_tokens, int64_t n_used, int64_t width, const char *what) {
    if (n_tokens < 1 || n_used < 1) {
        return fail(FT_CUDA_ESHAPE, "%s: n_tokens=%lld and n_used=%lld must be positive", what,
                    (long long)n_tokens, (long long)n_used);
    }
    if (n_used > MAX_ELEMENTS / n_tokens || width > MAX_ELEMENTS / (n_used * n_tokens)) {
        return fail(FT_CUDA_ESHAPE, "%s: %lld tokens x %lld slots x %lld is 2^31 elements or more", what,
                    (long long)n_tokens, (long long)n_used, (long long)width);
    }
    return FT_CUDA_OK;
}

static int32_t expert_matmul_locked(const ft_cuda_matmul_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    ggml_type t = GGML_TYPE_COUNT;
    if ((rc = check_type(a.wtype, &t)) != FT_CUDA_OK) {
        return rc;
    }
    if ((rc = check_pool("weights", t, a.k, a.n, a.n_slots, a.w, a.w_bytes)) != FT_CUDA_OK) {
        return rc;
    }
    if ((rc = check_tokens(a.n_tokens, a.n_used, std::max(a.k, a.n), "expert_matmul")) != FT_CUDA_OK) {
        return rc;
    }
    if (a.n_b != 1 && a.n_b != a.n_used) {
        return fail(FT_CUDA_ESHAPE, "x: n_b=%lld must be 1 or n_used=%lld", (long long)a.n_b, (long long)a.n_used);
    }
    if (a.x == nullptr || a.ids == nullptr || a.y == nullptr) {
        return fail(FT_CUDA_EINVAL, "x, ids and y must be non-null");
    }
    device_guard dg(a.device);
    const int32_t kernel = kernel_for_locked(a.device, t, a.n_tokens);
    if (kernel == FT_CUDA_KERNEL_NONE) {
        return fail(FT_CUDA_EUNSUPPORTED, "ggml-cuda has no MMVQ/MMQ kernel for %s at %lld tokens", ggml_type_name(t),
                    (long long)a.n_tokens);
    }
    cudaGetLastError(); // an earlier, unrelated error would make ggml's own checks abort
    const cudaStream_t stream = as_stream(a.stream);
    ggml_backend_cuda_context *ctx = context_for(a.device, stream);
    const stream_binding bind(ctx, a.device, stream);
    if (a.flags & FT_CUDA_CHECK_IDS) {
        if ((rc = check_ids_device(*ctx, stream, a.ids, a.n_used, a.n_tokens, a.n_slots)) != FT_CUDA_OK) {
            return rc;
        }
    }
    ggml_backend_buffer_t buf = g_devices[a.device].buffer;
    const ggml_tensor w = make_tensor(t, a.k, a.n, a.n_slots, a.w, buf);
    const ggml_tensor x = make_tensor(GGML_TYPE_F32, a.k, a.n_b, a.n_tokens, a.x, buf);
    const ggml_tensor ids = make_tensor(GGML_TYPE_I32, a.n_used, a.n_tokens, 1, a.ids, buf);
    ggml_tensor y = make_tensor(GGML_TYPE_F32, a.n, a.n_used, a.n_tokens, a.y, buf);
    launch_matmul(*ctx, kernel, w, x, ids, y);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "expert_matmul");
}

static int32_t moe_layer_locked(const ft_cuda_moe_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    ggml_type tg = GGML_TYPE_COUNT, tu = GGML_TYPE_COUNT, td = GGML_TYPE_COUNT;
    if ((rc = check_type(a.gate_type, &tg)) != FT_CUDA_OK || (rc = check_type(a.up_type, &tu)) != FT_CUDA_OK ||
        (rc = check_type(a.down_type, &td)) != FT_CUDA_OK) {
        return rc;
    }
    if ((rc = check_pool("gate", tg, a.hidden, a.ffn, a.n_slots, a.gate, a.gate_bytes)) != FT_CUDA_OK ||
        (rc = check_pool("up", tu, a.hidden, a.ffn, a.n_slots, a.up, a.up_bytes)) != FT_CUDA_OK ||
        (rc = check_pool("down", td, a.ffn, a.hidden, a.n_slots, a.down, a.down_bytes)) != FT_CUDA_OK) {
        return rc;
    }
    if ((rc = check_tokens(a.n_tokens, a.n_used, std::max(a.hidden, a.ffn), "moe_layer")) != FT_CUDA_OK) {
        return rc;
    }
    if (a.x == nullptr || a.ids == nullptr || a.weights == nullptr || a.y == nullptr) {
        return fail(FT_CUDA_EINVAL, "x, ids, weights and y must be non-null");
    }
    if (a.act != FT_CUDA_ACT_SILU && a.act != FT_CUDA_ACT_GELU) {
        return fail(FT_CUDA_EINVAL, "unknown activation %d", a.act);
    }
    device_guard dg(a.device);
    const int32_t kg = kernel_for_locked(a.device, tg, a.n_tokens);
    const int32_t ku = kernel_for_locked(a.device, tu, a.n_tokens);
    const int32_t kd = kernel_for_locked(a.device, td, a.n_tokens);
    if (kg == FT_CUDA_KERNEL_NONE || ku == FT_CUDA_KERNEL_NONE || kd == FT_CUDA_KERNEL_NONE) {
        const ggml_type bad = kg == FT_CUDA_KERNEL_NONE ? tg : ku == FT_CUDA_KERNEL_NONE ? tu : td;
        return fail(FT_CUDA_EUNSUPPORTED, "ggml-cuda has no MMVQ/MMQ kernel for %s at %lld tokens",
                    ggml_type_name(bad), (long long)a.n_tokens);
    }
    cudaGetLastError();
    const cudaStream_t stream = as_stream(a.stream);
    ggml_backend_cuda_context *ctx = context_for(a.device, stream);
    const stream_binding bind(ctx, a.device, stream);
    if (a.flags & FT_CUDA_CHECK_IDS) {
        if ((rc = check_ids_device(*ctx, stream, a.ids, a.n_used, a.n_tokens, a.n_slots)) != FT_CUDA_OK) {
            return rc;
        }
    }
    ggml_backend_buffer_t buf = g_devices[a.device].buffer;
    const int64_t n_act = a.ffn * a.n_used * a.n_tokens;
    // ggml's pool is a stack on VMM devices: allocate in declaration order, free in reverse.
    ggml_cuda_pool_alloc<float> gate_out(ctx->pool());
    ggml_cuda_pool_alloc<float> up_out(ctx->pool());
    ggml_cuda_pool_alloc<float> down_out(ctx->pool());
    const bool fused = tg == tu && ku == FT_CUDA_KERNEL_MMVQ;
    if (!fused) {
        gate_out.alloc(n_act);
    }
    up_out.alloc(n_act);
    down_out.alloc(a.hidden * a.n_used * a.n_tokens);

    const ggml_tensor gate = make_tensor(tg, a.hidden, a.ffn, a.n_slots, a.gate, buf);
    const ggml_tensor up = make_tensor(tu, a.hidden, a.ffn, a.n_slots, a.up, buf);
    const ggml_tensor down = make_tensor(td, a.ffn, a.hidden, a.n_slots, a.down, buf);
    const ggml_tensor x = make_tensor(GGML_TYPE_F32, a.hidden, 1, a.n_tokens, a.x, buf);
    const ggml_tensor ids = make_tensor(GGML_TYPE_I32, a.n_used, a.n_tokens, 1, a.ids, buf);
    ggml_tensor act = make_tensor(GGML_TYPE_F32, a.ffn, a.n_used, a.n_tokens, up_out.get(), buf);
    ggml_tensor y = make_tensor(GGML_TYPE_F32, a.hidden, a.n_used, a.n_tokens, down_out.get(), buf);

    if (fused) {
        // MMVQ computes up and gate in one pass and applies the GLU in its epilogue.
        ggml_cuda_mm_fusion_args_host fusion{};
        fusion.gate = &gate;
        fusion.glu_op = a.act == FT_CUDA_ACT_GELU ? GGML_GLU_OP_GEGLU : GGML_GLU_OP_SWIGLU;
        ggml_cuda_mul_mat_vec_q(*ctx, &up, &x, &ids, &act, &fusion);
    } else {
        ggml_tensor g = make_tensor(GGML_TYPE_F32, a.ffn, a.n_used, a.n_tokens, gate_out.get(), buf);
        launch_matmul(*ctx, kg, gate, x, ids, g);
        launch_matmul(*ctx, ku, up, x, ids, act);
        const int blocks = (int)std::min<int64_t>((n_act + 255) / 256, 65536);
        glu_kernel<<<blocks, 256, 0, stream>>>(gate_out.get(), up_out.get(), n_act, a.act);
    }
    launch_matmul(*ctx, kd, down, act, ids, y);
    const dim3 grid((unsigned)((a.hidden + 255) / 256), (unsigned)std::min<int64_t>(a.n_tokens, 65535));
    weighted_sum_kernel<<<grid, 256, 0, stream>>>(down_out.get(), a.weights, a.y, a.hidden, (int)a.n_used,
                                                  a.n_tokens, (a.flags & FT_CUDA_ACCUMULATE) != 0);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "moe_layer");
}

// ---- Hand-off with a host thread (hybrid MoE) ----

static __global__ void handoff_wait_add_kernel(const int64_t *counter, volatile int64_t *block, const float *src,
                                               float *dst, int64_t n, uint64_t timeout_ns) {
    __shared__ int answered;
    if (threadIdx.x == 0) {
        const int64_t seq = *counter;
        const uint64_t start = ft_clock_ns();
        int ok = 1;
        while (block[FT_CUDA_HANDOFF_CPU_SEQ] < seq) {
            if (ft_clock_ns() - start > timeout_ns) {
                block[FT_CUDA_HANDOFF_TIMEOUT] = seq;
                ok = 0;
                break;
            }
            __nanosleep(64);
        }
        __threadfence_system();
        answered = ok;
    }
    __syncthreads();
    if (!answered) {
        return;
    }
    const volatile float *s = src;  // host memory the host just wrote: never a cached copy
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        dst[i] += s[i];
    }
}

// The device address of registered host memory (an error when it is not registered mapped).
static int32_t mapped(const void *host, void **dev, const char *what) {
    const cudaError_t err = cudaHostGetDevicePointer(dev, const_cast<void *>(host), 0);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return fail(FT_CUDA_EINVAL, "%s: not mapped page-locked host memory (%s)", what, cudaGetErrorString(err));
    }
    return FT_CUDA_OK;
}

static int32_t handoff_locked(const ft_cuda_handoff_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.counter == nullptr || a.block == nullptr) {
        return fail(FT_CUDA_EINVAL, "handoff: counter and block must be non-null");
    }
    device_guard dg(a.device);
    void *block = nullptr;
    if ((rc = mapped(a.block, &block, "handoff block")) != FT_CUDA_OK) {
        return rc;
    }
    if (a.src == nullptr || a.dst == nullptr || a.n < 1 || a.n > MAX_ELEMENTS) {
        return fail(FT_CUDA_EINVAL, "handoff wait_add: src and dst non-null, n=%lld in 1..2^31", (long long)a.n);
    }
    void *src = nullptr;
    if ((rc = mapped(a.src, &src, "handoff src")) != FT_CUDA_OK) {
        return rc;
    }
    cudaGetLastError();
    handoff_wait_add_kernel<<<1, 1024, 0, as_stream(a.stream)>>>(a.counter, (volatile int64_t *)block,
                                                                 (const float *)src, a.dst, a.n, a.timeout_ns);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "handoff");
}

static __global__ void handoff_routes_kernel(ft_cuda_handoff_routes_args a, volatile int64_t *block, float *x_host,
                                             int32_t *ids_host, float *weights_host) {
    const int64_t n_x = a.n_tokens * a.hidden, n_r = a.n_tokens * a.top_k;
    for (int64_t i = threadIdx.x; i < n_x; i += blockDim.x) {
        x_host[i] = a.x[i];
    }
    for (int64_t i = threadIdx.x; i < n_r; i += blockDim.x) {
        const int32_t id = a.ids[i];
        const float w = a.weights[i];
        ids_host[i] = id;
        weights_host[i] = w;
        const int32_t s = id >= 0 && id < a.n_experts ? a.resident[id] : -1;
        a.slots[i] = s >= 0 ? s : (int32_t)(a.dummy_base + i % a.top_k);
        a.gpu_weights[i] = s >= 0 ? w : 0.0f;
    }
    __threadfence_system();  // every thread's host writes before the request
    __syncthreads();
    if (threadIdx.x == 0) {
        const int64_t seq = *a.counter + 1;
        *a.counter = seq;
        block[FT_CUDA_HANDOFF_TAG] = a.tag;
        __threadfence_system();
        block[FT_CUDA_HANDOFF_GPU_SEQ] = seq;
        __threadfence_system();
    }
}

static int32_t handoff_routes_locked(const ft_cuda_handoff_routes_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.counter == nullptr || a.block == nullptr || a.x == nullptr || a.ids == nullptr ||
        a.weights == nullptr || a.resident == nullptr || a.slots == nullptr || a.gpu_weights == nullptr) {
        return fail(FT_CUDA_EINVAL, "handoff_routes: null pointer");
    }
    if (a.n_tokens < 1 || a.hidden < 1 || a.top_k < 1 || a.n_experts < 1 || a.dummy_base < 0 ||
        a.n_tokens * a.hidden > MAX_ELEMENTS || a.dummy_base + a.top_k > INT32_MAX) {
        return fail(FT_CUDA_ESHAPE, "handoff_routes: bad sizes");
    }
    device_guard dg(a.device);
    void *block = nullptr, *x_host = nullptr, *ids_host = nullptr, *w_host = nullptr;
    if ((rc = mapped(a.block, &block, "handoff block")) != FT_CUDA_OK ||
        (rc = mapped(a.x_host, &x_host, "x_host")) != FT_CUDA_OK ||
        (rc = mapped(a.ids_host, &ids_host, "ids_host")) != FT_CUDA_OK ||
        (rc = mapped(a.weights_host, &w_host, "weights_host")) != FT_CUDA_OK) {
        return rc;
    }
    cudaGetLastError();
    handoff_routes_kernel<<<1, 1024, 0, as_stream(a.stream)>>>(a, (volatile int64_t *)block, (float *)x_host,
                                                               (int32_t *)ids_host, (float *)w_host);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "handoff_routes");
}

// ---- The fetch share on the device (fetch.cuh) ----

static bool positive_finite(double v) { return v > 0.0 && v < INFINITY; }

static int32_t fetch_plan_locked(const ft_cuda_fetch_plan_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.ids == nullptr || a.weights == nullptr || a.resident == nullptr || a.resident_host == nullptr ||
        a.fetched == nullptr || a.slots == nullptr || a.fetch_weights == nullptr || a.stats == nullptr) {
        return fail(FT_CUDA_EINVAL, "fetch_plan: null pointer");
    }
    const bool links = positive_finite(a.b_cpu) && positive_finite(a.b_pcie) && positive_finite(a.b_gpu) &&
                       positive_finite(a.b_cpu_with_pcie) && positive_finite(a.b_pcie_with_cpu);
    if (a.n_tokens < 1 || a.top_k < 1 || a.n_tokens > MAX_ELEMENTS / a.top_k || a.n_experts < 1 ||
        a.n_experts > FT_CUDA_FETCH_MAX_EXPERTS || a.dummy_base < 0 || a.dummy_base > INT32_MAX - a.top_k ||
        a.max_fetch < 0 || a.max_fetch > a.n_experts || a.max_fetch > a.dummy_base ||
        a.max_fetch >= FETCH_PLAN_THREADS || (a.price_routes != 0 && a.price_routes != 1) ||
        !positive_finite(a.expert_bytes) || !(a.overhead_s >= 0.0 && a.overhead_s < INFINITY) ||
        !(a.share < 0.0 || a.share <= 1.0) || !links) {
        return fail(FT_CUDA_ESHAPE,
                    "fetch_plan: bad sizes (%lld tokens, top-%lld of %lld experts, max_fetch %lld, dummy_base %lld, "
                    "share %g, expert bytes %g, overhead %g)",
                    (long long)a.n_tokens, (long long)a.top_k, (long long)a.n_experts, (long long)a.max_fetch,
                    (long long)a.dummy_base, a.share, a.expert_bytes, a.overhead_s);
    }
    device_guard dg(a.device);
    void *marks = nullptr;
    if ((rc = mapped(a.resident_host, &marks, "resident_host")) != FT_CUDA_OK) {
        return rc;
    }
    ft_cuda_fetch_plan_args p = a;
    p.resident_host = (int32_t *)marks;
    cudaGetLastError();
    fetch_plan_kernel<<<1, FETCH_PLAN_THREADS, 0, as_stream(a.stream)>>>(p);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "fetch_plan");
}

static int32_t fetch_gather_locked(const ft_cuda_fetch_gather_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.fetched == nullptr || a.stats == nullptr) {
        return fail(FT_CUDA_EINVAL, "fetch_gather: null pointer");
    }
    if (a.n_kinds < 1 || a.n_kinds > 3 || a.n_experts < 1 || a.n_experts > FT_CUDA_FETCH_MAX_EXPERTS ||
        a.top_k < 1 || a.max_fetch < 0 || a.max_fetch > a.n_experts || a.dummy_base < a.max_fetch ||
        a.dummy_base > INT32_MAX - a.top_k) {
        return fail(FT_CUDA_ESHAPE, "fetch_gather: bad sizes (%d kinds, %lld experts, top-%lld, max_fetch %lld, "
                    "dummy_base %lld)", a.n_kinds, (long long)a.n_experts, (long long)a.top_k,
                    (long long)a.max_fetch, (long long)a.dummy_base);
    }
    device_guard dg(a.device);
    ft_cuda_fetch_gather_args p = a;
    for (int k = 0; k < a.n_kinds; ++k) {
        if (a.src[k] == nullptr || a.dst[k] == nullptr || a.nbytes[k] < 1 || a.src_stride[k] < 0 ||
            a.src_stride[k] > (INT64_MAX - a.nbytes[k]) / a.n_experts) {
            return fail(FT_CUDA_EINVAL, "fetch_gather: kind %d: null pointer or bad sizes", k);
        }
        // Every expert's bytes lie in one registration: its first and last byte map to
        // device addresses as far apart as on the host.
        const int64_t last = (a.n_experts - 1) * a.src_stride[k] + a.nbytes[k] - 1;
        void *first_dev = nullptr, *last_dev = nullptr;
        if ((rc = mapped(a.src[k], &first_dev, "fetch_gather src")) != FT_CUDA_OK ||
            (rc = mapped((const char *)a.src[k] + last, &last_dev, "fetch_gather src end")) != FT_CUDA_OK) {
            return rc;
        }
        if ((char *)last_dev - (char *)first_dev != last) {
            return fail(FT_CUDA_EINVAL, "fetch_gather: kind %d's experts span several registrations", k);
        }
        p.src[k] = first_dev;
    }
    cudaGetLastError();
    const dim3 grid((unsigned)(a.max_fetch + a.top_k), (unsigned)a.n_kinds);
    fetch_gather_kernel<<<grid, FETCH_GATHER_THREADS, 0, as_stream(a.stream)>>>(p);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "fetch_gather");
}

// ---- Attention's q/k: RMSNorm per head and NEOX RoPE in one kernel ----

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
static __device__ float block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    const int lane = threadIdx.x % 32;
    if (lane == 0) {
        part[threadIdx.x / 32] = v;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? part[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// One block per (token, head); thread i holds the pair (i, i + d/2) that NEOX rotates together.
static __global__ void norm_rope_kernel(ft_cuda_norm_rope_args a) {
    const int64_t t = blockIdx.x / a.n_heads, h = blockIdx.x % a.n_heads;
    const int half = (int)(a.head_dim / 2), i = threadIdx.x;
    const float *x = a.x + t * a.row_stride + h * a.head_dim;
    float x0 = 0.0f, x1 = 0.0f;
    if (i < half) {
        x0 = x[i];
        x1 = x[i + half];
    }
    if (a.weight != nullptr) {
        const float ss = block_sum(__fadd_rn(__fmul_rn(x0, x0), __fmul_rn(x1, x1)));
        const float r = rsqrtf(ss / (float)a.head_dim + a.eps);
        if (i < half) {
            x0 = __fmul_rn(__fmul_rn(x0, r), a.weight[i]);
            x1 = __fmul_rn(__fmul_rn(x1, r), a.weight[i + half]);
        }
    }
    if (i < half) {
        const float *c = a.cos + t * a.head_dim, *s = a.sin + t * a.head_dim;
        float *y = a.y + (t * a.n_heads + h) * a.head_dim;
        // No contraction into FMAs: the same roundings as torch's x * cos + roll(x) * sin.
        y[i] = __fadd_rn(__fmul_rn(x0, c[i]), __fmul_rn(x1, s[i]));
        y[i + half] = __fadd_rn(__fmul_rn(x1, c[i + half]), __fmul_rn(x0, s[i + half]));
    }
}

static int32_t norm_rope_locked(const ft_cuda_norm_rope_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.x == nullptr || a.cos == nullptr || a.sin == nullptr || a.y == nullptr) {
        return fail(FT_CUDA_EINVAL, "norm_rope: x, cos, sin and y must be non-null");
    }
    if (a.n_tokens < 1 || a.n_heads < 1 || a.head_dim < 2 || a.head_dim > 1024 || a.head_dim % 2 != 0 ||
        a.row_stride < a.n_heads * a.head_dim || a.n_tokens * a.row_stride > MAX_ELEMENTS ||
        a.n_tokens * a.n_heads > INT32_MAX) {
        return fail(FT_CUDA_ESHAPE, "norm_rope: bad sizes (tokens %lld, heads %lld, head_dim %lld, stride %lld)",
                    (long long)a.n_tokens, (long long)a.n_heads, (long long)a.head_dim, (long long)a.row_stride);
    }
    device_guard dg(a.device);
    cudaGetLastError();
    const int threads = (int)((a.head_dim / 2 + 31) / 32 * 32);
    norm_rope_kernel<<<(unsigned)(a.n_tokens * a.n_heads), threads, 0, as_stream(a.stream)>>>(a);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "norm_rope");
}

// ---- Decode attention: one query per head over the cached keys (attn_decode.cuh) ----

// SMs per device, read once (the split of decode attention aims at a number of blocks per SM).
static int g_n_sm[GGML_CUDA_MAX_DEVICES] = {};

static int32_t n_sm_locked(int32_t device, int64_t *n_sm) {
    if (g_n_sm[device] == 0) {
        const cudaError_t err = cudaDeviceGetAttribute(&g_n_sm[device], cudaDevAttrMultiProcessorCount, device);
        if (err != cudaSuccess) {
            g_n_sm[device] = 0;
            return cuda_fail(err, "cudaDeviceGetAttribute");
        }
    }
    *n_sm = g_n_sm[device];
    return FT_CUDA_OK;
}

static bool attn_sizes_ok(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t head_dim_v, int64_t n_keys) {
    return n_heads >= 1 && n_heads <= 65535 && n_kv_heads >= 1 && n_heads % n_kv_heads == 0 && head_dim >= 1 &&
           head_dim <= 512 && head_dim_v >= 1 && head_dim_v <= 512 && n_keys >= 1 && n_keys <= FT_CUDA_ATTN_MAX_KEYS;
}

static int32_t attn_decode_locked(const ft_cuda_attn_decode_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.q == nullptr || a.k == nullptr || a.v == nullptr || a.out == nullptr) {
        return fail(FT_CUDA_EINVAL, "attn_decode: q, k, v and out must be non-null");
    }
    if (!attn_sizes_ok(a.n_heads, a.n_kv_heads, a.head_dim, a.head_dim_v, a.n_keys) ||
        a.k_stride < a.n_kv_heads * a.head_dim ||
        !((a.v_dim_stride == 1 && a.v_stride >= a.n_kv_heads * a.head_dim_v) ||
          (a.v_stride == 1 && a.v_dim_stride >= a.n_keys)) ||
        a.window < 0 || (a.pos_dev == nullptr && a.pos_value < 0)) {
        return fail(FT_CUDA_ESHAPE,
                    "attn_decode: bad sizes (heads %lld/%lld, dims %lld/%lld, keys %lld, strides %lld/%lld/%lld, "
                    "window %lld, pos %lld)",
                    (long long)a.n_heads, (long long)a.n_kv_heads, (long long)a.head_dim, (long long)a.head_dim_v,
                    (long long)a.n_keys, (long long)a.k_stride, (long long)a.v_stride, (long long)a.v_dim_stride,
                    (long long)a.window, (long long)a.pos_value);
    }
    int64_t n_sm = 0;
    rc = n_sm_locked(a.device, &n_sm);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    const attn_plan p = attn_plan_for(a.n_heads, a.n_kv_heads, a.head_dim, a.head_dim_v, a.n_keys, n_sm);
    if (a.work_bytes < p.work_bytes || (p.work_bytes > 0 && (a.work == nullptr || (uintptr_t)a.work % 4 != 0))) {
        return fail(FT_CUDA_ESHAPE,
                    "attn_decode: a workspace of %llu bytes at %p, these sizes need %llu 4-byte aligned "
                    "(ft_cuda_attn_decode_work)",
                    (unsigned long long)a.work_bytes, a.work, (unsigned long long)p.work_bytes);
    }
    device_guard dg(a.device);
    cudaGetLastError();
    const cudaStream_t stream = as_stream(a.stream);
    attn_chunk_kernel<<<dim3((unsigned)p.n_chunks, (unsigned)p.n_groups), ATTN_THREADS, p.shared, stream>>>(a, p);
    if (p.n_chunks > 1) {
        const unsigned dim_blocks = (unsigned)attn_ceil_div(a.head_dim_v, ATTN_MERGE_THREADS);
        attn_merge_kernel<<<dim3((unsigned)a.n_heads, dim_blocks), ATTN_MERGE_THREADS, 0, stream>>>(a, p);
    }
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "attn_decode");
}

static int32_t attn_decode_work_locked(int32_t device, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                       int64_t head_dim_v, int64_t n_keys, uint64_t *bytes) {
    int32_t rc = check_device(device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (bytes == nullptr) {
        return fail(FT_CUDA_EINVAL, "attn_decode_work: bytes must be non-null");
    }
    if (!attn_sizes_ok(n_heads, n_kv_heads, head_dim, head_dim_v, n_keys)) {
        return fail(FT_CUDA_ESHAPE, "attn_decode_work: bad sizes (heads %lld/%lld, dims %lld/%lld, keys %lld)",
                    (long long)n_heads, (long long)n_kv_heads, (long long)head_dim, (long long)head_dim_v,
                    (long long)n_keys);
    }
    int64_t n_sm = 0;
    rc = n_sm_locked(device, &n_sm);
    if (rc == FT_CUDA_OK) {
        *bytes = attn_work_bound(n_heads, n_kv_heads, head_dim_v, n_keys, n_sm);
    }
    return rc;
}

// ---- Softmax routing: top-k and the renormalized weights in one kernel ----

// (value, id) of the largest value in the block, ties to the lower id, in every thread.
struct scored {
    float v;
    int id;
};

static __device__ __forceinline__ scored better(scored a, scored b) {
    return (b.v > a.v || (b.v == a.v && b.id < a.id)) ? b : a;
}

static __device__ scored block_max(scored x) {
    __shared__ scored part[32];
    for (int o = 16; o > 0; o >>= 1) {
        x = better(x, {__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.id, o)});
    }
    const int lane = threadIdx.x % 32;
    __syncthreads();  // part may still be read by the previous call
    if (lane == 0) {
        part[threadIdx.x / 32] = x;
    }
    __syncthreads();
    x = lane < (int)(blockDim.x / 32) ? part[lane] : scored{-INFINITY, INT_MAX};
    for (int o = 16; o > 0; o >>= 1) {
        x = better(x, {__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.id, o)});
    }
    return x;
}

// One block per token, a thread per expert: k rounds of a block-wide arg-max.
static __global__ void topk_softmax_kernel(ft_cuda_topk_softmax_args a) {
    const int64_t t = blockIdx.x;
    const int e = threadIdx.x, k = (int)a.top_k;
    const float logit = e < a.n_experts ? a.logits[t * a.row_stride + e] : -INFINITY;
    const float mine = isnan(logit) ? -INFINITY : logit;  // a total order: ids stay in range
    bool open = e < a.n_experts;  // not taken yet; any open expert beats padding and taken ones
    __shared__ float vals[FT_CUDA_TOPK_MAX_K];
    __shared__ int ids[FT_CUDA_TOPK_MAX_K];
    for (int j = 0; j < k; ++j) {
        const scored best = block_max(open ? scored{mine, e} : scored{-INFINITY, INT_MAX});
        if (threadIdx.x == 0) {
            vals[j] = best.v;
            ids[j] = best.id;
        }
        open = open && e != best.id;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) {
            sum += expf(vals[j] - vals[0]);
        }
        for (int j = 0; j < k; ++j) {
            a.ids[t * k + j] = ids[j];
            a.weights[t * k + j] = expf(vals[j] - vals[0]) / sum * a.scale;
            if (a.counts != nullptr) {
                atomicAdd((unsigned long long *)&a.counts[ids[j]], 1ull);
            }
        }
    }
}

static int32_t topk_softmax_locked(const ft_cuda_topk_softmax_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.logits == nullptr || a.ids == nullptr || a.weights == nullptr) {
        return fail(FT_CUDA_EINVAL, "topk_softmax: logits, ids and weights must be non-null");
    }
    if (a.n_tokens < 1 || a.n_tokens > INT32_MAX || a.n_experts < 1 || a.n_experts > FT_CUDA_TOPK_MAX_EXPERTS ||
        a.top_k < 1 || a.top_k > FT_CUDA_TOPK_MAX_K || a.top_k > a.n_experts || a.row_stride < a.n_experts ||
        a.n_tokens * a.row_stride > MAX_ELEMENTS) {
        return fail(FT_CUDA_ESHAPE, "topk_softmax: bad sizes (tokens %lld, experts %lld, top-k %lld, stride %lld)",
                    (long long)a.n_tokens, (long long)a.n_experts, (long long)a.top_k, (long long)a.row_stride);
    }
    device_guard dg(a.device);
    cudaGetLastError();
    const int threads = (int)((a.n_experts + 31) / 32 * 32);
    topk_softmax_kernel<<<(unsigned)a.n_tokens, threads, 0, as_stream(a.stream)>>>(a);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "topk_softmax");
}

// ---- Gated DeltaNet decode step: conv, norms, gates, delta rule, gated norm (gdn_decode.cuh) ----

static_assert(GDN_MAX_SEQS == FT_CUDA_GDN_MAX_SEQS && GDN_MAX_DIM == FT_CUDA_GDN_MAX_DIM,
              "gdn_decode.cuh's limits are the ABI's");

static int32_t gdn_decode_locked(const ft_cuda_gdn_decode_args &a) {
    int32_t rc = check_device(a.device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    if (a.mixed == nullptr || a.z == nullptr || a.b == nullptr || a.a == nullptr || a.conv_weight == nullptr ||
        a.dt_bias == nullptr || a.ssm_a == nullptr || a.norm == nullptr || a.conv_states == nullptr ||
        a.ssm_states == nullptr || a.out == nullptr) {
        return fail(FT_CUDA_EINVAL, "gdn_decode: null pointer");
    }
    const int64_t d = a.head_dim;
    // Heads first: with them in range the channel count cannot overflow.
    const bool heads_ok = a.k_heads >= 1 && a.v_heads >= 1 && a.v_heads <= 65535 && a.v_heads % a.k_heads == 0 &&
                          d >= 1 && d <= FT_CUDA_GDN_MAX_DIM;
    const int64_t channels = heads_ok ? (2 * a.k_heads + a.v_heads) * d : 1;
    if (!heads_ok || a.n_seqs < 1 || a.n_seqs > FT_CUDA_GDN_MAX_SEQS || a.conv_kernel < 2 ||
        a.conv_kernel > INT32_MAX / channels || a.ba_group < 1 || a.v_heads % a.ba_group != 0 ||
        a.mixed_stride < channels || a.z_stride < a.v_heads * d || a.ba_stride < 0 || a.ba_group_stride < 0 ||
        !(a.eps >= 0.0f) || a.eps == INFINITY) {
        return fail(FT_CUDA_ESHAPE,
                    "gdn_decode: bad sizes (%lld sequences, heads %lld/%lld of %lld, conv %lld, b/a groups of %lld, "
                    "strides %lld/%lld/%lld/%lld, eps %g)",
                    (long long)a.n_seqs, (long long)a.k_heads, (long long)a.v_heads, (long long)d,
                    (long long)a.conv_kernel, (long long)a.ba_group, (long long)a.mixed_stride,
                    (long long)a.z_stride, (long long)a.ba_stride, (long long)a.ba_group_stride, (double)a.eps);
    }
    for (int64_t s = 0; s < a.n_seqs; ++s) {
        if (a.conv_states[s] == nullptr || a.ssm_states[s] == nullptr) {
            return fail(FT_CUDA_EINVAL, "gdn_decode: sequence %lld has a null state", (long long)s);
        }
    }
    const gdn_params p = gdn_params_of(a);
    device_guard dg(a.device);
    cudaGetLastError();
    const cudaStream_t stream = as_stream(a.stream);
    gdn_step_kernel<<<gdn_step_grid(p), GDN_THREADS, 0, stream>>>(p);
    gdn_finish_kernel<<<gdn_finish_grid(p), GDN_THREADS, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FT_CUDA_OK : cuda_fail(err, "gdn_decode");
}

FT_EXPORT uint32_t ft_cuda_abi_version(void) { return FT_CUDA_ABI_VERSION; }

FT_EXPORT uint64_t ft_cuda_struct_size(int32_t which) {
    switch (which) {
        case 0: return sizeof(ft_cuda_device_info);
        case 1: return sizeof(ft_cuda_matmul_args);
        case 2: return sizeof(ft_cuda_moe_args);
        case 3: return sizeof(ft_cuda_handoff_args);
        case 4: return sizeof(ft_cuda_handoff_routes_args);
        case 5: return sizeof(ft_cuda_norm_rope_args);
        case 6: return sizeof(ft_cuda_topk_softmax_args);
        case 7: return sizeof(ft_cuda_attn_decode_args);
        case 8: return sizeof(ft_cuda_gdn_decode_args);
        case 9: return sizeof(ft_cuda_fetch_plan_args);
        case 10: return sizeof(ft_cuda_fetch_gather_args);
        default: return 0;
    }
}

FT_EXPORT int32_t ft_cuda_init(int32_t *n_devices) {
    std::lock_guard<std::mutex> lock(g_mutex);
    const int32_t rc = init_locked();
    if (n_devices != nullptr) {
        *n_devices = rc == FT_CUDA_OK ? g_n_devices : 0;
    }
    return rc;
}

FT_EXPORT int32_t ft_cuda_device_info_get(int32_t device, ft_cuda_device_info *out) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (out == nullptr || out->struct_size != sizeof(ft_cuda_device_info)) {
        return fail(FT_CUDA_EINVAL, "device_info: null or wrong struct_size (want %zu)", sizeof(ft_cuda_device_info));
    }
    const int32_t rc = check_device(device);
    if (rc != FT_CUDA_OK) {
        return rc;
    }
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess) {
        return cuda_fail(err, "cudaGetDeviceProperties");
    }
    snprintf(out->name, sizeof(out->name), "%s", prop.name);
    out->cc = ggml_cuda_info().devices[device].cc;
    out->n_sm = prop.multiProcessorCount;
    out->total_mem = prop.totalGlobalMem;
    size_t free_mem = 0, total = 0;
    {
        device_guard dg(device);
        err = cudaMemGetInfo(&free_mem, &total);
    }
    if (err != cudaSuccess) {
        return cuda_fail(err, "cudaMemGetInfo");
    }
    out->free_mem = free_mem;
    return FT_CUDA_OK;
}

FT_EXPORT int32_t ft_cuda_kernel_for(int32_t device, int32_t type, int64_t n_tokens) {
    std::lock_guard<std::mutex> lock(g_mutex);
    ggml_type t = GGML_TYPE_COUNT;
    if (check_device(device) != FT_CUDA_OK || check_type(type, &t) != FT_CUDA_OK) {
        return FT_CUDA_KERNEL_NONE;
    }
    device_guard dg(device);
    return kernel_for_locked(device, t, n_tokens);
}

// Every kernel entry point: one call at a time (the library's state is shared), and the
// argument struct checked by its size before any field is read.
template <typename Args>
static int32_t checked_call(const char *what, const Args *args, int32_t (*body)(const Args &)) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (args == nullptr || args->struct_size != sizeof(Args)) {
        return fail(FT_CUDA_EINVAL, "%s: null or wrong struct_size (want %zu)", what, sizeof(Args));
    }
    return body(*args);
}

FT_EXPORT int32_t ft_cuda_expert_matmul(const ft_cuda_matmul_args *args) {
    return checked_call("expert_matmul", args, expert_matmul_locked);
}

FT_EXPORT int32_t ft_cuda_moe_layer(const ft_cuda_moe_args *args) {
    return checked_call("moe_layer", args, moe_layer_locked);
}

FT_EXPORT int32_t ft_cuda_handoff_wait_add(const ft_cuda_handoff_args *args) {
    return checked_call("handoff", args, handoff_locked);
}

FT_EXPORT int32_t ft_cuda_handoff_routes(const ft_cuda_handoff_routes_args *args) {
    return checked_call("handoff_routes", args, handoff_routes_locked);
}

FT_EXPORT int32_t ft_cuda_norm_rope(const ft_cuda_norm_rope_args *args) {
    return checked_call("norm_rope", args, norm_rope_locked);
}

FT_EXPORT int32_t ft_cuda_attn_decode(const ft_cuda_attn_decode_args *args) {
    return checked_call("attn_decode", args, attn_decode_locked);
}

FT_EXPORT int32_t ft_cuda_attn_decode_work(int32_t device, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                           int64_t head_dim_v, int64_t n_keys, uint64_t *bytes) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return attn_decode_work_locked(device, n_heads, n_kv_heads, head_dim, head_dim_v, n_keys, bytes);
}

FT_EXPORT int32_t ft_cuda_topk_softmax(const ft_cuda_topk_softmax_args *args) {
    return checked_call("topk_softmax", args, topk_softmax_locked);
}

FT_EXPORT int32_t ft_cuda_gdn_decode(const ft_cuda_gdn_decode_args *args) {
    return checked_call("gdn_decode", args, gdn_decode_locked);
}

FT_EXPORT int32_t ft_cuda_fetch_plan(const ft_cuda_fetch_plan_args *args) {
    return checked_call("fetch_plan", args, fetch_plan_locked);
}

FT_EXPORT int32_t ft_cuda_fetch_gather(const ft_cuda_fetch_gather_args *args) {
    return checked_call("fetch_gather", args, fetch_gather_locked);
}

FT_EXPORT const char *ft_cuda_last_error(void) { return g_last_error.c_str(); }
