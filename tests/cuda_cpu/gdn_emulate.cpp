// ft_cuda_gdn_decode's kernels on the CPU (cuda_emulation.h), behind a flat C entry point for
// ctypes: the arguments as the ABI struct, packed and launched as shim.cu does.
#include "cuda_emulation.h"

#include "gdn_decode.cuh"

extern "C" void gdn_emulate(const int64_t *sizes, const int64_t *strides, float eps, const float *const *inputs,
                            float *const *conv_states, float *const *ssm_states, float *out) {
    ft_cuda_gdn_decode_args a{};
    a.struct_size = sizeof(a);
    a.n_seqs = sizes[0];
    a.k_heads = sizes[1];
    a.v_heads = sizes[2];
    a.head_dim = sizes[3];
    a.conv_kernel = sizes[4];
    a.grouped = (int32_t)sizes[5];
    a.ba_group = sizes[6];
    a.mixed_stride = strides[0];
    a.z_stride = strides[1];
    a.ba_stride = strides[2];
    a.ba_group_stride = strides[3];
    a.eps = eps;
    a.mixed = inputs[0];
    a.z = inputs[1];
    a.b = inputs[2];
    a.a = inputs[3];
    a.conv_weight = inputs[4];
    a.dt_bias = inputs[5];
    a.ssm_a = inputs[6];
    a.norm = inputs[7];
    a.conv_states = conv_states;
    a.ssm_states = ssm_states;
    a.out = out;
    const gdn_params p = gdn_params_of(a);
    emulate_launch(gdn_step_kernel, gdn_step_grid(p), GDN_THREADS, p);
    emulate_launch(gdn_finish_kernel, gdn_finish_grid(p), GDN_THREADS, p);
}
