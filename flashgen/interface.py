"""The flash-attn 2 Python API on flashgen kernels: same names, arguments, layouts and return values.

Every argument is validated before any launch; errors name the argument and what was expected.
"""
from __future__ import annotations

import math

import torch

from codegen import heuristics
from codegen.params import (BWD_PARAMS, BWD_PRE_PARAMS, BWD_SM90_PARAMS, DROPOUT_MASK_PARAMS, FWD_PARAMS,
                            FWD_SM90_PARAMS)
from codegen.traits import FUSED_MAX_HDIM, MAX_HDIM

from . import dispatch, tma

_DTYPES = (torch.float16, torch.bfloat16)
_ALIGN_ELEMS = 8   # 16-byte vector accesses of 2-byte elements


# ----------------------------------------------------------------------------------------------------
# validation


def _capturing() -> bool:
    """True inside CUDA graph capture, where checks that read device values must be skipped."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_tensor(name: str, t, ndim: int, layout: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be torch.float16 or torch.bfloat16, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}")


def _check_same(q, k, v):
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all inputs must be on one device")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, k and v must share a dtype")


def _check_heads_and_dim(q_heads: int, k_heads: int, head_dim: int, k_head_dim: int, v_head_dim: int,
                         dropout_p: float = 0.0):
    """q and k share a head dim; v's (headdim_v, the output's) may differ, e.g. 192 / 128 in MLA models."""
    if k_head_dim != head_dim:
        raise ValueError(f"k's head dim ({k_head_dim}) must equal q's ({head_dim})")
    for name, hd in (("q", head_dim), ("v", v_head_dim)):
        if hd % 8 or not 8 <= hd <= MAX_HDIM:
            raise ValueError(f"head dim of {name} (last dim) must be a multiple of 8 in [8, {MAX_HDIM}], got {hd}")
    if dropout_p and max(head_dim, v_head_dim) > FUSED_MAX_HDIM:
        raise NotImplementedError(f"dropout_p > 0 supports head dims up to {FUSED_MAX_HDIM}, got q {head_dim}, "
                                  f"v {v_head_dim}")
    if k_heads == 0 or q_heads % k_heads:
        raise ValueError(f"nheads of q ({q_heads}) must be a multiple of nheads of k/v ({k_heads})")


def _check_options(dropout_p, window_size, softcap, alibi_slopes, softmax_scale, generator=None):
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (a float), got {dropout_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (a CUDA one), got {type(generator).__name__}")
    if generator is not None and generator.device.type != "cuda":
        raise ValueError(f"generator must be a CUDA generator (torch.Generator(device='cuda')), got one on "
                         f"{generator.device}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size={tuple(window_size)} (local attention) is not implemented in flashgen")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap} is not implemented in flashgen")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not implemented in flashgen")
    if softmax_scale is not None and not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")


def _check_cu_seqlens(name: str, cu, batch: int | None, device) -> int:
    """Type, device and shape of a cu_seqlens tensor; returns its batch size."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device} with q, got {cu.device}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} must have batch + 1 = {batch + 1} entries (as cu_seqlens_q), got {cu.numel()}")
    if not cu.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return cu.numel() - 1


def _check_cu_seqlens_values(name: str, cu, total: int, max_name: str, max_seqlen: int):
    """Values of a cu_seqlens tensor (reads the device: skipped during CUDA graph capture)."""
    host = cu.tolist()
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0]}")
    if any(b < a for a, b in zip(host, host[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {host}")
    if host[-1] > total:
        raise ValueError(f"{name}[-1] = {host[-1]} exceeds the {total} rows of the packed tensor")
    longest = max(b - a for a, b in zip(host, host[1:]))
    if longest > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is smaller than the longest sequence ({longest}) in {name}")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """16-byte vector loads need 16-byte aligned rows; a tensor that is not gets a contiguous copy."""
    if t.data_ptr() % 16 == 0 and all(s % _ALIGN_ELEMS == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------------
# dropout


def _draw_rng_state(device, generator=None) -> torch.Tensor:
    """Two int64 (seed, offset) for one dropout call, drawn on the device by a torch random op: it advances
    torch's CUDA generator (or `generator`) like any other random op, so torch.manual_seed reproduces a run
    and consecutive calls differ, and under CUDA graph capture torch's graph-safe generator state makes every
    replay draw fresh values. The kernels read the pair from device memory; the backward reuses it."""
    return torch.empty(2, dtype=torch.int64, device=device).random_(generator=generator)


# Autograd saves the rng state as a tensor; without dropout an empty int64 tensor stands for None.
def _save_rng(rng_state, like: torch.Tensor) -> torch.Tensor:
    return rng_state if rng_state is not None else like.new_empty(0, dtype=torch.int64)


def _load_rng(rng: torch.Tensor):
    return rng if rng.numel() else None


def dropout_threshold(dropout_p: float) -> int:
    """Kernels drop an entry when its random byte is below this: drop probability threshold / 256."""
    return min(255, round(dropout_p * 256))


def dropout_keep_scale(dropout_p: float) -> float:
    """What kept entries are multiplied by: 1 / (keep probability), so the expectation is exact."""
    return 256.0 / (256 - dropout_threshold(dropout_p))


def _dropout_values(dropout_p: float, rng_state) -> dict:
    """Launch fields of the dropout kernels (templates/include/flashgen/dropout.cuh)."""
    if not dropout_p:
        return dict(rng_state=0, dropout_threshold=0, rp_dropout=1.0)
    return dict(rng_state=rng_state.data_ptr(), dropout_threshold=dropout_threshold(dropout_p),
                rp_dropout=dropout_keep_scale(dropout_p))


def dropout_mask(rng_state: torch.Tensor, dropout_p: float, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                 cu_seqlens_q=None, cu_seqlens_k=None) -> torch.Tensor:
    """The keep-mask (batch, nheads, seqlen_q, seqlen_k) bool that the attention kernels applied for this rng
    state (the kernel generates it with the same Philox mapping, templates/include/flashgen/dropout.cuh).
    Varlen: seqlen_* are the max lengths and entries past a sequence are False. For tests and S_dmask."""
    device = rng_state.device
    mask = torch.empty((batch, nheads, seqlen_q, seqlen_k), dtype=torch.uint8, device=device)
    if mask.numel() == 0:
        return mask.bool()
    kernel = dispatch.dropout_mask_kernel(device.index)
    t = kernel.traits
    grid = (-(-seqlen_k // t.num_threads), -(-seqlen_q // t.rows_per_block), batch * nheads)
    if grid[2] > 65535 or grid[1] > 65535:
        raise ValueError(f"dropout_mask: batch * nheads ({grid[2]}) and seqlen_q / {t.rows_per_block} must be <= 65535")
    varlen = cu_seqlens_q is not None
    values = dict(mask=mask.data_ptr(), rng_state=rng_state.data_ptr(),
                  cu_seqlens_q=cu_seqlens_q.data_ptr() if varlen else 0,
                  cu_seqlens_k=cu_seqlens_k.data_ptr() if varlen else 0,
                  mask_batch_stride=mask.stride(0), mask_head_stride=mask.stride(1), mask_row_stride=mask.stride(2),
                  nheads=nheads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                  dropout_threshold=dropout_threshold(dropout_p))
    with torch.cuda.device(device):
        kernel.launch(grid, DROPOUT_MASK_PARAMS.pack(values), device.index,
                      torch.cuda.current_stream(device).cuda_stream)
    return mask.bool()


def _round128(n: int) -> int:
    return -(-n // 128) * 128


def _probs(q, k, lse, softmax_scale, causal):
    """softmax(scale * q k^T) in fp32 from the forward's lse: q (sq, h, d), k (sk, hk, d), lse (h, sq) -> (h, sq, sk)."""
    h, hk = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(h // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float() * softmax_scale, kf)
    sq, sk = q.shape[0], k.shape[0]
    if causal:
        row = torch.arange(sq, device=q.device).view(-1, 1)
        col = torch.arange(sk, device=q.device).view(1, -1)
        scores = scores.masked_fill(col > row + sk - sq, float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    return p.masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)


def _s_dmask(q, k, lse, rng_state, dropout_p, softmax_scale, causal, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None):
    """flash-attn's S_dmask: the attention probabilities (batch, nheads, seqlen_q_rounded, seqlen_k_rounded),
    rounded up to multiples of 128 and zero-padded, with the entries dropout dropped negated; so
    `S_dmask >= 0` recovers the keep-mask where P > 0. Computed in PyTorch from the kernels' lse and the mask
    kernel: slow, for testing only."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, nheads = cu_seqlens_q.numel() - 1, q.shape[1]
        sq, sk = int(max_seqlen_q), int(max_seqlen_k)
    else:
        batch, sq, nheads = q.shape[:3]
        sk = k.shape[1]
    keep = dropout_mask(rng_state, dropout_p, batch, nheads, sq, sk, cu_seqlens_q, cu_seqlens_k)
    out = torch.zeros((batch, nheads, _round128(sq), _round128(sk)), dtype=q.dtype, device=q.device)
    if varlen:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(batch):
        if varlen:
            qb, kb, lb = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], lse[:, cq[b]:cq[b + 1]]
        else:
            qb, kb, lb = q[b], k[b], lse[b]
        p = _probs(qb, kb, lb, softmax_scale, causal)
        lq, lk = p.shape[1], p.shape[2]
        out[b, :, :lq, :lk] = torch.where(keep[b, :, :lq, :lk], p, -p).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------------
# forward launch


def _strides(name: str, t: torch.Tensor, varlen: bool) -> dict:
    if varlen:   # (total, heads, dim)
        return {f"{name}_batch_stride": 0, f"{name}_row_stride": t.stride(0), f"{name}_head_stride": t.stride(1)}
    return {f"{name}_batch_stride": t.stride(0), f"{name}_row_stride": t.stride(1),
            f"{name}_head_stride": t.stride(2)}


def _launch_fwd(q, k, v, out, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, batch, max_seqlen_q,
                max_seqlen_k, dropout_p=0.0, rng_state=None):
    varlen = cu_seqlens_q is not None
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    kernel = dispatch.fwd_kernel(q.device.index, q.dtype, head_dim, causal, dropout=bool(dropout_p),
                                 head_dim_v=v.shape[-1], seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
                                 tma_ok=tma.supported(q, k, v))
    t = kernel.traits
    values = dict(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(), lse=lse.data_ptr(),
        cu_seqlens_q=cu_seqlens_q.data_ptr() if varlen else 0,
        cu_seqlens_k=cu_seqlens_k.data_ptr() if varlen else 0,
        **_strides("q", q, varlen), **_strides("k", k, varlen), **_strides("v", v, varlen),
        **_strides("o", out, varlen),
        lse_batch_stride=0 if varlen else lse.stride(0), lse_head_stride=lse.stride(-2),
        batch=batch, nheads=nheads, nheads_k=nheads_k, head_dim=head_dim, head_dim_v=v.shape[-1],
        seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
        scale_log2=softmax_scale * math.log2(math.e), scale=softmax_scale,
        **_dropout_values(dropout_p, rng_state),
    )
    grid = ((max_seqlen_q + t.block_m - 1) // t.block_m, nheads, batch)
    if max_seqlen_q == 0 or batch == 0 or nheads == 0:
        return
    if t.family != "fwd_sm90":
        if t.persistent:   # the resident CTAs walk the tiles in the grid's order
            grid = (min(grid[0] * nheads * batch, kernel.resident_ctas(q.device.index)), 1, 1)
        kernel.launch(grid, FWD_PARAMS.pack(values), q.device.index, torch.cuda.current_stream(q.device).cuda_stream)
        return
    maps = tma.fwd_maps(q, k, v, out, t.block_m, t.block_n, varlen)
    m_blocks = grid[0]
    tiles = m_blocks * nheads * batch
    split_tiles, split_k = 0, 1
    if t.split_tail and not varlen:
        split_tiles, split_k = heuristics.fwd_sm90_split_tail(tiles, kernel.resident_ctas(q.device.index),
                                                              -(-max_seqlen_k // t.block_n))
    if t.persistent:   # the resident CTAs walk the tiles in the grid's order
        grid = (min(tiles, kernel.resident_ctas(q.device.index)), 1, 1)
    elif t.split_tail:   # a one-dimensional grid of work items: whole tiles, then the split ones' pieces
        grid = (tiles + split_tiles * (split_k - 1), 1, 1)
    # The next item to take (persistent) and a merge counter per split tile and consumer warpgroup: zeroed on the
    # stream, so graph replays start from 0.
    counters = (torch.zeros(1 + split_tiles * (t.block_m // 64), dtype=torch.int32, device=q.device)
                if t.persistent or split_tiles else None)
    o_part = lse_part = None
    if split_tiles:
        o_part = torch.empty(split_tiles * split_k * t.block_m * t.head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(split_tiles * split_k * t.block_m, dtype=torch.float32, device=q.device)
    group = heuristics.head_group(heuristics.FWD_SM90_HEAD_GROUP_CTAS, t.head_dim, causal, m_blocks, nheads * batch)
    packed = FWD_SM90_PARAMS.pack({
        **values, **maps, "head_group": group,
        "tile_counter": counters.data_ptr() if counters is not None else 0,
        "split_tiles": split_tiles, "split_k": split_k,
        "o_partial": o_part.data_ptr() if split_tiles else 0, "lse_partial": lse_part.data_ptr() if split_tiles else 0,
        "split_counter": counters.data_ptr() + 4 if split_tiles else 0})
    kernel.launch(grid, packed, q.device.index, torch.cuda.current_stream(q.device).cuda_stream)


def _flash_attn_forward(q, k, v, softmax_scale, causal, dropout_p=0.0, rng_state=None):
    """q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq) fp32. With dropout_p > 0,
    rng_state is the call's (seed, offset) pair on the device (_draw_rng_state)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        _launch_fwd(q, k, v, out, lse, softmax_scale, causal, None, None, batch, seqlen_q, seqlen_k, dropout_p,
                    rng_state)
    return out, lse


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, dropout_p=0.0, rng_state=None):
    """q (total_q, h, d), k/v (total_k, hk, d) -> out (total_q, h, d), lse (h, total_q) fp32."""
    total_q, nheads, head_dim = q.shape
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        _launch_fwd(q, k, v, out, lse, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k,
                    cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, dropout_p, rng_state)
    return out, lse


# ----------------------------------------------------------------------------------------------------
# backward launch


def _dq_accum_zeros(numel: int, device) -> torch.Tensor:
    """The fused backward's fp32 dQ accumulator, zeroed (one place, so benchmarks can try other memory for it)."""
    return torch.zeros(numel, dtype=torch.float32, device=device)


def _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, batch,
                max_seqlen_q, max_seqlen_k, backward_impl, deterministic, dropout_p=0.0, rng_state=None):
    """dq, dk, dv (same shapes as q, k, v, contiguous) <- the gradients. GQA: dK/dV are computed per query
    head and summed over each group of query heads afterwards."""
    varlen = cu_seqlens_q is not None
    nheads, head_dim = q.shape[-2], q.shape[-1]
    nheads_k = k.shape[-2]
    schedule = dispatch.bwd_schedule(q.device.index, q.dtype, head_dim, causal, backward_impl, deterministic,
                                     batch * nheads, max_seqlen_q, max_seqlen_k, head_dim_v=v.shape[-1])
    if max_seqlen_q == 0 or batch == 0 or nheads == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return schedule
    dev = q.device.index
    stream = torch.cuda.current_stream(q.device).cuda_stream
    # The fused schedule runs as one Hopper kernel, the split one as two (dK / dV, dQ), where there are such for the
    # call (sm_90a, FLASHGEN_HOPPER_BWD=1).
    tma_ok = tma.supported(q, k, v, dout)
    hopper = (dispatch.bwd_sm90_kernel(dev, q.dtype, head_dim, causal, bool(dropout_p), v.shape[-1], tma_ok)
              if schedule == "fused" else None)
    hopper_split = (dispatch.bwd_sm90_split_kernels(dev, q.dtype, head_dim, causal, bool(dropout_p), v.shape[-1],
                                                    tma_ok) if schedule == "split" else None)
    kinds = (("pre",) if hopper or hopper_split else ("pre", "dkdv_atomic") if schedule == "fused"
             else ("pre", "dkdv", "dq"))
    kernels = {kind: dispatch.bwd_kernel(dev, q.dtype, head_dim, causal, kind, dropout=bool(dropout_p),
                                         seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, head_dim_v=v.shape[-1])
               for kind in kinds}

    lse = lse.contiguous()
    dsum = torch.empty_like(lse)
    lse_strides = dict(lse_batch_stride=0 if varlen else lse.stride(0), lse_head_stride=lse.stride(-2))
    cu = dict(cu_seqlens_q=cu_seqlens_q.data_ptr() if varlen else 0,
              cu_seqlens_k=cu_seqlens_k.data_ptr() if varlen else 0)

    pre = kernels["pre"]
    rows = pre.traits.rows_per_block
    pre.launch(((max_seqlen_q + rows - 1) // rows, nheads, batch), BWD_PRE_PARAMS.pack(dict(
        o=out.data_ptr(), dout=dout.data_ptr(), dsum=dsum.data_ptr(), cu_seqlens_q=cu["cu_seqlens_q"],
        **_strides("o", out, varlen), **_strides("dout", dout, varlen),
        dsum_batch_stride=lse_strides["lse_batch_stride"], dsum_head_stride=lse_strides["lse_head_stride"],
        batch=batch, nheads=nheads, head_dim=v.shape[-1], seqlen_q=max_seqlen_q)), dev, stream)

    # dK/dV per query head: the outputs themselves without GQA, else (.., nheads, d) buffers summed below.
    if nheads_k != nheads:
        dk_h = k.new_empty((*k.shape[:-2], nheads, k.shape[-1]))
        dv_h = v.new_empty((*v.shape[:-2], nheads, v.shape[-1]))
    else:
        dk_h, dv_h = dk, dv
    dkdv = hopper or (hopper_split[0] if hopper_split else kernels["dkdv_atomic" if schedule == "fused" else "dkdv"])
    # Hopper split tail (BwdSm90Traits.split_tail): the last wave's key blocks as pieces over query ranges.
    split_tiles, split_k, n_blocks_k = 0, 1, (max_seqlen_k + dkdv.traits.block_n - 1) // dkdv.traits.block_n
    if hopper and hopper.traits.split_tail and not varlen and max_seqlen_k > 0:
        split_tiles, split_k = heuristics.bwd_sm90_split_tail(
            n_blocks_k * nheads * batch, hopper.resident_ctas(dev), (max_seqlen_q + hopper.traits.block_m - 1) //
            hopper.traits.block_m)
    # Fused: dQ accumulates in fp32 across key blocks, per head in whole (block_m x dq_accum_width) tiles whose
    # element order the kernel owns; varlen sequences start on tile boundaries (see BwdSeq::dq_accum_row0).
    if schedule == "fused":
        bm, bucket = dkdv.traits.block_m, dkdv.traits.dq_accum_width
        if varlen:
            rows = (q.shape[0] + bm * batch + bm - 1) // bm * bm
            dq_accum = _dq_accum_zeros(nheads * rows * bucket, q.device).view(nheads, rows, bucket)
            acc_strides = dict(dq_accum_batch_stride=0, dq_accum_row_stride=bucket,
                               dq_accum_head_stride=rows * bucket)
        else:
            rows = (max_seqlen_q + bm - 1) // bm * bm
            # A split tail's counters (int32, zero) after the accumulator: one zero fill for both.
            numel = batch * nheads * rows * bucket
            flat = _dq_accum_zeros(numel + split_tiles, q.device)
            dq_accum = flat[:numel].view(batch, nheads, rows, bucket)
            acc_strides = dict(dq_accum_batch_stride=nheads * rows * bucket, dq_accum_row_stride=bucket,
                               dq_accum_head_stride=rows * bucket)
    else:
        dq_accum, acc_strides = None, {}
    values = dict(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout.data_ptr(), lse=lse.data_ptr(),
        dsum=dsum.data_ptr(), dq=dq.data_ptr(), dq_accum=dq_accum.data_ptr() if dq_accum is not None else 0,
        dk=dk_h.data_ptr(), dv=dv_h.data_ptr(), **cu,
        **_strides("q", q, varlen), **_strides("k", k, varlen), **_strides("v", v, varlen),
        **_strides("dout", dout, varlen), **_strides("dq", dq, varlen),
        **acc_strides,
        **_strides("dk", dk_h, varlen), **_strides("dv", dv_h, varlen), **lse_strides,
        batch=batch, nheads=nheads, nheads_k=nheads_k, head_dim=head_dim, head_dim_v=v.shape[-1],
        seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
        scale_log2=softmax_scale * math.log2(math.e), scale=softmax_scale,
        **_dropout_values(dropout_p, rng_state),
    )
    def sm90_params(t, **fields):
        """A Hopper backward kernel's parameters: its tensor maps (Q / dO boxes of its block_m rows, K / V of its
        block_n), no head groups and no split tail unless `fields` says otherwise."""
        return BWD_SM90_PARAMS.pack({**values, **tma.bwd_maps(q, k, v, dout, t.block_m, t.block_n, varlen),
                                     "head_group": 0, "split_tiles": 0, "split_k": 1, "dkdv_partial": 0,
                                     "split_counter": 0, **fields})
    if hopper or hopper_split:
        t = dkdv.traits
        group = heuristics.head_group(heuristics.BWD_SM90_HEAD_GROUP_CTAS, t.head_dim, causal, n_blocks_k,
                                      nheads * batch)
        tail = {}
        if split_tiles:
            dkdv_part = torch.empty(split_tiles * split_k * 2 * t.block_n * t.head_dim, dtype=torch.float32,
                                    device=q.device)
            tail = dict(split_tiles=split_tiles, split_k=split_k, dkdv_partial=dkdv_part.data_ptr(),
                        split_counter=dq_accum.data_ptr() + dq_accum.numel() * 4)
        packed = sm90_params(t, head_group=group, **tail)
    else:
        packed = BWD_PARAMS.pack(values)
    if split_tiles:   # a one-dimensional grid of work items: whole key blocks, then the split ones' pieces
        dkdv.launch((n_blocks_k * nheads * batch + split_tiles * (split_k - 1), 1, 1), packed, dev, stream)
    elif max_seqlen_k > 0:
        dkdv.launch((n_blocks_k, nheads, batch), packed, dev, stream)
    else:
        dk_h.zero_(), dv_h.zero_()
    m_blocks = (max_seqlen_q + dkdv.traits.block_m - 1) // dkdv.traits.block_m
    if schedule == "fused":
        t = dkdv.traits
        dkdv.launch((m_blocks, nheads, batch), packed, dev, stream, entry="convert_dq",
                    smem=0 if hopper else t.block_m * t.head_dim * 2)
    else:
        kdq = hopper_split[1] if hopper_split else kernels["dq"]
        kdq.launch(((max_seqlen_q + kdq.traits.block_m - 1) // kdq.traits.block_m, nheads, batch),
                   sm90_params(kdq.traits) if hopper_split else packed, dev, stream)
    if nheads_k != nheads:
        group = nheads // nheads_k
        torch.sum(dk_h.unflatten(-2, (nheads_k, group)), dim=-2, out=dk)
        torch.sum(dv_h.unflatten(-2, (nheads_k, group)), dim=-2, out=dv)
    return schedule


def _check_backward_impl(backward_impl, head_dim: int = 0):
    """Also, given the wider head dim, that the schedule asked for exists for it (before the forward runs)."""
    if backward_impl not in ("auto",) + heuristics.BWD_SCHEDULES:
        raise ValueError(f"backward_impl must be 'auto', 'fused' or 'split', got {backward_impl!r}")
    if head_dim:
        heuristics.bwd_schedule(backward_impl, False, 0, 0, 0, head_dim=head_dim)


def _flash_attn_backward(dout, q, k, v, out, lse, softmax_scale, causal, backward_impl="auto",
                         deterministic=False, dropout_p=0.0, rng_state=None):
    """Gradients of _flash_attn_forward: dout (b, sq, h, d), lse (b, h, sq) -> dq, dk, dv (shapes of q, k, v)."""
    _check_backward_impl(backward_impl)
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    q, k, v, out, dout = _aligned(q), _aligned(k), _aligned(v), _aligned(out), _aligned(dout)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    with torch.cuda.device(q.device):
        _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, None, None, batch, seqlen_q,
                    seqlen_k, backward_impl, deterministic, dropout_p, rng_state)
    return dq, dk, dv


def _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale, causal, backward_impl="auto", deterministic=False, dropout_p=0.0,
                                rng_state=None):
    """Gradients of _flash_attn_varlen_forward: dout (total_q, h, d), lse (h, total_q) -> dq, dk, dv."""
    _check_backward_impl(backward_impl)
    q, k, v, out, dout = _aligned(q), _aligned(k), _aligned(v), _aligned(out), _aligned(dout)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    with torch.cuda.device(q.device):
        _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k,
                    cu_seqlens_q.numel() - 1, int(max_seqlen_q), int(max_seqlen_k), backward_impl, deterministic,
                    dropout_p, rng_state)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# autograd


# The gradient of lse is ignored, as in flash-attn: lse is returned for inspection, not for training.
# With dropout the forward draws the call's rng state and returns it (non-differentiable) so that S_dmask
# can be rebuilt; the backward regenerates the same mask from it.
class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, backward_impl, deterministic, dropout_p, generator):
        rng_state = _draw_rng_state(q.device, generator) if dropout_p else None
        out, lse = _flash_attn_forward(q, k, v, softmax_scale, causal, dropout_p, rng_state)
        rng = _save_rng(rng_state, lse)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        ctx.args = (softmax_scale, causal, backward_impl, deterministic, dropout_p)
        ctx.mark_non_differentiable(rng)
        return out, lse, rng

    @staticmethod
    def backward(ctx, dout, dlse, drng):
        q, k, v, out, lse, rng = ctx.saved_tensors
        dq, dk, dv = _flash_attn_backward(dout, q, k, v, out, lse, *ctx.args, rng_state=_load_rng(rng))
        return dq, dk, dv, None, None, None, None, None, None


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                backward_impl, deterministic, dropout_p, generator):
        rng_state = _draw_rng_state(q.device, generator) if dropout_p else None
        out, lse = _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              softmax_scale, causal, dropout_p, rng_state)
        rng = _save_rng(rng_state, lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, backward_impl, deterministic, dropout_p)
        ctx.mark_non_differentiable(rng)
        return out, lse, rng

    @staticmethod
    def backward(ctx, dout, dlse, drng):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng = ctx.saved_tensors
        dq, dk, dv = _flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.args,
                                                 rng_state=_load_rng(rng))
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def _result(out, lse, return_attn_probs, s_dmask=None):
    # S_dmask only exists with dropout (as in flash-attn); without it there is nothing to return.
    return (out, lse, s_dmask) if return_attn_probs else out


# ----------------------------------------------------------------------------------------------------
# public API


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, backward_impl="auto",
                    generator=None):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, S_dmask) with return_attn_probs.
    dropout_p: dropout on the attention probabilities (Philox in the kernels; seeded from torch's CUDA
    generator, or `generator`). S_dmask (only with dropout_p > 0, else None): the probabilities with dropped
    entries negated, (batch, nheads, seqlen_q, seqlen_k) rounded up to multiples of 128; slow, for tests.
    backward_impl (flashgen extra): "auto", "fused" (sequence-parallel dK/dV kernel, dQ by fp32 atomics) or
    "split" (separate dQ kernel, bitwise deterministic); deterministic=True always uses "split"."""
    _check_options(dropout_p, window_size, softcap, alibi_slopes, softmax_scale, generator)
    _check_backward_impl(backward_impl)
    layout_q, layout_kv = "(batch, seqlen_q, nheads, headdim)", "(batch, seqlen_k, nheads_k, headdim)"
    _check_tensor("q", q, 4, layout_q)
    _check_tensor("k", k, 4, layout_kv)
    _check_tensor("v", v, 4, layout_kv)
    _check_same(q, k, v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in (batch, seqlen_k, nheads_k), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v batch ({k.shape[0]}) must equal q batch ({q.shape[0]})")
    _check_heads_and_dim(q.shape[2], k.shape[2], q.shape[3], k.shape[3], v.shape[3], dropout_p)
    _check_backward_impl(backward_impl, max(q.shape[3], v.shape[3]))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    dropout_p = float(dropout_p)
    out, lse, rng = _FlashAttnFunc.apply(q, k, v, scale, bool(causal), backward_impl, bool(deterministic), dropout_p,
                                         generator)
    s_dmask = None
    if return_attn_probs and dropout_p:
        with torch.no_grad():
            s_dmask = _s_dmask(q.detach(), k.detach(), lse, rng, dropout_p, scale, bool(causal))
    return _result(out, lse, return_attn_probs, s_dmask)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              backward_impl="auto", generator=None):
    """qkv: (batch, seqlen, 3, nheads, headdim); the gradient comes back packed the same way."""
    _check_backward_impl(backward_impl)
    _check_tensor("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have 3 in dim 2 (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, backward_impl,
                           generator)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             backward_impl="auto", generator=None):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim)."""
    _check_backward_impl(backward_impl)
    _check_tensor("kv", kv, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have 2 in dim 2 (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, backward_impl, generator)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           backward_impl="auto", generator=None):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_*: int32 (batch + 1,).
    Returns out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q), S_dmask); S_dmask with
    dropout: (batch, nheads, max_seqlen_q, max_seqlen_k) rounded up to multiples of 128."""
    _check_options(dropout_p, window_size, softcap, alibi_slopes, softmax_scale, generator)
    _check_backward_impl(backward_impl)
    if block_table is not None:
        raise NotImplementedError("block_table (paged KV cache) is not implemented in flashgen")
    _check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    _check_tensor("k", k, 3, "(total_k, nheads_k, headdim)")
    _check_tensor("v", v, 3, "(total_k, nheads_k, headdim)")
    _check_same(q, k, v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in (total_k, nheads_k), got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_heads_and_dim(q.shape[1], k.shape[1], q.shape[2], k.shape[2], v.shape[2], dropout_p)
    _check_backward_impl(backward_impl, max(q.shape[2], v.shape[2]))
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k,
                      _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q.device), q.device)
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if int(val) < 0:
            raise ValueError(f"{name} must be >= 0, got {val}")
    if not _capturing():
        _check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", int(max_seqlen_q))
        _check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", int(max_seqlen_k))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    dropout_p = float(dropout_p)
    out, lse, rng = _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                               int(max_seqlen_k), scale, bool(causal), backward_impl,
                                               bool(deterministic), dropout_p, generator)
    s_dmask = None
    if return_attn_probs and dropout_p:
        with torch.no_grad():
            s_dmask = _s_dmask(q.detach(), k.detach(), lse, rng, dropout_p, scale, bool(causal), cu_seqlens_q,
                               cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    return _result(out, lse, return_attn_probs, s_dmask)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, backward_impl="auto", generator=None):
    """qkv: (total, 3, nheads, headdim)."""
    _check_backward_impl(backward_impl)
    _check_tensor("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have 3 in dim 1 (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, backward_impl=backward_impl, generator=generator)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                    backward_impl="auto", generator=None):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim)."""
    _check_backward_impl(backward_impl)
    _check_tensor("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have 2 in dim 1 (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, backward_impl=backward_impl, generator=generator)
