"""flashgen.bert_padding on CPU: unpad/pad round trip, the varlen metadata it returns, gradients."""
import pytest
import torch

from flashgen.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input


def _random_mask(batch, seqlen, gen, right_padded=True):
    """(batch, seqlen) bool; right-padded masks as tokenizers make them, else holes anywhere. One row is
    full and one (with batch > 2) empty, the edge cases."""
    if right_padded:
        lens = torch.randint(0, seqlen + 1, (batch,), generator=gen)
        lens[0] = seqlen
        if batch > 2:
            lens[1] = 0
        return torch.arange(seqlen).view(1, -1) < lens.view(-1, 1)
    mask = torch.rand(batch, seqlen, generator=gen) < 0.6
    mask[0] = True
    if batch > 2:
        mask[1] = False
    return mask


@pytest.mark.parametrize("right_padded", [True, False], ids=["right-padded", "holes"])
@pytest.mark.parametrize("trailing", [(), (8,), (3, 4)], ids=["2d", "3d", "4d"])
def test_unpad_pad_roundtrip(right_padded, trailing):
    gen = torch.Generator().manual_seed(0)
    batch, seqlen = 5, 13
    x = torch.randn(batch, seqlen, *trailing, generator=gen)
    mask = _random_mask(batch, seqlen, gen, right_padded)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)

    lens = mask.sum(-1)
    assert x_unpad.shape == (int(lens.sum()), *trailing)
    assert indices.dtype == torch.int64 and torch.equal(indices, mask.flatten().nonzero().flatten())
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape == (batch + 1,)
    assert cu_seqlens.tolist() == [0] + torch.cumsum(lens, 0).tolist()
    assert isinstance(max_seqlen, int) and max_seqlen == int(lens.max())
    assert seqused.dtype == torch.int32 and seqused.tolist() == lens.tolist()
    # Packed rows are the kept tokens in order, sequence after sequence.
    assert torch.equal(x_unpad, x[mask])

    padded = pad_input(x_unpad, indices, batch, seqlen)
    assert padded.shape == x.shape
    assert torch.equal(padded[mask], x[mask])
    assert not padded[~mask].any(), "padding positions must come back as zeros"


def test_int_mask_and_unused_mask():
    """An int mask works like a bool one; unused tokens are packed and counted in cu_seqlens, not in seqused."""
    x = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)
    used = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 0, 1, 0, 0], [0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, used, unused)
    assert indices.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 10]
    assert cu_seqlens.tolist() == [0, 4, 9]
    assert max_seqlen == 5
    assert seqused.tolist() == [3, 2]
    assert x_unpad.flatten().tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 10]


def test_all_masked():
    x = torch.randn(3, 4, 2)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, torch.zeros(3, 4, dtype=torch.bool))
    assert x_unpad.shape == (0, 2) and indices.numel() == 0
    assert cu_seqlens.tolist() == [0, 0, 0, 0] and max_seqlen == 0 and seqused.tolist() == [0, 0, 0]
    assert torch.equal(pad_input(x_unpad, indices, 3, 4), torch.zeros(3, 4, 2))


def test_index_first_axis_gradients():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    indices = torch.tensor([5, 0, 2, 6])
    torch.autograd.gradcheck(index_first_axis, (x, indices))
    # Rows not selected get zero gradient; selected rows get exactly the incoming gradient.
    g = torch.randn(4, 3, dtype=torch.float64, generator=gen)
    index_first_axis(x, indices).backward(g)
    expected = torch.zeros_like(x)
    expected[indices] = g
    assert torch.equal(x.grad, expected)


def test_index_first_axis_repeated_indices_sum():
    x = torch.zeros(3, 2, requires_grad=True)
    index_first_axis(x, torch.tensor([1, 1, 2])).sum().backward()
    assert x.grad.tolist() == [[0, 0], [2, 2], [1, 1]]


def test_index_put_first_axis_gradients():
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(3, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    indices = torch.tensor([4, 1, 3])
    out = index_put_first_axis(values, indices, 6)
    assert out.shape == (6, 2, 2) and not out[[0, 2, 5]].any()
    torch.autograd.gradcheck(lambda t: index_put_first_axis(t, indices, 6), (values,))


def test_gradients_through_unpad_and_pad():
    """A loss on the re-padded tensor gives the padded input a gradient only where the mask keeps tokens."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, 5, generator=gen, requires_grad=True)
    mask = _random_mask(4, 9, gen)
    x_unpad, indices, *_ = unpad_input(x, mask)
    weight = torch.randn(4, 9, 5, generator=gen)
    (pad_input(x_unpad * 2, indices, 4, 9) * weight).sum().backward()
    assert torch.equal(x.grad, torch.where(mask[..., None], 2 * weight, torch.zeros(())))
