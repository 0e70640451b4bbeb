// bwd_sm90_fp16_hd128_m64n128_s2_ls_sm90a: attention backward over key blocks (dK, dV, dQ added into an fp32 accumulator), Hopper path (TMA + wgmma + warp specialization).
// Rendered by flashgen from templates/bwd_sm90.cu.j2 -- edit the template, not this file.
// traits: dtype=fp16 head_dim=128 block_m=64 block_n=128 stages=2 causal=false lse_smem=true dropout=false early_dv=false dq_handoff=false dq_red=false split_tail=true arch=sm_90a
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

using Kernel = flashgen::BwdSm90<cutlass::half_t, 128, 64, 128, 2, false, true, false, false, false, true, false>;
static_assert(Kernel::kSmemBytes == 198696, "codegen and the kernel disagree on shared memory");
static_assert(Kernel::kNThreads == 384, "codegen and the kernel disagree on the block size");
static_assert(Kernel::kDqAccumWidth == 128, "codegen and the kernel disagree on the dQ accumulator");

extern "C" __global__ void __launch_bounds__(384, 1) bwd_sm90_fp16_hd128_m64n128_s2_ls_sm90a(const __grid_constant__ BwdSm90Params params) {
  // 1024-byte alignment: the 128-byte TMA / GMMA swizzle repeats every 8 rows of 128 bytes.
  extern __shared__ __align__(1024) char smem[];
  flashgen::bwd_sm90<Kernel>(params, smem);
}

// Second entry point of the same cubin: the fp32 dQ accumulator -> dQ, in the tile order this unit wrote it.
extern "C" __global__ void __launch_bounds__(384) bwd_sm90_fp16_hd128_m64n128_s2_ls_sm90a_convert_dq(const __grid_constant__ BwdSm90Params params) {
  flashgen::bwd_sm90_convert_dq<Kernel>(params);
}
