"""The Hopper kernels' codegen on the CPU: traits, the tensor-map parameter struct, dispatch, NVRTC compiles whose
PTX uses wgmma and TMA, and the host-side TMA eligibility check."""
import dataclasses
import os
import re
import struct

import pytest
import torch

from codegen import heuristics
from codegen.params import FWD_SM90_PARAMS
from codegen.traits import FwdSm90Traits, TraitsError, traits_from_dict, traits_from_name


def test_traits_and_names():
    t = heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, True)
    assert t.name == "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_causal_sm90a" and t.num_threads == 384
    assert traits_from_name(t.name) == t and traits_from_dict(t.to_dict()) == t
    assert heuristics.fwd_sm90_traits("sm_90a", "fp16", 96, False).head_dim == 128   # TMA zero-fills 96..127
    assert heuristics.fwd_sm90_traits("sm_90a", "bf16", 256, False).smem_bytes() <= 227 * 1024
    assert heuristics.fwd_sm90_traits("sm_80", "bf16", 128, False) is None            # no wgmma
    assert heuristics.fwd_sm90_traits("sm_90a", "bf16", 320, False) is None
    ov = heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False, mainloop="overlap")
    assert ov.name == "fwd_sm90_bf16_hd128_m128n128_s2_ov_sm90a" and traits_from_name(ov.name) == ov
    se = heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, True, 128, 160, "serial")
    assert se.name == "fwd_sm90_bf16_hd128_m128n160_s2_causal_sm90a" and traits_from_name(se.name) == se
    with pytest.raises(TraitsError, match="ping-pong"):
        FwdSm90Traits("sm_90a", "bf16", 128, 128, 128, 2, False, False, True).validate()
    with pytest.raises(TraitsError, match="sm_90a only"):
        FwdSm90Traits("sm_100a", "bf16").validate()
    with pytest.raises(TraitsError, match="spill"):
        FwdSm90Traits("sm_90a", "bf16", 256, 128, 144, 1).validate()
    # Dropout: FWD_SM90_DROPOUT_MAINLOOP, at most 128 rows, block_n a multiple of 32 (hdim 256's 80 keys -> 64).
    d = heuristics.fwd_sm90_traits("sm_90a", "bf16", 256, True, dropout=True)
    assert (d.pingpong, d.dropout, d.name) == (True, True, "fwd_sm90_bf16_hd256_m128n64_s2_ov_pp_causal_dropout_sm90a")
    assert traits_from_name(d.name) == d
    with pytest.raises(TraitsError, match="dropout"):
        heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False, 128, 176, mainloop="overlap", dropout=True)
    ps = heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, True, mainloop="pingpong", persistent=True)
    assert ps.name == "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_ps_causal_sm90a" and traits_from_name(ps.name) == ps
    assert not heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, True).persistent   # the table's kernels
    edv = heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, True, dq_red=False)   # the table's early_dv key
    assert edv.name == "bwd_sm90_bf16_hd64_m64n128_s3_ls_edv_ho_causal_sm90a" and traits_from_name(edv.name) == edv
    assert not heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, True, dropout=True).early_dv
    with pytest.raises(TraitsError, match="early_dv"):
        heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, True, dropout=True, early_dv=True)
    # dq_handoff: the warpgroups fill one dQ stage in turns (64 x 64 floats) instead of one each
    meet = heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, True, dq_handoff=False, dq_red=False)
    assert edv.dq_handoff and edv.smem_bytes() == meet.smem_bytes() - 64 * 64 * 4
    # dq_red (the table's hdim 64 causal key, dropout-free): dQ by reds from registers, no stage in shared memory;
    # not at head dim 256, whose warpgroups each hold 64 x 128 of dQ
    red = heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, True)
    assert red.name == "bwd_sm90_bf16_hd64_m64n128_s3_ls_edv_ho_red_causal_sm90a" and traits_from_name(red.name) == red
    assert red.smem_bytes() == edv.smem_bytes() - 64 * 64 * 4 and red.dq_red
    # with dropout: the hdim 64 kernels (64-row blocks, dq_handoff, causal or not) and hdim 128 causal red
    assert all(heuristics.bwd_sm90_traits("sm_90a", "bf16", hd, c, dropout=True).dq_red
               for hd, c in ((64, False), (64, True), (128, True)))
    assert not heuristics.bwd_sm90_traits("sm_90a", "bf16", 128, False, dropout=True).dq_red
    assert not any(heuristics.bwd_sm90_traits("sm_90a", "bf16", hd, c).dq_red for hd in (64, 128, 256)
                   for c in (False, True) if (hd, c) != (64, True))
    assert heuristics.bwd_sm90_traits("sm_90a", "bf16", 128, False, dq_red=True).smem_bytes() == \
        heuristics.bwd_sm90_traits("sm_90a", "bf16", 128, False).smem_bytes() - 2 * 64 * 64 * 4
    with pytest.raises(TraitsError, match="dq_red"):
        heuristics.bwd_sm90_traits("sm_90a", "bf16", 256, False, dq_red=True)
    # hdim 64 non-causal: 128-row query blocks whose dQ the warpgroups split by rows (a 64 x 64 stage each), 2 Q/dO
    # stages; dropout keeps 64-row blocks, and 128 rows take no dq handoff, dropout, other head dims or block_n
    rows = heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, False)
    assert rows.name == "bwd_sm90_bf16_hd64_m128n128_s2_ls_sm90a" and traits_from_name(rows.name) == rows
    assert rows.smem_bytes() == (2 * 2 * 128 * 64 + 2 * 128 * 64 + 2 * 128 * 128) * 2 + 2 * 64 * 64 * 4 + 5 * 8 \
        + 2 * 2 * 2 * 128 * 4
    assert heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, False, dropout=True).block_m == 64
    assert not heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, False, early_dv=True).dq_handoff
    for bad in (dict(block_n=64), dict(dq_handoff=True), dict(dropout=True)):
        with pytest.raises(TraitsError, match="block_m"):
            dataclasses.replace(rows, **bad).validate()
    with pytest.raises(TraitsError, match="dq_handoff"):
        heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, False, tiles=(64, 64, 2), dq_handoff=True)
    # dropout: the warp pairs' keep-flag exchange, two buffers of 64 words per pair
    drop = heuristics.bwd_sm90_traits("sm_90a", "bf16", 128, False, dropout=True)
    assert drop.smem_bytes() == heuristics.bwd_sm90_traits("sm_90a", "bf16", 128, False).smem_bytes() + 4 * 2 * 64 * 4
    ls = heuristics.bwd_sm90_traits("sm_90a", "bf16", 128, True, lse_smem=True)
    assert ls.name == "bwd_sm90_bf16_hd128_m64n128_s2_ls_causal_sm90a" and traits_from_name(ls.name) == ls
    assert ls.smem_bytes() == heuristics.bwd_sm90_traits("sm_90a", "bf16", 128, True, lse_smem=False).smem_bytes() + 2 * 2 * 2 * 64 * 4


def _wgmma_a_operands(ptx: str) -> list:
    """(shape, first token of the A operand) of each bf16 wgmma in the PTX: `%rd..` for a shared-memory descriptor,
    `{` for a register fragment."""
    return re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)\.f32\.bf16\.bf16 +\{[^}]*\}, *([%{\w]+)", ptx)


def test_persistent_kernel_walks_tiles():
    """The persistent variant compiles with no GPU: the producer takes tiles from the global counter (an atomic add
    offset by gridDim.x), Q is double-buffered where shared memory allows (hdim 256 keeps one buffer), and a fence
    orders O's generic stores before the next Q's TMA into the same buffer."""
    from codegen.render import render
    from flashgen import compiler
    t = heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False, persistent=True)
    assert t.q_bufs == 2 and heuristics.fwd_sm90_traits("sm_90a", "bf16", 256, False, persistent=True).q_bufs == 1
    assert t.smem_bytes() - heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False).smem_bytes() == \
        128 * 128 * 2 + 4 * 8 + 2 * 16   # the second Q buffer, its 2 barriers, an O-ready barrier each, 2 tile slots
    src = render(t)
    assert "FwdSm90<cutlass::bfloat16_t, 128, 128, 128, 2, false, true, true, false, true, 2, false, true>" in src
    res = compiler.compile_source(src, t.name, t.arch, "<memory>", ptx=True)
    assert "fence.proxy.async.shared::cta" in res.ptx and "nctaid.x" in res.ptx and "atom.global.add" in res.ptx
    # The producer (24 registers after setmaxnreg) walks its K/V loop one block per iteration: unrolled, the walk's
    # state spilled (144 B), the SASS check.
    assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0"], res.log


def test_one_buffer_walk_aligns_tile_slot():
    """hdim 256's walk has one Q buffer, so an odd count of mbarriers (Q full / empty / O ready and the ring's): the
    barrier region is rounded up to 16 bytes, or the int4 tile slot after it faults (misaligned address) on the GPU.
    The header's static_assert checks the alignment; the compile here runs it."""
    from codegen.render import render
    from flashgen import compiler
    t = heuristics.fwd_sm90_traits("sm_90a", "bf16", 256, False, persistent=True)
    grid = dataclasses.replace(t, persistent=False)
    assert t.q_bufs == 1 and t.smem_bytes() - grid.smem_bytes() == 16 + 16   # 11 barriers round up to 12; a tile slot
    # Compiles (dispatch keeps hdim 256 on the grid, so this walk only runs when forced; ptxas spills 28-32 B in it).
    assert compiler.compile_source(render(t), t.name, t.arch, "<memory>").cubin


@pytest.fixture(scope="module")
def split_fwd():
    """The hdim 128 non-causal Hopper forward with 192 x 80 tiles (the split tail's kernel), its source and one NVRTC
    compile of it with the PTX kept: shared by the tests that read a Hopper forward's PTX or ptxas log."""
    from codegen.render import render
    from flashgen import compiler
    t = heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False, 192, 80, "overlap", 4)
    src = render(t)
    return t, src, compiler.compile_source(src, t.name, t.arch, "<memory>", ptx=True)


def test_stale_max_first_try(split_fwd):
    """The overlapped loops of head dims up to 128 take each block's P with the running max first and vote over the
    warpgroup (bar.red.or) on redoing it exactly; hdim 256 and the serial loop keep the block's row max."""
    t, src, res = split_fwd
    assert t.stale_max and src.count(", true>;") == 1   # the kernel's last template argument
    assert "bar.red.or.pred" in res.ptx
    assert not heuristics.fwd_sm90_traits("sm_90a", "bf16", 256, False).stale_max
    assert not heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False, 128, 128, "serial").stale_max


def test_split_tail_kernel_and_estimate(monkeypatch, split_fwd):
    """Non-causal grid kernels can run the last wave's tiles as pieces over key ranges (FwdSm90Traits.split_tail): the
    kernel counts pieces with a global atomic and compiles spill-free; causal, dropout and persistent kernels carry no
    split code. The launch splits where the estimate says the last wave shortens: halves for a partial last wave of a
    long launch (hdim 128 8k: 1376 tiles on 132 SMs), more pieces for a launch that fills no wave, none for a full
    last wave or tiles of few key blocks."""
    from codegen.render import render
    t, src, res = split_fwd
    assert t.split_tail and not t.persistent
    for other in (dataclasses.replace(t, causal=True), dataclasses.replace(t, dropout=True, block_m=128, block_n=64),
                  dataclasses.replace(t, persistent=True)):
        # kSplit is the kernel's next-to-last template argument (kStaleMax the last)
        assert not other.split_tail and re.search(r"(\w+), \w+>;", render(other)).group(1) == "false"
    assert "FwdSm90<cutlass::bfloat16_t, 128, 192, 80, 4, false, true, false, false, false, 1, true, true>" in src
    assert "atom.global.add" in res.ptx
    assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0"], res.log
    split = heuristics.fwd_sm90_split_tail
    assert split(1376, 132, 103) == (56, 2)        # hdim 128 8k: 56 tiles in the last wave, halved
    assert split(1024, 132, 103) == (0, 1)         # hdim 256 8k: 100 of 132, halves would take two rounds
    assert split(1320, 132, 103) == (0, 1)         # a full last wave
    assert split(86, 132, 103) == (86, 3)          # less than a wave: thirds fill 2 rounds of 132
    assert split(40, 132, 9) == (40, 2) and split(40, 132, 7) == (0, 1)   # pieces of >= 4 key blocks
    monkeypatch.setattr(heuristics, "FWD_SM90_SPLIT", 0)
    assert split(1376, 132, 103) == (0, 1)
    monkeypatch.setattr(heuristics, "FWD_SM90_SPLIT", 7)   # forced (tests): the last wave's tiles, or all of them
    assert split(1376, 132, 103) == (56, 7) and split(90, 132, 3) == (90, 3) and split(264, 132, 50) == (132, 7)


def test_causal_head_groups():
    """Causal Hopper launches group heads so that about the table's CTA count runs heaviest block first (at least one
    pair, at most all); non-causal launches and buckets outside the table keep the natural order (0)."""
    table = {128: 256}
    assert heuristics.head_group(table, 128, True, 16, 128) == 16      # 2k keys in 128-key blocks: 16 x 16 CTAs
    assert heuristics.head_group(table, 128, True, 64, 32) == 4
    assert heuristics.head_group(table, 128, True, 300, 32) == 1
    assert heuristics.head_group(table, 128, True, 16, 5) == 5
    assert heuristics.head_group(table, 128, False, 16, 128) == 0
    assert heuristics.head_group(table, 64, True, 16, 128) == 0
    assert heuristics.head_group(table, 128, True, 0, 128) == 0
    for tab in (heuristics.FWD_SM90_HEAD_GROUP_CTAS, heuristics.BWD_SM90_HEAD_GROUP_CTAS):
        assert set(tab) <= {64, 128, 192, 256} and all(v > 0 for v in tab.values())


def test_dispatch_walks_short_sequences_persistently(monkeypatch):
    """The Hopper forward walks its tiles persistently up to the seqlen bucket heuristics.FWD_SM90_PERSISTENT_SEQLEN
    gives its head-dim bucket (max of seqlen_q and seqlen_k); longer or unknown seqlens, hdim 256 and dropout take the
    grid, a tuning file's tiles take the same walk, FWD_SM90_PERSISTENT forces one, and the tuner times each walk."""
    from flashgen import dispatch, tuning
    fwd = lambda hd, sq, sk, **kw: dispatch.fwd_traits("sm_90a", None, "bf16", hd, kw.pop("causal", False),
                                                       seqlen_q=sq, seqlen_k=sk, hopper=True, **kw)
    assert heuristics.FWD_SM90_PERSISTENT is None and set(heuristics.FWD_SM90_PERSISTENT_SEQLEN) == {64, 128}
    for hd in (40, 64, 96, 128):
        t = fwd(hd, 2048, 2048)
        assert t.family == "fwd_sm90" and t.persistent and t.q_bufs == 2, t.name
        assert fwd(hd, 1000, 2048, causal=True).persistent
        assert not fwd(hd, 2048, 2049).persistent and not fwd(hd, 8192, 8192).persistent
        assert not fwd(hd, 2048, 2048, dropout=True).persistent
        assert not fwd(hd, 0, 0).persistent   # seqlens unknown
    assert not fwd(256, 2048, 2048).persistent and not fwd(192, 1024, 1024).persistent
    entry = tuning.Entry(dtype="bf16", hdim=128, causal=False, seqlen=2048, fwd_sm90=(128, 160, "serial"))
    monkeypatch.setattr(dispatch, "_tuned", lambda *a: entry)
    assert fwd(128, 2048, 2048).name == "fwd_sm90_bf16_hd128_m128n160_s2_ps_sm90a"
    lines = dispatch.explain("sm_90a", "a GPU", "bf16", 128, False, 8, 16, 2048, 2048)
    assert any("persistent walk" in line for line in lines), lines
    monkeypatch.undo()
    # The tuner compiles and times each Hopper candidate in the walk of the seqlen it tunes.
    from flashgen import tuner
    names = set(tuner.kernels_of("sm_90a", "bf16", 128, False,
                                 {"fwd": [], "bwd": [], "fwd_sm90": {b: [(128, 128, "overlap")] for b in (2048, 8192)}}))
    assert names == {"fwd_sm90_bf16_hd128_m128n128_s2_ov_ps_sm90a", "fwd_sm90_bf16_hd128_m128n128_s2_ov_sm90a"}
    monkeypatch.setattr(heuristics, "FWD_SM90_PERSISTENT", True)
    assert fwd(256, 8192, 8192).persistent and fwd(128, 0, 0).persistent


def test_dispatch_takes_shape_tiles_without_tuning_file():
    """A GPU without a tuning file (an H200) runs heuristics.FWD_SM90_SHAPE_TILES' choice for its head-dim bucket,
    causal flag and seqlen bucket, stages included; unknown seqlens, dropout and any tile override keep the bucket's."""
    from flashgen import dispatch
    fwd = lambda hd, s, causal=False, **kw: dispatch.fwd_traits("sm_90a", "NVIDIA H200", "bf16", hd, causal,
                                                                seqlen_q=s, seqlen_k=s, hopper=True, **kw)
    assert fwd(128, 8192).name == "fwd_sm90_bf16_hd128_m192n80_s4_ov_sm90a"
    assert fwd(128, 16384).name == fwd(128, 8192).name   # the 32768 bucket takes longer seqlens too
    assert fwd(120, 2000).name == "fwd_sm90_bf16_hd128_m192n80_s3_ov_ps_sm90a"   # walked, its third K/V stage
    assert fwd(128, 2048, True).name == "fwd_sm90_bf16_hd128_m128n128_s2_ov_ps_causal_sm90a"
    assert fwd(256, 2048, True).name == "fwd_sm90_bf16_hd256_m128n64_s2_ov_pp_causal_sm90a"
    table = heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False)
    assert (table.block_m, table.block_n, table.stages) == (128, 128, 2)   # seqlen unknown: the bucket's
    assert fwd(128, 8192, dropout=True).name == "fwd_sm90_bf16_hd128_m128n128_s2_ov_pp_dropout_sm90a"
    assert heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, False, mainloop="pingpong", seqlen=8192).stages == 2
    for (bucket, causal, seqlen), (m, n, stages, mainloop) in heuristics.FWD_SM90_SHAPE_TILES.items():
        assert seqlen in heuristics.SEQLEN_BUCKETS and mainloop in heuristics.FWD_SM90_MAINLOOPS
        t = heuristics.fwd_sm90_traits("sm_90a", "fp16", bucket, causal, seqlen=seqlen)
        assert (t.block_m, t.block_n, t.stages, heuristics.sm90_mainloop(t)) == (m, n, stages, mainloop)
        assert t in heuristics.default_set("sm_90a", ("fp16",), (bucket,), ("fwd",))   # generated with the rest
    line = dispatch.explain("sm_90a", "NVIDIA H200", "bf16", 128, False, 2, 16, 8192, 8192)
    assert any("from heuristics.FWD_SM90_SHAPE_TILES" in x for x in line), line


def test_params_put_tensor_maps_first_and_aligned():
    fields = {f: off for f, _, off in FWD_SM90_PARAMS.layout()[0]}
    assert (fields["tma_q"], fields["tma_k"], fields["tma_v"], fields["tma_o"]) == (0, 128, 256, 384)
    blob = bytes(range(128))
    packed = FWD_SM90_PARAMS.pack({"tma_k": blob, "seqlen_q": 7})
    assert packed[128:256] == blob and packed[:128] == bytes(128)
    assert struct.unpack_from("<i", packed, fields["seqlen_q"])[0] == 7


def test_dispatch_opt_in(monkeypatch):
    from flashgen import dispatch
    assert dispatch.fwd_traits("sm_90a", None, "bf16", 128, False).family == "fwd"
    t = dispatch.fwd_traits("sm_90a", None, "bf16", 128, False, hopper=True)
    assert t.family == "fwd_sm90"
    # Dropout takes FWD_SM90_DROPOUT_MAINLOOP with at most two consumer warpgroups; a separate V head dim and other
    # archs stay on the SM80 path.
    drop = dispatch.fwd_traits("sm_90a", None, "bf16", 64, False, dropout=True, hopper=True)
    assert drop.name == "fwd_sm90_bf16_hd64_m128n128_s2_ov_pp_dropout_sm90a"
    # A tuning file's Hopper choice was timed without dropout: dropout keeps the table's.
    from flashgen import tuning
    entry = tuning.Entry(dtype="bf16", hdim=128, causal=True, seqlen=8192, fwd_sm90=(128, 160, "serial"))
    monkeypatch.setattr(dispatch, "_tuned", lambda *a: entry)
    assert dispatch.fwd_traits("sm_90a", "a GPU", "bf16", 128, True, hopper=True).name == \
        "fwd_sm90_bf16_hd128_m128n160_s2_causal_sm90a"
    assert dispatch.fwd_traits("sm_90a", "a GPU", "bf16", 128, True, dropout=True, hopper=True) == \
        heuristics.fwd_sm90_traits("sm_90a", "bf16", 128, True, dropout=True)
    monkeypatch.undo()
    # FWD_SM90_SHORT_SEQLEN keeps a head-dim bucket's short sequences on the SM80 forward; empty by default (the
    # persistent walk measured faster there).
    short = dict(seqlen_q=512, seqlen_k=512, hopper=True)
    assert dispatch.fwd_traits("sm_90a", None, "bf16", 96, False, **short).family == "fwd_sm90"
    monkeypatch.setattr(heuristics, "FWD_SM90_SHORT_SEQLEN", {128: 512})
    assert dispatch.fwd_traits("sm_90a", None, "bf16", 96, False, **short).family == "fwd"
    assert dispatch.fwd_traits("sm_90a", None, "bf16", 256, False, **short).family == "fwd_sm90"
    monkeypatch.undo()
    assert dispatch.fwd_traits("sm_90a", None, "bf16", 96, False, seqlen_q=2048, seqlen_k=2048,
                               hopper=True).family == "fwd_sm90"
    assert dispatch.fwd_traits("sm_90a", None, "bf16", 192, False, head_dim_v=128, hopper=True).family == "fwd"
    assert dispatch.fwd_traits("sm_80", None, "bf16", 128, False, hopper=True).family == "fwd"
    monkeypatch.delenv("FLASHGEN_HOPPER", raising=False)
    assert dispatch.hopper_enabled()                   # the default on compute capability 9.0
    with dispatch.hopper_forward(False):               # the tuner's and benchmarks' switch, restored after
        assert not dispatch.hopper_enabled()
    assert dispatch.hopper_enabled() and "FLASHGEN_HOPPER" not in os.environ
    monkeypatch.setenv("FLASHGEN_HOPPER", "0")
    assert not dispatch.hopper_enabled()
    with dispatch.hopper_forward(True):
        assert dispatch.hopper_enabled()
    assert not dispatch.hopper_enabled()
    # The table picks each bucket's mainloop; FWD_SM90_MAINLOOP forces one for all.
    assert heuristics.fwd_sm90_traits("sm_90a", "bf16", 64, False).name == "fwd_sm90_bf16_hd64_m192n128_s2_ov_sm90a"
    assert heuristics.fwd_sm90_traits("sm_90a", "bf16", 256, False).overlap
    monkeypatch.setattr(heuristics, "FWD_SM90_MAINLOOP", "serial")
    assert not heuristics.fwd_sm90_traits("sm_90a", "bf16", 256, False).overlap
    # Ping-pong takes turns between exactly two consumer warpgroups: 128 rows whatever the table's block_m.
    monkeypatch.setattr(heuristics, "FWD_SM90_MAINLOOP", "pingpong")
    assert heuristics.fwd_sm90_traits("sm_90a", "bf16", 64, False).block_m == 128


def test_tma_eligibility():
    from flashgen import tma
    q = torch.empty(2, 64, 4, 128, dtype=torch.bfloat16)
    assert tma.supported(q, q, q)
    assert not tma.supported(q[..., 1:121])                    # base not 16-byte aligned
    odd = torch.empty(2, 64, 4, 132, dtype=torch.bfloat16)[..., :128]
    assert not tma.supported(odd)                              # row stride 264 bytes: not a multiple of 16
    assert tma.supported(torch.empty(2, 64, 3, 4, 128, dtype=torch.bfloat16)[:, :, 1])   # packed qkv view


def test_compiles_to_wgmma_and_tma(split_fwd):
    """NVRTC compiles a Hopper kernel with no GPU; its PTX issues wgmma, 4-D TMA loads and setmaxnreg."""
    ptx = split_fwd[2].ptx
    for needle in ("wgmma.mma_async", "cp.async.bulk.tensor.4d", "setmaxnreg.inc", "setmaxnreg.dec",
                   "mbarrier.try_wait.parity"):
        assert needle in ptx, needle


# ---- the Hopper backward


def test_backward_traits_dispatch_and_launch_choice(monkeypatch):
    from flashgen import dispatch
    t = heuristics.bwd_sm90_traits("sm_90a", "bf16", 72, True)
    assert t.name == "bwd_sm90_bf16_hd128_m64n128_s2_ls_causal_sm90a" and t.num_threads == 384
    assert traits_from_name(t.name) == t and traits_from_dict(t.to_dict()) == t
    assert t.smem_bytes() <= 227 * 1024
    assert heuristics.bwd_sm90_traits("sm_90a", "fp16", 32, False).head_dim == 64
    assert heuristics.bwd_sm90_traits("sm_90a", "bf16", 136, False).head_dim == 256   # no 192 bucket: padded to 256
    assert heuristics.bwd_sm90_traits("sm_90a", "bf16", 264, False) is None   # above 256: the SM80 kernels
    assert heuristics.bwd_sm90_traits("sm_80", "bf16", 64, False) is None     # no wgmma
    with pytest.raises(TraitsError, match="block_m"):
        heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, False, (128, 64, 1))
    # On by default, dropout included; off with FLASHGEN_HOPPER_BWD=0 or the benchmarks' switch; never for
    # head_dim_v != head_dim or tensors TMA cannot describe (the launch then runs the SM80 kernels).
    monkeypatch.setattr(dispatch, "device_arch", lambda i: "sm_90a")
    monkeypatch.setattr(dispatch, "get_kernel", lambda traits: traits)   # the traits stand in for the kernel
    dispatch._bwd_sm90_kernel.cache_clear()
    monkeypatch.delenv("FLASHGEN_HOPPER_BWD", raising=False)
    pick = lambda **kw: dispatch.bwd_sm90_kernel(0, torch.bfloat16, 128, False, **{"tma_ok": True, **kw})
    assert pick().name == "bwd_sm90_bf16_hd128_m64n128_s2_ls_sm90a" and pick().dq_accum_width == 128
    assert pick(dropout=True).name == "bwd_sm90_bf16_hd128_m64n128_s2_ls_dropout_sm90a"
    assert traits_from_name(pick(dropout=True).name) == pick(dropout=True)
    assert pick(head_dim_v=64) is None and pick(tma_ok=False) is None
    with dispatch.hopper_backward(False):
        assert pick() is None
    assert pick() is not None and "FLASHGEN_HOPPER_BWD" not in os.environ
    dispatch._bwd_sm90_kernel.cache_clear()
    assert any(line.startswith("hopper backward: bwd_sm90_bf16_hd64")
               for line in dispatch.explain("sm_90a", None, "bf16", 64, False))
    assert {"bwd_sm90_bf16_hd64_m128n128_s2_ls_sm90a", "bwd_sm90_bf16_hd64_m64n128_s3_ls_edv_ho_red_causal_sm90a"} <= \
        {k.name for k in heuristics.default_set("sm_90a", ("bf16",), (64,))}


def test_backward_hdim256_column_split():
    """Head dims 193..256: one 64-key block whose two consumer warpgroups split dK's and dV's columns, P^T and dS^T
    through shared memory (two buffers each); no early_dv or dq_handoff variant; with dropout, lse and D in registers
    and the warp pairs' keep-flag exchange on the non-causal kernel only. Compiles with NVRTC: every
    GEMM a wgmma from shared memory (no register A operand), the dQ shares bulk-reduced."""
    from codegen.render import render
    from flashgen import compiler
    t = heuristics.bwd_sm90_traits("sm_90a", "bf16", 200, False)
    assert t.name == "bwd_sm90_bf16_hd256_m64n64_s1_sm90a" and t.col_split and t.num_threads == 384
    assert traits_from_name(t.name) == t
    # Q, dO (one stage), K, V of 64 x 256; 2 dS + 2 P^T buffers of 64 x 64; two 64 x 128 fp32 dQ shares; 3 mbarriers
    assert t.smem_bytes() == (4 * 64 * 256 + 4 * 64 * 64) * 2 + 2 * 64 * 128 * 4 + 3 * 8 <= 227 * 1024
    drop = heuristics.bwd_sm90_traits("sm_90a", "bf16", 256, False, dropout=True)
    assert drop.name == "bwd_sm90_bf16_hd256_m64n64_s1_dropout_sm90a" and drop.smem_bytes() <= 227 * 1024
    assert drop.smem_bytes() == t.smem_bytes() + 2 * 2 * 2 * 64 * 4   # two warp pairs per warpgroup, two buffers
    drop_causal = heuristics.bwd_sm90_traits("sm_90a", "bf16", 256, True, dropout=True)
    assert drop_causal.smem_bytes() == t.smem_bytes() and not drop_causal.lse_smem
    assert not heuristics.bwd_sm90_traits("sm_90a", "bf16", 256, True).early_dv
    for bad in (dict(early_dv=True), dict(dq_handoff=True), dict(tiles=(64, 128, 1))):
        with pytest.raises(TraitsError, match="head_dim 256"):
            heuristics.bwd_sm90_traits("sm_90a", "bf16", 256, False, **bad)
    res = compiler.compile_source(render(t), t.name, t.arch, "<memory>", ptx=True)
    ptx = res.ptx
    assert "wgmma.mma_async.sp" not in ptx and "cp.reduce.async.bulk.global" in ptx
    wgmmas = _wgmma_a_operands(ptx)
    # S^T, dP^T: 64 x 32 per warpgroup; dV, dK, dQ: 64 x 128; A always a shared-memory descriptor (a 64-bit register)
    assert {shape for shape, _ in wgmmas} == {"m64n32k16", "m64n128k16"}, set(wgmmas)
    assert all(a.startswith("%rd") for _, a in wgmmas), wgmmas[:4]
    assert "C7515" not in res.log, res.log   # ptxas did not serialise the wgmma
    # No spills: the epilogue's tile offsets come through shared memory (204 B without), and store_pairs swizzles
    # 32-bit shared-memory addresses (36 B of 64-bit ones spilled)
    assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0", "0"], res.log


def test_backward_split_tail_kernel_and_estimate(monkeypatch):
    """Non-causal Hopper backwards up to head dim 128 can run the last wave's key blocks as pieces over query ranges
    (BwdSm90Traits.split_tail, bwd_sm90.cuh's kSplit); causal, dropout and head dim 256 kernels carry no split code.
    The launch splits where the estimate says the last wave shortens: the benchmark shapes' grids end on 4 of 132 key
    blocks (hdim 64: 4096 = 31 x 132 + 4) or 68 (hdim 128: 2048), a full last wave or pieces of fewer than 4 query
    blocks take none."""
    from codegen.render import render
    for head_dim in (64, 128):
        t = heuristics.bwd_sm90_traits("sm_90a", "bf16", head_dim, False)
        assert t.split_tail and render(t).count(", true, false>;") == 1 and "split_tail=true" in render(t)
        for other in (heuristics.bwd_sm90_traits("sm_90a", "bf16", head_dim, True),
                      heuristics.bwd_sm90_traits("sm_90a", "bf16", head_dim, False, dropout=True)):
            assert not other.split_tail and "split_tail=false" in render(other)
    assert not heuristics.bwd_sm90_traits("sm_90a", "bf16", 256, False).split_tail
    split = heuristics.bwd_sm90_split_tail
    assert split(4096, 132, 16) == (4, 4) and split(4096, 132, 64) == (4, 8)      # hdim 64 2k / 8k
    assert split(2048, 132, 32) == (68, 3) and split(2048, 132, 128) == (68, 5)   # hdim 128 2k / 8k
    assert split(2112, 132, 32) == (0, 1)                                         # a full last wave
    assert split(100, 132, 6) == (0, 1) and split(40, 132, 1) == (0, 1)           # pieces of >= 4 query blocks
    monkeypatch.setattr(heuristics, "BWD_SM90_SPLIT", 0)
    assert split(4096, 132, 16) == (0, 1)
    monkeypatch.setattr(heuristics, "BWD_SM90_SPLIT", 5)   # forced (tests): the last wave's key blocks, or all of them
    assert split(2048, 132, 32) == (68, 5) and split(100, 132, 3) == (100, 3)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_backward_noncausal_spill_free(head_dim):
    """The hdim 128 and 64 non-causal Hopper backwards compile without local-memory spills (the issue's SASS check).
    hdim 128: its loop never spilled, and its epilogue's dK / dV addresses are computed only after the barrier that
    ends the accumulators' shared-memory stores (100 B of spills when they were computed up front). hdim 64 (128-row
    query blocks): with S^T's accumulator declared outside the query walk, which tests at its end, ptxas no longer
    keeps the warpgroup's dK / dV offset on the stack (4 B before; twenty-eighth session). Both carry the split tail's
    code, which moves its slots by bulk copies (per-thread global addresses there spilled 4 B of the hdim 64 loop)."""
    from codegen.render import render
    from flashgen import compiler
    t = heuristics.bwd_sm90_traits("sm_90a", "bf16", head_dim, False)
    assert t.block_m == {128: 64, 64: 128}[head_dim]
    res = compiler.compile_source(render(t), t.name, t.arch, "<memory>")
    assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0", "0"], res.log   # both entry points
    assert "C751" not in res.log, res.log


def test_backward_compiles_to_wgmma_with_register_operands():
    """The Hopper backward compiles with NVRTC: wgmma, 4-D TMA loads, dQ's 16-byte reds (dq_red), its convert entry,
    K and V as the register A operands of S^T and dP^T (hdim 64), and no local-memory spills (8 B before store_pairs
    swizzled 32-bit shared-memory addresses)."""
    from codegen.render import render
    from flashgen import compiler
    t = heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, True)
    res = compiler.compile_source(render(t), t.name, t.arch, "<memory>", ptx=True)
    ptx = res.ptx
    assert t.dq_red
    for needle in ("wgmma.mma_async", "cp.async.bulk.tensor.4d", "setmaxnreg.inc", "red.relaxed.gpu.global.add.v4.f32",
                   f".entry {t.name}_convert_dq"):
        assert needle in ptx, needle
    assert "cp.reduce.async.bulk.global" not in ptx   # no shared-memory stage
    assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0", "0"], res.log   # both entry points
    assert "C751" not in res.log, res.log                     # C7510..C7519: ptxas serialised the wgmma
    wgmmas = _wgmma_a_operands(ptx)
    # only dQ (8 k-steps over 128 keys) reads A from shared memory; S^T, dP^T, dV and dK (4 k-steps each, dK issued
    # in both branches of the dQ turn) from registers
    assert sum(a.startswith("%rd") for _, a in wgmmas) == 8 and sum(a.startswith("{") for _, a in wgmmas) == 20


def test_backward_split_schedule_traits_and_dispatch(monkeypatch):
    """The Hopper split schedule (deterministic=True, backward_impl="split"): the fused kernel without dQ for dK and dV
    (names end in _dkdv, no dQ stages, none of dQ's options, no split tail) and a dQ kernel over query blocks; both in
    the default set; dispatch picks them for calls that TMA can describe, with dropout too."""
    from flashgen import dispatch
    dkdv, dq = heuristics.bwd_sm90_split_traits("sm_90a", "bf16", 72, True)
    fused = heuristics.bwd_sm90_traits("sm_90a", "bf16", 72, True)
    assert dkdv.name == "bwd_sm90_bf16_hd128_m64n128_s2_ls_dkdv_causal_sm90a" and not dkdv.split_tail
    assert dq.name == "bwd_dq_sm90_bf16_hd128_m192n64_s2_causal_sm90a" and dq.num_threads == 512   # 3 consumer WGs
    for t in (dkdv, dq):
        assert traits_from_name(t.name) == t and traits_from_dict(t.to_dict()) == t and t.smem_bytes() <= 227 * 1024
    assert dkdv.smem_bytes() == fused.smem_bytes() - 2 * 64 * 64 * 4   # the two warpgroups' fp32 dQ shares
    wide_dkdv, wide_dq = heuristics.bwd_sm90_split_traits("sm_90a", "fp16", 200, False)
    assert wide_dkdv.col_split and wide_dkdv.stages == 2 and wide_dq.num_threads == 256   # one consumer warpgroup
    assert wide_dq.name == "bwd_dq_sm90_fp16_hd256_m64n48_s3_ov_sm90a" and not dq.overlap   # the overlapped loop
    # With dropout the dQ kernel's key blocks are whole 32-key Philox blocks.
    wide_drop = heuristics.bwd_sm90_split_traits("sm_90a", "fp16", 200, False, dropout=True)[1]
    assert wide_drop.name == "bwd_dq_sm90_fp16_hd256_m64n32_s3_ov_dropout_sm90a" and wide_drop.smem_bytes() <= 227 * 1024
    with pytest.raises(TraitsError, match="overlap"):
        dataclasses.replace(dq, overlap=True, stages=1).validate()
    assert heuristics.bwd_sm90_split_traits("sm_90a", "bf16", 264, False) is None
    assert heuristics.bwd_sm90_split_traits("sm_80", "bf16", 64, False) is None
    assert not dataclasses.replace(fused, dq=False).split_tail
    with pytest.raises(TraitsError, match="without dQ"):   # hdim 64 causal takes early_dv, dq_handoff and dq_red
        dataclasses.replace(heuristics.bwd_sm90_traits("sm_90a", "bf16", 64, True), dq=False).validate()
    with pytest.raises(TraitsError, match="would spill"):
        heuristics.bwd_sm90_split_traits("sm_90a", "bf16", 256, False, dq_tiles=(64, 64, 2))
    with pytest.raises(TraitsError, match="would spill"):   # three warpgroups have 160 registers a thread
        heuristics.bwd_sm90_split_traits("sm_90a", "bf16", 128, False, dq_tiles=(192, 96, 2))
    names = {k.name for k in heuristics.default_set("sm_90a", ("bf16",), (64,))}
    assert {"bwd_sm90_bf16_hd64_m128n128_s2_ls_dkdv_sm90a", "bwd_dq_sm90_bf16_hd64_m192n64_s2_causal_sm90a"} <= names
    monkeypatch.setattr(dispatch, "device_arch", lambda i: "sm_90a")
    monkeypatch.setattr(dispatch, "get_kernel", lambda traits: traits)
    dispatch._bwd_sm90_split_kernels.cache_clear()
    monkeypatch.delenv("FLASHGEN_HOPPER_BWD", raising=False)
    pick = lambda **kw: dispatch.bwd_sm90_split_kernels(0, torch.bfloat16, 128, False, **{"tma_ok": True, **kw})
    assert [t.name for t in pick()] == ["bwd_sm90_bf16_hd128_m64n128_s2_ls_dkdv_sm90a",
                                        "bwd_dq_sm90_bf16_hd128_m192n64_s2_sm90a"]
    # hdim 128's dropout dQ kernel keeps two warpgroups (at 192 rows it spills 8 B)
    assert [t.name for t in pick(dropout=True)] == ["bwd_sm90_bf16_hd128_m64n128_s2_ls_dkdv_dropout_sm90a",
                                                    "bwd_dq_sm90_bf16_hd128_m128n64_s2_dropout_sm90a"]
    assert all(traits_from_name(t.name) == t for t in pick(dropout=True))
    assert pick(head_dim_v=64) is None and pick(tma_ok=False) is None
    with dispatch.hopper_backward(False):
        assert pick() is None
    dispatch._bwd_sm90_split_kernels.cache_clear()
    assert any(line.startswith("hopper split backward: bwd_sm90_bf16_hd64_m128n128_s2_ls_dkdv_sm90a + bwd_dq_sm90")
               for line in dispatch.explain("sm_90a", None, "bf16", 64, False))


def test_backward_split_schedule_compiles_deterministic():
    """Both kernels of the Hopper split schedule compile with NVRTC, spill-free and without serialised wgmmas; neither
    adds into global memory (no reds, atomics or bulk reduces: the schedule is bitwise deterministic), the dK / dV
    kernel has no convert entry, and the dQ kernel's dQ GEMM takes dS from registers."""
    from codegen.render import render
    from flashgen import compiler
    for t in heuristics.bwd_sm90_split_traits("sm_90a", "bf16", 128, False):
        res = compiler.compile_source(render(t), t.name, t.arch, "<memory>", ptx=True)
        assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0"], res.log   # one entry point each
        assert "C751" not in res.log, res.log
        for needle in ("wgmma.mma_async", "cp.async.bulk.tensor.4d", "setmaxnreg.inc"):
            assert needle in res.ptx, (t.name, needle)
        assert not re.search(r"^\s*(@%p\d+\s+)?(red|atom)\.", res.ptx, re.M), t.name
        for needle in ("cp.reduce.async.bulk", "_convert_dq"):
            assert needle not in res.ptx, (t.name, needle)
        if t.family == "bwd_dq_sm90":
            wgmmas = _wgmma_a_operands(res.ptx)
            # S and dP (8 k-steps each over hdim 128) from shared memory, dQ (4 k-steps over 64 keys) from registers
            assert sum(a.startswith("%rd") for _, a in wgmmas) == 16 and sum(a.startswith("{") for _, a in wgmmas) == 4


def test_backward_split_wide_dq_kernel_compiles():
    """The head dim 256 dQ kernel the table picks (one warpgroup at 256 registers, 48-key blocks, the next block's S and
    dP issued behind each dQ GEMM) compiles spill-free and without serialised wgmmas: its overlapped loop is where the
    registers run out first (Q as a register operand there made ptxas serialise every wgmma, C7512)."""
    from codegen.render import render
    from flashgen import compiler
    t = heuristics.bwd_sm90_split_traits("sm_90a", "bf16", 256, True)[1]
    assert t.overlap and t.block_n == 48 and t.num_threads == 256
    res = compiler.compile_source(render(t), t.name, t.arch, "<memory>")
    assert re.findall(r"(\d+) bytes spill stores", res.log) == ["0"], res.log
    assert "C751" not in res.log, res.log
