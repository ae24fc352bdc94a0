"""FP8 kernels on the GPU (compute capability 8.9+): the forward's FP8 variants against float64 attention.

Accuracy rule, FA3's (hopper/test_flash_attn.py) for its FP8 forward: on the dequantized inputs,

    max|out - out_ref| <= 2 * max|out_pt - out_ref| + fwd_atol

``out_ref`` float64 attention of the dequantized q, k, v; ``out_pt`` PyTorch attention of the same inputs in
bfloat16 (matmuls in bf16, softmax in float32) with the probabilities rounded to float8_e4m3fn before P V,
the rounding an FP8 P V product cannot avoid; ``fwd_atol`` twice bfloat16's rounding of out_ref's values
near 0.3. The kernel rounds the unnormalised exp(s - running max) to float8, out_pt the normalised
probabilities: each loses about float8's half-ulp (2^-4 relative) per weight, so their errors are of one
size and the factor 2 that the bf16 kernels meet applies.
"""

import math

import pytest
import torch

import flashtile
from flashtile import fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with FP8 tensor cores")

DEVICE = "cuda"


def _attention(q, k, v, causal, dtype, p_dtype=None):
    """Naive BSHD attention in ``dtype`` (softmax in float32 for half dtypes); GQA by repeating k, v."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype) for x in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    if causal:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
        scores = scores.masked_fill(~seen, -math.inf)
    probs = torch.softmax(scores.float() if dtype != torch.float64 else scores, dim=-1).to(dtype)
    probs = torch.nan_to_num(probs)  # rows that see no key
    if p_dtype is not None:
        probs = probs.to(p_dtype).to(dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shapes = ((batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim))
    q = torch.randn(*shapes[0], device=DEVICE, generator=gen)
    k, v = (torch.randn(*shapes[1], device=DEVICE, generator=gen) * 2 for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, nheads_k), fp8.quantize(k), fp8.quantize(v)
    return (q8, k8, v8), (qd, kd, vd)


def _check(out, q8, k8, v8, descales, causal):
    deq = [fp8.dequantize(x, d, torch.float64) for x, d in zip((q8, k8, v8), descales)]
    out_ref = _attention(*deq, causal, torch.float64)
    out_pt = _attention(*deq, causal, torch.bfloat16, p_dtype=torch.float8_e4m3fn)
    rounded = out_ref.to(torch.bfloat16)
    fwd_atol = 2 * (rounded + 0.3 - 0.3 - rounded).abs().max().item()
    assert not torch.isnan(out).any()
    err = (out.double() - out_ref).abs().max().item()
    base = (out_pt.double() - out_ref).abs().max().item()
    assert err <= 2 * base + fwd_atol, f"max error {err:.3e} > 2 x {base:.3e} + {fwd_atol:.1e}"


def check_lse(lse, q8, k8, descales, causal):
    """lse (batch, heads, seqlen_q) within twice the error of bf16 PyTorch scores, both against float64 scores of
    the dequantized q and k: an FP8 product on Hopper accumulates in fewer than float32's bits, so the kernel's
    scores are not float32-exact either; -inf exactly on rows that see no key."""
    q, k = (fp8.dequantize(x, d, torch.float64) for x, d in zip((q8, k8), descales[:2]))
    k = k.repeat_interleave(q.shape[2] // k.shape[2], 2)
    scale = q.shape[-1] ** -0.5

    def lse_of(q, k):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k).double() * scale
        if causal:
            seqlen_q, seqlen_k = q.shape[1], k.shape[1]
            seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
            scores = scores.masked_fill(~seen, -math.inf)
        return torch.logsumexp(scores, dim=-1)

    lse_ref = lse_of(q, k)
    lse_pt = lse_of(q.to(torch.bfloat16), k.to(torch.bfloat16))
    seen = torch.isfinite(lse_ref)
    assert torch.equal(seen, torch.isfinite(lse)), "lse: -inf exactly on rows that see no key"
    base = (lse_pt[seen] - lse_ref[seen]).abs().max().item()
    err = (lse.double()[seen] - lse_ref[seen]).abs().max().item()
    assert err <= 2 * base, f"lse: max error {err:.3e} > 2 x {base:.3e}"


@pytest.mark.parametrize("headdim", [64, 128, 256, 80])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(257, 257), (100, 515)], ids=["sq=sk", "sq<sk"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_fp8_forward(headdim, causal, seqlens, heads):
    (q8, k8, v8), descales = _inputs(2, *seqlens, *heads, headdim, seed=headdim + causal + seqlens[0] + heads[1])
    out = flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=descales[0], k_descale=descales[1],
                                    v_descale=descales[2])
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape
    _check(out, q8, k8, v8, descales, causal)
    again = flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=descales[0], k_descale=descales[1],
                                      v_descale=descales[2])
    assert torch.equal(out, again), "FP8 forward not bitwise reproducible"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_k", [515, 8], ids=["sk515", "sk8"])
def test_fp8_forward_keys_fastest_v_is_the_same_call(causal, seqlen_k):
    # quantize(v, keys_fastest=True) is taken as it is; the usual v is copied so: one kernel, equal bits.
    (q8, k8, v8), (qd, kd, vd) = _inputs(2, 100, seqlen_k, 8, 2, 128, seed=seqlen_k + causal)
    v = torch.randn(2, seqlen_k, 2, 128, device=DEVICE)
    (v8, vd), (v8_keys_fastest, vd_keys_fastest) = fp8.quantize(v), fp8.quantize(v, keys_fastest=True)
    assert v8_keys_fastest.stride(1) == 1 and torch.equal(v8_keys_fastest.float(), v8.float())
    assert torch.equal(vd, vd_keys_fastest)
    out = flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    got = flashtile.flash_attn_func(q8, k8, v8_keys_fastest, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out, got)
    # keys-fastest but rows not a multiple of 16 bytes: copied again (not read by the copy engine as is)
    odd = torch.empty(2, 2, 128, seqlen_k + 1, dtype=v8.dtype, device=DEVICE).permute(0, 3, 1, 2)[:, :seqlen_k]
    odd.copy_(v8)
    assert torch.equal(out, flashtile.flash_attn_func(q8, k8, odd, causal=causal, q_descale=qd, k_descale=kd,
                                                      v_descale=vd))


@pytest.mark.parametrize("seqlen", [515, 4096])  # 4,096: the Gluon FP8 forward's lengths on sm90
def test_fp8_packed_qkv_is_the_call_on_its_parts(seqlen):
    """An FP8 qkv packed as (batch, seqlen, 3, heads, d): strided q, k, v views, the same bits as flash_attn_func
    on contiguous copies of them (the kernels read the views in place, or copy what the copy engine cannot)."""
    (q8, k8, v8), (qd, kd, vd) = _inputs(1, seqlen, seqlen, 4, 4, 128, seed=seqlen)
    kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    qkv = torch.stack([q8, k8, v8], dim=2)
    out = flashtile.flash_attn_qkvpacked_func(qkv, **kw)
    assert torch.equal(out, flashtile.flash_attn_func(q8, k8, v8, **kw))
    assert torch.equal(out, flashtile.flash_attn_kvpacked_func(q8, qkv[:, :, 1:], **kw))


def test_transpose_keys_past_65535_heads():
    """The V transpose launches one flat grid axis: (batch, head) pairs past a CUDA grid's second axis."""
    from flashtile.kernels.forward import transpose_keys

    v = torch.randn(8200, 20, 8, 32, device=DEVICE).to(torch.float8_e4m3fn)
    out = torch.empty(8200, 8, 32, 32, device=DEVICE, dtype=torch.float8_e4m3fn)
    transpose_keys(v, out)
    assert torch.equal(out[..., :20].view(torch.uint8), v.permute(0, 2, 3, 1).contiguous().view(torch.uint8))


def test_fp8_forward_fp16_out_and_lse():
    (q8, k8, v8), descales = _inputs(1, 300, 300, 4, 4, 128, seed=7)
    out, lse, _ = flashtile.flash_attn_func(q8, k8, v8, q_descale=descales[0], k_descale=descales[1],
                                            v_descale=descales[2], out_dtype=torch.float16, return_attn_probs=True)
    assert out.dtype == torch.float16
    _check(out, q8, k8, v8, descales, False)
    check_lse(lse, q8, k8, descales, False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [64, 128])
def test_fp8_varlen(causal, headdim):
    lengths_q, lengths_k = [37, 1, 200, 64], [37, 90, 250, 64]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    nheads, nheads_k = 6, 2
    q = torch.randn(sum(lengths_q), nheads, headdim, device=DEVICE)
    k, v = (torch.randn(sum(lengths_k), nheads_k, headdim, device=DEVICE) for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize_varlen(q, cu_q, nheads_k), fp8.quantize_varlen(k, cu_k),
                                    fp8.quantize_varlen(v, cu_k))
    out = flashtile.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                           q_descale=qd, k_descale=kd, v_descale=vd)
    for b in range(len(lengths_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        _check(out[None, sq], q8[None, sq], k8[None, sk], v8[None, sk], (qd[b:b + 1], kd[b:b + 1], vd[b:b + 1]),
               causal)


@pytest.mark.parametrize("q_kind", ["fp8", "bf16"])
@pytest.mark.parametrize("v_layout", ["rows", "positions-fastest"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("headdim", [64, 128])
def test_fp8_cache_decoding(paged, headdim, v_layout, q_kind):
    """One new token appended to an FP8 cache and attended: out within the rule of the bf16 call on the
    dequantized cache (its own error against float64), and the cache holds the quantized token. V in rows, or
    laid out positions-fastest (``fp8.zeros_cache``); q float8 with its descale, or a bf16 model's q as it is."""
    batch, seqlen_cache, nheads, nheads_k = 3, 1024, 8, 2
    k_cache, v_cache = (torch.randn(batch, seqlen_cache, nheads_k, headdim, device=DEVICE) for _ in range(2))
    (kc8, kd), (vc8, vd) = fp8.quantize(k_cache), fp8.quantize(v_cache)
    q = torch.randn(batch, 1, nheads, headdim, device=DEVICE, dtype=torch.bfloat16)
    q8, qd = fp8.quantize(q, nheads_k)
    k_new, v_new = (torch.randn(batch, 1, nheads_k, headdim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([5, 700, 1000], dtype=torch.int32, device=DEVICE)
    table = None
    if paged:  # 64-token pages, shuffled
        page = 64
        order = torch.randperm(batch * seqlen_cache // page, device=DEVICE)
        table = order.view(batch, -1).to(torch.int32)
        pool_k, pool_v = (torch.empty_like(kc8.view(-1, page, nheads_k, headdim)) for _ in range(2))
        if v_layout != "rows":
            pool_v = fp8.zeros_cache(*pool_v.shape, device=DEVICE)[1]
        pool_k[order] = kc8.view(-1, page, nheads_k, headdim)
        pool_v[order] = vc8.view(-1, page, nheads_k, headdim)
        kc8, vc8 = pool_k, pool_v
    elif v_layout != "rows":
        vc8 = fp8.zeros_cache(*vc8.shape, device=DEVICE)[1].copy_(vc8)
    q_scale = dict(q_descale=qd) if q_kind == "fp8" else {}
    out = flashtile.flash_attn_with_kvcache(q8 if q_kind == "fp8" else q, kc8, vc8, k_new, v_new, cache_seqlens=seqlens,
                                           block_table=table, causal=True, k_descale=kd, v_descale=vd, **q_scale)
    assert out.dtype == torch.bfloat16
    if paged:  # back to rows
        kc8, vc8 = kc8[table.long()].reshape(batch, seqlen_cache, nheads_k, headdim), vc8[table.long()].reshape(
            batch, seqlen_cache, nheads_k, headdim)
    rows = torch.arange(batch, device=DEVICE)
    assert torch.equal(kc8[rows, seqlens.long()].float(), fp8._quantize_with(k_new[:, 0:1], kd)[:, 0].float())
    assert torch.equal(vc8[rows, seqlens.long()].float(), fp8._quantize_with(v_new[:, 0:1], vd)[:, 0].float())
    qq, kk, vv = (fp8.dequantize(x, d, torch.float64) for x, d in ((q8, qd), (kc8, kd), (vc8, vd)))
    if q_kind == "bf16":
        qq = q.double()
    for b in range(batch):
        keys = slice(0, int(seqlens[b]) + 1)
        ref = _attention(qq[b:b + 1], kk[b:b + 1, keys], vv[b:b + 1, keys], True, torch.float64)
        pt = _attention(qq[b:b + 1], kk[b:b + 1, keys], vv[b:b + 1, keys], True, torch.bfloat16)
        err = (out[b:b + 1].double() - ref).abs().max().item()
        base = (pt.double() - ref).abs().max().item()
        assert err <= 2 * base + 1e-3, f"entry {b}: max error {err:.3e} > 2 x {base:.3e} + 1e-3"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_fp8_attn_func_training(causal, heads, headdim):
    """fp8_attn_func: out by the forward rule, dq, dk, dv by 3x the error of bf16 PyTorch attention (P rounded
    to float8 in its forward, as the FP8 forward does) against float64, all at the quantized inputs."""
    gen = torch.Generator(device=DEVICE).manual_seed(headdim + causal + heads[1])
    q = torch.randn(2, 300, heads[0], headdim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 300, heads[1], headdim, device=DEVICE, generator=gen, dtype=torch.bfloat16)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = fp8.fp8_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    quantized = [fp8.quantize(q, heads[1]), fp8.quantize(k), fp8.quantize(v)]
    _check(out, *(x for x, _ in quantized), tuple(d for _, d in quantized), causal)
    ref_in = [fp8.dequantize(x, d, torch.float64).requires_grad_() for x, d in quantized]
    pt_in = [fp8.dequantize(x, d, torch.bfloat16).requires_grad_() for x, d in quantized]
    want = torch.autograd.grad(_attention(*ref_in, causal, torch.float64), ref_in, dout.double())
    base = torch.autograd.grad(_attention(*pt_in, causal, torch.bfloat16, p_dtype=torch.float8_e4m3fn), pt_in, dout)
    for name, got, ref, pt in zip(("dq", "dk", "dv"), grads, want, base):
        assert not torch.isnan(got).any()
        err, bound = (got.double() - ref).abs().max().item(), 3 * (pt.double() - ref).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3e} > 3 x {bound / 3:.3e}"


def _backward_pt(q, k, v, dout, do_dp, causal, dtype=torch.bfloat16):
    """(dq, dk, dv) of attention by hand in ``dtype`` (softmax and dS in float32), dP read from ``do_dp``."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    q, k, v = q.to(dtype), k.repeat_interleave(group, 2).to(dtype), v.repeat_interleave(group, 2).to(dtype)
    scale = headdim ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if causal:
        seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
        scores = scores.masked_fill(~seen, -math.inf)
    probs = scores.softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(dtype), v)
    dv = torch.einsum("bhqk,bqhd->bkhd", probs.to(dtype), dout.to(dtype))
    dp = torch.einsum("bqhd,bkhd->bhqk", do_dp.to(dtype), v).float()
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)[..., None]
    ds = (probs * (dp - delta)).to(dtype)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = (batch, seqlen_k, nheads_k, group, headdim)
    return dq, dk.view(fold).sum(3), dv.view(fold).sum(3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("headdim", [64, 128])
def test_fp8_backward_products(causal, heads, headdim, monkeypatch):
    """FLASHTILE_FP8_BACKWARD=1: QK^T and dO V^T on FP8 tensor cores, dO quantized per (batch, head). dq,
    dk, dv within 3x the error of bf16 PyTorch attention whose dP reads dO rounded as the kernel's is
    (the rounding an FP8 dO V^T cannot avoid), against float64 attention at the quantized inputs;
    bitwise reproducible."""
    monkeypatch.setenv("FLASHTILE_FP8_BACKWARD", "1")
    gen = torch.Generator(device=DEVICE).manual_seed(headdim + 2 * causal + heads[1])

    def spread(nheads):  # another magnitude per (batch, head): a scale taken from the wrong one shows
        return (torch.tensor([1.0, 3.0], device=DEVICE)[:, None] * torch.linspace(0.5, 2.0, nheads, device=DEVICE)
                )[:, None, :, None]

    q = torch.randn(2, 300, heads[0], headdim, device=DEVICE, generator=gen) * spread(heads[0])
    k, v = (torch.randn(2, 300, heads[1], headdim, device=DEVICE, generator=gen) * spread(heads[1]) for _ in range(2))
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    dout = (torch.randn(2, 300, heads[0], headdim, device=DEVICE, generator=gen) * spread(heads[0]).flip(2)
            ).to(torch.bfloat16)
    out = fp8.fp8_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    again = torch.autograd.grad(fp8.fp8_attn_func(q, k, v, causal=causal), (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "FP8 backward not bitwise reproducible"
    quantized = [fp8.quantize(q, heads[1]), fp8.quantize(k), fp8.quantize(v)]
    ref_in = [fp8.dequantize(x, d, torch.float64).requires_grad_() for x, d in quantized]
    want = torch.autograd.grad(_attention(*ref_in, causal, torch.float64), ref_in, dout.double())
    dout_rounded = fp8.dequantize(*fp8.quantize(dout), torch.float64)
    base = _backward_pt(*(x.detach() for x in ref_in), dout.double(), dout_rounded, causal)
    for name, got, ref, pt in zip(("dq", "dk", "dv"), grads, want, base):
        assert not torch.isnan(got).any()
        err, bound = (got.double() - ref).abs().max().item(), 3 * (pt.double() - ref).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3e} > 3 x {bound / 3:.3e}"


def test_fp8_attn_func_under_torch_compile():
    """Inductor compiles fp8_attn_func whole (its scaling passes fused, the FP8 kernel behind its custom
    op). Its scale factors may round in the last bit otherwise than eager PyTorch's, and so a few FP8
    inputs: out and gradients must lie within twice the eager call's own error against float64 attention
    of the (eager) quantized inputs."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v = (torch.randn(2, 300, 8, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    dout = torch.randn(2, 300, 8, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen)

    def step(q, k, v):
        return fp8.fp8_attn_func(q, k, v, causal=True)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        out = fn(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    ref_in = [fp8.dequantize(*fp8.quantize(x), torch.float64).requires_grad_() for x in (q, k, v)]
    ref_out = _attention(*ref_in, True, torch.float64)
    refs = (ref_out, *torch.autograd.grad(ref_out, ref_in, dout.double()))
    for name, got, eager, ref in zip(("out", "dq", "dk", "dv"), results[1], results[0], refs):
        assert not torch.isnan(got).any()
        diff, own = (got.double() - eager.double()).abs().max().item(), (eager.double() - ref).abs().max().item()
        assert diff <= 2 * own, f"{name}: compiled differs from eager by {diff:.3e} > 2 x {own:.3e}"


@pytest.mark.parametrize("gap", [5.0, 7.0, 9.0])
def test_fp8_forward_dominant_key(gap):
    """One key ``gap`` nats above all others for every query (a sink token such as BOS): the small weights
    must survive P's rounding to float8 (FA3's exp2(s - m + 8) range). Bound: twice the error of a float64
    emulation of that rounding, plus fwd_atol (P in (0, 1] instead gave 0.63 at gap 7, outputs near 1.9)."""
    gen = torch.Generator(device=DEVICE).manual_seed(int(gap))
    seqlen_q, seqlen_k, headdim = 16, 2048, 64
    q = torch.randn(1, seqlen_q, 1, headdim, device=DEVICE, generator=gen)
    k = torch.randn(1, seqlen_k, 1, headdim, device=DEVICE, generator=gen) * 0.1
    v = torch.randn(1, seqlen_k, 1, headdim, device=DEVICE, generator=gen) + 1.0
    scale = headdim ** -0.5
    k[0, 0, 0] = torch.linalg.lstsq(q[0, :, 0] * scale, torch.full((seqlen_q, 1), gap, device=DEVICE)).solution[:, 0]
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)
    out = flashtile.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    qq, kk, vv = (fp8.dequantize(x, d, torch.float64) for x, d in ((q8, qd), (k8, kd), (v8, vd)))
    scores = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scale
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)
    shifted = torch.exp2((scores - scores.amax(-1, keepdim=True)) / math.log(2) + 8)
    emulated = torch.einsum("bhqk,bkhd->bqhd", shifted.float().to(torch.float8_e4m3fn).double(), vv)
    emulated = emulated / shifted.sum(-1).transpose(1, 2)[..., None]
    rounded = ref.to(torch.bfloat16)
    fwd_atol = 2 * (rounded + 0.3 - 0.3 - rounded).abs().max().item()
    err, base = (out.double() - ref).abs().max().item(), (emulated - ref).abs().max().item()
    assert err <= 2 * base + fwd_atol, f"max error {err:.3e} > 2 x {base:.3e} + {fwd_atol:.1e}"
