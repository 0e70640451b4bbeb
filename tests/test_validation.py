"""Bad input gets a clear error naming the argument, raised before any launch (CPU only: fake CUDA tensors)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashgen


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def _qkv(b=2, sq=16, sk=16, h=4, hk=4, d=64, dtype=torch.float16, device="cuda"):
    return (torch.empty(b, sq, h, d, device=device, dtype=dtype), torch.empty(b, sk, hk, d, device=device, dtype=dtype),
            torch.empty(b, sk, hk, d, device=device, dtype=dtype))


def test_cpu_tensor_rejected():
    q, k, v = _qkv(device="cpu")
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        flashgen.flash_attn_func(q, k, v)


def test_dtype(fake):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must be torch.float16 or torch.bfloat16"):
        flashgen.flash_attn_func(q.float(), k, v)
    with pytest.raises(TypeError, match="k has dtype torch.bfloat16 but q has torch.float16"):
        flashgen.flash_attn_func(q, k.bfloat16(), v)


def test_shapes(fake):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q must have shape \(batch, seqlen_q, nheads, headdim\)"):
        flashgen.flash_attn_func(torch.empty(16, 4, 64, device="cuda", dtype=torch.float16), k, v)
    with pytest.raises(ValueError, match=r"k and v must agree in \(batch, seqlen_k, nheads_k\)"):
        flashgen.flash_attn_func(q, k, _qkv(sk=8)[2])
    q2, k2, v2 = _qkv(b=3)
    with pytest.raises(ValueError, match="batch"):
        flashgen.flash_attn_func(q, k2, v2)


def test_head_dim_and_heads(fake):
    q, k, v = _qkv(d=36)
    with pytest.raises(ValueError, match="head dim .* multiple of 8"):
        flashgen.flash_attn_func(q, k, v)
    q, k, v = _qkv(d=520)
    with pytest.raises(ValueError, match=r"head dim of q .* multiple of 8 in \[8, 512\], got 520"):
        flashgen.flash_attn_func(q, k, v)
    q, k, v = _qkv(d=128)
    with pytest.raises(ValueError, match=r"k's head dim \(64\) must equal q's \(128\)"):
        flashgen.flash_attn_func(q, _qkv(d=64)[1], v)
    with pytest.raises(ValueError, match=r"head dim of v .* got 36"):
        flashgen.flash_attn_func(q, k, _qkv(d=36)[2])
    with pytest.raises(NotImplementedError, match=r"dropout_p > 0 supports head dims up to 256, got q 128, v 512"):
        flashgen.flash_attn_func(q, k, _qkv(d=512)[2], dropout_p=0.1)
    with pytest.raises(ValueError, match=r"backward_impl='fused' supports head dims up to 256, got 512"):
        flashgen.flash_attn_func(q, k, _qkv(d=512)[2], backward_impl="fused")
    q, k, v = _qkv(h=6, hk=4)
    with pytest.raises(ValueError, match="nheads of q \\(6\\) must be a multiple of nheads of k/v \\(4\\)"):
        flashgen.flash_attn_func(q, k, v)


def test_stride(fake):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        flashgen.flash_attn_func(torch.empty_strided((2, 16, 4, 64), (4096, 256, 64, 2), device="cuda",
                                                    dtype=torch.float16), k, v)


def test_options(fake):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout_p must be in \\[0, 1\\)"):
        flashgen.flash_attn_func(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="dropout_p must be in \\[0, 1\\)"):
        flashgen.flash_attn_func(q, k, v, dropout_p=-0.1)
    with pytest.raises(ValueError, match="dropout_p must be in \\[0, 1\\)"):
        flashgen.flash_attn_varlen_func(None, None, None, None, None, 16, 16, dropout_p=1.5)   # checked first
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        flashgen.flash_attn_func(q, k, v, dropout_p=0.1, generator=123)
    with pytest.raises(ValueError, match="generator must be a CUDA generator"):
        flashgen.flash_attn_func(q, k, v, dropout_p=0.1, generator=torch.Generator())
    with pytest.raises(NotImplementedError, match="window_size"):
        flashgen.flash_attn_func(q, k, v, window_size=(16, 0))
    with pytest.raises(NotImplementedError, match="softcap"):
        flashgen.flash_attn_func(q, k, v, softcap=30.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flashgen.flash_attn_func(q, k, v, alibi_slopes=torch.empty(4, device="cuda"))


def test_backward_impl(fake):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backward_impl must be 'auto', 'fused' or 'split', got 'fast'"):
        flashgen.flash_attn_func(q, k, v, backward_impl="fast")
    cu = torch.empty(3, dtype=torch.int32, device="cuda")
    packed = torch.empty(40, 4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="backward_impl"):
        flashgen.flash_attn_varlen_func(packed, packed, packed, cu, cu, 20, 20, backward_impl=None)
    with pytest.raises(ValueError, match="backward_impl"):
        flashgen.flash_attn_qkvpacked_func(torch.empty(2, 16, 3, 4, 64, device="cuda", dtype=torch.float16),
                                           backward_impl="Fused")


def test_packed(fake):
    qkv = torch.empty(2, 16, 2, 4, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="qkv must have 3 in dim 2"):
        flashgen.flash_attn_qkvpacked_func(qkv)
    with pytest.raises(ValueError, match="kv must have 2 in dim 2"):
        flashgen.flash_attn_kvpacked_func(_qkv()[0], torch.empty(2, 16, 3, 4, 64, device="cuda",
                                                                 dtype=torch.float16))


def test_cu_seqlens(fake):
    q = torch.empty(40, 4, 64, device="cuda", dtype=torch.float16)
    cu = torch.empty(3, device="cuda", dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype torch.int32"):
        flashgen.flash_attn_varlen_func(q, q, q, cu.long(), cu, 20, 20)
    with pytest.raises(ValueError, match="cu_seqlens_k must have batch \\+ 1 = 3 entries"):
        flashgen.flash_attn_varlen_func(q, q, q, cu, torch.empty(4, device="cuda", dtype=torch.int32), 20, 20)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D"):
        flashgen.flash_attn_varlen_func(q, q, q, torch.empty(3, 1, device="cuda", dtype=torch.int32), cu, 20, 20)
    with pytest.raises(NotImplementedError, match="block_table"):
        flashgen.flash_attn_varlen_func(q, q, q, cu, cu, 20, 20, block_table=cu)


def test_import_is_cheap():
    import subprocess
    import sys
    import time
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "import flashgen, sys; assert 'torch' not in sys.modules"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - t0 < 5.0


def test_cu_seqlens_values():
    from flashgen.interface import _check_cu_seqlens_values
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        _check_cu_seqlens_values("cu_seqlens_q", torch.tensor([0, 5, 3], dtype=torch.int32), 10, "max_seqlen_q", 8)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[0\] must be 0"):
        _check_cu_seqlens_values("cu_seqlens_k", torch.tensor([1, 5], dtype=torch.int32), 10, "max_seqlen_k", 8)
    with pytest.raises(ValueError, match="exceeds the 4 rows"):
        _check_cu_seqlens_values("cu_seqlens_q", torch.tensor([0, 5], dtype=torch.int32), 4, "max_seqlen_q", 8)
    with pytest.raises(ValueError, match="max_seqlen_q=3 is smaller than the longest sequence \\(5\\)"):
        _check_cu_seqlens_values("cu_seqlens_q", torch.tensor([0, 5], dtype=torch.int32), 10, "max_seqlen_q", 3)
    _check_cu_seqlens_values("cu_seqlens_q", torch.tensor([0, 0, 5], dtype=torch.int32), 10, "max_seqlen_q", 5)
