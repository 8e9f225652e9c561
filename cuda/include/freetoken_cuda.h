/* libfreetoken_cuda: the C ABI that crates/ft-cuda loads at run time (dlopen, RTLD_LOCAL).
 *
 * Everything else in the library (ggml-base, ggml-cuda) is hidden by the version script, so
 * the extension's own static ggml never interposes with this one.
 *
 * This header is the source of the ABI: crates/ft-cuda's tests compile it and compare every
 * constant, struct layout and the pool-size formula with the Rust side.
 *
 * Layouts follow ggml's mul_mat_id (ne0 fastest):
 *   weights  [K, N, n_slots]     quantized, rows of K elements; the tensor is followed by a
 *                                zeroed tail (ft_cuda_pool_bytes)
 *   x        [K, n_b, n_tokens]  float32; n_b == 1 broadcasts one row to every slot used
 *   ids      [n_used, n_tokens]  int32 slot ids, distinct within a token
 *   y        [N, n_used, n_tokens] float32
 * All pointers are device memory owned by the caller, except ids_host. Work is queued on the
 * caller's stream (0 means the legacy default stream); calls return without synchronizing
 * unless FT_CUDA_CHECK_IDS is set.
 *
 * Every call returns FT_CUDA_OK or an FT_CUDA_E* code; ft_cuda_last_error() then holds the
 * message (per thread). Each argument struct starts with its own size, which the library
 * checks against the size it was built with.
 */
#ifndef FREETOKEN_CUDA_H
#define FREETOKEN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FT_CUDA_ABI_VERSION 8

enum ft_cuda_status {
    FT_CUDA_OK = 0,
    FT_CUDA_EINVAL = 1,       /* a bad argument: null pointer, bad id, duplicate slot in a token */
    FT_CUDA_ESHAPE = 2,       /* sizes that do not fit together */
    FT_CUDA_EUNSUPPORTED = 3, /* no kernel for this type and token count */
    FT_CUDA_ENOMEM = 4,       /* a device allocation failed */
    FT_CUDA_EDEVICE = 5,      /* a CUDA error, or no usable device */
};

/* Kernels, as ft_cuda_kernel_for() reports them. */
enum ft_cuda_kernel {
    FT_CUDA_KERNEL_NONE = 0,
    FT_CUDA_KERNEL_MMVQ = 1,
    FT_CUDA_KERNEL_MMQ = 2,
};

/* Activations of the fused layer: act(gate) * up. */
enum ft_cuda_act {
    FT_CUDA_ACT_SILU = 0,
    FT_CUDA_ACT_GELU = 1, /* tanh approximation, as ggml */
};

/* ggml-cuda reads up to the next multiple of this many elements past a weight tensor's last row
 * (its MATRIX_ROW_PADDING), and indexes a tensor's blocks with 32-bit integers. */
#define FT_CUDA_ROW_PADDING 512
#define FT_CUDA_MAX_POOL_BLOCKS 2147483647

/* Bytes a pool of n_slots matrices [k, n] of a type of `block_size` elements in `type_size`
 * bytes needs (k whole blocks): the matrices, then a zeroed tail covering the reads past the
 * last row, up to the next multiple of FT_CUDA_ROW_PADDING elements in whole blocks. */
static inline int64_t ft_cuda_pool_bytes(int64_t block_size, int64_t type_size, int64_t k, int64_t n,
                                         int64_t n_slots) {
    int64_t bytes = k / block_size * type_size * n * n_slots;
    if (k % FT_CUDA_ROW_PADDING != 0) {
        const int64_t pad = FT_CUDA_ROW_PADDING - k % FT_CUDA_ROW_PADDING;
        bytes += (pad + block_size - 1) / block_size * type_size;
    }
    return bytes;
}

/* flags */
#define FT_CUDA_CHECK_IDS 1u  /* check ids on the device (range, duplicates): synchronizes */
#define FT_CUDA_ACCUMULATE 2u /* moe_layer: y += result instead of y = result */

typedef struct ft_cuda_device_info {
    uint64_t struct_size;
    char name[256];
    int32_t cc; /* compute capability, major * 100 + minor * 10 (ggml's convention) */
    int32_t n_sm;
    uint64_t total_mem;
    uint64_t free_mem;
} ft_cuda_device_info;

typedef struct ft_cuda_matmul_args {
    uint64_t struct_size;
    int32_t device;
    int32_t wtype; /* ggml type id */
    int64_t k, n, n_slots;
    const void *w;
    uint64_t w_bytes; /* bytes the caller owns at w, zeroed tail included */
    int64_t n_tokens, n_used, n_b;
    const float *x;
    const int32_t *ids;
    float *y;
    void *stream; /* cudaStream_t */
    uint32_t flags;
    uint32_t reserved;
} ft_cuda_matmul_args;

/* One MoE layer: y = sum_j weights[t, j] * down_j(act(gate_j(x_t)) * up_j(x_t)). */
typedef struct ft_cuda_moe_args {
    uint64_t struct_size;
    int32_t device;
    int32_t act;
    int64_t hidden, ffn, n_slots, n_tokens, n_used;
    int32_t gate_type, up_type, down_type, reserved0;
    const void *gate; /* [hidden, ffn, n_slots] */
    uint64_t gate_bytes;
    const void *up; /* [hidden, ffn, n_slots] */
    uint64_t up_bytes;
    const void *down; /* [ffn, hidden, n_slots] */
    uint64_t down_bytes;
    const float *x;       /* [hidden, n_tokens] */
    const int32_t *ids;   /* [n_used, n_tokens] */
    const float *weights; /* [n_used, n_tokens] */
    float *y;             /* [hidden, n_tokens] */
    void *stream;
    uint32_t flags;
    uint32_t reserved1;
} ft_cuda_moe_args;

/* The hand-off between the GPU and a host thread (hybrid MoE, docs/hybrid.md): a block of
 * FT_CUDA_HANDOFF_WORDS int64 words in mapped page-locked host memory, and an int64 sequence
 * counter in device memory (zero at start, kept by the device so that a replayed CUDA graph
 * counts on). A request (ft_cuda_handoff_routes) adds one to the counter, writes its tag then
 * the new count to the block: everything it wrote before (its copies of activations and
 * routes) is then visible to the host. `ft_cuda_handoff_wait_add` spins until the host's
 * answer reaches the counter, then adds `n` floats of mapped host memory at `src` into device memory `dst`; after `timeout_ns`
 * without an answer it writes the count into FT_CUDA_HANDOFF_TIMEOUT and adds nothing. */
#define FT_CUDA_HANDOFF_WORDS 8
#define FT_CUDA_HANDOFF_GPU_SEQ 0 /* written by a request: the latest one */
#define FT_CUDA_HANDOFF_CPU_SEQ 1 /* written by the host: the latest answer */
#define FT_CUDA_HANDOFF_TAG 2     /* written by a request: what it is about */
#define FT_CUDA_HANDOFF_TIMEOUT 3 /* written by wait_add: the request it gave up on */
#define FT_CUDA_HANDOFF_ERROR 4   /* written by the host: a request it could not answer */
#define FT_CUDA_HANDOFF_STOP 5    /* written by the host: its thread may return when idle */
#define FT_CUDA_HANDOFF_ANSWERED 6 /* host only: requests answered */
#define FT_CUDA_HANDOFF_BUSY_NS 7  /* host only: nanoseconds spent answering */

typedef struct ft_cuda_handoff_args {
    uint64_t struct_size;
    int32_t device;
    int32_t reserved;
    int64_t *counter; /* device memory, one int64 */
    int64_t *block;   /* registered (cudaHostRegisterMapped) host memory, FT_CUDA_HANDOFF_WORDS */
    const float *src; /* registered host memory, n floats */
    float *dst;       /* device memory, n floats */
    int64_t n;
    uint64_t timeout_ns;
    void *stream;
} ft_cuda_handoff_args;

/* One kernel for a layer's side of the hand-off (one graph node instead of copies, gather and
 * selects): copies x, ids and weights into the mapped host buffers, writes each route's slot
 * (resident[id], or dummy_base + j for a route j whose expert is not resident) and its GPU
 * weight (0 for those), then raises the request. */
typedef struct ft_cuda_handoff_routes_args {
    uint64_t struct_size;
    int32_t device;
    int32_t reserved;
    int64_t *counter;
    int64_t *block;
    int64_t tag;
    int64_t n_tokens, hidden, top_k, n_experts, dummy_base;
    const float *x;           /* device [n_tokens, hidden] */
    const int32_t *ids;       /* device [n_tokens, top_k] */
    const float *weights;     /* device [n_tokens, top_k] */
    const int32_t *resident;  /* device [n_experts] */
    float *x_host;            /* registered host [n_tokens, hidden] */
    int32_t *ids_host;        /* registered host [n_tokens, top_k] */
    float *weights_host;      /* registered host [n_tokens, top_k] */
    int32_t *slots;           /* device out [n_tokens, top_k] */
    float *gpu_weights;       /* device out [n_tokens, top_k] */
    void *stream;
} ft_cuda_handoff_routes_args;

/* The fetch share of a hybrid layer's missed experts, chosen and uploaded on the device (no
 * read-back, so a step that fetches stays one CUDA graph; docs/hybrid.md, "Fetching part of
 * the misses"). ft_cuda_fetch_plan (one block, before the layer's hand-off request): counts
 * the routes of each expert that `resident` does not place (a miss), orders the misses by
 * routes (most first, then by id), and takes the first n_fetch: `share` of them rounded
 * (share >= 0), else the count of least modelled time, the fewest among equals
 * (freetoken.engine.fetch's rule, in float64 in its order of operations: uploading n_f costs
 * n_f * expert_bytes * (1 / b_pcie + 1 / b_gpu) / 1e9 s, the CPU's reads left cost
 * reads * expert_bytes / b_cpu / 1e9 s, each side at its figure with the other busy when
 * both run, plus overhead_s when anything is fetched; a read is an expert, or a route with
 * price_routes), at most max_fetch. It writes the host's resident table row: FT_CUDA_FETCHED
 * for those experts (the host thread skips them as residents), `resident` for the others;
 * lists them in
 * `fetched`, and writes each route's staging slot (its expert's place in the list, or
 * dummy_base + j for a route j whose expert is not fetched) and weight (0 for those).
 * ft_cuda_fetch_gather (after the plan, on any stream) copies the listed experts of each
 * matrix kind from registered host memory into staging slots 0..n_fetch-1 and zeroes the
 * top_k slots from dummy_base. */
#define FT_CUDA_FETCH_MAX_EXPERTS 1024
#define FT_CUDA_FETCHED INT32_MAX
/* The plan's int64 words (stats): what it chose, and the gather's span on the GPU's timer. */
#define FT_CUDA_FETCH_STATS 8
#define FT_CUDA_FETCH_N 0            /* experts fetched */
#define FT_CUDA_FETCH_MISSED 1       /* experts missed */
#define FT_CUDA_FETCH_ROUTES 2       /* routes of the fetched experts */
#define FT_CUDA_FETCH_MISSED_ROUTES 3 /* routes of the missed experts */
#define FT_CUDA_FETCH_START_NS 4     /* the gather's first block started (INT64_MAX: none) */
#define FT_CUDA_FETCH_END_NS 5       /* its last block ended */
#define FT_CUDA_FETCH_UPLOAD_NS 6    /* the model's upload and GPU time of the choice */
#define FT_CUDA_FETCH_CPU_NS 7       /* the model's CPU time of the choice */

typedef struct ft_cuda_fetch_plan_args {
    uint64_t struct_size;
    int32_t device;
    int32_t price_routes;            /* 0 or 1 */
    int64_t n_tokens, top_k, n_experts; /* n_experts 1..FT_CUDA_FETCH_MAX_EXPERTS */
    int64_t max_fetch;               /* 0..min(n_experts, dummy_base) */
    int64_t dummy_base;
    double expert_bytes;             /* > 0 */
    double overhead_s;               /* >= 0 */
    double share;                    /* 0..1, or < 0: the modelled choice */
    double b_cpu, b_pcie, b_gpu, b_cpu_with_pcie, b_pcie_with_cpu; /* GB/s, > 0 */
    const int32_t *ids;              /* device [n_tokens, top_k] */
    const float *weights;            /* device [n_tokens, top_k] */
    const int32_t *resident;         /* device [n_experts]: slot or -1 */
    int32_t *resident_host;          /* registered host [n_experts], written */
    int32_t *fetched;                /* device out [n_experts] (the first n_fetch written) */
    int32_t *slots;                  /* device out [n_tokens, top_k] */
    float *fetch_weights;            /* device out [n_tokens, top_k] */
    int64_t *stats;                  /* device out [FT_CUDA_FETCH_STATS] */
    void *stream;
} ft_cuda_fetch_plan_args;

typedef struct ft_cuda_fetch_gather_args {
    uint64_t struct_size;
    int32_t device;
    int32_t n_kinds;                 /* 1..3 */
    int64_t n_experts, top_k, max_fetch, dummy_base; /* as the plan's */
    const int32_t *fetched;          /* device: the plan's */
    int64_t *stats;                  /* device: the plan's (reads n_fetch, writes the span) */
    const void *src[3];              /* registered host: expert 0's bytes of each kind */
    int64_t src_stride[3];           /* bytes from one expert to the next, >= 0 */
    int64_t nbytes[3];               /* an expert's bytes of each kind, > 0 */
    void *dst[3];                    /* device: staging slot s of a kind at dst + s * nbytes */
    void *stream;
} ft_cuda_fetch_gather_args;

/* Attention's q or k after the fused QKV product, in one kernel (instead of an RMSNorm and four
 * element-wise kernels): per token and head, RMSNorm over the head (when `weight` is set), then
 * NEOX RoPE over the whole head with the whole-head tables (`cos` twice, `-sin` then `sin`):
 *   n = x / sqrt(mean(x^2) + eps) * weight;  y[i] = n[i] * cos[i] + n[(i + d/2) % d] * sin[i]
 * computed as torch computes `n * cos + roll(n, d/2) * sin` (two rounded products, one sum). */
typedef struct ft_cuda_norm_rope_args {
    uint64_t struct_size;
    int32_t device;
    int32_t reserved;
    int64_t n_tokens, n_heads, head_dim; /* head_dim even, 2..1024 */
    int64_t row_stride;                  /* floats from one token's heads to the next's */
    float eps;
    int32_t reserved1;
    const float *x;      /* device [n_tokens][row_stride], heads contiguous from the start */
    const float *weight; /* device [head_dim], or null: no norm */
    const float *cos;    /* device [n_tokens, head_dim] */
    const float *sin;    /* device [n_tokens, head_dim] */
    float *y;            /* device [n_tokens, n_heads, head_dim], not overlapping x */
    void *stream;
} ft_cuda_norm_rope_args;

/* Softmax routing with renormalized top-k (Qwen, Mixtral) in one kernel instead of a sort, a
 * softmax, a cast and a count: per token the k largest logits (ties to the lower id), their
 * ids, and the softmax over those k times `scale` (the renormalized top-k of the full
 * softmax); `counts[id] += 1` per route when `counts` is set. A thread per expert. */
#define FT_CUDA_TOPK_MAX_EXPERTS 1024
#define FT_CUDA_TOPK_MAX_K 32
typedef struct ft_cuda_topk_softmax_args {
    uint64_t struct_size;
    int32_t device;
    int32_t reserved;
    int64_t n_tokens, n_experts, top_k; /* n_experts 1..FT_CUDA_TOPK_MAX_EXPERTS, top_k
                                           1..n_experts, at most FT_CUDA_TOPK_MAX_K */
    int64_t row_stride;                 /* floats from one token's logits to the next's */
    float scale;
    int32_t reserved1;
    const float *logits; /* device [n_tokens][row_stride] */
    int32_t *ids;        /* device out [n_tokens, top_k] */
    float *weights;      /* device out [n_tokens, top_k] */
    int64_t *counts;     /* device [n_experts], or null */
    void *stream;
} ft_cuda_topk_softmax_args;

/* One query per head attending over a layer's cached keys (a decode step) in one kernel
 * instead of a scale, two batched products, a mask and a softmax. Query head h reads kv head
 * h / (n_heads / n_kv_heads); key j (its position) is visible when j <= pos and, with a
 * window, pos - j < window: s_j = scale * q_h . k_j, p = softmax(s) (the sink logit sinks[h]
 * joining the denominator when given), out_h = sum_j p_j v_j; no visible key gives zeros;
 * float32 throughout. `pos` is read from device memory when `pos_dev` is set (a captured step
 * replays it), else `pos_value`. The keys are split into chunks whose partial softmaxes a
 * second kernel merges, through the caller's workspace `work`: ft_cuda_attn_decode_work tells
 * its size. The launches depend on the sizes only (never on the position). */
#define FT_CUDA_ATTN_MAX_KEYS 262144
typedef struct ft_cuda_attn_decode_args {
    uint64_t struct_size;
    int32_t device;
    int32_t reserved;
    int64_t n_heads, n_kv_heads; /* n_heads a multiple of n_kv_heads */
    int64_t head_dim, head_dim_v; /* 1..512 each */
    int64_t n_keys;               /* 1..FT_CUDA_ATTN_MAX_KEYS */
    int64_t k_stride, v_stride;   /* floats from one position's keys (values) to the next's */
    int64_t v_dim_stride;         /* floats from one value dimension to the next (across heads):
                                     1 for rows of positions, >= n_keys for the transposed cache
                                     (positions along each dimension's row, v_stride 1) */
    int64_t window;               /* 0: none */
    int64_t pos_value;            /* the query's position when pos_dev is null */
    float scale;
    int32_t reserved1;
    const float *q;         /* device [n_heads, head_dim] */
    const float *k;         /* device: key j of kv head g at k + j * k_stride + g * head_dim */
    const float *v;         /* device: dimension d of value j of kv head g at
                               v + j * v_stride + (g * head_dim_v + d) * v_dim_stride */
    const int64_t *pos_dev; /* device, or null */
    const float *sinks;     /* device [n_heads], or null */
    float *out;             /* device [n_heads, head_dim_v] */
    void *work;             /* device workspace, 4-byte aligned; null when work_bytes is 0 */
    uint64_t work_bytes;    /* at least what ft_cuda_attn_decode_work reports for n_keys */
    void *stream;
} ft_cuda_attn_decode_args;

/* A Gated DeltaNet layer's decode step (one token per sequence) between its projections, in
 * two kernels instead of the torch path's forty or so small ones. Per sequence s and value
 * head h (key head kh = h / (v_heads / k_heads) when `grouped`, else h % k_heads), with the
 * channels (2 k_heads + v_heads) * head_dim of `mixed` ordered q heads, k heads, v heads:
 *   y = silu(causal conv of mixed over the conv state, tap conv_kernel - 1 on the token)
 *   q = y_q[kh] / sqrt(|y_q[kh]|^2 + eps) / sqrt(head_dim)
 *   k = y_k[kh] / sqrt(|y_k[kh]|^2 + eps)
 *   g = softplus(a_h + dt_bias[h]) * ssm_a[h];  beta = sigmoid(b_h)
 *   S' = exp(g) S;  S = S' + k (beta (y_v[h] - S'^T k))^T;  o = S^T q
 *   out[s, h] = o / sqrt(mean(o^2) + eps) * norm * silu(z[s, h])
 * S is the head's [head_dim (k), head_dim (v)] block of the sequence's delta-rule state and
 * the conv state [conv_kernel - 1, channels] holds the previous inputs, oldest first; both are
 * float32 and updated in place. Beta and alpha inputs of value head h sit at
 * b + s * ba_stride + (h / ba_group) * ba_group_stride + h % ba_group (a alike): ba_group =
 * v_heads for plain rows, or per key head its group of value heads (a fused projection whose
 * rows interleave the groups' b and a). The state addresses are host arrays of n_seqs device
 * pointers, read during the call. */
#define FT_CUDA_GDN_MAX_SEQS 64
#define FT_CUDA_GDN_MAX_DIM 256
typedef struct ft_cuda_gdn_decode_args {
    uint64_t struct_size;
    int32_t device;
    int32_t grouped;               /* 1: value heads grouped by key head; 0: tiled */
    int64_t n_seqs;                /* 1..FT_CUDA_GDN_MAX_SEQS */
    int64_t k_heads, v_heads;      /* v_heads a multiple of k_heads, at most 65535 */
    int64_t head_dim;              /* 1..FT_CUDA_GDN_MAX_DIM, keys and values alike */
    int64_t conv_kernel;           /* 2.. */
    int64_t ba_group;              /* divides v_heads */
    int64_t mixed_stride, z_stride; /* floats from one sequence's row to the next */
    int64_t ba_stride, ba_group_stride;
    float eps;                     /* the L2 norms' and the RMSNorm's */
    int32_t reserved;
    const float *mixed;       /* device [n_seqs][mixed_stride]: the qkv projection, pre-conv */
    const float *z;           /* device [n_seqs][z_stride]: the gate projection, v_heads * head_dim */
    const float *b, *a;       /* device: beta and alpha inputs (layout above) */
    const float *conv_weight; /* device [channels, conv_kernel] */
    const float *dt_bias;     /* device [v_heads] */
    const float *ssm_a;       /* device [v_heads]: -exp(A_log) */
    const float *norm;        /* device [head_dim] */
    float *const *conv_states; /* host [n_seqs] of device [conv_kernel - 1, channels] */
    float *const *ssm_states;  /* host [n_seqs] of device [v_heads, head_dim, head_dim] */
    float *out;               /* device [n_seqs, v_heads, head_dim], not overlapping the inputs */
    void *stream;
} ft_cuda_gdn_decode_args;

uint32_t ft_cuda_abi_version(void);
/* sizeof of each argument struct: 0 device_info, 1 matmul_args, 2 moe_args, 3 handoff_args,
 * 4 handoff_routes_args, 5 norm_rope_args, 6 topk_softmax_args, 7 attn_decode_args,
 * 8 gdn_decode_args, 9 fetch_plan_args, 10 fetch_gather_args; 0 if unknown. */
uint64_t ft_cuda_struct_size(int32_t which);
/* Finds the devices; FT_CUDA_EDEVICE when there are none. Safe to call more than once. */
int32_t ft_cuda_init(int32_t *n_devices);
int32_t ft_cuda_device_info_get(int32_t device, ft_cuda_device_info *out);
/* Which kernel serves `type` at `n_tokens` tokens on `device` (an ft_cuda_kernel). */
int32_t ft_cuda_kernel_for(int32_t device, int32_t type, int64_t n_tokens);
int32_t ft_cuda_expert_matmul(const ft_cuda_matmul_args *args);
int32_t ft_cuda_moe_layer(const ft_cuda_moe_args *args);
int32_t ft_cuda_handoff_wait_add(const ft_cuda_handoff_args *args);
int32_t ft_cuda_handoff_routes(const ft_cuda_handoff_routes_args *args);
int32_t ft_cuda_norm_rope(const ft_cuda_norm_rope_args *args);
int32_t ft_cuda_attn_decode(const ft_cuda_attn_decode_args *args);
/* Bytes of workspace ft_cuda_attn_decode needs on `device` for these sizes with any key count
 * up to n_keys (one buffer serves a cache read at growing lengths); 0 when none is needed. */
int32_t ft_cuda_attn_decode_work(int32_t device, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                 int64_t head_dim_v, int64_t n_keys, uint64_t *bytes);
int32_t ft_cuda_topk_softmax(const ft_cuda_topk_softmax_args *args);
int32_t ft_cuda_gdn_decode(const ft_cuda_gdn_decode_args *args);
int32_t ft_cuda_fetch_plan(const ft_cuda_fetch_plan_args *args);
int32_t ft_cuda_fetch_gather(const ft_cuda_fetch_gather_args *args);
const char *ft_cuda_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* FREETOKEN_CUDA_H */
