"""Attention backward for Hopper (sm90) written in Gluon (``triton.experimental.gluon``, triton 3.6).

In flashtile's dispatch: the warp-specialized one pass in fixed point (below), the keys as M in FA3's order, for
dense d = 128 calls from 2,048 tokens (causal or not) and d = 64 calls from 1,024 (2,048 causal;
``configs.gluon_backward_choice``), where on an H200 it ran 1.01-1.21x the Triton two passes at d = 64 (docs/tuning.md,
"Backward: the one pass"). The two Gluon passes are a
prototype: their gradients came out bitwise equal to the Triton backward's, at 0.77-0.95x of its speed in two runs.

The same three steps as the Triton backward (``backward.py``), with the same math:

1. ``backward._attn_bwd_preprocess`` (the Triton kernel itself): delta = rowsum(dO * O), and lse in log2
   units (+inf for a row that saw no key, so every P recomputed from it is exactly 0).
2. ``_gluon_bwd_dkdv``: one program per (key block of BLOCK_N rows, batch, KV head) holds its K and V tiles
   in shared memory and dK, dV in registers, and streams the (BLOCK_M-row Q tile, dO tile) pairs of every
   query head of its GQA group through a ring of STAGES shared-memory stages (TMA, one mbarrier per stage).
   Per pair: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (two wgmmas from shared memory), Pᵀ = exp2(Sᵀ·c - lse₂),
   dSᵀ = Pᵀ ∘ (dPᵀ - delta), then dV += Pᵀ dO and dK += dSᵀ Q (wgmmas with Pᵀ and dSᵀ from registers).
   dK is scaled by softmax_scale once at the end.
3. ``_gluon_bwd_dq``: one program per (BLOCK_M query rows, batch, head) holds Q and dO, streams K and V
   tiles: S = Q Kᵀ, dP = dO Vᵀ, P, dS = P ∘ (dP - delta), dQ += dS K.

The two passes take no atomics: each gradient element is written by one program, so the result is bitwise
reproducible. The one pass (below) adds dQ's shares by the copy engine's reductions, in an order that varies,
as integers: the same bits every run too, though not the two passes' bits.

``one_pass="atomic"`` or ``"fixed"`` runs no dQ pass, only step 2's kernel (``_one_pass_step``): per pair,
S = Q Kᵀ and dP = dO Vᵀ with the query rows as M, P and dS stored in shared memory for dV += Pᵀ dO, dK += dSᵀ Q
and dQ's share dS K, which goes to the copy engine's bulk reduction into an accumulator laid out as q
(``_add_dq``): float32 adds ("atomic": the sum's rounding depends on the order they land in), or int32 counts of
a per-row unit ("fixed": integer sums do not depend on the order, so the bits repeat; ``fixed_point_units``
bounds every partial sum under 2^30 units). ``warp_specialize=True`` adds a 1-warp producer partition loading
the (Q, dO) ring (``_dkdv_producer``; the kernel's warps run the steps with 240 registers, ``_dkdv_consumer``),
which load each step's row statistics a step ahead (``_pair_stats``) and address the stationary tiles anew
every step (``_stationary``: hoisted out of the loop, their wgmma descriptors spilled). Under a causal mask the
grid is 1-D: the first (longest) key blocks of a section of (batch, KV head) pairs start before any second one
(``configs.section_heads``). The fixed-point units and the last conversion to dQ are three small Triton kernels
in ``fixed_point`` (``_kv_maxima``; ``_row_units``, which also makes delta and lse₂ in place of step 1's kernel;
``_dq_from_counts``); by default the maxima come from sampled keys, each program checks its K and V against them
(``_flag_unbounded_keys``), and ``backward.dq_where_flagged`` makes dQ again for the KV heads whose check failed.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import configs, fixed_point
from .common import dropout_keep_groups
from .gluon_forward import (
    LOG2E,
    _await_prior_grids,
    _descriptor,
    _every_thread_asm,
    _free_stage,
    _kv_range,
    _named_barrier,
    _release,
    keys_kept,
    section_order,
)

# Registers a thread of the warp-specialized pass's 1-warp producer asks for (setmaxnreg): it issues TMA copies (and in
# FA3's order loads and stores each pair's row statistics: six values a thread); the consumer warps get the rest.
_PRODUCER_REGS = gl.constexpr(24)
_PRODUCER_WARPS = gl.constexpr(1)
# Fixed at import: by default the keys-as-M pass masks only the pairs whose keys pass seqlen_k or, causal, cross
# the diagonal (``_keys_m_probs``): the same values as masking every pair, and causal 1.03-1.04x the backward at
# d = 128 and 1.04-1.07x at d = 64 from 2,048 tokens (benchmarks/lab/env_ab.py, alternating processes); "0" masks
# every pair, for A/B runs.
_MASK_EDGES_ONLY = gl.constexpr(configs.env_switch("FLASHTILE_BWD_MASK_EDGES_ONLY", "1") == "1")
# Fixed at import: by default FA3's order waits for its dQ buffer's last reduction before the barrier that publishes
# dSᵀ, so that barrier also frees the buffer and the step's own barrier for it goes (four bar.sync a step instead of
# five): 1.001-1.012x the backward at d = 64 and 128, causal and not, same bits (benchmarks/lab/env_ab.py); "0" keeps
# the separate barrier, for A/B runs.
_DQ_WAIT_AT_DS = gl.constexpr(configs.env_switch("FLASHTILE_BWD_DQ_WAIT_AT_DS", "1") == "1")
# Fixed at import: by default FA3's order at d = 128 hands each ring stage back to the producer by a named barrier
# (``_named_barrier``: the consumer warps' bar.arrive, which does not wait, against the producer's bar.sync) instead
# of a CTA barrier and one thread's mbarrier arrival. Gluon puts a CTA barrier before any shared-memory access that
# follows an mbarrier arrival (its barrier pass takes the arrival for a write to all of shared memory: here the next
# ring wait), so this takes two of the step's four bar.sync away: 1.004-1.009x the backward at d = 128, same bits;
# at d = 64 0.990x without a mask, so not there (benchmarks/lab/env_ab.py). "0" keeps the mbarrier, for A/B runs.
_NAMED_RELEASE = gl.constexpr(configs.env_switch("FLASHTILE_BWD_NAMED_RELEASE", "1") == "1")
# Fixed at import: by default FA3's order at d = 128 (named releases, two dQ buffers) sends each step's dQ share
# after the next step's dSᵀ barrier instead of behind a CTA barrier of its own. Gluon's barrier pass cannot tell two
# buffers of one allocation apart, so the two dSᵀ and the two dQ buffers are allocations of their own and the loop
# runs two steps a turn, each on fixed buffers (``_keys_m_fa3_turn``): one bar.sync a step instead of two,
# 1.017-1.031x the backward at d = 128, same bits (benchmarks/lab/env_ab.py). "0" keeps the send's own barrier.
_DQ_SEND_LATE = gl.constexpr(configs.env_switch("FLASHTILE_BWD_DQ_SEND_LATE", "1") == "1")
# Fixed at import: by default the one pass in FA3's order without a causal mask splits the key blocks of its last,
# partial wave into pieces over query-tile ranges (``tail_plan``), whose float32 dK and dV a small kernel then sums in
# a fixed order (``_merge_tail_pieces``), so that the multiprocessors the partial wave leaves idle take a share of its
# work: 1.008-1.019x the backward at d = 128 from 4,096 to 16,384 tokens, 0.998-1.001x at d = 64 (an H100,
# benchmarks/lab/env_ab.py). "0" keeps every block whole, for A/B runs. (Host code: the choice reaches the kernel as
# its TAIL_SPLIT argument.)
TAIL_SPLIT = configs.env_switch("FLASHTILE_BWD_TAIL_SPLIT", "1") == "1"
# Fixed at import, lab switches for A/B runs (FA3's order without dropout, ``_keys_m_step_fa3``):
# FLASHTILE_BWD_DV_AT, where dV += Pᵀ dO is issued: "ds" (the default) once dSᵀ is computed, "wait" right after the
# wait for dPᵀ, "early" before that wait (``keys_as_m="fa3-early-dv"``'s order); FLASHTILE_BWD_DELTA_AHEAD=1: the
# pair's delta read from shared memory before the wait for dPᵀ instead of after it.
_DV_AT = gl.constexpr({"ds": 0, "early": 1, "wait": 2}[configs.env_switch("FLASHTILE_BWD_DV_AT", "ds",
                                                                         ("ds", "wait", "early"))])
_DELTA_AHEAD = gl.constexpr(configs.env_switch("FLASHTILE_BWD_DELTA_AHEAD", "0") == "1")
# The fixed-point units' K and V maxima from a sample of the keys, checked by the one pass
# (``fixed_point.SAMPLE_PARTS``; ``gluon_attention_backward``'s sampled_bound). FLASHTILE_BWD_SAMPLED_BOUND=0: from
# every key, read first.
SAMPLED_BOUND = configs.env_switch("FLASHTILE_BWD_SAMPLED_BOUND", "1") == "1"
# Named barriers of the CTA (16 in all): 0 is Gluon's thread_barrier, 1 its warp_specialize's; the release of
# ring stage s takes 2 + s. (Triton's warp_specialize also gives a worker partition of more than one warp barrier
# 2 + its index for its thread_barrier; the producer's one warp gets bar.warp.sync instead. A wider producer would
# collide with stage 0's release.)
_RELEASE_BARRIER0 = gl.constexpr(2)


@gluon.jit
def _issue_pair(desc_a, desc_b, smem_a, smem_b, bars, slot, batch, head, row, STAGES: gl.constexpr, pred):
    """TMA loads of one row tile of two tensors (Q and dO, or K and V) into ring stage ``slot % STAGES``,
    both signalling that stage's barrier."""
    stage = slot % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(desc_a, [batch, row, head, 0], bar, smem_a.index(stage), pred)
    tma.async_copy_global_to_shared(desc_b, [batch, row, head, 0], bar, smem_b.index(stage), pred)


@gluon.jit
def _issue_query_pair(q_desc, do_desc, q_smem, do_smem, bars, it, n_mt, m_lo, batch, kv_head, group, total,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """The dK/dV pass's iteration ``it`` (query head it // n_mt of the group, query tile m_lo + it % n_mt):
    its Q and dO tiles into stage it % STAGES, if it < total."""
    g = it // gl.maximum(n_mt, 1)
    m = m_lo + it % gl.maximum(n_mt, 1)
    _issue_pair(q_desc, do_desc, q_smem, do_smem, bars, it, batch, kv_head * group + g, m * BLOCK_M, STAGES,
                it < total)


@gluon.jit
def _pass_buffers(stay_a_desc, stay_b_desc, ring_a_desc, ring_b_desc, STAY_ROWS: gl.constexpr,
                  RING_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  RING_ARRIVALS: gl.constexpr = 1):
    """Shared memory of one pass: the program's two stationary tiles (K and V, or Q and dO: one stage and one
    barrier of their own, loaded once) and the ring of STAGES stages of the streamed tile pairs (a barrier
    each, completed by RING_ARRIVALS arrivals and the loads' bytes), the barriers initialised. Returns (stay_a,
    stay_b, ring_a, ring_b, stay_bar, ring_bars)."""
    dtype: gl.constexpr = stay_a_desc.dtype
    stay_a = gl.allocate_shared_memory(dtype, [1, 1, STAY_ROWS, 1, HEAD_DIM], stay_a_desc.layout)
    stay_b = gl.allocate_shared_memory(dtype, [1, 1, STAY_ROWS, 1, HEAD_DIM], stay_b_desc.layout)
    ring_a = gl.allocate_shared_memory(dtype, [STAGES, 1, RING_ROWS, 1, HEAD_DIM], ring_a_desc.layout)
    ring_b = gl.allocate_shared_memory(dtype, [STAGES, 1, RING_ROWS, 1, HEAD_DIM], ring_b_desc.layout)
    stay_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ring_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(stay_bar.index(0), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ring_bars.index(s), count=RING_ARRIVALS)
    fence_async_shared()
    return stay_a, stay_b, ring_a, ring_b, stay_bar, ring_bars


@gluon.jit
def _invalidate_barriers(stay_bar, ring_bars, STAGES: gl.constexpr):
    mbarrier.invalidate(stay_bar.index(0))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ring_bars.index(s))


@gluon.jit
def _row_stats(Lse2, Delta, rows, batch, nheads, head, seqlen_q, live=True):
    """lse₂ and delta of ``rows`` of a (batch, head), laid out as ``rows``; rows past seqlen_q (every row where
    ``live`` is False) read lse₂ = +inf (every P recomputed from it is 0) and delta = 0."""
    stats = (batch * nheads + head).to(gl.int64) * seqlen_q + rows
    kept = (rows < seqlen_q) & live
    lse2 = gl.load(Lse2 + stats, mask=kept, other=float("inf"))
    delta = gl.load(Delta + stats, mask=kept, other=0.0)
    return lse2, delta


@gluon.jit
def _issue_two_products(a, b, c, d, layout: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """a·bᵀ and c·dᵀ (the scores and dP of a pair, its operands in shared memory) issued into two fresh float32
    (ROWS, COLS) accumulators in ``layout``: two wgmma groups, in flight on return."""
    first = warpgroup_mma(a, b.permute((1, 0)), gl.zeros([ROWS, COLS], gl.float32, layout), use_acc=False,
                          is_async=True)
    second = warpgroup_mma(c, d.permute((1, 0)), gl.zeros([ROWS, COLS], gl.float32, layout), use_acc=False,
                           is_async=True)
    return first, second


@gluon.jit
def _two_products(a, b, c, d, layout: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """``_issue_two_products``, both completed on return."""
    first, second = _issue_two_products(a, b, c, d, layout, ROWS, COLS)
    return warpgroup_mma_wait(num_outstanding=0, deps=(first, second))


@gluon.jit
def _dkdv_stage(q_smem, do_smem, bars, it, m, head, Lse2, Delta, batch, nheads, seqlen_q, st_layout: gl.constexpr,
                BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Iteration ``it``'s (Q, dO) tiles once their stage has landed, and the rows' statistics: (Q, dO, rows,
    lse₂, delta); rows past seqlen_q read lse₂ = +inf (P = 0)."""
    stage = it % STAGES
    mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
    q_tile = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
    do_tile = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
    rows = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    lse2, delta = _row_stats(Lse2, Delta, rows, batch, nheads, head, seqlen_q)
    return q_tile, do_tile, rows, lse2, delta


@gluon.jit
def _dkdv_probs(st, lse2, rows, n_start, seqlen_q, seqlen_k, qk_scale, st_layout: gl.constexpr,
                BLOCK_N: gl.constexpr, MASKED: gl.constexpr):
    """Pᵀ of a (key block, query tile) pair from its completed Sᵀ."""
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    if MASKED:  # causal: key j of the block is seen by query i iff j <= i + seqlen_k - seqlen_q
        keys = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
        keep = gl.expand_dims(keys, 1) <= gl.expand_dims(rows + (seqlen_k - seqlen_q), 0)
        pt = gl.where(keep, pt, 0.0)
    return pt


@gluon.jit
def _dkdv_step(k_tile, v_tile, q_smem, do_smem, bars, dk, dv, it, m, head, Lse2, Delta, batch, nheads, n_start,
               seqlen_q, seqlen_k, qk_scale, st_layout: gl.constexpr, kv_layout: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    """One (query head, query tile) of a key block: dK and dV accumulated, every wgmma completed on return."""
    q_tile, do_tile, rows, lse2, delta = _dkdv_stage(q_smem, do_smem, bars, it, m, head, Lse2, Delta, batch, nheads,
                                                     seqlen_q, st_layout, BLOCK_M, HEAD_DIM, STAGES)

    st, dpt = _two_products(k_tile, q_tile, v_tile, do_tile, st_layout, BLOCK_N, BLOCK_M)

    pt = _dkdv_probs(st, lse2, rows, n_start, seqlen_q, seqlen_k, qk_scale, st_layout, BLOCK_N, MASKED)
    dst = pt * (dpt - gl.expand_dims(delta, 0))

    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    pt_op = gl.convert_layout(pt.to(q_tile.dtype), operand)
    dst_op = gl.convert_layout(dst.to(q_tile.dtype), operand)
    dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
    dv, dk, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt_op, dst_op))
    return dk, dv


@gluon.jit
def _landed_pair(q_smem, do_smem, bars, it, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Iteration ``it``'s (Q, dO) tiles, once their ring stage has landed."""
    stage = it % STAGES
    mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
    return q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM]), do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])


@gluon.jit
def _one_pass_probs(s, dp, m, lse2, delta, n_start, seqlen_q, seqlen_k, qk_scale, dtype: gl.constexpr,
                    s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """P and dS = P (dP - delta) of query tile m's pair from its completed S and dP, in the inputs' dtype."""
    rows = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    # Keys past seqlen_k are masked causal or not, as in the dQ pass: zero-filled, their S is 0 and P = 2^-lse2,
    # which the two passes' dK/dV rows drop but which here would reach dQ through dS K (as inf * 0 = NaN once
    # dS overflows).
    p = _dq_probs(s, n_start // BLOCK_N, lse2, rows, seqlen_q, seqlen_k, qk_scale, s_layout, BLOCK_N, CAUSAL, True)
    ds = p * (dp - gl.expand_dims(delta, 1))
    return p.to(dtype), ds.to(dtype)


@gluon.jit
def _stage_probs(p, ds, p_smem, ds_smem):
    """P and dS into shared memory for the pair's products, once every warpgroup's previous products have read
    the buffers."""
    gl.thread_barrier()
    p_smem.store(p)
    ds_smem.store(ds)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _one_pass_products(k_tile, q_tile, do_tile, p_smem, ds_smem, dk, dv, inv_unit, m, head, batch, dq_desc, dq_smem,
                       dq_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, DQ_MODE: gl.constexpr,
                       DQ_BUFFERS: gl.constexpr):
    """A pair's three products from its staged P and dS: dQ's share dS K handed to the copy engine (``_add_dq``;
    the reduction may still be in flight on return), dV += Pᵀ dO and dK += dSᵀ Q completed on return."""
    # dQ's share first: once it completes (wgmma groups complete in issue order), its conversion, store and bulk
    # reduction run while the tensor cores still compute dV and dK.
    dq = warpgroup_mma(ds_smem, k_tile, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout), use_acc=False,
                       is_async=True)
    dv = warpgroup_mma(p_smem.permute((1, 0)), do_tile, dv, is_async=True)
    dk = warpgroup_mma(ds_smem.permute((1, 0)), q_tile, dk, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq,))
    _add_dq(dq, dq_smem, dq_desc, inv_unit, m, head, batch, dq_layout, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    return dk, dv


@gluon.jit
def _one_pass_step(k_tile, v_tile, q_smem, do_smem, bars, dk, dv, it, m, head, lse2, delta, inv_unit, batch, n_start,
                   seqlen_q, seqlen_k, qk_scale, dq_desc, p_smem, ds_smem, dq_smem,
                   s_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                   DQ_BUFFERS: gl.constexpr):
    """One (query head, query tile) of a key block in the one pass: dK and dV accumulated and this pair's share
    of dQ, dS K, handed to the copy engine (``_add_dq``; the reduction may still be in flight on return); every
    wgmma completed on return.

    S = Q Kᵀ and dP = dO Vᵀ with the query rows as M (over one warpgroup's four warps) and the keys split over the
    warpgroups, so that a thread holds the statistics of two rows, not of a column each of the tile (as the
    two passes' Sᵀ = K Qᵀ does): what leaves the registers room for dK, dV and dQ's share at d = 128 with 64-row
    query tiles. P and dS go to shared memory, where dV += Pᵀ dO and dK += dSᵀ Q read them transposed as A
    operands and dQ's share dS K reads dS as it is (both warpgroups' keys). ``lse2``, ``delta``, ``inv_unit``: the
    pair's row statistics (``_pair_stats``), loaded a step ahead by the warp-specialized loop."""
    q_tile, do_tile = _landed_pair(q_smem, do_smem, bars, it, BLOCK_M, HEAD_DIM, STAGES)
    s, dp = _two_products(q_tile, k_tile, do_tile, v_tile, s_layout, BLOCK_M, BLOCK_N)
    p, ds = _one_pass_probs(s, dp, m, lse2, delta, n_start, seqlen_q, seqlen_k, qk_scale, q_tile.dtype, s_layout,
                            BLOCK_M, BLOCK_N, CAUSAL)
    _stage_probs(p, ds, p_smem, ds_smem)
    return _one_pass_products(k_tile, q_tile, do_tile, p_smem, ds_smem, dk, dv, inv_unit, m, head, batch, dq_desc,
                              dq_smem, dq_layout, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS)


@gluon.jit
def _one_pass_loop_pipelined(k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt, m_lo, head0,
                             Lse2, Delta, batch, nheads, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc, InvUnit,
                             p_smem, ds_smem, dq_smem, s_layout: gl.constexpr, dq_layout: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                             STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                             DQ_BUFFERS: gl.constexpr):
    """The warp-specialized one pass with the next pair's scores under this pair's products (``total`` >= 1).

    Each iteration enters with pair it's P and dS in registers and stages them. It issues dQ's share (dS K) and
    dK += dSᵀ Q; once dQ's share is done (wgmma groups complete in issue order) it is converted and stored to shared
    memory while the tensor cores run dK's product. Then the next pair's S and dP, and dV += Pᵀ dO, are issued, and
    only then is the share fenced and sent to the copy engine (d = 128 causal: sent before them, which measured
    faster there). Once S and dP are done, the next P and dS are computed while the tensor cores run dV's product.
    Part of the elementwise work that the plain loop runs between its products, with the tensor cores idle, runs
    beside them. (dV last, not the scores: with the next S and dP in flight beside dQ's share, ptxas runs out of
    registers at d = 128, spills and serializes the wgmmas.) The last pair takes the plain step's products.
    Returns (dK, dV)."""
    dtype: gl.constexpr = q_smem.dtype
    k_tile, v_tile, p_tile, ds_tile = _stationary(k_smem, v_smem, p_smem, ds_smem, 0, BLOCK_N, HEAD_DIM)
    lse2, delta, inv_unit = _pair_stats(Lse2, Delta, InvUnit, m_lo, head0, True, batch, nheads, seqlen_q, s_layout,
                                        dq_layout, BLOCK_M, DQ_MODE)
    q_tile, do_tile = _landed_pair(q_smem, do_smem, bars, 0, BLOCK_M, HEAD_DIM, STAGES)
    s, dp = _two_products(q_tile, k_tile, do_tile, v_tile, s_layout, BLOCK_M, BLOCK_N)
    p, ds = _one_pass_probs(s, dp, m_lo, lse2, delta, n_start, seqlen_q, seqlen_k, qk_scale, dtype, s_layout,
                            BLOCK_M, BLOCK_N, CAUSAL)
    for it in range(0, total - 1):
        k_tile, v_tile, p_tile, ds_tile = _stationary(k_smem, v_smem, p_smem, ds_smem, it, BLOCK_N, HEAD_DIM)
        m_next = m_lo + (it + 1) % n_mt
        lse2, delta, next_inv_unit = _pair_stats(Lse2, Delta, InvUnit, m_next, head0 + (it + 1) // n_mt, True, batch,
                                                 nheads, seqlen_q, s_layout, dq_layout, BLOCK_M, DQ_MODE)
        _stage_probs(p, ds, p_tile, ds_tile)
        stage = it % STAGES
        q_tile = q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do_tile = do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM])
        dq = warpgroup_mma(ds_tile, k_tile, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout), use_acc=False,
                           is_async=True)
        dk = warpgroup_mma(ds_tile.permute((1, 0)), q_tile, dk, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq,))
        dq_buffer = dq_smem.index(it % DQ_BUFFERS)
        # The next pair's S and dP (and dV's product) are issued between the store of dQ's share and its send, so
        # the send's fence and barrier wait beside them: 1.01-1.03x without a mask and at d = 64 on an H200, but
        # 0.97x at d = 128 causal, which keeps the send before them (benchmarks/lab/env_ab.py, tuning.md).
        SEND_LATE: gl.constexpr = (not CAUSAL) or HEAD_DIM < 128
        if SEND_LATE:
            _store_dq(dq, dq_buffer, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS, inv_unit)
        else:
            _add_dq(dq, dq_buffer, dq_desc, inv_unit, m_lo + it % n_mt, head0 + it // n_mt, batch, dq_layout, BLOCK_M,
                    HEAD_DIM, DQ_MODE, DQ_BUFFERS)
        q_next, do_next = _landed_pair(q_smem, do_smem, bars, it + 1, BLOCK_M, HEAD_DIM, STAGES)
        s, dp = _issue_two_products(q_next, k_tile, do_next, v_tile, s_layout, BLOCK_M, BLOCK_N)
        dv = warpgroup_mma(p_tile.permute((1, 0)), do_tile, dv, is_async=True)
        if SEND_LATE:
            _send_dq(dq_buffer, dq_desc, m_lo + it % n_mt, head0 + it // n_mt, batch, BLOCK_M)
        dk, s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(dk, s, dp))
        p, ds = _one_pass_probs(s, dp, m_next, lse2, delta, n_start, seqlen_q, seqlen_k, qk_scale, dtype, s_layout,
                                BLOCK_M, BLOCK_N, CAUSAL)
        dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
        _release(empty_bars, it, STAGES)
        inv_unit = next_inv_unit
    last = total - 1
    k_tile, v_tile, p_tile, ds_tile = _stationary(k_smem, v_smem, p_smem, ds_smem, last, BLOCK_N, HEAD_DIM)
    _stage_probs(p, ds, p_tile, ds_tile)
    stage = last % STAGES
    dk, dv = _one_pass_products(k_tile, q_smem.index(stage).reshape([BLOCK_M, HEAD_DIM]),
                                do_smem.index(stage).reshape([BLOCK_M, HEAD_DIM]), p_tile, ds_tile, dk, dv, inv_unit,
                                m_lo + last % n_mt, head0 + last // n_mt, batch, dq_desc,
                                dq_smem.index(last % DQ_BUFFERS), dq_layout, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS)
    _release(empty_bars, last, STAGES)
    return dk, dv


@gluon.jit
def _pair_stats(Lse2, Delta, InvUnit, m, head, live, batch, nheads, seqlen_q, s_layout: gl.constexpr,
                dq_layout: gl.constexpr, BLOCK_M: gl.constexpr, DQ_MODE: gl.constexpr, QUERY_DIM: gl.constexpr = 0):
    """The row statistics of a one-pass pair (query tile m of query head ``head``): lse₂ and delta laid out along
    ``s_layout``'s query dim (QUERY_DIM: 0, S's rows; 1, Sᵀ's columns, the keys-as-M step's), and (fixed point,
    DQ_MODE 2) 1 / unit as dQ's rows (else zeros), 0 past seqlen_q. ``live`` False (a step past the last) loads
    nothing."""
    rows = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1 - QUERY_DIM, s_layout))
    lse2, delta = _row_stats(Lse2, Delta, rows, batch, nheads, head, seqlen_q, live)
    if DQ_MODE == 2:
        dq_rows = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        inv_unit = gl.load(InvUnit + (batch * nheads + head).to(gl.int64) * seqlen_q + dq_rows,
                           mask=(dq_rows < seqlen_q) & live, other=0.0)
    else:
        inv_unit = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, dq_layout))
    return lse2, delta, inv_unit


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """The copy engine adds a shared-memory tile into global memory (``cp.reduce.async.bulk.tensor ... .add``),
    as ``tma.async_copy_shared_to_global`` stores one: triton 3.6's Gluon builds the operation but names no
    function for it. Completes like a TMA store (``tma.store_wait``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _add_dq(dq, dq_smem, dq_desc, inv_unit, m, head, batch, dq_layout: gl.constexpr,
            BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, DQ_MODE: gl.constexpr, DQ_BUFFERS: gl.constexpr,
            FREED: gl.constexpr = False):
    """Adds one key block's share of a query tile's dQ (float32 (BLOCK_M, HEAD_DIM) in ``dq_layout``) into the
    accumulator behind ``dq_desc`` ((batch, seqlen_q, heads, HEAD_DIM), contiguous): through ``dq_smem`` and a
    TMA bulk reduction, which drops the rows past seqlen_q. DQ_MODE 1: float32 adds, so the sum's rounding
    depends on the order the key blocks' adds land in. DQ_MODE 2: each value is first rounded to an int32
    count of its row's unit (``inv_unit``: 1 / unit of each row, ``_pair_stats``); integer addition does not depend on
    the order, so the result is bitwise reproducible (the unit keeps every partial sum under 2^30 units:
    ``fixed_point_units``). FREED: the caller waited for the buffer's last reduction before a CTA barrier."""
    _store_dq(dq, dq_smem, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS, inv_unit, FREED)
    _send_dq(dq_smem, dq_desc, m, head, batch, BLOCK_M)


@gluon.jit
def _bulk_reads_wait(PENDINGS: gl.constexpr):
    """This thread's bulk copies (the dQ reductions it issued) all but the last PENDINGS done reading shared memory:
    ``tma.store_wait`` without the CTA barrier that Gluon puts after it, for a caller whose next barrier follows."""
    _every_thread_asm(_bulk_wait_asm(PENDINGS), 0)


@triton.constexpr_function
def _bulk_wait_asm(pendings):
    return f"cp.async.bulk.wait_group.read {pendings};"


@gluon.jit
def _store_dq(dq, dq_smem, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, DQ_MODE: gl.constexpr,
              DQ_BUFFERS: gl.constexpr, inv_unit, FREED: gl.constexpr = False):
    """``_add_dq``'s first half: dQ's share (in fixed point, DQ_MODE 2) into ``dq_smem`` (FREED: known free)."""
    if DQ_MODE == 2:
        # One conversion instruction (cvt runs at a sixteenth of the FMA rate): round to nearest, not floor + cvt.
        dq = gl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [dq * gl.expand_dims(inv_unit, 1)],
                                       dtype=gl.int32, is_pure=True, pack=1)
    if not FREED:
        # The reduction that last used this buffer has read it (only the threads that issued it can wait for that).
        tma.store_wait(pendings=DQ_BUFFERS - 1)
        gl.thread_barrier()
    dq_smem.reshape([BLOCK_M, HEAD_DIM]).store(dq)


@gluon.jit
def _send_dq(dq_smem, dq_desc, m, head, batch, BLOCK_M: gl.constexpr):
    """``_add_dq``'s second half: once every thread's store landed, the copy engine's bulk reduction of
    ``dq_smem`` into the accumulator."""
    fence_async_shared()
    gl.thread_barrier()
    _tma_reduce_add(dq_desc, [batch, m * BLOCK_M, head, 0], dq_smem)


@gluon.jit
def _scores_beside_deferred(a, b, c, d, acc, op_prev, ring, it, layout: gl.constexpr, ROWS: gl.constexpr,
                            COLS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, FIRST: gl.constexpr):
    """The product issue of a pipelined step (both passes, their operands in mirrored roles): a·bᵀ, then (unless
    FIRST) the previous iteration's deferred product ``acc += op_prev · ring[it - 1]`` (``ring``: the stages of
    b, (COLS, HEAD_DIM) each), then c·dᵀ, the two fresh float32 (ROWS, COLS) accumulators in ``layout``; waits
    for a·bᵀ alone. Returns (a·bᵀ, acc and c·dᵀ still in flight)."""
    first = warpgroup_mma(a, b.permute((1, 0)), gl.zeros([ROWS, COLS], gl.float32, layout), use_acc=False,
                          is_async=True)
    if not FIRST:
        prev = (it - 1 + STAGES) % STAGES
        acc = warpgroup_mma(op_prev, ring.index(prev).reshape([COLS, HEAD_DIM]), acc, is_async=True)
    second = warpgroup_mma(c, d.permute((1, 0)), gl.zeros([ROWS, COLS], gl.float32, layout), use_acc=False,
                           is_async=True)
    first = warpgroup_mma_wait(num_outstanding=1 if FIRST else 2, deps=(first,))
    return first, acc, second


@gluon.jit
def _dkdv_step_pipelined(k_tile, v_tile, q_smem, do_smem, bars, dk, dv, dst_prev, it, m, head, Lse2, Delta, batch,
                         nheads, n_start, seqlen_q, seqlen_k, qk_scale, q_desc, do_desc, n_mt, m_lo, kv_head, group,
                         total, st_layout: gl.constexpr, kv_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                         FIRST: gl.constexpr):
    """One (query head, query tile) of a key block with the tensor cores kept busy through the elementwise work.

    On entry ``dst_prev`` holds dSᵀ of iteration it - 1, whose product dK += dSᵀ Q has not been issued yet
    (FIRST: iteration 0, none; ``dst_prev`` unused). The wgmma groups complete in issue order: Sᵀ of this
    tile, the deferred dK product, dPᵀ; Pᵀ is computed as soon as Sᵀ is done, under the other two; dV += Pᵀ dO
    is issued, and once the dK product and dPᵀ are done (stage it - 1 is then free: it is refilled; FIRST: the
    caller filled the stage the prologue left empty), dSᵀ is computed under the dV product. Returns (dK with
    this tile's product still owed, dV complete, dSᵀ of this tile as an operand)."""
    q_tile, do_tile, rows, lse2, delta = _dkdv_stage(q_smem, do_smem, bars, it, m, head, Lse2, Delta, batch, nheads,
                                                     seqlen_q, st_layout, BLOCK_M, HEAD_DIM, STAGES)

    st, dk, dpt = _scores_beside_deferred(k_tile, q_tile, v_tile, do_tile, dk, dst_prev, q_smem, it, st_layout,
                                          BLOCK_N, BLOCK_M, HEAD_DIM, STAGES, FIRST)

    pt = _dkdv_probs(st, lse2, rows, n_start, seqlen_q, seqlen_k, qk_scale, st_layout, BLOCK_N, MASKED)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    pt_op = gl.convert_layout(pt.to(q_tile.dtype), operand)
    dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    if FIRST:
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
    else:
        dk, dpt, dst_prev = warpgroup_mma_wait(num_outstanding=1, deps=(dk, dpt, dst_prev))
        # Stage it - 1 is free (its dV product completed last iteration, its dK product now): refill it.
        _issue_query_pair(q_desc, do_desc, q_smem, do_smem, bars, it - 1 + STAGES, n_mt, m_lo, batch, kv_head,
                          group, total, BLOCK_M, STAGES)

    dst_op = gl.convert_layout((pt * (dpt - gl.expand_dims(delta, 0))).to(q_tile.dtype), operand)
    dv, pt_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, pt_op))
    return dk, dv, dst_op


@gluon.jit
def _dkdv_producer(q_desc, do_desc, q_smem, do_smem, bars, empty_bars, n_mt, m_lo, batch, kv_head, group, total,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, stats_smem=None, Lse2=None, Delta=None, InvUnit=None,
                   nheads=0, seqlen_q=0, STATS: gl.constexpr = False, RELEASE_THREADS: gl.constexpr = 0):
    """Worker partition (1 warp) of the warp-specialized pass: the TMA loads of every (Q, dO) pair into the ring.
    The r-th refill of a stage (r >= 1) waits for the consumer's r-th release of it. STATS: the pair's rows of
    lse₂, delta and 1 / unit into the stage's ``stats_smem`` too (0 past seqlen_q), so that the consumer reads each
    statistic from shared memory where it uses it instead of holding it in registers across the step's products
    (FA3's LSE and dPsum). They are loaded to registers before the wait for the stage (their latency under it) and
    published by an arrival of their own on the stage's barrier (its second: the TMA loads' expect-arrival is
    the other), which the consumer's wait on it acquires; the consumer's release of the stage orders its reads
    before the next refill's stores. compute-sanitizer's racecheck reports these stores against the consumer's
    reads, as it does for a textbook two-stage ring (``benchmarks/lab/racecheck_control.py --ring``): it follows an
    mbarrier handoff's first phase, not a ring's repeated ones. RELEASE_THREADS (FA3's order at d = 128,
    ``_NAMED_RELEASE``): the releases are named barriers of that many threads, the consumer's and this warp's."""
    for it in range(0, total):
        if STATS:
            head = kv_head * group + it // gl.maximum(n_mt, 1)
            rows = (m_lo + it % gl.maximum(n_mt, 1)) * BLOCK_M + gl.arange(
                0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0]))
            offsets = (batch * nheads + head).to(gl.int64) * seqlen_q + rows
            kept = rows < seqlen_q
            lse2 = gl.load(Lse2 + offsets, mask=kept, other=0.0)
            delta = gl.load(Delta + offsets, mask=kept, other=0.0)
            inv_unit = gl.load(InvUnit + offsets, mask=kept, other=0.0)
        if RELEASE_THREADS:
            if it >= STAGES:
                _named_barrier(_RELEASE_BARRIER0 + it % STAGES, RELEASE_THREADS, False)
        else:
            mbarrier.wait(empty_bars.index(it % STAGES), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
        if STATS:
            stage = it % STAGES
            stats_smem.index(stage * 4).store(lse2)
            stats_smem.index(stage * 4 + 1).store(delta)
            stats_smem.index(stage * 4 + 2).store(inv_unit)
            gl.thread_barrier()  # every lane's rows stored before one thread's arrival publishes them
            mbarrier.arrive(bars.index(stage))
        _issue_query_pair(q_desc, do_desc, q_smem, do_smem, bars, it, n_mt, m_lo, batch, kv_head, group, total,
                          BLOCK_M, STAGES)


@gluon.jit
def _stationary(k_smem, v_smem, p_smem, ds_smem, it, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The one pass's tiles that stay in place, K, V, P and dS, addressed anew in iteration ``it``: each buffer's
    stage ``(it >> 30) & 1``, which is 0 in every iteration (the host keeps the count under 2^30) but which the
    compiler cannot prove constant. Addressed once, their wgmma descriptors (a 64-bit value per 16-deep k-step
    of each product: about 40 at d = 128) were hoisted out of the loop and held across it, and ptxas spilled
    them (204-228 bytes a thread at d = 128, warp-specialized), reloading them from local memory every step:
    the kernel's top stall under Nsight Compute. Made in the loop, they cost a few integer adds."""
    stage = (it >> 30) & 1
    k_tile = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    return k_tile, v_tile, p_smem.index(stage), ds_smem.index(stage)


@triton.constexpr_function
def _keys_m_mask_rule(block_m, causal, step_copies=True):
    """How the keys-as-M pass masks Pᵀ, ``_keys_m_probs``' MASK: 1 every pair; 2 the edge pairs only, a branch around
    the mask (``_keys_m_edge``); 3 the edge pairs only, a branch between two copies of FA3's step (``_keys_m_loop``;
    2 where the caller has no such copies, ``step_copies`` False). Edge pairs only by default (``_MASK_EDGES_ONLY``).
    With 128 query rows (d = 64) the branch around the mask made ptxas spill: without a causal mask (16 bytes a
    thread) it ran 0.97-0.98x masking every pair, so there every pair is masked; causal (24 bytes) the step's two
    copies spill nothing and ran 1.002-1.018x the branch around the mask."""
    if not _MASK_EDGES_ONLY:
        return 1
    if block_m > 64 and not causal:
        return 1
    return 3 if block_m > 64 and step_copies else 2


@gluon.jit
def _keys_m_edge(m, n_start, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Whether the keys-as-M pair (query tile m, keys from n_start) needs a mask: keys past seqlen_k or, causal,
    keys past its first row's diagonal."""
    edge = n_start + BLOCK_N > seqlen_k
    if CAUSAL:
        edge = edge | (n_start + BLOCK_N - 1 > m * BLOCK_M + (seqlen_k - seqlen_q))
    return edge


@gluon.jit
def _keys_m_probs(st, lse2, m, n_start, seqlen_q, seqlen_k, qk_scale, st_layout: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr):
    """Pᵀ of a keys-as-M pair (query tile m) from its completed Sᵀ and the tile's lse₂ (laid out as Sᵀ's columns).
    Keys past seqlen_k are zero-filled: their P would be 2^-lse2, not 0, and reach dQ through dS K, so they are
    masked causal or not. Only a pair with such keys or, causal, keys past its first row's diagonal needs the mask
    (causal about one pair in sixteen at 4,096 tokens, without a mask none where the length is a multiple of
    BLOCK_N), and the others can skip its compares and selects. MASK (``_keys_m_mask_rule``): 1 masks, 0 does not
    (the caller knows this pair's kind), 2 masks where ``_keys_m_edge`` says so."""
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
    if MASK == 1:
        pt = _keys_m_mask(pt, m, n_start, seqlen_q, seqlen_k, st_layout, BLOCK_M, BLOCK_N, CAUSAL)
    elif MASK == 2:
        if _keys_m_edge(m, n_start, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL):
            pt = _keys_m_mask(pt, m, n_start, seqlen_q, seqlen_k, st_layout, BLOCK_M, BLOCK_N, CAUSAL)
    return pt


@gluon.jit
def _keys_m_mask(pt, m, n_start, seqlen_q, seqlen_k, st_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Pᵀ with zeros for keys past seqlen_k and, causal, for keys past each query row's diagonal."""
    keys = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    keep = gl.expand_dims(keys, 1) < seqlen_k
    if CAUSAL:
        rows = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        keep = keep & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows + (seqlen_k - seqlen_q), 0))
    return gl.where(keep, pt, 0.0)


@gluon.jit
def _keys_m_step(k_tile, v_tile, q_smem, do_smem, bars, dk, dv, it, m, head, lse2, delta, inv_unit, batch, n_start,
                 seqlen_q, seqlen_k, qk_scale, dq_desc, dst_smem, dq_smem, st_layout: gl.constexpr,
                 kv_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                 DQ_BUFFERS: gl.constexpr):
    """One (query head, query tile) of a key block in the one pass with the keys as M (FA3's ``SdP_swapAB``):
    Sᵀ = K Qᵀ and dPᵀ = V dOᵀ with the block's keys over the two warpgroups (64 each) and the query tile as N,
    so that Pᵀ and dSᵀ come out in the rows dV += Pᵀ dO and dK += dSᵀ Q take as register operands: only dSᵀ goes
    to shared memory, for dQ's share dS K (dSᵀ read transposed as the A operand). Against the query rows as M
    (``_one_pass_step``): P's store and both products' reads of P and dS from shared memory are gone (48 KB of
    about 416 a step at d = 128); the statistics are per column, each thread holding 16 of the tile's 64.
    ``lse2``, ``delta``: the query tile's, laid out as Sᵀ's columns; ``inv_unit`` as dQ's rows. Every wgmma
    completed on return."""
    dtype: gl.constexpr = q_smem.dtype
    q_tile, do_tile = _landed_pair(q_smem, do_smem, bars, it, BLOCK_M, HEAD_DIM, STAGES)
    st, dpt = _two_products(k_tile, q_tile, v_tile, do_tile, st_layout, BLOCK_N, BLOCK_M)
    pt = _keys_m_probs(st, lse2, m, n_start, seqlen_q, seqlen_k, qk_scale, st_layout, BLOCK_M, BLOCK_N, CAUSAL,
                       _keys_m_mask_rule(BLOCK_M, CAUSAL, False))
    dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    pt_op = gl.convert_layout(pt.to(dtype), operand)
    dst_op = gl.convert_layout(dst, operand)
    gl.thread_barrier()  # the other warpgroup's dQ product of the pair before has read the buffer
    dst_smem.store(dst)
    fence_async_shared()
    gl.thread_barrier()
    dq = warpgroup_mma(dst_smem.permute((1, 0)), k_tile, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout),
                       use_acc=False, is_async=True)
    dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq,))
    _add_dq(dq, dq_smem, dq_desc, inv_unit, m, head, batch, dq_layout, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS)
    dv, dk, pt_op, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt_op, dst_op))
    return dk, dv


@gluon.jit
def _dropout_keep_t(seed, row_start, col_start, rng_stride, dropout_p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    layout: gl.constexpr):
    """Bool (BLOCK_N, BLOCK_M) in ``layout``: ``common.dropout_keep``'s keys-first tile, the same bits as the Triton
    kernels' (the tiles' groups with layouts left to Gluon, which lays them out as ``layout`` asks: no data moves)."""
    q_groups = row_start + gl.expand_dims(gl.arange(0, BLOCK_M // 16), 1) * 16 + gl.expand_dims(gl.arange(0, 8), 0)
    k_groups = col_start + gl.expand_dims(gl.arange(0, BLOCK_N // 16), 1) * 16 + gl.expand_dims(gl.arange(0, 8), 0)
    keep = dropout_keep_groups(seed, q_groups, k_groups, rng_stride, dropout_p, BLOCK_M, BLOCK_N, True)
    return gl.set_auto_layout(keep, layout)


@gluon.jit
def _keys_m_step_fa3(k_tile, v_tile, q_tile, do_tile, dk, dv, m, head, stats_smem, stats_row, batch, n_start,
                     seqlen_q, seqlen_k, qk_scale, dq_desc, dst_smem, dq_smem, st_layout: gl.constexpr,
                     kv_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                     EARLY_DV: gl.constexpr = False, MASK: gl.constexpr = 1, SEND_LATE: gl.constexpr = False,
                     prev_dq_smem=None, prev_m=0, prev_head=0, send_prev=False, seed=0, dropout_p=0.0,
                     DROPOUT: gl.constexpr = False):
    """``_keys_m_step`` in FA3's order (its sm90 ``bwd_step``): Sᵀ and dPᵀ issued together, Pᵀ computed while dPᵀ
    runs; dV += Pᵀ dO issued before dSᵀ is stored, so the tensor cores work through the store and its barrier;
    dSᵀ into this step's own buffer of two (``dst_smem``, taken by the step's parity: the other buffer is the one
    the step before read, so no barrier guards the store, one barrier publishes it); dQ's share and dK's product
    issued together, the share sent while dK's product runs. ``stats_smem`` rows ``stats_row`` to + 2: the pair's
    lse₂, delta and 1 / unit (BLOCK_M each) in shared memory, each read where it is used. EARLY_DV (a lab
    variant): dV's product issued as soon as Pᵀ is, before the wait for dPᵀ, so that it runs while dSᵀ is computed
    (wgmma groups complete in order: the wait for dPᵀ leaves dV's in flight). SEND_LATE (``_DQ_SEND_LATE``): this
    step's dQ share is stored, not sent; the step before's (``prev_dq_smem``, query tile ``prev_m`` of head
    ``prev_head``, if ``send_prev``) is sent once dSᵀ's barrier has passed, which orders every thread's store of it
    (fenced by this step's fence) before the copy engine reads it. DROPOUT: the forward's mask regenerated
    (``_dropout_keep_t``; ``seed``, the call's seed plus the batch's first counter, its first counter row times
    seqlen_k: one value live, not two): dV's product takes the kept Pᵀ (the survivors' 1 / (1 - p) applied to dV
    at the end), dSᵀ the kept dPᵀ / (1 - p)."""
    dtype: gl.constexpr = q_tile.dtype
    gl.static_assert(not SEND_LATE or _DQ_WAIT_AT_DS,
                     "a late send: the bulk wait before dSᵀ's barrier frees its buffer")
    st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout),
                       use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout),
                        use_acc=False, is_async=True)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
    lse2 = stats_smem.index(stats_row).load(gl.SliceLayout(0, st_layout))
    pt = _keys_m_probs(st, lse2, m, n_start, seqlen_q, seqlen_k, qk_scale, st_layout, BLOCK_M, BLOCK_N, CAUSAL,
                       MASK)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    # (Under dropout Pᵀ's operand is made after the wait below, with the mask, which then lives only briefly: made
    # here, the mask's bytes stayed live across the wait and spilled.)
    gl.static_assert(not (DROPOUT and EARLY_DV), "dropout: the FA3 order's default variant")
    # Where dV's product is issued (``_DV_AT``; EARLY_DV: 1): 0 after dSᵀ is computed, 1 before the wait for dPᵀ, 2
    # right after it. Dropout: 0 (its Pᵀ operand is made after the wait, with the mask). 1 from the switch only in the
    # late-send step with 64 query rows (d = 128's default): with 128 rows (d = 64) ptxas spilled 396 bytes, and 32
    # with the four barriers of every pair masked.
    if EARLY_DV:
        DV_AT: gl.constexpr = 1
    elif DROPOUT or (_DV_AT == 1 and (BLOCK_M > 64 or not SEND_LATE)):
        DV_AT: gl.constexpr = 0
    else:
        DV_AT: gl.constexpr = _DV_AT
    DELTA_AHEAD: gl.constexpr = _DELTA_AHEAD and not DROPOUT
    if not DROPOUT:
        pt_op = gl.convert_layout(pt.to(dtype), operand)
    if DELTA_AHEAD:  # (its shared-memory latency under dPᵀ's product)
        delta = stats_smem.index(stats_row + 1).load(gl.SliceLayout(0, st_layout))
    if DV_AT == 1:
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
    else:
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
    if DV_AT == 2:
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    if not DELTA_AHEAD:
        delta = stats_smem.index(stats_row + 1).load(gl.SliceLayout(0, st_layout))
    if DROPOUT:
        keep = _dropout_keep_t(seed, head.to(gl.int64) * seqlen_q + m * BLOCK_M, n_start, seqlen_k, dropout_p,
                               BLOCK_M, BLOCK_N, st_layout)
        pt_op = gl.convert_layout(gl.where(keep, pt, 0.0).to(dtype), operand)
        # dPᵀ of the kept entries / (1 - p): the scale fused with delta's subtraction
        dst = (pt * (gl.where(keep, dpt, 0.0) * (1.0 / (1.0 - dropout_p)) - gl.expand_dims(delta, 0))).to(dtype)
    else:
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
    if DV_AT == 0:
        dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    dst_op = gl.convert_layout(dst, operand)
    if _DQ_WAIT_AT_DS:
        # This step's dQ buffer was last reduced DQ_BUFFERS steps back, long since issued. Every thread runs the wait
        # (the reduction is issued by an elected lane of several warps, each tracking its own bulk groups; never
        # limit it to one thread), and the barrier below frees the buffer for all of them.
        # (SEND_LATE: this buffer's last reduction went out in the step before, the latest issued)
        _bulk_reads_wait(0 if SEND_LATE else DQ_BUFFERS - 1)
    dst_smem.store(dst)
    fence_async_shared()
    gl.thread_barrier()  # both warpgroups' keys of dSᵀ stored: dQ's share reads all of them
    if SEND_LATE:
        if send_prev:
            _tma_reduce_add(dq_desc, [batch, prev_m * BLOCK_M, prev_head, 0], prev_dq_smem)
    dq = warpgroup_mma(dst_smem.permute((1, 0)), k_tile, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout),
                       use_acc=False, is_async=True)
    dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
    dv, dq, pt_op = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq, pt_op))
    inv_unit = stats_smem.index(stats_row + 2).load(gl.SliceLayout(1, dq_layout))
    if SEND_LATE:
        _store_dq(dq, dq_smem, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS, inv_unit, True)
    else:
        _add_dq(dq, dq_smem, dq_desc, inv_unit, m, head, batch, dq_layout, BLOCK_M, HEAD_DIM, DQ_MODE, DQ_BUFFERS,
                _DQ_WAIT_AT_DS)
    dk, dst_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dst_op))
    return dk, dv


@gluon.jit
def _keys_m_fa3_turn(it, k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt, m_lo, head0, batch,
                     n_start, seqlen_q, seqlen_k, qk_scale, dq_desc, ds_buffer, dq_buffer, prev_dq_buffer, stats_smem,
                     st_layout: gl.constexpr, kv_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     DQ_MODE: gl.constexpr, DQ_BUFFERS: gl.constexpr, EARLY_DV: gl.constexpr, MASK: gl.constexpr,
                     RELEASE_THREADS: gl.constexpr, seed, dropout_p, DROPOUT: gl.constexpr):
    """Step ``it`` of FA3's order under ``_DQ_SEND_LATE`` on fixed buffers (``ds_buffer``, ``dq_buffer``; the step
    before's share sent from ``prev_dq_buffer``), its stage released after. Returns (dK, dV)."""
    # ``it`` through an opaque move: what derives from it is computed here, not hoisted into the step before
    it = gl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [it], dtype=gl.int32, is_pure=False, pack=1)
    k_tile, v_tile, _unused, _unused2 = _stationary(k_smem, v_smem, ds_buffer, ds_buffer, it, BLOCK_N, HEAD_DIM)
    q_tile, do_tile = _landed_pair(q_smem, do_smem, bars, it, BLOCK_M, HEAD_DIM, STAGES)
    prev = gl.maximum(it - 1, 0)
    stay = (it >> 30) & 1  # 0, but not to the compiler: the buffers addressed in the loop (``_stationary``)
    dk, dv = _keys_m_step_fa3(k_tile, v_tile, q_tile, do_tile, dk, dv, m_lo + it % n_mt, head0 + it // n_mt,
                              stats_smem, (it % STAGES) * 4, batch, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc,
                              ds_buffer.index(stay), dq_buffer.index(stay), st_layout, kv_layout, dq_layout, BLOCK_M,
                              BLOCK_N, HEAD_DIM, CAUSAL, DQ_MODE, DQ_BUFFERS, EARLY_DV, MASK, True,
                              prev_dq_buffer.index(stay), m_lo + prev % n_mt, head0 + prev // n_mt, it > 0, seed,
                              dropout_p, DROPOUT)
    _free_stage(empty_bars, it, total, _RELEASE_BARRIER0, STAGES, RELEASE_THREADS)
    return dk, dv


@gluon.jit
def _keys_m_loop(k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt, m_lo, head0, Lse2, Delta,
                 batch, nheads, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc, InvUnit, ds_smem, dq_smem,
                 st_layout: gl.constexpr, kv_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                 DQ_MODE: gl.constexpr, DQ_BUFFERS: gl.constexpr, FA3_ORDER: gl.constexpr = False, stats_smem=None,
                 EARLY_DV: gl.constexpr = False, RELEASE_THREADS: gl.constexpr = 0, ds_other=None, dq_other=None,
                 SEND_LATE: gl.constexpr = False, seed=0, dropout_p=0.0, DROPOUT: gl.constexpr = False):
    """The warp-specialized consumer's loop of ``_keys_m_step``s, each step's statistics loaded at the step.
    FA3_ORDER: ``_keys_m_step_fa3`` (EARLY_DV: its lab variant), dSᵀ in two buffers taken in turn. RELEASE_THREADS:
    each stage handed back by the named barrier the producer waits on (``_dkdv_producer``), but for the last STAGES,
    which the producer does not refill. SEND_LATE (``_DQ_SEND_LATE``; named releases, two dQ buffers): steps in turns
    of two, the even ones on ``ds_smem`` and ``dq_smem``, the odd ones on ``ds_other`` and ``dq_other`` (one buffer
    each), every dQ share sent in the step after its own. DROPOUT: FA3's order only. Returns (dK, dV)."""
    gl.static_assert(FA3_ORDER or not DROPOUT, "dropout: FA3's order only")
    # Rule 3 (``_keys_m_mask_rule``): the edge pairs take their own copy of the step. (A branch between steps once
    # gave wrong dK in the Triton-like loop of _gluon_bwd_dkdv, below; here every wgmma and dQ reduction of a step
    # is waited for or committed within it, and the gradients' bits equal those of the branch around the mask.)
    RULE: gl.constexpr = _keys_m_mask_rule(BLOCK_M, CAUSAL)
    STEP_BRANCH: gl.constexpr = RULE == 3
    UNMASKED: gl.constexpr = 0 if STEP_BRANCH else RULE  # the other pairs' MASK
    if SEND_LATE:
        gl.static_assert(FA3_ORDER and not STEP_BRANCH and RELEASE_THREADS > 0 and DQ_BUFFERS == 2 and _DQ_WAIT_AT_DS,
                         "late dQ sends: FA3's order, named releases, two dQ buffers, the bulk wait at dSᵀ's barrier, "
                         "one copy of the step")
        for turn in range(0, total // 2):
            dk, dv = _keys_m_fa3_turn(2 * turn, k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt,
                                      m_lo, head0, batch, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc, ds_smem,
                                      dq_smem, dq_other, stats_smem, st_layout, kv_layout, dq_layout, BLOCK_M, BLOCK_N,
                                      HEAD_DIM, STAGES, CAUSAL, DQ_MODE, DQ_BUFFERS, EARLY_DV, UNMASKED,
                                      RELEASE_THREADS, seed, dropout_p, DROPOUT)
            dk, dv = _keys_m_fa3_turn(2 * turn + 1, k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total,
                                      n_mt, m_lo, head0, batch, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc,
                                      ds_other, dq_other, dq_smem, stats_smem, st_layout, kv_layout, dq_layout, BLOCK_M,
                                      BLOCK_N, HEAD_DIM, STAGES, CAUSAL, DQ_MODE, DQ_BUFFERS, EARLY_DV, UNMASKED,
                                      RELEASE_THREADS, seed, dropout_p, DROPOUT)
        if total % 2 == 1:
            dk, dv = _keys_m_fa3_turn(total - 1, k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt,
                                      m_lo, head0, batch, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc, ds_smem,
                                      dq_smem, dq_other, stats_smem, st_layout, kv_layout, dq_layout, BLOCK_M, BLOCK_N,
                                      HEAD_DIM, STAGES, CAUSAL, DQ_MODE, DQ_BUFFERS, EARLY_DV, UNMASKED,
                                      RELEASE_THREADS, seed, dropout_p, DROPOUT)
        if total > 0:  # the last step's share
            last = total - 1
            if last % 2 == 0:
                _send_dq(dq_smem.index(0), dq_desc, m_lo + last % n_mt, head0 + last // n_mt, batch, BLOCK_M)
            else:
                _send_dq(dq_other.index(0), dq_desc, m_lo + last % n_mt, head0 + last // n_mt, batch, BLOCK_M)
    else:
        for it in range(0, total):
            k_tile, v_tile, dst_tile, _unused = _stationary(k_smem, v_smem, ds_smem, ds_smem, it, BLOCK_N, HEAD_DIM)
            if FA3_ORDER:
                q_tile, do_tile = _landed_pair(q_smem, do_smem, bars, it, BLOCK_M, HEAD_DIM, STAGES)
                m = m_lo + it % n_mt
                if STEP_BRANCH:  # (else a compile-time False: one copy of the step, deciding its mask itself)
                    edge = _keys_m_edge(m, n_start, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
                else:
                    edge = False
                if edge:
                    dk, dv = _keys_m_step_fa3(k_tile, v_tile, q_tile, do_tile, dk, dv, m, head0 + it // n_mt,
                                              stats_smem, (it % STAGES) * 4, batch, n_start, seqlen_q, seqlen_k,
                                              qk_scale, dq_desc, ds_smem.index(it & 1),
                                              dq_smem.index(it % DQ_BUFFERS), st_layout, kv_layout, dq_layout,
                                              BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DQ_MODE, DQ_BUFFERS, EARLY_DV,
                                              1, seed=seed, dropout_p=dropout_p, DROPOUT=DROPOUT)
                else:
                    dk, dv = _keys_m_step_fa3(k_tile, v_tile, q_tile, do_tile, dk, dv, m, head0 + it // n_mt,
                                              stats_smem, (it % STAGES) * 4, batch, n_start, seqlen_q, seqlen_k,
                                              qk_scale, dq_desc, ds_smem.index(it & 1),
                                              dq_smem.index(it % DQ_BUFFERS), st_layout, kv_layout, dq_layout,
                                              BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DQ_MODE, DQ_BUFFERS, EARLY_DV,
                                              UNMASKED, seed=seed, dropout_p=dropout_p,
                                              DROPOUT=DROPOUT)
            else:
                lse2, delta, inv_unit = _pair_stats(Lse2, Delta, InvUnit, m_lo + it % n_mt, head0 + it // n_mt, True,
                                                    batch, nheads, seqlen_q, st_layout, dq_layout, BLOCK_M, DQ_MODE, 1)
                dk, dv = _keys_m_step(k_tile, v_tile, q_smem, do_smem, bars, dk, dv, it, m_lo + it % n_mt,
                                      head0 + it // n_mt, lse2, delta, inv_unit, batch, n_start, seqlen_q, seqlen_k,
                                      qk_scale, dq_desc, dst_tile, dq_smem.index(it % DQ_BUFFERS), st_layout, kv_layout,
                                      dq_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, DQ_MODE, DQ_BUFFERS)
            _free_stage(empty_bars, it, total, _RELEASE_BARRIER0, STAGES, RELEASE_THREADS)
    return dk, dv


@gluon.jit
def _flag_unbounded_keys(k_tile, v_tile, bounds, Flag, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         NUM_WARPS: gl.constexpr):
    """Set ``Flag`` (its KV head's int32) if a key of the block passes the bounds its dQ units were made from
    (``fixed_point.setup_units``, sampled): bounds[0] >= |V_j| (the row's 2-norm) and bounds[1] >= |K_jc| for
    every key j and column c. NaN and inf fail, as do bounds that are not finite (rows that see no key of such a
    head still get a finite dQ from the flagged recomputation). k_tile, v_tile: (BLOCK_N, HEAD_DIM) in shared
    memory; 32 rows at a time, 16-byte reads."""
    ROWS: gl.constexpr = 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    v_bound = gl.load(bounds)
    k_bound = gl.load(bounds + 1)
    finite = (v_bound < float("inf")) & (k_bound < float("inf"))  # (NaN compares false)
    for r in gl.static_range(0, BLOCK_N, ROWS):
        k = k_tile.slice(r, ROWS).load(layout).to(gl.float32)
        v = v_tile.slice(r, ROWS).load(layout).to(gl.float32)
        k_inside = gl.min(gl.where(gl.abs(k) <= k_bound, 1, 0), axis=1) > 0
        inside = k_inside & (gl.sqrt(gl.sum(v * v, axis=1)) <= v_bound) & finite
        gl.store(Flag + gl.zeros([ROWS], gl.int32, row_layout), gl.full([ROWS], 1, gl.int32, row_layout),
                 mask=~inside)


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt, m_lo, head0, Lse2, Delta,
                   batch, nheads, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc, InvUnit, p_smem, ds_smem, dq_smem,
                   s_layout: gl.constexpr, dq_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_MODE: gl.constexpr,
                   DQ_BUFFERS: gl.constexpr, PIPELINED: gl.constexpr, KEYS_AS_M: gl.constexpr = 0,
                   st_layout: gl.constexpr = None, kv_layout: gl.constexpr = None, stats_smem=None,
                   EARLY_DV: gl.constexpr = False, RELEASE_THREADS: gl.constexpr = 0, ds_other=None, dq_other=None,
                   SEND_LATE: gl.constexpr = False, seed=0, dropout_p=0.0, DROPOUT: gl.constexpr = False,
                   kv_bar=None, bounds=None, Flag=None, CHECK: gl.constexpr = False, NUM_WARPS: gl.constexpr = 8):
    """Default partition of the warp-specialized pass (the kernel's warps, with the registers the producer
    leaves): the one-pass steps, each stage released once its products completed (PIPELINED: the next pair's
    scores under this pair's products, ``_one_pass_loop_pipelined``). It waits for K and V (``kv_bar``) itself, so
    that the producer's first (Q, dO) loads are in flight with them. CHECK: first, K and V against the bounds the
    dQ units assumed (``_flag_unbounded_keys``). (DROPOUT: K and V were waited for before the partitions.) Returns
    (dK, dV)."""
    if not DROPOUT:
        mbarrier.wait(kv_bar.index(0), 0)
    if CHECK:
        _flag_unbounded_keys(k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]), v_smem.index(0).reshape([BLOCK_N, HEAD_DIM]),
                             bounds, Flag, BLOCK_N, HEAD_DIM, NUM_WARPS)
    if KEYS_AS_M:
        dk, dv = _keys_m_loop(k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt, m_lo, head0, Lse2,
                              Delta, batch, nheads, n_start, seqlen_q, seqlen_k, qk_scale, dq_desc, InvUnit, ds_smem,
                              dq_smem, st_layout, kv_layout, dq_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                              DQ_MODE, DQ_BUFFERS, KEYS_AS_M == 2, stats_smem, EARLY_DV, RELEASE_THREADS, ds_other,
                              dq_other, SEND_LATE, seed, dropout_p, DROPOUT)
    elif PIPELINED:
        gl.static_assert(not DROPOUT, "dropout: the keys as M in FA3's order only")
        dk, dv = _one_pass_loop_pipelined(k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt, m_lo,
                                         head0, Lse2, Delta, batch, nheads, n_start, seqlen_q, seqlen_k, qk_scale,
                                         dq_desc, InvUnit, p_smem, ds_smem, dq_smem, s_layout, dq_layout, BLOCK_M,
                                         BLOCK_N, HEAD_DIM, STAGES, CAUSAL, DQ_MODE, DQ_BUFFERS)
    else:
        gl.static_assert(not DROPOUT, "dropout: the keys as M in FA3's order only")
        # Each step's row statistics are loaded during the step before (their global-memory latency, waited on at
        # the first use, was a tenth of the consumer's stalls under Nsight Compute).
        lse2, delta, inv_unit = _pair_stats(Lse2, Delta, InvUnit, m_lo, head0, total > 0, batch, nheads, seqlen_q,
                                            s_layout, dq_layout, BLOCK_M, DQ_MODE)
        for it in range(0, total):
            k_tile, v_tile, p_tile, ds_tile = _stationary(k_smem, v_smem, p_smem, ds_smem, it, BLOCK_N, HEAD_DIM)
            next_lse2, next_delta, next_inv_unit = _pair_stats(
                Lse2, Delta, InvUnit, m_lo + (it + 1) % n_mt, head0 + (it + 1) // n_mt, it + 1 < total, batch, nheads,
                seqlen_q, s_layout, dq_layout, BLOCK_M, DQ_MODE)
            dk, dv = _one_pass_step(k_tile, v_tile, q_smem, do_smem, bars, dk, dv, it, m_lo + it % n_mt,
                                    head0 + it // n_mt, lse2, delta, inv_unit, batch, n_start, seqlen_q, seqlen_k,
                                    qk_scale, dq_desc, p_tile, ds_tile, dq_smem.index(it % DQ_BUFFERS), s_layout,
                                    dq_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, DQ_MODE, DQ_BUFFERS)
            lse2, delta, inv_unit = next_lse2, next_delta, next_inv_unit
            _release(empty_bars, it, STAGES)
    return dk, dv


# (seed: random; n_whole, tail_parts: the split's plan, 0 and 1 without one: no compiled variant per value or
# divisibility class)
@gluon.jit(do_not_specialize=["seed", "n_whole", "tail_parts"])
def _gluon_bwd_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse2, Delta, seqlen_q, seqlen_k, nheads,
                    nheads_k, group, qk_scale, softmax_scale, dq_desc, InvUnit, bh_group, seed, dropout_p,
                    Pieces, n_whole, tail_parts, Bounds, Flag,
                    CAUSAL: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    NUM_WARPS: gl.constexpr, PIPELINED: gl.constexpr = False, DQ_MODE: gl.constexpr = 0,
                    WARP_SPECIALIZE: gl.constexpr = False, KEYS_AS_M: gl.constexpr = 0,
                    EARLY_DV: gl.constexpr = False, DQ_BUFFERS: gl.constexpr = 1, PDL: gl.constexpr = False,
                    DROPOUT: gl.constexpr = False, TAIL_SPLIT: gl.constexpr = False, CHECK: gl.constexpr = False):
    # DROPOUT (seed, dropout_p): the dense forward's mask regenerated, in the warp-specialized FA3 order only.
    # CHECK (warp-specialized, fixed point): the dQ units came from estimated bounds (Bounds, (batch * nheads_k, 2)
    # float32); the consumer checks its K and V against them and sets its (batch, KV head)'s Flag ((batch * nheads_k,)
    # int32) where they fail (``_flag_unbounded_keys``).
    # TAIL_SPLIT (without a causal mask; ``tail_plan``): a 1-D grid of the n_whole key blocks first, each whole, then
    # tail_parts pieces of each remaining block, piece j taking the j-th of tail_parts ranges of its query tiles and
    # writing its float32 dK, dV to ``Pieces`` (``_merge_tail_pieces`` sums them).
    gl.static_assert(not DROPOUT or (WARP_SPECIALIZE and KEYS_AS_M == 2), "dropout: the FA3 order's one pass")
    _await_prior_grids(PDL)  # (programmatic dependent launch: configs.pdl_options)
    if CAUSAL:
        # A 1-D grid in sections of bh_group (batch, KV head) pairs whose (Q, dO) stay in L2 together
        # (``configs.section_heads``): the first key blocks, which see the most query tiles, of all the section's
        # pairs go first, so the programs still running at the end are short ones. Head by head, a grid ended with
        # some heads' long blocks still running (about 5-11% of the kernel's time at 4-8k tokens by a greedy
        # schedule over 132 multiprocessors).
        n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
        pid_n, pid_bh = section_order(n_blocks, gl.num_programs(0) // n_blocks, bh_group)
        parts: gl.constexpr = 1  # (a whole key block: no piece)
    elif TAIL_SPLIT:
        n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
        pid = gl.program_id(0)
        piece = gl.maximum(pid - n_whole, 0)
        whole = pid < n_whole
        unit = gl.where(whole, pid, n_whole + piece // tail_parts)  # (key block, batch x KV head), blocks fastest
        part = gl.where(whole, 0, piece % tail_parts)
        parts = gl.where(whole, 1, tail_parts)
        pid_n = unit % n_blocks
        pid_bh = unit // n_blocks
    else:
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        parts: gl.constexpr = 1
    batch = pid_bh // nheads_k
    kv_head = pid_bh % nheads_k
    n_start = pid_n * BLOCK_N
    dtype: gl.constexpr = q_desc.dtype

    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    # One pass: S and dP with the query rows over one warpgroup's four warps and the keys over the warpgroups
    # (64 query rows are one warpgroup's M; 128, at d = 64, the layout twice over).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                       instr_shape=[16, BLOCK_N * 4 // NUM_WARPS, 16])
    # dQ's share (BLOCK_M, HEAD_DIM) = dS K: where the tile has a warp for every 16 query rows (128 rows, d = 64),
    # split by rows, so that each warpgroup reads its own half of dS from shared memory (BLOCK_M x BLOCK_N / 2),
    # not all of it for half the columns: 16 KB less shared-memory traffic a step, 1.03-1.10x the one pass's speed
    # (docs/tuning.md, "Backward: the one pass"). Else split by columns, like S.
    if BLOCK_M == 16 * NUM_WARPS:
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
    else:
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                            instr_shape=[16, HEAD_DIM * 4 // NUM_WARPS, 16])

    # K and V of the block stay; (Q, dO) pairs stream through the ring.
    # (FA3's order: the producer's arrival with each stage's statistics, beside the loads' expect-arrival)
    k_smem, v_smem, q_smem, do_smem, kv_bar, bars = _pass_buffers(k_desc, v_desc, q_desc, do_desc, BLOCK_N, BLOCK_M,
                                                                  HEAD_DIM, STAGES, 2 if KEYS_AS_M == 2 else 1)
    # (DQ_BUFFERS: dQ's share buffers, ``dkdv_shared_memory``'s choice)
    stats_smem = k_smem  # (unused but in FA3's order)
    # FA3's order at d = 128 (_NAMED_RELEASE): the stages' releases are named barriers of the consumer's warps and
    # the producer's.
    RELEASE_THREADS: gl.constexpr = (32 * (NUM_WARPS + _PRODUCER_WARPS)
                                     if _NAMED_RELEASE and WARP_SPECIALIZE and KEYS_AS_M == 2 and HEAD_DIM > 64 else 0)
    # _DQ_SEND_LATE where the stages are released so and two dQ buffers fit (the late send relies on the bulk wait
    # before dSᵀ's barrier, _DQ_WAIT_AT_DS, to free each dQ buffer, and on one copy of the step)
    SEND_LATE: gl.constexpr = (_DQ_SEND_LATE and _DQ_WAIT_AT_DS and RELEASE_THREADS > 0 and DQ_BUFFERS == 2
                               and _keys_m_mask_rule(BLOCK_M, CAUSAL) != 3)
    if KEYS_AS_M:  # dSᵀ of the current pair for dQ's share (Pᵀ and dSᵀ stay in registers for dV and dK)
        p_smem = k_smem  # unused
        # (KEYS_AS_M 2, FA3's order: two dSᵀ buffers taken in turn)
        DS_BUFFERS: gl.constexpr = 2 if KEYS_AS_M == 2 else 1
        # (SEND_LATE, FA3's order with named releases and two dQ buffers: each buffer an allocation of its own)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        if SEND_LATE:
            ds_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
            ds_other = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
            dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [1, 1, BLOCK_M, 1, HEAD_DIM], dq_desc.layout)
            dq_other = gl.allocate_shared_memory(dq_desc.dtype, [1, 1, BLOCK_M, 1, HEAD_DIM], dq_desc.layout)
        else:
            ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFFERS, BLOCK_N, BLOCK_M], ds_layout)
            dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [DQ_BUFFERS, 1, BLOCK_M, 1, HEAD_DIM], dq_desc.layout)
            ds_other = ds_smem
            dq_other = dq_smem
        # FA3's order: each ring stage's rows of lse₂, delta and 1 / unit (the producer's copies)
        if KEYS_AS_M == 2:
            stats_smem = gl.allocate_shared_memory(gl.float32, [STAGES * 4, BLOCK_M],  # (3 rows a stage used)
                                                   gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    elif DQ_MODE != 0:  # P and dS of the current pair for their products, and its dQ share on the way out
        p_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
        ds_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, BLOCK_N],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
        # Warp-specialized: two buffers, so a pair's share is written while the one before is still being added.
        dq_smem = gl.allocate_shared_memory(dq_desc.dtype, [DQ_BUFFERS, 1, BLOCK_M, 1, HEAD_DIM], dq_desc.layout)
        ds_other = ds_smem  # unused
        dq_other = dq_smem
    else:
        p_smem = k_smem  # unused
        ds_smem = k_smem
        dq_smem = k_smem
        ds_other = k_smem
        dq_other = k_smem

    _issue_pair(k_desc, v_desc, k_smem, v_smem, kv_bar, 0, batch, kv_head, n_start, 1, True)

    # Query tiles that see a key of this block: from m_lo (causal) to the last. Every query head of the group
    # streams the same tiles.
    n_m = gl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL:
        m_lo = gl.minimum(gl.maximum(n_start - (seqlen_k - seqlen_q), 0) // BLOCK_M, n_m)
        n_mt = n_m - m_lo
    elif TAIL_SPLIT:
        m_lo = part * n_m // parts
        n_mt = (part + 1) * n_m // parts - m_lo
    else:
        m_lo = 0
        n_mt = n_m - m_lo
    total = group * n_mt

    if not WARP_SPECIALIZE:  # prologue: the first STAGES - 1 (Q, dO) pairs in flight (else the producer's)
        for i in gl.static_range(STAGES - 1):
            _issue_query_pair(q_desc, do_desc, q_smem, do_smem, bars, i, n_mt, m_lo, batch, kv_head, group, total,
                              BLOCK_M, STAGES)

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    gl.static_assert(not CHECK or (WARP_SPECIALIZE and DQ_MODE == 2), "CHECK: the warp-specialized pass in fixed point")
    # Warp-specialized, the consumer partition waits, the producer's loads already in flight; but with dropout, where
    # that wait tipped the d = 128 consumer into spilling (12 bytes a thread against 8).
    if not WARP_SPECIALIZE or DROPOUT:
        mbarrier.wait(kv_bar.index(0), 0)
    k_tile = k_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.index(0).reshape([BLOCK_N, HEAD_DIM])
    if PIPELINED and not WARP_SPECIALIZE:
        gl.static_assert(DQ_MODE == 0, "the one pass pipelines its warp-specialized loop only")
        if total > 0:
            # Iteration 0 has no dK product to catch up on; the stage the prologue left empty is filled first
            # (iteration it >= 1 refills stage it - 1 once it is free).
            _issue_query_pair(q_desc, do_desc, q_smem, do_smem, bars, STAGES - 1, n_mt, m_lo, batch, kv_head, group,
                              total, BLOCK_M, STAGES)
            dk, dv, dst = _dkdv_step_pipelined(
                k_tile, v_tile, q_smem, do_smem, bars, dk, dv, 0, 0, m_lo, kv_head * group, Lse2, Delta, batch,
                nheads, n_start, seqlen_q, seqlen_k, qk_scale, q_desc, do_desc, n_mt, m_lo, kv_head, group, total,
                st_layout, kv_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, True)
            for it in range(1, total):
                dk, dv, dst = _dkdv_step_pipelined(
                    k_tile, v_tile, q_smem, do_smem, bars, dk, dv, dst, it, m_lo + it % n_mt,
                    kv_head * group + it // n_mt, Lse2, Delta, batch, nheads, n_start, seqlen_q, seqlen_k, qk_scale,
                    q_desc, do_desc, n_mt, m_lo, kv_head, group, total, st_layout, kv_layout, BLOCK_M, BLOCK_N,
                    HEAD_DIM, STAGES, CAUSAL, False)
            last = (total - 1) % STAGES
            dk = warpgroup_mma(dst, q_smem.index(last).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
            dk, dst = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dst))
    elif WARP_SPECIALIZE:
        gl.static_assert(DQ_MODE != 0, "the warp-specialized pass is the one-pass backward's")
        # A ring stage is free again once the consumer released it (one arrival after all its warps waited).
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(empty_bars.index(s), count=1)
        fence_async_shared()
        gl.static_assert(RELEASE_THREADS == 0 or (_PRODUCER_WARPS == 1 and _RELEASE_BARRIER0 + STAGES <= 16),
                         "named releases: a one-warp producer (no barrier of its own) and a barrier id per stage")
        dk, dv = gl.warp_specialize(
            [(_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, bars, empty_bars, dk, dv, total, n_mt, m_lo,
                               kv_head * group, Lse2, Delta, batch, nheads, n_start, seqlen_q, seqlen_k, qk_scale,
                               dq_desc, InvUnit, p_smem, ds_smem, dq_smem, s_layout, dq_layout, BLOCK_M, BLOCK_N,
                               HEAD_DIM, STAGES, CAUSAL, DQ_MODE, DQ_BUFFERS, PIPELINED, KEYS_AS_M, st_layout,
                               kv_layout, stats_smem, EARLY_DV, RELEASE_THREADS, ds_other, dq_other, SEND_LATE,
                               seed + batch.to(gl.int64) * nheads * seqlen_q * seqlen_k, dropout_p, DROPOUT,
                               kv_bar, Bounds + 2 * pid_bh, Flag + pid_bh, CHECK, NUM_WARPS)),
             (_dkdv_producer, (q_desc, do_desc, q_smem, do_smem, bars, empty_bars, n_mt, m_lo, batch, kv_head, group,
                               total, BLOCK_M, STAGES, stats_smem, Lse2, Delta, InvUnit, nheads, seqlen_q,
                               KEYS_AS_M == 2, RELEASE_THREADS))],
            [_PRODUCER_WARPS], [_PRODUCER_REGS])
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(empty_bars.index(s))
    else:
        for it in range(0, total):
            # Refill the stage iteration it - 1 used: its wgmmas completed (each step waits for all of its own).
            _issue_query_pair(q_desc, do_desc, q_smem, do_smem, bars, it + STAGES - 1, n_mt, m_lo, batch, kv_head,
                              group, total, BLOCK_M, STAGES)
            # Causal masks every tile, not only the diagonal band's. With a masked and an unmasked step chosen by
            # a branch in this loop, the H200 gave wrong dK, different from run to run, in exactly the causal
            # cases that took both steps (those with masked steps only passed); as two loops, one per step,
            # d = 128 spills (596 spill stores). The mask costs a compare and a select per element.
            if DQ_MODE == 0:
                dk, dv = _dkdv_step(k_tile, v_tile, q_smem, do_smem, bars, dk, dv, it, m_lo + it % n_mt,
                                    kv_head * group + it // n_mt, Lse2, Delta, batch, nheads, n_start, seqlen_q,
                                    seqlen_k, qk_scale, st_layout, kv_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                    CAUSAL, CAUSAL)
            elif KEYS_AS_M:
                k_it, v_it, dst_tile, _unused = _stationary(k_smem, v_smem, ds_smem, ds_smem, it, BLOCK_N, HEAD_DIM)
                lse2, delta, inv_unit = _pair_stats(Lse2, Delta, InvUnit, m_lo + it % n_mt,
                                                    kv_head * group + it // n_mt, True, batch, nheads, seqlen_q,
                                                    st_layout, dq_layout, BLOCK_M, DQ_MODE, 1)
                dk, dv = _keys_m_step(k_it, v_it, q_smem, do_smem, bars, dk, dv, it, m_lo + it % n_mt,
                                      kv_head * group + it // n_mt, lse2, delta, inv_unit, batch, n_start, seqlen_q,
                                      seqlen_k, qk_scale, dq_desc, dst_tile, dq_smem.index(it % DQ_BUFFERS),
                                      st_layout, kv_layout, dq_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                      DQ_MODE, DQ_BUFFERS)
            else:
                k_it, v_it, p_tile, ds_tile = _stationary(k_smem, v_smem, p_smem, ds_smem, it, BLOCK_N, HEAD_DIM)
                lse2, delta, inv_unit = _pair_stats(Lse2, Delta, InvUnit, m_lo + it % n_mt,
                                                    kv_head * group + it // n_mt, True, batch, nheads, seqlen_q,
                                                    s_layout, dq_layout, BLOCK_M, DQ_MODE)
                dk, dv = _one_pass_step(k_it, v_it, q_smem, do_smem, bars, dk, dv, it, m_lo + it % n_mt,
                                        kv_head * group + it // n_mt, lse2, delta, inv_unit, batch, n_start, seqlen_q,
                                        seqlen_k, qk_scale, dq_desc, p_tile, ds_tile, dq_smem.index(0),
                                        s_layout, dq_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, DQ_MODE,
                                        DQ_BUFFERS)

    _invalidate_barriers(kv_bar, bars, STAGES)
    dk = dk * softmax_scale
    if DROPOUT:
        dv = dv * (1.0 / (1.0 - dropout_p))  # the survivors' scale (``_keys_m_step_fa3``)
    if parts > 1:  # (a constexpr 1, so no branch, but for TAIL_SPLIT's pieces)
        _store_piece(Pieces, piece, dk, dv, kv_layout, BLOCK_N, HEAD_DIM)
    else:
        _store_dkdv(k_smem, v_smem, dk, dv, dk_desc, dv_desc, batch, n_start, kv_head)


@gluon.jit
def _store_dkdv(k_smem, v_smem, dk, dv, dk_desc, dv_desc, batch, n_start, kv_head):
    """A key block's dK and dV (float32, scaled), rounded to the inputs' dtype, through K's and V's buffers (free:
    every wgmma that read them completed) and TMA stores that drop the rows past seqlen_k."""
    dtype: gl.constexpr = k_smem.dtype
    k_smem.index(0).reshape(dk.shape).store(dk.to(dtype))
    v_smem.index(0).reshape(dv.shape).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [batch, n_start, kv_head, 0], k_smem.index(0))
    tma.async_copy_shared_to_global(dv_desc, [batch, n_start, kv_head, 0], v_smem.index(0))
    tma.store_wait(pendings=0)


@gluon.jit
def _store_piece(Pieces, piece, dk, dv, kv_layout: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A tail piece's float32 dK and dV (scaled) into ``Pieces`` (float32 (pieces, 2, BLOCK_N, HEAD_DIM)), all rows:
    ``_merge_tail_pieces`` drops those past seqlen_k."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    offsets = gl.expand_dims(rows, 1) * HEAD_DIM + gl.expand_dims(cols, 0)
    base = Pieces + piece.to(gl.int64) * (2 * BLOCK_N * HEAD_DIM)
    gl.store(base + offsets, dk)
    gl.store(base + BLOCK_N * HEAD_DIM + offsets, dv)


@gluon.jit
def _dq_probs(s, tile, lse2, rows, seqlen_q, seqlen_k, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
              CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    """P of a key tile of a query block from its completed S."""
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if MASKED:  # keys past seqlen_k (zero-filled: their P would not be 0) and, causal, right of the diagonal
        p = gl.where(keys_kept(rows, tile, seqlen_q, seqlen_k, s_layout, BLOCK_N, CAUSAL), p, 0.0)
    return p


@gluon.jit
def _dq_step(q_tile, do_tile, k_smem, v_smem, bars, dq, tile, lse2, delta, rows, seqlen_q, seqlen_k, qk_scale,
             s_layout: gl.constexpr, q_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr):
    """One key tile of a query block: dQ accumulated, every wgmma completed on return."""
    stage = tile % STAGES
    mbarrier.wait(bars.index(stage), (tile // STAGES) & 1)
    k_tile = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])

    s, dp = _two_products(q_tile, k_tile, do_tile, v_tile, s_layout, BLOCK_M, BLOCK_N)

    p = _dq_probs(s, tile, lse2, rows, seqlen_q, seqlen_k, qk_scale, s_layout, BLOCK_N, CAUSAL, MASKED)
    ds = p * (dp - gl.expand_dims(delta, 1))
    ds_op = gl.convert_layout(ds.to(q_tile.dtype), gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2))
    dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_op))
    return dq


@gluon.jit
def _dq_step_pipelined(q_tile, do_tile, k_smem, v_smem, bars, dq, ds_prev, tile, lse2, delta, rows, seqlen_q,
                       seqlen_k, qk_scale, k_desc, v_desc, batch, kv_head, n_tiles, s_layout: gl.constexpr,
                       q_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr, FIRST: gl.constexpr):
    """Key tile ``tile`` of a query block with the previous tile's dQ product issued beside this tile's S and dP
    (``ds_prev``: dS of ``tile`` - 1 as an operand; FIRST: tile 0, none, ``ds_prev`` unused). P is computed
    under the products in flight; once the dQ product and dP are done, stage ``tile`` - 1 is refilled (FIRST:
    the caller filled the stage the prologue left empty) and dS computed. Returns (dQ with this tile's product
    still owed, dS of this tile as an operand)."""
    stage = tile % STAGES
    mbarrier.wait(bars.index(stage), (tile // STAGES) & 1)
    k_tile = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    s, dq, dp = _scores_beside_deferred(q_tile, k_tile, do_tile, v_tile, dq, ds_prev, k_smem, tile, s_layout, BLOCK_M,
                                        BLOCK_N, HEAD_DIM, STAGES, FIRST)
    p = _dq_probs(s, tile, lse2, rows, seqlen_q, seqlen_k, qk_scale, s_layout, BLOCK_N, CAUSAL, MASKED)
    if FIRST:
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
    else:
        dq, dp, ds_prev = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dp, ds_prev))
        ahead = tile - 1 + STAGES
        _issue_pair(k_desc, v_desc, k_smem, v_smem, bars, ahead, batch, kv_head, ahead * BLOCK_N, STAGES,
                    ahead < n_tiles)
    ds = p * (dp - gl.expand_dims(delta, 1))
    return dq, gl.convert_layout(ds.to(q_tile.dtype),
                                 gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2))


@gluon.jit
def _gluon_bwd_dq(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse2, Delta, seqlen_q, seqlen_k, nheads, group, qk_scale,
                  softmax_scale, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                  PIPELINED: gl.constexpr = False, PDL: gl.constexpr = False):
    _await_prior_grids(PDL)  # (programmatic dependent launch: configs.pdl_options)
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m  # the longest rows (most key tiles) first
    pid_bh = gl.program_id(1)
    batch = pid_bh // nheads
    head = pid_bh % nheads
    kv_head = head // group
    start_m = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])

    # Q and dO of the block stay; (K, V) pairs stream through the ring.
    q_smem, do_smem, k_smem, v_smem, q_bar, bars = _pass_buffers(q_desc, do_desc, k_desc, v_desc, BLOCK_M, BLOCK_N,
                                                                 HEAD_DIM, STAGES)

    _issue_pair(q_desc, do_desc, q_smem, do_smem, q_bar, 0, batch, head, start_m, 1, True)

    full, n_tiles = _kv_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    for i in gl.static_range(STAGES - 1):
        _issue_pair(k_desc, v_desc, k_smem, v_smem, bars, i, batch, kv_head, i * BLOCK_N, STAGES, i < n_tiles)

    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    lse2, delta = _row_stats(Lse2, Delta, rows, batch, nheads, head, seqlen_q)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, q_layout)
    mbarrier.wait(q_bar.index(0), 0)
    q_tile = q_smem.index(0).reshape([BLOCK_M, HEAD_DIM])
    do_tile = do_smem.index(0).reshape([BLOCK_M, HEAD_DIM])
    if PIPELINED:
        if n_tiles > 0:
            # Tile 0 alone (its dQ product issued by tile 1 or the epilogue); the stage the prologue left empty
            # is filled first (tile t >= 1 refills stage t - 1 once it is free).
            _issue_pair(k_desc, v_desc, k_smem, v_smem, bars, STAGES - 1, batch, kv_head, (STAGES - 1) * BLOCK_N,
                        STAGES, STAGES - 1 < n_tiles)
            # (tile 0 masked: a mask that keeps every key changes nothing)
            dq, ds = _dq_step_pipelined(q_tile, do_tile, k_smem, v_smem, bars, dq, 0, 0, lse2, delta, rows, seqlen_q,
                                        seqlen_k, qk_scale, k_desc, v_desc, batch, kv_head, n_tiles, s_layout,
                                        q_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, True, True)
            for tile in range(1, full):
                dq, ds = _dq_step_pipelined(q_tile, do_tile, k_smem, v_smem, bars, dq, ds, tile, lse2, delta, rows,
                                            seqlen_q, seqlen_k, qk_scale, k_desc, v_desc, batch, kv_head, n_tiles,
                                            s_layout, q_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, False,
                                            False)
            for tile in range(gl.maximum(full, 1), n_tiles):
                dq, ds = _dq_step_pipelined(q_tile, do_tile, k_smem, v_smem, bars, dq, ds, tile, lse2, delta, rows,
                                            seqlen_q, seqlen_k, qk_scale, k_desc, v_desc, batch, kv_head, n_tiles,
                                            s_layout, q_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, True,
                                            False)
            last = (n_tiles - 1) % STAGES
            dq = warpgroup_mma(ds, k_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
            dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
    else:
        for tile in range(0, full):
            ahead = tile + STAGES - 1
            _issue_pair(k_desc, v_desc, k_smem, v_smem, bars, ahead, batch, kv_head, ahead * BLOCK_N, STAGES,
                        ahead < n_tiles)
            dq = _dq_step(q_tile, do_tile, k_smem, v_smem, bars, dq, tile, lse2, delta, rows, seqlen_q, seqlen_k,
                          qk_scale, s_layout, q_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, False)
        for tile in range(full, n_tiles):
            ahead = tile + STAGES - 1
            _issue_pair(k_desc, v_desc, k_smem, v_smem, bars, ahead, batch, kv_head, ahead * BLOCK_N, STAGES,
                        ahead < n_tiles)
            dq = _dq_step(q_tile, do_tile, k_smem, v_smem, bars, dq, tile, lse2, delta, rows, seqlen_q, seqlen_k,
                          qk_scale, s_layout, q_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, True)

    _invalidate_barriers(q_bar, bars, STAGES)
    q_tile.store((dq * softmax_scale).to(dtype))  # through Q's buffer: every wgmma that read it completed
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [batch, start_m, head, 0], q_smem.index(0))
    tma.store_wait(pendings=0)


# ---------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, STAGES, num_warps) of each pass per head dim. dK/dV: 128 keys a program over two
# warpgroups (64 key rows each), 64-row query tiles; dQ: 128 query rows, 64-key tiles. Shared memory at
# d = 128: dK/dV K + V 64 KiB + 2 stages x (Q 16 + dO 16) = 128 KiB; dQ Q + dO 64 KiB + 2 x (K 16 + V 16).
DKDV_TILES = {64: (64, 128, 2, 8), 128: (64, 128, 2, 8)}
DQ_TILES = {64: (128, 64, 2, 8), 128: (128, 64, 2, 8)}
# The pipelined dK/dV pass holds one more tile's operands: the largest tiles that compile for sm_90a without
# spills, causal or not (ptxas, through the stand-in driver: 196-225 registers at d = 64, 218-250 at d = 128
# with 32-row query tiles; 64-row ones spill 140-184 bytes at d = 128 causal). A third stage gives the refill,
# issued mid-step once a stage is free, a step and a half to land.
PIPELINED_DKDV_TILES = {64: (64, 128, 3, 8), 128: (32, 128, 3, 8)}
PIPELINED_DQ_TILES = {64: (128, 64, 3, 8), 128: (128, 64, 3, 8)}
# The one pass (``_one_pass_step``): query rows as M over one warpgroup's four warps (64 rows, or 128 at d = 64),
# 128 keys over two warpgroups. d = 64: 128 query rows a step, 1.02-1.05x the 64-row tile in the pipelined loop
# (2026-12-03, one_pass_bench.py), the dispatch's; the plain (not pipelined) warp-specialized loop spills with it
# (ptxas for sm_90a: 24-28 bytes with dQ's share split by columns, 48 causal and none without a mask split by rows),
# so its compile check takes 64 rows.
ONE_PASS_TILES = {64: (128, 128, 2, 8), 128: (64, 128, 2, 8)}
# The keys as M in FA3's order (``keys_as_m="fa3"``): 64-row query tiles at d = 128; 128 at d = 64, with one dQ buffer
# instead of two (``dkdv_shared_memory``), where on an H200 (2026-12-04, one_pass_bench.py, 16 heads) it ran
# 1.10-1.12x the 64-row tile without a mask and 1.08-1.10x causal at 4,096 and 16,384 tokens. (The plain order,
# ``keys_as_m=True``, takes ``ONE_PASS_TILES``.)
KEYS_AS_M_TILES = {64: (128, 128, 2, 8), 128: (64, 128, 2, 8)}
# With dropout: at d = 64, 128 query rows spilled 104 B a thread (the mask's hashes beside Pᵀ and dPᵀ), 64 none
# (compiled for sm_90a; at d = 128 4 B without a mask, 8 B causal).
KEYS_AS_M_DROPOUT_TILES = {64: (64, 128, 2, 8), 128: (64, 128, 2, 8)}
SM90_SHARED_BYTES = 227 * 1024  # a program's shared memory on sm90 (the opt-in maximum)


def tail_plan(units: int, multiprocessors: int, query_tiles: int, max_parts: int = 8) -> tuple[int, int]:
    """How the one pass without a causal mask splits its last wave: (whole units, parts per remaining unit).

    ``units`` programs of equal work (key blocks x batch x KV heads), one at a time on each of ``multiprocessors``:
    the last ``units % multiprocessors`` start alone and leave the other multiprocessors idle for a whole program's
    time. Splitting each of them into k pieces (ranges of its ``query_tiles``) ends the grid ceil(r k / P) / k of a
    program's time after the whole waves instead of 1. The smallest k within a tenth of the best, k <= max_parts,
    each piece at least two query tiles, the pieces at most two rounds (r k <= 2 P: their float32 dK and dV, 128 KiB
    a piece at d = 128, stay under 33 MiB on 132 multiprocessors); (units, 1) where no split gains a fifth of a
    program."""
    remainder = units % multiprocessors if multiprocessors > 0 else 0
    limit = min(max_parts, query_tiles // 2)
    if remainder == 0 or limit < 2:
        return units, 1
    ends = {k: math.ceil(remainder * k / multiprocessors) / k for k in range(1, limit + 1)
            if remainder * k <= 2 * multiprocessors}
    best = min(ends.values())
    parts = min(k for k, end in ends.items() if end <= best + 0.1)
    if parts == 1 or ends[1] - ends[parts] < 0.2 - 1e-9:
        return units, 1
    return units - remainder, parts


@triton.jit
def _merge_tail_pieces(Pieces, DK, DV, n_whole, parts, n_blocks, nheads_k, seqlen_k, stride_kb, stride_kn, stride_kh,
                       stride_vb, stride_vn, stride_vh, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                       ROWS: tl.constexpr):
    """dK and dV of the split key blocks (``tail_plan``): each the sum of its pieces' float32 values in piece order
    (the same bits every run), rounded to DK's dtype, rows past seqlen_k dropped. Grid: (split blocks, 2: dK then dV,
    BLOCK_N // ROWS)."""
    split = tl.program_id(0)
    which = tl.program_id(1)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HEAD_DIM)
    offsets = rows[:, None] * HEAD_DIM + cols[None, :]
    total = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for j in range(parts):
        base = ((split * parts + j).to(tl.int64) * 2 + which) * (BLOCK_N * HEAD_DIM)
        total += tl.load(Pieces + base + offsets)
    unit = n_whole + split
    batch = unit // n_blocks // nheads_k
    kv_head = unit // n_blocks % nheads_k
    keys = unit % n_blocks * BLOCK_N + rows
    keep = (keys < seqlen_k)[:, None]
    if which == 0:
        at = DK + batch.to(tl.int64) * stride_kb + keys[:, None].to(tl.int64) * stride_kn + kv_head * stride_kh
        tl.store(at + cols[None, :], total.to(DK.dtype.element_ty), mask=keep)
    else:
        at = DV + batch.to(tl.int64) * stride_vb + keys[:, None].to(tl.int64) * stride_vn + kv_head * stride_vh
        tl.store(at + cols[None, :], total.to(DV.dtype.element_ty), mask=keep)


def dkdv_shared_memory(block_m: int, block_n: int, stages: int, d: int, warp_specialize: bool,
                       keys_as_m: int) -> tuple[int, int]:
    """(shared memory bytes, dQ share buffers) of ``_gluon_bwd_dkdv`` at these tiles (16-bit inputs, head dim d;
    ``keys_as_m`` as its KEYS_AS_M: 0, 1, or 2 for FA3's order): K and V, the (Q, dO) ring, P and dS (FA3's order:
    two dSᵀ buffers), dQ's share buffers (float32; two warp-specialized or with the keys as M, else one) and, in
    FA3's order, each ring stage's rows of lse₂, delta and 1 / unit. Where two dQ buffers would pass
    ``SM90_SHARED_BYTES`` FA3's order keeps one (d = 64 with 128-row query tiles: 228 KiB with two): a share's
    store then waits for the bulk reduction of the one before, issued a step earlier."""
    fixed = 2 * block_n * d * 2 + stages * 2 * block_m * d * 2 + 2 * block_m * block_n * 2
    if keys_as_m == 2:
        fixed += stages * 4 * block_m * 4
    buffers = 2 if warp_specialize or keys_as_m else 1
    if keys_as_m == 2 and fixed + buffers * block_m * d * 4 > SM90_SHARED_BYTES:
        buffers = 1
    return fixed + buffers * block_m * d * 4, buffers


def gluon_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                             softmax_scale: float | None = None, *, dkdv_tiles: tuple | None = None,
                             dq_tiles: tuple | None = None, pipelined: bool = False,
                             overlap: bool = False, one_pass: str | None = None, warp_specialize: bool = False,
                             keys_as_m: bool | str = False, dropout_p: float = 0.0,
                             dropout_seed: int = 0, grads: tuple | None = None, split_sms: int | None = None,
                             sampled_bound: bool | None = None,
                             estimate_margin: float = fixed_point.ESTIMATE_MARGIN
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of dense BSHD attention through the Gluon sm90 kernels.

    dout, q, out: (batch, seqlen_q, heads, d); k, v: (batch, seqlen_k, heads_k, d); fp16/bf16, d in {64, 128};
    lse: float32 (batch, heads, seqlen_q), natural log, as flashtile's forward returns it. Tiles:
    (BLOCK_M, BLOCK_N, STAGES, num_warps) per pass (defaults ``DKDV_TILES[d]``, ``DQ_TILES[d]``).
    ``pipelined``: both passes keep their tensor cores busy through the elementwise work
    (``_dkdv_step_pipelined``, ``_dq_step_pipelined``; not yet run on a GPU; default tiles
    ``PIPELINED_DKDV_TILES[d]``, ``PIPELINED_DQ_TILES[d]``). ``overlap``: the dQ pass on a side stream beside
    the dK/dV pass (CUDA tensors). ``one_pass``: no dQ pass; the dK/dV pass adds each pair's dS K into a
    zeroed accumulator, "atomic" in float32 (the sum's rounding depends on the order the adds land in), "fixed"
    in int32 counts of a per-row unit (``fixed_point_units``; bitwise reproducible). ``keys_as_m`` (the one pass,
    not pipelined): True, the keys as M with Pᵀ and dSᵀ as register operands (``_keys_m_step``, a lab variant:
    0.89-0.95x the pipelined loop at d = 128 on an H200); "fa3", the same in FA3's order with the row statistics
    through shared memory (``_keys_m_step_fa3``; fixed point, warp-specialized; the dispatch's at d = 64 and 128,
    ``configs.GLUON_BACKWARD_KEYS_AS_M``); "fa3-early-dv", a lab variant of it (``_keys_m_step_fa3``'s EARLY_DV;
    on an H200 0.91-1.03x the FA3 order at d = 128, docs/tuning.md). ``dropout_p`` > 0 (``keys_as_m="fa3"`` only):
    the gradients of the dense forward that dropped with ``dropout_seed`` (``common.dropout_keep``). ``split_sms``
    (FA3's order without a causal mask): split the last wave of key blocks as ``tail_plan`` does for a GPU of that
    many multiprocessors (None: this one's, unless ``FLASHTILE_BWD_TAIL_SPLIT=0``; 0: none). ``sampled_bound``
    (the warp-specialized one pass in fixed point without dropout; None: ``SAMPLED_BOUND``): the units' K and V
    maxima guessed from a sample of the keys times ``estimate_margin`` (``fixed_point.SAMPLE_PARTS``), each program
    checking its keys against them, and dQ recomputed by the Triton dQ pass where one fails
    (``backward.dq_where_flagged``); else read from every key first. Gradients are contiguous, in q's dtype. Not
    public API yet."""
    from .backward import preprocess
    from .forward import placeholder

    batch, seqlen_q, nheads, d = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or any(t.dtype != q.dtype for t in (k, v, dout, out)):
        raise TypeError("fp16 or bf16 q, k, v, out, dout of one dtype")
    if d not in DKDV_TILES or k.shape[3] != d or v.shape != k.shape or dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"head dim 64 or 128 and matching shapes, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if nheads_k == 0 or nheads % nheads_k or k.shape[0] != batch or lse.shape != (batch, nheads, seqlen_q):
        raise ValueError(f"heads a multiple of kv heads, one batch size, lse (batch, heads, seqlen_q): q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, lse {tuple(lse.shape)}")
    if any(t.device != q.device for t in (k, v, out, dout, lse)):
        raise ValueError("q, k, v, out, dout and lse on one device")
    # The accumulator's rows (dK/dV: BLOCK_N keys; dQ: BLOCK_M queries) are 16 per warp.
    for tiles, acc_rows in ((dkdv_tiles, 1), (dq_tiles, 0)):
        if tiles is not None and (tiles[3] not in (4, 8) or tiles[1 - acc_rows] % 16
                                  or tiles[acc_rows] % (16 * tiles[3]) or tiles[2] < 1):
            raise ValueError(f"tile {tiles}: (BLOCK_M, BLOCK_N, STAGES, num_warps), 4 or 8 warps, the "
                             "accumulator's rows a multiple of 16 per warp, at least 1 stage")
        if tiles is not None and pipelined and tiles[2] < 2:
            # The deferred product reads the previous tile's stage while the next tile lands in another.
            raise ValueError(f"tile {tiles}: the pipelined passes need at least 2 stages")
    if warp_specialize and not one_pass:
        raise ValueError("warp_specialize: the one-pass backward's (one_pass='atomic' or 'fixed')")
    if one_pass not in (None, "atomic", "fixed") or (one_pass and (overlap or dq_tiles is not None)):
        raise ValueError(f"one_pass: None, 'atomic' or 'fixed', without overlap or dq_tiles (no dQ pass runs); got "
                         f"{one_pass!r}")
    fa3_order = keys_as_m in ("fa3", "fa3-early-dv")
    if (keys_as_m not in (False, True) and not fa3_order) or (keys_as_m and (not one_pass or pipelined)) or (
            fa3_order and (one_pass != "fixed" or not warp_specialize)):
        raise ValueError(f"keys_as_m: False, True, 'fa3' or 'fa3-early-dv' (FA3's order: fixed point, "
                         f"warp-specialized), the one pass's, not pipelined; got {keys_as_m!r}")
    if one_pass and pipelined and not warp_specialize:
        raise ValueError("pipelined with one_pass: the warp-specialized loop's (warp_specialize=True)")
    if dropout_p and keys_as_m != "fa3":
        raise ValueError(f"dropout_p: the one pass in FA3's order's (keys_as_m='fa3'), got keys_as_m={keys_as_m!r}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    keys_as_m_mode = 2 if fa3_order else int(keys_as_m)
    if one_pass and dkdv_tiles is not None:
        bm, bn, stages, warps = dkdv_tiles
        shared, _ = dkdv_shared_memory(bm, bn, stages, d, warp_specialize, keys_as_m_mode)
        if warps != 8 or bm % 64 or shared > SM90_SHARED_BYTES:
            raise ValueError(f"dkdv_tiles {dkdv_tiles} for the one pass: 8 warps (two warpgroups share the keys), "
                             f"BLOCK_M a multiple of 64 (the wgmma's rows), and at most 227 KiB of shared memory "
                             f"(this tile needs {shared / 1024:.0f} KiB at d = {d})")
    one_pass_tiles = dkdv_tiles or (KEYS_AS_M_DROPOUT_TILES if dropout_p else KEYS_AS_M_TILES if fa3_order
                                    else ONE_PASS_TILES)[d]
    if one_pass and (nheads // max(nheads_k, 1)) * triton.cdiv(seqlen_q, one_pass_tiles[0]) >= 2**30:
        # A program's step count (query heads of its group x query tiles) must stay under 2^30 (``_stationary``).
        raise ValueError(f"one_pass: seqlen_q {seqlen_q} x {nheads // nheads_k} query heads per kv head is too long")
    if max(batch * nheads, batch * nheads_k) > 65535:
        raise ValueError(f"batch x heads = {batch * nheads} exceeds the grid's second axis (65535)")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if grads is not None and all(configs._tma_ready(g) for g in grads):
        dq, dk, dv = grads  # written in place (``attention_backward``'s grads)
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if grads is not None:  # (strides no descriptor covers: computed apart, then copied in)
            result = gluon_attention_backward(
                dout, q, k, v, out, lse, causal, softmax_scale, dkdv_tiles=dkdv_tiles, dq_tiles=dq_tiles,
                pipelined=pipelined, overlap=overlap, one_pass=one_pass, warp_specialize=warp_specialize,
                keys_as_m=keys_as_m, dropout_p=dropout_p, dropout_seed=dropout_seed, split_sms=split_sms,
                sampled_bound=sampled_bound, estimate_margin=estimate_margin)
            for grad, made in zip(grads, result):
                grad.copy_(made)
            return grads
    if batch * nheads == 0 or seqlen_k == 0 or seqlen_q == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # A first call's five kernels compile side by side (configs.compile_together), then launch in order. Not with
    # the two passes' overlap, whose side stream waits on the main one as the launches are made. The key: what picks
    # the kernels' variants, integers by the classes Triton specializes them on (a multiple of 16, 1), so that a new
    # length of a known class launches as it goes. (Made for one-pass calls only: the two passes hold nothing.)
    if one_pass:
        classes = tuple((x % 16 == 0, x == 1) for x in (*q.shape, *k.shape, *q.stride(), *k.stride(), *v.stride(),
                                                         *dout.stride(), *out.stride()))
        held = configs.compile_together((classes, d, q.dtype, causal, dkdv_tiles and tuple(dkdv_tiles), pipelined,
                                         one_pass, warp_specialize, keys_as_m, dropout_p > 0, sampled_bound,
                                         estimate_margin, split_sms, grads is not None))
    else:
        held = contextlib.nullcontext()
    with held:
        q, k, v, dout = map(configs.tma_ready_or_copy, (q, k, v, dout))
        out = out if out.stride(-1) == 1 else out.contiguous()  # the preprocess reads rows with a unit last stride
        lse = lse.float().contiguous()

        qk_scale = softmax_scale * LOG2E
        group = nheads // nheads_k
        dq_mode = {None: 0, "atomic": 1, "fixed": 2}[one_pass]
        inv_unit = placeholder(torch.int32, q.device)
        # dQ's accumulator, laid out as q (a float32 or int32 twin of dq), zeroed: the one pass adds into it. In fixed
        # point the rows' kernel zeroes it (and makes delta and lse₂ with the units), so that the call is launches and
        # allocations only (a launch plan replays it).
        # (Not under dropout, whose d = 128 consumer already spills 8 bytes: the check is not built or measured there.)
        check = (dq_mode == 2 and warp_specialize and not dropout_p
                 and (SAMPLED_BOUND if sampled_bound is None else sampled_bound))
        bounds = flag = placeholder(torch.float32, q.device)
        if dq_mode == 2:
            dq_acc = torch.empty(q.shape, dtype=torch.int32, device=q.device)
            delta, lse2, unit, inv_unit, bounds, flag = fixed_point.setup_units(
                out, dout, lse, k, v, group, acc=dq_acc, dp_scale=1.0 / (1.0 - dropout_p), sampled=check,
                estimate_margin=estimate_margin)
        else:
            delta, lse2 = preprocess(out, dout, lse, placeholder(torch.int32, q.device), out.stride()[:3],
                                     dout.stride()[:3], lse.stride()[:2], batch, nheads, seqlen_q)
            if dq_mode == 1:
                dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def launch_dq():
            bm, bn, stages, warps = dq_tiles or (PIPELINED_DQ_TILES if pipelined else DQ_TILES)[d]
            configs.launch_plain(
                _gluon_bwd_dq, (triton.cdiv(seqlen_q, bm), batch * nheads),
                _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(dout, bm), _descriptor(dq, bm),
                lse2, delta, seqlen_q, seqlen_k, nheads, group, qk_scale, softmax_scale,
                CAUSAL=bool(causal), BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, STAGES=stages, NUM_WARPS=warps,
                PIPELINED=bool(pipelined), num_warps=warps, **configs.pdl_options(q.device))

        # overlap: the dQ pass on a side stream beside the dK/dV pass, as the Triton backward runs large calls
        # (joined back even if the dK/dV launch raises: its buffers must not return to the allocator early).
        main_stream = side = None
        if overlap and q.is_cuda:
            main_stream, side = torch.cuda.current_stream(q.device), configs.side_stream(q.device)
            if side.cuda_stream == main_stream.cuda_stream:
                side = None
            else:
                side.wait_stream(main_stream)
                with torch.cuda.stream(side):
                    launch_dq()
        try:
            bm, bn, stages, warps = one_pass_tiles if one_pass else dkdv_tiles or (
                PIPELINED_DKDV_TILES if pipelined else DKDV_TILES)[d]
            dk_desc = _descriptor(dk, bn)
            dq_desc = _descriptor(dq_acc, bm) if dq_mode else dk_desc  # (unused by the two passes)
            n_blocks = triton.cdiv(seqlen_k, bn)
            units, tail_parts, pieces = n_blocks * batch * nheads_k, 1, placeholder(torch.float32, q.device)
            if causal:  # longest key blocks first across a section of heads (the kernel's 1-D grid)
                bh_group = configs.section_heads(batch * nheads_k, 2 * group * seqlen_q * d * q.element_size())
                grid = (units,)
            else:
                bh_group, grid = 1, (n_blocks, batch * nheads_k)
                if fa3_order:
                    if split_sms is None:
                        split_sms = configs.multiprocessors(q.device.index) if TAIL_SPLIT and q.is_cuda else 0
                    n_whole, tail_parts = tail_plan(units, split_sms, triton.cdiv(seqlen_q, bm))
                    if tail_parts > 1:
                        grid = (n_whole + (units - n_whole) * tail_parts,)
                        pieces = torch.empty(((units - n_whole) * tail_parts, 2, bn, d), dtype=torch.float32,
                                             device=q.device)
            configs.launch_plain(
                _gluon_bwd_dkdv, grid,
                _descriptor(q, bm), _descriptor(k, bn), _descriptor(v, bn), _descriptor(dout, bm), dk_desc,
                _descriptor(dv, bn), lse2, delta, seqlen_q, seqlen_k, nheads, nheads_k, group, qk_scale, softmax_scale,
                dq_desc, inv_unit, bh_group, dropout_seed, float(dropout_p), pieces, 0 if tail_parts == 1 else n_whole,
                tail_parts, bounds, flag, CAUSAL=bool(causal), BLOCK_M=bm, BLOCK_N=bn,
                HEAD_DIM=d, STAGES=stages,
                NUM_WARPS=warps, PIPELINED=bool(pipelined), DQ_MODE=dq_mode, WARP_SPECIALIZE=bool(warp_specialize),
                KEYS_AS_M=keys_as_m_mode, EARLY_DV=keys_as_m == "fa3-early-dv",
                DQ_BUFFERS=dkdv_shared_memory(bm, bn, stages, d, warp_specialize, keys_as_m_mode)[1],
                DROPOUT=dropout_p > 0, TAIL_SPLIT=tail_parts > 1, CHECK=check, num_warps=warps,
                **configs.pdl_options(q.device))
            if tail_parts > 1:
                rows = 32
                configs.launch_plain(
                    _merge_tail_pieces, (units - n_whole, 2, bn // rows), pieces, dk, dv, n_whole, tail_parts, n_blocks,
                    nheads_k, seqlen_k, *dk.stride()[:3], *dv.stride()[:3], BLOCK_N=bn, HEAD_DIM=d, ROWS=rows,
                    num_warps=4)
        finally:
            if side is not None:
                main_stream.wait_stream(side)
        if dq_mode:
            # (float32 holds the counts to 2^-24 of themselves, finer than dq's own 16-bit rounding. A row whose unit
            # is not finite counted nothing, 1 / unit being 0 there, and comes out 0 * inf or 0 * NaN = NaN here, then
            # its own value from the flagged pass below.)
            fixed_point.dq_from_accumulator(dq_acc, unit if dq_mode == 2 else None, dq, softmax_scale)
            if dq_mode == 2:
                # Flagged KV heads (a key past the sampled bounds, whose counts may have wrapped; or a row whose unit is
                # not finite, which counted nothing): their query heads' dQ made again, each row its own value (a NaN
                # key's head no longer takes every row's dQ to NaN, only those of the rows that see it). The other
                # heads keep their counts' dQ.
                from .backward import dq_where_flagged

                dq_where_flagged(flag, dout, q, k, v, lse2, delta, dq, causal, softmax_scale, dropout_p, dropout_seed)
        elif side is None:
            launch_dq()
        return dq, dk, dv
