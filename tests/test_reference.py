"""The tiled PyTorch path: same grid as the kernels, larger sizes, fp32/fp64, and linear memory."""

import pytest
import torch

from flashtile import reference
from flashtile.bench import cpu_peak_bytes
from flashtile.options import AttentionOptions
from tests.utils import check_against_oracle, covering, make_qkv, stable_seed

HEADDIMS = [16, 40, 64, 96, 111, 128]
SEQLENS = [(1, 1), (1, 17), (17, 1), (113, 203), (128, 217), (256, 128), (600, 1023)]


class _Tiled(torch.autograd.Function):
    """The reference forward/backward pair behind autograd, with small blocks to cross many tiles."""

    @staticmethod
    def forward(ctx, q, k, v, opts, blocks):
        out, lse = reference.attention_forward(q, k, v, opts, block_m=blocks[0], block_n=blocks[1])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts, ctx.blocks = opts, blocks
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = reference.attention_backward(dout, q, k, v, out, lse, ctx.opts, block_m=ctx.blocks[0],
                                             block_n=ctx.blocks[1])
        return (*grads, None, None)


def _tiled(causal, scale=None, blocks=(64, 32), **variant):
    def run(q, k, v):
        opts = AttentionOptions(q.shape[-1] ** -0.5 if scale is None else scale, causal, **variant)
        return _Tiled.apply(q, k, v, opts, blocks)

    return run


@pytest.mark.parametrize(("headdim", "seqlens", "causal", "dtype"), covering(
    HEADDIMS, SEQLENS, [False, True], [torch.float32, torch.float64, torch.float16],
    ids=lambda d, s, c, t: f"d{d}-sq{s[0]}-sk{s[1]}-{'causal' if c else 'full'}-{t}"))
def test_tiled_against_oracle(headdim, seqlens, causal, dtype, poison):
    """Every head dim, length pair, mask and dtype; without a GPU (and --slow) the 42 cases that meet each
    head dim with each length pair and with each mask and dtype."""
    torch.manual_seed(stable_seed(headdim, seqlens, causal))
    nheads, nheads_k = (6, 2) if headdim % 2 else (4, 4)
    q, k, v = make_qkv(2, *seqlens, nheads, nheads_k, headdim, dtype)
    check_against_oracle(_tiled(causal), q, k, v, causal)


@pytest.mark.parametrize("nheads_k", [1, 2, 8])
def test_tiled_gqa_mqa(nheads_k):
    torch.manual_seed(nheads_k)
    q, k, v = make_qkv(2, 300, 257, 8, nheads_k, 64, torch.float32)
    check_against_oracle(_tiled(True), q, k, v, True)


def test_public_api_uses_tiled_path_on_cpu(backend):
    from flashtile import flash_attn_func

    backend("torch")
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 130, 140, 2, 1, 32, torch.float64)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out_ref, lse_ref = reference.attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=0, atol=1e-6)


def test_gradcheck_fp64():
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 9, 13, 2, 1, 8, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: _tiled(True)(q, k, v)[0], (q, k, v))


def test_peak_memory_grows_linearly():
    """Forward+backward peak bytes: 4x the sequence costs about 4x the memory (naive: 16x)."""

    def peak(seqlen, fn):
        q, k, v = make_qkv(1, seqlen, seqlen, 2, 2, 32, torch.float32)
        dout = torch.randn_like(q)
        return cpu_peak_bytes(lambda: torch.autograd.grad(fn(q, k, v)[0], (q, k, v), dout))

    # 128 x 128 tiles: the same linear memory as small ones, an eighth of the Python steps under the tracker.
    tiled = [peak(s, _tiled(True, blocks=(128, 128))) for s in (1024, 4096)]
    naive = [peak(s, lambda q, k, v: reference.attention_ref(q, k, v, causal=True)) for s in (1024, 4096)]
    assert tiled[1] / tiled[0] < 5.0, tiled
    assert naive[1] / naive[0] > 10.0, naive
    assert tiled[1] < naive[1] / 8


@pytest.mark.parametrize("causal", [False, True])
def test_saturated_softmax_gradient_error_is_rounding_of_its_terms(causal, backend):
    """softmax_scale = 1e3 in float32: every row's softmax is one-hot, the true dQ and dK are ~1e-33 and
    naive autograd (P * (dP - sum(P dP)), exact zeros from the one-hot P) gets them to ~1e-36. The
    FlashAttention backward forms delta = rowsum(dO * O) instead of sum(P dP) (it never holds a row of P),
    and dP - delta then keeps the float32 rounding of those dot products, times the scale: an error of a
    few ulp of scale * |dO| |V| |K|, the size of the terms dQ sums (docs/compatibility.md). This pins that
    bound (no more than rounding) rather than the 3x rule, which a near-exact baseline cannot give."""
    from flashtile import flash_attn_func
    from flashtile.reference import attention_ref

    backend("torch")
    torch.manual_seed(0)
    scale = 1e3
    q, k, v = make_qkv(1, 33, 33, 2, 2, 16, torch.float32)
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out_ref, _ = attention_ref(*leaves, softmax_scale=scale, causal=causal)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, leaves, dout.double())
    eps = torch.finfo(torch.float32).eps
    terms = scale * dout.norm(dim=-1).max() * v.detach().norm(dim=-1).max() * k.detach().norm(dim=-1).max()
    for got, want, norm in ((dq, dq_ref, terms), (dk, dk_ref, terms * q.detach().norm(dim=-1).max()
                                                   / k.detach().norm(dim=-1).max())):
        assert (got.double() - want).abs().max().item() <= 2 * eps * norm.item()
    assert (out.double() - out_ref).abs().max().item() <= 4 * eps * v.detach().abs().max().item()
    assert (dv.double() - dv_ref).abs().max().item() <= 8 * eps * dv_ref.abs().max().item()
