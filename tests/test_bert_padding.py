"""flash_ext.bert_padding against straightforward masked indexing (flash_attn 2.8 semantics), gradients
through every gather/scatter, and bad input."""
from __future__ import annotations

import pytest
import torch

from flash_ext import bert_padding as bp

# (batch, seqlen) masks: mixed lengths with an all-padding row, left padding, a hole in the middle, batch 1,
# no padding at all, all padding.
MASKS = {
    "mixed_with_empty_row": [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]],
    "left_padding": [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]],
    "holes": [[1, 0, 1, 0, 1], [0, 1, 1, 0, 0]],
    "batch_1": [[1, 1, 1, 1, 0, 0, 0]],
    "no_padding": [[1, 1, 1], [1, 1, 1]],
    "all_padding": [[0, 0, 0], [0, 0, 0]],
}


def _expected(hidden: torch.Tensor, mask: torch.Tensor):
    """The reference: Python loops over the mask, no tensor tricks."""
    batch, seqlen = mask.shape
    rows, indices, cu, lens = [], [], [0], []
    for b in range(batch):
        count = 0
        for s in range(seqlen):
            if mask[b, s]:
                rows.append(hidden[b, s])
                indices.append(b * seqlen + s)
                count += 1
        lens.append(count)
        cu.append(cu[-1] + count)
    packed = torch.stack(rows) if rows else hidden.new_zeros(0, *hidden.shape[2:])
    return packed, torch.tensor(indices, dtype=torch.int64), torch.tensor(cu, dtype=torch.int32), lens


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64])
def test_unpad_pad_against_masked_indexing(name, mask_dtype):
    mask = torch.tensor(MASKS[name], dtype=mask_dtype)
    hidden = torch.randn(*mask.shape, 3, 4)
    unpad, indices, cu, max_seqlen, seqused = bp.unpad_input(hidden, mask)
    ref_rows, ref_indices, ref_cu, lens = _expected(hidden, mask)
    assert torch.equal(unpad, ref_rows)
    assert torch.equal(unpad, hidden[mask.bool()])
    assert indices.dtype == torch.int64 and torch.equal(indices, ref_indices)
    assert cu.dtype == torch.int32 and torch.equal(cu, ref_cu)
    assert isinstance(max_seqlen, int) and max_seqlen == max(lens)
    assert seqused.dtype == torch.int32 and seqused.tolist() == lens

    padded = bp.pad_input(unpad, indices, *mask.shape)
    assert padded.shape == hidden.shape
    assert torch.equal(padded, torch.where(mask.bool()[..., None, None], hidden, torch.zeros(())))


def test_unpad_input_unused_mask():
    """Allocated-but-unused tokens are packed and counted in cu_seqlens, but not in seqused."""
    used = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    hidden = torch.randn(2, 4, 5)
    unpad, indices, cu, max_seqlen, seqused = bp.unpad_input(hidden, used, unused)
    either = (used + unused).bool()
    assert torch.equal(unpad, hidden[either])
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu.tolist() == [0, 3, 6] and max_seqlen == 3
    assert seqused.tolist() == [2, 1]


def test_unpad_input_for_concatenated_sequences():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    hidden = torch.randn(4, 6, 2, 3)
    unpad, indices, cu, max_seqlen = bp.unpad_input_for_concatenated_sequences(hidden, lengths)
    # Reference: each row's first sum(lengths) tokens, one sequence per nonzero length.
    keep = torch.zeros(4, 6, dtype=torch.bool)
    for b, total in enumerate(lengths.sum(-1).tolist()):
        keep[b, :total] = True
    assert torch.equal(unpad, hidden[keep])
    assert torch.equal(indices, torch.nonzero(keep.flatten()).flatten())
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16]
    assert max_seqlen == 6


def test_index_helpers_match_indexing():
    x = torch.randn(7, 3, 2)
    idx = torch.tensor([5, 0, 6, 2])
    assert torch.equal(bp.index_first_axis(x, idx), x[idx])
    put = bp.index_put_first_axis(x[idx], idx, 7)
    expected = torch.zeros_like(x)
    expected[idx] = x[idx]
    assert torch.equal(put, expected)
    gathered, residual = bp.index_first_axis_residual(x, idx)
    assert torch.equal(gathered, x[idx]) and torch.equal(residual, x)


def test_gradients_flow_like_indexing():
    """The custom backward of each helper equals autograd through plain indexing (double precision
    gradcheck, and a comparison with the index/scatter reference)."""
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 1, 5])
    assert torch.autograd.gradcheck(lambda t: bp.index_first_axis(t, idx), (x,))
    vals = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: bp.index_put_first_axis(t, idx, 6), (vals,))
    assert torch.autograd.gradcheck(lambda t: bp.index_first_axis_residual(t, idx), (x,))
    # Residual: d/dx of (sum(w1 * x[idx]) + sum(w2 * x)) = scatter-add of w1 plus w2.
    w1, w2 = torch.randn(3, 2, 3, dtype=torch.float64), torch.randn(6, 2, 3, dtype=torch.float64)
    gathered, residual = bp.index_first_axis_residual(x, idx)
    (grad,) = torch.autograd.grad((gathered * w1).sum() + (residual * w2).sum(), x)
    expected = w2.clone()
    expected[idx] += w1
    assert torch.allclose(grad, expected)
    # Repeated indices: the gradient accumulates, as for x[idx].
    rep = torch.tensor([2, 2, 0])
    (grad,) = torch.autograd.grad((bp.index_first_axis(x, rep) * w1).sum(), x)
    (ref,) = torch.autograd.grad((x[rep] * w1).sum(), x)
    assert torch.allclose(grad, ref)


@pytest.mark.parametrize("name", ["mixed_with_empty_row", "batch_1", "all_padding"])
def test_unpad_pad_round_trip_gradient(name):
    """unpad -> elementwise -> pad: the gradient reaches exactly the real tokens."""
    mask = torch.tensor(MASKS[name], dtype=torch.bool)
    hidden = torch.randn(*mask.shape, 4, dtype=torch.float64, requires_grad=True)
    unpad, indices, _, _, _ = bp.unpad_input(hidden, mask)
    out = bp.pad_input(unpad * 3.0, indices, *mask.shape)
    weight = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * weight).sum(), hidden)
    assert torch.equal(grad, torch.where(mask[..., None], 3.0 * weight, torch.zeros(())))
    assert torch.autograd.gradcheck(
        lambda t: bp.pad_input(bp.unpad_input(t, mask)[0], indices, *mask.shape), (hidden,))


def test_bad_input_is_a_value_error_naming_the_argument():
    hidden = torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match=r"attention_mask: got shape \(2, 4\)"):
        bp.unpad_input(hidden, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask: got torch.float32"):
        bp.unpad_input(hidden, torch.ones(2, 5))
    with pytest.raises(ValueError, match="hidden_states"):
        bp.unpad_input(torch.randn(5), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="indices: got torch.float32"):
        bp.index_first_axis(hidden, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="input: got \\(5,\\)"):
        bp.index_first_axis(torch.randn(5), torch.tensor([0]))
    with pytest.raises(ValueError, match="hidden_states/indices: got 3 rows for 2 indices"):
        bp.pad_input(torch.randn(3, 4), torch.tensor([0, 1]), 1, 4)
