"""TMA tensor maps for the Hopper kernels, built on the host with the driver's cuTensorMapEncodeTiled.

NVRTC compiles device code only, so CuTe's host-side make_tma_copy is not available: the kernels take raw
CUtensorMaps (128 bytes each) in their parameter struct and issue `cp.async.bulk.tensor` with coordinates.
A map describes one attention operand as 4-D (head dim, rows, heads, batch), innermost first, with a box of
64 columns (128 bytes: the span of the 128-byte swizzle the GMMA shared-memory atoms use) by `box_rows` rows.
Bounds are the runtime sizes, so rows past a sequence and columns past the head dim read as zeros.
"""
from __future__ import annotations

BOX_COLS = 64   # 16-bit elements per 128-byte swizzle span


class TmaUnsupported(ValueError):
    """A tensor a tensor map cannot describe (unaligned address or strides); the caller takes the SM80 path."""


def _drv():
    from cuda.bindings import driver
    return driver


def supported(*tensors) -> bool:
    """TMA needs a 16-byte aligned base and byte strides that are positive multiples of 16."""
    for t in tensors:
        if t.numel() == 0 or t.data_ptr() % 16 or t.element_size() != 2:   # empty: nothing to map (SM80 path)
            return False
        if any(s <= 0 or (s * 2) % 16 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
            return False
    return True


_maps: dict[tuple, bytes] = {}


def operand_map(t, box_rows: int, varlen: bool) -> bytes:
    """The tensor map of q, k or v: (batch, rows, heads, dim) fixed length or (total, heads, dim) varlen. Memoized
    on everything the map encodes (a launch is host-bound for short problems: this is the common path)."""
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, box_rows, varlen)
    m = _maps.get(key)
    if m is None:
        if len(_maps) >= 1024:   # a long run over many buffers: start over rather than grow without bound
            _maps.clear()
        m = _maps[key] = _operand_map(t, box_rows, varlen)
    return m


def _operand_map(t, box_rows: int, varlen: bool) -> bytes:
    if varlen:
        rows, heads, dim = t.shape
        row_stride, head_stride = t.stride(0), t.stride(1)
        batch, batch_stride = 1, max(rows, 1) * row_stride
    else:
        batch, rows, heads, dim = t.shape
        batch_stride, row_stride, head_stride = t.stride(0), t.stride(1), t.stride(2)
    # Strides of size-1 dims are never stepped over; give them a legal value.
    strides = [s if n > 1 else 16 // t.element_size() for s, n in
               ((row_stride, rows), (head_stride, heads), (batch_stride, batch))]
    return _encode(str(t.dtype), t.data_ptr(), (dim, max(rows, 1), max(heads, 1), max(batch, 1)),
                   tuple(s * t.element_size() for s in strides), box_rows)


def _encode(dtype: str, ptr: int, dims: tuple, byte_strides: tuple, box_rows: int) -> bytes:
    """cuTensorMapEncodeTiled (operand_map memoizes: a training loop reuses the same few buffers and shapes)."""
    drv = _drv()
    dt = {"torch.bfloat16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
          "torch.float16": drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16}[dtype]
    if any(s % 16 or s >= 1 << 40 for s in byte_strides):
        raise TmaUnsupported(f"TMA needs byte strides that are multiples of 16 below 2^40, got {byte_strides}")
    err, tmap = drv.cuTensorMapEncodeTiled(
        dt, 4, ptr, [drv.cuuint64_t(d) for d in dims], [drv.cuuint64_t(s) for s in byte_strides],
        [drv.cuuint32_t(b) for b in (BOX_COLS, box_rows, 1, 1)], [drv.cuuint32_t(1)] * 4,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise TmaUnsupported(f"cuTensorMapEncodeTiled failed ({err}) for dims {dims}, byte strides {byte_strides}, "
                             f"box ({BOX_COLS}, {box_rows})")
    return b"".join(int(w).to_bytes(8, "little") for w in tmap.opaque)


def fwd_maps(q, k, v, out, block_m: int, block_n: int, varlen: bool) -> dict:
    """The tensor maps of the Hopper forward's parameter struct; O's (64-row boxes: each consumer warpgroup stores its
    own rows) only where `out` suits TMA, else o_tma = 0 and the kernel stores O without it."""
    o_ok = supported(out)
    return {"tma_q": operand_map(q, block_m, varlen), "tma_k": operand_map(k, block_n, varlen),
            "tma_v": operand_map(v, block_n, varlen), "tma_o": operand_map(out, 64, varlen) if o_ok else None,
            "o_tma": int(o_ok)}


def bwd_maps(q, k, v, dout, block_m: int, block_n: int, varlen: bool) -> dict:
    """The four tensor maps of the Hopper backward's parameter struct (Q and dO boxes of block_m rows)."""
    return {"tma_q": operand_map(q, block_m, varlen), "tma_k": operand_map(k, block_n, varlen),
            "tma_v": operand_map(v, block_n, varlen), "tma_do": operand_map(dout, block_m, varlen)}
