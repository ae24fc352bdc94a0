"""Rotary embeddings as ``flash_attn.layers.rotary.apply_rotary_emb`` gives them, in plain PyTorch, so
``from flash_attn.layers.rotary import apply_rotary_emb`` becomes ``from flashtile.rotary import ...``.

Same signature and meaning as flash-attn's: the first ``rotary_dim = 2 * cos.shape[-1]`` features of each
head are rotated, at position ``seqlen_offsets + t`` of each sequence (positions past the table are left
as they are); arithmetic in float32 (float64 for float64 x), the result in x's dtype. Autograd flows
through it. (``flash_attn_with_kvcache`` rotates its new tokens itself, with ``rotary_cos``/``rotary_sin``.)
"""

from __future__ import annotations

import numbers

import torch

from .inference import _rotate
from .interface import values_readable


def _check_args(x, cos, sin, seqlen_offsets, cu_seqlens) -> None:
    """Bad arguments raise here, each named, before any computation."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    packed = cu_seqlens is not None
    if x.dim() != (3 if packed else 4):
        layout = "(total, nheads, headdim) with cu_seqlens" if packed else "(batch, seqlen, nheads, headdim)"
        raise ValueError(f"x must be {layout}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must both be (seqlen_rotary, rotary_dim / 2), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos and sin must be on x's device ({x.device}), got {cos.device} and {sin.device}")
    if not 0 < 2 * cos.shape[1] <= x.shape[-1]:
        raise ValueError(f"rotary_dim (2 * cos.shape[1] = {2 * cos.shape[1]}) must lie in [2, headdim = {x.shape[-1]}]")
    if packed and (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in
                   (torch.int32, torch.int64)):
        raise ValueError("cu_seqlens must be a 1-D int32 (or int64) tensor (batch + 1,)")
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = cu_seqlens.shape[0] - 1 if packed else x.shape[0]
        if seqlen_offsets.is_floating_point() or seqlen_offsets.dim() > 1 or (
                seqlen_offsets.dim() == 1 and seqlen_offsets.shape[0] != batch):
            raise ValueError(f"seqlen_offsets must be an int or an integer tensor of shape ({batch},), got "
                             f"{seqlen_offsets.dtype} of shape {tuple(seqlen_offsets.shape)}")
    elif isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, numbers.Integral):
        raise TypeError(f"seqlen_offsets must be an int or an integer tensor, got {type(seqlen_offsets).__name__}")
    elif seqlen_offsets < 0:
        raise ValueError(f"seqlen_offsets must be >= 0, got {seqlen_offsets}")
    if packed and values_readable(cu_seqlens.device):
        values = cu_seqlens.tolist()  # one host read (the packing below is told its size, and reads none)
        if not values or values[0] != 0 or values[-1] != x.shape[0] or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"cu_seqlens must start at 0, not decrease and end at x's {x.shape[0]} rows, got "
                             f"{values}")


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
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
    _check_args(x, cos, sin, seqlen_offsets, cu_seqlens)
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = torch.arange(seqlen, device=device)[None, :].expand(batch, seqlen)  # (batch, seqlen)
        sequence = torch.arange(batch, device=device)[:, None].expand(batch, seqlen)
    else:
        starts = cu_seqlens.to(device).long()
        sequence = torch.repeat_interleave(torch.arange(starts.shape[0] - 1, device=device), starts.diff(),
                                           output_size=x.shape[0])[None]
        positions = torch.arange(x.shape[0], device=device)[None] - starts[sequence]  # (1, total)
    offsets = torch.as_tensor(seqlen_offsets, device=device).long()
    positions = positions + (offsets[sequence] if offsets.dim() else offsets)
    inside = positions < cos.shape[0]  # past the table: cos 1, sin 0 (unrotated), as flash-attn's kernel
    index = positions.clamp(0, cos.shape[0] - 1)
    acc = torch.promote_types(x.dtype, torch.float32)
    cos_t = torch.where(inside[..., None], cos.to(acc)[index], 1.0)  # (batch or 1, seqlen or total, rotary_dim / 2)
    sin_t = torch.where(inside[..., None], sin.to(acc)[index], 0.0)
    out = _rotate(x if cu_seqlens is None else x[None], cos_t, sin_t, interleaved)
    out = out if cu_seqlens is None else out[0]
    if inplace:
        x.copy_(out)
        return x
    return out


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's older name

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func"]
