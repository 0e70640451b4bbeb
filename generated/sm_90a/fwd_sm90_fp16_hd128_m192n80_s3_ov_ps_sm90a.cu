// fwd_sm90_fp16_hd128_m192n80_s3_ov_ps_sm90a: attention forward, Hopper path (TMA + wgmma + warp specialization).
// Rendered by flashgen from templates/fwd_sm90.cu.j2 -- edit the template, not this file.
// traits: dtype=fp16 head_dim=128 block_m=192 block_n=80 stages=3 causal=false overlap=true pingpong=false dropout=false persistent=true q_bufs=2 split_tail=false stale_max=true arch=sm_90a
#include "flashgen/fwd_sm90.cuh"

struct FwdSm90Params {
    cute::TmaDescriptor tma_q;
    cute::TmaDescriptor tma_k;
    cute::TmaDescriptor tma_v;
    cute::TmaDescriptor tma_o;
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
    void* tile_counter;
    int o_tma;
    int head_group;
    int split_tiles;
    int split_k;
    void* o_partial;
    void* lse_partial;
    void* split_counter;
};
static_assert(sizeof(FwdSm90Params) == 832, "FwdSm90Params size drifted from Python");

using Kernel = flashgen::FwdSm90<cutlass::half_t, 128, 192, 80, 3, false, true, false, false, true, 2, false, true>;
static_assert(Kernel::kSmemBytes == 222896, "codegen and the kernel disagree on shared memory");
static_assert(Kernel::kNThreads == 512, "codegen and the kernel disagree on the block size");
static_assert(Kernel::kConsumerRegs == 160, "codegen and the kernel disagree on the register budget");

extern "C" __global__ void __launch_bounds__(512, 1) fwd_sm90_fp16_hd128_m192n80_s3_ov_ps_sm90a(const __grid_constant__ FwdSm90Params params) {
  // 1024-byte alignment: the 128-byte TMA / GMMA swizzle repeats every 8 rows of 128 bytes.
  extern __shared__ __align__(1024) char smem[];
  flashgen::fwd_sm90<Kernel>(params, smem);
}
