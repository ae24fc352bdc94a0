"""FP8 inputs (FA3's convention) on the PyTorch path: quantization, the dequantize path, bad input."""

import os
import re

import pytest
import torch

import flashtile
from flashtile import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, fp8
from flashtile.inference import _rotate
from flashtile.kernels import configs
from tests.utils import run_without_triton

F8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


def _fp8_qkv(b=2, sq=7, sk=9, h=4, hk=2, d=16, seed=0):
    """Quantized q, k, v (q with one scale per kv head) and their descales."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g) * (1 + torch.arange(n))[:, None]
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    (qf, qd), (kf, kd), (vf, vd) = fp8.quantize(q, hk), fp8.quantize(k), fp8.quantize(v)
    return qf, kf, vf, qd, kd, vd


def _assert_fp8_error_bound(x, x_fp8, descale, per_head):
    """|x - x_fp8 * descale| <= 2^-4 |x| (3 mantissa bits, round to nearest) + 2^-10 * descale (subnormals)."""
    err = (fp8.dequantize(x_fp8, descale, torch.float32) - x).abs()
    assert (err <= x.abs() * 2**-4 + per_head * 2**-10 + 1e-12).all()


@pytest.mark.parametrize("nheads_k", [None, 2, 1])
def test_quantize_round_trip(nheads_k):
    x = torch.randn(3, 11, 4, 16) * torch.tensor([1e-3, 1.0, 50.0, 1e4])[:, None]
    x[1, :, 2] = 0  # an all-zero (batch, head): descale 1, no NaN
    x_fp8, descale = fp8.quantize(x, nheads_k)
    assert x_fp8.dtype == F8 and x_fp8.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == (3, nheads_k or 4)
    heads = descale.repeat_interleave(4 // descale.shape[1], dim=1)[:, None, :, None]
    amax = x.abs().amax(dim=(1, 3)).view(3, descale.shape[1], -1).amax(-1)
    torch.testing.assert_close(descale, torch.where(amax > 0, amax / 448, torch.ones_like(amax)), rtol=1e-6, atol=0)
    assert not torch.isnan(x_fp8.float()).any()
    _assert_fp8_error_bound(x, x_fp8, descale, heads)
    if nheads_k is None:
        assert descale[1, 2] == 1 and (x_fp8[1, :, 2].float() == 0).all()


def test_quantize_keys_fastest_is_the_same_values_laid_out_for_fp8_products():
    x = torch.randn(2, 21, 3, 24)
    plain, descale = fp8.quantize(x)
    keys_fastest, descale_kf = fp8.quantize(x, keys_fastest=True)
    assert torch.equal(descale, descale_kf) and keys_fastest.shape == x.shape
    assert keys_fastest.stride() == (3 * 24 * 32, 1, 24 * 32, 32)  # tokens fastest, rows padded to 16
    assert torch.equal(keys_fastest.float(), plain.float())
    assert fp8.dequantize(keys_fastest, descale).is_contiguous()


@pytest.mark.parametrize("shape,headdim_stride", [((2, 300, 3, 80), 1), ((1, 5, 2, 17), 1), ((3, 129, 2, 24), 2)])
def test_transpose_keys_kernel(shape, headdim_stride):
    """The FP8 forward's transposing copy (its Triton kernel in the interpreter): odd lengths and head dims,
    a strided source; the padding columns are left as they were."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel runs on CPU tensors in the Triton interpreter only")
    from flashtile.kernels.forward import transpose_keys

    batch, seqlen, nheads, headdim = shape
    source = torch.randn(batch, seqlen, nheads, headdim * headdim_stride).to(F8)[..., ::headdim_stride]
    out = torch.full((batch, nheads, headdim, seqlen + 7), 1.0).to(F8)
    transpose_keys(source, out)
    assert torch.equal(out[..., :seqlen].float(), source.permute(0, 2, 3, 1).float())
    assert (out[..., seqlen:].float() == 1).all()


def test_keys_fastest_v_is_not_copied_again(monkeypatch):
    """The FP8 forward reads quantize(v, keys_fastest=True) in place; a usual v is copied once."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the FP8 kernel runs on CPU tensors in the Triton interpreter only")
    from flashtile.kernels import forward
    from flashtile.options import AttentionOptions

    copies = []
    monkeypatch.setattr(forward, "transpose_keys", lambda v, out: copies.append(v) or out[..., :v.shape[1]].copy_(
        v.permute(0, 2, 3, 1)))
    qf, kf, vf, qd, kd, vd = _fp8_qkv(sk=40, d=32)
    v_keys_fastest, _ = fp8.quantize(fp8.dequantize(vf, vd, torch.float32), keys_fastest=True)
    opts = AttentionOptions(32 ** -0.5)
    forward.attention_forward(qf, kf, v_keys_fastest, opts, fp8=(qd, kd, vd, torch.bfloat16, False))
    assert copies == []
    forward.attention_forward(qf, kf, vf, opts, fp8=(qd, kd, vd, torch.bfloat16, False))
    assert len(copies) == 1


def test_func_takes_a_keys_fastest_v():
    qf, kf, vf, qd, kd, vd = _fp8_qkv()
    v_keys_fastest = torch.empty(2, 2, 16, 9, dtype=F8).permute(0, 3, 1, 2)
    v_keys_fastest.copy_(vf)
    out = flash_attn_func(qf, kf, vf, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out, flash_attn_func(qf, kf, v_keys_fastest, q_descale=qd, k_descale=kd, v_descale=vd))
    with pytest.raises(ValueError, match="v must have a contiguous last dimension"):  # 16-bit v: not allowed
        flash_attn_func(*(x.float() for x in (qf, kf)), v_keys_fastest.float())


def test_quantize_varlen_matches_per_sequence():
    cu = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32)  # an empty sequence among them
    x = torch.randn(13, 4, 8) * torch.arange(1, 14)[:, None, None]
    x_fp8, descale = fp8.quantize_varlen(x, cu, nheads_k=2)
    assert x_fp8.shape == x.shape and descale.shape == (4, 2)
    assert torch.equal(descale[1], torch.ones(2))
    for b in range(4):
        lo, hi = cu[b].item(), cu[b + 1].item()
        if hi > lo:
            one_fp8, one_descale = fp8.quantize(x[None, lo:hi], nheads_k=2)
            assert torch.equal(descale[b], one_descale[0])
            assert torch.equal(x_fp8[lo:hi].float(), one_fp8[0].float())
    back = fp8.dequantize(x_fp8, descale, torch.float32, cu_seqlens=cu)
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-3).all()


def test_dequantize_maps_query_heads_to_their_kv_head():
    x_fp8 = torch.ones(1, 2, 6, 4).to(F8)
    descale = torch.tensor([[1.0, 10.0, 100.0]])  # 6 heads, 3 kv heads: heads (0, 1), (2, 3), (4, 5)
    got = fp8.dequantize(x_fp8, descale, torch.float32)
    assert torch.equal(got[0, 0, :, 0], torch.tensor([1.0, 1, 10, 10, 100, 100]))


@pytest.mark.parametrize("out_dtype", [None, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_func_equals_the_call_on_dequantized_inputs(heads, out_dtype, causal):
    qf, kf, vf, qd, kd, vd = _fp8_qkv(h=heads[0], hk=heads[1])
    out, lse, _ = flash_attn_func(qf, kf, vf, causal=causal, return_attn_probs=True, q_descale=qd, k_descale=kd,
                                  v_descale=vd, out_dtype=out_dtype)
    dtype = out_dtype or torch.bfloat16
    ref, lse_ref, _ = flash_attn_func(fp8.dequantize(qf, qd, dtype), fp8.dequantize(kf, kd, dtype),
                                      fp8.dequantize(vf, vd, dtype), causal=causal, return_attn_probs=True)
    assert out.dtype == dtype and out.shape == qf.shape
    assert torch.equal(out, ref) and torch.equal(lse, lse_ref)
    # GQA mapping spelled out: query head h is q_fp8 * q_descale[:, h // group], in float32 (the bound is
    # bfloat16's rounding of sharp softmaxes; a wrong head mapping changes the output by O(1)).
    group = heads[0] // heads[1]
    q32 = qf.float() * qd[:, None, torch.arange(heads[0]) // group, None]
    k32, v32 = kf.float() * kd[:, None, :, None], vf.float() * vd[:, None, :, None]
    torch.testing.assert_close(out.float(), flash_attn_func(q32, k32, v32, causal=causal), atol=0.1, rtol=0.05)


def test_varlen_equals_the_call_on_dequantized_inputs():
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 8, 17], dtype=torch.int32)
    q, k, v = torch.randn(10, 4, 16), torch.randn(17, 2, 16), torch.randn(17, 2, 16)
    (qf, qd), (kf, kd), (vf, vd) = (fp8.quantize_varlen(q, cu_q, 2), fp8.quantize_varlen(k, cu_k),
                                    fp8.quantize_varlen(v, cu_k))
    out = flash_attn_varlen_func(qf, kf, vf, cu_q, cu_k, 7, 9, causal=True, q_descale=qd, k_descale=kd,
                                 v_descale=vd)
    # Dequantized by hand: token t of sequence b takes row b of the descales.
    seq_q = torch.repeat_interleave(torch.arange(3), cu_q.diff())
    seq_k = torch.repeat_interleave(torch.arange(3), cu_k.diff())
    q_deq = (qf.float() * qd[seq_q].repeat_interleave(2, dim=1)[:, :, None]).bfloat16()
    k_deq, v_deq = ((x.float() * d[seq_k][:, :, None]).bfloat16() for x, d in ((kf, kd), (vf, vd)))
    ref = flash_attn_varlen_func(q_deq, k_deq, v_deq, cu_q, cu_k, 7, 9, causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


@pytest.mark.parametrize("out_dtype", [None, torch.float16], ids=["bf16", "fp16"])
def test_packed_functions_equal_flash_attn_func_on_their_parts(out_dtype):
    """FP8 qkv / kv packed (as FA3's packed functions take them): the same bits as flash_attn_func and
    flash_attn_varlen_func on the unbound parts with the same descales."""
    qf, kf, vf, qd, kd, vd = _fp8_qkv(sq=9, sk=9, h=4, hk=4)
    kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype)
    ref = flash_attn_func(qf, kf, vf, **kw)
    assert torch.equal(flashtile.flash_attn_qkvpacked_func(torch.stack([qf, kf, vf], dim=2), **kw), ref)
    assert torch.equal(flashtile.flash_attn_kvpacked_func(qf, torch.stack([kf, vf], dim=2), **kw), ref)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    flat = [x.reshape(18, 4, 16) for x in (qf, kf, vf)]
    ref = flash_attn_varlen_func(*flat, cu, cu, 9, 9, **kw)
    assert torch.equal(ref.reshape(2, 9, 4, 16), flash_attn_func(qf, kf, vf, **kw))
    packed = flashtile.flash_attn_varlen_qkvpacked_func(torch.stack(flat, dim=1), cu, 9, **kw)
    assert torch.equal(packed, ref)
    packed = flashtile.flash_attn_varlen_kvpacked_func(flat[0], torch.stack(flat[1:], dim=1), cu, cu, 9, 9, **kw)
    assert torch.equal(packed, ref)


def test_packed_kv_with_gqa_equals_the_call_on_its_parts():
    """FP8 q over packed kv with fewer kv heads (GQA), dense and packed sequences: the bits of the call on the
    unbound parts."""
    qf, kf, vf, qd, kd, vd = _fp8_qkv(sq=7, sk=9, h=4, hk=2)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(flashtile.flash_attn_kvpacked_func(qf, torch.stack([kf, vf], dim=2), **kw),
                       flash_attn_func(qf, kf, vf, **kw))
    cu_q, cu_k = torch.tensor([0, 7, 14], dtype=torch.int32), torch.tensor([0, 9, 18], dtype=torch.int32)
    q_flat, k_flat, v_flat = qf.reshape(14, 4, 16), kf.reshape(18, 2, 16), vf.reshape(18, 2, 16)
    packed = flashtile.flash_attn_varlen_kvpacked_func(q_flat, torch.stack([k_flat, v_flat], dim=1), cu_q, cu_k, 7, 9,
                                                       causal=True, **kw)
    assert torch.equal(packed, flash_attn_varlen_func(q_flat, k_flat, v_flat, cu_q, cu_k, 7, 9, causal=True, **kw))


def _packed_fp8_calls():
    """(call, error type, the part its message names) of FP8 packed calls that are wrong."""
    qf, kf, vf, qd, kd, vd = _fp8_qkv(sq=9, sk=9, h=4, hk=4)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    qkv, kv = torch.stack([qf, kf, vf], dim=2), torch.stack([kf, vf], dim=2)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    qkv_flat, kv_flat = qkv.reshape(18, 3, 4, 16), kv.reshape(18, 2, 4, 16)
    return {
        "qkvpacked, no descales": (lambda: flashtile.flash_attn_qkvpacked_func(qkv), TypeError, "qkv[:, :, 0]"),
        "kvpacked, bf16 kv": (lambda: flashtile.flash_attn_kvpacked_func(qf, kv.bfloat16(), **kw), TypeError,
                              "kv[:, :, 0]"),
        "kvpacked, heads": (lambda: flashtile.flash_attn_kvpacked_func(
            torch.cat([qf, qf[:, :, :1]], dim=2), kv, **kw), ValueError, "kv[:, :, 0]"),
        "qkvpacked, grad": (lambda: flashtile.flash_attn_qkvpacked_func(
            qkv.float().requires_grad_().to(F8), **kw), NotImplementedError, "qkv[:, :, 0]"),
        "varlen qkvpacked, no descales": (lambda: flashtile.flash_attn_varlen_qkvpacked_func(qkv_flat, cu, 9),
                                          TypeError, "qkv[:, 0]"),
        "varlen kvpacked, bf16 kv": (lambda: flashtile.flash_attn_varlen_kvpacked_func(
            qf.reshape(18, 4, 16), kv_flat.bfloat16(), cu, cu, 9, 9, **kw), TypeError, "kv[:, 0]"),
    }


@pytest.mark.parametrize("case", list(_packed_fp8_calls()))
def test_packed_fp8_errors_name_the_part(case):
    call, exc, part = _packed_fp8_calls()[case]
    with pytest.raises(exc, match=re.escape(part)):
        call()


def test_quantize_keys_fastest_on_the_cpu_needs_no_triton():
    """Off Linux flashtile installs without Triton: the CPU path, keys-fastest V included, imports none."""
    out = run_without_triton("""
        import torch, flashtile
        from flashtile import fp8
        (q, qd), (k, kd) = fp8.quantize(torch.randn(1, 5, 2, 8)), fp8.quantize(torch.randn(1, 5, 2, 8))
        v, vd = fp8.quantize(torch.randn(1, 5, 2, 8), keys_fastest=True)
        print(flashtile.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd).shape)
        """)
    assert "torch.Size([1, 5, 2, 8])" in out


def test_paged_varlen_reads_each_sequence_with_its_factors():
    page, lengths = 4, [6, 5]
    pool = torch.randn(5, page, 2, 16).to(F8)
    v_pool = torch.randn(5, page, 2, 16).to(F8)
    table = torch.tensor([[3, 0], [3, 1]], dtype=torch.int32)  # page 3 shared by both sequences
    kd, vd = torch.tensor([[0.5, 1.0], [2.0, 3.0]]), torch.tensor([[1.0, 0.25], [4.0, 1.0]])
    q = torch.randn(2, 4, 16)
    qf, qd = fp8.quantize_varlen(q, torch.tensor([0, 1, 2], dtype=torch.int32), nheads_k=2)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 11], dtype=torch.int32)
    out = flash_attn_varlen_func(qf, pool, v_pool, cu_q, cu_k, 1, 6, block_table=table, q_descale=qd, k_descale=kd,
                                 v_descale=vd)
    for b in range(2):
        keys = pool.float()[table[b].long()].reshape(-1, 2, 16)[:lengths[b]].float() * kd[b][None, :, None]
        values = v_pool.float()[table[b].long()].reshape(-1, 2, 16)[:lengths[b]].float() * vd[b][None, :, None]
        ref = flash_attn_func(fp8.dequantize(qf[b:b + 1][None], qd[b:b + 1]), keys[None].bfloat16(),
                              values[None].bfloat16())
        assert torch.equal(out[b], ref[0, 0])


def _fp8_cache(batch_cache, length, hk=2, d=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(batch_cache, length, hk, d, generator=g).to(F8)
    vc = torch.randn(batch_cache, length, hk, d, generator=g).to(F8)
    return kc, vc


@pytest.mark.parametrize("layout", ["rows", "batch_idx", "paged", "rows-v-positions-fastest",
                                    "batch_idx-v-positions-fastest", "paged-v-positions-fastest"])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("new_dtype", [torch.bfloat16, F8], ids=["new-bf16", "new-fp8"])
def test_kvcache_appends_quantized_tokens_and_attends_to_them(layout, rotary, new_dtype):
    """The new tokens land in the FP8 cache quantized (a V cache in rows, or laid out positions-fastest by
    ``fp8.zeros_cache``), and the call attends to them as the dequantized call does."""
    v_fast = layout.endswith("-v-positions-fastest")
    layout = layout.removesuffix("-v-positions-fastest")
    batch, seqlen_q, seqlen_new, length, h, hk, d = 2, 3, 2, 12, 4, 2, 16
    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch, seqlen_q, h, d, generator=g)
    qf, qd = fp8.quantize(q, hk)
    kd = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    vd = torch.tensor([[1.5, 1.0], [0.75, 3.0]])
    k_new = torch.randn(batch, seqlen_new, hk, d, generator=g)
    v_new = torch.randn(batch, seqlen_new, hk, d, generator=g)
    if new_dtype == F8:
        k_new, v_new = (k_new / kd[:, None, :, None]).to(F8), (v_new / vd[:, None, :, None]).to(F8)
    else:
        k_new, v_new = k_new.bfloat16(), v_new.bfloat16()
    seqlens = torch.tensor([4, 9], dtype=torch.int32)
    idx = table = None
    if layout == "paged":
        kc, vc = _fp8_cache(5, 4)  # 5 pages of 4
        table = torch.tensor([[2, 0, 4], [1, 3, -1]], dtype=torch.int32)
        seqlens = torch.tensor([4, 5], dtype=torch.int32)
    elif layout == "batch_idx":
        kc, vc = _fp8_cache(4, length)
        idx = torch.tensor([3, 1], dtype=torch.int32)
    else:
        kc, vc = _fp8_cache(batch, length)
    if v_fast:
        vc = fp8.zeros_cache(*vc.shape)[1].copy_(vc)
        assert vc.stride(1) == 1
    cos = sin = None
    if rotary:
        angles = torch.rand(16, d // 4, generator=g) * 6
        cos, sin = angles.cos(), angles.sin()
    kc_before, vc_before = kc.clone(), vc.clone()

    out = flash_attn_with_kvcache(qf, kc, vc, k_new, v_new, cos, sin, seqlens, idx, block_table=table, causal=True,
                                  rotary_interleaved=False, q_descale=qd, k_descale=kd, v_descale=vd)

    # The cache: the new tokens, rotated and quantized with their entry's factors; nothing else changed.
    k_expect = k_new.float() * kd[:, None, :, None] if new_dtype == F8 else k_new
    v_expect = v_new if new_dtype == F8 else (v_new.float() / vd[:, None, :, None]).clamp(-448, 448).to(F8)
    pos = seqlens.long()[:, None] + torch.arange(seqlen_new)
    if rotary:
        k_expect = _rotate(k_expect, cos[pos], sin[pos], False)
    if rotary or new_dtype != F8:
        k_expect = (k_expect.float() / kd[:, None, :, None]).clamp(-448, 448).to(F8)
    else:
        k_expect = k_new
    k_flat, v_flat = kc_before.view(-1, hk, d).clone(), vc_before.view(-1, hk, d).clone()
    for b in range(batch):
        for i in range(seqlen_new):
            p = seqlens[b].item() + i
            row = (table[b, p // 4].item() * 4 + p % 4 if table is not None
                   else (idx[b].item() if idx is not None else b) * length + p)
            k_flat[row], v_flat[row] = k_expect[b, i], v_expect[b, i]
    assert torch.equal(kc.view(-1, hk, d).view(torch.uint8), k_flat.view(torch.uint8))
    assert torch.equal(vc.view(-1, hk, d).view(torch.uint8), v_flat.view(torch.uint8))

    # Attention: the same call without new tokens on the cache as written (dequantized), q rotated at
    # the new tokens' positions (causal).
    q_ref = fp8.dequantize(qf, qd)
    if rotary:
        q_ref = _rotate(q_ref, cos[pos[:, :1] + torch.arange(seqlen_q)], sin[pos[:, :1] + torch.arange(seqlen_q)],
                        False)
    rows = table.long().clamp(min=0) if table is not None else (idx.long() if idx is not None else torch.arange(2))
    k_rows = kc.view(torch.uint8)[rows].view(F8).reshape(batch, -1, hk, d)  # (torch 2.9: no float8 indexing on CPU)
    v_rows = vc.view(torch.uint8)[rows].view(F8).reshape(batch, -1, hk, d)
    ref = flash_attn_with_kvcache(q_ref, fp8.dequantize(k_rows, kd), fp8.dequantize(v_rows, vd),
                                  cache_seqlens=seqlens + seqlen_new, causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


@pytest.mark.parametrize("v_layout", ["rows", "positions-fastest"])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kvcache_16bit_q_over_an_fp8_cache(v_layout, rotary, dtype):
    """A bf16/fp16 model's q and new tokens over an FP8 cache, without q_descale: the tokens land quantized
    (as quantize_with), and out, in q's dtype, is the call on the cache dequantized to that dtype."""
    batch, seqlen_new, length, h, hk, d = 2, 2, 12, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, 1, h, d, generator=g).to(dtype)
    k_new, v_new = (torch.randn(batch, seqlen_new, hk, d, generator=g).to(dtype) for _ in range(2))
    kd, vd = torch.tensor([[0.5, 2.0], [1.0, 0.25]]), torch.tensor([[1.5, 1.0], [0.75, 3.0]])
    kc, vc = _fp8_cache(batch, length)
    if v_layout != "rows":
        vc = fp8.zeros_cache(*vc.shape)[1].copy_(vc)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    cos = sin = None
    if rotary:
        angles = torch.rand(16, d // 4, generator=g) * 6
        cos, sin = angles.cos(), angles.sin()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cos, sin, seqlens, causal=True, k_descale=kd,
                                       v_descale=vd, return_softmax_lse=True)
    assert out.dtype == dtype
    pos = seqlens.long()[:, None] + torch.arange(seqlen_new)
    k_rot = _rotate(k_new, cos[pos], sin[pos], True) if rotary else k_new
    rows = torch.arange(batch)[:, None]
    assert torch.equal(kc.view(torch.uint8)[rows, pos], fp8.quantize_with(k_rot, kd).view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8)[rows, pos], fp8.quantize_with(v_new, vd).view(torch.uint8))
    q_ref = _rotate(q, cos[pos[:, :1]], sin[pos[:, :1]], True) if rotary else q  # (at the first new position)
    ref, lse_ref = flash_attn_with_kvcache(q_ref, fp8.dequantize(kc, kd, dtype), fp8.dequantize(vc, vd, dtype),
                                           cache_seqlens=seqlens + seqlen_new, causal=True, return_softmax_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, lse_ref)


def test_kvcache_without_new_tokens_equals_the_dequantized_call():
    kc, vc = _fp8_cache(3, 10, hk=1)
    qf, qd = fp8.quantize(torch.randn(2, 1, 3, 16), 1)
    kd, vd = torch.rand(2, 1) + 0.5, torch.rand(2, 1) + 0.5
    seqlens = torch.tensor([7, 10], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(qf, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True, q_descale=qd,
                                       k_descale=kd, v_descale=vd, out_dtype=torch.float16)
    ref, lse_ref = flash_attn_with_kvcache(fp8.dequantize(qf, qd, torch.float16),
                                           fp8.dequantize(kc[:2], kd, torch.float16),
                                           fp8.dequantize(vc[:2], vd, torch.float16), cache_seqlens=seqlens,
                                           return_softmax_lse=True)
    assert out.dtype == torch.float16 and torch.equal(out, ref) and torch.equal(lse, lse_ref)


def _descales(b=2, hk=2):
    return torch.ones(b, hk), torch.ones(b, hk), torch.ones(b, hk)


def _bf16(qf, kf, vf):
    return qf.bfloat16(), kf.bfloat16(), vf.bfloat16()


def _kvcache_call(**kw):
    qf, qd = fp8.quantize(torch.randn(2, 1, 4, 16), 2)
    kc, vc = _fp8_cache(3, 8)
    args = dict(cache_seqlens=2, q_descale=qd, k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))
    args.update(kw)
    return flash_attn_with_kvcache(args.pop("q", qf), args.pop("k_cache", kc), args.pop("v_cache", vc), **args)


D = _descales
BAD = [
    # (description, call on (qf, kf, vf), exception, words the message must contain)
    ("fp8 without descales", lambda qf, kf, vf: flash_attn_func(qf, kf, vf), TypeError,
     "q is float8_e4m3fn: FP8 inputs need q_descale, k_descale and v_descale"),
    ("fp8 without k_descale", lambda qf, kf, vf: flash_attn_func(qf, kf, vf, q_descale=D()[0], v_descale=D()[2]),
     TypeError, "k_descale is required"),
    ("descale shape (batch, nheads)", lambda qf, kf, vf: flash_attn_func(
        qf, kf, vf, q_descale=torch.ones(2, 4), k_descale=D()[1], v_descale=D()[2]), ValueError,
     "q_descale must have shape (2, 2)"),
    ("descale float64", lambda qf, kf, vf: flash_attn_func(
        qf, kf, vf, *(), q_descale=D()[0], k_descale=D()[1].double(), v_descale=D()[2]), TypeError,
     "k_descale must be float32"),
    ("descale on another device", lambda qf, kf, vf: flash_attn_func(
        qf, kf, vf, q_descale=D()[0], k_descale=D()[1], v_descale=D()[2].to("meta")), ValueError,
     "v_descale is on meta"),
    ("descale not a tensor", lambda qf, kf, vf: flash_attn_func(qf, kf, vf, q_descale=1.0, k_descale=D()[1],
                                                                 v_descale=D()[2]), TypeError, "q_descale must be a"),
    ("descales with bf16", lambda qf, kf, vf: flash_attn_func(*_bf16(qf, kf, vf), k_descale=D()[1]), TypeError,
     "k_descale is given but q has dtype torch.bfloat16"),
    ("out_dtype with bf16", lambda qf, kf, vf: flash_attn_func(*_bf16(qf, kf, vf), out_dtype=torch.bfloat16),
     TypeError, "out_dtype is given"),
    ("fp8 q, bf16 k", lambda qf, kf, vf: flash_attn_func(qf, kf.bfloat16(), vf, *(), q_descale=D()[0],
                                                          k_descale=D()[1], v_descale=D()[2]), TypeError,
     "k has dtype torch.bfloat16, expected float8_e4m3fn"),
    ("bf16 q, fp8 v", lambda qf, kf, vf: flash_attn_func(qf.bfloat16(), kf.bfloat16(), vf), TypeError,
     "v has dtype torch.float8_e4m3fn.*FP8 attention"),
    ("out_dtype float32", lambda qf, kf, vf: flash_attn_func(qf, kf, vf, q_descale=D()[0], k_descale=D()[1],
                                                              v_descale=D()[2], out_dtype=torch.float32),
     ValueError, "out_dtype must be torch.bfloat16 or torch.float16"),
    ("fp8 requires grad", lambda qf, kf, vf: flash_attn_func(qf, kf.requires_grad_(), vf, q_descale=D()[0],
                                                              k_descale=D()[1], v_descale=D()[2]),
     NotImplementedError, "k requires grad: FP8 tensors are forward only"),
    ("descale requires grad", lambda qf, kf, vf: flash_attn_func(qf, kf, vf, q_descale=D()[0],
                                                                  k_descale=D()[1], v_descale=D()[2].requires_grad_()),
     NotImplementedError, "v_descale requires grad"),
    ("varlen descale of the packed batch", lambda qf, kf, vf: flash_attn_varlen_func(
        qf.flatten(0, 1), kf.flatten(0, 1), vf.flatten(0, 1), torch.tensor([0, 4, 10, 14], dtype=torch.int32),
        torch.tensor([0, 9, 9, 18], dtype=torch.int32), 6, 9, q_descale=D()[0], k_descale=D()[1],
        v_descale=D()[2]), ValueError, r"q_descale must have shape (3, 2)"),
    ("varlen without descales", lambda qf, kf, vf: flash_attn_varlen_func(
        qf.flatten(0, 1), kf.flatten(0, 1), vf.flatten(0, 1), torch.tensor([0, 7, 14], dtype=torch.int32),
        torch.tensor([0, 9, 18], dtype=torch.int32), 7, 9), TypeError, "q is float8_e4m3fn: FP8 inputs need"),
    ("varlen mixed", lambda qf, kf, vf: flash_attn_varlen_func(
        qf.flatten(0, 1), kf.flatten(0, 1), vf.flatten(0, 1).half(), torch.tensor([0, 7, 14], dtype=torch.int32),
        torch.tensor([0, 9, 18], dtype=torch.int32), 7, 9, q_descale=D()[0], k_descale=D()[1], v_descale=D()[2]),
     TypeError, "v has dtype torch.float16"),
    ("varlen bad cu_seqlens", lambda qf, kf, vf: flash_attn_varlen_func(
        qf.flatten(0, 1), kf.flatten(0, 1), vf.flatten(0, 1), torch.tensor([0, 7, 15], dtype=torch.int32),
        torch.tensor([0, 9, 18], dtype=torch.int32), 8, 9, q_descale=D()[0], k_descale=D()[1], v_descale=D()[2]),
     ValueError, r"cu_seqlens_q\[-1\]"),
    ("kvcache descale of batch_cache", lambda qf, kf, vf: _kvcache_call(k_descale=torch.ones(3, 2)), ValueError,
     "k_descale must have shape (2, 2)"),
    ("kvcache bf16 cache", lambda qf, kf, vf: _kvcache_call(v_cache=torch.zeros(3, 8, 2, 16, dtype=torch.bfloat16)),
     TypeError, "v_cache has dtype torch.bfloat16, expected float8_e4m3fn"),
    ("kvcache new k float32", lambda qf, kf, vf: _kvcache_call(k=torch.zeros(2, 1, 2, 16), v=torch.zeros(2, 1, 2, 16)),
     TypeError, "k has dtype torch.float32"),
    ("kvcache no v_descale", lambda qf, kf, vf: _kvcache_call(v_descale=None), TypeError, "v_descale is required"),
    ("kvcache no descales", lambda qf, kf, vf: _kvcache_call(q_descale=None, k_descale=None, v_descale=None),
     TypeError, "q is float8_e4m3fn: FP8 inputs need"),
    ("paged varlen no descales", lambda qf, kf, vf: flash_attn_varlen_func(
        qf[0], kf, vf, torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32), 4, 5,
        block_table=torch.zeros(2, 1, dtype=torch.int32)), TypeError, "q is float8_e4m3fn: FP8 inputs need"),
    ("kvcache append past the cache", lambda qf, kf, vf: _kvcache_call(
        k=torch.zeros(2, 2, 2, 16, dtype=torch.bfloat16), v=torch.zeros(2, 2, 2, 16, dtype=torch.bfloat16),
        cache_seqlens=7), ValueError, "cache length"),
    ("kvcache batch_idx range", lambda qf, kf, vf: _kvcache_call(cache_batch_idx=torch.tensor([0, 3],
                                                                                               dtype=torch.int32)),
     ValueError, "cache_batch_idx values"),
    ("kvcache repeated batch_idx append", lambda qf, kf, vf: _kvcache_call(
        cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32), k=torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16),
        v=torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16)), ValueError, "same cache slot"),
    ("kvcache page out of range", lambda qf, kf, vf: _kvcache_call(block_table=torch.tensor([[0], [3]],
                                                                                            dtype=torch.int32)),
     ValueError, "block_table values"),
    ("kvcache bf16 q with q_descale", lambda qf, kf, vf: _kvcache_call(q=torch.zeros(2, 1, 4, 16,
                                                                                   dtype=torch.bfloat16)),
     TypeError, "q_descale is given but q has dtype torch.bfloat16"),
    ("kvcache bf16 q, fp16 out", lambda qf, kf, vf: _kvcache_call(q=torch.zeros(2, 1, 4, 16, dtype=torch.bfloat16),
                                                                  q_descale=None, out_dtype=torch.float16),
     ValueError, "out_dtype is torch.float16 but q has dtype torch.bfloat16"),
    ("kvcache float32 q", lambda qf, kf, vf: _kvcache_call(q=torch.zeros(2, 1, 4, 16), q_descale=None),
     TypeError, "q has dtype torch.float32 but k_cache is float8_e4m3fn"),
    ("kvcache bf16 q, bf16 v_cache", lambda qf, kf, vf: _kvcache_call(
        q=torch.zeros(2, 1, 4, 16, dtype=torch.bfloat16), q_descale=None,
        v_cache=torch.zeros(3, 8, 2, 16, dtype=torch.bfloat16)),
     TypeError, "v_cache has dtype torch.bfloat16, expected float8_e4m3fn like k_cache"),
    ("kvcache bf16 q and cache with descales", lambda qf, kf, vf: _kvcache_call(
        q=torch.zeros(2, 1, 4, 16, dtype=torch.bfloat16), q_descale=None,
        k_cache=torch.zeros(3, 8, 2, 16, dtype=torch.bfloat16), v_cache=torch.zeros(3, 8, 2, 16, dtype=torch.bfloat16)),
     TypeError, "k_descale is given but k_cache has dtype torch.bfloat16"),
    ("bf16 q, FP8 k and v", lambda qf, kf, vf: flash_attn_func(qf.float().bfloat16(), kf, vf, k_descale=D()[1],
                                                                 v_descale=D()[2]),
     TypeError, "mixed FP8 and torch.bfloat16"),
    ("kvcache lengths past the cache, rotary", lambda qf, kf, vf: _kvcache_call(
        k=torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16), v=torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16),
        cache_seqlens=torch.tensor([100, 0], dtype=torch.int32), rotary_cos=torch.ones(16, 8),
        rotary_sin=torch.zeros(16, 8)), ValueError, "(the cache length); got up to 101"),
    ("kvcache lengths past the cache, batch_idx", lambda qf, kf, vf: _kvcache_call(
        k=torch.zeros(2, 2, 2, 16, dtype=torch.bfloat16), v=torch.zeros(2, 2, 2, 16, dtype=torch.bfloat16),
        cache_seqlens=torch.tensor([8, 0], dtype=torch.int32), cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)),
     ValueError, "(the cache length); got up to 10"),
    ("kvcache negative lengths", lambda qf, kf, vf: _kvcache_call(
        cache_seqlens=torch.tensor([-2, 0], dtype=torch.int32)), ValueError, "cache_seqlens must be >= 0"),
    ("kvcache append to an expanded cache", lambda qf, kf, vf: _kvcache_call(
        k_cache=_fp8_cache(3, 8)[0][:, :, :1].expand(3, 8, 2, 16), k=torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16),
        v=torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16)), ValueError, "k_cache's elements may share memory"),
    ("kvcache FP8 new k requires grad", lambda qf, kf, vf: _kvcache_call(
        k=torch.zeros(2, 1, 2, 16).to(F8).requires_grad_(), v=torch.zeros(2, 1, 2, 16).to(F8)),
     NotImplementedError, "k requires grad"),
    ("kvcache bf16 q, no descales", lambda qf, kf, vf: _kvcache_call(
        q=torch.zeros(2, 1, 4, 16, dtype=torch.bfloat16), q_descale=None, k_descale=None, v_descale=None),
     TypeError, "an FP8 KV cache also takes a bfloat16/float16 q, with k_descale and v_descale"),
    ("quantize an int tensor", lambda qf, kf, vf: fp8.quantize(torch.zeros(1, 4, 2, 8, dtype=torch.int32)),
     TypeError, "x must be a float16"),
    ("quantize an FP8 tensor", lambda qf, kf, vf: fp8.quantize(qf), TypeError, "x must be a float16"),
    ("dequantize to int", lambda qf, kf, vf: fp8.dequantize(qf, D()[0], torch.int32), TypeError, "dtype must be"),
    ("dequantize, cu_seqlens short of the rows", lambda qf, kf, vf: fp8.dequantize(
        qf[0], D()[0][:1], cu_seqlens=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
     r"cu_seqlens\[-1\] must equal the number of packed tokens"),
    ("dequantize, cu_seqlens a list", lambda qf, kf, vf: fp8.dequantize(qf[0], D()[0][:1], cu_seqlens=[0, 5]),
     TypeError, "cu_seqlens must be a torch.Tensor"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_fp8_input_raises_naming_the_argument(call, exc, words, monkeypatch):
    launched = []
    monkeypatch.setattr(flashtile._ops, "run_forward", lambda *a, **kw: launched.append(a))
    qf, kf, vf, *_ = _fp8_qkv()
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)") if "\\" not in words else words):
        call(qf, kf, vf)
    assert not launched, "no kernel may run for an invalid call"


def test_failed_kvcache_call_leaves_the_cache_unchanged():
    kc, vc = _fp8_cache(2, 8)
    before = kc.clone()
    qf, qd = fp8.quantize(torch.randn(2, 1, 4, 16), 2)
    with pytest.raises(ValueError, match="cache length"):
        flash_attn_with_kvcache(qf, kc, vc, torch.ones(2, 2, 2, 16, dtype=torch.bfloat16),
                                torch.ones(2, 2, 2, 16, dtype=torch.bfloat16), cache_seqlens=torch.tensor(
                                    [1, 7], dtype=torch.int32), q_descale=qd, k_descale=torch.ones(2, 2),
                                v_descale=torch.ones(2, 2))
    assert torch.equal(kc.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize(("capability", "ok"), [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                                 ((10, 0), True)])
def test_fp8_needs_fp8_tensor_cores(capability, ok, monkeypatch):
    configs._capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    try:
        if ok:
            fp8.check_device(torch.device("cuda", 0))
        else:
            with pytest.raises(TypeError, match=rf"q is float8_e4m3fn on cuda:0.*capability {capability[0]}\."
                                                rf"{capability[1]}.*8.9 or newer"):
                fp8.check_device(torch.device("cuda", 0))
            with pytest.raises(TypeError, match=r"k_cache is float8_e4m3fn on cuda:0"):
                fp8.check_device(torch.device("cuda", 0), "k_cache")
    finally:
        configs._capability.cache_clear()


def test_decoding_plan_key_refuses_only_float8_inputs_that_require_grad():
    """A decoding step over an FP8 cache may replay under a 16-bit q or tokens that require grad (a model decoding
    without no_grad; the ordinary path takes them), not with a float8 input or descale that does (it raises)."""
    from flashtile.inference import _decode_plan_key

    kc, vc = _fp8_cache(2, 8)
    kd, vd = torch.ones(2, 2), torch.ones(2, 2)
    lengths = torch.tensor([1, 2], dtype=torch.int32)
    new = torch.zeros(2, 1, 2, 16, dtype=torch.bfloat16, requires_grad=True)

    def key(q, k, v, descales):
        return _decode_plan_key(q, kc, vc, k, v, lengths, None, False, (-1, -1), 0.0, 0, False, descales)

    q16 = torch.zeros(2, 1, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    assert key(q16, new, new.detach().clone(), (None, kd, vd, None)) is not None
    q8, qd = fp8.quantize(torch.randn(2, 1, 4, 16), 2)
    assert key(q8, None, None, (qd, kd, vd, None)) is not None
    assert key(q8, None, None, (qd, kd.clone().requires_grad_(), vd, None)) is None
    assert key(q8.clone().requires_grad_(), None, None, (qd, kd, vd, None)) is None


def test_16bit_q_over_an_fp8_cache_names_the_cache_in_the_device_check(monkeypatch):
    """The tensor-core check of a bf16 q over an FP8 cache names the cache, the float8 input (not q)."""
    named = []
    monkeypatch.setattr(fp8, "check_device", lambda device, name="q": named.append(name))
    kc, vc = _fp8_cache(1, 4)
    fp8.check_inputs({"q": torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16), "k_cache": kc, "v_cache": vc},
                     {"q_descale": None, "k_descale": torch.ones(1, 2), "v_descale": torch.ones(1, 2)}, None, (1, 2),
                     torch.device("cpu"), q_over_cache=True)
    assert named == ["k_cache"]


def test_plain_calls_do_not_enter_the_fp8_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a call without FP8 inputs went through flashtile.fp8")

    for name in ("attention_func", "varlen_func", "kvcache_func", "check_inputs"):
        monkeypatch.setattr(fp8, name, refuse)
    q, k, v = (torch.randn(1, 5, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_func(q, k, v)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5)
    flash_attn_with_kvcache(q, k.clone(), v.clone(), cache_seqlens=5)


def test_quantize_tiny_amax_gives_no_nan():
    """A head whose largest |x| is so small that 448 / amax overflows: scale 1, zeros stay zeros."""
    x = torch.zeros(1, 4, 1, 8)
    x[0, 0, 0, 0] = 1e-40
    x_fp8, descale = fp8.quantize(x)
    assert torch.isfinite(descale).all() and (descale > 0).all()
    assert not torch.isnan(x_fp8.float()).any()


def test_paged_varlen_v_of_another_shape_is_an_error():
    q = torch.randn(6, 2, 16)
    k_pool = torch.randn(4, 4, 2, 16)
    q8, k8 = fp8.quantize_varlen(q, torch.tensor([0, 6], dtype=torch.int32))[0], fp8.quantize(k_pool)[0]
    cu_q = torch.tensor([0, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 8], dtype=torch.int32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    descale = torch.ones(1, 2)
    with pytest.raises(ValueError, match="v must have the shape of k"):
        flash_attn_varlen_func(q8, k8, k8[:3], cu_q, cu_k, 6, 8, block_table=table, q_descale=descale,
                               k_descale=descale, v_descale=descale)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_attn_func_is_attention_at_the_quantized_inputs(heads, causal):
    """Off the FP8 kernels: out and gradients equal flash_attn_func's at the quantized-dequantized inputs."""
    nheads, nheads_k = heads
    q = torch.randn(2, 37, nheads, 32, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 53, nheads_k, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = fp8.fp8_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, nheads_k), fp8.quantize(k), fp8.quantize(v)
    leaves = [fp8.dequantize(x, d).requires_grad_() for x, d in ((q8, qd), (k8, kd), (v8, vd))]
    want = flash_attn_func(*leaves, causal=causal)
    assert torch.equal(out, want)
    for got, ref in zip(grads, torch.autograd.grad(want, leaves, dout)):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("kernels", [False, True], ids=["dequantized", "fp8-kernels"])
def test_fp8_attn_func_compiles_whole(kernels, backend, monkeypatch):
    """torch.compile(fullgraph=True) traces fp8_attn_func (quantize steps and the custom ops) and matches
    the eager call, forward and backward; "fp8-kernels": through the FP8 kernel (in the interpreter
    without a GPU), whose launch only the custom op hides from the tracer."""
    if kernels:
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs a GPU or the Triton interpreter")
        backend("triton")
        monkeypatch.setattr(fp8, "kernels_run", lambda *args: True)
    device = "cuda" if kernels and torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 37, 4, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    k, v = (torch.randn(2, 53, 2, 32, dtype=torch.bfloat16, device=device, requires_grad=True) for _ in range(2))
    dout = torch.randn(2, 37, 4, 32, dtype=torch.bfloat16, device=device)

    def step(q, k, v):
        return fp8.fp8_attn_func(q, k, v, causal=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for fn in (step, compiled):
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        if fn is step:
            want = (out, *grads)
    for got, ref in zip((out, *grads), want):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_fp8_attn_func_self_attention_on_one_tensor_compiles():
    """fp8_attn_func(x, x, x) under torch.compile: one tensor passed three times (dynamo refused an
    autograd.Function given a duplicate input); the gradient sums the three roles as in eager."""
    x = torch.randn(1, 9, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    grads = []
    for fn in (lambda x: fp8.fp8_attn_func(x, x, x, causal=True),
               torch.compile(lambda x: fp8.fp8_attn_func(x, x, x, causal=True), fullgraph=True, backend="aot_eager")):
        out = fn(x)
        grads.append((out, *torch.autograd.grad(out.float().square().sum(), x)))
    for got, ref in zip(*grads):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_fp8_flash_attn_func_compiles(backend, monkeypatch):
    """An FP8 flash_attn_func call traces under torch.compile(fullgraph=True) (through the FP8 kernel's
    custom op; in the interpreter without a GPU) and returns the eager call's bits."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
    backend("triton")
    monkeypatch.setattr(fp8, "kernels_run", lambda *args: True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    qf, kf, vf, qd, kd, vd = (t.to(device) for t in _fp8_qkv(d=32))

    def call(q, k, v):
        return flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    assert torch.equal(torch.compile(call, fullgraph=True, backend="aot_eager")(qf, kf, vf), call(qf, kf, vf))


def test_fp8_backward_products_in_the_interpreter(backend, monkeypatch):
    """FLASHTILE_FP8_BACKWARD=1 through the backward kernels' FP8 variant (the Triton interpreter, float16):
    gradients close to the 16-bit backward's at the same quantized inputs (dO's rounding to float8 in dP
    apart), and exactly dq, dk, dv shapes and dtypes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors in the Triton interpreter only")
    backend("triton")
    monkeypatch.setattr(fp8, "kernels_run", lambda *args: True)
    gen = torch.Generator().manual_seed(5)
    heads = torch.tensor([0.5, 1.0, 2.0, 4.0])[None, None, :, None]  # another scale per head
    q = (torch.randn(1, 37, 4, 32, generator=gen) * heads).half().transpose(1, 2).contiguous().transpose(1, 2)
    q.requires_grad_()  # (BHSD memory: the FP8 copies are made contiguous for the backward)
    k, v = ((torch.randn(1, 45, 2, 32, generator=gen) * heads[:, :, 1:3]).half().requires_grad_() for _ in range(2))
    dout = (torch.randn(1, 37, 4, 32, generator=gen) * heads.flip(2)).half()
    grads = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("FLASHTILE_FP8_BACKWARD", mode)
        grads[mode] = torch.autograd.grad(fp8.fp8_attn_func(q, k, v, causal=True), (q, k, v), dout)
    for got, ref in zip(grads["1"], grads["0"]):
        assert got.shape == ref.shape and got.dtype == ref.dtype and not torch.isnan(got).any()
        assert (got.float() - ref.float()).abs().max() <= 0.1 * ref.float().abs().max()


def test_fp8_attn_func_bad_input():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="fp8_attn_func takes bfloat16 or float16"):
        fp8.fp8_attn_func(q, q, q)
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8.fp8_attn_func(q8, q8, q8)
    qb = q.bfloat16()
    with pytest.raises(ValueError, match="headdim"):
        fp8.fp8_attn_func(qb, qb[..., :8], qb)


def test_quantize_empty_sequence_gives_descale_one():
    x8, descale = fp8.quantize(torch.randn(2, 0, 4, 16), 2)
    assert x8.shape == (2, 0, 4, 16) and torch.equal(descale, torch.ones(2, 2))
    q = torch.randn(1, 0, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 5, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    out = fp8.fp8_attn_func(q, k, k)
    assert out.shape == q.shape


def test_paged_cache_without_seqlens_checks_every_page_of_the_table():
    """cache_seqlens=None reads every page of the table: an out-of-range entry anywhere in it is an error,
    as in the bf16 call (the dequantize path checked only the first page)."""
    pool = torch.randn(6, 4, 1, 16).to(torch.float8_e4m3fn)
    table = torch.tensor([[0, 1, 9]], dtype=torch.int32)
    q = torch.randn(1, 1, 1, 16).to(torch.float8_e4m3fn)
    one = torch.ones(1, 1)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, pool, pool, block_table=table, q_descale=one, k_descale=one, v_descale=one)


def test_dequantize_checks_its_descale():
    """fp8.dequantize refuses a descale that would broadcast over the batch or does not divide the heads, and
    an x_fp8 that is not FP8, naming the argument."""
    x8, descale = fp8.quantize(torch.randn(3, 5, 4, 8), 2)
    assert fp8.dequantize(x8, descale).shape == x8.shape
    for bad in (descale[:1], descale[:, :0], torch.ones(3, 3), descale.double(), descale[:, 0]):
        with pytest.raises(ValueError, match="descale"):
            fp8.dequantize(x8, bad)
    with pytest.raises(ValueError, match="x_fp8"):
        fp8.dequantize(x8.float(), descale)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    packed, packed_descale = fp8.quantize_varlen(torch.randn(5, 4, 8), cu)
    assert fp8.dequantize(packed, packed_descale, cu_seqlens=cu).shape == packed.shape
    with pytest.raises(ValueError, match="descale"):
        fp8.dequantize(packed, packed_descale[:1], cu_seqlens=cu)


def test_zeros_cache_layout():
    """zeros_cache: FP8 zeros of the cache's shape, K contiguous, V with unit stride over positions and the
    batch next (so that both are still viewed as rows), and its sizes checked."""
    k_cache, v_cache = fp8.zeros_cache(3, 40, 2, 16)
    assert k_cache.shape == v_cache.shape == (3, 40, 2, 16) and k_cache.dtype == v_cache.dtype == F8
    assert k_cache.is_contiguous() and v_cache.stride() == (40, 1, 16 * 120, 120)
    assert v_cache.view(120, 2, 16).stride() == (1, 16 * 120, 120)
    assert not k_cache.float().any() and not v_cache.float().any()
    with pytest.raises(ValueError, match="ints >= 0"):
        fp8.zeros_cache(3, -1, 2, 16)


def test_positions_fastest_v_cache_is_fp8_only():
    """A 16-bit v_cache with unit stride over positions is refused (its kernels read V rows), naming v_cache;
    the FP8 call takes it."""
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    k_cache = torch.randn(2, 12, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.randn(2, 16, 2, 12, dtype=torch.bfloat16).permute(0, 3, 2, 1)
    with pytest.raises(ValueError, match="v_cache must have a contiguous last dimension"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    k8, v8 = fp8.zeros_cache(2, 12, 2, 16)
    q8, qd = fp8.quantize(q, 2)
    ones = torch.ones(2, 2)
    out = flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=5, q_descale=qd, k_descale=ones, v_descale=ones)
    assert out.shape == q.shape and not out.isnan().any()


def test_quantize_with_is_what_the_cache_append_writes():
    """quantize_with: the float8 values flash_attn_with_kvcache writes for 16-bit new tokens (x / descale,
    saturated), and its arguments checked."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 2, 16, generator=g).bfloat16() * 300
    descale = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    got = fp8.quantize_with(x, descale)
    want = (x.float() / descale[:, None, :, None]).clamp(-448, 448).to(F8)
    assert got.dtype == F8 and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    kc, vc = _fp8_cache(2, 12)
    q8, qd = fp8.quantize(torch.randn(2, 3, 4, 16, generator=g), 2)
    seqlens = torch.tensor([4, 9], dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    a = flash_attn_with_kvcache(q8, kc, vc, x, x, cache_seqlens=seqlens, q_descale=qd, k_descale=descale,
                                v_descale=descale)
    b = flash_attn_with_kvcache(q8, kc2, vc2, got, got, cache_seqlens=seqlens, q_descale=qd, k_descale=descale,
                                v_descale=descale)
    assert torch.equal(a, b) and torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    with pytest.raises(ValueError, match="descale must be float32"):
        fp8.quantize_with(x, descale[:1])
    with pytest.raises(TypeError, match="x must be a float16"):
        fp8.quantize_with(got, descale)


def test_numpy_ints_are_taken_as_the_api_takes_them():
    import numpy as np

    x = torch.randn(1, 3, 4, 16)
    assert torch.equal(fp8.quantize(x, np.int64(2))[1], fp8.quantize(x, 2)[1])
    k_cache, v_cache = fp8.zeros_cache(np.int64(2), 8, np.int32(2), 16)
    assert k_cache.shape == v_cache.shape == (2, 8, 2, 16)


def test_kvcache_16bit_q_of_batch_zero_over_an_fp8_cache():
    k_cache, v_cache = fp8.zeros_cache(2, 8, 1, 16)
    q = torch.randn(0, 1, 2, 16, dtype=torch.bfloat16)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.zeros(0, dtype=torch.int32),
                                  k_descale=torch.ones(0, 1), v_descale=torch.ones(0, 1))
    assert out.shape == (0, 1, 2, 16) and out.dtype == torch.bfloat16


def test_an_fp8_cache_checks_an_int_cache_seqlens_by_name():
    """An int cache_seqlens out of int32's range, or not an int, is named (it was turned into a tensor first:
    an overflow or int()'s own error)."""
    kc, vc = _fp8_cache(2, 12)
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    descales = dict(k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"cache_seqlens must be an int in \[0, 2\*\*31\)"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2**40, **descales)
    with pytest.raises(TypeError, match="cache_seqlens must be an int"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens="3", **descales)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=13, **descales)


def test_an_fp8_cache_without_positions_attends_to_nothing_as_a_16bit_one():
    """An FP8 cache of seqlen_cache 0 gives zeros, as a 16-bit one does (its layout check refused it as not
    contiguous over its first two dims)."""
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    kc, vc = (torch.zeros(2, 0, 2, 16, dtype=F8) for _ in range(2))
    out = flash_attn_with_kvcache(q, kc, vc, k_descale=torch.ones(2, 2), v_descale=torch.ones(2, 2))
    assert out.shape == q.shape and not out.any()
