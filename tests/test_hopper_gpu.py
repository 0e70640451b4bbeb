"""The Hopper forward (sm_90a: TMA + wgmma + warp specialization, the default forward on compute capability 9.0) against the fp32
reference with flash-attn's error rule, on the shapes the SM80 forward is tested on."""
import pytest
import torch

from codegen import heuristics

from tests.attn_ref import assert_close_to_ref, attention_ref
from tests.build_gpu_kernels import HOPPER_CANDIDATES, staged_choices
from tests.test_fwd_gpu import HDIMS, SEQLENS, grid_inputs   # the SM80 forward's grid
from tests.test_fwd_gpu import _check as check_fwd

pytestmark = pytest.mark.gpu

@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper path needs compute capability 9.0")
    monkeypatch.setenv("FLASHGEN_HOPPER", "1")
    # The Hopper kernels on every shape, short sequences included (dispatch keeps the SM80 forward there).
    from flashgen import dispatch
    monkeypatch.setattr(heuristics, "FWD_SM90_SHORT_SEQLEN", {})
    dispatch._fwd_kernel.cache_clear()
    yield
    dispatch._fwd_kernel.cache_clear()


@pytest.fixture(params=list(heuristics.FWD_SM90_MAINLOOPS))
def mainloop(monkeypatch, request):
    """Each mainloop: one block at a time; S of block i issued with P V of block i-1; that plus the two consumer
    warpgroups taking turns."""
    from flashgen import dispatch
    monkeypatch.setattr(heuristics, "FWD_SM90_MAINLOOP", request.param)
    dispatch._fwd_kernel.cache_clear()
    yield request.param
    dispatch._fwd_kernel.cache_clear()


def _check(q, k, v, causal, expect):
    """The Hopper kernel dispatch picks has the expected mainloop (a name) or (block_m, block_n, mainloop[, stages]);
    then the SM80 forward tests' check (poisoned outputs, out and lse against the fp32 reference)."""
    from flashgen import dispatch
    t = dispatch.fwd_kernel(q.device.index, q.dtype, q.shape[-1], causal, tma_ok=True).traits
    assert t.family == "fwd_sm90", t.name
    if isinstance(expect, str):
        assert heuristics.sm90_mainloop(t) == expect, t.name
    else:   # a tuning choice: stages only where it names them
        assert (t.block_m, t.block_n, heuristics.sm90_mainloop(t), t.stages)[:len(expect)] == tuple(expect), t.name
    check_fwd(q, k, v, causal)


# Each head dim with dispatch's walk (persistent at these seqlens in the buckets of FWD_SM90_PERSISTENT_SEQLEN, else
# the grid), and with the grid forced where that differs.
HDIM_WALKS = [pytest.param(h, None, id=f"hd{h}-dispatch") for h in HDIMS] + \
             [pytest.param(h, False, id=f"hd{h}-grid") for h in HDIMS
              if heuristics.sm90_bucket(h) in heuristics.FWD_SM90_PERSISTENT_SEQLEN]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("hdim,walk", HDIM_WALKS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_grid(monkeypatch, mainloop, dtype, hdim, walk, causal, seqlens):
    from flashgen import dispatch
    if walk is not None:
        monkeypatch.setattr(heuristics, "FWD_SM90_PERSISTENT", walk)
        dispatch._fwd_kernel.cache_clear()
    q, k, v = grid_inputs(dtype, hdim, seqlens)
    t = dispatch.fwd_kernel(q.device.index, q.dtype, hdim, causal, seqlen_q=seqlens[0], seqlen_k=seqlens[1],
                            tma_ok=True).traits
    short = max(seqlens) <= heuristics.FWD_SM90_PERSISTENT_SEQLEN.get(heuristics.sm90_bucket(hdim), 0)
    assert t.persistent == (short if walk is None else walk), t.name
    _check(q, k, v, causal, mainloop)


# `flashgen tune` times only candidates whose output matches the table's kernel; these check some off-table ones
# (three consumer warpgroups, FlashAttention 3's 176-key blocks, narrow blocks) against the fp32 reference.
@pytest.mark.parametrize("hdim,choice", HOPPER_CANDIDATES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else f"hd{x}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (239, 1), (17, 17), (1023, 1024), (2048, 2048)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_tuner_candidates(hdim, choice, causal, seqlens):
    from codegen.traits import bucket_for_head_dim
    from flashgen import dispatch
    key = ("bf16", bucket_for_head_dim(hdim), causal)
    dispatch.set_fwd_sm90(*key, choice)
    try:
        _check(*grid_inputs(torch.bfloat16, hdim, seqlens), causal, choice)
    finally:
        dispatch.set_fwd_sm90(*key, None)


@pytest.mark.parametrize("dtype,hdim,causal,choice", staged_choices("sm_90a"),
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (17, 17), (1023, 1024), (2048, 2048), (4097, 3000)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_hand_set_choices(dtype, hdim, causal, choice, seqlens):
    from flashgen import dispatch
    dispatch.set_fwd_sm90(dtype, hdim, causal, choice)
    try:   # the walk at seqlens up to 2048 (FWD_SM90_PERSISTENT_SEQLEN), the grid above
        _check(*grid_inputs({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype], hdim, seqlens), causal, choice)
    finally:
        dispatch.set_fwd_sm90(dtype, hdim, causal, None)


# The overlapped mainloops keep a row's running max until a block's exceeds it by 2^8 (online_softmax_lazy): scores
# with a wide range (q and k scaled up) make rows cross that threshold in the middle of the sequence, several times.
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sigma", [2.0, 3.0])
@pytest.mark.parametrize("seqlens", [(1000, 1500), (2048, 2048), (17, 1023)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_wide_score_range(hdim, causal, sigma, seqlens):
    q, k, v = grid_inputs(torch.bfloat16, hdim, seqlens)
    q, k = (q * sigma).bfloat16(), (k * sigma).bfloat16()
    from flashgen import dispatch
    t = dispatch.fwd_kernel(q.device.index, q.dtype, hdim, causal, seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                            tma_ok=True).traits
    assert t.family == "fwd_sm90" and t.overlap, t.name   # the table's (or tuned) overlapped mainloop
    check_fwd(q, k, v, causal)


# The overlapped loop first takes each block's P with the running max as it stands (fwd_sm90.cuh's exp_stale) and
# redoes the block exactly where that leaves range. With q shifted by 3, key 0 (walked last) and a middle key set to
# `jump` score ~3 jump sqrt(hdim) against the other keys' ~N(0, 10): the max moves by a few to ~20 (0.5), by ~50-100
# (1.5) and by far more than 128 (30, where P's first try overflows fp32), in log2 units of the scaled scores.
# Rows are then nearly one-hot on key 0, where PyTorch's bf16 path is exact (its softmax rounds key 0's probability to
# 1.0 before the P V product), while the first try's P for key 0 is 2^(up to 16) rounded to bf16 against an fp32 row
# sum: a relative error up to 2^-9 in the output, as in any loop that rescales only when the max moves far (e.g.
# FlashAttention 4's). So each element may also be off by one bf16 ulp of its value (a failed redo is off by far
# more, or NaN).
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("jump", [0.5, 1.5, 30.0])
@pytest.mark.parametrize("seqlens", [(1000, 1500), (2048, 2048), (333, 333)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_score_jumps(mainloop, hdim, causal, jump, seqlens):
    sq, sk = seqlens
    q = torch.randn(2, sq, 3, hdim, device="cuda") + 3.0
    k, v = (torch.randn(2, sk, 3, hdim, device="cuda") for _ in range(2))
    k[:, 0], k[:, sk // 2] = jump, 0.7 * jump
    check_fwd(*(x.bfloat16() for x in (q, k, v)), causal, ulps=1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 1), (8, 2)], ids=["mqa", "gqa4"])
def test_hopper_fwd_gqa_strided(mainloop, causal, heads):
    h, hk = heads
    q = torch.randn(2, 257, h, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 311, 2, hk, 128, device="cuda", dtype=torch.bfloat16)   # packed: strided k and v
    _check(q, kv[:, :, 0], kv[:, :, 1], causal, mainloop)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_fwd_varlen(mainloop, causal):
    import flashgen
    lens_q, lens_k = [17, 0, 113, 1, 256, 300], [33, 5, 113, 0, 256, 129]
    h, hk, d = 4, 2, 128
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16)
    out = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    for i in range(len(lens_q)):
        if lens_q[i] == 0:
            continue
        qs = q[cu_q[i]:cu_q[i + 1]].unsqueeze(0)
        ks, vs = (t[cu_k[i]:cu_k[i + 1]].unsqueeze(0) for t in (k, v))
        ref, _ = attention_ref(qs, ks, vs, causal)
        ref_lowp, _ = attention_ref(qs, ks, vs, causal, upcast=False)
        assert_close_to_ref(out[cu_q[i]:cu_q[i + 1]].unsqueeze(0), ref, ref_lowp, name=f"seq{i}")


@pytest.mark.parametrize("mainloop_name", list(heuristics.FWD_SM90_MAINLOOPS))
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (239, 1), (1023, 1024), (2048, 2048)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_persistent(monkeypatch, mainloop_name, hdim, causal, seqlens):
    """The persistent variant (one CTA per SM walks the tiles; the K/V ring runs on across tiles) on the grid's odd
    shapes, with more tiles than SMs at the longer ones; (239, 1) causal has tiles without key blocks."""
    from flashgen import dispatch
    monkeypatch.setattr(heuristics, "FWD_SM90_MAINLOOP", mainloop_name)
    monkeypatch.setattr(heuristics, "FWD_SM90_PERSISTENT", True)
    dispatch._fwd_kernel.cache_clear()
    q, k, v = grid_inputs(torch.bfloat16, hdim, seqlens)
    t = dispatch.fwd_kernel(q.device.index, q.dtype, hdim, causal, tma_ok=True).traits
    assert t.persistent, t.name
    _check(q, k, v, causal, mainloop_name)


@pytest.mark.parametrize("mainloop_name", list(heuristics.FWD_SM90_MAINLOOPS))
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", [(1000, 777), (1000, 300)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_persistent_many_tiles(monkeypatch, mainloop_name, hdim, seqlens):
    """More tiles than SMs, so each CTA walks several (the K/V stages and the Q buffer's phases carry over), causal
    with seqlen_q > seqlen_k so some tiles in the middle of a walk see no key at all."""
    from flashgen import dispatch
    monkeypatch.setattr(heuristics, "FWD_SM90_MAINLOOP", mainloop_name)
    monkeypatch.setattr(heuristics, "FWD_SM90_PERSISTENT", True)
    dispatch._fwd_kernel.cache_clear()
    sq, sk = seqlens
    q = torch.randn(3, sq, 24, hdim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, sk, 24, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert 3 * 24 * -(-sq // 192) > torch.cuda.get_device_properties(q.device).multi_processor_count
    for causal in (False, True):
        _check(q, k, v, causal, mainloop_name)


@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", [(1000, 777), (300, 1500), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_fwd_head_groups(monkeypatch, persistent, hdim, seqlens):
    """Causal tiles heaviest first over groups of 3 (head, batch) pairs (sm90_common.cuh's grouped_tile): 2 x 7 = 14
    pairs, so the last group holds 2; on the grid and the persistent walk, whatever the table picks per bucket."""
    from flashgen import dispatch
    monkeypatch.setattr(heuristics, "head_group", lambda table, bucket, causal, blocks, pairs: 3 if causal else 0)
    monkeypatch.setattr(heuristics, "FWD_SM90_PERSISTENT", persistent)
    dispatch._fwd_kernel.cache_clear()
    sq, sk = seqlens
    q = torch.randn(2, sq, 7, hdim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 7, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    t = dispatch.fwd_kernel(q.device.index, q.dtype, hdim, True, tma_ok=True).traits
    assert t.family == "fwd_sm90" and t.persistent == persistent, t.name
    check_fwd(q, k, v, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_fwd_persistent_varlen(monkeypatch, causal):
    """Varlen through the persistent walk: empty sequences and tiles past a sequence's end are skipped by the
    producer and the consumers alike."""
    monkeypatch.setattr(heuristics, "FWD_SM90_PERSISTENT", True)
    from flashgen import dispatch
    dispatch._fwd_kernel.cache_clear()
    test_hopper_fwd_varlen("serial", causal)



@pytest.mark.parametrize("mainloop_name", list(heuristics.FWD_SM90_MAINLOOPS))
@pytest.mark.parametrize("hdim", [64, 128, 160, 256])
@pytest.mark.parametrize("pieces", [2, 3, 7])
@pytest.mark.parametrize("shape", [(3, 24, 1000, 777), (2, 3, 113, 1500), (1, 2, 17, 1023), (1, 1, 1, 300),
                                   (1, 70, 1023, 1024)], ids=lambda s: "x".join(map(str, s)))
def test_hopper_fwd_split_tail(monkeypatch, mainloop_name, hdim, pieces, shape):
    """The grid's split tail forced to `pieces` key ranges per tile (heuristics.FWD_SM90_SPLIT): the last wave's tiles
    where there are more tiles than SMs (3 x 24 x 1000 and 70 heads x 1023 rows), every tile where there are fewer;
    pieces of one or a few key blocks (1500 / 7, the last block partial). Out and lse against the fp32 reference, and
    the result bit for bit the same on a second call (the merge sums in key-range order, whichever piece ends last)."""
    from flashgen import dispatch, interface
    monkeypatch.setattr(heuristics, "FWD_SM90_MAINLOOP", mainloop_name)
    monkeypatch.setattr(heuristics, "FWD_SM90_PERSISTENT", False)
    monkeypatch.setattr(heuristics, "FWD_SM90_SPLIT", pieces)
    splits = []   # (tiles, ctas, key blocks) -> (split tiles, pieces) of each launch
    real = heuristics.fwd_sm90_split_tail
    monkeypatch.setattr(heuristics, "fwd_sm90_split_tail", lambda *a: splits.append((a, real(*a))) or splits[-1][1])
    dispatch._fwd_kernel.cache_clear()
    b, h, sq, sk = shape
    q = torch.randn(b, sq, h, hdim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _check(q, k, v, False, mainloop_name)
    (tiles, ctas, blocks), (split_tiles, k_pieces) = splits[-1]
    assert split_tiles == (tiles % ctas or tiles) and k_pieces == min(pieces, blocks) > 1, splits
    out, lse = interface._flash_attn_forward(q, k, v, hdim ** -0.5, False)
    out2, lse2 = interface._flash_attn_forward(q, k, v, hdim ** -0.5, False)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("shape", [(2, 8, 2048), (1, 4, 8192), (1, 2, 12000)], ids=lambda s: "x".join(map(str, s)))
def test_hopper_fwd_split_tail_estimate(hdim, shape):
    """The split dispatch's estimate picks (heuristics.fwd_sm90_split_tail) on benchmark-sized shapes, where the last
    wave is partial: out and lse against the fp32 reference."""
    b, h, s = shape
    q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    check_fwd(q, k, v, False)
