// Host-side check of the layout algebra in flashgen's kernel headers, compiled with g++ (tests/test_layouts_cpu.py).
// CuTe layouts are host code, so the mappings the kernels rely on can be checked without a GPU:
//   Hopper forward: the S accumulator re-read as the register A operand of P V holds the right (row, key) per
//   register; accumulator rows sit on quads; V^T addresses are V's; Q/K/V tiles are laid out exactly as TMA's
//   128-byte swizzle writes its 64-column boxes; the epilogue's 8-column reads are 16-byte units.
//   SM80 forward: the column-group slices of V^T and O (head dims above 256), and every O element owned by one thread.
//   SM80 backward: each GEMM's output tile covered once by the 8 warps (32-key blocks, head_dim_v != head_dim),
//   transposed smem views (P^T, dS^T, dO^T, K^T, Q^T) address what the plain views do.
//   Hopper backward: S^T / dS^T re-read as the A operand of dV / dK; the dS^T write view addresses dS (dQ's A
//   operand) transposed, with the value pairs store_pairs writes adjacent; Q^T / dO^T / K^T views; each warpgroup's
//   dQ share (split columns or the whole tile) covered once, pairs adjacent, in the accumulator order (dq_tile_index)
//   one-to-one with 8-column units contiguous; the dq_red order (dq_frag_index) one-to-one, each thread's four values
//   of a column group consecutive and its groups 512 floats apart; the dK/dV epilogue pairs.
//   Hopper forward key blocks: each consumer warpgroup's count of key blocks, against a count over its rows.
#include "flashgen/bwd_sm90.cuh"
#include "flashgen/fwd_sm90.cuh"
#include "flashgen/fwd_sm80.cuh"
#include "flashgen/bwd_sm80.cuh"
#include <algorithm>
#include <cstdio>
#include <vector>
using namespace cute;
using namespace flashgen;
static int failures = 0;
#define CHECK(c, ...) do { if (!(c)) { if (failures++ < 10) { printf("FAIL %s:%d ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } } while (0)

template <class K>
void check_sm90() {
  using Element = typename K::Element;
  constexpr int M = K::kBlockM, N = K::kBlockN, D = K::kHeadDim;
  typename K::MmaS mma_s;
  typename K::MmaO mma_o;
  for (int t = 0; t < 128 * K::kConsumerWGs; ++t) {
    auto thr_s = mma_s.get_thread_slice(t);
    auto thr_o = mma_o.get_thread_slice(t);
    auto cS = thr_s.partition_C(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    // 1. P (S accumulator) re-read as the A operand of P V: same (row, key) per register.
    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<M>, Int<N>>{});   // the kernel's fragment layout
    Tensor vals = make_tensor<int>(acc_s.layout());
    CHECK(size(vals) == size(cS), "acc size");
    for (int i = 0; i < size(vals); ++i) vals(i) = get<0>(cS(i)) * N + get<1>(cS(i));
    Tensor asA = make_tensor(vals.data(), acc_as_a_layout_sm90(vals.layout()));
    auto cA = thr_o.partition_A(make_identity_tensor(Shape<Int<M>, Int<N>>{}));
    CHECK(size(asA) == size(cA), "size");
    for (int v = 0; v < size<0>(cA); ++v)
      for (int m = 0; m < size<1>(cA); ++m)
        for (int k = 0; k < size<2>(cA); ++k) {
          int want = get<0>(cA(v, m, k)) * N + get<1>(cA(v, m, k));
          CHECK(asA(v, m, k) == want, "A view t=%d v=%d k=%d got %d want %d", t, v, k, asA(v, m, k), want);
        }
    // 2. rowcol view: rows/cols of the S accumulator; quad lanes share rows.
    auto rc = rowcol_sm90(cS);
    for (int r = 0; r < size<0>(rc); ++r)
      for (int c = 0; c < size<1>(rc); ++c) CHECK(get<0>(rc(r, c)) == get<0>(rc(r, 0)), "row");
    CHECK(get<0>(rc(0, 0)) == (t / 128) * 64 + (t % 128) / 32 * 16 + (t % 32) / 4, "row of thread %d", t);
  }
  // 3./4. Addresses through smem pointers (the GMMA atoms apply their swizzle in the pointer): a fake 1024-aligned base.
  using E = typename K::Element;
  E* base = reinterpret_cast<E*>(uintptr_t(1) << 20);
  Tensor kv = make_tensor(make_smem_ptr(base), typename K::SmemLayoutKV{});
  Tensor vt = make_tensor(make_smem_ptr(base), typename K::SmemLayoutVt{});
  int bad_vt = 0, bad_q = 0, bad_kv = 0;
  for (int s = 0; s < K::kStages; ++s)
    for (int n = 0; n < N; ++n)
      for (int d = 0; d < D; ++d) bad_vt += &vt(d, n, s) != &kv(n, d, s);
  // TMA 128-byte swizzle: box c (64 columns) of rows at its chunk offset, 16-byte unit XOR row % 8.
  Tensor q = make_tensor(make_smem_ptr(base), typename K::SmemLayoutQ{});
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < D; ++c) {
      long want = (c / 64) * M * 64 + r * 64 + ((((c % 64) / 8) ^ (r % 8)) * 8) + c % 8;
      bad_q += (&q(r, c) - base) != want;
    }
  for (int s = 0; s < K::kStages; ++s)
    for (int n = 0; n < N; ++n)
      for (int d = 0; d < D; ++d) {
        long want = s * N * D + (d / 64) * N * 64 + n * 64 + ((((d % 64) / 8) ^ (n % 8)) * 8) + d % 8;
        bad_kv += (&kv(n, d, s) - base) != want;
      }
  // The epilogue reads 8 output columns from a multiple of 8 as one 16-byte unit.
  int bad_o = 0;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < D; c += 8)
      for (int e = 1; e < 8; ++e) bad_o += &q(r, c + e) != &q(r, c) + e;
  CHECK(bad_o == 0, "O 16-byte units: %d mismatches", bad_o);
  CHECK(bad_vt == 0 && bad_q == 0 && bad_kv == 0, "smem: V^T %d, Q swizzle %d, KV swizzle %d mismatches", bad_vt,
        bad_q, bad_kv);
  printf("sm90 hd%d m%d n%d: checked\n", D, M, N);
}

template <class K>
void check_sm80_groups() {
  constexpr int M = K::kBlockM, N = K::kBlockN, DV = K::kHeadDimV, G = K::kGroups;
  auto vt = typename K::SmemLayoutVt{};
  auto v = typename K::SmemLayoutV{};
  for (int g = 0; g < G; ++g) {
    Tensor t = make_tensor(make_smem_ptr((typename K::Element*)nullptr), vt);
    auto sl = group_rows<G>(make_tensor(counting_iterator<int>(0), vt), g);
    CHECK(size<0>(sl) == DV / G && size<1>(sl) == N, "slice shape");
    for (int dd = 0; dd < DV / G; ++dd)
      for (int n = 0; n < N; ++n) CHECK(sl(dd, n) == v(n, g * (DV / G) + dd), "V^T group slice");
    auto o = typename K::SmemLayoutO{};
    auto so = group_cols<G>(make_tensor(counting_iterator<int>(0), o), g);
    for (int m = 0; m < M; ++m)
      for (int cc = 0; cc < DV / G; ++cc) CHECK(so(m, cc) == o(m, g * (DV / G) + cc), "O group slice");
  }
  printf("sm80 groups=%d dv=%d: checked\n", G, DV);
}

// Each element of a (rows x cols) output tile is held by exactly one of kThreads threads.
template <class TiledMma, int kRows, int kCols>
int coverage_errors(int threads) {
  TiledMma mma;
  std::vector<int> seen(kRows * kCols, 0);
  for (int t = 0; t < threads; ++t) {
    auto c = mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kCols>>{}));
    for (int i = 0; i < size(c); ++i) seen[get<0>(c(i)) * kCols + get<1>(c(i))]++;
  }
  int bad = 0;
  for (int x : seen) bad += x != 1;
  return bad;
}

template <class K>
void check_sm80_fwd_coverage() {
  constexpr int M = K::kBlockM, DV = K::kHeadDimV, G = K::kGroups, DVG = K::kHeadDimVGroup;
  std::vector<int> seen(M * DV, 0);
  typename K::TiledMma mma;
  for (int t = 0; t < K::kNThreads; ++t) {
    const int g = t / K::kGroupThreads, tg = t % K::kGroupThreads;
    auto c = mma.get_thread_slice(tg).partition_C(make_identity_tensor(Shape<Int<M>, Int<DVG>>{}));
    for (int i = 0; i < size(c); ++i) seen[get<0>(c(i)) * DV + g * DVG + get<1>(c(i))]++;
  }
  int bad = 0;
  for (int x : seen) bad += x != 1;
  CHECK(bad == 0, "fwd O coverage: %d", bad);
}

template <class K>
void check_sm80_bwd() {
  constexpr int M = K::kBlockM, N = K::kBlockN, D = K::kHeadDim, DV = K::kHeadDimV;
  CHECK((coverage_errors<typename K::TiledMmaSdP, M, N>(K::kNThreads)) == 0, "S/dP coverage");
  CHECK((coverage_errors<typename K::TiledMmaDk, N, D>(K::kNThreads)) == 0, "dK coverage");
  CHECK((coverage_errors<typename K::TiledMmaDv, N, DV>(K::kNThreads)) == 0, "dV coverage");
  CHECK((coverage_errors<typename K::TiledMmaDq, M, D>(K::kNThreads)) == 0, "dQ coverage");
  auto p = typename K::SmemLayoutPdS{};
  auto pt = typename K::SmemLayoutPdSt{};
  auto d_o = typename K::SmemLayoutdO{};
  auto d_ot = typename K::SmemLayoutdOt{};
  auto k = typename K::SmemLayoutK{};
  auto kt = typename K::SmemLayoutKt{};
  int bad = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) bad += pt(n, m) != p(m, n);
  for (int m = 0; m < M; ++m)
    for (int d = 0; d < DV; ++d) bad += d_ot(d, m) != d_o(m, d);
  for (int n = 0; n < N; ++n)
    for (int d = 0; d < D; ++d) bad += kt(d, n) != k(n, d);
  CHECK(bad == 0, "bwd transposed views: %d", bad);
  printf("sm80 bwd m%d n%d hd%d v%d: checked\n", M, N, D, DV);
}

template <class K>
void check_sm90_bwd() {
  constexpr int M = K::kBlockM, N = K::kBlockN, D = K::kHeadDim, WGS = K::kConsumerWGs;
  typename K::MmaSdP mma_sdp;
  typename K::MmaDkv mma_dkv;
  typename K::MmaDq mma_dq;
  using E = typename K::Element;
  E* base = reinterpret_cast<E*>(uintptr_t(1) << 20);
  Tensor sdS = make_tensor(make_smem_ptr(base), typename K::SmemLayoutdS{});      // (queries, keys, buffer)
  Tensor sdSt = make_tensor(make_smem_ptr(base), typename K::SmemLayoutdSt{});    // (keys, queries), buffer 0
  Tensor sK = make_tensor(make_smem_ptr(base), typename K::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(base), typename K::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(base), typename K::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(base), typename K::SmemLayoutQt{});
  int bad_view = 0, bad_pair = 0, bad_a = 0, bad_frag = 0;
  for (int n = 0; n < N; ++n)
    for (int m = 0; m < M; ++m) bad_view += &sdSt(n, m) != &sdS(m, n, 0);
  for (int n = 0; n < N; ++n)
    for (int d = 0; d < D; ++d) bad_view += &sKt(d, n) != &sK(n, d);
  for (int s = 0; s < K::kStages; ++s)
    for (int m = 0; m < M; ++m)
      for (int d = 0; d < D; ++d) bad_view += &sQt(d, m, s) != &sQ(m, d, s);
  std::vector<int> dq_owner(size_t(M) * D, 0), dkv_owner(size_t(N) * D, 0);
  for (int t = 0; t < 128 * WGS; ++t) {
    auto thr_sdp = mma_sdp.get_thread_slice(t);
    auto thr_dkv = mma_dkv.get_thread_slice(t);
    // S^T / dS^T accumulators re-read as the register A operand of dV += P^T dO and dK += dS^T Q.
    auto cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<N>, Int<M>>{}));
    Tensor acc = partition_fragment_C(mma_sdp, Shape<Int<N>, Int<M>>{});
    Tensor vals = make_tensor<int>(acc.layout());
    for (int i = 0; i < size(vals); ++i) vals(i) = get<0>(cS(i)) * M + get<1>(cS(i));
    Tensor asA = make_tensor(vals.data(), acc_as_a_layout_sm90(vals.layout()));
    auto cA = thr_dkv.partition_A(make_identity_tensor(Shape<Int<N>, Int<M>>{}));
    for (int v = 0; v < size<0>(cA); ++v)
      for (int k = 0; k < size<2>(cA); ++k) bad_a += asA(v, 0, k) != get<0>(cA(v, 0, k)) * M + get<1>(cA(v, 0, k));
    // store_pairs: values j, j + 1 of the dS^T partition are adjacent addresses, as are those of dK / dV in sK.
    Tensor tdS = thr_sdp.partition_C(sdSt);
    for (int j = 0; j < size(tdS); j += 2) bad_pair += &tdS(j + 1) != &tdS(j) + 1;
    Tensor tdK = thr_dkv.partition_C(sK);
    auto cK = thr_dkv.partition_C(make_identity_tensor(Shape<Int<N>, Int<D>>{}));
    for (int j = 0; j < size(tdK); j += 2) bad_pair += &tdK(j + 1) != &tdK(j) + 1;
    for (int j = 0; j < size(cK); ++j) dkv_owner[get<0>(cK(j)) * D + get<1>(cK(j))]++;
    // dQ: the kernel's slice (split: the warpgroup's columns; taking turns: the whole tile as warpgroup 0).
    const int wg = t / 128, dq_col0 = K::kDqSplit ? wg * K::kDqCols : 0;
    auto cQ = mma_dq.get_thread_slice(K::kDqSplit ? t : t % 128)
                  .partition_C(make_identity_tensor(Shape<Int<M>, Int<D>>{}));
    if (K::kDqSplit || wg == 0) {
      for (int j = 0; j < size(cQ); ++j) {
        const int row = get<0>(cQ(j)), col = get<1>(cQ(j));
        bad_pair += col < dq_col0 || col >= dq_col0 + K::kDqCols;
        dq_owner[row * D + col]++;
        if (j % 2 == 0) {
          bad_pair += get<0>(cQ(j + 1)) != row || get<1>(cQ(j + 1)) != col + 1 ||
                      dq_tile_index<M>(row, col - dq_col0) + 1 != dq_tile_index<M>(row, col + 1 - dq_col0);
        }
        if (j % 4 == 0) {   // kDqRed: one 16-byte red of values j .. j + 3 at frag(0) + j / 4 * 512
          const int f = dq_frag_index<M>(row, col);
          for (int k = 1; k < 4; ++k) bad_frag += dq_frag_index<M>(get<0>(cQ(j + k)), get<1>(cQ(j + k))) != f + k;
          bad_frag += f % 4 != 0 || f != dq_frag_index<M>(get<0>(cQ(0)), get<1>(cQ(0))) + j / 4 * 512;
        }
      }
    }
  }
  int bad_cover = 0;
  for (int c : dq_owner) bad_cover += c != 1;
  for (int c : dkv_owner) bad_cover += c != 1;
  // The accumulator order: one-to-one into kBlockM x kDqAccumWidth floats, 8-column units contiguous.
  std::vector<int> slot(size_t(M) * K::kDqAccumWidth, 0), frag_slot(slot);
  int bad_index = 0;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < D; ++c) {
      const int i = dq_tile_index<M>(r, c), f = dq_frag_index<M>(r, c);
      bad_index += i < 0 || i >= M * K::kDqAccumWidth || slot[i]++ != 0;
      if (c % 8) bad_index += i != dq_tile_index<M>(r, c - 1) + 1;
      bad_frag += f < 0 || f >= M * K::kDqAccumWidth || frag_slot[f]++ != 0;
    }
  CHECK(bad_view == 0 && bad_pair == 0 && bad_a == 0 && bad_cover == 0 && bad_index == 0 && bad_frag == 0,
        "sm90 bwd: views %d, pairs %d, A operand %d, coverage %d, dQ order %d, dq_red order %d", bad_view, bad_pair,
        bad_a, bad_cover, bad_index, bad_frag);
  printf("sm90 bwd hd%d m%d n%d: checked\n", D, M, N);
}

// The Hopper forward's key-block counts (FwdSm90Tile::key_blocks, rows_key_blocks): each consumer warpgroup's count
// is exactly one past the highest key block any of its 64 rows sees, within the sequence (causal: bottom-right
// aligned), and never above the tile's count. Blocks are walked highest first, so a count below the tile's skips the
// tile's first blocks; a count too low would drop keys, one too high computes a masked block.
template <int N, bool kCausal>
void check_sm90_key_blocks(int& bad, int& cases, int& skipped) {
  const int lens[] = {1, 17, 64, 113, 128, 191, 192, 300, 777, 1000, 1023, 1500, 2048};
  for (int block_m : {64, 128, 192})
    for (int sq : lens)
      for (int sk : lens) {
        FwdSm90Tile t{};
        t.seqlen_q = sq, t.seqlen_k = sk;
        for (int m = 0; m * block_m < sq; ++m) {
          t.n_block_max = FwdSm90Tile::key_blocks<N, kCausal>((m + 1) * block_m - 1, sq, sk);
          for (int wg = 0; wg < block_m / 64; ++wg) {
            const int first = m * block_m + 64 * wg, own = t.rows_key_blocks<N, kCausal>(first);
            int want = 0;
            for (int r = first; r < first + 64 && r < sq; ++r) {
              const int last_key = kCausal ? std::min(sk - 1, r + sk - sq) : sk - 1;
              if (last_key >= 0) want = std::max(want, last_key / N + 1);
            }
            bad += own != want || own > t.n_block_max;
            skipped += t.n_block_max - own;
            ++cases;
          }
        }
      }
}

void check_sm90_key_blocks() {
  int bad = 0, cases = 0, skipped = 0;
  check_sm90_key_blocks<64, false>(bad, cases, skipped);
  check_sm90_key_blocks<64, true>(bad, cases, skipped);
  check_sm90_key_blocks<80, false>(bad, cases, skipped);
  check_sm90_key_blocks<80, true>(bad, cases, skipped);
  check_sm90_key_blocks<128, false>(bad, cases, skipped);
  check_sm90_key_blocks<128, true>(bad, cases, skipped);
  check_sm90_key_blocks<176, true>(bad, cases, skipped);
  CHECK(bad == 0, "sm90 key blocks: %d of %d warpgroup counts wrong", bad, cases);
  printf("sm90 key blocks: %d warpgroup tiles checked, %d blocks skipped\n", cases, skipped);
}

int main() {
  check_sm90_key_blocks();
  check_sm90<FwdSm90<cutlass::bfloat16_t, 128, 128, 128, 2, false, false, false>>();
  check_sm90<FwdSm90<cutlass::bfloat16_t, 256, 128, 80, 2, false, true, true>>();
  check_sm90<FwdSm90<cutlass::half_t, 192, 128, 96, 2, true, true, false>>();
  check_sm90<FwdSm90<cutlass::bfloat16_t, 64, 128, 128, 2, false, false, false>>();
  check_sm90<FwdSm90<cutlass::bfloat16_t, 64, 192, 128, 2, false, true, false>>();    // three consumer warpgroups
  check_sm90<FwdSm90<cutlass::half_t, 128, 128, 176, 2, true, true, true>>();         // FA3's hdim-128 key block
  check_sm90_bwd<BwdSm90<cutlass::bfloat16_t, 128, 64, 128, 2, false>>();   // dQ columns split
  check_sm90_bwd<BwdSm90<cutlass::half_t, 64, 64, 128, 3, true>>();       // dQ by turns
  check_sm90_bwd<BwdSm90<cutlass::bfloat16_t, 64, 64, 128, 3, true, true, false, true, true, false, true>>();   // dq_red
  check_sm90_bwd<BwdSm90<cutlass::bfloat16_t, 128, 64, 64, 2, false>>();  // one consumer warpgroup
  check_sm80_groups<FwdSm80<cutlass::bfloat16_t, 512, 512, 64, 32, 8, false, true, false>>();
  check_sm80_groups<FwdSm80<cutlass::bfloat16_t, 192, 128, 128, 64, 8, false, true, false>>();
  check_sm80_groups<FwdSm80<cutlass::bfloat16_t, 512, 512, 32, 32, 4, false, true, false>>();
  check_sm80_fwd_coverage<FwdSm80<cutlass::bfloat16_t, 512, 512, 64, 32, 8, false, true, false>>();
  check_sm80_fwd_coverage<FwdSm80<cutlass::bfloat16_t, 192, 128, 128, 64, 8, false, true, false>>();
  check_sm80_fwd_coverage<FwdSm80<cutlass::bfloat16_t, 512, 512, 32, 32, 4, false, true, false>>();
  check_sm80_fwd_coverage<FwdSm80<cutlass::bfloat16_t, 128, 128, 128, 64, 4, false, true, false>>();
  check_sm80_bwd<BwdSm80<cutlass::bfloat16_t, 512, 512, 64, 32, 8, 1, false, true, false>>();
  check_sm80_bwd<BwdSm80<cutlass::bfloat16_t, 192, 128, 64, 64, 8, 2, true, true, false>>();
  check_sm80_bwd<BwdSm80<cutlass::bfloat16_t, 64, 128, 64, 128, 8, 2, false, true, false>>();
  check_sm80_bwd<BwdSm80<cutlass::bfloat16_t, 128, 128, 64, 128, 8, 2, false, true, true>>();
  printf("%d failures\n", failures);
  return failures != 0;
}
