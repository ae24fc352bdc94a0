"""Rotary embeddings as ``flash_attn.layers.rotary`` gives them, in plain PyTorch, so
``from flash_attn.layers.rotary import apply_rotary_emb, RotaryEmbedding`` becomes ``from flashtile.rotary import
...``: ``apply_rotary_emb`` (``apply_rotary_emb_func``), ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``,
``RotaryEmbedding``, and the reference helpers ``rotate_half`` and ``apply_rotary_emb_torch``.

Same signatures and meaning as flash-attn's: the first ``rotary_dim = 2 * cos.shape[-1]`` features of each
head are rotated, at position ``seqlen_offsets + t`` of each sequence (positions past the table are left
as they are); arithmetic in float32 (float64 for float64 x), the result in x's dtype. The backward rotates the
gradient back (the same tables, sine negated); cos and sin get no gradient, as in flash-attn. In-place calls
write into their input and return it, a leaf that requires grad included, as flash-attn's do.
(``flash_attn_with_kvcache`` rotates its new tokens itself, with ``rotary_cos``/``rotary_sin``.)
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


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
             seqlen_offsets: int | torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """x rotated (a new tensor, x's dtype): ``apply_rotary_emb``'s values, arguments already checked."""
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
    return out if cu_seqlens is None else out[0]


class _Rotary(torch.autograd.Function):
    """Rotations of parts of one tensor, in place or not: ``parts`` is a list of (index, cos, sin), ``index`` picking
    a view of the tensor (``_part``) that is rotated by its own tables. The backward rotates the gradient's parts
    back: the same tables with the sine negated (a rotation's adjoint is its inverse)."""

    @staticmethod
    def forward(ctx, x, parts, interleaved, inplace, seqlen_offsets, cu_seqlens):
        ctx.parts, ctx.interleaved, ctx.seqlen_offsets, ctx.cu_seqlens = parts, interleaved, seqlen_offsets, cu_seqlens
        # In place: flash-attn returns its input without marking it modified, so that a leaf that requires grad
        # (its own tests rotate such leaves) may be rotated too; autograd then gives back a view of it.
        return _rotate_parts(x, parts, interleaved, inplace, seqlen_offsets, cu_seqlens)

    @staticmethod
    def backward(ctx, grad):
        inverse = [(index, cos, -sin) for index, cos, sin in ctx.parts]
        return (_rotate_parts(grad, inverse, ctx.interleaved, False, ctx.seqlen_offsets, ctx.cu_seqlens),
                None, None, None, None, None)


def _rotate_parts(x: torch.Tensor, parts: list, interleaved: bool, inplace: bool, seqlen_offsets,
                  cu_seqlens) -> torch.Tensor:
    """x's ``parts`` rotated, in x itself (``inplace``) or in a copy, which is returned."""
    out = x if inplace else x.clone()
    for index, cos, sin in parts:
        view = _part(out, index)
        view.copy_(_rotated(view, cos, sin, interleaved, seqlen_offsets, cu_seqlens))
    return out


def _apply(x: torch.Tensor, parts: list, interleaved: bool, inplace: bool, seqlen_offsets, cu_seqlens) -> torch.Tensor:
    """``_Rotary`` where autograd records the call; else the rotation alone, returning x itself in place."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotary.apply(x, parts, interleaved, inplace, seqlen_offsets, cu_seqlens)
    return _rotate_parts(x, parts, interleaved, inplace, seqlen_offsets, cu_seqlens)


def _part(x: torch.Tensor, index) -> torch.Tensor:
    """The view of x that ``index`` names: None, all of x; (dim, start, stop), x narrowed along dim; an int,
    x[:, :, index] (q or k of a (batch, seqlen, 3 or 2, nheads, headdim) tensor)."""
    if index is None:
        return x
    if isinstance(index, int):
        return x[:, :, index]
    dim, start, stop = index
    return x.narrow(dim, start, stop - start)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: int | torch.Tensor = 0,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """Rotary embedding of x.

    Args:
        x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with ``cu_seqlens``.
        cos, sin: (seqlen_rotary, rotary_dim / 2), rotary_dim <= headdim.
        interleaved: rotate pairs of neighbouring features instead of the two halves.
        inplace: write the result into x (and return x).
        seqlen_offsets: int or (batch,) integer tensor: the position of each sequence's first token.
        cu_seqlens: (batch + 1,) int32 for packed x; max_seqlen: unused (kept for the signature).

    Returns:
        x rotated, same shape and dtype.
    """
    _check_args(x, cos, sin, seqlen_offsets, cu_seqlens)
    return _apply(x, [(None, cos, sin)], interleaved, inplace, seqlen_offsets, cu_seqlens)


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's older name


def _qkv_parts(qkv: torch.Tensor, num_heads_q: int | None, kv: bool = False) -> tuple:
    """(index of q or None, index of k) in a packed qkv (or kv) tensor, after checking its layout."""
    name = "kv" if kv else "qkv"
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(qkv).__name__}")
    if kv:
        if qkv.dim() != 5 or qkv.shape[2] != 2:
            raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got shape {tuple(qkv.shape)}")
        return None, 0
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got shape {tuple(qkv.shape)}")
        return 0, 1
    if qkv.dim() != 4:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2 * "
                         f"num_heads_k, headdim), got shape {tuple(qkv.shape)}")
    if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, numbers.Integral):
        raise ValueError("num_heads_q must be given (an int) for a (batch, seqlen, num_heads_q + 2 * num_heads_k, "
                         f"headdim) qkv, got {num_heads_q!r}")
    num_heads_k, odd = divmod(qkv.shape[2] - num_heads_q, 2)
    if num_heads_q <= 0 or num_heads_k <= 0 or odd:
        raise ValueError(f"qkv's {qkv.shape[2]} heads must be num_heads_q ({num_heads_q}) + 2 * num_heads_k")
    return (2, 0, num_heads_q), (2, num_heads_q, num_heads_q + num_heads_k)


def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cos_k: torch.Tensor | None = None,
                          sin_k: torch.Tensor | None = None, interleaved: bool = False,
                          seqlen_offsets: int | torch.Tensor = 0, num_heads_q: int | None = None) -> torch.Tensor:
    """Rotary embedding of q and k in a packed qkv, in place; returns qkv.

    Args:
        qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)
            (GQA/MQA: q's heads, then k's, then v's) with ``num_heads_q``.
        cos, sin: (seqlen_rotary, rotary_dim / 2) tables of q (and of k without ``cos_k``/``sin_k``).
        cos_k, sin_k: k's own tables (XPos), optional.
        interleaved, seqlen_offsets: as ``apply_rotary_emb``.
    """
    q_index, k_index = _qkv_parts(qkv, num_heads_q)
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    _check_args(_part(qkv, q_index), cos, sin, seqlen_offsets, None)
    _check_args(_part(qkv, k_index), cos_k, sin_k, seqlen_offsets, None)
    return _apply(qkv, [(q_index, cos, sin), (k_index, cos_k, sin_k)], interleaved, True, seqlen_offsets, None)


def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offsets: int | torch.Tensor = 0) -> torch.Tensor:
    """Rotary embedding of k in a packed kv (batch, seqlen, 2, nheads, headdim), in place; returns kv."""
    _, k_index = _qkv_parts(kv, None, kv=True)
    _check_args(_part(kv, k_index), cos, sin, seqlen_offsets, None)
    return _apply(kv, [(k_index, cos, sin)], interleaved, True, seqlen_offsets, None)


def rotate_half(x: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """(-x2, x1) of x's two halves (or, interleaved, of each pair of neighbouring features): the 90-degree turn
    that rotary embedding mixes in by sin."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleaved: bool = False) -> torch.Tensor:
    """The rotation written out, as flash-attn's reference: x (batch, seqlen, nheads, headdim), cos and sin
    (seqlen, rotary_dim / 2) or (batch, seqlen, rotary_dim / 2), in x's dtype; no position offsets."""
    rotary_dim = 2 * cos.shape[-1]
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over the heads
    rot = x[..., :rotary_dim]
    return torch.cat((rot * cos + rotate_half(rot, interleaved) * sin, x[..., rotary_dim:]), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's ``RotaryEmbedding`` (RoFormer's rotary position embedding; XPos with ``scale_base``): tables
    of ``dim`` rotated features from ``base`` (inverse frequencies base^(-2i/dim)), made in float32 and kept in
    the inputs' dtype up to the longest length seen; ``forward`` rotates q and k in place.

    Args:
        dim: rotary_dim, the features rotated in each head (even, at most headdim).
        base: the frequencies' base.
        interleaved: rotate pairs of neighbouring features (GPT-J) instead of the two halves (GPT-NeoX).
        scale_base: XPos's scale base (None: plain rotary; 512 is XPos's suggestion).
        device: where the inverse frequencies are made.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0 or dim % 2:
            raise ValueError(f"dim must be a positive even int (the rotated features), got {dim!r}")
        self.dim = int(dim)
        self.base = float(base)
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = None
        if scale_base is not None:
            scale = (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None) -> torch.Tensor:
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        """Tables for positions [0, seqlen) in ``dtype`` on ``device``, remade where the length grows, the device
        or dtype changes, or training starts on inference-mode tables."""
        cached = self._cos_cached
        if (seqlen <= self._seq_len_cached and cached is not None and cached.device == device
                and cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # float32 positions and frequencies whatever the module's dtype: their products reach large angles.
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        freqs = torch.outer(t, inv_freq.to(device))
        if self.scale is None:
            self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
            return
        power = (torch.arange(seqlen, dtype=self.scale.dtype, device=self.scale.device) - seqlen // 2) / self.scale_base
        scale = (self.scale.to(device=power.device) ** power[:, None]).to(freqs.device)
        self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
        self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: torch.Tensor | None = None, seqlen_offset: int | torch.Tensor = 0,
                max_seqlen: int | None = None,
                num_heads_q: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place.

        Args:
            qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)
                with ``num_heads_q``; with ``kv``, q alone (batch, seqlen, nheads, headdim).
            kv: (batch, seqlen, 2, nheads_k, headdim), optional.
            seqlen_offset: int or (batch,) integer tensor: each sequence's first position (a KV cache's length).
                With a tensor, pass ``max_seqlen`` so that the tables cover every position.
            max_seqlen: the tables' length (default seqlen + seqlen_offset for an int offset).

        Returns:
            qkv, or (q, kv), rotated.
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, numbers.Integral):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        if self._cos_cached is None:
            raise ValueError("max_seqlen must be given with a tensor seqlen_offset on the first call (no tables yet)")
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached, interleaved=self.interleaved,
                                  seqlen_offsets=seqlen_offset)
        return q, kv


__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_", "apply_rotary_emb_torch", "rotate_half"]
