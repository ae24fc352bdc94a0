"""flashtile.rotary.apply_rotary_emb: flash-attn's rotary embedding (signature, positions, packed form,
argument checks)."""

import pytest
import torch

from flashtile.rotary import apply_rotary_emb


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb(interleaved):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)
    angles = torch.rand(7, 2, dtype=torch.float64) * 6  # rotary_dim 4 of 8; 7 positions
    offsets = torch.tensor([0, 3])
    out = apply_rotary_emb(x, angles.cos(), angles.sin(), interleaved, seqlen_offsets=offsets)
    for b in range(2):
        for t in range(6):
            pos = t + offsets[b].item()
            want = x[b, t].clone()
            if pos < 7:  # past the table: unrotated, as flash-attn's kernel
                pairs = [(0, 1), (2, 3)] if interleaved else [(0, 2), (1, 3)]
                for i, (a, c) in enumerate(pairs):
                    cos, sin = angles[pos, i].cos(), angles[pos, i].sin()
                    want[:, a] = x[b, t, :, a] * cos - x[b, t, :, c] * sin
                    want[:, c] = x[b, t, :, a] * sin + x[b, t, :, c] * cos
            torch.testing.assert_close(out[b, t], want)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    packed = apply_rotary_emb(x.reshape(12, 3, 8), angles.cos(), angles.sin(), interleaved,
                                     seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=6)
    torch.testing.assert_close(packed, out.reshape(12, 3, 8))


def test_inplace_and_gradient():
    x = torch.randn(1, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    angles = torch.rand(3, 4, dtype=torch.float64)
    out = apply_rotary_emb(x, angles.cos(), angles.sin())
    out.pow(2).sum().backward()  # a rotation keeps norms: the gradient of |out|^2 is 2x
    torch.testing.assert_close(x.grad, 2 * x.detach())
    y = x.detach().clone()
    assert apply_rotary_emb(y, angles.cos(), angles.sin(), inplace=True) is y
    torch.testing.assert_close(y, out.detach())


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.randn(2, 3, 8)), "x must be"),
    (dict(cos=torch.randn(5, 2), sin=torch.randn(5, 3)), "cos and sin"),
    (dict(cos=torch.randn(5, 5), sin=torch.randn(5, 5)), "rotary_dim"),
    (dict(x=torch.randint(0, 3, (1, 3, 2, 8))), "floating-point"),
    (dict(seqlen_offsets=1.5), "seqlen_offsets"),
    (dict(seqlen_offsets=torch.zeros(3, dtype=torch.long)), "seqlen_offsets"),
    (dict(x=torch.randn(6, 2, 8), cu_seqlens=torch.tensor([0.0, 6.0])), "cu_seqlens"),
    (dict(x=torch.randn(6, 2, 8), cu_seqlens=torch.tensor([0, 3])), "end at x's 6 rows"),
    (dict(x=torch.randn(6, 2, 8), cu_seqlens=torch.tensor([0, 4, 2, 6])), "not decrease"),
    (dict(seqlen_offsets=-1), "seqlen_offsets must be >= 0"),
])
def test_bad_arguments_are_named(bad, message):
    args = dict(x=torch.randn(1, 3, 2, 8), cos=torch.randn(5, 2), sin=torch.randn(5, 2))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=message):
        apply_rotary_emb(**args)
