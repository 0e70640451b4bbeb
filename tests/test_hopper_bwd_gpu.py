"""The Hopper backward (sm_90a, FLASHGEN_HOPPER_BWD=1: the fused schedule as one TMA + wgmma kernel) against the fp32
reference with the backward tests' rule (3x PyTorch's same-dtype error + 1e-4), on the SM80 backward's shapes for
the head dims it takes. Each test also checks that the Hopper kernel ran, not the SM80 fallback."""
import pytest
import torch

from codegen import heuristics
from tests import test_bwd_gpu as sm80

pytestmark = pytest.mark.gpu

# The head dims with a Hopper backward (all up to 256: buckets 64, 128, 256); the GEMM-order and dQ-handoff variants
# exist for the first two.
CONFIGS = [c for c in sm80.CONFIGS if heuristics.bwd_sm90_traits("sm_90a", "bf16", c[1], False) is not None]
CONFIGS_128 = [c for c in CONFIGS if c[1] <= 128]


def hopper_only(monkeypatch, choice: str) -> list:
    """Skips without compute capability 9.0; else sets FLASHGEN_HOPPER_BWD=1 and returns the list that collects what
    dispatch.<choice> returns (the caller checks it was a Hopper kernel)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper path needs compute capability 9.0")
    from flashgen import dispatch
    monkeypatch.setenv("FLASHGEN_HOPPER_BWD", "1")
    picked = []
    real = getattr(dispatch, choice)

    def spy(*args, **kw):
        picked.append(real(*args, **kw))
        return picked[-1]
    monkeypatch.setattr(dispatch, choice, spy)
    return picked


@pytest.fixture(autouse=True)
def hopper_bwd(monkeypatch):
    """FLASHGEN_HOPPER_BWD=1, and every backward launch must find a Hopper kernel."""
    picked = hopper_only(monkeypatch, "bwd_sm90_kernel")
    yield
    assert picked and all(k is not None and k.traits.family == "bwd_sm90" for k in picked), picked


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", sm80.SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_bwd_grid(config, causal, seqlens):
    sm80.test_bwd_grid(config, causal, seqlens, "fused")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 3)], ids=["mqa", "gqa4", "gqa2"])
def test_hopper_bwd_gqa(causal, heads):
    sm80.test_bwd_gqa(causal, heads, "fused")


def test_hopper_bwd_scale_many_heads_batch1():
    sm80.test_bwd_scale_many_heads_batch1("fused")


@pytest.mark.parametrize("hdim", [64, 128, 72, 256, 160])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_bwd_varlen(hdim, causal):
    sm80.test_bwd_varlen(hdim, causal, "fused")


@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", [(1000, 777), (300, 1500), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_bwd_head_groups(monkeypatch, hdim, seqlens):
    """Causal key blocks heaviest first over groups of 3 (head, batch) pairs (sm90_common.cuh's grouped_tile): 2 x 7
    = 14 pairs, so the last group holds 2; the forward runs grouped too."""
    monkeypatch.setattr(heuristics, "head_group", lambda table, bucket, causal, blocks, pairs: 3 if causal else 0)
    sq, sk = seqlens
    q = torch.randn(2, sq, 7, hdim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 7, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sm80._check(q, k, v, True, "fused")


@pytest.mark.parametrize("hdim", [64, 128, 96])
@pytest.mark.parametrize("pieces", [2, 3, 16])
@pytest.mark.parametrize("shape", [(3, 24, 1000, 777), (2, 3, 300, 1500), (1, 2, 200, 17), (1, 70, 1023, 1024)],
                         ids=lambda s: "x".join(map(str, s)))
def test_hopper_bwd_split_tail(monkeypatch, hdim, pieces, shape):
    """The backward's split tail forced to `pieces` query ranges per key block (heuristics.BWD_SM90_SPLIT): the last
    wave's key blocks where there are more than SMs (3 x 24 x 7 and 70 x 8 key blocks), every one where there are fewer;
    pieces of one or a few query blocks, more pieces than query blocks (empty pieces), the last key block partial. The
    gradients against the fp32 reference, and dK and dV the same bit for bit on a second call (the last piece sums
    the slots in piece order, whichever ended last)."""
    import flashgen
    monkeypatch.setattr(heuristics, "BWD_SM90_SPLIT", pieces)
    splits = []   # (key blocks, ctas, query blocks) -> (split tiles, pieces) of each launch
    real = heuristics.bwd_sm90_split_tail
    monkeypatch.setattr(heuristics, "bwd_sm90_split_tail", lambda *a: splits.append((a, real(*a))) or splits[-1][1])
    b, h, sq, sk = shape
    q = torch.randn(b, sq, h, hdim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sm80._check(q, k, v, False, "fused")
    (tiles, ctas, blocks), (split_tiles, k_pieces) = splits[-1]
    assert split_tiles == (tiles % ctas or tiles) and k_pieces == min(pieces, blocks) > 1, splits
    dout = torch.randn_like(q)
    again = []
    for _ in range(2):
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        flashgen.flash_attn_func(qq, kk, vv, backward_impl="fused").backward(dout)
        again.append((kk.grad, vv.grad))
    assert torch.equal(again[0][0], again[1][0]) and torch.equal(again[0][1], again[1][1])


@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("shape", [(1, 67, 2048), (1, 9, 8192)], ids=lambda s: "x".join(map(str, s)))
def test_hopper_bwd_split_tail_estimate(monkeypatch, hdim, shape):
    """The split the estimate picks (heuristics.bwd_sm90_split_tail) where the last wave is a sliver (67 heads x 16
    key blocks = 1072 = 8 x 132 + 16) or a third (9 x 64 = 576 = 4 x 132 + 48): the gradients against the fp32
    reference, the launch split."""
    splits = []
    real = heuristics.bwd_sm90_split_tail
    monkeypatch.setattr(heuristics, "bwd_sm90_split_tail", lambda *a: splits.append((a, real(*a))) or splits[-1][1])
    b, h, s = shape
    q, k, v = (torch.randn(b, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sm80._check(q, k, v, False, "fused")
    (tiles, ctas, _), (split_tiles, k_pieces) = splits[-1]
    assert ctas != 132 or (split_tiles == tiles % ctas and k_pieces > 1), splits


def test_hopper_bwd_packed_gradients():
    sm80.test_bwd_packed_gradients()


def test_hopper_bwd_varlen_qkvpacked():
    sm80.test_bwd_varlen_qkvpacked()


def test_hopper_bwd_fully_masked_rows():
    sm80.test_bwd_fully_masked_rows("fused")


def _override(monkeypatch, name, value):
    """Set one of heuristics' Hopper-backward overrides for a test, with the memoised kernel choice cleared around it."""
    from flashgen import dispatch
    monkeypatch.setattr(heuristics, name, value)
    dispatch._bwd_sm90_kernel.cache_clear()
    yield value
    dispatch._bwd_sm90_kernel.cache_clear()


@pytest.fixture(params=[True, False], ids=["lse_smem", "lse_regs"])
def lse_smem(monkeypatch, request):
    """Both ways of passing lse and D (shared memory or per-thread registers) for every key, whatever
    heuristics.BWD_SM90_LSE_SMEM_TABLE picks for it."""
    yield from _override(monkeypatch, "BWD_SM90_LSE_SMEM", request.param)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (239, 1), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_bwd_lse_smem_grid(lse_smem, config, causal, seqlens):
    from flashgen import dispatch
    assert dispatch.bwd_sm90_kernel(0, config[0], config[1], causal, tma_ok=True).traits.lse_smem == lse_smem
    sm80.test_bwd_grid(config, causal, seqlens, "fused")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_bwd_lse_smem_varlen(lse_smem, causal):
    sm80.test_bwd_varlen(128, causal, "fused")


@pytest.fixture(params=[True, False], ids=["early_dv", "dv_after_ds"])
def early_dv(monkeypatch, request):
    """Both GEMM orders (BwdSm90Traits.early_dv) for every dropout-free key, whatever
    heuristics.BWD_SM90_EARLY_DV_TABLE picks for it."""
    yield from _override(monkeypatch, "BWD_SM90_EARLY_DV", request.param)


@pytest.mark.parametrize("config", CONFIGS_128, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (239, 1), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_bwd_early_dv_grid(early_dv, config, causal, seqlens):
    from flashgen import dispatch
    assert dispatch.bwd_sm90_kernel(0, config[0], config[1], causal, tma_ok=True).traits.early_dv == early_dv
    sm80.test_bwd_grid(config, causal, seqlens, "fused")


@pytest.fixture(params=[True, False], ids=["dq_handoff", "dq_meet"])
def dq_handoff(monkeypatch, request):
    """Both ways the consumer warpgroups meet over dS (BwdSm90Traits.dq_handoff) for every key, whatever
    heuristics.BWD_SM90_DQ_HANDOFF_TABLE picks for it."""
    yield from _override(monkeypatch, "BWD_SM90_DQ_HANDOFF", request.param)


@pytest.mark.parametrize("config", CONFIGS_128, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (239, 1), (1023, 1024), (2048, 555)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_bwd_dq_handoff_grid(dq_handoff, config, causal, seqlens):
    from flashgen import dispatch
    t = dispatch.bwd_sm90_kernel(0, config[0], config[1], causal, tma_ok=True).traits
    assert t.dq_handoff == (dq_handoff and t.block_m == 64)   # 128-row query blocks split dQ's rows instead
    sm80.test_bwd_grid(config, causal, seqlens, "fused")


@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_bwd_dq_handoff_varlen(dq_handoff, hdim, causal):
    sm80.test_bwd_varlen(hdim, causal, "fused")


@pytest.fixture(params=[True, False], ids=["dq_red", "dq_stage"])
def dq_red(monkeypatch, request):
    """Both ways dQ reaches its fp32 accumulator (BwdSm90Traits.dq_red: 16-byte reds from registers into the fragment
    order; else a shared-memory stage and a bulk reduce) for every dropout-free key up to head dim 128, whatever
    heuristics.BWD_SM90_DQ_RED_TABLE picks for it."""
    yield from _override(monkeypatch, "BWD_SM90_DQ_RED", request.param)


@pytest.mark.parametrize("config", CONFIGS_128, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (239, 1), (1023, 1024), (2048, 555)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_bwd_dq_red_grid(dq_red, config, causal, seqlens):
    from flashgen import dispatch
    assert dispatch.bwd_sm90_kernel(0, config[0], config[1], causal, tma_ok=True).traits.dq_red == dq_red
    sm80.test_bwd_grid(config, causal, seqlens, "fused")


@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_bwd_dq_red_varlen(dq_red, hdim, causal):
    sm80.test_bwd_varlen(hdim, causal, "fused")
