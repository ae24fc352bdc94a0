"""Block-sparse cases shared by the PyTorch-path and kernel tests."""

import math

import torch

from flashtile import SPARSE_BLOCK, block_sparse_attn_func, local_global_block_mask
from tests.utils import assert_rule


def dense_mask(block_mask, seqlen_q, seqlen_k):
    """Element mask (B|1, H|1, sq, sk) of a tile mask."""
    rows = torch.arange(seqlen_q, device=block_mask.device) // SPARSE_BLOCK
    cols = torch.arange(seqlen_k, device=block_mask.device) // SPARSE_BLOCK
    return block_mask[:, :, rows][:, :, :, cols]


def sparse_oracle(q, k, v, block_mask, causal, dtype):
    """Naive attention with the tile mask as an additive -inf bias (through softcap-free scores)."""
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    nheads, nheads_k = q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(nheads // nheads_k, 2), v.repeat_interleave(nheads // nheads_k, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    keep = dense_mask(block_mask, q.shape[1], k.shape[1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = keep & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    scores = scores.masked_fill(~keep, -math.inf)
    attn = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    return torch.einsum("bhts,bshd->bthd", attn, v)


def check_block_sparse(seqlen_q, seqlen_k, causal, per_head, dtype, device):
    torch.manual_seed(seqlen_q + seqlen_k + causal)
    batch, nheads, nheads_k, headdim = 2, 4, 2, 32
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=True)
    rows, cols = -(-seqlen_q // SPARSE_BLOCK), -(-seqlen_k // SPARSE_BLOCK)
    if per_head:
        block_mask = torch.rand(batch, nheads, rows, cols, device=device) < 0.5
    else:
        block_mask = local_global_block_mask(seqlen_q, seqlen_k, 0, 1, causal=causal, device=device)
    out = block_sparse_attn_func(q, k, v, block_mask, causal=causal)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out_ref = sparse_oracle(*leaves, block_mask, causal, None)
    plain = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out_pt = sparse_oracle(*plain, block_mask, causal, None)
    assert_rule("out", out, out_ref, out_pt, 2.0)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(out_ref, leaves, dout.double())
    base = torch.autograd.grad(out_pt, plain, dout)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert_rule(name, g, w, b, 3.0)


def check_local_global_mask():
    mask = local_global_block_mask(5 * SPARSE_BLOCK, 5 * SPARSE_BLOCK, 1, 1, causal=True)[0, 0]
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [True, False, True, True, False],
        [True, False, False, True, True],
    ]


def check_local_global_mask_keeps_each_diagonal(seqlen_q: int, seqlen_k: int, causal: bool):
    """Every query row's diagonal key (row + seqlen_k - seqlen_q, where that is a key) lies in a tile its block
    attends, whatever the shift in tokens; causal, no tile past the block's last diagonal key is on."""
    mask = local_global_block_mask(seqlen_q, seqlen_k, 0, 0, causal=causal)[0, 0]
    for row in range(seqlen_q):
        key = row + seqlen_k - seqlen_q
        if 0 <= key < seqlen_k:
            assert mask[row // SPARSE_BLOCK, key // SPARSE_BLOCK], (row, key)
    if causal:
        for block in range(mask.shape[0]):
            last_key = min((block + 1) * SPARSE_BLOCK, seqlen_q) - 1 + seqlen_k - seqlen_q
            assert not mask[block, last_key // SPARSE_BLOCK + 1:].any() if last_key >= 0 else not mask[block].any()
