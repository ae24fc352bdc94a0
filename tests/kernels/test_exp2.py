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
    """At most 2.5e-7 relative to float64 2**x over [-126, 0] (the hardware ex2.approx.f32 bound is
    2 ulp, 2.4e-7), float32 rounding included; integers and half-integers (the ends of the fitted
    interval) among the points."""
    n = 1 << 14
    x = torch.cat([-126.0 * torch.rand(n - 509, dtype=torch.float64), -torch.arange(253, dtype=torch.float64) / 2,
                   -torch.rand(256, dtype=torch.float64)]).float().to(DEVICE)
    y = torch.empty_like(x)
    _exp2_fma_kernel[(1,)](x, y, N=n)
    want = torch.exp2(x.double())
    rel = ((y.double() - want) / want).abs().max().item()
    assert rel <= 2.5e-7, rel


def test_exp2_fma_zeros():
    """-inf (a masked score) and anything below -127 give exactly 0; 0 gives 1 within the bound."""
    x = torch.tensor([float("-inf"), -1e30, -200.0, -127.5, -127.0, 0.0, -0.0, -1.0], device=DEVICE)
    x = torch.cat([x, torch.full((8,), -3.0, device=DEVICE)])
    y = torch.full_like(x, float("nan"))
    _exp2_fma_kernel[(1,)](x, y, N=16)
    assert torch.equal(y[:5], torch.zeros(5, device=DEVICE))
    assert abs(y[5].item() - 1.0) <= 2.5e-7 and abs(y[6].item() - 1.0) <= 2.5e-7
    assert abs(y[7].item() - 0.5) <= 2.5e-7 * 0.5


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
