"""flashtile.rotary: flash-attn's rotary embedding (``flash_attn.layers.rotary``): apply_rotary_emb (signature,
positions, packed form, argument checks), the in-place qkv and kv forms, RotaryEmbedding (rotary and XPos)."""

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
    # In place on a leaf that requires grad (flash-attn's own tests do this): written into the leaf, and the
    # gradient flows back to it.
    leaf = x.detach().clone().requires_grad_()
    rotated = apply_rotary_emb(leaf, angles.cos(), angles.sin(), inplace=True)
    torch.testing.assert_close(leaf.detach(), out.detach())
    rotated.pow(2).sum().backward()
    torch.testing.assert_close(leaf.grad, 2 * x.detach())  # with respect to the values before the rotation


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


def _rotated_reference(x, cos, sin, interleaved, offsets):
    """x (batch, seqlen, heads, d) rotated at positions offsets[b] + t, float64, by ``apply_rotary_emb_torch``."""
    from flashtile.rotary import apply_rotary_emb_torch

    rows = []
    for b in range(x.shape[0]):
        index = torch.arange(x.shape[1]) + int(offsets[b] if torch.is_tensor(offsets) else offsets)
        rows.append(apply_rotary_emb_torch(x[b:b + 1].double(), cos[index].double()[None], sin[index].double()[None],
                                           interleaved))
    return torch.cat(rows)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["qkv", "gqa", "kv"])
def test_packed_rotations_in_place_with_gradients(layout, interleaved):
    """``apply_rotary_emb_qkv_`` (3 stacked heads, or GQA's q, k, v heads side by side) and ``apply_rotary_emb_kv_``
    rotate q and k (k alone) in place, a leaf that requires grad included, as flash-attn's do; v is untouched; the
    gradient is the upstream gradient rotated back; per-sequence offsets."""
    from flashtile.rotary import apply_rotary_emb_kv_, apply_rotary_emb_qkv_

    torch.manual_seed(11)
    batch, seqlen, d, heads_q, heads_k = 2, 5, 8, 4, 2
    shape = {"qkv": (batch, seqlen, 3, heads_q, d), "gqa": (batch, seqlen, heads_q + 2 * heads_k, d),
             "kv": (batch, seqlen, 2, heads_k, d)}[layout]
    packed = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    before = packed.detach().clone()
    angles = torch.rand(9, 3, dtype=torch.float64) * 6  # rotary_dim 6 of 8
    offsets = torch.tensor([0, 3])
    if layout == "kv":
        out = apply_rotary_emb_kv_(packed, angles.cos(), angles.sin(), interleaved, seqlen_offsets=offsets)
        parts = [(before[:, :, 0], out[:, :, 0], True), (before[:, :, 1], out[:, :, 1], False)]
    elif layout == "qkv":
        out = apply_rotary_emb_qkv_(packed, angles.cos(), angles.sin(), interleaved=interleaved,
                                    seqlen_offsets=offsets)
        parts = [(before[:, :, i], out[:, :, i], i < 2) for i in range(3)]
    else:
        out = apply_rotary_emb_qkv_(packed, angles.cos(), angles.sin(), interleaved=interleaved,
                                    seqlen_offsets=offsets, num_heads_q=heads_q)
        bounds = [(0, heads_q, True), (heads_q, heads_q + heads_k, True), (heads_q + heads_k, None, False)]
        parts = [(before[:, :, a:b], out[:, :, a:b], rotated) for a, b, rotated in bounds]
    assert torch.equal(packed.detach(), out.detach())  # in place
    for x, got, rotated in parts:
        want = _rotated_reference(x, angles.cos(), angles.sin(), interleaved, offsets) if rotated else x
        torch.testing.assert_close(got, want)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference = before.clone().requires_grad_()
    ref_parts = {"kv": lambda t: torch.stack([_rotated_reference(t[:, :, 0], angles.cos(), angles.sin(), interleaved,
                                                                 offsets), t[:, :, 1]], dim=2),
                 "qkv": lambda t: torch.stack([_rotated_reference(t[:, :, i], angles.cos(), angles.sin(), interleaved,
                                                                  offsets) for i in range(2)] + [t[:, :, 2]], dim=2),
                 "gqa": lambda t: torch.cat([_rotated_reference(t[:, :, :heads_q], angles.cos(), angles.sin(),
                                                                interleaved, offsets),
                                             _rotated_reference(t[:, :, heads_q:heads_q + heads_k], angles.cos(),
                                                                angles.sin(), interleaved, offsets),
                                             t[:, :, heads_q + heads_k:]], dim=2)}[layout]
    ref_parts(reference).backward(grad)
    torch.testing.assert_close(packed.grad, reference.grad)


@pytest.mark.parametrize("scale_base", [None, 512.0], ids=["rotary", "xpos"])
@pytest.mark.parametrize("with_kv", [False, True], ids=["qkv", "q-and-kv"])
def test_rotary_embedding_module(scale_base, with_kv):
    """``RotaryEmbedding`` as flash-attn's: tables from base^(-2i/dim) in float32 (XPos scales q's by
    scale^(position - L/2) and divides k's), grown to the longest length seen; q and k rotated in place at
    positions seqlen_offset + t; an int offset grows the tables to cover it."""
    from flashtile.rotary import RotaryEmbedding

    torch.manual_seed(5)
    dim, d, heads, seqlen, offset = 6, 8, 2, 4, 3
    module = RotaryEmbedding(dim, base=100.0, scale_base=scale_base)
    qkv = torch.randn(2, seqlen, 3, heads, d, dtype=torch.float64)
    before = qkv.clone()
    if with_kv:
        q, kv = module(qkv[:, :, 0].clone(), qkv[:, :, 1:].clone(), seqlen_offset=offset)
        got_q, got_k, got_v = q, kv[:, :, 0], kv[:, :, 1]
    else:
        out = module(qkv, seqlen_offset=offset)
        assert out.data_ptr() == qkv.data_ptr()
        got_q, got_k, got_v = out.unbind(2)
    length = seqlen + offset
    assert module._seq_len_cached == length and module._cos_cached.shape == (length, dim // 2)
    inv_freq = 1.0 / 100.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    scale = torch.ones_like(angles)
    if scale_base is not None:
        power = (torch.arange(length, dtype=torch.float64) - length // 2) / scale_base
        scale = ((torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim))[None, :] ** power[:, None]
    want_q = _rotated_reference(before[:, :, 0], angles.cos() * scale, angles.sin() * scale, False, offset)
    want_k = _rotated_reference(before[:, :, 1], angles.cos() / scale, angles.sin() / scale, False, offset)
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)  # the tables are float32
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_v, before[:, :, 2])


def test_rotary_embedding_tensor_offsets_and_gqa():
    """Per-sequence offsets (a tensor) with ``max_seqlen`` for the tables, on GQA's packed heads."""
    from flashtile.rotary import RotaryEmbedding

    module = RotaryEmbedding(8, interleaved=True)
    qkv = torch.randn(2, 3, 4 + 2 * 1, 8, dtype=torch.float64)
    before = qkv.clone()
    offsets = torch.tensor([2, 0])
    module(qkv, seqlen_offset=offsets, max_seqlen=6, num_heads_q=4)
    cos, sin = module._cos_cached.double(), module._sin_cached.double()
    torch.testing.assert_close(qkv[:, :, :4], _rotated_reference(before[:, :, :4], cos, sin, True, offsets))
    torch.testing.assert_close(qkv[:, :, 4:5], _rotated_reference(before[:, :, 4:5], cos, sin, True, offsets))
    assert torch.equal(qkv[:, :, 5:], before[:, :, 5:])


@pytest.mark.parametrize("call, message", [
    (lambda r: r.apply_rotary_emb_qkv_(torch.randn(1, 2, 4, 2, 8), *_TABLES), "qkv must be"),
    (lambda r: r.apply_rotary_emb_qkv_(torch.randn(1, 2, 6, 8), *_TABLES), "num_heads_q must be given"),
    (lambda r: r.apply_rotary_emb_qkv_(torch.randn(1, 2, 7, 8), *_TABLES, num_heads_q=4), "num_heads_q"),
    (lambda r: r.apply_rotary_emb_kv_(torch.randn(1, 2, 3, 2, 8), *_TABLES), "kv must be"),
    (lambda r: r.apply_rotary_emb_qkv_(torch.randn(1, 2, 3, 2, 8), torch.randn(5, 5), torch.randn(5, 5)),
     "rotary_dim"),
    (lambda r: r.RotaryEmbedding(7), "dim must be"),
    (lambda r: r.RotaryEmbedding(8)(torch.randn(1, 2, 3, 2, 8), seqlen_offset=torch.tensor([1])), "max_seqlen"),
])
def test_packed_bad_arguments_are_named(call, message):
    import flashtile.rotary as rotary

    with pytest.raises((ValueError, TypeError), match=message):
        call(rotary)


_TABLES = (torch.randn(5, 2), torch.randn(5, 2))
