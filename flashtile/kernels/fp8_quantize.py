"""FP8 quantization of BSHD attention inputs in two kernels (``flashtile.fp8.quantize`` on a GPU; packed ones,
``quantize_varlen``, by their VARLEN variant: one scale per (sequence, head)).

``flashtile.fp8.quantize`` in PyTorch ops is a chain of passes over x: ``abs``, ``amax``, then ``float``, a
multiply, a clamp and the cast, each reading and writing the whole tensor (33 bytes of traffic per bfloat16
element, float32 in between) and each a launch. Here 5 (x read twice, a byte written), in two launches:

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

from ..layout import keys_fastest_memory
from . import configs
from .common import bshd_tile

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
    rounding); 8 is 2^-6's pattern. NaN: 0x7F with y's sign, as PyTorch writes it (a GPU's arithmetic makes
    its NaN positive; a CPU's 0 / 0 is negative)."""
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
def _amax_kernel(X, Amax, Seq, tiles, seqlen, nheads, stride_b, stride_s, stride_h,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, VARLEN: tl.constexpr):
    """Amax[batch * nheads + head] = max(itself, max |x| over this program's tile), NaN winning as in PyTorch's
    amax. Amax holds float32 bits: |x| >= 0, so ordering the bit patterns as integers orders the values, NaN's
    above all, and the maxima are integer ones. VARLEN: x is one packed batch; each token's row max goes to its
    sequence's entry, Seq[token] (sequence-major, as the dense batch)."""
    pid = tl.program_id(0)
    batch, head, tokens, _, _, x = bshd_tile(X, pid, tiles, seqlen, nheads, stride_b, stride_s, stride_h, 1,
                                             HEAD_DIM, BLOCK_D, BLOCK_S, ZEROS=True)  # (0 counts for no amax)
    row_max = tl.max(tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True), 1)
    if VARLEN:
        in_rows = tokens < seqlen
        sequence = tl.load(Seq + tokens, mask=in_rows, other=0)
        tl.atomic_max(Amax + sequence * nheads + head, row_max, mask=in_rows)
    else:
        tl.atomic_max(Amax + batch * nheads + head, tl.max(row_max, 0))


@triton.jit
def _scaled(x, Amax, Descale, Seq, CuSeqlens, pid, tiles, batch, head, tokens, seqlen, nheads, nheads_k,
            BLOCK_S: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, AMAX_TINY: tl.constexpr,
            VARLEN: tl.constexpr):
    """``_quantize_kernel``'s x (BLOCK_S, BLOCK_D) float32 times its group's scale 448 / amax, not yet clamped; the
    group's descale 1 / scale stored by its first program (VARLEN: each sequence's first token's)."""
    group = head // GROUP
    members = tl.arange(0, BLOCK_G)
    if VARLEN:
        in_rows = tokens < seqlen
        sequence = tl.load(Seq + tokens, mask=in_rows, other=0)
        amax_bits = tl.load(Amax + sequence[:, None] * nheads + group * GROUP + members[None, :],
                            mask=in_rows[:, None] & (members[None, :] < GROUP), other=0)
        amax = tl.max(amax_bits, 1).to(tl.float32, bitcast=True)
    else:
        amax_bits = tl.load(Amax + batch * nheads + group * GROUP + members, mask=members < GROUP, other=0)
        amax = tl.max(amax_bits, 0).to(tl.float32, bitcast=True)
    # As PyTorch computes ``448 / amax`` and ``1 / scale``: a reciprocal rounded to nearest, times the numerator.
    scale = tl.where(amax > AMAX_TINY, tl.math.div_rn(1.0, amax) * _FP8_MAX, 1.0)
    if VARLEN:
        first = in_rows & (tokens == tl.load(CuSeqlens + sequence, mask=in_rows, other=-1)) & (head % GROUP == 0)
        tl.store(Descale + sequence * nheads_k + group, tl.math.div_rn(1.0, scale), mask=first)
        y = x * scale[:, None]
    else:
        if (pid % tiles == 0) & (head % GROUP == 0):
            tl.store(Descale + batch * nheads_k + group, tl.math.div_rn(1.0, scale))
        y = x * scale
    return y


@triton.jit
def _quantize_kernel(X, Amax, Out, Descale, Seq, CuSeqlens, tiles, seqlen, nheads, nheads_k,
                     stride_b, stride_s, stride_h, out_stride_b, out_stride_s, out_stride_h, out_stride_d,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_G: tl.constexpr, AMAX_TINY: tl.constexpr, VARLEN: tl.constexpr,
                     GIVEN: tl.constexpr = False):
    """Out (uint8: float8_e4m3fn's bits) = x * scale clamped to ±448, rounded; the scale from the amax of the
    GROUP heads that share kv head ``head // GROUP``; Descale[batch, kv head] = 1 / scale, written by the
    group's first program (VARLEN: per token, by its sequence's amax; the descale by each sequence's first
    token, CuSeqlens[sequence]; an empty sequence keeps the caller's 1). Out in any layout: out_stride_d is 1 in
    the usual one, the padded length in v's keys-fastest one (``quantize(v, keys_fastest=True)``).

    GIVEN (``fp8.quantize_with``, dense, GROUP 1): Descale is the caller's (batch, nheads) and is read, not
    written; Out = x / Descale[batch, head] (an IEEE division, as PyTorch's), clamped and rounded; Amax unused."""
    pid = tl.program_id(0)
    batch, head, tokens, dims, mask, x = bshd_tile(X, pid, tiles, seqlen, nheads, stride_b, stride_s, stride_h, 1,
                                                   HEAD_DIM, BLOCK_D, BLOCK_S)
    x = x.to(tl.float32)
    if GIVEN:
        y = tl.math.div_rn(x, tl.load(Descale + batch * nheads + head))
    else:
        y = _scaled(x, Amax, Descale, Seq, CuSeqlens, pid, tiles, batch, head, tokens, seqlen, nheads, nheads_k,
                    BLOCK_S, GROUP, BLOCK_G, AMAX_TINY, VARLEN)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX))  # NaN kept, as torch.clamp keeps it
    out = Out + batch.to(tl.int64) * out_stride_b + head.to(tl.int64) * out_stride_h
    tl.store(out + tokens.to(tl.int64)[:, None] * out_stride_s + dims.to(tl.int64)[None, :] * out_stride_d,
             _e4m3_bits(y).to(tl.uint8), mask=mask)


@triton.jit
def _e4m3_value(code):
    """float32 values of float8_e4m3fn bit patterns (int32 in [0, 255]), decoded in integer arithmetic (exact):
    normal ones rebiased into a float32 pattern, subnormals m * 2^-9, 0x7F/0xFF NaN of that sign."""
    sign = (code & 0x80) << 24
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = ((mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign).to(tl.float32,
                                                                                               bitcast=True)
    value = tl.where(exponent == 0, subnormal, normal)  # (the sign by its bit: -0 stays -0)
    return tl.where((code & 0x7F) == 0x7F, (sign | 0x7FC00000).to(tl.float32, bitcast=True), value)


@triton.jit
def _dequantize_kernel(X, Descale, Out, tiles, seqlen, nheads, nheads_k, stride_b, stride_s, stride_h, stride_d,
                       out_stride_b, out_stride_s, out_stride_h,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, GROUP: tl.constexpr):
    """Out = x_fp8's values * Descale[batch, head // GROUP] in Out's dtype, contiguous; X the float8 bytes in any
    layout (a keys-fastest v too: stride_d is then its padded length)."""
    pid = tl.program_id(0)
    batch, head, tokens, dims, mask, code = bshd_tile(X, pid, tiles, seqlen, nheads, stride_b, stride_s, stride_h,
                                                      stride_d, HEAD_DIM, BLOCK_D, BLOCK_S)
    descale = tl.load(Descale + batch * nheads_k + head // GROUP)
    y = _e4m3_value(code.to(tl.int32)) * descale
    out = Out + batch.to(tl.int64) * out_stride_b + head.to(tl.int64) * out_stride_h
    tl.store(out + tokens.to(tl.int64)[:, None] * out_stride_s + dims[None, :], y.to(Out.dtype.element_ty), mask=mask)


def dequantize_heads(x_fp8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``flashtile.fp8._dequantize`` of a (batch, seqlen, nheads, headdim) float8 tensor (any strides) with float32
    (batch, nheads_k) descales (checked by the caller), by one kernel: contiguous, in ``dtype``."""
    batch, seqlen, nheads, headdim = x_fp8.shape
    out = torch.empty(x_fp8.shape, dtype=dtype, device=x_fp8.device)
    bytes_ = x_fp8.view(torch.uint8)
    tiles = triton.cdiv(seqlen, BLOCK_S)
    with torch.cuda.device(x_fp8.device) if x_fp8.is_cuda else contextlib.nullcontext():
        configs.launch_plain(_dequantize_kernel, (configs.flat_programs(tiles, batch * nheads),), bytes_,
                             descale.contiguous(), out, tiles, seqlen, nheads, descale.shape[1], *bytes_.stride(),
                             out.stride(0), out.stride(1), out.stride(2), HEAD_DIM=headdim,
                             BLOCK_D=triton.next_power_of_2(headdim), BLOCK_S=BLOCK_S,
                             GROUP=nheads // descale.shape[1])
    return out


def quantize_heads(x: torch.Tensor, nheads_k: int | None = None, cu_seqlens: torch.Tensor | None = None,
                   sequence: torch.Tensor | None = None,
                   keys_fastest: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``flashtile.fp8.quantize(x, nheads_k)``'s (x_fp8, descale) by the two kernels: x (batch, seqlen, nheads,
    headdim) float16/bfloat16/float32/float64 with unit stride in headdim, seqlen and headdim > 0, nheads_k
    dividing nheads (checked by the caller). x_fp8 float8_e4m3fn contiguous, descale float32 (batch, nheads_k).

    Packed (``fp8.quantize_varlen``): x (total, nheads, headdim), ``cu_seqlens`` int32 (batch + 1,) and
    ``sequence`` (total,) each token's sequence (``fp8._sequence_index``), both checked by the caller.

    keys_fastest (dense only): x_fp8 written straight into (batch, nheads, headdim, padded) memory, seqlen padded to
    a multiple of 16 (the padding unwritten), returned as its (batch, seqlen, nheads, headdim) view, as
    ``fp8.quantize(v, keys_fastest=True)`` returns it."""
    packed = cu_seqlens is not None
    x4 = x.unsqueeze(0) if packed else x
    batch, seqlen, nheads, headdim = x4.shape
    rows = cu_seqlens.numel() - 1 if packed else batch  # (the scales' rows: sequences)
    nheads_k = nheads if nheads_k is None else int(nheads_k)
    group = nheads // nheads_k
    amax = torch.zeros(rows * nheads, dtype=torch.int32, device=x.device)  # float32 bits (0 is 0.0)
    if keys_fastest:
        out = keys_fastest_memory(batch, seqlen, nheads, headdim, torch.uint8, x.device).permute(0, 3, 1, 2)
    else:
        out = torch.empty(x4.shape, dtype=torch.uint8, device=x.device)
    # (packed: an empty sequence's descale is 1, as on the PyTorch path; no program writes it)
    descale = (torch.ones if packed else torch.empty)(rows, nheads_k, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(seqlen, BLOCK_S)
    grid = (configs.flat_programs(tiles, batch * nheads),)
    block_d = triton.next_power_of_2(headdim)
    strides = (x4.stride(0), x4.stride(1), x4.stride(2))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (Triton: the current device)
        # (dense: amax stands in for the Seq and CuSeqlens pointers, which are not read)
        configs.launch_plain(_amax_kernel, grid, x4, amax, sequence if packed else amax, tiles, seqlen, nheads,
                             *strides, HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_S=BLOCK_S, VARLEN=packed)
        configs.launch_plain(_quantize_kernel, grid, x4, amax, out, descale, sequence if packed else amax,
                             cu_seqlens.contiguous() if packed else amax,  # (read with unit stride)
                             tiles, seqlen, nheads, nheads_k, *strides, *out.stride(), HEAD_DIM=headdim,
                             BLOCK_D=block_d,
                             BLOCK_S=BLOCK_S, GROUP=group, BLOCK_G=triton.next_power_of_2(group), AMAX_TINY=AMAX_TINY,
                             VARLEN=packed)
    out = out.view(torch.float8_e4m3fn)
    return (out[0] if packed else out[:, :seqlen] if keys_fastest else out), descale


def quantize_given(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``flashtile.fp8.quantize_with(x, descale)`` by one kernel: x (batch, seqlen, nheads_k, headdim)
    float16/bfloat16/float32/float64 with unit stride in headdim, seqlen and headdim > 0; descale float32
    (batch, nheads_k) on x's device (checked by the caller). float8_e4m3fn, contiguous."""
    batch, seqlen, nheads, headdim = x.shape
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    descale = descale.contiguous()
    tiles = triton.cdiv(seqlen, BLOCK_S)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        # (Amax, Seq and CuSeqlens are not read: descale stands in, as amax does in quantize_heads)
        configs.launch_plain(_quantize_kernel, (configs.flat_programs(tiles, batch * nheads),), x, descale, out,
                             descale, descale, descale, tiles, seqlen, nheads, nheads, *x.stride()[:3],
                             *out.stride(), HEAD_DIM=headdim,
                             BLOCK_D=triton.next_power_of_2(headdim), BLOCK_S=BLOCK_S, GROUP=1, BLOCK_G=1,
                             AMAX_TINY=AMAX_TINY, VARLEN=False, GIVEN=True)
    return out.view(torch.float8_e4m3fn)
