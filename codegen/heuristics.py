"""The dispatch table: which traits run a problem. Readable data, used by both `flashgen generate`
(the default set is exactly what this table can pick) and the runtime dispatcher.

Forward tiles (block_m, block_n, num_warps) per head-dim bucket. Origin: the tile choices of
flash-attn 2's forward launch templates for A100/H100 (large shared memory) and for sm86/sm89
(~100 KB per block), re-checked against our own shared-memory and register limits in traits.py.
H100 measurements that move an entry are recorded in docs/NOTES.md and benchmarks/RESULTS.md.
"""
from __future__ import annotations

from dataclasses import replace

from .arch import get_arch
from .traits import (FUSED_MAX_HDIM, HDIM_BUCKETS, WIDE_HDIM_BUCKETS, BwdDkdvTraits, BwdDqSm90Traits, BwdDqTraits,
                     BwdPreTraits, BwdSm90Traits, DropoutMaskTraits, FwdSm90Traits, FwdTraits, TraitsError,
                     bucket_for_head_dim)

# Sequence-length buckets (tuning files' keys, the Hopper forward's walk and shape table): a call falls into the first
# bucket >= max(seqlen_q, seqlen_k); the last one also takes everything longer. Tile choices move with the number of
# blocks per head, which these separate (1024 since the twenty-third session: on the H100 hdim 64 causal wants 128-row
# tiles at 1k and 192-row ones at 2k).
SEQLEN_BUCKETS = (512, 1024, 2048, 8192, 32768)


def seqlen_bucket(seqlen_q: int, seqlen_k: int = 0) -> int:
    s = max(seqlen_q, seqlen_k)
    return next((b for b in SEQLEN_BUCKETS if s <= b), SEQLEN_BUCKETS[-1])


# bucket -> (block_m, block_n, num_warps); "big" = >= 160 KB smem per block, "small" = ~100 KB.
FWD_TILES_BIG = {
    32: (128, 128, 4),
    64: (128, 64, 4),     # H100 2026-11-23: 308/320 TFLOP/s (2k/8k) vs 272/288 for flash-attn's 128x128
    96: (128, 64, 4),
    128: (128, 64, 4),    # H100: 319/335 vs 321/332 for 128x32, 295/301 for 64x64, 293/310 for 128x64 w8
    160: (128, 32, 4),
    192: (128, 64, 8),
    224: (128, 64, 8),
    256: (128, 64, 8),    # H100: 294/308 vs 292/299 for 64x64 w4, 279/290 for 128x32 w8
    # Wider head dims: 8 warps over 64 rows make two column groups, each holding half of O (FwdTraits.groups).
    **{b: (64, 32, 8) for b in WIDE_HDIM_BUCKETS},
}
# Causal entries that differ (measured on the H100, bf16, 2k/8k, 2026-11-23).
FWD_TILES_BIG_CAUSAL = {
    # hdim 128 was 128x32 (280/308 vs 268/301 for 128x64) until ldsm_imm: 128x64 with it 305/333 vs 282/311 for
    # 128x32 (tenth session, same process; flash-attn 2 279/309).
    # Eighth session, with the masked steps as a phase of their own (fwd_sm80.cuh): 276/300 vs 257/296 for 128x64x8
    # (flash-attn 2: 269/286).
    256: (64, 64, 4),
}
FWD_TILES_SMALL = {
    **FWD_TILES_BIG,
    128: (128, 32, 4),    # two blocks per SM fit in 100 KB
    224: (64, 64, 4),
    256: (64, 64, 4),
    **{b: (32, 32, 4) for b in WIDE_HDIM_BUCKETS},   # two column groups of 2 warps; 96 KB at hdim 512
}


def fwd_tiles(arch: str, head_dim_bucket: int, causal: bool) -> tuple[int, int, int]:
    if get_arch(arch).smem_per_block >= 160 * 1024:
        if causal and head_dim_bucket in FWD_TILES_BIG_CAUSAL:
            return FWD_TILES_BIG_CAUSAL[head_dim_bucket]
        return FWD_TILES_BIG[head_dim_bucket]
    return FWD_TILES_SMALL[head_dim_bucket]


def head_dim_buckets(head_dim: int, head_dim_v: int | None = None) -> tuple[int, int, bool]:
    """(bucket of head_dim, bucket of head_dim_v, even_k): runtime head dims -> the kernel's compile-time ones."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    bucket, bucket_v = bucket_for_head_dim(head_dim), bucket_for_head_dim(head_dim_v)
    return bucket, bucket_v, head_dim == bucket and head_dim_v == bucket_v


# Non-causal SM80 forwards as a persistent walk (FwdTraits.persistent): the GPU's resident CTAs take the tiles round
# robin and load each next tile's Q and first K block under the current tile's epilogue. H100, bf16, 16k tokens,
# 2k/4k/8k vs SDPA FLASH (ninth session, RESULTS.md): hdim 256 128x64x8 0.96/0.98/0.99 -> 1.03-1.04/1.06-1.07/1.05-1.07x,
# hdim 128 128x64 0.95/0.98/0.97 -> 0.97-0.98/1.00/0.98x (76 B of spills instead of 96), hdim 64 unchanged (kept on
# the grid); hdim 192 and 224 share hdim 256's 128x64x8 shape (not measured). Causal stays on the grid: a walk
# that took tiles heaviest-first from a global counter measured 5-15% slower than the hardware's own CTA scheduling.
# Only with the big tiles (>= 160 KB of shared memory per block), where it was measured: O's own space would halve
# the small tiles' CTAs per SM. FWD_SM80_PERSISTENT None: the buckets below; True / False: every non-causal key or
# none (tests, benchmarks).
FWD_SM80_PERSISTENT: bool | None = None
# hdim 128 left the walk in the tenth session: with ldsm_imm the grid measured as fast or faster (pv_passes 2, 2k/8k
# vs FLASH: grid 1.069/1.081, persistent 1.069/1.064).
FWD_SM80_PERSISTENT_BUCKETS = frozenset({192, 224, 256})

# How the SM80 forward addresses shared memory for its GEMMs, per bucket: (ldsm_imm, pv_passes), FwdTraits. Buckets
# not listed use CuTe's copies. H100, bf16, 16k tokens, tenth session, ratio to SDPA FLASH at 2k/8k in one process
# (CuTe's copies -> ldsm_imm -> + 2 P V passes; RESULTS.md): hdim 128 0.98/0.98 -> 1.07/1.07 -> 1.07/1.08 (its 96 B of
# spills -> 64), causal 128x64 1.01/1.02 -> 1.09/1.08; hdim 96 1.05/1.09 -> 1.06/1.09, causal 1.05/1.06 -> 1.06/1.06;
# hdim 160 1.49/1.44 -> 1.47/1.48, causal 1.39/1.42 -> 1.41/1.44. Not taken where it measured level or slower:
# hdim 32 (-0.5%), 64 (+-1%), 192 (-1%), 224 (+-2%), 256 (-2%; causal -1 to -3%). The SM80 backward keeps CuTe's copies
# (its fused schedule measured 1-5% slower with them, the split schedule 1-3% faster).
FWD_SM80_LDSM_IMM = {96: (True, 1), 128: (True, 2), 160: (True, 1)}
# Buckets whose SM80 forward runs the register-lean mainloop (FwdTraits.lean_loop). Tenth session (H200, ratio to SDPA
# FLASH at 2k / 8k): hdim 128 non-causal with V waited for right before P V 1.057 / 1.080 -> 1.057 / 1.068 and its
# 64 B of spills gone; causal with the wait, one loop and per-block copy addresses 1.092 / 1.074 -> 1.057 / 1.044 and
# 100 -> 0 B (the late wait alone kept 96 B, with one loop 8 B). hdim 64, 96, 160, 256 ran 5-8% slower with the late
# wait and do not spill without it.
FWD_SM80_LEAN_LOOP = frozenset({128})


def fwd_persistent(arch: str, bucket: int) -> bool:
    """The table's choice for a non-causal key (fwd_traits keeps causal kernels on the grid)."""
    if get_arch(arch).smem_per_block < 160 * 1024:
        return False
    return FWD_SM80_PERSISTENT if FWD_SM80_PERSISTENT is not None else bucket in FWD_SM80_PERSISTENT_BUCKETS


def fwd_traits(arch: str, dtype: str, head_dim: int, causal: bool,
               tiles: tuple[int, int, int] | None = None, dropout: bool = False,
               head_dim_v: int | None = None, persistent: bool | None = None) -> FwdTraits:
    """Traits for a forward call with runtime head dims `head_dim` (Q, K) and `head_dim_v` (V, O; default the
    same), multiples of 8 up to 512; the tile table is keyed by the wider bucket. `tiles` (block_m, block_n,
    num_warps) overrides the table, e.g. from a tuning run. Dropout kernels take the dropout-free tiles.
    `persistent` (non-causal only) overrides fwd_persistent."""
    bucket, bucket_v, even_k = head_dim_buckets(head_dim, head_dim_v)
    wide = max(bucket, bucket_v)   # the tables' key
    m, n, w = tiles or fwd_tiles(arch, wide, causal)
    ps = not causal and (fwd_persistent(arch, wide) if persistent is None else persistent)
    imm, passes = FWD_SM80_LDSM_IMM.get(wide, (False, 1))
    t = FwdTraits(arch=arch, dtype=dtype, head_dim=bucket, head_dim_v=bucket_v, block_m=m, block_n=n,
                  num_warps=w, causal=causal, even_k=even_k, dropout=dropout, persistent=ps, ldsm_imm=imm,
                  pv_passes=passes, lean_loop=wide in FWD_SM80_LEAN_LOOP)
    if not t.pv_passes_fit(passes):
        t = replace(t, pv_passes=1)   # these tiles' O columns do not split into equal power-of-two passes
    if ps and persistent is None and t.smem_bytes() > get_arch(arch).smem_per_block:
        t = replace(t, persistent=False)   # O's own space does not fit beside Q, K and V (hdim 224 on sm_80)
    return t.validate()


# Forward tiles `flashgen tune` measures (those that validate for the arch and head dim): the table's picks
# and their neighbours from the H100 tile sweeps in benchmarks/RESULTS.md.
FWD_TILE_CANDIDATES = ((128, 128, 4), (128, 64, 4), (128, 32, 4), (64, 128, 4), (64, 64, 4),
                       (128, 128, 8), (128, 64, 8), (128, 32, 8))


def fwd_tile_candidates(arch: str, dtype: str, head_dim: int, causal: bool) -> list[tuple[int, int, int]]:
    """Forward tiles worth timing for one key, the table's pick first."""
    default = fwd_tiles(arch, bucket_for_head_dim(head_dim), causal)
    out = []
    for tiles in (default,) + tuple(t for t in FWD_TILE_CANDIDATES if t != default):
        try:
            fwd_traits(arch, dtype, head_dim, causal, tiles)
            out.append(tiles)
        except TraitsError:
            pass
    return out


# Hopper forward (sm_90a; the default forward on compute capability 9.0, FLASHGEN_HOPPER=0 turns it off):
# bucket (a multiple of 64) -> (block_m, block_n, stages, mainloop). 128 rows = two consumer warpgroups; block_n as
# large as the registers (S, O and P per consumer thread) and 227 KB of shared memory allow with 2 K/V stages.
# Mainloops: "serial" (S GEMM, softmax, P V GEMM, each waited for), "overlap" (S of block i issued with P V of
# block i-1) and "pingpong" (overlap + the two consumer warpgroups taking turns issuing GEMMs).
# H100 2026-11-23 (bf16, 16k tokens, TFLOP/s at seqlen 2k/8k non-causal, serial / overlap / ping-pong, 128 x table
# block_n): hdim 64 402/426, 367/376, 366/400; hdim 128 522/560, 501/503, 508/553; hdim 256 417/439, 446/463, 446/478.
# `flashgen tune --family fwd_sm90` (sixth session) then moved two buckets: hdim 64 to 192 rows (three consumer
# warpgroups, FlashAttention 3's shape) serial, 459/524 vs 402/447 (causal 345/468 vs 330/414); hdim 256 to 128 x 64
# overlapped, 621 vs 453 at 2k (80-key blocks were the slow part: serial 128 x 64 alone gave 609). hdim 192 follows
# hdim 256 (not measured). Until the seventh session the overlapped mainloops did not overlap (ptxas hoisted the
# P V wait above the softmax; fwd_sm90.cuh's order_before_wait): retuned after the fix (tuner timings, warm L2),
# hdim 256 128 x 64 overlap 643/729 vs serial 626/678; hdim 128 128 x 128 serial 571/637 vs overlap 573/610, ping-pong
# 581/595; hdim 64 192 x 128 serial 455/540 vs overlap 405/434. The table keeps its choices.
# Eighth session, the 80/160/176-key candidates measured for real (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, tuner timings,
# 2k/8k non-causal, causal): hdim 128 128 x 160 serial 598/631, 459/585 vs 128 x 128 serial 548/614, 419/568 (128 x 176
# 595/650, 440/517; 192 x 80 606/562, 456/572), so the table moves to 128 x 160; hdim 256 128 x 80 overlap 666/685,
# 511/627 vs 128 x 64 overlap 621/713, 503/627 (kept).
# Eleventh session: the overlapped mainloops had kept P across iterations by an element-wise copy of 16-bit values
# (~100 byte permutes per block, some after the P V wait); converted straight into P's registers (convert_into) they
# gained 5-10% (H100, do_bench, ratio to SDPA CUDNN at 2k / 8k: hdim 128 128 x 128 overlap 0.885 / 0.923 -> 0.973 /
# 1.011, ping-pong 0.867 / 0.930 -> 0.948 / 1.048; hdim 256 128 x 80 ping-pong 0.987 / 0.979 -> ~1.04 / 1.09) and now
# beat the serial mainloop (hdim 128 128 x 160 serial 0.904 / 0.982; hdim 64 192 x 128 serial 1.002 / 1.106 vs overlap
# 1.009 / 1.174). The table moved to them; docs/NOTES.md has the whole table.
FWD_SM90_TILES = {64: (192, 128, 2, "overlap"), 128: (128, 128, 2, "pingpong"), 192: (128, 64, 2, "overlap"),
                  256: (128, 80, 2, "pingpong")}
# (bucket, causal, sequence bucket) -> (block_m, block_n, stages, mainloop): where the H100's A/Bs found a better choice
# than the bucket's for a causal flag and sequence length (it lived only in the H100's tuning file until the
# forty-sixth session, so other sm_90a GPUs ran the bucket's). H100, bf16, ratio to SDPA CUDNN (benchmarks/RESULTS.md):
# hdim 128 non-causal 2k 192 x 80 overlap with 3 K/V stages 1.011-1.031 -> 1.037-1.048 (twenty-sixth session), 8k and
# longer 192 x 80 overlap 4 stages 1.03-1.06 -> 1.08-1.11, 16k 1.059 -> 1.132 (twenty-fifth); causal 8k the same
# tiles 1.115 -> 1.136 (twenty-sixth); causal 1k / 2k 128 x 128 overlap (`flashgen tune`, eleventh); hdim 256 causal 2k
# 128 x 64 ping-pong 1.085 -> 1.102 (twenty-sixth). fp16 measured the same at 8k (1.04-1.06 -> 1.11). H200 (forty-sixth
# session): NOTES.md. Dropout keeps the bucket's (its own adjustments below).
FWD_SM90_SHAPE_TILES = {
    (128, False, 2048): (192, 80, 3, "overlap"),
    (128, False, 8192): (192, 80, 4, "overlap"),
    (128, False, 32768): (192, 80, 4, "overlap"),
    (128, True, 1024): (128, 128, 2, "overlap"),
    (128, True, 2048): (128, 128, 2, "overlap"),
    (128, True, 8192): (192, 80, 4, "overlap"),
    (256, True, 2048): (128, 64, 2, "pingpong"),
}
FWD_SM90_MAINLOOPS = {"serial": (False, False), "overlap": (True, False), "pingpong": (True, True)}  # (overlap, pp)
FWD_SM90_MAINLOOP: str | None = None   # one mainloop for every bucket (tests, benchmarks); None: the table's
# With dropout (eleventh session, H100, p = 0.1, ratio to SDPA CUDNN without dropout at 2k / 8k): the Philox rounds of
# block i run under block i's S GEMM and block i-1's P V GEMM. hdim 128 128 x 128 ping-pong 0.741 / 0.833 vs serial
# 0.663 / 0.700 (128 x 160 serial, the table's before: 0.679 / 0.709), causal 0.741 / 0.788 vs 0.688 / 0.734; hdim 64
# 0.619 / 0.651 vs 0.611 / 0.639.
FWD_SM90_DROPOUT_MAINLOOP = "pingpong"
# The Hopper forward as a persistent walk (one CTA per SM takes the next tile from a global counter; the K/V ring runs
# on across tiles and the next tile's Q loads during this one's last blocks): per head-dim bucket, the longest seqlen
# bucket (SEQLEN_BUCKETS, of max(seqlen_q, seqlen_k)) that takes it; longer or unknown (0) seqlens,
# other buckets and dropout keep the grid. It halves the per-tile fixed cost but runs each key block a little slower
# (twelfth session: hdim 128 intercept 50 -> 24 us, slope +6%), so it pays where tiles are short. H100, nineteenth
# session (bf16, 16k tokens, ratio to SDPA CUDNN, grid (measured twice) -> persistent, 11 rounds in random order):
# hdim 128 1k 0.941 / 0.939 -> 0.979, causal 0.889 / 0.890 -> 1.007; 2k 1.006 / 1.007 -> 1.015, causal 1.029 / 1.029 ->
# 1.061; 4k 1.048 / 1.053 -> 1.054, causal 1.093 / 1.095 -> 1.092; 8k 1.062 / 1.063 -> 1.056, causal 1.115 / 1.103 ->
# 1.093. hdim 64: 1k 0.911 / 0.907 -> 0.966, causal 0.727 / 0.727 -> 0.803; 2k 1.035 / 1.028 -> 1.058, causal 0.952 /
# 0.954 -> 0.990; 4k 1.068 / 1.062 -> 1.073, causal 1.008 / 1.003 -> 1.022; 8k 1.135 / 1.143 -> 1.135, causal 1.093 /
# 1.092 -> 1.080. (4k falls in the 8192 bucket, with 8k.) hdim 256 has room for one Q buffer only and measured slower
# with the walk (twelfth session: 1.068 -> 0.960 at 2k).
FWD_SM90_PERSISTENT_SEQLEN = {64: 2048, 128: 2048}
FWD_SM90_PERSISTENT: bool | None = None   # one walk for every call (tests, benchmarks); None: the rule above


def fwd_sm90_persistent(bucket: int, seqlen: int, dropout: bool) -> bool:
    """Whether the Hopper forward of a head-dim bucket walks its tiles persistently at seqlen bucket `seqlen`."""
    if FWD_SM90_PERSISTENT is not None:
        return FWD_SM90_PERSISTENT
    return not dropout and 0 < seqlen <= FWD_SM90_PERSISTENT_SEQLEN.get(bucket, 0)


# Head-dim bucket -> the longest sequence bucket (SEQLEN_BUCKETS) at which dispatch keeps the SM80
# forward on sm_90a (with few key blocks per tile the Hopper kernel's fixed costs dominate). H100 2026-11-23 (seqlen
# 512, SM80 vs Hopper grid TFLOP/s): hdim 64 251 vs 221 (causal 180 vs 122), hdim 128 274 vs 231 (194 vs 176), so
# {64: 512, 128: 512} until the nineteenth session, when the persistent walk took the short sequences (ratio to SDPA
# CUDNN, bf16, 16k tokens, SM80 / Hopper walk / Hopper grid): hdim 64 seqlen 256 0.615 / 0.740 / 0.515, causal 0.717 /
# 0.628 / 0.452; 512 0.656 / 0.923 / 0.780, causal 0.716 / 0.770 / 0.647; hdim 128 256 0.713 / 0.982 / 0.856, causal
# 0.847 / 0.951 / 0.804; 512 0.592 / 0.909 / 0.830, causal 0.666 / 0.872 / 0.729. Empty now: the Hopper forward
# everywhere it applies.
FWD_SM90_SHORT_SEQLEN: dict = {}

# Causal Hopper kernels take their tiles heaviest first over groups of heads (the params' head_group, sm90_common.cuh's
# grouped_tile) of about this many CTAs, per head-dim bucket; a bucket not listed keeps the natural order (each head's
# blocks in turn, the heaviest first within a head). Larger groups lose L2 sharing. H100 2026-11-24 (eighteenth
# session, bf16, 16k tokens, causal, ratio to SDPA CUDNN at 2k / 8k, 11 rounds in random order, natural order measured
# twice, then groups of 128 / 256 CTAs): forward hdim 64 0.950 / 0.951 -> 0.916 / 0.939, 1.102 / 1.095 -> 1.096 /
# 1.109; hdim 128 1.006 / 1.007 -> 1.010 / 1.012, 1.087 / 1.080 -> 1.104 / 1.111; hdim 256 1.024 / 1.023 -> 1.063 /
# 1.048, 1.108 / 1.110 -> 1.166 / 1.150. Backward hdim 64 0.970 / 0.971 -> 0.980 / 0.974, 0.977 / 0.970 -> 0.979 /
# 0.997; hdim 128 0.932 / 0.918 -> 0.949 / 0.955, 0.929 / 0.931 -> 0.949 / 0.949; hdim 256 1.045 / 1.046 -> 1.040 /
# 1.037, 1.047 / 1.040 -> 1.046 / 1.044. Groups of 1024 CTAs or all heads: -10 to -40% at 2k (L2).
FWD_SM90_HEAD_GROUP_CTAS = {128: 256, 256: 128}
BWD_SM90_HEAD_GROUP_CTAS = {64: 256, 128: 256}


def head_group(table: dict, bucket: int, causal: bool, blocks: int, pairs: int) -> int:
    """(head, batch) pairs per group of a causal Hopper launch with `blocks` tiles per pair (0: the natural order)."""
    ctas = table.get(bucket) if causal else None
    if not ctas or blocks <= 0 or pairs <= 0:
        return 0
    return min(pairs, -(-ctas // blocks))


# Split tail (FwdSm90Traits.split_tail): a piece costs its share of the tile's key blocks plus about this many blocks
# (its first S GEMM and softmax with nothing to overlap, its partial O written, the merge), and a split must cut the
# estimated last wave by FWD_SM90_SPLIT_GAIN or more. Each piece has at least FWD_SM90_SPLIT_MIN_BLOCKS key blocks. A
# launch of one wave or less takes up to FWD_SM90_SPLIT_MAX pieces per tile, the last wave of a longer one up to
# FWD_SM90_SPLIT_MAX_TAIL: on the H100 (twenty-seventh session) halves gained 1.3-2.5% at hdim 128 8k, while fifths of
# the hdim 256 8k tail lost 2.4-5% (under the power cap the SMs a partial last wave leaves idle speed up the others).
FWD_SM90_SPLIT_COST = 2.0
FWD_SM90_SPLIT_GAIN = 0.9
FWD_SM90_SPLIT_MAX = 8
FWD_SM90_SPLIT_MAX_TAIL = 2
FWD_SM90_SPLIT_MIN_BLOCKS = 4
FWD_SM90_SPLIT_LIMIT = 16   # what fwd_sm90.cuh's merge holds (kMaxSplit)
# None: the estimate below; 0 (or False): never; k >= 2: k pieces for the last wave's tiles, or for every tile of a
# launch that fills no wave (tests, benchmarks)
FWD_SM90_SPLIT: int | None = None


def split_tail(tiles: int, ctas: int, blocks: int, forced: int | None, cost: float, gain: float, most: int,
               most_tail: int, min_blocks: int, limit: int) -> tuple[int, int]:
    """(split_tiles, split_k) for a launch of `tiles` equal tiles of `blocks` blocks (the loop's steps) on `ctas`
    resident CTAs: the tiles past the last full wave run as split_k pieces each, where the estimated time of that last
    wave, rounds of pieces x (blocks / split_k + cost), falls by `gain`; (0, 1): no split. A launch of one wave or
    less takes up to `most` pieces per tile, the last wave of a longer one up to `most_tail`; each piece has at least
    `min_blocks` blocks. `forced` (tests, benchmarks): 0 never, k >= 2 k pieces for the last wave's tiles, or for every
    tile of a launch that fills no wave."""
    rem = tiles % ctas if ctas > 0 else 0
    if (forced is not None and forced < 2) or blocks <= 1:
        return 0, 1
    if forced is not None:
        return rem or min(tiles, ctas), min(forced, limit, blocks)
    if rem == 0:
        return 0, 1
    ks = range(2, min(most if tiles < ctas else most_tail, blocks // min_blocks) + 1)
    est = {k: -(-rem * k // ctas) * (blocks / k + cost) for k in ks}
    if not est or min(est.values()) > (blocks + cost) * gain:
        return 0, 1
    # the fewest pieces within 10% of the best estimate: fewer partials to write and merge
    return rem, min(k for k in ks if est[k] <= 1.1 * min(est.values()))


def fwd_sm90_split_tail(tiles: int, ctas: int, key_blocks: int) -> tuple[int, int]:
    """The Hopper forward's split tail (split_tail with the FWD_SM90_SPLIT_* constants) over tiles of key_blocks."""
    return split_tail(tiles, ctas, key_blocks, FWD_SM90_SPLIT, FWD_SM90_SPLIT_COST, FWD_SM90_SPLIT_GAIN,
                      FWD_SM90_SPLIT_MAX, FWD_SM90_SPLIT_MAX_TAIL, FWD_SM90_SPLIT_MIN_BLOCKS, FWD_SM90_SPLIT_LIMIT)


# The Hopper backward's split tail (BwdSm90Traits.split_tail; split_tail's arguments): a piece costs its share of the
# key block's query blocks plus about BWD_SM90_SPLIT_COST blocks (K and V loaded, dK and dV written to a slot, the
# last piece's sum of the slots). The non-causal grids of the benchmark shapes end on a sliver of a wave (hdim 64:
# 4096 key blocks = 31.03 waves of 132) or half of one (hdim 128: 15.5).
BWD_SM90_SPLIT_COST = 2.0
BWD_SM90_SPLIT_GAIN = 0.9
BWD_SM90_SPLIT_MAX = 8
BWD_SM90_SPLIT_MAX_TAIL = 8
BWD_SM90_SPLIT_MIN_BLOCKS = 4
BWD_SM90_SPLIT_LIMIT = 16   # pieces a forced split takes at most (the kernel has no limit of its own)
# None: the estimate; 0 (or False): never; k >= 2: k pieces (tests, benchmarks), as FWD_SM90_SPLIT
BWD_SM90_SPLIT: int | None = None


def bwd_sm90_split_tail(tiles: int, ctas: int, query_blocks: int) -> tuple[int, int]:
    """The Hopper backward's split tail over key blocks (tiles) that each walk query_blocks query blocks."""
    return split_tail(tiles, ctas, query_blocks, BWD_SM90_SPLIT, BWD_SM90_SPLIT_COST, BWD_SM90_SPLIT_GAIN,
                      BWD_SM90_SPLIT_MAX, BWD_SM90_SPLIT_MAX_TAIL, BWD_SM90_SPLIT_MIN_BLOCKS, BWD_SM90_SPLIT_LIMIT)


def sm90_bucket(head_dim: int) -> int:
    """The Hopper kernels' head-dim bucket: the next multiple of 64 (one TMA box / swizzle span is 64 columns; the
    tensor maps zero-fill the columns past the runtime head dim, so there is no padded variant)."""
    return -(-head_dim // 64) * 64


def fwd_sm90_shape_choice(head_dim: int, causal: bool, seqlen: int, dropout: bool = False) -> tuple | None:
    """FWD_SM90_SHAPE_TILES' choice for a call, or None where the bucket's applies: seqlen unknown (0), dropout, or
    one mainloop forced for every call (FWD_SM90_MAINLOOP: the tests' and benchmarks' per-mainloop runs)."""
    if not seqlen or dropout or FWD_SM90_MAINLOOP is not None:
        return None
    return FWD_SM90_SHAPE_TILES.get((sm90_bucket(head_dim), bool(causal), seqlen_bucket(seqlen)))


def fwd_sm90_traits(arch: str, dtype: str, head_dim: int, causal: bool, block_m: int | None = None,
                    block_n: int | None = None, mainloop: str | None = None, stages: int | None = None,
                    dropout: bool = False, persistent: bool | None = None, seqlen: int = 0) -> FwdSm90Traits | None:
    """The Hopper forward for a runtime head dim, or None where there is none (arch without wgmma, head dim
    above 256). Head dims between the buckets read zeros past the head dim (TMA bounds): no padded variant.
    `block_m`, `block_n`, `mainloop` and `stages` (the order of a tuning choice) override the table. With dropout the
    table's choice takes FWD_SM90_DROPOUT_MAINLOOP, at most 128 rows (the Philox words need the registers a third
    warpgroup gives up) and block_n a multiple of 32 (the mask's blocks). `persistent` overrides fwd_sm90_persistent,
    which decides from the seqlen bucket of `seqlen` (0: unknown), as FWD_SM90_SHAPE_TILES does where none of the four
    is given."""
    if "sm90_wgmma" not in get_arch(arch).mma or not 0 < head_dim <= max(FWD_SM90_TILES):
        return None
    bucket = sm90_bucket(head_dim)
    m, n, table_stages, table_mainloop = FWD_SM90_TILES[bucket]
    shape = fwd_sm90_shape_choice(head_dim, causal, seqlen, dropout)
    if shape is not None and (block_m, block_n, mainloop, stages) == (None,) * 4:
        m, n, table_stages, table_mainloop = shape   # one choice as a whole, stages included
    if dropout:
        m, n, table_mainloop = min(m, 128), n // 32 * 32, FWD_SM90_DROPOUT_MAINLOOP
    overlap, pingpong = FWD_SM90_MAINLOOPS[mainloop or (None if dropout else FWD_SM90_MAINLOOP) or table_mainloop]
    if pingpong and block_m is None:
        m = 128   # ping-pong alternates exactly two consumer warpgroups
    return FwdSm90Traits(arch=arch, dtype=dtype, head_dim=bucket, block_m=block_m or m, block_n=block_n or n,
                         stages=stages or table_stages, causal=causal, overlap=overlap, pingpong=pingpong,
                         dropout=dropout,
                         persistent=fwd_sm90_persistent(bucket, seqlen, dropout) if persistent is None
                         else persistent).validate()


def sm90_mainloop(t: FwdSm90Traits) -> str:
    """The mainloop name of a Hopper forward's traits."""
    return next(k for k, v in FWD_SM90_MAINLOOPS.items() if v == (t.overlap, t.pingpong))


# Hopper forward candidates `flashgen tune` times per key: each block_m x block_n here with each mainloop, where
# the traits validate (registers for S, P and O; shared memory for 2 K/V stages), the table's pick first. 192 rows
# = three consumer warpgroups with 160 registers each (FlashAttention 3's hdim-64 shape); block_n 176 is its
# hdim-128 choice; the rest brackets the table.
FWD_SM90_BLOCK_M_CANDIDATES = (128, 192)
FWD_SM90_BLOCK_N_CANDIDATES = (64, 80, 96, 128, 160, 176)


def fwd_sm90_candidates(arch: str, dtype: str, head_dim: int, causal: bool, seqlen: int = 0) -> list[tuple]:
    """(block_m, block_n, mainloop) worth timing for one key at seqlen bucket `seqlen` (0: unknown), the table's
    first (with its stages where FWD_SM90_SHAPE_TILES chose them); [] without a Hopper forward."""
    table = fwd_sm90_traits(arch, dtype, head_dim, causal, seqlen=seqlen)
    if table is None:
        return []
    first = (table.block_m, table.block_n, sm90_mainloop(table))
    out = [first + (table.stages,) if fwd_sm90_shape_choice(head_dim, causal, seqlen) else first]
    seen = {table.name}   # one timing per kernel: (m, n, mainloop) may name the table's choice without its stages
    for m in FWD_SM90_BLOCK_M_CANDIDATES:
        for n in FWD_SM90_BLOCK_N_CANDIDATES:
            for mainloop in FWD_SM90_MAINLOOPS:
                try:
                    name = fwd_sm90_traits(arch, dtype, head_dim, causal, m, n, mainloop, seqlen=seqlen).name
                except TraitsError:
                    continue
                if name not in seen:
                    seen.add(name)
                    out.append((m, n, mainloop))
    return out


def dropout_mask_traits(arch: str) -> DropoutMaskTraits:
    """The kernel that writes a dropout keep-mask (tests, return_attn_probs with dropout)."""
    return DropoutMaskTraits(arch=arch).validate()


# Backward tiles: (block_m, block_n, stages) candidates in order of preference; the first that fits the
# arch's shared memory is used. dK/dV keep block_n x head_dim x 2 fp32 accumulators in registers, so wide
# head dims take block_n = 64. Origin: flash-attn 2's sm80 backward tiles (64 x 128 up to hdim 128,
# 64 x 64 above), with a second Q/dO (dK/dV kernel) or K/V (dQ kernel) stage where memory allows.
# H100 2026-11-23 (bf16, 16k tokens, TFLOP/s at seqlen 2k/8k, fused schedule): hdim 64 128x128 249/268 vs
# 229/245 for 64x128; hdim 128 64x128 2 stages 285/303 vs 243/261 with 1 stage; hdim 256 64x64 2 stages 240/256
# vs 206/217 with 1 stage. The split schedule ranks the same.
BWD_TILE_CANDIDATES = {
    "small": [(128, 128, 2), (64, 128, 2), (64, 128, 1), (64, 64, 1)],   # head dim bucket <= 64
    "narrow": [(64, 128, 2), (64, 128, 1), (64, 64, 2), (64, 64, 1)],    # <= 128
    "wide": [(64, 64, 2), (64, 64, 1)],
    # Above 256, dK and dV of 64 keys no longer fit the registers: 32 keys per block (split schedule only, see
    # FUSED_MAX_HDIM).
    "huge": [(64, 32, 2), (64, 32, 1)],
}


def _bwd_candidates(bucket: int):
    return BWD_TILE_CANDIDATES["small" if bucket <= 64 else "narrow" if bucket <= 128 else
                               "wide" if bucket <= 256 else "huge"]
# Hopper backward (the fused schedule in one wgmma kernel, plus the shared preprocess): (bucket, causal) -> (block_m,
# block_n, stages). Two consumer warpgroups of 64 keys each hold dK and dV (2 x 64 x head_dim fp32) in registers up to
# head dim 128 (above, see the 256 entry). H100 2026-11-23 (bf16, 16k
# tokens, TFLOP/s at 2k/8k, against the SM80 fused kernels' 288/308 at hdim 128 and 251/268 at hdim 64): the first
# version (dQ by 8-byte atomics, 2 stages) 333/352 and 242/270; 3 Q/dO stages 327/368 and 269/294 (hdim 64 takes
# them). Leaving the atomics out gave 419/478 and 303/357, hence the bulk reduce of dQ from shared memory. The
# default on sm_90a (FLASHGEN_HOPPER_BWD=0 turns it off). Fourteenth session (bulk reduce, dQ handoff, unpadded
# accumulator; 5 rounds in one process, ratio to SDPA CUDNN at 2k / 8k, 3 -> 2 -> 4 stages): hdim 64 0.916 / 0.894 ->
# 0.921 / 0.914 -> 0.906 / 0.896, causal 0.951 / 0.939 -> 0.953 / 0.948 -> 0.954 / 0.946; hdim 128 2 -> 3 stages level.
# Head dim 256 (fifteenth session): one 64-key block per CTA whose two consumer warpgroups split dK's and dV's columns
# (BwdSm90Traits.col_split); one Q/dO stage (the fp32 dQ stages take 64 KB of the 227 KB). Head dims 129..255 run it
# zero-padded (no 192 bucket: 96-column halves are not whole 64-column spans), which still beats the SM80 kernels of
# their own buckets (H100, TFLOP/s of the real head dim at 2k / 8k, SM80 fused -> Hopper: hdim 160 213 / 224 -> 228 /
# 254, causal 184 / 222 -> 192 / 236; 192 234 / 250 -> 270 / 303, causal 205 / 250 -> 230 / 287; 224 218 / 232 ->
# 296 / 326, causal 186 / 220 -> 250 / 308).
# Sixteenth session, hdim 64 with K and V in registers (BwdSm90::kSdpRs; 9 rounds, the 2-stage base twice): 2 -> 3 -> 4
# stages 0.921 / 0.913 -> 0.909 / 0.900 -> 0.946 / 0.940, causal 0.964 / 0.973 -> 0.968 / 0.972 -> 0.970 / 0.974: 4.
# Twentieth session, hdim 64 in 128-row query blocks (FlashAttention 3's 128 x 128 tile: each consumer warpgroup
# computes the dQ of 64 rows; spill-free only without early_dv and without the separate mask pass; ab_sm90.py, 11
# rounds, ratio to SDPA CUDNN at 2k / 8k, two calls): 0.943 / 0.942 -> 0.976 / 0.989 and 0.952 / 0.941 -> 0.987 /
# 0.981; causal 0.981 / 0.977 -> 0.951 / 0.947 and 0.971 / 0.987 -> 0.941 / 0.954 (not taken).
# Thirty-second session, hdim 64 causal after stmatrix and the loops that test at their end (ab_sm90.py, 4 -> 3
# stages, ratio to SDPA CUDNN at 2k / 8k): 11 rounds 1.015 / 1.018 -> 1.032 / 1.032; 21 rounds 1.026 / 1.008 -> 1.040 /
# 1.032; batch 4 x 16 heads, 15 rounds 1.069 / 1.016 -> 1.096 / 1.024: 3.
BWD_SM90_TILES = {(64, False): (128, 128, 2), (64, True): (64, 128, 3), (128, False): (64, 128, 2),
                  (128, True): (64, 128, 2), (256, False): (64, 64, 1), (256, True): (64, 64, 1)}
BWD_SM90_BUCKETS = sorted({bucket for bucket, _ in BWD_SM90_TILES})
# Dropout takes 64-row query blocks (bwd_sm90_keep_bits pairs the Philox calls of 64 rows).
BWD_SM90_DROPOUT_TILES = {64: (64, 128, 4)}


# lse and D through shared memory in the Hopper backward (BwdSm90Traits.lse_smem, built in the seventh session to take
# 32 registers off the hdim 128 kernel's spills), per (bucket, causal). H100 2026-11-24 (bf16, 16k tokens, TFLOP/s at
# 2k/8k, without -> with): hdim 64 307/346 -> 322/354, causal 241/303 -> 256/324; hdim 128 384/422 -> 397/436, causal
# 313/391 -> 300/387 (kept off there). Thirteenth session: with the prefetched lse converted when it is stored (not
# right after its load), hdim 128 causal gains from it too (ratio to SDPA CUDNN at 2k / 8k: 0.828 / 0.849 -> 0.857 / 0.902).
# Fifteenth session, hdim 256 (ratio to SDPA CUDNN at 2k / 8k, 5 rounds, shared memory -> registers): 0.974 / 1.052 ->
# 1.024 / 1.131, causal 0.990 / 1.004 -> 0.984 / 1.002.
BWD_SM90_LSE_SMEM_TABLE = {(64, False): True, (64, True): True, (128, False): True, (128, True): True,
                           (256, False): False, (256, True): False}
BWD_SM90_LSE_SMEM: bool | None = None   # one choice for every key (tests, benchmarks); None: the table's
# dV issued before dP's wait and dK after dQ (BwdSm90Traits.early_dv), per (bucket, causal). H100 2026-11-24 (eleventh
# session, bf16, 16k tokens, ratio to SDPA CUDNN backward at 2k / 8k, as is -> early_dv): hdim 64 0.815 / 0.839 ->
# 0.858 / 0.903, causal 0.827 / 0.829 -> 0.783 / 0.790; hdim 128 0.878 / 0.886 -> 0.876 / 0.895, causal 0.826 / 0.861
# -> 0.649 / 0.682 (in the hdim 128 causal kernel ptxas hoists ~200 instructions, the lse / D loads among them, between
# the S^T warpgroup arrive and its first HGMMA, and spills in the loop). Not with dropout (dV's operand P Z is formed together with dS).
# Twelfth session: hdim 64 forms the causal mask in a pass of its own (BwdSm90::kMaskPass), and early_dv then pays on
# causal too: 0.810 / 0.810 -> 0.870 / 0.891 (non-causal 0.836 / 0.877 -> 0.842 / 0.891).
BWD_SM90_EARLY_DV_TABLE = {(64, False): False, (64, True): True}   # (64, False): its 128-row blocks spill with it
BWD_SM90_EARLY_DV: bool | None = None   # one choice for every dropout-free key (tests); None: the table's
# The consumer warpgroups take turns on dQ and only the one whose turn it is waits for the other's dS
# (BwdSm90Traits.dq_handoff), per (bucket, causal). H100 2026-11-24 (fourteenth session, bf16, 16k tokens, ratio to
# SDPA CUDNN backward at 2k / 8k, table -> handoff): hdim 64 0.892 / 0.893 -> 0.905 / 0.916, causal 0.918 / 0.908 ->
# 0.933 / 0.910 (it already took turns; now without the barrier over both warpgroups); hdim 128 0.916 / 0.936 ->
# 0.808 / 0.802, causal 0.855 / 0.925 -> 0.772 / 0.805 (one warpgroup's 64 x 128 dQ tile instead of a 64 x 64 share
# each: a longer chain per block for it; with early_dv 0.65-0.77).
BWD_SM90_DQ_HANDOFF_TABLE = {(64, False): True, (64, True): True}
BWD_SM90_DQ_HANDOFF: bool | None = None   # one choice for every key (tests, benchmarks); None: the table's
# dQ added from registers by 16-byte reds instead of a shared-memory stage and a bulk reduce (BwdSm90Traits.dq_red),
# per (bucket, causal), dropout-free keys. H100 2026-11-27 (thirty-sixth session, bf16, 16k
# tokens, ab_sm90.py, ratio to SDPA CUDNN backward at 2k / 8k, stage -> dq_red): hdim 64 causal 1.039 / 1.039 -> 1.059 /
# 1.077, 1.044 / 1.041 -> 1.060 / 1.053 (11 rounds) and 1.028 / 1.037 -> 1.066 / 1.060 (15 rounds), three calls; hdim
# 64 1.061 / 1.056 -> 1.023 / 1.022; hdim 128 1.032 / 1.014 -> 0.949 / 0.918, causal 1.017 / 1.037 -> 0.991 / 0.988.
# Where both warpgroups red every block the reds cost more than the stage; the hdim 64 causal kernel (dq_handoff) reds
# one 64 x 64 tile a block and loses the wait for the stage's read-out from its barrier.
BWD_SM90_DQ_RED_TABLE = {(64, True): True}
# With dropout, per (bucket, causal). H200 2026-11-29 (forty-seventh session, bf16, p = 0.1, ab_sm90.py --dropout, 15
# rounds, two calls each, ratio to SDPA CUDNN backward without dropout at 2k / 8k, stage -> dq_red): hdim 64 (dq_handoff)
# 0.741 / 0.746 -> 0.750 / 0.753 and 0.739 / 0.746 -> 0.749 / 0.754, causal 0.784 / 0.797 -> 0.801 / 0.811 and 0.787 /
# 0.797 -> 0.804 / 0.812; hdim 128 causal 0.850 / 0.842 -> 0.872 / 0.848 and 0.858 / 0.839 -> 0.867 / 0.849, but
# non-causal 0.844 / 0.828 -> 0.842 / 0.814 and 0.847 / 0.838 -> 0.839 / 0.823 (stage kept there).
BWD_SM90_DROPOUT_DQ_RED = {(64, False): True, (64, True): True, (128, True): True}
BWD_SM90_DQ_RED: bool | None = None   # one choice for every key (tests, benchmarks); None: the tables'


def bwd_sm90_traits(arch: str, dtype: str, head_dim: int, causal: bool,
                    tiles: tuple[int, int, int] | None = None, lse_smem: bool | None = None,
                    dropout: bool = False, early_dv: bool | None = None,
                    dq_handoff: bool | None = None, dq_red: bool | None = None) -> BwdSm90Traits | None:
    """The Hopper backward for a runtime head dim (Q, K and V alike), or None where there is none (arch without
    wgmma, head dim above 256). `tiles` (block_m, block_n, stages) overrides the table; dropout takes
    BWD_SM90_DROPOUT_TILES where it has the bucket, else the dropout-free choices."""
    if "sm90_wgmma" not in get_arch(arch).mma or not 0 < head_dim <= max(BWD_SM90_BUCKETS):
        return None
    # The smallest bucket that holds the head dim (the tensor maps zero-fill the columns past it).
    bucket = min(b for b in BWD_SM90_BUCKETS if b >= head_dim)
    m, n, stages = tiles or (dropout and BWD_SM90_DROPOUT_TILES.get(bucket)) or BWD_SM90_TILES[(bucket, causal)]
    if lse_smem is None and BWD_SM90_LSE_SMEM is not None:
        lse_smem = BWD_SM90_LSE_SMEM
    elif lse_smem is None:
        # With dropout the keep flags take registers: lse and D through shared memory measured faster everywhere
        # (H100, hdim 128 causal 209/262 -> 251/322 TFLOP/s at 2k/8k; ninth session).
        # At hdim 256 the keep-flag exchange fits only with lse and D in registers.
        lse_smem = True if dropout and bucket <= 128 else BWD_SM90_LSE_SMEM_TABLE[(bucket, causal)]
    if early_dv is None:
        early_dv = not dropout and bucket <= 128 and (BWD_SM90_EARLY_DV if BWD_SM90_EARLY_DV is not None else
                                    BWD_SM90_EARLY_DV_TABLE.get((bucket, causal), False))
    if dq_handoff is None:
        dq_handoff = m == 64 and n == 128 and (BWD_SM90_DQ_HANDOFF if BWD_SM90_DQ_HANDOFF is not None else
                                   BWD_SM90_DQ_HANDOFF_TABLE.get((bucket, causal), False))
    if dq_red is None:
        table = BWD_SM90_DROPOUT_DQ_RED if dropout else BWD_SM90_DQ_RED_TABLE
        dq_red = bucket <= 128 and (BWD_SM90_DQ_RED if BWD_SM90_DQ_RED is not None else
                                    table.get((bucket, causal), False))
    return BwdSm90Traits(arch=arch, dtype=dtype, head_dim=bucket, block_m=m, block_n=n, stages=stages,
                         causal=causal, lse_smem=lse_smem, dropout=dropout, early_dv=early_dv,
                         dq_handoff=dq_handoff, dq_red=dq_red).validate()


# The Hopper split schedule (deterministic=True or backward_impl="split" on sm_90a): the fused kernel without dQ
# (BwdSm90Traits.dq=False) for dK and dV, on the fused table's tiles, except that head dim 256, free of the fp32 dQ
# stages, takes a second Q/dO stage; and a dQ kernel over query blocks (BwdDqSm90Traits): bucket -> (block_m, block_n,
# stages). 64 query rows per consumer warpgroup; block_n as wide as dQ, S and dP in registers allow (dQ alone takes
# head_dim / 2 registers a thread), and head dim 256 one warpgroup (Q and dO of 128 rows would leave no room for K/V).
# H200 2026-11-29 (fifty-second session, bwd_split_ab.py, 7 rounds, ratio to SDPA CUDNN at 2k / 8k / causal 2k /
# causal 8k): hdim 256 block_n 32 -> 48 1.036 / 1.078 / 1.053 / 0.979 -> 1.048 / 1.119 / 1.085 / 1.022; hdim 128 block_n
# 64 / 80 / 96 0.853 / 0.819 / 0.912 / 0.861, 0.855 / 0.857 / 0.914 / 0.865, 0.857 / 0.854 / 0.894 / 0.874 (64 kept:
# the 8k gain sits on a low base reading, 0.838-0.854 in three other calls). With dropout the keys go in whole 32-key
# Philox blocks: BWD_DQ_SM90_DROPOUT_TILES. hdim 64 and 128 take three consumer warpgroups (192 rows at 160 registers);
# fifty-second session, 5 rounds, base -> 192 x 64: hdim 64 0.899 / 0.924 / 0.950 / 0.948 -> 0.925 / 0.940 / 0.946 /
# 0.956, hdim 128 0.868 / 0.815 / 0.890 / 0.873 -> 0.908 / 0.859 / 0.901 / 0.874. hdim 128's dropout kernel spills 8 B
# at 192 rows, so it keeps two warpgroups.
BWD_SM90_SPLIT_DKDV_TILES = {256: (64, 64, 2)}
BWD_DQ_SM90_TILES = {64: (192, 64, 2), 128: (192, 64, 2), 256: (64, 48, 3)}
BWD_DQ_SM90_DROPOUT_TILES = {128: (128, 64, 2), 256: (64, 32, 3)}
# The dQ kernel's next key block's S and dP issued behind this block's dQ GEMM (BwdDqSm90Traits.overlap), per bucket.
# H200 2026-11-29 (fifty-first session, bwd_split_ab.py, bf16, 16k tokens, ratio to SDPA CUDNN at 2k / 8k, serial ->
# overlap, 5 rounds): hdim 64 0.904 / 0.916 -> 0.898 / 0.915, causal 0.916 / 0.924 -> 0.930 / 0.904; hdim 128 0.885 /
# 0.840 -> 0.844 / 0.834, causal 0.926 / 0.883 -> 0.880 / 0.868 (7 rounds: 0.870 / 0.852 -> 0.845 / 0.825, 3 K/V stages
# 0.859 / 0.839); hdim 256 0.999 / 1.036 -> 1.027 / 1.074, causal 0.995 / 0.965 -> 1.035 / 0.973 (one warpgroup at 232
# registers, the overlapped causal kernel spilling 40 B); at 256 registers, spill-free: 1.004 / 1.029 -> 1.029 / 1.076,
# causal 0.980 / 0.961 -> 1.029 / 0.986.
BWD_DQ_SM90_OVERLAP_TABLE = {256: True}
BWD_DQ_SM90_OVERLAP: bool | None = None   # one choice for every bucket (tests, benchmarks); None: the table's


def bwd_sm90_split_traits(arch: str, dtype: str, head_dim: int, causal: bool, dropout: bool = False,
                          dq_tiles: tuple[int, int, int] | None = None) -> tuple | None:
    """(dK / dV kernel, dQ kernel) of the Hopper split schedule for a runtime head dim, or None where there is none
    (arch without wgmma, head dim above 256). With dropout, dK / dV take the fused kernel's dropout choices."""
    fused = bwd_sm90_traits(arch, dtype, head_dim, causal, dropout=dropout)
    if fused is None:
        return None
    tiles = BWD_SM90_SPLIT_DKDV_TILES.get(fused.head_dim)
    dkdv = replace(fused, dq=False, early_dv=False, dq_handoff=False, dq_red=False,
                   **(dict(zip(("block_m", "block_n", "stages"), tiles)) if tiles else {})).validate()
    m, n, stages = dq_tiles or (dropout and BWD_DQ_SM90_DROPOUT_TILES.get(fused.head_dim)) or \
        BWD_DQ_SM90_TILES[fused.head_dim]
    dq = BwdDqSm90Traits(arch=arch, dtype=dtype, head_dim=fused.head_dim, block_m=m, block_n=n, stages=stages,
                         causal=causal, overlap=BWD_DQ_SM90_OVERLAP_TABLE.get(fused.head_dim, False)
                         if BWD_DQ_SM90_OVERLAP is None else BWD_DQ_SM90_OVERLAP, dropout=dropout).validate()
    return dkdv, dq


BWD_KINDS = ("pre", "dkdv_atomic", "dkdv", "dq")   # fused schedule: pre + dkdv_atomic; split: pre + dkdv + dq
BWD_SCHEDULES = ("fused", "split")


def bwd_traits(arch: str, dtype: str, head_dim: int, causal: bool, kind: str,
               tiles: tuple[int, int, int] | None = None, dropout: bool = False, head_dim_v: int | None = None):
    """Traits of one backward kernel for a call with runtime head dims `head_dim` (Q, K) and `head_dim_v` (V, dO;
    default the same); `tiles` (block_m, block_n, stages) overrides the candidate list, e.g. from a tuning run."""
    bucket, bucket_v, even_k = head_dim_buckets(head_dim, head_dim_v)
    if kind == "pre":   # rowsum(dO * O): rows of head_dim_v
        return BwdPreTraits(arch=arch, dtype=dtype, head_dim=bucket_v).validate()
    if kind not in BWD_KINDS:
        raise ValueError(f"unknown backward kernel kind {kind!r}; known: {BWD_KINDS}")
    errors = []
    for m, n, stages in ([tuple(tiles)] if tiles else _bwd_candidates(max(bucket, bucket_v))):
        common = dict(arch=arch, dtype=dtype, head_dim=bucket, head_dim_v=bucket_v, block_m=m, block_n=n, num_warps=8, stages=stages,
                      causal=causal, even_k=even_k, dropout=dropout)
        t = BwdDqTraits(**common) if kind == "dq" else BwdDkdvTraits(**common, atomic_dq=(kind == "dkdv_atomic"))
        try:
            return t.validate()
        except TraitsError as e:
            errors.append(str(e))
    raise TraitsError(f"no backward tiles for head dim {head_dim} fit {arch}: " + "; ".join(errors))


def bwd_tile_candidates(arch: str, dtype: str, head_dim: int, causal: bool,
                        schedule: str) -> list[tuple[int, int, int]]:
    """Backward tiles worth timing for one schedule (`flashgen tune`), used by all its kernels: those of the head
    dim's BWD_TILE_CANDIDATES list and of its neighbours that fit. One stage only where two do not fit: the 8-warp
    blocks run one per SM at ~255 registers, so the smaller shared memory buys no occupancy (H100: 2 stages
    15-20% faster)."""
    lists = list(BWD_TILE_CANDIDATES.values())
    i = next(j for j, cands in enumerate(lists) if cands is _bwd_candidates(bucket_for_head_dim(head_dim)))

    def fits(tiles):
        try:
            for kind in bwd_kinds(schedule)[1:]:
                bwd_traits(arch, dtype, head_dim, causal, kind, tiles)
            return True
        except TraitsError:
            return False
    out = []
    for m, n, stages in (t for cands in lists[max(0, i - 1):i + 2] for t in cands):
        if (m, n, stages) not in out and fits((m, n, stages)) and (stages > 1 or not fits((m, n, 2))):
            out.append((m, n, stages))
    return out


def bwd_kinds(schedule: str) -> tuple[str, ...]:
    """The kernels one backward schedule launches."""
    return ("pre", "dkdv_atomic") if schedule == "fused" else ("pre", "dkdv", "dq")


def bwd_schedule(backward_impl: str, deterministic: bool, batch_heads: int, seqlen_q: int, seqlen_k: int,
                 tuned: str | None = None, head_dim: int = 0) -> str:
    """"fused" (one sequence-parallel dK/dV kernel adding dQ with fp32 atomics) or "split" (separate dQ kernel,
    no atomics, bitwise deterministic). `tuned`: the schedule a tuning file measured fastest for this call's key;
    it only replaces the "auto" rule (an explicit choice or deterministic=True is the caller's). `head_dim`: the
    wider of the call's head dims."""
    if backward_impl not in ("auto",) + BWD_SCHEDULES:
        raise ValueError(f"backward_impl must be 'auto', 'fused' or 'split', got {backward_impl!r}")
    if head_dim > FUSED_MAX_HDIM:
        if backward_impl == "fused":
            raise ValueError(f"backward_impl='fused' supports head dims up to {FUSED_MAX_HDIM}, got {head_dim}; "
                             f"use 'auto' or 'split'")
        return "split"
    if deterministic:
        return "split"
    if backward_impl != "auto":
        return backward_impl
    if tuned in BWD_SCHEDULES:
        return tuned
    # H100 2026-11-23: fused beats split on every measured shape, by 1.1-1.5x (16k tokens, hdim 64/128/256,
    # seqlen 1k-16k) and down to batch 1 x 1 head (hdim 128, seqlen 8k: 152 vs 138 TFLOP/s; 32k: 314 vs 221).
    # The split schedule recomputes S and dP for dQ, 7 GEMMs against 5; it is the deterministic choice.
    return "fused"


def default_set(arch: str, dtypes=("fp16", "bf16"), head_dims=HDIM_BUCKETS, families=("fwd", "bwd"),
                dropout=(False,)) -> list:
    """Every kernel the dispatcher can pick for the given head dims (a head dim that is not a bucket
    adds its padded variant; a (head_dim, head_dim_v) pair adds the kernels for V/O of another width; sm_90a adds
    the Hopper forwards and backwards). Backward kernels whose tiles do not fit the arch are left out (the runtime
    says so when asked for them). Dropout kernels (dropout=(False, True)) double the set, so they are only
    built on request (`flashgen generate --dropout`) and otherwise compile on first use."""
    out = []
    for dtype in dtypes:
        for dims in head_dims:
            hd, hdv = dims if isinstance(dims, tuple) else (dims, None)
            for causal in (False, True):
                for drop in dropout:
                    if "fwd" in families:
                        out.append(fwd_traits(arch, dtype, hd, causal, dropout=drop, head_dim_v=hdv))
                        # sm_90a: the Hopper forward runs what it supports, as a grid and (short seqlens,
                        # fwd_sm90_persistent) as a persistent walk, with the tiles of each seqlen bucket; the SM80
                        # one stays for the rest.
                        for seqlen in () if hdv else (0,) + SEQLEN_BUCKETS:   # walk and FWD_SM90_SHAPE_TILES
                            sm90 = fwd_sm90_traits(arch, dtype, hd, causal, dropout=drop, seqlen=seqlen)
                            if sm90 is not None:
                                out.append(sm90)
                    if "bwd" in families:
                        # sm_90a: the Hopper backward runs the fused schedule where it applies.
                        sm90 = None if drop or hdv else bwd_sm90_traits(arch, dtype, hd, causal)
                        if sm90 is not None:
                            out.append(sm90)
                            out += bwd_sm90_split_traits(arch, dtype, hd, causal)   # and the split schedule
                        # The split schedule's kernels (all or none), and the fused one where it fits (head dims
                        # up to FUSED_MAX_HDIM).
                        for kinds in (("pre", "dkdv", "dq"), ("dkdv_atomic",)):
                            try:
                                out += [bwd_traits(arch, dtype, hd, causal, kind, dropout=drop, head_dim_v=hdv)
                                        for kind in kinds]
                            except TraitsError:
                                if "pre" in kinds:
                                    break
    if True in dropout:
        out.append(dropout_mask_traits(arch))
    seen, uniq = set(), []
    for t in out:
        if t.name not in seen:
            seen.add(t.name)
            uniq.append(t)
    return uniq


def explain(arch: str, dtype: str, head_dim: int, causal: bool, batch: int = 1, nheads: int = 1,
            seqlen_q: int = 1, seqlen_k: int = 1, backward_impl: str = "auto", deterministic: bool = False,
            tuned=None, head_dim_v: int | None = None) -> list[str]:
    """What the dispatcher runs for one call and why, one line each (`flashgen explain`). `tuned`: the tuning-file
    entry for the call's key (flashgen.tuning.Entry: .fwd, .bwd_schedule, .bwd_tiles, .origin), which the
    dispatcher prefers over the tables."""
    info = get_arch(arch)
    bucket, bucket_v, even_k = head_dim_buckets(head_dim, head_dim_v)
    wide = max(bucket, bucket_v)   # the tile tables are keyed by the wider bucket
    big = info.smem_per_block >= 160 * 1024
    lines = [f"arch {arch}: {info.description}; {info.smem_per_block // 1024} KB shared memory per block "
             f"({'large' if big else 'small'}-memory tile tables)",
             f"head dim {head_dim} -> bucket {bucket}" + ("" if head_dim == bucket else
                                                         f" (padded: columns >= {head_dim} masked, even_k=False)")]
    if head_dim_v not in (None, head_dim):
        lines.append(f"head dim of v {head_dim_v} -> bucket {bucket_v} (V and O; Q and K keep {bucket})")
    if tuned is not None and tuned.fwd:
        fwd = fwd_traits(arch, dtype, head_dim, causal, tuned.fwd, head_dim_v=head_dim_v)
        source = f"tuning file {tuned.origin}"
    else:
        fwd = fwd_traits(arch, dtype, head_dim, causal, head_dim_v=head_dim_v)
        source = ("FWD_TILES_BIG_CAUSAL" if big and causal and wide in FWD_TILES_BIG_CAUSAL
                  else "FWD_TILES_BIG" if big else "FWD_TILES_SMALL") + f"[{wide}]"
    m_blocks = -(-seqlen_q // fwd.block_m)
    lines += [f"forward: {fwd.name}",
              f"  tiles block_m={fwd.block_m} block_n={fwd.block_n} warps={fwd.num_warps} from {source}; "
              f"{fwd.smem_bytes() // 1024} KB shared memory" + (f"; {fwd.groups} column groups of O" if fwd.groups > 1
                                                                else ""),
              f"  grid ({m_blocks}, {nheads}, {batch}) = {m_blocks * nheads * batch} blocks of {fwd.num_threads} threads"]
    tuned_schedule = tuned.bwd_schedule if tuned is not None else None
    widest = max(head_dim, head_dim_v or 0)
    schedule = bwd_schedule(backward_impl, deterministic, batch * nheads, seqlen_q, seqlen_k, tuned_schedule,
                            head_dim=widest)
    why = (f"head dim {widest} > {FUSED_MAX_HDIM}: split only" if widest > FUSED_MAX_HDIM
           else "deterministic=True" if deterministic else f"backward_impl={backward_impl!r}"
           if backward_impl != "auto" else f"auto: measured fastest, tuning file {tuned.origin}" if tuned_schedule
           else "auto: fused measured faster on every shape (H100)")
    lines.append(f"backward schedule: {schedule} ({why})")
    for kind in bwd_kinds(schedule):
        tiles = tuned.bwd_tiles.get(kind) if tuned is not None and kind != "pre" else None
        try:
            t = bwd_traits(arch, dtype, head_dim, causal, kind, tiles, head_dim_v=head_dim_v)
        except TraitsError as e:
            lines.append(f"  {kind}: none fits ({e})")
            continue
        if kind == "pre":
            lines.append(f"  {t.name}: {t.rows_per_block} rows per block")
            continue
        if tiles:
            lines.append(f"  {t.name}: tiles {tiles} from tuning file {tuned.origin}; "
                         f"{t.smem_bytes() // 1024} KB shared memory")
            continue
        cands = _bwd_candidates(wide)
        skipped = cands[:cands.index((t.block_m, t.block_n, t.stages))]
        note = f"; skipped {skipped} (shared memory)" if skipped else ""
        lines.append(f"  {t.name}: tiles {(t.block_m, t.block_n, t.stages)} = first fitting candidate of "
                     f"BWD_TILE_CANDIDATES{note}; {t.smem_bytes() // 1024} KB shared memory")
    return lines
