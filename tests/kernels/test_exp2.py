"""exp2 on the FMA units (kernels/common.py): its error bound, its zeros, and the tile split that shares
a softmax tile's exponentials between the special-function unit and the FMA units."""

import pytest
import torch
import triton
import triton.language as tl

from flashtile.kernels.common import exp2_fma, exp2_tile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _exp2_fma_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, exp2_fma(tl.load(X + offs)))


@triton.jit
def _exp2_tile_kernel(X, Y, ROWS: tl.constexpr, COLS: tl.constexpr, FMA_SHARE: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(Y + offs, exp2_tile(tl.load(X + offs), FMA_SHARE))


def test_exp2_fma_error_bound():
    """At most 2.5e-7 relative to float64 2**x over [-125.5, 0] (the hardware ex2.approx.f32 bound is
    2 ulp, 2.4e-7), float32 rounding included; integers and half-integers (the ends of the fitted
    interval) among the points."""
    n = 1 << 14
    x = torch.cat([-125.5 * torch.rand(n - 508, dtype=torch.float64), -torch.arange(252, dtype=torch.float64) / 2,
                   -torch.rand(256, dtype=torch.float64)]).float().to(DEVICE)
    y = torch.empty_like(x)
    _exp2_fma_kernel[(1,)](x, y, N=n)
    want = torch.exp2(x.double())
    rel = ((y.double() - want) / want).abs().max().item()
    assert rel <= 2.5e-7, rel


def test_exp2_fma_zeros_and_nan():
    """-inf (a masked score) and anything below -125.5 give exactly 0 (the flush-to-zero range); NaN
    stays NaN; 0 gives 1 within the bound."""
    zeros = [float("-inf"), -1e30, -200.0, -127.0, -126.9, -126.0, -125.6]
    x = torch.tensor(zeros + [float("nan"), 0.0, -0.0, -1.0] + [-3.0] * 5, device=DEVICE)
    y = torch.full_like(x, 7.0)
    _exp2_fma_kernel[(1,)](x, y, N=16)
    assert torch.equal(y[:7], torch.zeros(7, device=DEVICE))
    assert torch.isnan(y[7])
    assert abs(y[8].item() - 1.0) <= 2.5e-7 and abs(y[9].item() - 1.0) <= 2.5e-7
    assert abs(y[10].item() - 0.5) <= 2.5e-7 * 0.5


@pytest.mark.parametrize("fma_share", [0, 2, 4])
def test_exp2_tile_columns_in_place(fma_share):
    """Each column of the tile comes back in its place, whichever unit computed it: column c of row r
    holds -(r + c / cols), so a permuted column shows as a wrong value."""
    rows, cols = 16, 32
    x = -(torch.arange(rows, dtype=torch.float32)[:, None] + torch.arange(cols, dtype=torch.float32)[None, :] / cols)
    x = x.contiguous().to(DEVICE)
    y = torch.full_like(x, float("nan"))
    _exp2_tile_kernel[(1,)](x, y, ROWS=rows, COLS=cols, FMA_SHARE=fma_share)
    torch.testing.assert_close(y, torch.exp2(x), rtol=3e-7, atol=0)
