"""Variants through the Triton kernels (interpreter on CPU, fp16; bf16 and fp16 on a GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from flashtile.kernels.common import tanh as kernel_tanh
from tests.utils import covering
from tests.variant_cases import (
    SEQ_PAIRS,
    VARLEN_CASES,
    WINDOWS,
    check_dropout,
    check_huge_windows,
    check_large_softcap,
    check_negative_alibi,
    check_paged_varlen,
    check_sink,
    check_softcap_alibi,
    check_varlen,
    check_varlen_dropout,
    check_window,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


@pytest.mark.parametrize(("seqlens", "window_causal", "dtype"), covering(
    # Longer queries first: the causal windows' cases then have rows that see no key.
    sorted(SEQ_PAIRS, key=lambda s: -s[0]), WINDOWS, DTYPES, ids=lambda s, w, t: f"{w[0]}-{w[1]}-{s}-{t}"))
def test_window(window_causal, seqlens, dtype, poison):
    """Every window with every length pair (without a GPU: each window once, each length pair twice)."""
    check_window(*window_causal, seqlens, dtype, DEVICE)


@pytest.mark.parametrize("kind", ["softcap", "alibi", "alibi_batch", "softcap_alibi"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_alibi(kind, dtype, poison):
    check_softcap_alibi(kind, dtype, DEVICE)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{len(c[0])}seqs-causal{c[2]}-w{c[3]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen(case, dtype, poison):
    check_varlen(*case, dtype, DEVICE)


def test_varlen_alibi(poison):
    check_varlen([20, 7], [25, 7], True, (-1, -1), 2, DTYPES[0], DEVICE, alibi=True)


@pytest.mark.parametrize("causal", [False, True])
def test_sink(causal, poison):
    check_sink(DTYPES[0], DEVICE, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout(causal):
    check_dropout(DTYPES[0], DEVICE, causal, keep_fraction=not causal)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_dropout(causal, poison):
    check_varlen_dropout(DTYPES[0], DEVICE, causal)


@pytest.mark.parametrize("seed", [0, 12345, (1 << 62) - 7])
def test_dropout_mask_is_the_pytorch_paths(seed):
    """The kernels' dropout generator and the PyTorch path's (``reference.dropout_mask``, through ``dropout_keep``)
    keep the same entries of a dense call, bit for bit, across thresholds; about p of them dropped."""
    from flashtile import reference
    from flashtile.kernels.dropout import dropout_mask

    batch, nheads, seqlen_q, seqlen_k = 2, 3, 37, 45
    for dropout_p in (0.1, 1 / 3, 0.5, 0.9):
        kernels = dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, DEVICE)
        pytorch = reference.dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, DEVICE)
        assert torch.equal(kernels, pytorch), dropout_p
        assert abs((1 - kernels.float().mean().item()) - dropout_p) < 0.03, dropout_p


@pytest.mark.parametrize("kind", ["alibi_batch", "softcap_alibi", "sink", "sink_full"])
def test_packed_gqa_variants(kind, poison):
    """Few query rows with GQA: the forward packs the group's heads into one block (per-row head for the
    ALiBi slope, the sink, out and lse); the backward keeps the plain layout and reads that lse."""
    if kind.startswith("sink"):
        check_sink(DTYPES[0], DEVICE, causal=kind == "sink", seqlens=(13, 90))
    else:
        check_softcap_alibi(kind, DTYPES[0], DEVICE, seqlens=(17, 130))


@pytest.mark.parametrize("causal", [False, True])
def test_negative_alibi_slopes(causal, poison):
    check_negative_alibi(DTYPES[0], DEVICE, causal)


@pytest.mark.parametrize("softcap", [0.5, 1e6, 1e30])
def test_large_softcap(softcap, poison):
    check_large_softcap(softcap, DTYPES[0], DEVICE)


@triton.jit
def _apply_tanh(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, kernel_tanh(tl.load(X + offs, mask=offs < n)), mask=offs < n)


def test_tanh_accuracy():
    """The kernels' tanh against float64 over x in +-[1e-30, 1e3] (and 0): a few float32 ulp everywhere,
    exact sign and +-1 at saturation."""
    x = torch.cat([torch.logspace(-30, 3, 3000), torch.linspace(0.4, 0.7, 1000), torch.linspace(0, 12, 1000)])
    x = torch.cat([x, -x]).float().to(DEVICE)
    y = torch.empty_like(x)
    _apply_tanh[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double())
    relative = ((y.double() - want).abs() / want.abs().clamp_min(1e-300))[want != 0]
    assert relative.max().item() < 6e-7  # 5 ulp: the interpreter measures 1.6, a GPU's exp2 adds ~2
    assert torch.equal(y[x == 0], x[x == 0]) and torch.equal(y[x.abs() > 10], torch.sign(x[x.abs() > 10]))


def test_huge_window_bounds():
    """window_size=(-1, 2**31 - 1) gave an all-zero output here (int32 overflow of the key range)."""
    check_huge_windows(DTYPES[0], DEVICE)


@pytest.mark.parametrize("page_size,causal", [(16, True), (32, False)])
def test_paged_varlen(page_size, causal):
    check_paged_varlen(DTYPES[0], DEVICE, page_size, causal)


def test_paged_varlen_pages_checked_once_per_table(monkeypatch):
    """flash_attn_varlen_func with block_table reads the pages in use back once per (block_table, cu_seqlens_k)
    pair while both stay unwritten (a model's layers pass the same pair), again after an in-place write."""
    from flashtile import flash_attn_varlen_func, interface

    reads = []
    check = interface.pages_in_use_invalid
    monkeypatch.setattr(interface, "pages_in_use_invalid", lambda *a: reads.append(1) or check(*a))
    q = torch.randn(6, 2, 16, dtype=DTYPES[0], device=DEVICE)
    pool = torch.randn(3, 4, 2, 16, dtype=DTYPES[0], device=DEVICE)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEVICE)
    outs = [flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 7, causal=True, block_table=table) for _ in range(3)]
    assert len(reads) == 1 and all(torch.equal(o, outs[0]) for o in outs)
    cu_k.data[2] = 9  # a write PyTorch does not see: the keys follow the values, as the kernels read them
    got = flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 7, causal=True, block_table=table)
    assert torch.equal(got, flash_attn_varlen_func(q, pool, pool, cu_q, cu_k.clone(), 4, 7, causal=True,
                                                   block_table=table))
    table[1, 0] = 5  # in use by the second sequence, outside the pool: seen and refused
    with pytest.raises(ValueError, match="block_table values"):
        flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 7, causal=True, block_table=table)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bad_bounds_stay_inside(causal):
    """cu_seqlens values that were not checked (changed behind autograd's back after a check) are clamped
    by the kernels to the packed rows: forward and backward read and write nothing outside them. q, k, v,
    dout sit between NaN rows of a larger buffer, so a read outside would show as NaN."""
    from flashtile import kernels
    from flashtile.options import AttentionOptions

    total, nheads, headdim = 10, 2, 32
    dtype = DTYPES[0]

    def inside_nan(x):  # rows [3, 3 + total) of a NaN buffer
        buffer = torch.full((total + 6, nheads, headdim), float("nan"), dtype=dtype, device=DEVICE)
        buffer[3:3 + total] = x
        return buffer[3:3 + total]

    q, k, v, dout = (inside_nan(torch.randn(total, nheads, headdim, dtype=dtype, device=DEVICE)) for _ in range(4))
    opts = AttentionOptions(headdim**-0.5, causal=causal)
    good = torch.tensor([0, 4, total], dtype=torch.int32, device=DEVICE)
    out_good, lse_good = kernels.attention_forward(q, k, v, opts, (good, good, 6, 6))
    grads_good = kernels.attention_backward(dout, q, k, v, out_good, lse_good, opts, (good, good, 6, 6))
    # The second sequence runs past the end (4 + 10 > 10): clamped to the 6 rows there are.
    bad = torch.tensor([0, 4, 14], dtype=torch.int32, device=DEVICE)
    out, lse = kernels.attention_forward(q, k, v, opts, (bad, bad, 10, 10))
    grads = kernels.attention_backward(dout, q, k, v, out, lse, opts, (bad, bad, 10, 10))
    for got, want in zip((out, lse, *grads), (out_good, lse_good, *grads_good)):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want)
    # Negative and decreasing values: empty sequences, nothing read outside, no NaN.
    weird = torch.tensor([-5, 12, 3], dtype=torch.int32, device=DEVICE)
    out, lse = kernels.attention_forward(q, k, v, opts, (weird, weird, 10, 10))
    grads = kernels.attention_backward(dout, q, k, v, out, lse, opts, (weird, weird, 10, 10))
    assert not any(t.isnan().any() for t in grads)


def test_varlen_strided_cu_seqlens():
    """cu_seqlens given as a strided view (a column of a larger tensor) give the contiguous result,
    forward and backward (the kernels read contiguous cumulative cu_seqlens in place)."""
    from flashtile import flash_attn_varlen_func

    dtype = DTYPES[0]
    q, k, v, dout = (torch.randn(12, 2, 32, dtype=dtype, device=DEVICE) for _ in range(4))
    contiguous = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    strided = torch.tensor([[0, 99], [5, 99], [12, 99]], dtype=torch.int32, device=DEVICE)[:, 0]
    results = []
    for cu in (contiguous, strided):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu, cu, 7, 7, causal=True)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    for want, got in zip(*results):
        assert torch.equal(want, got)
