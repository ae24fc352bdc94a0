"""flashtile.bert_padding: flash-attn's padding helpers (signatures and return values)."""

import torch

from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.bert_padding import (
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def test_round_trip_and_gradient():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert packed.shape == (9, 2, 4) and cu_seqlens.tolist() == [0, 3, 8, 9] and max_seqlen == 5
    assert cu_seqlens.dtype == torch.int32 and seqused.tolist() == [3, 5, 1]
    assert torch.equal(packed, x[mask])
    assert torch.equal(index_first_axis(x.reshape(15, 2, 4), indices), packed)
    back = pad_input(packed, indices, 3, 5)
    assert torch.equal(back, x * mask[..., None, None])
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].expand_as(x).float())
    unused = torch.zeros_like(mask)
    unused[0, 3] = True  # allocated, not used: packed, not counted in seqused
    _, _, cu_seqlens, _, seqused = unpad_input(x, mask, unused)
    assert cu_seqlens.tolist() == [0, 4, 9, 10] and seqused.tolist() == [3, 5, 1]


def test_varlen_through_unpad_matches_each_sequence_alone(backend):
    """The usual varlen recipe: unpad q, k, v, run flash_attn_varlen_func, pad the output back."""
    backend("torch")
    torch.manual_seed(1)
    batch, seqlen, heads, headdim = 3, 7, 2, 8
    q, k, v = (torch.randn(batch, seqlen, heads, headdim, dtype=torch.float64) for _ in range(3))
    lengths = [7, 4, 1]
    mask = torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]
    q_packed, indices, cu_seqlens, max_seqlen, _ = unpad_input(q, mask)
    k_packed, v_packed = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(flash_attn_varlen_func(q_packed, k_packed, v_packed, cu_seqlens, cu_seqlens, max_seqlen,
                                           max_seqlen, causal=True), indices, batch, seqlen)
    for row, length in enumerate(lengths):
        alone = flash_attn_func(q[row:row + 1, :length], k[row:row + 1, :length], v[row:row + 1, :length],
                                causal=True)
        torch.testing.assert_close(out[row:row + 1, :length], alone)
        assert not out[row, length:].any()


def test_index_put_and_residual_helpers():
    x = torch.randn(6, 3, requires_grad=True)
    indices = torch.tensor([4, 0, 2])
    rows, residual = index_first_axis_residual(x, indices)
    assert torch.equal(rows, x[indices]) and torch.equal(residual, x)
    (rows.sum() + residual.sum()).backward()
    assert x.grad[:, 0].tolist() == [2, 1, 2, 1, 2, 1]
    values = torch.randn(3, 2, requires_grad=True)
    spread = index_put_first_axis(values, indices, 6)
    assert spread.shape == (6, 2) and torch.equal(spread[indices], values)
    assert spread[[1, 3, 5]].abs().sum() == 0
    (spread * torch.arange(6.0)[:, None]).sum().backward()
    assert values.grad[:, 0].tolist() == [4, 0, 2]


def test_concatenated_samples_attend_each_to_itself(backend):
    """flash-attn's docstring example: rows of back-to-back samples, each sample its own sequence."""
    backend("torch")
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.randn(3, 6, 2, 8, dtype=torch.float64)
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.tolist() == [0, 2, 5, 8, 10, 16] and cu_seqlens.dtype == torch.int32 and max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(packed, x.reshape(18, 2, 8)[indices])
    out = flash_attn_varlen_func(packed, packed, packed, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
    padded = pad_input(out, indices, 3, 6)
    for row, starts in enumerate([[0, 2], [0, 3], [0]]):
        for start, length in zip(starts, [n for n in lengths[row].tolist() if n]):
            sample = x[row:row + 1, start:start + length]
            want = flash_attn_func(sample, sample, sample, causal=True)[0]
            torch.testing.assert_close(padded[row, start:start + length], want)
    assert padded[0, 5].abs().sum() == 0
