"""dQ accumulated in fixed point: the backward passes that add each key block's share of dQ (dS K) into one
accumulator (``gluon_backward``'s one pass, the Triton dK pass's ``DQ_SHARE``) add int32 counts of a per-row unit,
so that the sum does not depend on the order the shares land in and the bits repeat.

Three small Triton kernels: ``_kv_maxima`` and ``_row_units`` make each row's unit (and the rows' delta and lse₂,
as the backward's preprocess does), ``_dq_from_counts`` turns the counts into dQ. ``fixed_point_units`` is the
readable PyTorch form of the units. By default (the warp-specialized one pass) the units' K and V maxima are guessed
from a sample of the keys (``sampled_keys``, times ``ESTIMATE_MARGIN``) rather than read from every key; the one pass
checks each key it loads against the guess and flags a miss, on which ``backward.dq_where_flagged`` makes dQ again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import configs
from .common import await_prior_grids, row_delta_and_lse2

FIXED_POINT_BITS = 30


def fixed_point_units(dout: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor,
                      group: int, dp_scale: float = 1.0, sampled: bool = False) -> torch.Tensor:
    """Per query row, the unit of the one-pass backward's int32 dQ accumulator: (batch, heads, seqlen_q) float32.
    In PyTorch ops, the readable form of what ``setup_units`` computes in two kernels (the tests hold
    the kernels to it).

    A row's dQ (before softmax_scale) is sum_j dS_ij K_j with dS_ij = P_ij (dP_ij - delta_i), P_ij >= 0,
    sum_j P_ij = 1 and |dP_ij| = |dO_i . V_j| <= |dO_i| |V_j|. So every element of it, and of every partial sum
    over key blocks, is at most (|dO_i| max_j |V_j| + |delta_i|) max_jc |K_jc| in magnitude (max over the row's
    KV head); that bound, with a margin for rounding, is 2^FIXED_POINT_BITS units, which keeps every int32
    partial sum clear of overflow. Under dropout dP_ij is the kept entries' dO_i . V_j / (1 - p): |dO_i| max_j |V_j|
    is multiplied by ``dp_scale`` = 1 / (1 - p). dout: (batch, seqlen_q, heads, d); k, v: (batch, seqlen_k,
    heads_k, d); delta: (batch, heads, seqlen_q) float32. ``sampled``: the maxima over the keys of
    ``sampled_keys`` only, times ``ESTIMATE_MARGIN`` (``kv_estimates``): a guess at the bound that the one pass
    checks against every key it reads."""
    do_norm = torch.linalg.vector_norm(dout, dim=-1, dtype=torch.float32).transpose(1, 2)  # (batch, heads, seqlen_q)
    v_max, k_max = kv_estimates(k, v, sampled)
    v_max, k_max = (x.repeat_interleave(group, dim=1) for x in (v_max, k_max))  # (batch, heads)
    bound = (do_norm * v_max.unsqueeze(-1) * dp_scale + delta.abs()) * k_max.unsqueeze(-1)
    # The margin covers dS's 16-bit rounding (2^-8 of each element) and the float32 products; the floor keeps
    # 1 / unit finite (a row under it has a dQ of at most 2^-90, counted to 2^-120). A non-finite bound (inf or
    # NaN in the row's dO, or in its head's K or V) stays non-finite: those rows count nothing, and their unit
    # raises the flag on which the one pass's dQ is made again (``backward.dq_where_flagged``). Contiguous: the
    # kernel indexes the rows as lse's, and elementwise results keep do_norm's transposed strides.
    bound = torch.where(bound < 2.0 ** -90, 2.0 ** -90, bound)
    return (bound * ((1 + 2.0 ** -4) * 2.0 ** -FIXED_POINT_BITS)).contiguous()


# The bound's K and V maxima guessed from a sample of the keys: SAMPLE_PARTS tiles of SAMPLE_ROWS keys, the p-th from
# key p * (seqlen_k // SAMPLE_PARTS) (key 0 always among them), times ESTIMATE_MARGIN. Reading every key for the exact
# maxima took 54 us of a 2.47 ms d = 128 backward at 4,096 tokens on an H100; the one pass reads each key anyway and
# checks it against the guess there (``gluon_backward._flag_unbounded_keys``), and a key past it sets a flag on which
# the Triton dQ pass recomputes dQ (``backward.dq_where_flagged``). The margin costs dQ's counts one bit of K and one
# of V: 28 of the 30 bits of resolution under the bound remain.
SAMPLE_PARTS = 8
SAMPLE_ROWS = 32
ESTIMATE_MARGIN = 2.0


def sampled_keys(seqlen_k: int) -> torch.Tensor:
    """The key rows ``_kv_maxima`` reads when sampling (sorted, distinct), int64."""
    starts = torch.arange(SAMPLE_PARTS) * (seqlen_k // SAMPLE_PARTS)
    rows = (starts[:, None] + torch.arange(SAMPLE_ROWS)).flatten()
    return rows[rows < seqlen_k].unique()


def kv_estimates(k: torch.Tensor, v: torch.Tensor, sampled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_j |V_j|, max |K_jc|) per (batch, KV head), float32 (batch, heads_k) each: over every key, or
    (``sampled``) over ``sampled_keys`` times ``ESTIMATE_MARGIN``. NaN kept."""
    if sampled:
        rows = sampled_keys(k.shape[1]).to(k.device)
        k, v = k[:, rows], v[:, rows]
    v_max = torch.linalg.vector_norm(v, dim=-1, dtype=torch.float32).amax(dim=1)
    k_max = k.abs().amax(dim=(1, 3)).float()
    if sampled:
        v_max, k_max = v_max * ESTIMATE_MARGIN, k_max * ESTIMATE_MARGIN
    return v_max, k_max


# The one pass's fixed-point setup and its last step as three small kernels (in PyTorch ops, fixed_point_units
# and the conversion took about 0.3-0.5 ms of every call on an H200, most of a 4,096-token backward's margin).
_MAXIMA_PARTS = 32  # programs per (batch, KV head) in _kv_maxima: partial maxima _row_units reduces
# The three kernels stream rows (64 keys, 64 query rows, 32 accumulator rows a program): memory-bound passes whose
# tiles were not tuned; at 16,384 tokens they take tens of microseconds against a backward of milliseconds.


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _kv_maxima(K, V, Partial, Flag, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, nheads_k,
               seqlen_k, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr,
               SAMPLED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Per (batch, KV head) and part: max_j |V_j| (the row's 2-norm) and max |K_jc| over the part's key tiles
    (tiles part, part + PARTS, ...; SAMPLED: the one tile from key part * (seqlen_k // PARTS)), NaN kept, into
    Partial (batch * nheads_k, PARTS, 2) float32. The (batch, KV head)'s Flag ((batch * nheads_k,) int32,
    ``_row_units``'s and the one pass's) zeroed."""
    await_prior_grids(PDL)
    part, pid_bh = tl.program_id(0), tl.program_id(1)
    tl.store(Flag + pid_bh, 0, mask=part == 0)
    batch, kv_head = pid_bh // nheads_k, pid_bh % nheads_k
    cols = tl.arange(0, BLOCK_D)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    v_max = tl.zeros([BLOCK_N], tl.float32)
    k_max = tl.zeros([BLOCK_N], tl.float32)
    if SAMPLED:
        first, step = part * (seqlen_k // PARTS), seqlen_k
    else:
        first, step = part * BLOCK_N, PARTS * BLOCK_N
    for start in range(first, seqlen_k, step):
        keys = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
        kept = (keys[:, None] < seqlen_k) & (cols[None, :] < HEAD_DIM)
        k = tl.load(k_base + keys[:, None] * stride_kn + cols[None, :], mask=kept, other=0.0).to(tl.float32)
        v = tl.load(v_base + keys[:, None] * stride_vn + cols[None, :], mask=kept, other=0.0).to(tl.float32)
        v_max = _nan_max(v_max, tl.sqrt(tl.sum(v * v, 1)))
        k_max = _nan_max(k_max, tl.reduce(tl.abs(k), 1, _nan_max))
    out = Partial + (pid_bh * PARTS + part) * 2
    tl.store(out, tl.reduce(v_max, 0, _nan_max))
    tl.store(out + 1, tl.reduce(k_max, 0, _nan_max))


@triton.jit
def _row_units(Out, DO, Lse, Delta, Lse2, Partial, Unit, InvUnit, Acc, Bounds, Flag, stride_ob, stride_om, stride_oh,
               stride_dob, stride_dom, stride_doh, nheads, group, seqlen_q, margin, dp_scale, estimate_margin,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PARTS: tl.constexpr,
               PDL: tl.constexpr = False):
    """Everything the one pass in fixed point needs per query row, from one read of O and dO: delta = rowsum(dO * O)
    and lse in log2 units (+inf for a row that saw no key) into Delta, Lse2 (``common.row_delta_and_lse2``, as the
    Triton backward's preprocess at the same tile: the same bits), then the row's unit and its inverse (0
    where the unit is not finite), as ``fixed_point_units``, into Unit, InvUnit (all (batch, nheads, seqlen_q)
    float32, contiguous, as Lse), from dO's norm, delta and the row's KV head's maxima (``_kv_maxima``; dP's bound
    times ``dp_scale``, 1 / (1 - p) under dropout). The rows' dQ accumulator (Acc, contiguous (batch, seqlen_q,
    nheads, HEAD_DIM) int32) zeroed too. The maxima times ``estimate_margin`` (``ESTIMATE_MARGIN`` when sampled, else
    1) into Bounds ((batch * nheads_k, 2) float32: V's, K's), which the one pass checks its keys against. Flag
    ((batch * nheads_k,) int32, zeroed by ``_kv_maxima``) set at the KV head of a row whose unit is not finite: with
    the margin a finite bound can overflow, and the flagged dQ pass then gives that head's rows their values."""
    await_prior_grids(PDL)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    batch, head = pid_bh // nheads, pid_bh % nheads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    tokens = rows.to(tl.int64)
    o_ptrs = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    o_ptrs += tokens[:, None] * stride_om + cols[None, :]
    do_ptrs = DO + batch.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    do_ptrs += tokens[:, None] * stride_dom + cols[None, :]
    stats = pid_bh.to(tl.int64) * seqlen_q + rows
    do, delta = row_delta_and_lse2(o_ptrs, do_ptrs, Lse, Delta, Lse2, stats, rows, seqlen_q, cols, HEAD_DIM, EVEN_D)
    partial = Partial + ((batch * (nheads // group) + head // group) * PARTS + tl.arange(0, PARTS)) * 2
    v_max = tl.reduce(tl.load(partial), 0, _nan_max) * estimate_margin
    k_max = tl.reduce(tl.load(partial + 1), 0, _nan_max) * estimate_margin
    kv_index = batch * (nheads // group) + head // group
    first = (pid_m == 0) & (head % group == 0)  # one program per (batch, KV head) writes its bounds
    tl.store(Bounds + kv_index * 2, v_max, mask=first)
    tl.store(Bounds + kv_index * 2 + 1, k_max, mask=first)
    bound = (tl.sqrt(tl.sum(do * do, 1)) * v_max * dp_scale + tl.abs(delta)) * k_max
    bound = tl.where(bound < 2.0 ** -90, 2.0 ** -90, bound)  # (NaN compares false: it stays NaN)
    unit = bound * margin
    finite = (unit == unit) & (unit < float("inf"))
    tl.store(Flag + kv_index + tl.zeros([BLOCK_M], tl.int32), tl.full([BLOCK_M], 1, tl.int32),
             mask=(rows < seqlen_q) & ~finite)
    tl.store(Unit + stats, unit, mask=rows < seqlen_q)
    tl.store(InvUnit + stats, tl.where(finite, tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), unit), 0.0),
             mask=rows < seqlen_q)
    acc_rows = ((batch * seqlen_q + rows).to(tl.int64) * nheads + head) * HEAD_DIM
    tl.store(Acc + acc_rows[:, None] + cols[None, :], tl.zeros([BLOCK_M, BLOCK_D], tl.int32),
             mask=(rows[:, None] < seqlen_q) & (cols[None, :] < HEAD_DIM))


@triton.jit
def _dq_from_counts(Acc, Unit, DQ, scale, nheads, seqlen_q, total_rows, stride_dq_b, stride_dq_t, stride_dq_h,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, FIXED: tl.constexpr,
                    PDL: tl.constexpr = False):
    """dQ from the one pass's accumulator, contiguous (batch, seqlen_q, nheads, HEAD_DIM): counts times the row's
    unit (FIXED; Unit (batch, nheads, seqlen_q)) or float32 sums, times ``scale``, in DQ's dtype. DQ has that
    shape in strides of its own (its last dim contiguous): a slice of a packed gradient, say."""
    await_prior_grids(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # (batch, token, head) rows
    cols = tl.arange(0, BLOCK_D)
    kept = (rows[:, None] < total_rows) & (cols[None, :] < HEAD_DIM)
    acc = tl.load(Acc + rows[:, None] * HEAD_DIM + cols[None, :], mask=kept, other=0).to(tl.float32)
    head = rows % nheads
    token = (rows // nheads) % seqlen_q
    batch = rows // (nheads * seqlen_q)
    if FIXED:
        unit = tl.load(Unit + (batch * nheads + head) * seqlen_q + token, mask=rows < total_rows, other=0.0)
        value = acc * (unit * scale)[:, None]
    else:
        value = acc * scale
    dq_rows = batch * stride_dq_b + token * stride_dq_t + head * stride_dq_h
    tl.store(DQ + dq_rows[:, None] + cols[None, :], value.to(DQ.dtype.element_ty), mask=kept)


class Units(NamedTuple):
    """What ``setup_units`` makes: (batch, heads, seqlen_q) float32 delta, lse₂, unit, 1 / unit (0 where not
    finite); the maxima the units assume, (batch * heads_k, 2) float32 (V's, K's); a flag per (batch, KV head),
    (batch * heads_k,) int32, zeroed."""
    delta: torch.Tensor
    lse2: torch.Tensor
    unit: torch.Tensor
    inv_unit: torch.Tensor
    bounds: torch.Tensor
    flag: torch.Tensor


def setup_units(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: int, acc: torch.Tensor, dp_scale: float = 1.0, sampled: bool = False,
                estimate_margin: float = ESTIMATE_MARGIN) -> Units:
    """(delta, lse in log2 units, unit, 1 / unit or 0 where not finite) of the one pass in fixed point, by two
    kernels (``_kv_maxima``, ``_row_units``): (batch, heads, seqlen_q) float32 each; delta and lse₂ as the Triton
    backward's ``preprocess`` makes them, the units as ``fixed_point_units``. out, dout, k, v: their last dim
    contiguous; lse float32, contiguous (batch, heads, seqlen_q). ``acc``: the one pass's int32 dQ accumulator
    (contiguous, dout's shape), zeroed on the way (no PyTorch fill, which a launch plan could not replay). The
    preprocess's work rides on the units' read of dO: one launch and one read of dO fewer than the two apart.
    ``dp_scale``: 1 / (1 - p) under dropout (``fixed_point_units``). ``sampled``: the maxima from ``sampled_keys``
    times ``estimate_margin`` (``fixed_point_units(sampled=True)`` at the default margin), which the one pass checks
    (``Units.bounds``, ``Units.flag``)."""
    batch, seqlen_q, nheads, d = dout.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    block_d = triton.next_power_of_2(d)
    parts, rows = (SAMPLE_PARTS, SAMPLE_ROWS) if sampled else (_MAXIMA_PARTS, 64)
    partial = torch.empty(batch * nheads_k, parts, 2, dtype=torch.float32, device=dout.device)
    flag = torch.empty(batch * nheads_k, dtype=torch.int32, device=dout.device)
    configs.launch_plain(_kv_maxima, (parts, batch * nheads_k), k, v, partial, flag, *k.stride()[:3],
                         *v.stride()[:3], nheads_k, seqlen_k, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=rows,
                         PARTS=parts, SAMPLED=sampled, **configs.pdl_options(k.device))
    delta, lse2, unit, inv_unit = (torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=dout.device)
                                   for _ in range(4))
    bounds = torch.empty(batch * nheads_k, 2, dtype=torch.float32, device=dout.device)
    margin = (1 + 2.0 ** -4) * 2.0 ** -FIXED_POINT_BITS
    # The preprocess's tile (configs.PREPROCESS_BLOCK_M rows, 4 warps): delta's sum in the same order, the same bits.
    configs.launch_plain(_row_units, (triton.cdiv(seqlen_q, configs.PREPROCESS_BLOCK_M), batch * nheads), out, dout,
                         lse, delta, lse2, partial, unit, inv_unit, acc, bounds, flag, *out.stride()[:3],
                         *dout.stride()[:3], nheads, group, seqlen_q, margin, dp_scale,
                         estimate_margin if sampled else 1.0, HEAD_DIM=d, BLOCK_D=block_d,
                         BLOCK_M=configs.PREPROCESS_BLOCK_M, PARTS=parts, num_warps=4,
                         **configs.pdl_options(dout.device))
    return Units(delta, lse2, unit, inv_unit, bounds, flag)


def dq_from_accumulator(acc: torch.Tensor, unit: torch.Tensor | None, dq: torch.Tensor, scale: float) -> None:
    """dq (acc's shape, its last dim contiguous, any other strides) = acc's (contiguous) float32 sums, or its int32
    counts times each row's ``unit``, times scale."""
    batch, seqlen_q, nheads, d = acc.shape
    rows = batch * seqlen_q * nheads
    configs.launch_plain(_dq_from_counts, (triton.cdiv(rows, 32),), acc, acc if unit is None else unit, dq,
                         scale, nheads, seqlen_q, rows, *dq.stride()[:3], HEAD_DIM=d,
                         BLOCK_D=triton.next_power_of_2(d), BLOCK_R=32, FIXED=unit is not None,
                         **configs.pdl_options(dq.device))
