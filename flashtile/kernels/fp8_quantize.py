"""FP8 quantization of BSHD attention inputs in two kernels (``flashtile.fp8.quantize`` on a GPU).

``flashtile.fp8.quantize`` in PyTorch ops is a chain of passes over x: ``abs``, ``amax``, then ``float``, a
multiply, a clamp and the cast, each reading and writing the whole tensor (about 16 bytes of traffic per
bfloat16 element) and each a launch. Here:

1. ``_amax_kernel``: one program per tile of BLOCK_S tokens of one (batch, head), the tile's largest |x|
   folded into that (batch, head)'s entry by an atomic max (a max does not depend on the order the
   programs arrive in: the same bits every run).
2. ``_quantize_kernel``: the same tiles; each program takes its group's amax (the heads sharing one
   scale, ``nheads_k``), scale = 448 / amax (1 where amax is 0 or tiny), writes x * scale clamped to ±448
   and rounded to float8_e4m3fn, and the group's first program its descale 1 / scale.

The results are bitwise those of the PyTorch ops (tests/kernels/test_fp8_quantize.py): ``448 / amax`` and
``1 / scale`` as PyTorch computes a number over a tensor (the reciprocal rounded to nearest, times the number),
the product of x in float32 and the scale rounded once, NaN carried through the max (the maxima are taken over
|x|'s bit patterns as integers) and through the clamp as PyTorch carries it, and the float8 rounding to nearest
even done in integer arithmetic (``_e4m3_bits``): Triton's interpreter rounds some float32 values to the wrong
float8 exponent, and integer steps are the same on every target; the kernels are bound by memory either way.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import configs

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
_FP8_MAX = tl.constexpr(FP8_MAX)
# amax at or below this gets scale 1: 448 / amax would overflow float32 (fp8._scale_from_amax's rule)
AMAX_TINY = FP8_MAX * torch.finfo(torch.float32).tiny
BLOCK_S = 64  # tokens per program


@triton.jit
def _e4m3_bits(y):
    """float8_e4m3fn bit patterns (int32 in [0, 255]) of float32 ``y`` in [-448, 448] or NaN, rounded to nearest,
    ties to even, as PyTorch's cast rounds. Normal results (|y| >= 2^-6): the float32 pattern less 20 mantissa
    bits, rounded, the exponent rebiased from 127 to 7 (a rounding carry steps the exponent, as it should).
    Subnormal ones: |y| / 2^-9 rounded to an integer by adding and taking away 2^23 (exact but for that one
    rounding); 8 is 2^-6's pattern. NaN: 0x7F with y's sign, as PyTorch writes it."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    small = tl.where(mag < (121 << 23), tl.abs(y), 0.0)  # (NaN and large values kept out of the integer cast)
    subnormal = ((small * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < (121 << 23), subnormal, normal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def _tile(X, pid, tiles, seqlen, nheads, stride_b, stride_s, stride_h,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """(batch, head, tokens, dims, mask, the tile in float32) of program ``pid`` of the flat grid: BLOCK_S tokens
    of one (batch, head); consecutive programs take consecutive tiles of one head."""
    pid_bh = pid // tiles
    batch = pid_bh // nheads
    head = pid_bh % nheads
    tokens = (pid % tiles) * BLOCK_S + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    mask = (tokens[:, None] < seqlen) & (dims[None, :] < HEAD_DIM)
    rows = X + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    x = tl.load(rows + tokens.to(tl.int64)[:, None] * stride_s + dims[None, :], mask=mask, other=0.0)
    return batch, head, tokens, dims, mask, x.to(tl.float32)


@triton.jit
def _amax_kernel(X, Amax, tiles, seqlen, nheads, stride_b, stride_s, stride_h,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Amax[batch * nheads + head] = max(itself, max |x| over this program's tile), NaN winning as in PyTorch's
    amax. Amax holds float32 bits: |x| >= 0, so ordering the bit patterns as integers orders the values, NaN's
    above all, and the maxima are integer ones."""
    pid = tl.program_id(0)
    batch, head, _, _, _, x = _tile(X, pid, tiles, seqlen, nheads, stride_b, stride_s, stride_h,
                                    HEAD_DIM, BLOCK_D, BLOCK_S)
    tile_max = tl.max(tl.max(tl.abs(x).to(tl.int32, bitcast=True), 1), 0)
    tl.atomic_max(Amax + batch * nheads + head, tile_max)


@triton.jit
def _quantize_kernel(X, Amax, Out, Descale, tiles, seqlen, nheads, nheads_k,
                     stride_b, stride_s, stride_h, out_stride_b, out_stride_s, out_stride_h,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_G: tl.constexpr, AMAX_TINY: tl.constexpr):
    """Out (uint8: float8_e4m3fn's bits) = x * scale clamped to ±448, rounded; the scale from the amax of the
    GROUP heads that share kv head ``head // GROUP``; Descale[batch, kv head] = 1 / scale, written by the
    group's first program."""
    pid = tl.program_id(0)
    batch, head, tokens, dims, mask, x = _tile(X, pid, tiles, seqlen, nheads, stride_b, stride_s, stride_h,
                                               HEAD_DIM, BLOCK_D, BLOCK_S)
    group = head // GROUP
    members = tl.arange(0, BLOCK_G)
    amax_bits = tl.load(Amax + batch * nheads + group * GROUP + members, mask=members < GROUP, other=0)
    amax = tl.max(amax_bits, 0).to(tl.float32, bitcast=True)
    # As PyTorch computes ``448 / amax`` and ``1 / scale``: a reciprocal rounded to nearest, times the numerator.
    scale = tl.where(amax > AMAX_TINY, tl.math.div_rn(1.0, amax) * _FP8_MAX, 1.0)
    if (pid % tiles == 0) & (head % GROUP == 0):
        tl.store(Descale + batch * nheads_k + group, tl.math.div_rn(1.0, scale))
    y = x * scale
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX))  # NaN kept, as torch.clamp keeps it
    out = Out + batch.to(tl.int64) * out_stride_b + head.to(tl.int64) * out_stride_h
    tl.store(out + tokens.to(tl.int64)[:, None] * out_stride_s + dims[None, :], _e4m3_bits(y).to(tl.uint8),
             mask=mask)


def quantize_heads(x: torch.Tensor, nheads_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashtile.fp8.quantize(x, nheads_k)``'s (x_fp8, descale) by the two kernels: x (batch, seqlen, nheads,
    headdim) float16/bfloat16/float32/float64 with unit stride in headdim, seqlen and headdim > 0, nheads_k
    dividing nheads (checked by the caller). x_fp8 float8_e4m3fn contiguous, descale float32 (batch, nheads_k)."""
    batch, seqlen, nheads, headdim = x.shape
    nheads_k = nheads if nheads_k is None else int(nheads_k)
    group = nheads // nheads_k
    amax = torch.zeros(batch * nheads, dtype=torch.int32, device=x.device)  # float32 bits (0 is 0.0)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    descale = torch.empty(batch, nheads_k, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(seqlen, BLOCK_S)
    grid = (configs.flat_programs(tiles, batch * nheads),)
    block_d = triton.next_power_of_2(headdim)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (Triton: the current device)
        configs.launch_plain(_amax_kernel, grid, x, amax, tiles, seqlen, nheads, x.stride(0), x.stride(1),
                             x.stride(2), HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_S=BLOCK_S)
        configs.launch_plain(_quantize_kernel, grid, x, amax, out, descale, tiles, seqlen, nheads, nheads_k,
                             x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
                             HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_S=BLOCK_S, GROUP=group,
                             BLOCK_G=triton.next_power_of_2(group), AMAX_TINY=AMAX_TINY)
    return out.view(torch.float8_e4m3fn), descale
