"""The attention variant being computed, in one object shared by the API, the PyTorch path and the kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

SPARSE_BLOCK = 128  # rows and columns of one tile of a block-sparse mask
FLOAT32_NORMAL_MIN = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max
LOG2E = math.log2(math.e)
MAX_SOFTMAX_SCALE = FLOAT32_MAX / LOG2E  # the scale times log2(e), as the kernels use it, stays finite


@dataclass(frozen=True)
class AttentionOptions:
    """What to compute, beyond q, k and v (the flash-attn 2 semantics).

    Attributes:
        softmax_scale: multiplier of ``q @ k^T``.
        causal: bottom-right aligned causal mask (query i sees key j iff j <= i + seqlen_k - seqlen_q).
        window_left, window_right: query i sees keys in
            ``[i + seqlen_k - seqlen_q - window_left, i + seqlen_k - seqlen_q + window_right]``; -1 means
            unbounded on that side. ``causal`` sets the right bound to 0.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)`` (score already scaled).
        alibi_slopes: float32 (nheads,) or (batch, nheads); adds ``-slope * |i + sk - sq - j|``.
        sink: float32 (nheads,) attention-sink logits: one extra score per row with no value, so that
            ``softmax`` normalises by ``sum_j exp(s_ij) + exp(sink_h)`` (beyond flash-attn 2).
        block_mask: bool (batch, nheads, ceil(sq / SPARSE_BLOCK), ceil(sk / SPARSE_BLOCK)) tile mask of
            block-sparse attention (already expanded); False tiles are skipped entirely.
        dropout_p, dropout_seed: probability of zeroing an attention weight (survivors scaled by
            1 / (1 - p)); the seed of the counter-based generator that forward and backward share (while
            torch.compile traces, a one-element int64 host tensor: see ``interface._dropout_seed``).
    """

    softmax_scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sink: torch.Tensor | None = None
    block_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    dropout_seed: int | torch.Tensor = 0

    def __post_init__(self):
        # The kernels take both as float32 and divide and multiply by them: a value that float32 rounds
        # to 0 (or inf) would turn masked scores' -inf * 0 into NaN instead of a clear error; and they fold
        # log2(e) into the scale, which must stay finite too.
        if not FLOAT32_NORMAL_MIN <= self.softmax_scale <= MAX_SOFTMAX_SCALE:
            raise ValueError(f"softmax_scale must be a positive float32 normal number at most float32's largest "
                             f"/ log2(e) ({FLOAT32_NORMAL_MIN:.3g} to {MAX_SOFTMAX_SCALE:.4g}), "
                             f"got {self.softmax_scale!r}")
        if self.softcap != 0 and not FLOAT32_NORMAL_MIN <= self.softcap <= FLOAT32_MAX:
            raise ValueError(f"softcap must be 0 (off) or a positive float32 normal number "
                             f"({FLOAT32_NORMAL_MIN:.3g} to {FLOAT32_MAX:.3g}), got {self.softcap!r}")
        # The kernels multiply by softmax_scale / softcap and softcap * log2(e) in float32: a quotient that
        # flushes to 0 would make every score 0 (uniform attention), a product that overflows NaN.
        if self.softcap != 0 and (self.softmax_scale / self.softcap < FLOAT32_NORMAL_MIN
                                  or self.softcap * LOG2E > FLOAT32_MAX):
            raise ValueError(f"softcap {self.softcap!r} is too large for float32 arithmetic with softmax_scale "
                             f"{self.softmax_scale!r} (softmax_scale / softcap must stay above "
                             f"{FLOAT32_NORMAL_MIN:.3g}, softcap * log2(e) below {FLOAT32_MAX:.3g})")

    @property
    def left_limit(self) -> int | None:
        """How far left of the diagonal a query sees, or None (unbounded)."""
        return None if self.window_left < 0 else self.window_left

    @property
    def right_limit(self) -> int | None:
        """How far right of the diagonal a query sees, or None (unbounded); 0 when causal."""
        if self.causal:
            return 0 if self.window_right < 0 else min(self.window_right, 0)
        return None if self.window_right < 0 else self.window_right


class CacheLengths(NamedTuple):
    """Key bounds of a KV cache read in place: sequence b's keys are rows
    [r * row_stride, r * row_stride + lengths[b]) of the cache's row view (``inference.cache_rows``), r = b or
    ``rows[b]`` (cache_batch_idx), or positions [0, lengths[b]) of its pages (a paged pool: row_stride 0, the
    block table maps positions to rows). The kernels read ``lengths`` and ``rows`` as they are, so a decoding
    step builds no bounds tensor (small kernels less per step, next to an attention kernel of ~0.1 ms).

    lengths: (batch,) int32, contiguous, on the cache's device. row_stride: the cache's pitch, or 0.
    rows: None, or (batch,) int32, contiguous: each sequence's cache entry.
    """

    lengths: torch.Tensor
    row_stride: int
    rows: torch.Tensor | None = None


def as_bounds(seqlens: torch.Tensor | CacheLengths) -> torch.Tensor:
    """(batch, 2) int32 [start, length] per sequence, from cumulative ``cu_seqlens`` (batch + 1,), from
    ``CacheLengths``, or from bounds already in that form (the KV cache builds them: a start inside the
    cache and a length)."""
    if isinstance(seqlens, CacheLengths):
        lengths = seqlens.lengths
        entries = (seqlens.rows if seqlens.rows is not None else
                   torch.arange(lengths.shape[0], dtype=torch.int32, device=lengths.device))
        starts = entries * seqlens.row_stride
        return torch.stack([starts, lengths.to(torch.int32)], dim=1)
    if seqlens.dim() == 2:
        return seqlens
    return torch.stack([seqlens[:-1], seqlens[1:] - seqlens[:-1]], dim=1).to(torch.int32).contiguous()


def sparse_lists(block_mask: torch.Tensor, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, head, row block): how many column blocks are on, and their indices first.

    Returns counts int32 (batch * nheads * rows) and indices int32 (batch * nheads * rows * cols); with
    ``transpose`` the roles of rows (query blocks) and columns (key blocks) swap, for the dK/dV pass.
    Built with tensor ops on the mask's device, no host synchronisation.
    """
    mask = block_mask.transpose(-1, -2) if transpose else block_mask
    counts = mask.sum(-1, dtype=torch.int32)
    # A stable sort of "off" puts the on-blocks first, in increasing order.
    indices = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts.reshape(-1).contiguous(), indices.reshape(-1).contiguous()
