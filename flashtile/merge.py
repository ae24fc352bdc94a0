"""Merging partial attention results by their logsumexp.

If ``out_i`` is softmax attention over a subset ``K_i`` of the keys and ``lse_i`` its logsumexp, then
attention over the union of disjoint subsets is ``sum_i exp(lse_i - lse) * out_i`` with
``lse = log(sum_i exp(lse_i))``. Split-KV decoding and context parallelism both rest on this.
A subset that a row does not see at all has ``lse_i = -inf`` and weight 0; a row that sees nothing in
any subset keeps out 0 and lse -inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _merged_lse(lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, empty): logsumexp over the parts (dim 0), and where every part is -inf (a row that saw no key
    anywhere: lse -inf). Its gradient there is 0, not logsumexp's NaN; a NaN part stays NaN."""
    empty = torch.isneginf(lse_parts).all(dim=0)
    lse = torch.logsumexp(torch.where(empty, 0.0, lse_parts), dim=0)
    return torch.where(empty, float("-inf"), lse), empty


def _weights(lse_parts: torch.Tensor, lse: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """exp(lse_i - lse) as (parts, batch, seqlen, nheads, 1), 0 where the row is empty (a NaN stays NaN)."""
    w = torch.where(empty, 0.0, torch.exp(lse_parts - torch.where(empty, 0.0, lse)))
    return w.transpose(-1, -2).unsqueeze(-1)


def merge_attention_states_many(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of partial results.

    Args:
        outs: each (batch, seqlen, nheads, headdim).
        lses: each (batch, nheads, seqlen), natural log.
        out_dtype: dtype of the merged out (default: that of ``outs[0]``). The arithmetic is float32
            (float64 when an input is float64).

    Returns:
        out (batch, seqlen, nheads, headdim) and lse (batch, nheads, seqlen) in the arithmetic dtype.
    """
    for name, parts in (("outs", outs), ("lses", lses)):
        if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(parts).__name__}")
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"need as many outs as lses, at least one; got {len(outs)} and {len(lses)}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        for name, x in ((f"outs[{i}]", o), (f"lses[{i}]", s)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TypeError(f"{name} must be a float tensor, got "
                                f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if o.dim() != 4 or s.shape != (o.shape[0], o.shape[2], o.shape[1]):
            raise ValueError(f"outs[{i}] must be (batch, seqlen, nheads, headdim) and lses[{i}] "
                             f"(batch, nheads, seqlen); got {tuple(o.shape)} and {tuple(s.shape)}")
        if o.shape != outs[0].shape:
            raise ValueError(f"every part must have the shape of outs[0] {tuple(outs[0].shape)} (the same rows, "
                             f"split over keys); outs[{i}] has {tuple(o.shape)}")
        if o.device != outs[0].device or s.device != outs[0].device:
            raise ValueError(f"outs[{i}] and lses[{i}] must be on {outs[0].device} (the device of outs[0]), got "
                             f"{o.device} and {s.device}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating torch.dtype or None, got {out_dtype!r}")
    acc = torch.float64 if any(x.dtype == torch.float64 for x in (*outs, *lses)) else torch.float32
    lse_parts = torch.stack([s.to(acc) for s in lses])  # (parts, B, H, S)
    lse, empty = _merged_lse(lse_parts)  # -inf where every part is -inf
    weights = _weights(lse_parts, lse, empty)
    out = sum(w * o.to(acc) for w, o in zip(weights, outs))
    return out.to(out_dtype or outs[0].dtype), lse


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results over disjoint key sets; see :func:`merge_attention_states_many`."""
    return merge_attention_states_many([out_a, out_b], [lse_a, lse_b], out_dtype)
