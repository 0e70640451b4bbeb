// bwd_dq_sm80_fp16_hd160_m64n64_w8_s1_sm120: attention backward over query blocks (dQ, split schedule), SM80 mma.sync path.
// Rendered by flashgen from templates/bwd_dq_sm80.cu.j2 -- edit the template, not this file.
// traits: dtype=fp16 head_dim=160 head_dim_v=160 block_m=64 block_n=64 num_warps=8 stages=1 causal=false even_k=true dropout=false arch=sm_120
#include "flashgen/bwd_sm80.cuh"

struct BwdParams {
    void* q;
    void* k;
    void* v;
    void* dout;
    void* lse;
    void* dsum;
    void* dq;
    void* dq_accum;
    void* dk;
    void* dv;
    void* cu_seqlens_q;
    void* cu_seqlens_k;
    long long q_batch_stride;
    long long q_row_stride;
    long long q_head_stride;
    long long k_batch_stride;
    long long k_row_stride;
    long long k_head_stride;
    long long v_batch_stride;
    long long v_row_stride;
    long long v_head_stride;
    long long dout_batch_stride;
    long long dout_row_stride;
    long long dout_head_stride;
    long long dq_batch_stride;
    long long dq_row_stride;
    long long dq_head_stride;
    long long dq_accum_batch_stride;
    long long dq_accum_row_stride;
    long long dq_accum_head_stride;
    long long dk_batch_stride;
    long long dk_row_stride;
    long long dk_head_stride;
    long long dv_batch_stride;
    long long dv_row_stride;
    long long dv_head_stride;
    long long lse_batch_stride;
    long long lse_head_stride;
    int batch;
    int nheads;
    int nheads_k;
    int head_dim;
    int head_dim_v;
    int seqlen_q;
    int seqlen_k;
    float scale_log2;
    float scale;
    void* rng_state;
    unsigned int dropout_threshold;
    float rp_dropout;
};
static_assert(sizeof(BwdParams) == 360, "BwdParams size drifted from Python");

using Kernel = flashgen::BwdSm80<cutlass::half_t, 160, 160, 64, 64, 8, 1, false, true, false>;
static_assert(Kernel::kSmemBytesDq == 90112, "codegen and the kernel disagree on shared memory");

extern "C" __global__ void __launch_bounds__(256, 1) bwd_dq_sm80_fp16_hd160_m64n64_w8_s1_sm120(const __grid_constant__ BwdParams params) {
  extern __shared__ __align__(128) char smem[];
  flashgen::bwd_dq_sm80<Kernel>(params, smem);
}
