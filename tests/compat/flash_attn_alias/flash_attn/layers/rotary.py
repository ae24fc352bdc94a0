"""``flash_attn.layers.rotary.apply_rotary_emb`` for flashtile's compatibility alias, in plain PyTorch.

Same signature and meaning as flash-attn's: the first ``rotary_dim = 2 * cos.shape[-1]`` features of each
head are rotated, at position ``seqlen_offsets + t`` of each sequence (positions past the table are left
as they are); arithmetic in float32, the result in x's dtype. Autograd flows through it.
"""

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., rotary_dim) float32 rotated by cos, sin (..., rotary_dim / 2)."""
    if interleaved:  # pairs (0, 1), (2, 3), ... (GPT-J)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)  # halves (i, i + rotary_dim / 2) (GPT-NeoX)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotary embedding of x.

    Args:
        x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with ``cu_seqlens``.
        cos, sin: (seqlen_rotary, rotary_dim / 2), rotary_dim <= headdim.
        interleaved: rotate pairs of neighbouring features instead of the two halves.
        inplace: write the result into x.
        seqlen_offsets: int or (batch,) integer tensor: the position of each sequence's first token.
        cu_seqlens: (batch + 1,) int32 for packed x; max_seqlen: unused (kept for the signature).

    Returns:
        x rotated, same shape and dtype.
    """
    rotary_half = cos.shape[-1]
    if 2 * rotary_half > x.shape[-1]:
        raise ValueError(f"rotary_dim ({2 * rotary_half}) must be at most headdim ({x.shape[-1]})")
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = torch.arange(seqlen, device=device)[None, :].expand(batch, seqlen)  # (batch, seqlen)
        sequence = torch.arange(batch, device=device)[:, None].expand(batch, seqlen)
    else:
        bounds = cu_seqlens.tolist()
        sequence = torch.cat([torch.full((b - a,), i, device=device) for i, (a, b) in enumerate(zip(bounds,
                                                                                                   bounds[1:]))])
        positions = torch.arange(x.shape[0], device=device) - cu_seqlens.to(device).long()[sequence]
    offsets = torch.as_tensor(seqlen_offsets, device=device).long()
    positions = positions + (offsets[sequence] if offsets.dim() else offsets)
    inside = positions < cos.shape[0]  # past the table: cos 1, sin 0 (unrotated), as flash-attn's kernel
    index = positions.clamp(0, cos.shape[0] - 1)
    cos_t = torch.where(inside[..., None], cos.float()[index], 1.0).unsqueeze(-2)  # (..., 1, rotary_dim / 2)
    sin_t = torch.where(inside[..., None], sin.float()[index], 0.0).unsqueeze(-2)
    rotated = _rotate(x[..., :2 * rotary_half].float(), cos_t, sin_t, interleaved).to(x.dtype)
    out = torch.cat([rotated, x[..., 2 * rotary_half:]], dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's older name

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func"]
