"""Between padded (batch, seqlen, ...) tensors and packed (total, ...) ones, for the varlen functions: what
``flash_attn.bert_padding`` gives, with its signatures and return values (``unpad_input`` returns five values,
as flash-attn >= 2.6 does), so ``from flash_attn.bert_padding import ...`` becomes
``from flashtile.bert_padding import ...``. Autograd flows through plain indexing.

    packed, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, attention_mask)   # x: (batch, seqlen, ...)
    out = pad_input(packed_out, indices, batch, seqlen)
"""

import torch


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows ``indices`` of x (first axis): (n, ...) -> (len(indices), ...). Differentiable."""
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dimensions, got shape {tuple(x.shape)}")
    return x[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Pack the tokens of ``attention_mask`` (and ``unused_mask``, allocated but unused) out of a padded batch.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: (batch, seqlen) bool or int, nonzero for real tokens.
        unused_mask: (batch, seqlen) or None: tokens kept in the packed tensor but not counted as used.

    Returns:
        packed (total, ...), indices (total,) into the flattened (batch * seqlen) tokens, cu_seqlens int32
        (batch + 1,), max_seqlen (int), seqused int32 (batch,): the used tokens per sequence.
    """
    selected = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten()).flatten()
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=seqlens.device)
    cu_seqlens[1:] = torch.cumsum(seqlens, dim=0)
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])  # (batch * seqlen, ...)
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of ``unpad_input``: (total, ...) -> (batch, seqlen, ...), zeros at the padding.
    Differentiable with respect to hidden_states."""
    padded = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    padded = padded.index_copy(0, indices, hidden_states)
    return padded.view(batch, seqlen, *hidden_states.shape[1:])


__all__ = ["index_first_axis", "pad_input", "unpad_input"]
