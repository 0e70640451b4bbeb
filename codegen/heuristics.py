"""The dispatch table: which traits run a problem. Readable data, used by both `flashgen generate`
(the default set is exactly what this table can pick) and the runtime dispatcher.

Forward tiles (block_m, block_n, num_warps) per head-dim bucket. Origin: the tile choices of
flash-attn 2's forward launch templates for A100/H100 (large shared memory) and for sm86/sm89
(~100 KB per block), re-checked against our own shared-memory and register limits in traits.py.
H100 measurements that move an entry are recorded in docs/NOTES.md and benchmarks/RESULTS.md.
"""
from __future__ import annotations

from .arch import get_arch
from .traits import HDIM_BUCKETS, FwdTraits, bucket_for_head_dim

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
}
# Causal entries that differ (measured on the H100, bf16, 2k/8k, 2026-11-23).
FWD_TILES_BIG_CAUSAL = {
    128: (128, 32, 4),    # 280/308 vs 268/301 for 128x64
}
FWD_TILES_SMALL = {
    **FWD_TILES_BIG,
    128: (128, 32, 4),    # two blocks per SM fit in 100 KB
    224: (64, 64, 4),
    256: (64, 64, 4),
}


def fwd_tiles(arch: str, head_dim_bucket: int, causal: bool) -> tuple[int, int, int]:
    if get_arch(arch).smem_per_block >= 160 * 1024:
        if causal and head_dim_bucket in FWD_TILES_BIG_CAUSAL:
            return FWD_TILES_BIG_CAUSAL[head_dim_bucket]
        return FWD_TILES_BIG[head_dim_bucket]
    return FWD_TILES_SMALL[head_dim_bucket]


def fwd_traits(arch: str, dtype: str, head_dim: int, causal: bool,
               tiles: tuple[int, int, int] | None = None) -> FwdTraits:
    """Traits for a forward call with runtime head dim `head_dim` (any multiple of 8 up to 256);
    `tiles` (block_m, block_n, num_warps) overrides the table, e.g. from a tuning run."""
    bucket = bucket_for_head_dim(head_dim)
    m, n, w = tiles or fwd_tiles(arch, bucket, causal)
    return FwdTraits(arch=arch, dtype=dtype, head_dim=bucket, block_m=m, block_n=n, num_warps=w,
                     causal=causal, even_k=(head_dim == bucket)).validate()


def default_set(arch: str, dtypes=("fp16", "bf16"), head_dims=HDIM_BUCKETS) -> list:
    """Every kernel the dispatcher can pick for the given head dims (a head dim that is not a bucket
    adds its padded variant)."""
    out = []
    for dtype in dtypes:
        for hd in head_dims:
            for causal in (False, True):
                out.append(fwd_traits(arch, dtype, hd, causal))
    seen, uniq = set(), []
    for t in out:
        if t.name not in seen:
            seen.add(t.name)
            uniq.append(t)
    return uniq
