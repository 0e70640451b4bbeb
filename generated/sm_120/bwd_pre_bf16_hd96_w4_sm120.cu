// bwd_pre_bf16_hd96_w4_sm120: attention backward preprocess, dsum = rowsum(dO * O) in fp32.
// Rendered by flashgen from templates/bwd_pre.cu.j2 -- edit the template, not this file.
// traits: dtype=bf16 head_dim=96 num_warps=4 arch=sm_120
#include "flashgen/bwd_pre.cuh"

struct BwdPreParams {
    void* o;
    void* dout;
    void* dsum;
    void* cu_seqlens_q;
    long long o_batch_stride;
    long long o_row_stride;
    long long o_head_stride;
    long long dout_batch_stride;
    long long dout_row_stride;
    long long dout_head_stride;
    long long dsum_batch_stride;
    long long dsum_head_stride;
    int batch;
    int nheads;
    int head_dim;
    int seqlen_q;
};
static_assert(sizeof(BwdPreParams) == 112, "BwdPreParams size drifted from Python");

extern "C" __global__ void __launch_bounds__(128) bwd_pre_bf16_hd96_w4_sm120(const __grid_constant__ BwdPreParams params) {
  flashgen::bwd_pre<cutlass::bfloat16_t, 96, 128, 8>(params);
}
