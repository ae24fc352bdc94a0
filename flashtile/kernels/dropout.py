"""The dropout mask the attention kernels draw, materialised: a testing aid for return_attn_probs."""

import torch
import triton
import triton.language as tl

from . import configs
from .common import dropout_keep


@triton.jit(do_not_specialize=["seed"])  # (random: no compiled variant per divisibility class)
def _dropout_mask_kernel(Mask, seed, dropout_p, nheads, seqlen_q, seqlen_k,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Mask (batch * nheads, seqlen_q, seqlen_k) bool, with the counters of the dense kernels."""
    pid_bh = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    row_base = pid_bh.to(tl.int64) * seqlen_q
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, row_base + start_m, start_n, seqlen_k, dropout_p, BLOCK_M, BLOCK_N)
        ptrs = Mask + (row_base + rows[:, None]) * seqlen_k + cols[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))


def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int,
                 device) -> torch.Tensor:
    """(batch, nheads, seqlen_q, seqlen_k) bool: the entries the dense kernels keep for this seed."""
    mask = torch.empty(batch * nheads, seqlen_q, seqlen_k, dtype=torch.int8, device=device)
    _dropout_mask_kernel[(batch * nheads, configs.cdiv(seqlen_q, 32))](
        mask, seed, dropout_p, nheads, seqlen_q, seqlen_k, BLOCK_M=32, BLOCK_N=32)
    return mask.view(batch, nheads, seqlen_q, seqlen_k).bool()
