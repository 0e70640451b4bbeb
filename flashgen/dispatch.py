"""Runtime dispatch: (device, dtype, head dim, causal, seqlens) -> loaded kernel.

Order of preference for the tiles: set_fwd_tiles / set_fwd_sm90 / set_bwd_tiles overrides (benchmarks, the
tuner), then the device's tuning file entry for the call's key (flashgen/tuning.py), then the heuristic tables
(codegen/heuristics.py). The decisions (fwd_traits, bwd_traits, schedule) are pure functions of arch + GPU name,
testable without a GPU; fwd_kernel / bwd_kernel map a device to them, load the kernel and memoize.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache

from codegen import heuristics
from codegen.arch import arch_for_capability
from codegen.traits import FwdTraits, KernelTraits, TraitsError, bucket_for_head_dim

from . import tuning
from .loader import Kernel, get_kernel

DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16"}


@lru_cache(maxsize=None)
def device_arch(device_index: int) -> str:
    import torch
    major, minor = torch.cuda.get_device_capability(device_index)
    return arch_for_capability(major, minor).name


@lru_cache(maxsize=None)
def device_name(device_index: int) -> str:
    """The name tuning files are keyed by, e.g. "NVIDIA H100 80GB HBM3"."""
    import torch
    return torch.cuda.get_device_name(device_index)


# (dtype, head-dim bucket, causal) -> (block_m, block_n, num_warps), preferred over tuning files and the table.
_fwd_tile_overrides: dict[tuple[str, int, bool], tuple[int, int, int]] = {}
# (dtype, head-dim bucket, causal) -> (block_m, block_n, mainloop[, stages]) of the Hopper forward, likewise.
_fwd_sm90_overrides: dict[tuple[str, int, bool], tuple] = {}
# (dtype, head-dim bucket, causal, kind) -> (block_m, block_n, stages), likewise.
_bwd_tile_overrides: dict[tuple[str, int, bool, str], tuple[int, int, int]] = {}


def set_fwd_tiles(dtype: str, bucket: int, causal: bool, tiles: tuple[int, int, int] | None) -> None:
    """Override (or with None restore) the forward tiles for one dispatch key."""
    if tiles is None:
        _fwd_tile_overrides.pop((dtype, bucket, causal), None)
    else:
        _fwd_tile_overrides[(dtype, bucket, causal)] = tuple(tiles)
    _fwd_kernel.cache_clear()


def set_fwd_sm90(dtype: str, bucket: int, causal: bool, choice: tuple | None) -> None:
    """Override (or with None restore) the Hopper forward's (block_m, block_n, mainloop[, stages]) for one dispatch
    key."""
    if choice is None:
        _fwd_sm90_overrides.pop((dtype, bucket, causal), None)
    else:
        _fwd_sm90_overrides[(dtype, bucket, causal)] = tuple(choice)
    _fwd_kernel.cache_clear()


def set_bwd_tiles(dtype: str, bucket: int, causal: bool, kind: str, tiles: tuple[int, int, int] | None) -> None:
    """Override (or with None restore) the backward tiles of one kernel kind ("dkdv_atomic", "dkdv", "dq")."""
    if tiles is None:
        _bwd_tile_overrides.pop((dtype, bucket, causal, kind), None)
    else:
        _bwd_tile_overrides[(dtype, bucket, causal, kind)] = tuple(tiles)
    _bwd_kernel.cache_clear()


def reload_tuning() -> None:
    """Re-read tuning files (after `flashgen tune` wrote one in this process)."""
    tuning.reload()
    _fwd_kernel.cache_clear()
    _bwd_kernel.cache_clear()


# ---- decisions (no GPU needed) ----

def _tuned(arch, gpu, dtype, head_dim, head_dim_v, causal, seqlen_q, seqlen_k):
    """The tuning entry for a call; tuning measures one head dim, so calls whose V is another bucket get none."""
    if head_dim_v is not None and bucket_for_head_dim(head_dim_v) != bucket_for_head_dim(head_dim):
        return None
    return tuning.lookup(gpu, arch, dtype, head_dim, causal, seqlen_q, seqlen_k)


def hopper_enabled() -> bool:
    """The Hopper (sm_90a) forward runs the calls it supports on compute capability 9.0 unless FLASHGEN_HOPPER=0
    (then the SM80 path runs them, as on every other GPU)."""
    return os.environ.get("FLASHGEN_HOPPER", "1") != "0"


@contextmanager
def _env_switch(name: str, enabled: bool):
    """Environment variable `name` set to "1" / "0" for the body, then restored (or removed)."""
    old = os.environ.get(name)
    os.environ[name] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def hopper_forward(enabled: bool):
    """FLASHGEN_HOPPER set for the body (the tuner and benchmarks time one forward path at a time), then restored.
    Kernel lookups are memoized per setting, so nothing needs clearing."""
    return _env_switch("FLASHGEN_HOPPER", enabled)


def hopper_backward_enabled() -> bool:
    """The Hopper (sm_90a) backward runs the fused schedule's calls it supports on compute capability 9.0 unless
    FLASHGEN_HOPPER_BWD=0 (then the SM80 kernels run them, as on every other GPU)."""
    return os.environ.get("FLASHGEN_HOPPER_BWD", "1") != "0"


def hopper_backward(enabled: bool):
    """FLASHGEN_HOPPER_BWD set for the body (benchmarks time the SM80 and Hopper backward side by side), then
    restored."""
    return _env_switch("FLASHGEN_HOPPER_BWD", enabled)


def fwd_sm90_traits(arch: str, dtype: str, head_dim: int, causal: bool, entry=None, dropout: bool = False,
                    seqlen: int = 0) -> tuple:
    """The Hopper forward for a call and where its (block_m, block_n, mainloop) came from: an override, else the
    tuning entry's (tuned without dropout: not for dropout), else the tables (the shape's, else the bucket's).
    (None, ...) where the arch or head dim has no Hopper forward. The walk (grid or persistent) follows the seqlen
    bucket `seqlen` (0: unknown)."""
    key = (dtype, bucket_for_head_dim(head_dim), causal)
    tuned = (entry.fwd_sm90, f"tuning file {entry.origin}") if entry is not None and not dropout else (None, "")
    for choice, source in ((_fwd_sm90_overrides.get(key), "an override (dispatch.set_fwd_sm90)"), tuned):
        if choice is not None:
            try:
                return heuristics.fwd_sm90_traits(arch, dtype, head_dim, causal, *choice, dropout=dropout,
                                                  seqlen=seqlen), source
            except TraitsError:
                pass   # tuned without dropout, or for a head dim of the bucket whose traits fit: the next source
    shaped = heuristics.fwd_sm90_shape_choice(head_dim, causal, seqlen, dropout) is not None
    return (heuristics.fwd_sm90_traits(arch, dtype, head_dim, causal, dropout=dropout, seqlen=seqlen),
            "heuristics.FWD_SM90_SHAPE_TILES" if shaped else "heuristics.FWD_SM90_TILES")


def fwd_traits(arch: str, gpu: str | None, dtype: str, head_dim: int, causal: bool, dropout: bool = False,
               seqlen_q: int = 0, seqlen_k: int = 0, head_dim_v: int | None = None,
               hopper: bool = False) -> KernelTraits:
    """The forward kernel for a call on GPU `gpu` (its name; None: no tuning file) of arch `arch`. `hopper`: take
    the Hopper kernel where one exists (one head dim for Q/K and V) and the sequences are not short for it
    (heuristics.FWD_SM90_SHORT_SEQLEN; seqlens 0: unknown); the caller checks the tensors suit TMA."""
    entry = _tuned(arch, gpu, dtype, head_dim, head_dim_v, causal, seqlen_q, seqlen_k)
    # Short sequences (a known seqlen, as a bucket) keep the SM80 forward where it measured faster.
    short_max = heuristics.FWD_SM90_SHORT_SEQLEN.get(heuristics.sm90_bucket(head_dim), 0)
    short = 0 < max(seqlen_q, seqlen_k) <= short_max
    if hopper and head_dim_v in (None, head_dim) and not short:
        t = fwd_sm90_traits(arch, dtype, head_dim, causal, entry, dropout, max(seqlen_q, seqlen_k))[0]
        if t is not None:
            return t
    kw = dict(dropout=dropout, head_dim_v=head_dim_v)
    override = _fwd_tile_overrides.get((dtype, bucket_for_head_dim(head_dim), causal))
    if override:
        return heuristics.fwd_traits(arch, dtype, head_dim, causal, override, **kw)
    if entry is not None and entry.fwd:
        try:
            return heuristics.fwd_traits(arch, dtype, head_dim, causal, entry.fwd, **kw)
        except TraitsError:
            pass   # tuned without dropout; e.g. block_n = 16 cannot hold the 32-column mask blocks
    return heuristics.fwd_traits(arch, dtype, head_dim, causal, **kw)


def bwd_traits(arch: str, gpu: str | None, dtype: str, head_dim: int, causal: bool, kind: str,
               dropout: bool = False, seqlen_q: int = 0, seqlen_k: int = 0,
               head_dim_v: int | None = None) -> KernelTraits:
    """One backward kernel ("pre", "dkdv_atomic", "dkdv", "dq") for a call, as fwd_traits decides the forward."""
    kw = dict(dropout=dropout, head_dim_v=head_dim_v)
    if kind != "pre":
        override = _bwd_tile_overrides.get((dtype, bucket_for_head_dim(head_dim), causal, kind))
        if override:
            return heuristics.bwd_traits(arch, dtype, head_dim, causal, kind, override, **kw)
        entry = _tuned(arch, gpu, dtype, head_dim, head_dim_v, causal, seqlen_q, seqlen_k)
        if entry is not None and kind in entry.bwd_tiles:
            try:
                return heuristics.bwd_traits(arch, dtype, head_dim, causal, kind, entry.bwd_tiles[kind], **kw)
            except TraitsError:
                pass   # the dropout variant does not fit those tiles
    return heuristics.bwd_traits(arch, dtype, head_dim, causal, kind, **kw)


def schedule(arch: str, gpu: str | None, dtype: str, head_dim: int, causal: bool, backward_impl: str,
             deterministic: bool, batch_heads: int, seqlen_q: int, seqlen_k: int,
             head_dim_v: int | None = None) -> str:
    """The backward schedule: a tuning file's measured winner replaces only the "auto" rule."""
    entry = (_tuned(arch, gpu, dtype, head_dim, head_dim_v, causal, seqlen_q, seqlen_k)
             if backward_impl == "auto" and not deterministic else None)
    return heuristics.bwd_schedule(backward_impl, deterministic, batch_heads, seqlen_q, seqlen_k,
                                   tuned=entry.bwd_schedule if entry is not None else None,
                                   head_dim=max(head_dim, head_dim_v or 0))


def explain(arch: str, gpu: str | None, dtype: str, head_dim: int, causal: bool, batch: int = 1, nheads: int = 1,
            seqlen_q: int = 1, seqlen_k: int = 1, backward_impl: str = "auto",
            deterministic: bool = False, head_dim_v: int | None = None) -> list[str]:
    """heuristics.explain with the tuning file of GPU `gpu` taken into account, and a line saying which file."""
    bucket = tuning.seqlen_bucket(seqlen_q, seqlen_k)
    key = f"{dtype} hdim {bucket_for_head_dim(head_dim)} {'causal' if causal else 'non-causal'} seqlen bucket {bucket}"
    table = tuning.table(gpu, arch) if gpu else None
    entry = _tuned(arch, gpu, dtype, head_dim, head_dim_v, causal, seqlen_q, seqlen_k)
    if not gpu:
        line = "tuning: no GPU (give --gpu NAME for its tuning file); heuristic tables"
    elif table is None:
        line = (f"tuning: no usable tuning file for {gpu!r} ({tuning.user_file(gpu)} or "
                f"{tuning.shipped_file(gpu)}); heuristic tables")
    elif entry is None:
        line = f"tuning: {table.path} has no entry for {key}; heuristic tables"
    else:
        line = f"tuning: {table.path} entry for {key}"
    lines = [line] + heuristics.explain(arch, dtype, head_dim, causal, batch, nheads, seqlen_q, seqlen_k,
                                        backward_impl, deterministic, tuned=entry, head_dim_v=head_dim_v)
    hopper, source = (fwd_sm90_traits(arch, dtype, head_dim, causal, entry, seqlen=bucket)
                      if head_dim_v in (None, head_dim) else (None, None))
    if hopper is not None:
        walk = ("a persistent walk (heuristics.FWD_SM90_PERSISTENT_SEQLEN)" if hopper.persistent
                else "a grid of tiles")
        about = (f"  Hopper path: block_m={hopper.block_m} block_n={hopper.block_n} stages={hopper.stages}, "
                 f"{heuristics.sm90_mainloop(hopper)} mainloop from {source}, {walk}; "
                 f"{hopper.smem_bytes() // 1024} KB shared memory")
        i = next(i for i, line in enumerate(lines) if line.startswith("forward: "))
        if hopper_enabled():
            lines[i] = "forward for q/k/v that TMA cannot describe: " + lines[i][len("forward: "):]
            lines[i:i] = [f"forward: {hopper.name}", about]
        else:
            lines.append(f"hopper forward: {hopper.name}, off (FLASHGEN_HOPPER=0)")
    bwd = heuristics.bwd_sm90_traits(arch, dtype, head_dim, causal) if head_dim_v in (None, head_dim) else None
    if bwd is not None:
        where = ("runs the fused schedule (dropout too), where TMA can describe q/k/v/dout"
                 if hopper_backward_enabled() else "off (FLASHGEN_HOPPER_BWD=0)")
        lines.append(f"hopper backward: {bwd.name} (block_m={bwd.block_m} block_n={bwd.block_n} "
                     f"stages={bwd.stages} from heuristics.BWD_SM90_TILES; {bwd.smem_bytes() // 1024} KB shared "
                     f"memory), {where}")
        dkdv, dq = heuristics.bwd_sm90_split_traits(arch, dtype, head_dim, causal)
        lines.append(f"hopper split backward: {dkdv.name} + {dq.name} (heuristics.BWD_DQ_SM90_TILES), "
                     + ("the split schedule's calls (dropout too), where TMA can describe q/k/v/dout"
                        if hopper_backward_enabled() else "off (FLASHGEN_HOPPER_BWD=0)"))
    return lines


# ---- loading (memoized per seqlen bucket, not per seqlen) ----

@lru_cache(maxsize=None)
def _fwd_kernel(arch: str, gpu: str, dtype: str, head_dim: int, causal: bool, dropout: bool, seqlen_bucket: int,
                head_dim_v: int | None, hopper: bool) -> Kernel:
    return get_kernel(fwd_traits(arch, gpu, dtype, head_dim, causal, dropout, seqlen_bucket, seqlen_bucket,
                                 head_dim_v, hopper))


def fwd_kernel(device_index: int, dtype, head_dim: int, causal: bool, dropout: bool = False, seqlen_q: int = 0,
               seqlen_k: int = 0, head_dim_v: int | None = None, tma_ok: bool = False) -> Kernel:
    """tma_ok: the call's q, k, v suit TMA tensor maps (flashgen/tma.py), so the Hopper kernel may run it."""
    return _fwd_kernel(device_arch(device_index), device_name(device_index), DTYPE_NAMES[str(dtype)], head_dim,
                       causal, dropout, tuning.seqlen_bucket(seqlen_q, seqlen_k), head_dim_v,
                       tma_ok and hopper_enabled())


@lru_cache(maxsize=None)
def dropout_mask_kernel(device_index: int) -> Kernel:
    return get_kernel(heuristics.dropout_mask_traits(device_arch(device_index)))


@lru_cache(maxsize=None)
def _bwd_kernel(arch: str, gpu: str, dtype: str, head_dim: int, causal: bool, kind: str, dropout: bool,
                seqlen_bucket: int, head_dim_v: int | None) -> Kernel:
    return get_kernel(bwd_traits(arch, gpu, dtype, head_dim, causal, kind, dropout, seqlen_bucket, seqlen_bucket,
                                 head_dim_v))


def bwd_kernel(device_index: int, dtype, head_dim: int, causal: bool, kind: str, dropout: bool = False,
               seqlen_q: int = 0, seqlen_k: int = 0, head_dim_v: int | None = None) -> Kernel:
    """kind: "pre", "dkdv_atomic" (fused schedule), "dkdv" or "dq" (split schedule)."""
    return _bwd_kernel(device_arch(device_index), device_name(device_index), DTYPE_NAMES[str(dtype)], head_dim,
                       causal, kind, dropout, tuning.seqlen_bucket(seqlen_q, seqlen_k), head_dim_v)


@lru_cache(maxsize=None)
def _bwd_sm90_kernel(arch: str, dtype: str, head_dim: int, causal: bool, dropout: bool = False) -> Kernel | None:
    t = heuristics.bwd_sm90_traits(arch, dtype, head_dim, causal, dropout=dropout)
    return get_kernel(t) if t is not None else None


def bwd_sm90_kernel(device_index: int, dtype, head_dim: int, causal: bool, dropout: bool = False,
                    head_dim_v: int | None = None, tma_ok: bool = False) -> Kernel | None:
    """The Hopper backward kernel for a fused-schedule call, or None where the SM80 kernels run it: Hopper backward
    off, head_dim_v != head_dim, a head dim or arch without one, or tensors TMA cannot describe (tma_ok)."""
    if not (tma_ok and hopper_backward_enabled()) or head_dim_v not in (None, head_dim):
        return None
    return _bwd_sm90_kernel(device_arch(device_index), DTYPE_NAMES[str(dtype)], head_dim, causal, dropout)


@lru_cache(maxsize=None)
def _bwd_sm90_split_kernels(arch: str, dtype: str, head_dim: int, causal: bool, dropout: bool) -> tuple | None:
    traits = heuristics.bwd_sm90_split_traits(arch, dtype, head_dim, causal, dropout)
    return tuple(get_kernel(t) for t in traits) if traits is not None else None


def bwd_sm90_split_kernels(device_index: int, dtype, head_dim: int, causal: bool, dropout: bool = False,
                           head_dim_v: int | None = None, tma_ok: bool = False) -> tuple | None:
    """(dK / dV kernel, dQ kernel) of the Hopper split schedule for a call, or None where the SM80 split kernels run
    it: as bwd_sm90_kernel."""
    if not (tma_ok and hopper_backward_enabled()) or head_dim_v not in (None, head_dim):
        return None
    return _bwd_sm90_split_kernels(device_arch(device_index), DTYPE_NAMES[str(dtype)], head_dim, causal, dropout)


def bwd_schedule(device_index: int, dtype, head_dim: int, causal: bool, backward_impl: str, deterministic: bool,
                 batch_heads: int, seqlen_q: int, seqlen_k: int, head_dim_v: int | None = None) -> str:
    """The schedule _launch_bwd runs; only "auto" without deterministic asks the device (for its tuning file)."""
    if backward_impl != "auto" or deterministic:
        return heuristics.bwd_schedule(backward_impl, deterministic, batch_heads, seqlen_q, seqlen_k,
                                       head_dim=max(head_dim, head_dim_v or 0))
    return schedule(device_arch(device_index), device_name(device_index), DTYPE_NAMES[str(dtype)], head_dim, causal,
                    backward_impl, deterministic, batch_heads, seqlen_q, seqlen_k, head_dim_v)
