"""Kernel traits: one frozen dataclass per kernel family. A traits object fixes everything that changes code;
its `name` encodes every field, and `validate` checks it against the target arch's limits."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from .arch import Arch, get_arch
from .params import (BWD_PARAMS, BWD_PRE_PARAMS, BWD_SM90_PARAMS, DROPOUT_MASK_PARAMS, FWD_PARAMS, FWD_SM90_PARAMS,
                     ParamStruct)

DTYPES = ("fp16", "bf16")
CPP_ELEMENT = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t"}
HDIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)      # the default set (generated/, `flashgen generate`)
WIDE_HDIM_BUCKETS = (320, 384, 448, 512)                 # compiled on request or first use
ALL_HDIM_BUCKETS = HDIM_BUCKETS + WIDE_HDIM_BUCKETS
MAX_HDIM = 512
# The fused backward's dK/dV kernel also holds a block_m x head_dim fp32 dQ tile: above 256 that no longer fits the
# registers beside dK and dV, so wider head dims take the split schedule.
FUSED_MAX_HDIM = 256


class TraitsError(ValueError):
    """A trait set that the target arch or the template cannot run."""


@dataclass(frozen=True)
class KernelTraits:
    """Fields every family shares."""
    arch: str
    dtype: str

    family: ClassVar[str] = "base"
    template: ClassVar[str] = ""
    params: ClassVar[ParamStruct]

    @property
    def name(self) -> str:
        raise NotImplementedError

    def arch_info(self) -> Arch:
        return get_arch(self.arch)

    def smem_bytes(self) -> int:
        return 0

    @property
    def num_threads(self) -> int:
        return 32 * getattr(self, "num_warps", 4)

    def validate(self) -> "KernelTraits":
        arch = self.arch_info()
        if self.dtype not in DTYPES:
            raise TraitsError(f"{self.name}: dtype must be one of {DTYPES}, got {self.dtype!r}")
        if "sm80_mma" not in arch.mma:
            raise TraitsError(f"{self.name}: {arch.name} has no SM80 mma.sync tensor cores")
        if self.smem_bytes() > arch.smem_per_block:
            raise TraitsError(f"{self.name}: needs {self.smem_bytes()} B shared memory, "
                              f"{arch.name} allows {arch.smem_per_block} B per block")
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["family"] = self.family
        d["name"] = self.name
        return d

    def template_values(self) -> dict:
        """What a template sees: the trait values plus a few derived spellings, nothing else."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(name=self.name, element=CPP_ELEMENT[self.dtype], num_threads=self.num_threads,
                 smem_bytes=self.smem_bytes(), params_decl=self.params.cpp_decl(),
                 params_name=self.params.name)
        return d


def _hd_suffix(head_dim: int, even_k: bool, head_dim_v: int | None = None) -> str:
    """hd128, hd192v128 (V/O head dim differs), + "p" when the runtime head dims are padded to the buckets."""
    v = f"v{head_dim_v}" if head_dim_v not in (None, head_dim) else ""
    return f"hd{head_dim}{v}" + ("" if even_k else "p")


class _HeadDims:
    """head_dim (Q, K) and head_dim_v (V, O; None = same as head_dim, normalised on construction)."""

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    def _check_head_dims(self) -> None:
        for what, hd in (("head_dim", self.head_dim), ("head_dim_v", self.head_dim_v)):
            if hd % 32 or not 32 <= hd <= MAX_HDIM:
                raise TraitsError(f"{self.name}: {what} bucket must be a multiple of 32 in [32, {MAX_HDIM}]")


@dataclass(frozen=True)
class FwdTraits(_HeadDims, KernelTraits):
    """SM80-path forward: mma.sync m16n8k16, cp.async, swizzled smem, ldmatrix, online softmax."""
    head_dim: int = 128        # the bucket; the kernel masks columns >= the runtime head dim unless even_k
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    causal: bool = False
    even_k: bool = True        # runtime head dim == bucket: no column predicates on loads/stores
    dropout: bool = False      # Philox dropout on P (a trait: dropout-free kernels carry no dropout code)
    head_dim_v: int | None = None   # V / O bucket; None: head_dim. Last, so positional construction keeps working
    # The GPU's resident CTAs walk the (equal, non-causal) tiles round robin and load each next tile's Q and first K
    # block under the current tile's epilogue; the grid is those CTAs (interface._launch_fwd).
    persistent: bool = False
    # ldmatrix addresses as a few per-thread registers plus immediate offsets (templates/.../sm80_ldsm.cuh) instead of
    # CuTe's copies, whose per-slice addresses NVVM kept as loop-invariant registers (hdim 128: spills, NOTES.md).
    ldsm_imm: bool = False
    # O += P V in this many passes over O's columns, each loading the V^T fragments of its columns (needs ldsm_imm).
    pv_passes: int = 1
    # The mainloop that trades a few percent for registers (hdim 128 spill-free; slower elsewhere, NOTES.md): V waited
    # for right before O += P V, K/V copy addresses re-derived per block, causal masking checked per block in one loop.
    lean_loop: bool = False

    family: ClassVar[str] = "fwd"
    template: ClassVar[str] = "fwd_sm80.cu.j2"
    params: ClassVar[ParamStruct] = FWD_PARAMS

    @property
    def name(self) -> str:
        return (f"fwd_sm80_{self.dtype}_{_hd_suffix(self.head_dim, self.even_k, self.head_dim_v)}"
                f"_m{self.block_m}n{self.block_n}"
                f"_w{self.num_warps}{'_causal' if self.causal else ''}{'_dropout' if self.dropout else ''}"
                f"{'_ps' if self.persistent else ''}{'_li' if self.ldsm_imm else ''}"
                f"{f'_pv{self.pv_passes}' if self.pv_passes > 1 else ''}{'_lean' if self.lean_loop else ''}"
                f"_{self.arch.replace('_', '')}")

    @property
    def groups(self) -> int:
        """Column groups: warps beyond block_m / 16 split O's columns (each group recomputes S); wide head dims."""
        return self.num_warps // min(self.num_warps, max(1, self.block_m // 16))

    @property
    def pv_tiles(self) -> int:
        """16-column ldmatrix tiles of O per column group: what pv_passes splits."""
        return self.head_dim_v // self.groups // 16

    def pv_passes_fit(self, passes: int) -> bool:
        """A pass takes a power-of-two share of pv_tiles (CuTe divides the fragments' column modes only along their
        power-of-two factors)."""
        tiles = self.pv_tiles
        return passes >= 1 and tiles % passes == 0 and tiles & (tiles - 1) == 0

    def smem_bytes(self) -> int:
        # Q, K tiles, then V; the O epilogue reuses Q and K's space, or (persistent: the next tile's Q and K load
        # meanwhile) has its own after V. 2-byte elements.
        q_k = (self.block_m + self.block_n) * self.head_dim
        o = self.block_m * self.head_dim_v
        if self.persistent:
            return (q_k + self.block_n * self.head_dim_v + o) * 2
        return (max(q_k, o) + self.block_n * self.head_dim_v) * 2

    def validate(self) -> "FwdTraits":
        super().validate()
        self._check_head_dims()
        group_warps = self.num_warps // self.groups
        if self.block_m % 16 or self.block_m % (16 * group_warps) or self.num_warps % group_warps:
            raise TraitsError(f"{self.name}: block_m must be a multiple of 16 * warps per column group "
                              f"(each warp owns 16-row MMA slices)")
        if self.head_dim_v % (16 * self.groups):
            raise TraitsError(f"{self.name}: head_dim_v must split into {self.groups} column groups of 16s")
        if self.block_n % 16 or self.block_n < 16:
            raise TraitsError(f"{self.name}: block_n must be a multiple of 16")
        if self.dropout and self.block_n % 32:
            raise TraitsError(f"{self.name}: dropout needs block_n a multiple of 32 (the mask comes in 32-column blocks)")
        if self.persistent and self.causal:
            raise TraitsError(f"{self.name}: the persistent walk deals tiles round robin, which balances only the equal "
                              f"tiles of a non-causal forward")
        if self.pv_passes != 1:
            if not self.ldsm_imm:
                raise TraitsError(f"{self.name}: pv_passes > 1 needs ldsm_imm")
            if not self.pv_passes_fit(self.pv_passes):
                raise TraitsError(f"{self.name}: pv_passes must divide the {self.pv_tiles} 16-column tiles of O per "
                                  f"column group, a power of two")
        # fp32 accumulators per thread (O tile + each group's S tile) must leave room for operands and addresses.
        acc = (self.block_m * self.head_dim_v + self.groups * self.block_m * self.block_n) // self.num_threads
        if acc > 192:
            raise TraitsError(f"{self.name}: {acc} accumulator registers per thread would spill")
        return self


@dataclass(frozen=True)
class FwdSm90Traits(KernelTraits):
    """Hopper forward (sm_90a): TMA loads on mbarriers, wgmma for S = Q K^T and O += P V, a producer warpgroup and
    block_m / 64 consumer warpgroups. Any runtime head dim up to the bucket: the tensor maps zero-fill the columns
    past it and the epilogue stores only those below it."""
    head_dim: int = 128        # bucket, a multiple of 64 (one TMA box / swizzle span is 64 columns)
    block_m: int = 128
    block_n: int = 128
    stages: int = 2            # K/V buffers in flight
    causal: bool = False
    overlap: bool = False      # issue S of block i with P V of block i-1 (softmax overlaps the tensor cores)
    pingpong: bool = False     # the two consumer warpgroups take turns issuing GEMMs (needs overlap, block_m 128)
    dropout: bool = False      # Philox dropout on P (the same mask as the SM80 kernels)
    # One CTA per SM walks the tiles (grid: min(tiles, SMs)), taking each next one from a global counter; K/V loads run
    # on across tiles and the next tile's Q loads into a second buffer (q_bufs).
    persistent: bool = False

    family: ClassVar[str] = "fwd_sm90"
    template: ClassVar[str] = "fwd_sm90.cu.j2"
    params: ClassVar[ParamStruct] = FWD_SM90_PARAMS

    @property
    def name(self) -> str:
        return (f"fwd_sm90_{self.dtype}_hd{self.head_dim}_m{self.block_m}n{self.block_n}_s{self.stages}"
                f"{'_ov' if self.overlap else ''}{'_pp' if self.pingpong else ''}{'_ps' if self.persistent else ''}"
                f"{'_causal' if self.causal else ''}"
                f"{'_dropout' if self.dropout else ''}_{self.arch.replace('_', '')}")

    @property
    def num_threads(self) -> int:
        return 128 * (self.block_m // 64 + 1)

    @property
    def consumer_regs(self) -> int:
        """Registers per consumer thread after setmaxnreg (the kernel's kConsumerRegs; static_assert'ed equal)."""
        return {1: 232, 2: 240, 3: 160}[self.block_m // 64]

    @property
    def split_tail(self) -> bool:
        """Whether the kernel can run the last tiles as pieces over key ranges, merged by lse (fwd_sm90.cuh's kSplit;
        the launch decides whether it does, heuristics.fwd_sm90_split_tail): non-causal tiles all cost the same, so
        the last wave's are what leaves SMs idle; causal grids end on their lightest tiles already. Not the persistent
        walk: its three-warpgroup kernels have no registers to spare for it (92-104 B of spills)."""
        return not self.causal and not self.dropout and not self.persistent

    @property
    def stale_max(self) -> bool:
        """Whether the overlapped loop first takes each block's P with the running row max as it stands, without the
        block's own max, and redoes the block exactly where P leaves range (fwd_sm90.cuh's exp_stale). H100, bf16, 16k
        tokens, ratio to SDPA CUDNN at 2k / 8k, without -> with (thirty-eighth session, 11 rounds): hdim 64 1.08 / 1.14
        -> 1.14-1.15 / 1.19-1.21, causal 1.04 / 1.12 -> 1.09-1.10 / 1.16-1.18; hdim 128 1.02 / 1.11 -> 1.09-1.11 /
        1.14-1.15, causal 1.09 / 1.13 -> 1.12-1.13 / 1.19-1.20. hdim 256 (two consumer warpgroups of 64 x 80, where the
        exponentials are a smaller share of the block) level, its causal 8k kernel 2% slower with 16 B of spills: off."""
        return self.overlap and self.head_dim <= 128

    def template_values(self) -> dict:
        return dict(super().template_values(), consumer_regs=self.consumer_regs, q_bufs=self.q_bufs,
                    split_tail=self.split_tail, stale_max=self.stale_max)

    def _smem_bytes(self, q_bufs: int) -> int:
        # Q buffers, stages x (K, V), 2-byte elements, 2 x Q buffers + 4 x stages mbarriers (persistent: 3 x Q
        # buffers) rounded up to 16 bytes, a word per consumer thread (scratch), persistent: an int4 per Q buffer (the
        # tile in it).
        barriers = ((3 if self.persistent else 2) * q_bufs + 4 * self.stages) * 8
        return ((q_bufs * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2
                + (barriers + 15) // 16 * 16 + 4 * 128 * (self.block_m // 64)
                + (16 * q_bufs if self.persistent else 0))

    @property
    def q_bufs(self) -> int:
        """Q buffers: a persistent walk loads the next tile's Q into a second one while this tile runs, where shared
        memory allows (not hdim 256: 2 x 64 KB of Q next to the K/V ring)."""
        two = self.persistent and self._smem_bytes(2) <= self.arch_info().smem_per_block
        return 2 if two else 1

    def smem_bytes(self) -> int:
        return self._smem_bytes(self.q_bufs)

    def validate(self) -> "FwdSm90Traits":
        if "sm90_wgmma" not in self.arch_info().mma:
            raise TraitsError(f"{self.name}: {self.arch} has no wgmma (the Hopper path is sm_90a only)")
        super().validate()
        if self.head_dim % 64 or not 64 <= self.head_dim <= 256:
            raise TraitsError(f"{self.name}: head_dim bucket must be 64, 128, 192 or 256")
        if self.block_m not in (64, 128, 192):
            raise TraitsError(f"{self.name}: block_m must be 64, 128 or 192 (one to three consumer warpgroups)")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise TraitsError(f"{self.name}: block_n must be a multiple of 16 in [16, 256]")
        if self.stages < 1:
            raise TraitsError(f"{self.name}: stages must be >= 1")
        if self.pingpong and not (self.overlap and self.block_m == 128):
            raise TraitsError(f"{self.name}: ping-pong needs the overlapped mainloop and two consumer warpgroups")
        if self.dropout and self.block_n % 32:
            raise TraitsError(f"{self.name}: dropout needs block_n a multiple of 32")
        # fp32 S and O accumulators plus 16-bit P per consumer thread, within the registers setmaxnreg gives (32
        # left for addresses, softmax state and indices). Overlapped: block i's S is live next to block i-1's P.
        # Calibrated with ptxas (0 spills): hd256 128x80 ping-pong (200 of 240), hd64 192x128 overlap (128 of 160).
        # Dropout holds the block's Philox words: one per 4 entries.
        acc = (64 * self.block_n + 64 * self.head_dim) // 128 + 64 * self.block_n // 256
        acc += 64 * self.block_n // 512 if self.dropout else 0
        if acc > self.consumer_regs - 32:
            raise TraitsError(f"{self.name}: {acc} accumulator registers per consumer thread would spill")
        return self


@dataclass(frozen=True)
class BwdSm90Traits(KernelTraits):
    """Hopper backward (sm_90a), the fused schedule in one kernel: per key block of block_n keys (64 per consumer
    warpgroup), walk the query blocks with TMA loads of Q and dO into a `stages` ring, wgmma for S^T, dP^T, dV, dK and
    dQ, dQ added into an fp32 accumulator by bulk reduces from shared memory (dq_red: by 16-byte reds from registers);
    a second entry point converts it. Any runtime head dim up to the bucket (the tensor maps zero-fill the columns
    past it). dq=False: the split schedule's dK / dV kernel (BwdDqSm90Traits computes dQ)."""
    head_dim: int = 128        # bucket: 64, 128 or 256 (256: two warpgroups split dK's and dV's columns, block_n 64)
    block_m: int = 64
    block_n: int = 128
    stages: int = 2            # Q/dO buffers in flight
    causal: bool = False
    lse_smem: bool = False     # lse and D through shared memory, loaded a query block ahead (one value per thread)
    dropout: bool = False      # Philox dropout: the forward's mask regenerated per block (the same mapping)
    early_dv: bool = False     # dV issued before dP's wait, dK after dQ (the tensor cores run them over dS / dQ's stores)
    dq_handoff: bool = False   # warpgroups take turns on dQ; only the one whose turn it is waits for the other's dS
    dq_red: bool = False       # dQ added from registers by 16-byte reds into a fragment-ordered accumulator, no stage
    dq: bool = True            # False: no dQ at all (the split schedule's dK / dV kernel)

    family: ClassVar[str] = "bwd_sm90"
    template: ClassVar[str] = "bwd_sm90.cu.j2"
    params: ClassVar[ParamStruct] = BWD_SM90_PARAMS

    @property
    def name(self) -> str:
        return (f"bwd_sm90_{self.dtype}_hd{self.head_dim}_m{self.block_m}n{self.block_n}_s{self.stages}"
                f"{'_ls' if self.lse_smem else ''}{'_edv' if self.early_dv else ''}{'_ho' if self.dq_handoff else ''}"
                f"{'_red' if self.dq_red else ''}{'' if self.dq else '_dkdv'}{'_causal' if self.causal else ''}"
                f"{'_dropout' if self.dropout else ''}_{self.arch.replace('_', '')}")

    @property
    def col_split(self) -> bool:
        """Head dim 256: the two consumer warpgroups split dK's and dV's columns over one 64-key block, P^T and dS^T
        through shared memory (bwd_sm90.cuh)."""
        return self.head_dim > 128

    @property
    def consumer_wgs(self) -> int:
        return 2 if self.col_split else self.block_n // 64

    @property
    def num_threads(self) -> int:
        return 128 * (self.consumer_wgs + 1)

    def smem_bytes(self) -> int:
        # stages x (Q, dO), K, V, two dS buffers (2-byte elements; col_split: two P^T buffers too), each consumer
        # warpgroup's fp32 dQ share (its columns when they split into whole 64-column spans, else the whole tile; one
        # shared tile with the dQ handoff; none with dq_red), then 1 + 2 x stages mbarriers.
        wgs = self.consumer_wgs
        dq_wgs = wgs if wgs > 1 and self.head_dim % (64 * wgs) == 0 and not self.dq_handoff else 1
        dq_share = 64 * self.dq_accum_width // dq_wgs   # floats (128-row query blocks: 64 rows per warpgroup)
        dq_stages = 0 if self.dq_red or not self.dq else 1 if self.dq_handoff else wgs
        s_buffers = 4 if self.col_split else 2
        return ((2 * self.stages * self.block_m * self.head_dim + 2 * self.block_n * self.head_dim
                 + s_buffers * self.block_m * self.block_n) * 2 + dq_stages * dq_share * 4 + (1 + 2 * self.stages) * 8
                + (wgs * 2 * 2 * self.block_m * 4 if self.lse_smem else 0)
                # keep-flag exchange per warp pair (col_split: non-causal only)
                + (wgs * 2 * 2 * 64 * 4 if self.dropout and not (self.col_split and self.causal) else 0))

    @property
    def dq_accum_width(self) -> int:
        """Floats per row of the fp32 dQ accumulator (64-column chunks, swizzled within, no padding)."""
        return self.head_dim

    @property
    def split_tail(self) -> bool:
        """Whether the kernel can run the last key blocks as pieces over query ranges, dK and dV summed from fp32 slots
        (bwd_sm90.cuh's kSplit; the launch decides whether it does, heuristics.bwd_sm90_split_tail): non-causal key
        blocks all cost the same, so the last wave's leave SMs idle; causal grids end on their lightest blocks. Not at
        head dim 256, already ahead of its target, whose two warpgroups share each key block's dK and dV."""
        return not self.causal and not self.dropout and not self.col_split and self.dq

    def template_values(self) -> dict:
        return dict(super().template_values(), dq_accum_width=self.dq_accum_width, split_tail=self.split_tail)

    def validate(self) -> "BwdSm90Traits":
        if "sm90_wgmma" not in self.arch_info().mma:
            raise TraitsError(f"{self.name}: {self.arch} has no wgmma (the Hopper path is sm_90a only)")
        if self.col_split and (self.block_n != 64 or self.early_dv or self.dq_handoff):
            raise TraitsError(f"{self.name}: head_dim 256 takes block_n 64 and no early_dv or dq_handoff")
        super().validate()
        if self.head_dim not in (64, 128, 256):
            raise TraitsError(f"{self.name}: head_dim bucket must be 64, 128 or 256")
        if self.block_m != 64 and not (self.block_m == 128 and self.head_dim == 64 and self.block_n == 128
                                       and not self.dq_handoff and not self.dropout):
            raise TraitsError(f"{self.name}: block_m must be 64, or 128 at head_dim 64 with block_n 128 (each consumer "
                              f"warpgroup computes the dQ of 64 rows), no dq_handoff and no dropout")
        if self.block_n not in (64, 128):
            raise TraitsError(f"{self.name}: block_n must be 64 or 128 (one or two consumer warpgroups)")
        if self.stages < 1:
            raise TraitsError(f"{self.name}: stages must be >= 1")
        if self.early_dv and self.dropout:
            raise TraitsError(f"{self.name}: early_dv has no dropout variant (dV's operand is P Z, formed with dS)")
        if self.dq_handoff and self.block_n != 128:
            raise TraitsError(f"{self.name}: dq_handoff takes two consumer warpgroups (block_n 128)")
        if self.dq_red and self.col_split:
            raise TraitsError(f"{self.name}: dq_red takes head_dim <= 128 (one 64 x 64 dQ fragment per warpgroup)")
        if not self.dq and (self.early_dv or self.dq_handoff or self.dq_red):
            raise TraitsError(f"{self.name}: without dQ (dq=False) there is no early_dv, dq_handoff or dq_red")
        return self


@dataclass(frozen=True)
class BwdDqSm90Traits(KernelTraits):
    """Hopper backward (sm_90a), the split schedule's dQ kernel: per query block of block_m rows (64 per consumer
    warpgroup), walk the key blocks with TMA loads of K and V into a `stages` ring, recompute S and dP by wgmma and
    keep dQ += dS K in registers: no block adds into another's result, so dQ is bitwise deterministic. Any runtime head
    dim up to the bucket."""
    head_dim: int = 128        # bucket: 64, 128 or 256
    block_m: int = 128
    block_n: int = 64
    stages: int = 2            # K/V buffers in flight
    causal: bool = False
    overlap: bool = False      # the next key block's S and dP issued behind this one's dQ GEMM, before its wait
    dropout: bool = False      # Philox dropout: the forward's mask regenerated per block (the forward's fragment view)

    family: ClassVar[str] = "bwd_dq_sm90"
    template: ClassVar[str] = "bwd_dq_sm90.cu.j2"
    params: ClassVar[ParamStruct] = BWD_SM90_PARAMS

    @property
    def name(self) -> str:
        return (f"bwd_dq_sm90_{self.dtype}_hd{self.head_dim}_m{self.block_m}n{self.block_n}_s{self.stages}"
                f"{'_ov' if self.overlap else ''}{'_causal' if self.causal else ''}{'_dropout' if self.dropout else ''}"
                f"_{self.arch.replace('_', '')}")

    @property
    def num_threads(self) -> int:
        return 128 * (self.block_m // 64 + 1)

    def smem_bytes(self) -> int:
        # Q, dO, stages x (K, V) (2-byte elements), then 1 + 2 x stages mbarriers.
        return (2 * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2 + (1 + 2 * self.stages) * 8

    def validate(self) -> "BwdDqSm90Traits":
        if "sm90_wgmma" not in self.arch_info().mma:
            raise TraitsError(f"{self.name}: {self.arch} has no wgmma (the Hopper path is sm_90a only)")
        super().validate()
        if self.head_dim not in (64, 128, 256):
            raise TraitsError(f"{self.name}: head_dim bucket must be 64, 128 or 256")
        if self.block_m not in (64, 128, 192):
            raise TraitsError(f"{self.name}: block_m must be 64, 128 or 192 (one to three consumer warpgroups)")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise TraitsError(f"{self.name}: block_n must be a multiple of 16 in [16, 256]")
        if self.dropout and self.block_n % 32:
            raise TraitsError(f"{self.name}: dropout needs block_n a multiple of 32 (the forward's Philox blocks)")
        if self.stages < 1 + self.overlap:
            raise TraitsError(f"{self.name}: stages must be >= 1 (overlap: >= 2, the next key block in another stage)")
        # fp32 dQ, S and dP plus 16-bit dS per consumer thread: at most 200 of one or two warpgroups' 256 / 240
        # registers, 152 of three warpgroups' 160 (the largest spill-free three-warpgroup kernel measured: hdim 64
        # 192 x 96).
        acc = (64 * self.head_dim + 2 * 64 * self.block_n) // 128 + 64 * self.block_n // 256
        if acc > (152 if self.block_m == 192 else 200):
            raise TraitsError(f"{self.name}: {acc} accumulator registers per consumer thread would spill")
        return self


@dataclass(frozen=True)
class BwdDkdvTraits(_HeadDims, KernelTraits):
    """Backward over key blocks: each block keeps dK, dV of block_n keys in registers and walks the query
    blocks. atomic_dq: also add dQ partials into an fp32 accumulator (the fused, sequence-parallel
    schedule); without it the split schedule's dQ kernel computes dQ."""
    head_dim: int = 128
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 8
    stages: int = 2            # Q/dO buffers: 2 loads the next query block while this one computes
    causal: bool = False
    even_k: bool = True
    atomic_dq: bool = True
    dropout: bool = False
    head_dim_v: int | None = None

    family: ClassVar[str] = "bwd_dkdv"

    @property
    def dq_accum_width(self) -> int:
        """Floats per row of the fused schedule's fp32 dQ accumulator."""
        return self.head_dim
    template: ClassVar[str] = "bwd_dkdv_sm80.cu.j2"
    params: ClassVar[ParamStruct] = BWD_PARAMS

    @property
    def name(self) -> str:
        return (f"bwd_dkdv{'_atomicdq' if self.atomic_dq else ''}_sm80_{self.dtype}_"
                f"{_hd_suffix(self.head_dim, self.even_k, self.head_dim_v)}_m{self.block_m}n{self.block_n}"
                f"_w{self.num_warps}_s{self.stages}"
                f"{'_causal' if self.causal else ''}{'_dropout' if self.dropout else ''}_{self.arch.replace('_', '')}")

    def smem_bytes(self) -> int:
        # K, V (block_n rows), `stages` x (Q, dO) (block_m rows), P and dS (block_m x block_n), 2-byte elements.
        return 2 * ((self.block_n + self.stages * self.block_m) * (self.head_dim + self.head_dim_v)
                    + 2 * self.block_m * self.block_n)

    def validate(self) -> "BwdDkdvTraits":
        super().validate()
        _check_bwd_tiles(self)
        if self.atomic_dq and max(self.head_dim, self.head_dim_v) > FUSED_MAX_HDIM:
            raise TraitsError(f"{self.name}: the fused schedule (atomic dQ) takes head dims up to {FUSED_MAX_HDIM}")
        acc = (self.block_n * (self.head_dim + self.head_dim_v) + 2 * self.block_m * self.block_n
               + (self.block_m * self.head_dim if self.atomic_dq else 0)) // self.num_threads
        if acc > 240:
            raise TraitsError(f"{self.name}: {acc} accumulator registers per thread would spill")
        return self


@dataclass(frozen=True)
class BwdDqTraits(_HeadDims, KernelTraits):
    """Backward over query blocks (split schedule): dQ of block_m rows in registers, walking the key blocks.
    No atomics: bitwise deterministic."""
    head_dim: int = 128
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 8
    stages: int = 2            # K/V buffers: 2 loads the next key block while this one computes
    causal: bool = False
    even_k: bool = True
    dropout: bool = False
    head_dim_v: int | None = None

    family: ClassVar[str] = "bwd_dq"
    template: ClassVar[str] = "bwd_dq_sm80.cu.j2"
    params: ClassVar[ParamStruct] = BWD_PARAMS

    @property
    def name(self) -> str:
        return (f"bwd_dq_sm80_{self.dtype}_{_hd_suffix(self.head_dim, self.even_k, self.head_dim_v)}"
                f"_m{self.block_m}n{self.block_n}"
                f"_w{self.num_warps}_s{self.stages}{'_causal' if self.causal else ''}{'_dropout' if self.dropout else ''}"
                f"_{self.arch.replace('_', '')}")

    def smem_bytes(self) -> int:
        # Q, dO (block_m rows), `stages` x (K, V) (block_n rows), dS (block_m x block_n).
        return 2 * ((self.block_m + self.stages * self.block_n) * (self.head_dim + self.head_dim_v)
                    + self.block_m * self.block_n)

    def validate(self) -> "BwdDqTraits":
        super().validate()
        _check_bwd_tiles(self)
        return self


def _check_bwd_tiles(t) -> None:
    t._check_head_dims()
    if t.num_warps != 8 or t.block_m % 64 or t.block_n % 32:
        raise TraitsError(f"{t.name}: the backward templates take 8 warps, block_m a multiple of 64 and block_n "
                          f"a multiple of 32")
    if t.dropout and t.block_n % 64:
        raise TraitsError(f"{t.name}: dropout needs block_n a multiple of 64 (each warp's S columns in whole 32s)")
    if t.stages not in (1, 2):
        raise TraitsError(f"{t.name}: stages must be 1 or 2")


@dataclass(frozen=True)
class BwdPreTraits(KernelTraits):
    """Backward preprocess: dsum = rowsum(dO * O) per query row, fp32."""
    head_dim: int = 128
    num_warps: int = 4

    family: ClassVar[str] = "bwd_pre"
    template: ClassVar[str] = "bwd_pre.cu.j2"
    params: ClassVar[ParamStruct] = BWD_PRE_PARAMS

    @property
    def name(self) -> str:
        return f"bwd_pre_{self.dtype}_hd{self.head_dim}_w{self.num_warps}_{self.arch.replace('_', '')}"

    threads_per_row: ClassVar[int] = 8   # each loads 16-byte vectors of its row, then a shuffle reduction

    @property
    def rows_per_block(self) -> int:
        return self.num_threads // self.threads_per_row

    def template_values(self) -> dict:
        return {**super().template_values(), "threads_per_row": self.threads_per_row}

    def validate(self) -> "BwdPreTraits":
        super().validate()
        if self.head_dim % 32 or not 32 <= self.head_dim <= MAX_HDIM:
            raise TraitsError(f"{self.name}: head_dim bucket must be a multiple of 32 in [32, {MAX_HDIM}]")
        return self


@dataclass(frozen=True)
class DropoutMaskTraits(KernelTraits):
    """The dropout keep-mask of an rng state as uint8 (tests, return_attn_probs): the same Philox mapping as
    the attention kernels (templates/include/flashgen/dropout.cuh), one entry per thread. Independent of the
    input dtype; plain CUDA, compiles in seconds."""
    dtype: str = "u8"
    num_warps: int = 4
    rows_per_block: int = 16

    family: ClassVar[str] = "dropout_mask"
    template: ClassVar[str] = "dropout_mask.cu.j2"
    params: ClassVar[ParamStruct] = DROPOUT_MASK_PARAMS

    @property
    def name(self) -> str:
        return f"dropout_mask_w{self.num_warps}_r{self.rows_per_block}_{self.arch.replace('_', '')}"

    def validate(self) -> "DropoutMaskTraits":
        self.arch_info()
        if self.dtype != "u8":
            raise TraitsError(f"{self.name}: the mask is uint8 (dtype 'u8'), got {self.dtype!r}")
        return self

    def template_values(self) -> dict:
        return {"name": self.name, "arch": self.arch, "num_warps": self.num_warps, "num_threads": self.num_threads,
                "rows_per_block": self.rows_per_block, "params_decl": self.params.cpp_decl(),
                "params_name": self.params.name}


FAMILIES = {cls.family: cls for cls in (FwdTraits, FwdSm90Traits, BwdDkdvTraits, BwdDqTraits, BwdPreTraits,
                                         DropoutMaskTraits, BwdSm90Traits, BwdDqSm90Traits)}


def traits_from_dict(d: dict) -> KernelTraits:
    d = dict(d)
    cls = FAMILIES[d.pop("family")]
    d.pop("name", None)
    return cls(**d)


def bucket_for_head_dim(head_dim: int, buckets=ALL_HDIM_BUCKETS) -> int:
    for b in sorted(buckets):
        if head_dim <= b:
            return b
    raise TraitsError(f"head dim {head_dim} exceeds the largest bucket {max(buckets)}")


_FWD_NAME = re.compile(r"^fwd_sm80_(?P<dtype>fp16|bf16)_hd(?P<hd>\d+)(?:v(?P<hdv>\d+))?(?P<pad>p?)_m(?P<m>\d+)n(?P<n>\d+)_w(?P<w>\d+)"
                       r"(?P<causal>_causal)?(?P<dropout>_dropout)?(?P<ps>_ps)?(?P<li>_li)?(?:_pv(?P<pv>\d+))?(?P<lean>_lean)?_sm(?P<arch>\d+a?)$")


_BWD_NAME = re.compile(r"^bwd_(?P<kind>dkdv|dq)(?P<atomic>_atomicdq)?_sm80_(?P<dtype>fp16|bf16)_hd(?P<hd>\d+)(?:v(?P<hdv>\d+))?"
                       r"(?P<pad>p?)_m(?P<m>\d+)n(?P<n>\d+)_w(?P<w>\d+)_s(?P<s>\d)(?P<causal>_causal)?(?P<dropout>_dropout)?"
                       r"_sm(?P<arch>\d+a?)$")
_FWD_SM90_NAME = re.compile(r"^fwd_sm90_(?P<dtype>fp16|bf16)_hd(?P<hd>\d+)_m(?P<m>\d+)n(?P<n>\d+)_s(?P<s>\d+)"
                            r"(?P<ov>_ov)?(?P<pp>_pp)?(?P<ps>_ps)?(?P<causal>_causal)?(?P<dropout>_dropout)?_sm(?P<arch>\d+a?)$")
_BWD_SM90_NAME = re.compile(r"^bwd_sm90_(?P<dtype>fp16|bf16)_hd(?P<hd>\d+)_m(?P<m>\d+)n(?P<n>\d+)_s(?P<s>\d+)"
                            r"(?P<ls>_ls)?(?P<edv>_edv)?(?P<ho>_ho)?(?P<red>_red)?(?P<dkdv>_dkdv)?(?P<causal>_causal)?"
                            r"(?P<dropout>_dropout)?_sm(?P<arch>\d+a?)$")
_BWD_DQ_SM90_NAME = re.compile(r"^bwd_dq_sm90_(?P<dtype>fp16|bf16)_hd(?P<hd>\d+)_m(?P<m>\d+)n(?P<n>\d+)_s(?P<s>\d+)"
                               r"(?P<ov>_ov)?(?P<causal>_causal)?(?P<dropout>_dropout)?_sm(?P<arch>\d+a?)$")
_PRE_NAME = re.compile(r"^bwd_pre_(?P<dtype>fp16|bf16)_hd(?P<hd>\d+)_w(?P<w>\d+)_sm(?P<arch>\d+a?)$")
_MASK_NAME = re.compile(r"^dropout_mask_w(?P<w>\d+)_r(?P<r>\d+)_sm(?P<arch>\d+a?)$")


def traits_from_name(name: str) -> KernelTraits:
    """Inverse of `.name`: every trait is in the name."""
    m = _FWD_NAME.match(name)
    if m:
        return FwdTraits(arch=f"sm_{m['arch']}", dtype=m["dtype"], head_dim=int(m["hd"]),
                         head_dim_v=int(m["hdv"] or m["hd"]), block_m=int(m["m"]),
                         block_n=int(m["n"]), num_warps=int(m["w"]), causal=bool(m["causal"]),
                         even_k=not m["pad"], dropout=bool(m["dropout"]), persistent=bool(m["ps"]),
                         ldsm_imm=bool(m["li"]), pv_passes=int(m["pv"] or 1), lean_loop=bool(m["lean"]))
    m = _BWD_NAME.match(name)
    if m:
        common = dict(arch=f"sm_{m['arch']}", dtype=m["dtype"], head_dim=int(m["hd"]),
                      head_dim_v=int(m["hdv"] or m["hd"]), block_m=int(m["m"]),
                      block_n=int(m["n"]), num_warps=int(m["w"]), stages=int(m["s"]), causal=bool(m["causal"]),
                      even_k=not m["pad"], dropout=bool(m["dropout"]))
        if m["kind"] == "dq":
            return BwdDqTraits(**common)
        return BwdDkdvTraits(**common, atomic_dq=bool(m["atomic"]))
    m = _FWD_SM90_NAME.match(name)
    if m:
        return FwdSm90Traits(arch=f"sm_{m['arch']}", dtype=m["dtype"], head_dim=int(m["hd"]), block_m=int(m["m"]),
                             block_n=int(m["n"]), stages=int(m["s"]), causal=bool(m["causal"]),
                             overlap=bool(m["ov"]), pingpong=bool(m["pp"]), dropout=bool(m["dropout"]),
                             persistent=bool(m["ps"]))
    m = _BWD_SM90_NAME.match(name)
    if m:
        return BwdSm90Traits(arch=f"sm_{m['arch']}", dtype=m["dtype"], head_dim=int(m["hd"]), block_m=int(m["m"]),
                             block_n=int(m["n"]), stages=int(m["s"]), causal=bool(m["causal"]),
                             lse_smem=bool(m["ls"]), dropout=bool(m["dropout"]), early_dv=bool(m["edv"]),
                             dq_handoff=bool(m["ho"]), dq_red=bool(m["red"]), dq=not m["dkdv"])
    m = _BWD_DQ_SM90_NAME.match(name)
    if m:
        return BwdDqSm90Traits(arch=f"sm_{m['arch']}", dtype=m["dtype"], head_dim=int(m["hd"]), block_m=int(m["m"]),
                               block_n=int(m["n"]), stages=int(m["s"]), causal=bool(m["causal"]),
                               overlap=bool(m["ov"]), dropout=bool(m["dropout"]))
    m = _PRE_NAME.match(name)
    if m:
        return BwdPreTraits(arch=f"sm_{m['arch']}", dtype=m["dtype"], head_dim=int(m["hd"]), num_warps=int(m["w"]))
    m = _MASK_NAME.match(name)
    if m:
        return DropoutMaskTraits(arch=f"sm_{m['arch']}", num_warps=int(m["w"]), rows_per_block=int(m["r"]))
    raise TraitsError(f"not a flashgen kernel name: {name!r}")
