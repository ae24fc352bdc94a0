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


def index_first_axis_residual(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x[indices], x)``: the rows and the input itself, for a caller that keeps both (a residual);
    gradients through either reach x."""
    return index_first_axis(x, indices), x


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """(len(indices), ...) -> (first_axis_dim, ...): ``values`` at rows ``indices``, zeros elsewhere.
    Differentiable with respect to values."""
    if values.dim() < 2:
        raise ValueError(f"values must have at least 2 dimensions, got shape {tuple(values.shape)}")
    return values.new_zeros(first_axis_dim, *values.shape[1:]).index_copy(0, indices, values)


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


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Pack rows that each hold several short samples back to back, every sample a sequence of its own.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask_in_length: (batch, seqlen) int: each row's nonzero entries, in order, are the lengths of
            the samples that fill that row from its start (``[2, 3, 0, 0, 0, 0]``: tokens 0-1 and 2-4, token 5
            padding); zeros are ignored.

    Returns:
        packed (total, ...), indices (total,) into the flattened (batch * seqlen) tokens, cu_seqlens int32
        (samples + 1,) over all samples of all rows, max_seqlen (int): four values, as flash-attn's.
    """
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    used = torch.arange(seqlen, device=lengths.device) < lengths.sum(dim=-1, keepdim=True)
    indices = torch.nonzero(used.flatten()).flatten()
    flat = lengths.flatten()
    seqlens = flat[flat != 0].to(torch.int32)
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = torch.cumsum(seqlens, dim=0)
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    packed = index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices)
    return packed, indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of ``unpad_input``: (total, ...) -> (batch, seqlen, ...), zeros at the padding.
    Differentiable with respect to hidden_states."""
    return index_put_first_axis(hidden_states, indices, batch * seqlen).view(batch, seqlen, *hidden_states.shape[1:])


__all__ = ["index_first_axis", "index_first_axis_residual", "index_put_first_axis", "pad_input", "unpad_input",
           "unpad_input_for_concatenated_sequences"]
