"""Variant cases shared by the PyTorch-path tests and the kernel tests (same grid, different sizes)."""

import pytest
import torch

from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.reference import attention_ref
from tests.utils import (
    assert_lse_close,
    assert_rule,
    check_against_oracle,
    make_qkv,
    random_cu_seqlens,
    stable_seed,
    varlen_oracle,
)

WINDOWS = [((16, 0), True), ((8, 8), False), ((0, 0), False), ((32, -1), False), ((-1, 5), False),
           ((40, 3), True)]
SEQ_PAIRS = [(113, 203), (203, 113), (64, 64)]


def flash(causal, **variant):
    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **variant)
        return out, lse

    return run


def check_window(window, causal, seqlens, dtype, device, headdim=32):
    torch.manual_seed(stable_seed(window, causal, seqlens))
    q, k, v = make_qkv(1, *seqlens, 4, 2, headdim, dtype, device)
    check_against_oracle(flash(causal, window_size=window), q, k, v, causal, window_size=window)


def check_softcap_alibi(kind, dtype, device, seqlens=(97, 130), headdim=32, causal=True):
    torch.manual_seed(stable_seed(kind))
    nheads = 4
    q, k, v = make_qkv(2, *seqlens, nheads, 2, headdim, dtype, device)
    variant = {}
    if "softcap" in kind:
        variant["softcap"] = 2.5  # small enough that tanh saturates on N(0, 1) scores at scale 1
    if "alibi" in kind:
        shape = (2, nheads) if "batch" in kind else (nheads,)
        variant["alibi_slopes"] = torch.rand(shape, device=device) * 0.3
    scale = 1.0 if "softcap" in kind else None
    check_against_oracle(flash(causal, softmax_scale=scale, **variant), q, k, v, causal, softmax_scale=scale,
                         **variant)


def check_sink(dtype, device, causal=True, seqlens=(70, 90)):
    """Attention sinks: out, lse and the gradients of q, k, v and the sink logits (3x rule)."""
    torch.manual_seed(5)
    q, k, v = make_qkv(2, *seqlens, 4, 2, 32, dtype, device)
    sink = (torch.randn(4, device=device) + 1.0).requires_grad_()
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, sink=sink, return_attn_probs=True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sink)]
    out_ref, lse_ref = attention_ref(*leaves[:3], causal=causal, sink=leaves[3])
    plain = [x.detach().clone().requires_grad_() for x in (q, k, v, sink)]
    out_pt, _ = attention_ref(*plain[:3], causal=causal, sink=plain[3])
    assert_rule("out", out, out_ref, out_pt, 2.0)
    assert (lse.double() - lse_ref).abs().max().item() < 1e-3
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), dout)
    want = torch.autograd.grad(out_ref, leaves, dout.double())
    base = torch.autograd.grad(out_pt, plain, dout)
    for name, g, w, b in zip(("dq", "dk", "dv", "dsink"), got, want, base):
        assert_rule(name, g, w, b, 3.0)


def check_dropout(dtype, device, causal, dropout_p=0.17, headdim=32, keep_fraction=True):
    """Dropout against the oracle built on the mask the backend drew (returned in S_dmask), gradients
    through the regenerated mask, reproducibility under torch.manual_seed, and (``keep_fraction``) the
    fraction kept on a larger matrix: one backend's random numbers, so one test per backend checks it."""
    torch.manual_seed(11)
    q, k, v = make_qkv(2, 77, 90, 4, 2, headdim, dtype, device)
    torch.manual_seed(5)
    out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, return_attn_probs=True)
    torch.manual_seed(5)
    again = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
    assert torch.equal(out, again), "same torch seed, same dropout mask"
    keep = s_dmask >= 0
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out_ref, _ = attention_ref(*leaves, causal=causal, dropout_mask=keep, dropout_p=dropout_p)
    plain = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out_pt, _ = attention_ref(*plain, causal=causal, dropout_mask=keep, dropout_p=dropout_p)
    assert_rule("out", out, out_ref, out_pt, 2.0)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(out_ref, leaves, dout.double())
    base = torch.autograd.grad(out_pt, plain, dout)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert_rule(name, g, w, b, 3.0)
    if not keep_fraction:
        return
    # Keep fraction on a larger matrix (non-causal: every entry is a real probability). 256 x 256 x 4
    # entries: the fraction's standard deviation is 0.0007, so the 0.01 bound is 13 of them.
    q_big = torch.randn(1, 256, 4, 16, dtype=dtype, device=device)
    _, _, big_mask = flash_attn_func(q_big, q_big, q_big, dropout_p=dropout_p, return_attn_probs=True)
    kept = (big_mask > 0).float().mean().item()
    assert abs(kept - (1 - dropout_p)) < 0.01, kept


VARLEN_CASES = [
    # (lengths_q, lengths_k, causal, window, nheads_k)
    ([5, 0, 1, 70, 33], [9, 4, 0, 70, 50], True, (-1, -1), 2),
    ([17, 64, 1], [17, 64, 1], False, (-1, -1), 4),
    ([40, 3, 66], [52, 3, 66], True, (12, 0), 1),
    ([30, 31], [31, 30], False, (6, 6), 2),
]


def check_varlen(lengths_q, lengths_k, causal, window, nheads_k, dtype, device, headdim=40, alibi=False):
    torch.manual_seed(sum(lengths_q) + 7 * sum(lengths_k))
    nheads = 4
    cu_q, cu_k = random_cu_seqlens(lengths_q, device), random_cu_seqlens(lengths_k, device)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, nheads, headdim, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(total_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(total_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=True)
    slopes = torch.rand(len(lengths_q), nheads, device=device) * 0.2 if alibi else None
    variant = dict(causal=causal, window_size=window, alibi_slopes=slopes)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                         return_attn_probs=True, **variant)
    assert out.shape == q.shape and lse.shape == (nheads, total_q)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = varlen_oracle(*leaves, cu_q, cu_k, **variant)
    plain = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out_pt, _ = varlen_oracle(*plain, cu_q, cu_k, dtype=None, **variant)
    assert_rule("out", out, out_ref, out_pt, 2.0)
    assert_lse_close(lse, lse_ref)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(out_ref, leaves, dout.double(), allow_unused=True)
    base = torch.autograd.grad(out_pt, plain, dout, allow_unused=True)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
        w = torch.zeros_like(g, dtype=torch.float64) if w is None else w
        b = torch.zeros_like(g) if b is None else b
        assert_rule(name, g, w, b, 3.0)


def check_varlen_dropout(dtype, device, causal, lengths=(17, 40, 5, 33), headdim=48, dropout_p=0.3):
    """Packed sequences with dropout. V is one-hot over each sequence's keys, so the output is the dropped and
    rescaled probabilities themselves (out = A v): the mask the forward drew is read off it (dropped entries are
    exact zeros), and the gradients are checked against the oracle on that mask, sequence by sequence. A backward
    that regenerated another mask than the forward's (packed counters are not the dense ones) fails."""
    torch.manual_seed(stable_seed("varlen dropout", causal))
    nheads, nheads_k = 4, 2
    cu = random_cu_seqlens(list(lengths), device)
    starts = cu.tolist()[:-1]
    total = sum(lengths)
    q = torch.randn(total, nheads, headdim, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(total, nheads_k, headdim, dtype=dtype, device=device, requires_grad=True)
    v = torch.zeros(total, nheads_k, headdim, dtype=dtype, device=device)
    for start, length in zip(starts, lengths):
        v[start:start + length, :, :length] = torch.eye(length, dtype=dtype, device=device)[:, None, :]
    v.requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), dropout_p=dropout_p, causal=causal)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    dropped = 0
    for start, length in zip(starts, lengths):
        rows = slice(start, start + length)
        keep = (out[rows, :, :length] > 0).permute(1, 0, 2)[None]  # (1, nheads, queries, keys)
        visible = torch.ones(length, length, dtype=torch.bool, device=device)
        if causal:
            visible = visible.tril()
        dropped += ((out[rows, :, :length] == 0) & visible[:, None, :]).sum().item()
        leaves = [x[rows][None].detach().double().requires_grad_() for x in (q, k, v)]
        out_ref, _ = attention_ref(*leaves, causal=causal, dropout_mask=keep, dropout_p=dropout_p)
        plain = [x[rows][None].detach().clone().requires_grad_() for x in (q, k, v)]
        out_pt, _ = attention_ref(*plain, causal=causal, dropout_mask=keep, dropout_p=dropout_p)
        assert_rule("out", out[rows][None], out_ref, out_pt, 2.0)
        want = torch.autograd.grad(out_ref, leaves, dout[rows][None].double())
        base = torch.autograd.grad(out_pt, plain, dout[rows][None])
        for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
            assert_rule(f"{name} of the sequence at {start}", g[rows][None], w, b, 3.0)
    assert dropped > 0, "some visible probabilities dropped"


__all__ = ["WINDOWS", "SEQ_PAIRS", "VARLEN_CASES", "check_window", "check_softcap_alibi", "check_varlen",
           "check_sink", "check_dropout", "check_varlen_dropout", "check_huge_windows", "check_negative_alibi",
           "check_large_softcap"]


def check_paged_varlen(dtype, device, page_size=16, causal=True):
    """flash_attn_varlen_func with block_table: keys in shuffled pages give the contiguous result."""
    torch.manual_seed(page_size + causal)
    lengths_q, lengths_k, nheads, nheads_k, headdim = [3, 1, 17, 0], [40, 5, 33, 9], 4, 2, 32
    cu_q, cu_k = random_cu_seqlens(lengths_q, device), random_cu_seqlens(lengths_k, device)
    q = torch.randn(sum(lengths_q), nheads, headdim, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lengths_k), nheads_k, headdim, dtype=dtype, device=device) for _ in range(2))
    max_pages = -(-max(lengths_k) // page_size)
    num_pages = len(lengths_k) * max_pages + 3
    order = torch.randperm(num_pages)[: len(lengths_k) * max_pages].view(len(lengths_k), max_pages)
    k_pool = torch.zeros(num_pages, page_size, nheads_k, headdim, dtype=dtype, device=device)
    v_pool = torch.zeros_like(k_pool)
    start = 0
    for b, n in enumerate(lengths_k):
        for j in range(n):
            k_pool[order[b, j // page_size], j % page_size] = k[start + j]
            v_pool[order[b, j // page_size], j % page_size] = v[start + j]
        start += n
    kw = dict(causal=causal, return_attn_probs=True)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **kw)
    # A strided table (every other column of a wider one), with -1 padding after the pages in use.
    wide = torch.full((len(lengths_k), 2 * max_pages + 2), -1, dtype=torch.int32)
    wide[:, 0:2 * max_pages:2] = order.to(torch.int32)
    for b, n in enumerate(lengths_k):
        wide[b, 2 * -(-n // page_size):2 * max_pages:2] = -1
    table = wide.to(device)[:, 0::2]
    out_p, lse_p, _ = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lengths_q), max(lengths_k), **kw,
                                             block_table=table)
    torch.testing.assert_close(out_p, out, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse_p, lse, atol=1e-4, rtol=0)
    # q that requires grad (flash-attn's suite passes such): the forward runs and gives the same result; only
    # a backward through it raises.
    q.requires_grad_()
    out_g = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                   block_table=table)
    assert out_g.requires_grad and torch.equal(out_g, out_p)
    with pytest.raises(NotImplementedError, match="forward only"):
        out_g.sum().backward()


def check_huge_windows(dtype, device):
    """Window bounds at or past every sequence length (2**31 - 1, sys.maxsize, 2**100) hide no key: the same
    bits as -1 (unbounded), forward and backward, dense and packed; no int32 or int64 overflow on the way.
    Bounds just below the lengths still mask (checked against the oracle)."""
    import sys

    torch.manual_seed(3)
    q, k, v = make_qkv(1, 20, 24, 2, 1, 16, dtype, device)
    dout = torch.randn_like(q)

    def run(**kw):
        out = flash_attn_func(q, k, v, **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    for huge, same in [((-1, 2**31 - 1), (-1, -1)), ((sys.maxsize, sys.maxsize), (-1, -1)),
                       ((2**31 - 1, 0), (-1, 0)), ((2**100, 2**63), (-1, -1)), ((24, 20), (-1, -1))]:
        for got, want in zip(run(window_size=huge), run(window_size=same)):
            assert torch.equal(got, want), f"window_size={huge} differs from {same}"
    for window in [(23, 19), (2, 18)]:  # one below each bound: still a window
        check_against_oracle(flash(False, window_size=window), q, k, v, False, window_size=window)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 24], dtype=torch.int32, device=device)
    packed = (q[0].detach(), k[0].detach(), v[0].detach(), cu, cu_k, 20, 24)
    assert torch.equal(flash_attn_varlen_func(*packed, window_size=(2**31 - 1, 2**31 - 1), causal=True),
                       flash_attn_varlen_func(*packed, causal=True))


def check_negative_alibi(dtype, device, causal=False):
    """Negative ALiBi slopes (a bias that grows with distance) with seqlen_q not a multiple of the row tile:
    forward and gradients against the oracle. The kernels' padded query rows once read lse = 0 in the
    backward, so their probabilities exp2(+slope * |rel|) overflowed and dK, dV turned non-finite."""
    torch.manual_seed(11)
    q, k, v = make_qkv(2, 20, 70, 2, 1, 16, dtype, device)  # padded rows then sit up to ~80 keys away
    slopes = torch.tensor([-0.3, -0.05], device=device)
    check_against_oracle(flash(causal, alibi_slopes=slopes), q, k, v, causal, alibi_slopes=slopes)


def check_large_softcap(softcap, dtype, device):
    """A softcap far above the scores (scores / softcap tiny, so the cap changes them by < 1e-9): tanh must
    keep its relative accuracy near 0, or the cap multiplies its error back up (the kernels'
    1 - 2 / (exp(2x) + 1) gave 5e-2 in out at 1e6, 1.1 at 1e30). The rule's baseline is plain attention
    in the input dtype without the cap (with it, fp16 cannot even hold the cap)."""
    torch.manual_seed(5)
    q, k, v = make_qkv(1, 20, 30, 2, 2, 16, dtype, device)
    out = flash_attn_func(q, k, v, causal=True, softcap=softcap)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out_ref, _ = attention_ref(*leaves, causal=True, softcap=softcap)
    plain = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out_pt, _ = attention_ref(*plain, causal=True)
    assert_rule("out", out, out_ref, out_pt, 2.0)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(out_ref, leaves, dout.double())
    base = torch.autograd.grad(out_pt, plain, dout)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert_rule(name, g, w, b, 3.0)
