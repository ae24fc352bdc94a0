"""Block-sparse attention: a boolean tile mask says which (query block, key block) pairs attend.

The long-sequence recipe of long-document and genomics models: every token attends a local band of
blocks around it plus a few global blocks (that attend, and are attended by, everything). Tiles the mask
turns off are never visited by the kernels, so the cost follows the mask's density.
"""

from __future__ import annotations

import numbers
from dataclasses import replace

import torch

from . import _ops
from .interface import _check_options, _check_qkv, _is_bool
from .options import SPARSE_BLOCK


def block_sparse_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """Attention restricted to the tiles of ``block_mask``, forward and backward.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
        block_mask: bool (batch or 1, nheads or 1, ceil(seqlen_q / B), ceil(seqlen_k / B)) with
            B = ``flashtile.SPARSE_BLOCK`` = 128: query block i attends key block j iff
            ``block_mask[..., i, j]``. The other masks (causal, window) still apply inside the tiles.
        The rest as in ``flash_attn_func``; a row with no tile on outputs 0 (lse -inf).

    Returns:
        out (batch, seqlen_q, nheads, headdim), or (out, lse, None) with ``return_attn_probs``: no dropped
        probabilities even with ``dropout_p > 0`` (``flash_attn_func`` returns them).
    """
    backend = _check_qkv(q, k, v)
    opts = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q,
                          q.shape[0], seqlens=(q.shape[1], k.shape[1]))
    batch, seqlen_q, nheads, _ = q.shape
    rows, cols = -(-seqlen_q // SPARSE_BLOCK), -(-k.shape[1] // SPARSE_BLOCK)
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError("block_mask must be a bool tensor")
    if (block_mask.dim() != 4 or block_mask.shape[0] not in (1, batch) or block_mask.shape[1] not in (1, nheads)
            or tuple(block_mask.shape[2:]) != (rows, cols)):
        raise ValueError(f"block_mask must have shape (1 or {batch}, 1 or {nheads}, {rows}, {cols}) for blocks of "
                         f"{SPARSE_BLOCK}, got {tuple(block_mask.shape)}")
    if block_mask.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.device}, expected {q.device} (the device of q)")
    full_mask = block_mask.expand(batch, nheads, rows, cols).contiguous()
    opts = replace(opts, block_mask=full_mask)
    out, lse = _ops.attention(q, k, v, opts, backend, None)
    return (out, lse, None) if return_attn_probs else out


def local_global_block_mask(seqlen_q: int, seqlen_k: int, local_blocks: int, global_blocks: int = 1,
                            causal: bool = False, device=None) -> torch.Tensor:
    """The local-window + global-tokens tile mask, shape (1, 1, ceil(sq / B), ceil(sk / B)).

    Query row r's diagonal key is r + seqlen_k - seqlen_q (bottom-right, as the causal mask). Query block i
    attends the key blocks that hold its rows' diagonal keys and ``local_blocks`` more on each side (a diagonal
    key before key 0, where seqlen_q > seqlen_k, counts in block -1, -2, ...: those blocks' neighbours within
    ``local_blocks`` are attended, as a window counts from negative positions), the first
    ``global_blocks`` key blocks (global tokens are seen by all), and the first ``global_blocks`` query blocks
    attend every key block. With ``causal`` the key blocks after the last diagonal key block are dropped.
    """
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("local_blocks", local_blocks),
                        ("global_blocks", global_blocks)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not _is_bool(causal):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    causal = bool(causal)
    seqlen_q, seqlen_k = int(seqlen_q), int(seqlen_k)
    rows, cols = -(-seqlen_q // SPARSE_BLOCK), -(-seqlen_k // SPARSE_BLOCK)
    i = torch.arange(rows, device=device)[:, None]
    j = torch.arange(cols, device=device)[None, :]
    # Key blocks of the block's first and last rows' diagonal keys (in tokens: a shift that is not a multiple
    # of the block size puts a block's diagonal across two key blocks).
    first_row, last_row = i * SPARSE_BLOCK, torch.clamp((i + 1) * SPARSE_BLOCK - 1, max=max(seqlen_q - 1, 0))
    first_diag = torch.div(first_row + (seqlen_k - seqlen_q), SPARSE_BLOCK, rounding_mode="floor")
    last_diag = torch.div(last_row + (seqlen_k - seqlen_q), SPARSE_BLOCK, rounding_mode="floor")
    mask = (((j >= first_diag - local_blocks) & (j <= last_diag + local_blocks)) | (j < global_blocks)
            | (i < global_blocks))
    if causal:
        mask &= j <= last_diag
    return mask[None, None]
