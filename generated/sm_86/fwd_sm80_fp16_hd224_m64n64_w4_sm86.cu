// fwd_sm80_fp16_hd224_m64n64_w4_sm86: attention forward, SM80 mma.sync path.
// Rendered by flashgen from templates/fwd_sm80.cu.j2 -- edit the template, not this file.
// traits: dtype=fp16 head_dim=224 head_dim_v=224 block_m=64 block_n=64 num_warps=4 causal=false even_k=true dropout=false persistent=false ldsm_imm=false pv_passes=1 lean_loop=false arch=sm_86
#include "flashgen/fwd_sm80.cuh"

struct FwdParams {
    void* q;
    void* k;
    void* v;
    void* o;
    void* lse;
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
    long long o_batch_stride;
    long long o_row_stride;
    long long o_head_stride;
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
static_assert(sizeof(FwdParams) == 224, "FwdParams size drifted from Python");

using Kernel = flashgen::FwdSm80<cutlass::half_t, 224, 224, 64, 64, 4, false, true, false, false, false, 1, false>;
static_assert(Kernel::kSmemBytes == 86016, "codegen and the kernel disagree on shared memory");

extern "C" __global__ void __launch_bounds__(128, 1) fwd_sm80_fp16_hd224_m64n64_w4_sm86(const __grid_constant__ FwdParams params) {
  extern __shared__ __align__(128) char smem[];
  flashgen::fwd_sm80<Kernel>(params, smem);
}
