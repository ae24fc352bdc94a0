"""flashtile.bert_padding: flash-attn's padding helpers (signatures and return values)."""

import torch

from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.bert_padding import index_first_axis, pad_input, unpad_input


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
