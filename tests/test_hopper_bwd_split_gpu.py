"""The Hopper split backward (sm_90a, FLASHGEN_HOPPER_BWD=1: deterministic=True or backward_impl="split" runs the fused
kernel without dQ for dK / dV and a dQ kernel over query blocks) against the fp32 reference with the backward tests'
rule (3x PyTorch's same-dtype error + 1e-4), on the SM80 backward's shapes for the head dims it takes; bitwise equal
gradients over repeated runs. Each test also checks that the Hopper kernels ran, not the SM80 split kernels."""
import pytest
import torch

from codegen import heuristics
from tests import test_bwd_gpu as sm80
from tests.test_hopper_bwd_gpu import hopper_only
from tests.attn_ref import assert_grads_close

pytestmark = pytest.mark.gpu

CONFIGS = [c for c in sm80.CONFIGS if heuristics.bwd_sm90_split_traits("sm_90a", "bf16", c[1], False) is not None]


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def hopper_split(monkeypatch, request):
    """FLASHGEN_HOPPER_BWD=1, both forms of the dQ kernel's loop (heuristics.BWD_DQ_SM90_OVERLAP), and every split
    backward launch must find the Hopper kernels."""
    from flashgen import dispatch
    monkeypatch.setattr(heuristics, "BWD_DQ_SM90_OVERLAP", request.param)
    dispatch._bwd_sm90_split_kernels.cache_clear()
    request.addfinalizer(dispatch._bwd_sm90_split_kernels.cache_clear)
    picked = hopper_only(monkeypatch, "bwd_sm90_split_kernels")
    yield
    assert picked and all(k is not None and [t.traits.family for t in k] == ["bwd_sm90", "bwd_dq_sm90"]
                          for k in picked), picked


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{'bf16' if c[0] == torch.bfloat16 else 'fp16'}-hd{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", sm80.SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_split_grid(config, causal, seqlens):
    sm80.test_bwd_grid(config, causal, seqlens, "split")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (6, 3)], ids=["mqa", "gqa4", "gqa2"])
def test_hopper_split_gqa(causal, heads):
    sm80.test_bwd_gqa(causal, heads, "split")


def test_hopper_split_scale_many_heads_batch1():
    sm80.test_bwd_scale_many_heads_batch1("split")


@pytest.mark.parametrize("hdim", [64, 128, 72, 256, 160])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_split_varlen(hdim, causal):
    sm80.test_bwd_varlen(hdim, causal, "split")


def test_hopper_split_fully_masked_rows():
    sm80.test_bwd_fully_masked_rows("split")


@pytest.mark.parametrize("seqlens", [(1000, 777), (300, 1500)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_split_head_groups(monkeypatch, seqlens):
    """The dK / dV kernel's causal key blocks heaviest first over groups of 3 (head, batch) pairs, as the fused one's."""
    monkeypatch.setattr(heuristics, "head_group", lambda table, bucket, causal, blocks, pairs: 3 if causal else 0)
    sq, sk = seqlens
    q = torch.randn(2, sq, 7, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 7, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sm80._check(q, k, v, True, "split")


@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("impl", ["auto", "fused"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_deterministic_is_bitwise(hdim, impl, causal):
    """deterministic=True runs the split schedule whatever backward_impl says: dq, dk, dv the same bit for bit over
    five runs (GQA: dK / dV summed over each group afterwards), and close to the reference."""
    import flashgen
    q = torch.randn(2, 1000, 8, hdim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1100, 2, hdim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1100, 2, hdim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    runs = [sm80._fwd_bwd(flashgen.flash_attn_func, (q, k, v), dout, causal=causal, deterministic=True,
                          backward_impl=impl)[1] for _ in range(5)]
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            assert torch.equal(a, b)
    assert_grads_close(runs[0], q, k, v, dout, causal)


@pytest.mark.parametrize("hdim", [64, 128, 256, 72])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1023, 1024), (239, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hopper_split_dropout(hdim, causal, seqlens):
    """With dropout: the dQ kernel regenerates the forward's mask per block; the gradients against the reference with
    the mask the forward returns (test_dropout_gpu's check)."""
    from tests import test_dropout_gpu as drop
    drop._check_against_ref(*drop._qkv(2, *seqlens, 3, 3, hdim), causal, "split")


def test_hopper_split_dropout_gqa_and_bitwise():
    from tests import test_dropout_gpu as drop
    drop._check_against_ref(*drop._qkv(2, 257, 311, 8, 2, 128), True, "split")
    drop.test_deterministic_backward_with_dropout_is_bitwise()
