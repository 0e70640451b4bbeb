"""Kernel parameter structs, defined once.

Each kernel takes a single struct by value. The same `ParamStruct` object renders the C++ declaration
(with a static_assert on its size; tests/test_params.py reads every offset back from NVRTC's PTX) and packs the bytes at
launch, so the two cannot disagree.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

# kind -> (C++ type, struct-module code, size, alignment)
_KINDS = {
    "ptr": ("void*", "Q", 8, 8),
    "i64": ("long long", "q", 8, 8),
    "u64": ("unsigned long long", "Q", 8, 8),
    "i32": ("int", "i", 4, 4),
    "u32": ("unsigned int", "I", 4, 4),
    "f32": ("float", "f", 4, 4),
    # A TMA tensor map (CUtensorMap, 128 opaque bytes, 64-byte aligned) built by flashgen/tma.py.
    "tmap": ("cute::TmaDescriptor", "128s", 128, 64),
}


@dataclass(frozen=True)
class ParamStruct:
    name: str
    fields: tuple[tuple[str, str], ...]   # (field name, kind)

    def layout(self) -> tuple[list[tuple[str, str, int]], int]:
        """[(field, kind, offset)], total size -- natural C alignment, as the compiler lays it out."""
        return self._layout

    @cached_property
    def _layout(self) -> tuple[list[tuple[str, str, int]], int]:
        out, off, align_max = [], 0, 1
        for fname, kind in self.fields:
            size, align = _KINDS[kind][2:]
            off = (off + align - 1) // align * align
            out.append((fname, kind, off))
            off += size
            align_max = max(align_max, align)
        return out, (off + align_max - 1) // align_max * align_max

    @cached_property
    def _packer(self) -> struct.Struct:
        """The whole layout as one struct format, padding as pad bytes: one pack call per launch (launches are
        host-bound for short problems; packing field by field cost ~20 us)."""
        fields, size = self.layout()
        fmt, end = "<", 0
        for _, kind, off in fields:
            fmt += f"{off - end}x" if off > end else ""
            fmt += _KINDS[kind][1]
            end = off + _KINDS[kind][2]
        fmt += f"{size - end}x" if size > end else ""
        packer = struct.Struct(fmt)
        assert packer.size == size, (self.name, packer.size, size)
        return packer

    @cached_property
    def _names(self) -> frozenset:
        return frozenset(f for f, _ in self.fields)

    @property
    def size(self) -> int:
        return self.layout()[1]

    def cpp_decl(self) -> str:
        lines = [f"struct {self.name} {{"]
        lines += [f"    {_KINDS[kind][0]} {fname};" for fname, kind in self.fields]
        lines.append("};")
        lines.append(f"static_assert(sizeof({self.name}) == {self.size}, \"{self.name} size drifted from Python\");")
        return "\n".join(lines)

    def pack(self, values: dict) -> bytes:
        if not self._names.issuperset(values):
            raise KeyError(f"{self.name}: unknown fields {sorted(set(values) - self._names)}")
        args = []
        for fname, kind in self.fields:
            v = values.get(fname, 0)
            if v is None or (kind == "tmap" and not v):   # a null pointer; a tensor map the kernel does not read
                v = bytes(128) if kind == "tmap" else 0
            args.append(v)
        return self._packer.pack(*args)


def _strides(*tensors: str) -> list[tuple[str, str]]:
    return [(f"{t}_{s}_stride", "i64") for t in tensors for s in ("batch", "row", "head")]


# Dropout (read only by kernels with the dropout trait): rng_state points at two int64 on the device (seed,
# offset) that torch's generator wrote; an entry of P is kept when its Philox byte is >= the threshold
# (round(p * 256)), and kept entries are scaled by rp_dropout = 256 / (256 - threshold). See
# templates/include/flashgen/dropout.cuh.
_DROPOUT = [("rng_state", "ptr"), ("dropout_threshold", "u32"), ("rp_dropout", "f32")]

# Forward attention: O = softmax(scale * Q K^T [+ mask]) V, lse per query row.
# Varlen when cu_seqlens_q is non-null: batch strides are unused and rows are offset by cu_seqlens.
FWD_PARAMS = ParamStruct("FwdParams", tuple(
    [("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "ptr"), ("lse", "ptr"),
     ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr")]
    + _strides("q", "k", "v", "o")
    + [("lse_batch_stride", "i64"), ("lse_head_stride", "i64"),
       ("batch", "i32"), ("nheads", "i32"), ("nheads_k", "i32"), ("head_dim", "i32"), ("head_dim_v", "i32"),
       ("seqlen_q", "i32"), ("seqlen_k", "i32"),
       ("scale_log2", "f32"),      # softmax_scale * log2(e): the kernel works in base 2
       ("scale", "f32")]
    + _DROPOUT
))

# Backward (dK/dV kernel, dQ kernel): dk/dv are per query head (GQA groups are summed afterwards);
# dq_accum is the fp32 accumulator the fused schedule adds into atomically, dq the split schedule's output.
# dsum = rowsum(dO * O) shares lse's layout.
BWD_PARAMS = ParamStruct("BwdParams", tuple(
    [("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("dout", "ptr"), ("lse", "ptr"), ("dsum", "ptr"),
     ("dq", "ptr"), ("dq_accum", "ptr"), ("dk", "ptr"), ("dv", "ptr"),
     ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr")]
    + _strides("q", "k", "v", "dout", "dq", "dq_accum", "dk", "dv")
    + [("lse_batch_stride", "i64"), ("lse_head_stride", "i64"),
       ("batch", "i32"), ("nheads", "i32"), ("nheads_k", "i32"), ("head_dim", "i32"), ("head_dim_v", "i32"),
       ("seqlen_q", "i32"), ("seqlen_k", "i32"),
       ("scale_log2", "f32"), ("scale", "f32")]
    + _DROPOUT
))

# Backward preprocess: dsum = rowsum(dO * O) in fp32, laid out like lse.
BWD_PRE_PARAMS = ParamStruct("BwdPreParams", tuple(
    [("o", "ptr"), ("dout", "ptr"), ("dsum", "ptr"), ("cu_seqlens_q", "ptr")]
    + _strides("o", "dout")
    + [("dsum_batch_stride", "i64"), ("dsum_head_stride", "i64"),
       ("batch", "i32"), ("nheads", "i32"), ("head_dim", "i32"), ("seqlen_q", "i32")]
))

# Dropout mask (tests, return_attn_probs): mask[b, h, row, col] = 1 kept / 0 dropped, uint8.
DROPOUT_MASK_PARAMS = ParamStruct("DropoutMaskParams", (
    ("mask", "ptr"), ("rng_state", "ptr"), ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"),
    ("mask_batch_stride", "i64"), ("mask_head_stride", "i64"), ("mask_row_stride", "i64"),
    ("nheads", "i32"), ("seqlen_q", "i32"), ("seqlen_k", "i32"), ("dropout_threshold", "u32"),
))

# Hopper forward: the SM80 forward's fields after four TMA tensor maps (first, so they sit 64-byte aligned) over
# (head dim, rows, heads, batch) of q, k, v and o; then the persistent walk's tile counter (an int32, zero at launch),
# whether tma_o is set (1) or O takes plain stores (0), and head_group: causal tiles heaviest first over groups of
# that many (head, batch) pairs (0: the natural order; heuristics.head_group decides, sm90_common.cuh's grouped_tile
# maps); then the split tail (heuristics.fwd_sm90_split_tail decides; fwd_sm90.cuh's kSplit): the last split_tiles
# tiles run as split_k pieces each, with their partial O (fp32, split_tiles * split_k * block_m * head_dim bucket) and
# lse (split_tiles * split_k * block_m) and a counter per tile and consumer warpgroup (int32, zero at launch).
FWD_SM90_PARAMS = ParamStruct("FwdSm90Params", (("tma_q", "tmap"), ("tma_k", "tmap"), ("tma_v", "tmap"),
                                                ("tma_o", "tmap"))
                              + FWD_PARAMS.fields + (("tile_counter", "ptr"), ("o_tma", "i32"), ("head_group", "i32"),
                                                     ("split_tiles", "i32"), ("split_k", "i32"),
                                                     ("o_partial", "ptr"), ("lse_partial", "ptr"),
                                                     ("split_counter", "ptr")))

# Hopper backward: the backward's fields after the tensor maps of q, k, v and dout (same 4-D form as the forward's),
# then head_group as the Hopper forward's; then the split tail (heuristics.bwd_sm90_split_tail decides;
# bwd_sm90.cuh's kSplit): the last split_tiles key blocks run as split_k pieces each over query ranges, with their
# fp32 dK and dV in slots of dkdv_partial (split_tiles * split_k * 2 * block_n * head_dim bucket) and a counter per
# tile in split_counter (int32, zero at launch).
BWD_SM90_PARAMS = ParamStruct("BwdSm90Params", (("tma_q", "tmap"), ("tma_k", "tmap"), ("tma_v", "tmap"),
                                                ("tma_do", "tmap")) + BWD_PARAMS.fields
                              + (("head_group", "i32"), ("split_tiles", "i32"), ("split_k", "i32"),
                                 ("dkdv_partial", "ptr"), ("split_counter", "ptr")))

ALL_PARAMS = {p.name: p for p in (FWD_PARAMS, BWD_PARAMS, BWD_PRE_PARAMS, DROPOUT_MASK_PARAMS, FWD_SM90_PARAMS,
                                  BWD_SM90_PARAMS)}


def offset_probe_source(ps: ParamStruct) -> str:
    """One tiny kernel per field, each reading only that field: NVRTC's PTX then shows the field as a
    single ld.param at the offset the compiler gave it."""
    def read(f, kind):   # a tensor map is read through its first 8 bytes
        return f"*(const unsigned long long*)&p.{f}" if kind == "tmap" else f"(unsigned long long)p.{f}"
    kernels = "".join(f"extern \"C\" __global__ void probe_{f}(const {ps.name} p, unsigned long long* out) "
                      f"{{ *out = {read(f, kind)}; }}\n" for f, kind in ps.fields)
    # Stand-in with CUtensorMap's size and alignment, so the probe needs no headers.
    tmap = ("namespace cute { struct alignas(64) TmaDescriptor { unsigned long long opaque[16]; }; }\n"
            if any(k == "tmap" for _, k in ps.fields) else "")
    return f"{tmap}{ps.cpp_decl()}\n{kernels}"
