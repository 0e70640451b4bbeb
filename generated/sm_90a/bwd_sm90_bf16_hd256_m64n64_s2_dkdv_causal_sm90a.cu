// bwd_sm90_bf16_hd256_m64n64_s2_dkdv_causal_sm90a: attention backward over key blocks (dK, dV; split schedule), Hopper path (TMA + wgmma + warp specialization).
// Rendered by flashgen from templates/bwd_sm90.cu.j2 -- edit the template, not this file.
// traits: dtype=bf16 head_dim=256 block_m=64 block_n=64 stages=2 causal=true lse_smem=false dropout=false early_dv=false dq_handoff=false dq_red=false split_tail=false dq=false arch=sm_90a
#include "flashgen/bwd_sm90.cuh"

struct BwdSm90Params {
    cute::TmaDescriptor tma_q;
    cute::TmaDescriptor tma_k;
    cute::TmaDescriptor tma_v;
    cute::TmaDescriptor tma_do;
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
    int head_group;
    int split_tiles;
    int split_k;
    void* dkdv_partial;
    void* split_counter;
};
static_assert(sizeof(BwdSm90Params) == 960, "BwdSm90Params size drifted from Python");

using Kernel = flashgen::BwdSm90<cutlass::bfloat16_t, 256, 64, 64, 2, true, false, false, false, false, false, false, false>;
static_assert(Kernel::kSmemBytes == 229416, "codegen and the kernel disagree on shared memory");
static_assert(Kernel::kNThreads == 384, "codegen and the kernel disagree on the block size");
static_assert(Kernel::kDqAccumWidth == 256, "codegen and the kernel disagree on the dQ accumulator");

extern "C" __global__ void __launch_bounds__(384, 1) bwd_sm90_bf16_hd256_m64n64_s2_dkdv_causal_sm90a(const __grid_constant__ BwdSm90Params params) {
  // 1024-byte alignment: the 128-byte TMA / GMMA swizzle repeats every 8 rows of 128 bytes.
  extern __shared__ __align__(1024) char smem[];
  flashgen::bwd_sm90<Kernel>(params, smem);
}
