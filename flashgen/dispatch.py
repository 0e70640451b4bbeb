"""Runtime dispatch: (device, dtype, head dim, causal) -> loaded kernel. The decisions live in
codegen/heuristics.py; this module only maps a device to its arch and memoizes."""
from __future__ import annotations

from functools import lru_cache

from codegen import heuristics
from codegen.arch import arch_for_capability
from codegen.traits import bucket_for_head_dim

from .loader import Kernel, get_kernel

DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}


@lru_cache(maxsize=None)
def device_arch(device_index: int) -> str:
    import torch
    major, minor = torch.cuda.get_device_capability(device_index)
    return arch_for_capability(major, minor).name


# (dtype, head-dim bucket, causal) -> (block_m, block_n, num_warps), preferred over the heuristic table.
_fwd_tile_overrides: dict[tuple[str, int, bool], tuple[int, int, int]] = {}


def set_fwd_tiles(dtype: str, bucket: int, causal: bool, tiles: tuple[int, int, int] | None) -> None:
    """Override (or with None restore) the forward tiles for one dispatch key."""
    if tiles is None:
        _fwd_tile_overrides.pop((dtype, bucket, causal), None)
    else:
        _fwd_tile_overrides[(dtype, bucket, causal)] = tuple(tiles)
    _fwd_kernel.cache_clear()


@lru_cache(maxsize=None)
def _fwd_kernel(arch: str, dtype: str, head_dim: int, causal: bool, dropout: bool) -> Kernel:
    tiles = _fwd_tile_overrides.get((dtype, bucket_for_head_dim(head_dim), causal))
    return get_kernel(heuristics.fwd_traits(arch, dtype, head_dim, causal, tiles, dropout=dropout))


def fwd_kernel(device_index: int, dtype, head_dim: int, causal: bool, dropout: bool = False) -> Kernel:
    return _fwd_kernel(device_arch(device_index), DTYPE_NAMES[str(dtype)], head_dim, causal, dropout)


@lru_cache(maxsize=None)
def dropout_mask_kernel(device_index: int) -> Kernel:
    return get_kernel(heuristics.dropout_mask_traits(device_arch(device_index)))


# (dtype, head-dim bucket, causal, kind) -> (block_m, block_n, stages), preferred over the candidate list.
_bwd_tile_overrides: dict[tuple[str, int, bool, str], tuple[int, int, int]] = {}


def set_bwd_tiles(dtype: str, bucket: int, causal: bool, kind: str, tiles: tuple[int, int, int] | None) -> None:
    """Override (or with None restore) the backward tiles of one kernel kind ("dkdv_atomic", "dkdv", "dq")."""
    if tiles is None:
        _bwd_tile_overrides.pop((dtype, bucket, causal, kind), None)
    else:
        _bwd_tile_overrides[(dtype, bucket, causal, kind)] = tuple(tiles)
    _bwd_kernel.cache_clear()


@lru_cache(maxsize=None)
def _bwd_kernel(arch: str, dtype: str, head_dim: int, causal: bool, kind: str, dropout: bool) -> Kernel:
    tiles = _bwd_tile_overrides.get((dtype, bucket_for_head_dim(head_dim), causal, kind))
    return get_kernel(heuristics.bwd_traits(arch, dtype, head_dim, causal, kind, tiles, dropout=dropout))


def bwd_kernel(device_index: int, dtype, head_dim: int, causal: bool, kind: str, dropout: bool = False) -> Kernel:
    """kind: "pre", "dkdv_atomic" (fused schedule), "dkdv" or "dq" (split schedule)."""
    return _bwd_kernel(device_arch(device_index), DTYPE_NAMES[str(dtype)], head_dim, causal, kind, dropout)
