"""dQ in fixed point (``flashtile.kernels.fixed_point``): the per-row units that keep every int32 partial sum of
dQ's shares clear of overflow, and the kernels that make them and turn the counts into dQ (interpreter on CPU)."""

import pytest
import torch

from flashtile.kernels import fixed_point
from tests.utils import stable_seed


@pytest.mark.parametrize("dropout_p", [0.0, 0.9], ids=["plain", "dropout"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fixed_point_units_bound_every_partial_sum(causal, dropout_p):
    """The one-pass backward's int32 dQ counts: every key block's share of a row's dQ, and every partial sum of
    them, stays under 2^FIXED_POINT_BITS units of the row (float64 attention, dS rounded to 16 bits as the kernel
    does, GQA with KV heads of different sizes, peaked and flat rows; under dropout dP the kept entries' over
    1 - p, the units made with ``dp_scale`` = 1 / (1 - p)), and
    the units come contiguous in lse's (batch, heads, seqlen_q) order, as the kernel reads them."""
    torch.manual_seed(stable_seed(causal, dropout_p, "fixed-point-units"))
    batch, seqlen, heads, heads_k, d, block = 2, 300, 4, 2, 32, 128
    q = torch.randn(batch, seqlen, heads, d, dtype=torch.float64) * torch.tensor([0.2, 1.0, 3.0, 8.0]).view(1, 1, 4, 1)
    k, v = (torch.randn(batch, seqlen, heads_k, d, dtype=torch.float64) * torch.tensor([1.0, 20.0]).view(1, 1, 2, 1)
            for _ in range(2))
    dout = torch.randn_like(q)
    kh, vh = (t.repeat_interleave(heads // heads_k, dim=2) for t in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, kh) * d ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), float("-inf"))
    p = scores.softmax(-1)
    kept = (torch.rand_like(p) >= dropout_p).double() / (1 - dropout_p)  # the mask and the survivors' scale
    out = torch.einsum("bhij,bjhd->bihd", p * kept, vh)
    delta = (dout * out).sum(-1).transpose(1, 2)
    # dS as the kernel rounds it (16-bit) before its products: the units' margin covers that rounding.
    dp = torch.einsum("bihd,bjhd->bhij", dout, vh) * kept
    ds = (p * (dp - delta.unsqueeze(-1))).to(torch.bfloat16).double()
    unit = fixed_point.fixed_point_units(dout.float(), k.float(), v.float(), delta.float(), heads // heads_k,
                                         dp_scale=1 / (1 - dropout_p))
    assert unit.is_contiguous() and unit.shape == (batch, heads, seqlen) and (unit > 0).all()
    running = torch.zeros(batch, heads, seqlen, d, dtype=torch.float64)
    for start in range(0, seqlen, block):
        share = torch.einsum("bhij,bjhd->bhid", ds[..., start:start + block], kh[:, start:start + block])
        running += share
        for value in (share, running):
            assert (value.abs() / unit.double().unsqueeze(-1)).max() < 2 ** fixed_point.FIXED_POINT_BITS


def test_fixed_point_units_follow_the_bound_per_row_and_kv_head():
    """Each row's unit is (|dO_i| max_j |V_j| + |delta_i|) max |K| of the row's own KV head (GQA: query head h reads
    KV head h // group), with the margin, over 2^FIXED_POINT_BITS; the KV heads of very different sizes, so that
    another head's maxima would show."""
    torch.manual_seed(stable_seed("fixed-point-units-formula"))
    batch, seqlen_q, seqlen_k, heads, heads_k, d = 2, 37, 53, 6, 3, 16
    group = heads // heads_k
    dout = torch.randn(batch, seqlen_q, heads, d) * torch.rand(batch, seqlen_q, heads, 1)
    size = torch.tensor([0.01, 1.0, 30.0]).view(1, 1, heads_k, 1)
    k, v = torch.randn(batch, seqlen_k, heads_k, d) * size, torch.randn(batch, seqlen_k, heads_k, d) * size.flip(2)
    delta = torch.randn(batch, heads, seqlen_q)
    unit = fixed_point.fixed_point_units(dout, k, v, delta, group)
    for b in range(batch):
        for h in range(heads):
            kh = h // group
            v_max = max(v[b, j, kh].double().norm() for j in range(seqlen_k))
            k_max = k[b, :, kh].double().abs().max()
            for i in range(seqlen_q):
                bound = (dout[b, i, h].double().norm() * v_max + abs(float(delta[b, h, i]))) * k_max
                want = bound * (1 + 2.0 ** -4) * 2.0 ** -fixed_point.FIXED_POINT_BITS
                assert float(unit[b, h, i]) == pytest.approx(float(want), rel=1e-5)


def test_fixed_point_units_floor_and_non_finite_rows():
    """A row whose bound is 0 (dO of zeros) gets the floor's unit, whose inverse is finite; a row with a NaN in its
    dO gets a NaN unit (its dQ comes out NaN), and the other rows are untouched."""
    dout, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)
    dout[0, 1, 0] = 0.0
    dout[0, 2, 1, 3] = float("nan")
    delta = torch.zeros(1, 2, 4)
    unit = fixed_point.fixed_point_units(dout, k, v, delta, 2)
    assert torch.isfinite(1.0 / unit[0, 0, 1]) and unit[0, 0, 1] > 0
    assert torch.isnan(unit[0, 1, 2]) and torch.isfinite(unit[0, 0]).all() and torch.isfinite(unit[0, 1, :2]).all()


@pytest.mark.parametrize("shape", [(2, 37, 53, 6, 3, 16), (1, 130, 333, 4, 2, 128), (2, 65, 64, 2, 2, 40)],
                         ids=["gqa-d16", "d128", "d40"])
def test_fused_fixed_point_setup_matches_the_reference(shape):
    """The kernels that make the one pass's row statistics and units and turn its accumulator into dQ
    (``setup_units``, ``dq_from_accumulator``): delta = rowsum(dO * O) within float32 rounding, lse in log2
    units (+inf for a row that saw no key), the units within float32 rounding of ``fixed_point_units`` (GQA, KV heads
    of very different sizes, a zero dO row, NaN in a dO row and in one KV head's K kept as NaN units), 1 / unit or 0
    where not finite, the one pass's accumulator zeroed on the way (its every element, from garbage), and dQ as
    counts times units times the scale (or float32 sums times the scale), bit for bit."""
    batch, seqlen_q, seqlen_k, heads, heads_k, d = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(stable_seed(*shape, "fused-units"))
    dout = torch.randn(batch, seqlen_q, heads, d) * torch.rand(batch, seqlen_q, heads, 1)
    out = torch.randn(batch, seqlen_q, heads, d)
    lse = torch.randn(batch, heads, seqlen_q) * 4
    lse[0, 0, 1] = float("-inf")  # a row that saw no key
    size = torch.tensor([0.01, 1.0, 30.0][:heads_k]).view(1, 1, heads_k, 1)
    k, v = torch.randn(batch, seqlen_k, heads_k, d) * size, torch.randn(batch, seqlen_k, heads_k, d) * size.flip(2)
    dout[0, 1, 0] = 0.0
    dout[0, 2, 1, 3] = float("nan")
    k[-1, 5, heads_k - 1, 1] = float("nan")
    acc = torch.randint(-2**30, 2**30, dout.shape, dtype=torch.int32, device=device)
    delta, lse2, unit, inv_unit = (t.cpu() for t in fixed_point.setup_units(
        *(t.to(device) for t in (out, dout, lse, k, v)), heads // heads_k, acc=acc)[:4])
    assert not acc.any()
    want_delta = (out * dout).sum(-1).transpose(1, 2)
    assert torch.equal(delta.isnan(), want_delta.isnan())
    assert torch.allclose(delta.nan_to_num(), want_delta.nan_to_num(), rtol=1e-5, atol=1e-5)
    want_lse2 = lse * 1.4426950408889634
    assert lse2[0, 0, 1] == float("inf") and torch.allclose(lse2[torch.isfinite(lse)], want_lse2[torch.isfinite(lse)])
    want = fixed_point.fixed_point_units(dout, k, v, delta, heads // heads_k)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isnan(unit), torch.isnan(want)) and finite.any() and not finite.all()
    assert ((unit[finite] - want[finite]).abs() / want[finite]).max() < 1e-6
    assert torch.equal(inv_unit, torch.where(torch.isfinite(unit), 1.0 / unit, 0.0))
    counts = torch.randint(-2**30, 2**30, (batch, seqlen_q, heads, d), dtype=torch.int32)
    dq = torch.full(counts.shape, float("nan"), dtype=torch.float16, device=device)
    fixed_point.dq_from_accumulator(counts.to(device), unit.to(device), dq, 0.125)
    want_dq = (counts * (unit * 0.125).transpose(1, 2).unsqueeze(-1)).to(torch.float16)
    assert torch.equal(dq.cpu().isnan(), want_dq.isnan())
    assert torch.equal(dq.cpu().nan_to_num(), want_dq.nan_to_num())
    sums = torch.randn(batch, seqlen_q, heads, d)
    fixed_point.dq_from_accumulator(sums.to(device), None, dq, 0.125)
    assert torch.equal(dq.cpu(), (sums * 0.125).to(torch.float16))


@pytest.mark.parametrize("seqlen_k", [5, 53, 1000], ids=["tiny", "short", "long"])
def test_sampled_setup_matches_the_reference_and_writes_its_bounds(seqlen_k, poison):
    """Sampled (``setup_units(sampled=True)``): the maxima from ``sampled_keys`` only (key 0 among them, every key
    when there are few), times ``ESTIMATE_MARGIN``, as ``fixed_point_units(sampled=True)`` makes them; the bounds
    the one pass checks its keys against written per (batch, KV head) (V's, K's), and the flag zeroed (from
    poisoned memory). A key outside the sample, much larger than the rest, is not seen (the one pass's check
    catches it). A row whose unit overflows (float32's range, the margin's 4x included) raises the flag."""
    batch, seqlen_q, heads, heads_k, d = 2, 37, 6, 3, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(stable_seed(seqlen_k, "sampled-units"))
    dout, out = torch.randn(batch, seqlen_q, heads, d), torch.randn(batch, seqlen_q, heads, d)
    lse = torch.randn(batch, heads, seqlen_q)
    size = torch.tensor([0.01, 1.0, 30.0]).view(1, 1, heads_k, 1)
    k, v = torch.randn(batch, seqlen_k, heads_k, d) * size, torch.randn(batch, seqlen_k, heads_k, d) * size.flip(2)
    rows = fixed_point.sampled_keys(seqlen_k)
    assert rows[0] == 0 and len(rows) == min(seqlen_k, fixed_point.SAMPLE_PARTS * fixed_point.SAMPLE_ROWS)
    outside = [j for j in range(seqlen_k) if j not in set(rows.tolist())]
    if outside:
        k[0, outside[len(outside) // 2], 1] *= 1000.0
    acc = torch.ones(dout.shape, dtype=torch.int32, device=device)
    units = fixed_point.setup_units(*(t.to(device) for t in (out, dout, lse, k, v)), heads // heads_k, acc=acc,
                                    sampled=True)
    want = fixed_point.fixed_point_units(dout, k, v, units.delta.cpu(), heads // heads_k, sampled=True)
    assert ((units.unit.cpu() - want) / want).abs().max() < 1e-6
    v_max, k_max = fixed_point.kv_estimates(k, v, sampled=True)
    bounds = units.bounds.cpu().view(batch, heads_k, 2)
    assert torch.allclose(bounds[..., 0], v_max, rtol=1e-6) and torch.equal(bounds[..., 1], k_max)
    assert units.flag.shape == (batch * heads_k,) and not units.flag.any() and not acc.any()
    exact_v, exact_k = fixed_point.kv_estimates(k, v)
    if outside:
        assert k_max[0, 1] < exact_k[0, 1]  # the outlier is past the guess
    else:
        assert torch.equal(k_max, exact_k * fixed_point.ESTIMATE_MARGIN)
    dout[0, 3, 4] *= 1e36  # (batch 0, row 3, head 4: KV head 2, whose K is 30x)
    units = fixed_point.setup_units(*(t.to(device) for t in (out, dout, lse, k, v)), heads // heads_k, acc=acc,
                                    sampled=True)
    assert not torch.isfinite(units.unit[0, 4, 3])
    assert units.flag.cpu().tolist() == [0, 0, 1, 0, 0, 0]  # (batch, KV head) flags, batch-major


@pytest.mark.parametrize("dropout_p", [0.0, 0.3], ids=["plain", "dropout"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [40, 64], ids=lambda d: f"d{d}")
def test_dq_where_flagged_recomputes_dq_only_where_flagged(headdim, causal, dropout_p):
    """The one pass's fallback (``backward.dq_where_flagged``): it writes dense attention's dQ (bottom-right causal
    or not, GQA, lengths no multiple of its tiles, dropout as the dense forward draws it) for the query heads whose
    (batch, KV head) flag is set, against float64 autograd (float32 inputs: TF32 products on a GPU), and leaves the
    other heads' dq as it was (NaN here): none, one KV head of the second sequence, all."""
    from flashtile.kernels.backward import dq_where_flagged
    from flashtile.reference import dropout_mask

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(stable_seed(headdim, causal, dropout_p, "dq-where-flagged"))
    batch, seqlen_q, seqlen_k, heads, heads_k, seed = 2, 70, 131, 4, 2, 1234
    scale = headdim ** -0.5
    q = torch.randn(batch, seqlen_q, heads, headdim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, heads_k, headdim, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(batch, seqlen_q, heads, headdim, dtype=torch.float64)
    kh, vh = (t.repeat_interleave(heads // heads_k, dim=2) for t in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, kh) * scale
    if causal:
        hidden = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).triu(seqlen_k - seqlen_q + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(-1)
    p = (scores - lse.unsqueeze(-1)).exp()
    if dropout_p:
        p = p * dropout_mask(batch, heads, seqlen_q, seqlen_k, dropout_p, seed, "cpu") / (1 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", p, vh)
    (want,) = torch.autograd.grad(out, q, dout)
    delta = (dout * out).sum(-1).transpose(1, 2).float().contiguous()
    lse2 = (lse * 1.4426950408889634).float().contiguous()
    inputs = [t.detach().float().to(device) for t in (dout, q, k, v)]
    for flags in ([0, 0, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]):
        dq = torch.full(q.shape, float("nan"), device=device)
        dq_where_flagged(torch.tensor(flags, dtype=torch.int32, device=device), *inputs, lse2.to(device),
                         delta.to(device), dq, causal, scale, dropout_p, seed)
        # (batch, KV head) flags to (batch, query head)
        written = torch.tensor(flags, dtype=torch.bool).view(batch, heads_k).repeat_interleave(heads // heads_k, 1)
        dq = dq.cpu().double().transpose(1, 2)  # (batch, heads, seqlen_q, d)
        assert dq[~written].isnan().all()
        if written.any():  # (on a GPU tl.dot rounds float32 inputs to TF32)
            error = (dq[written] - want.transpose(1, 2)[written]).abs().max()
            assert error < (1e-2 if device == "cuda" else 1e-4) * want.abs().max()
