"""The FP8 quantization kernels (kernels/fp8_quantize.py) give bitwise ``flashtile.fp8.quantize``'s and
``quantize_varlen``'s PyTorch ops' result (the float8 bytes and the descales), and its dequantize kernel
``_dequantize``'s. Without a GPU they run in Triton's interpreter on CPU tensors."""

import os

import pytest
import torch

from flashtile import fp8
from flashtile.kernels import fp8_quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs a GPU or the Triton interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_quantize(x, nheads_k):
    """``fp8.quantize``'s PyTorch ops, whatever path ``fp8.quantize`` itself takes on this device."""
    amax = fp8._group_amax(x.abs().amax(dim=(1, 3)), nheads_k)
    scale, descale = fp8._scale_from_amax(amax)
    return fp8._to_fp8(x, fp8._per_head(scale, x.shape[2])[:, None, :, None]), descale


def _assert_same(x, nheads_k=None):
    got, got_descale = fp8_quantize.quantize_heads(x, nheads_k)
    want, want_descale = _torch_quantize(x, nheads_k)
    assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape and got.is_contiguous()
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    assert not differ.any(), (int(differ.sum()), x[differ][:8].tolist(), got[differ][:8].float().tolist(),
                              want[differ][:8].float().tolist())
    assert torch.equal(got_descale, want_descale), (got_descale, want_descale)


@pytest.mark.parametrize("shape,nheads_k,dtype", [
    ((2, 100, 4, 64), None, torch.float16), ((1, 70, 6, 40), 2, torch.bfloat16), ((3, 65, 2, 128), 1, torch.float32),
    ((1, 129, 12, 59), 4, torch.float64), ((2, 1, 8, 256), 8, torch.bfloat16), ((1, 17, 3, 8), 1, torch.float16)],
    ids=["d64-fp16", "gqa-d40-bf16", "mqa-d128-fp32", "group3-d59-fp64", "one-token-d256-bf16", "d8-fp16"])
def test_quantize_kernels_match_the_pytorch_ops(shape, nheads_k, dtype):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape, device=DEVICE).mul_(torch.rand(shape[2], 1, device=DEVICE) * 10).to(dtype)
    _assert_same(x, nheads_k)


@pytest.mark.parametrize("seqlen", [1, 16, 70])
def test_quantize_kernels_write_keys_fastest(seqlen):
    """``quantize(v, keys_fastest=True)``'s kernel path: the same bytes and descales, written straight into v's
    keys-fastest layout (seqlen padded to a multiple of 16), with the strides the FP8 forward takes as they are."""
    torch.manual_seed(seqlen)
    x = (torch.randn(2, seqlen, 6, 40, device=DEVICE) * 3).to(torch.float16)
    got, got_descale = fp8_quantize.quantize_heads(x, 3, keys_fastest=True)
    want, want_descale = _torch_quantize(x, 3)
    padded = -(-seqlen // 16) * 16
    assert got.shape == x.shape and got.stride() == (6 * 40 * padded, 1, 40 * padded, padded)
    assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_descale, want_descale)


def test_quantize_kernels_on_strided_views_and_edge_values():
    """A model's q, k, v (views of one projection's output), and heads of edge values: all zero (scale 1), too
    small for 448 / amax (scale 1), a NaN (PyTorch's amax and clamp carry it: scale 1, NaN bytes), an inf (scale
    0: the inf becomes NaN, the rest 0), values at float8's subnormals and at 448."""
    torch.manual_seed(1)
    projection = torch.randn(2, 33, 3 * 6 * 32, device=DEVICE, dtype=torch.float16)
    for x in projection.view(2, 33, 3, 6, 32).unbind(2):
        _assert_same(x, 3)
    x = torch.randn(2, 40, 6, 32, device=DEVICE)
    x[0, :, 0] = 0.0
    x[0, :, 1] = 1e-38
    x[0, 3, 2, 5] = float("nan")
    x[1, 7, 3, 0] = float("inf")
    x[1, :, 4] = torch.linspace(-2.0 ** -6, 2.0 ** -6, 40 * 32, device=DEVICE).view(40, 32) * 448 / 2.0 ** -6 / 512
    x[1, :, 5] = 448.0
    _assert_same(x)


def _torch_quantize_varlen(x, cu_seqlens, nheads_k):
    """``fp8.quantize_varlen``'s PyTorch ops."""
    batch, nheads = cu_seqlens.numel() - 1, x.shape[1]
    seq = fp8._sequence_index(cu_seqlens, x.shape[0])
    amax = torch.zeros(batch, nheads, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, seq[:, None].expand(-1, nheads), x.abs().amax(dim=-1).float(), "amax")
    scale, descale = fp8._scale_from_amax(fp8._group_amax(amax, nheads_k))
    return fp8._to_fp8(x, fp8._per_head(scale, nheads)[seq][:, :, None]), descale


@pytest.mark.parametrize("lengths,nheads,nheads_k,dtype", [
    ((40, 1, 71), 4, None, torch.float16), ((0, 17, 0, 63, 16), 6, 2, torch.bfloat16), ((130,), 3, 1, torch.float32),
    ((5, 0), 2, 2, torch.float16)], ids=["three", "empty-sequences-gqa", "one-mqa", "empty-last"])
def test_packed_quantize_kernels_match_the_pytorch_ops(lengths, nheads, nheads_k, dtype):
    """``quantize_varlen``'s kernels (per (sequence, head) scales, tokens of several sequences in one tile, empty
    sequences keeping descale 1), bitwise its PyTorch ops."""
    torch.manual_seed(len(lengths))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    total = int(cu_seqlens[-1])
    x = (torch.randn(total, nheads, 40, device=DEVICE) * torch.rand(total, 1, 1, device=DEVICE) * 9).to(dtype)
    sequence = fp8._sequence_index(cu_seqlens, total)
    want, want_descale = _torch_quantize_varlen(x, cu_seqlens, nheads_k)
    # (and cu_seqlens as a strided view: the kernel reads it with unit stride, so the call makes it contiguous)
    strided = torch.stack([cu_seqlens, torch.zeros_like(cu_seqlens)], 1)[:, 0]
    for cu in (cu_seqlens, strided):
        got, got_descale = fp8_quantize.quantize_heads(x, nheads_k, cu, sequence)
        assert got.shape == x.shape and got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_descale, want_descale), (cu.stride(), got_descale, want_descale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_quantize_with_kernel_matches_the_pytorch_ops(dtype):
    """``quantize_with``'s kernel (a cache's descales given): bitwise its PyTorch ops, on a strided view (a model's
    new keys), with values past 448 (saturated), a NaN, an inf and a zero descale (0 / 0 is NaN, x / 0 inf)."""
    torch.manual_seed(3)
    projection = (torch.randn(3, 70, 2 * 4 * 48, device=DEVICE) * 40).to(dtype)
    x = projection.view(3, 70, 2, 4, 48)[:, :, 1]
    descale = torch.rand(3, 4, device=DEVICE) * 0.2 + 0.01
    x[0, 5, 1, 7] = float("nan")
    x[1, 2, 3, 0] = float("-inf")
    x[2, :, 2, :3] = 0.0
    descale[2, 2] = 0.0
    got = fp8_quantize.quantize_given(x, descale)
    # The PyTorch ops on the same device (a CPU's 0 / 0 is a NaN of the other sign than a GPU's)
    want = (x.float() / descale[:, None, :, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape and got.is_contiguous()
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    assert not differ.any(), (int(differ.sum()), x[differ][:8].tolist(), got[differ][:8].float().tolist())
    if torch.cuda.is_available():  # the public helper takes the kernel on a GPU: the same bits
        assert torch.equal(fp8.quantize_with(x, descale).view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dequantize_kernel_matches_the_pytorch_ops(dtype):
    """``_dequantize``'s kernel: every float8 value (NaN as NaN) times GQA descales, in each output dtype; a
    keys-fastest v; always contiguous. (bfloat16 on a GPU only: Triton's interpreter does not round float32 to
    bfloat16 to nearest, as the GPU's conversion does.)"""
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter rounds float32 to bfloat16 otherwise than the GPU")
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    x8 = codes.view(1, 256, 1, 1).repeat(2, 1, 4, 3)
    descale = torch.tensor([[0.5, 3.0], [1.0, 1e-3]], device=DEVICE)
    got, want = fp8_quantize.dequantize_heads(x8, descale, dtype), fp8._dequantize(x8.cpu(), descale.cpu(), dtype)
    assert got.dtype == dtype and got.is_contiguous()
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert torch.equal(got.view(torch.uint8)[~got.isnan().repeat_interleave(got.element_size(), -1)],
                       want.view(torch.uint8)[~want.isnan().repeat_interleave(want.element_size(), -1)])  # (-0.0)
    torch.manual_seed(2)
    v8, v_descale = fp8.quantize(torch.randn(2, 70, 4, 40, device=DEVICE), keys_fastest=True)
    assert v8.stride(1) == 1
    got = fp8_quantize.dequantize_heads(v8, v_descale, dtype)
    assert got.is_contiguous() and torch.equal(got.cpu(), fp8._dequantize(v8.cpu(), v_descale.cpu(), dtype))


def test_dequantize_keeps_autograd_for_a_learned_descale():
    """``fp8.dequantize`` with a descale that requires grad stays differentiable in it (on a GPU the kernel, which
    records no autograd history, stands aside for it)."""
    x8, descale = fp8.quantize(torch.randn(2, 9, 4, 32, device=DEVICE), 2)
    descale = descale.clone().requires_grad_()
    out = fp8.dequantize(x8, descale, torch.float32)
    (grad,) = torch.autograd.grad(out.sum(), descale)
    torch.testing.assert_close(grad, x8.float().view(2, 9, 2, 2, 32).sum(dim=(1, 3, 4)))


@pytest.fixture
def e4m3_bits():
    """``_e4m3_bits`` on a vector of float32 values, through a one-program kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, Out, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(Out + offsets, fp8_quantize._e4m3_bits(tl.load(X + offsets)).to(tl.uint8))

    def run(values):
        out = torch.empty(values.numel(), dtype=torch.uint8, device=values.device)
        kernel[(1,)](values, out, N=values.numel())
        return out

    return run


def test_e4m3_rounding_matches_the_cast_everywhere(e4m3_bits):
    """Every float8_e4m3fn value, the midpoints between neighbours (ties to even) and one float32 ulp either side,
    both signs, subnormals, zero and NaN: the bits of PyTorch's cast."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    middles = (codes[:-1] + codes[1:]) / 2
    ulp_down = torch.nextafter(middles, torch.zeros_like(middles))
    ulp_up = torch.nextafter(middles, torch.full_like(middles, 1e9))
    values = torch.cat([codes, middles, ulp_down, ulp_up, torch.tensor([1e-30, 2.0 ** -10, 3 * 2.0 ** -11])])
    values = torch.cat([values, -values])
    values = torch.cat([values, torch.zeros(2048 - values.numel())])  # (a power-of-2 block)
    values[-1] = float("nan")
    values = values.to(DEVICE)
    got = e4m3_bits(values)
    want = values.to(torch.float8_e4m3fn).view(torch.uint8)
    differ = got != want
    assert not differ.any(), (values[differ][:8].tolist(), got[differ][:8].tolist(), want[differ][:8].tolist())
