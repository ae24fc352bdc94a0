"""Attention forward for Hopper (sm90) written in Gluon (``triton.experimental.gluon``, triton 3.6).

On an sm90 GPU it is flashtile's forward of plain attention where ``configs.gluon_forward_choice`` admits the
call (d = 128 and 256 ``pingpong-fa3``, d = 64 ``single-ffma`` and from 4,096 tokens three consumers
(``pingpong3-fa3``, 192 query rows), d = 128 causal under 2,048 tokens ``single-ffma`` 128x64; dense calls from 512
or 1,024 tokens, packed ones (``gluon_attention_forward_varlen``) with long enough mean lengths);
``gluon_attention_forward`` also runs any variant and tile, for tests and benchmarks. The FP8 forward
(``gluon_attention_forward_fp8``) is the dispatch's for dense calls where ``configs.gluon_fp8_forward_choice`` admits
them (three consumers, ``pingpong3-fa3``, at d = 64 and 128; ``pingpong-fa3`` with 128-key tiles at d = 256).

One program owns BLOCK_M query rows of one (batch, head). Everything Hopper-specific is spelled out:

- Q, K, V and O move through TMA (``tma.async_copy_global_to_shared``) with 4-D descriptors made on the host
  over the dense (batch, seqlen, heads, head_dim) tensors, in (1, rows, 1, head_dim) boxes, so the copy engine
  zero-fills rows past a sequence's end and drops the stores of rows past seqlen_q.
- K and V tiles go through a ring of STAGES shared-memory stages, each with its own mbarrier per operand
  ("K of stage s has landed", "V of stage s has landed"), so that QKᵀ can start before V arrives.
- S = Q Kᵀ and O += P V are ``warpgroup_mma`` (wgmma); P goes to the second one from registers.
- Online softmax in fp32 registers, base 2: scores are scaled by softmax_scale·log2(e), exponentials are
  exp2, the running max m and sum l are per row; O is normalised once at the end and lse = (m + log2 l)·ln 2.
- Key tiles that need no mask (all keys < seqlen_k and, when causal, left of every row's diagonal) run in a
  mask-free loop; the rest (the diagonal band and the ragged last tile) in a masked one.

Variants (``VARIANTS``, the launcher's ``variant=``; constexprs WARP_SPECIALIZE, OVERLAP, CONSUMERS,
PINGPONG, and RAW_MAX, EARLY_K, LAG_RESCALE for the ``-ffma``/``-early``/``-lag``/``-fa3`` ones, described
at ``VARIANTS`` below):

- single: one partition. The program's own warps issue the TMA loads STAGES-1 tiles ahead of the tile they
  compute; a stage is reused only after the wgmmas that read it completed (each tile's wgmmas are waited on).
- ws: ``gl.warp_specialize`` with a 1-warp producer partition that only issues TMA loads into the ring,
  and the default partition (the kernel's warps) consuming: it waits on a stage's "full" barriers, runs
  the two wgmmas and the softmax, and arrives on the stage's "empty" barrier once both wgmmas completed.
- ws-overlap: as ws, with the consumer software-pipelined by one key tile (FA3's intra-warpgroup overlap):
  it issues S = Q Kᵀ of tile j and O += P V of tile j - 1 back to back, waits for the first only
  (``warpgroup_mma_wait(num_outstanding=1)``), runs tile j's softmax while the PV runs, then waits for it,
  releases stage j - 1 and rescales O. The consumer writes its own output.
- ws2: two overlapped consumer partitions of num_warps / 2 warps (one warpgroup each), each with its own
  BLOCK_M / 2 query rows (own Q buffer and barrier, own output), both reading every K/V stage (a stage's
  empty barrier counts two releases). Registers: setmaxnreg 240 for both consumers, 24 for the producer.
- pingpong: ws2, and the consumers take turns issuing their wgmmas (FA3's ping-pong): each waits on its
  own "turn" mbarrier before issuing, and arrives on the other's after, so that one's softmax runs while
  the other's wgmmas hold the tensor cores. pingpong3-fa3: three consumers in a ring (FP8; 16-bit at d = 64).

Schedules (``schedule=``, constexpr LPT): "grid", a 2-D grid (query block, batch·head), causal blocks in
decreasing length within each head; "lpt", a 1-D grid over groups of (batch, head) pairs whose K and V fit
in half of L2, each group walked query block by query block (longest first under causal) across its pairs.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import configs

LOG2E = math.log2(math.e)
LN2: gl.constexpr = gl.constexpr(math.log(2.0))
# Fixed at import (FLASHTILE_FWD_TREE_MAX, read by configs): where a row's max over a score tile is taken in a tree
# of halvings (``_row_max``, ``_tree_max``): "fp8" (the default) the FP8 forward with three consumers, "1" every
# forward, "0" none. A global constexpr that the kernels name, so that it enters their compile-cache key.
_TREE_MAX = gl.constexpr(configs.FWD_TREE_MAX)
# Fixed at import: by default the ping-pong consumers in FA3's order (``pingpong-fa3``) take turns and hand K and V
# stages back to the producer by named barriers (``_named_barrier``: bar.arrive, which does not wait, against
# bar.sync) instead of a barrier of the partition's warps and one thread's mbarrier arrival each. "0" keeps the
# mbarriers, for A/B runs (FLASHTILE_FWD_NAMED_SYNC, read by configs).
_NAMED_SYNC = gl.constexpr(configs.FWD_NAMED_SYNC)
# Fixed at import (FLASHTILE_FP8_P_REGISTERS, read by configs): how the FP8 forward with P V's P in registers
# (``P_REGS``) carries P from its softmax to the next step's P V: "carry" in float32, rounded at the issue; else
# rounded into its operand registers after the P V before completed (``_p_operand``).
_P_CARRY = gl.constexpr(configs.FP8_P_REGISTERS == "carry")
# Fixed at import (FLASHTILE_FWD_RESCALE_SKIP, read by configs): "0", "exact" or "1" (``_rescale``, ``_skip_threshold``)
_RESCALE_SKIP = gl.constexpr(configs.FWD_RESCALE_SKIP)
# Fixed at import (FLASHTILE_FWD_LANE_SUM): the overlapped consumers' row sums as a lane's partial sums (``_lane_tree``)
_LANE_SUM = gl.constexpr(configs.FWD_LANE_SUM == "1")
# Fixed at import (FLASHTILE_FWD_P_PAIRS): the 16-bit P operand rounded two keys a word by inline PTX (``_p_operand``)
_P_PAIRS = gl.constexpr(configs.FWD_P_PAIRS == "1")
# Fixed at import (FLASHTILE_FP8_EXP2_POLY): of each 8 of FP8's exponentials, how many a polynomial computes
_EXP2_POLY = gl.constexpr(int(configs.FP8_EXP2_POLY))
# Fixed at import (FLASHTILE_FP8_Q_REGISTERS): two FP8 consumers, or three at d = 64, keep their Q tile in registers
_Q_REGS = gl.constexpr(configs.FP8_Q_REGISTERS == "1")
# Four float32 ($1..$4, in key order) rounded to float8 e4m3 (saturating, as Triton's conversion) in one register $0,
# the first in its low byte.
# (key 2j + 1 in the high half: the first operand of cvt's pair goes there)
_CVT_PAIR = gl.constexpr(("cvt.rn.bf16x2.f32 $0, $2, $1;", "cvt.rn.f16x2.f32 $0, $2, $1;"))
_E4M3X4 = gl.constexpr("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                       "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
# Named barriers of the forward's CTA (16 in all): 0 is Gluon's thread_barrier (the first consumer's), 1 its
# warp_specialize's, 2 the second consumer's thread_barrier (a worker partition of more than one warp gets 2 + its
# index: 3 the third consumer's, if any; the next is left to the producer's index). Under _NAMED_SYNC, with C
# consumers, consumer w waits for its turn on C + 2 + w (``_turn_barrier0``), and stage s's K is released on
# 2C + 2 + s, its V on 2C + 2 + STAGES + s (``_free_barrier0``): 4 + w, 6 + s and 6 + STAGES + s for two consumers.


@triton.constexpr_function
def _turn_barrier0(consumers):
    return consumers + 2


@triton.constexpr_function
def _free_barrier0(consumers):
    return 2 * consumers + 2


@gluon.jit
def _every_thread_asm(ASM: gl.constexpr, value):
    """Inline assembly ``ASM`` ($1: the int32 ``value``) run by every thread of the calling warps (a one-element
    tensor that each thread holds), kept though its result is unused; Gluon's barrier pass does not see it."""
    token = gl.full([1], value, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    gl.inline_asm_elementwise(ASM + " mov.u32 $0, $1;", "=r,r", [token], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _named_barrier(barrier, THREADS: gl.constexpr, ARRIVE: gl.constexpr):
    """Named barrier ``barrier`` of THREADS threads (every thread of the calling warps takes part): ARRIVE marks
    them arrived without waiting (``bar.arrive``), else they wait for all THREADS (``bar.sync``)."""
    _every_thread_asm(_named_barrier_asm(ARRIVE, THREADS), barrier)


@gluon.jit
def _await_prior_grids(PDL: gl.constexpr):
    """Gluon's ``common.await_prior_grids``: under programmatic dependent launch, wait for the previous kernel on
    the stream to complete (its writes visible), then let the next such kernel launch; every thread of the
    calling warps, before any of them touches global memory. Nothing without PDL."""
    if PDL:
        _every_thread_asm("griddepcontrol.wait;", 0)
        _every_thread_asm("griddepcontrol.launch_dependents;", 0)


@triton.constexpr_function
def _named_barrier_asm(arrive, threads):
    return f"bar.{'arrive' if arrive else 'sync'} $1, {threads};"


@gluon.jit
def section_order(n_blocks, n_pairs, pairs_per_section):
    """(block, pair) of this program in a 1-D grid of ``n_blocks * n_pairs`` programs walked section by section
    (``pairs_per_section`` (batch, head) pairs, the last section possibly short), block by block within a section,
    pair by pair within a block: every pair of a section takes block b before any takes block b + 1. A section's
    pairs are few enough that what they stream stays in L2 together; under causal, where the blocks of one rank
    (the forward's last query blocks, the backward's first key blocks) are the longest, they start before any
    shorter ones (longest-processing-time first), instead of only those of one head."""
    pid = gl.program_id(0)
    first_pair = pid // (pairs_per_section * n_blocks) * pairs_per_section
    in_section = gl.minimum(pairs_per_section, n_pairs - first_pair)
    rest = pid - first_pair * n_blocks
    return rest // in_section, first_pair + rest % in_section


@gluon.jit
def _kv_range(start_m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(tiles without a mask, all key tiles) of the query rows [start_m, start_m + BLOCK_M).

    Causal is bottom-right aligned: row i sees key j iff j <= i + seqlen_k - seqlen_q."""
    if CAUSAL:
        shift = seqlen_k - seqlen_q
        hi = gl.minimum(start_m + BLOCK_M + shift, seqlen_k)
        hi = gl.maximum(hi, 0)
        # A tile [n, n + BLOCK_N) is seen whole by every row iff n + BLOCK_N - 1 <= start_m + shift.
        full = gl.maximum(start_m + shift + 1, 0) // BLOCK_N
        full = gl.minimum(full, seqlen_k // BLOCK_N)
    else:
        hi = seqlen_k
        full = seqlen_k // BLOCK_N
    n_tiles = (hi + BLOCK_N - 1) // BLOCK_N
    full = gl.minimum(full, n_tiles)
    return full, n_tiles


@gluon.jit
def _issue_tile(desc, smem, bars, tile, batch, kv_head, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, pred,
                KEYS_LAST: gl.constexpr = False, KEY_BLOCKS: gl.constexpr = False):
    """The TMA load of key tile ``tile`` of one operand (K or V) into its ring stage, signalling the stage's
    barrier of that operand.
    KEYS_LAST: the operand is laid out (batch, heads, head_dim, keys) (FP8's V, keys-fastest).
    KEY_BLOCKS: ``_permuted_k_descriptor``'s K; ``batch`` is then the sequence's first block of 16 keys and
    ``kv_head`` the head's first column."""
    stage = tile % STAGES
    mbarrier.expect(bars.index(stage), desc.block_type.nbytes, pred)
    if KEY_BLOCKS:
        tma.async_copy_global_to_shared(desc, [batch + tile * (BLOCK_N // 16), 0, 0, 0, kv_head], bars.index(stage),
                                        smem.index(stage), pred)
    elif KEYS_LAST:
        tma.async_copy_global_to_shared(desc, [batch, kv_head, 0, tile * BLOCK_N], bars.index(stage),
                                        smem.index(stage), pred)
    else:
        tma.async_copy_global_to_shared(desc, [batch, tile * BLOCK_N, kv_head, 0], bars.index(stage),
                                        smem.index(stage), pred)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, batch, kv_head,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, pred, V_KEYS_LAST: gl.constexpr = False):
    """TMA loads of key tile ``tile`` (K and V) into its ring stage, each signalling its stage's barrier."""
    _issue_tile(k_desc, k_smem, k_bars, tile, batch, kv_head, BLOCK_N, STAGES, pred)
    _issue_tile(v_desc, v_smem, v_bars, tile, batch, kv_head, BLOCK_N, STAGES, pred, V_KEYS_LAST)


@gluon.jit
def _key_of_column(cols, PERMUTED: gl.constexpr):
    """The key of its tile that column ``cols`` of a score tile holds. PERMUTED (K loaded by
    ``_permuted_k_descriptor``): within each 16 keys, column 8·g + 2·t + e holds key 4·t + 2·g + e."""
    if PERMUTED:
        return (cols & -16) | ((cols & 6) << 1) | ((cols >> 2) & 2) | (cols & 1)
    else:
        return cols


@gluon.jit
def keys_kept(rows, tile, seqlen_q, seqlen_k, s_layout: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
              PERMUTED: gl.constexpr = False):
    """Which keys of key tile ``tile`` each query row sees: those within seqlen_k and, ``CAUSAL``, left of or on
    the row's diagonal (bottom-right: key j iff j <= i + seqlen_k - seqlen_q). (rows, BLOCK_N) bool when causal,
    (1, BLOCK_N) otherwise. ``rows``: the rows' indices, in s_layout's dim-1 slice.

    In a wgmma accumulator layout a thread's columns are w·WARP_N + 8·g + 2·(lane % 4) + e (w its warp's block of
    WARP_N columns, the instruction's N). The part that is the same in all of a thread's registers moves to the
    limit, so each score meets a constant: (8·g + e) <= last(i) - thread part. The same test; compared as the
    column indices themselves, the compiler kept them in registers across the loop (32 a thread at 128 keys: a
    d = 64 128x128 causal forward program took 187 registers instead of 127, its multiprocessor alone).
    PERMUTED: the columns hold keys in ``_key_of_column``'s order, whose lane part is 4·(lane % 4)."""
    WARP_N: gl.constexpr = s_layout.instr_shape[1]
    cols = _key_of_column(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), PERMUTED)
    thread_cols = cols & ((12 if PERMUTED else 6) | -WARP_N)
    if CAUSAL:
        last = gl.minimum(rows + (seqlen_k - seqlen_q), seqlen_k - 1) - tile * BLOCK_N
        keep = gl.expand_dims(cols - thread_cols, 0) <= gl.expand_dims(last, 1) - gl.expand_dims(thread_cols, 0)
    else:
        keep = gl.expand_dims(cols - thread_cols <= seqlen_k - 1 - tile * BLOCK_N - thread_cols, 0)
    return keep


@triton.constexpr_function
def _tree_max(setting, fp8, consumers):
    """Whether a forward takes its row maxima in a tree (``_row_max``): ``setting`` (_TREE_MAX) "1" everywhere, "0"
    nowhere, "fp8" the FP8 forward with three consumers, where it measured 0.995-1.026x the chained reduction at
    d = 64 and 128 on an H100; the 16-bit forward ran 0.975-1.015x at d = 128 and 0.76x at d = 64 causal
    (benchmarks/RESULTS.md, "FP8")."""
    return setting == "1" or (setting == "fp8" and bool(fp8) and consumers == 3)


@gluon.jit
def _row_max(scores, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TREE: gl.constexpr):
    """Each row's max of a (BLOCK_M, BLOCK_N) fp32 tile, as ``gl.max(scores, 1)``, with the values a thread holds
    reduced in a tree. With TREE, for a wgmma accumulator's layout: its columns' top bits index a thread's
    registers, so each halving by the top bit pairs two registers of one thread (no data moves), and the
    exponentials can start after about 5 dependent max instructions instead of 31 (BLOCK_N = 128); the last four
    columns' bits are the lanes', which ``gl.max`` reduces by shuffles. Other layouts get the same values."""
    if TREE and BLOCK_N >= 16:
        x = _lane_tree(scores, BLOCK_M, BLOCK_N, False)
        return gl.convert_layout(gl.max(x, 1), gl.SliceLayout(1, scores.type.layout))
    else:
        return gl.max(scores, 1)


@gluon.jit
def _halve(x, SUM: gl.constexpr):
    if SUM:
        return gl.sum(x, 1)
    else:
        return gl.max(x, 1)


@gluon.jit
def _lane_tree(x, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SUM: gl.constexpr):
    """(BLOCK_M, 4): each row's max (SUM: sum) of the (BLOCK_M, BLOCK_N >= 16) wgmma-accumulator tile ``x`` over
    the columns of each lane of the row's quad, in a tree over the thread's own registers: each halving by the top
    column bit pairs two registers of one thread, no data moves and no shuffle (the last 4 columns' bits are the
    lanes')."""
    if BLOCK_N >= 256:
        x = _halve(gl.reshape(x, [BLOCK_M, 2, 128]), SUM)
    if BLOCK_N >= 128:
        x = _halve(gl.reshape(x, [BLOCK_M, 2, 64]), SUM)
    if BLOCK_N >= 64:
        x = _halve(gl.reshape(x, [BLOCK_M, 2, 32]), SUM)
    if BLOCK_N >= 32:
        x = _halve(gl.reshape(x, [BLOCK_M, 2, 16]), SUM)
    x = _halve(gl.reshape(x, [BLOCK_M, 2, 8]), SUM)
    x = gl.reshape(x, [BLOCK_M, 4, 2])
    if SUM:
        return gl.sum(x, 2)
    else:
        return gl.max(x, 2)


@triton.constexpr_function
def _skip_threshold(setting, p_log2):
    """How far (log2 units) a tile's row max may exceed the running max m before m moves to it (``_softmax_stats``);
    below 0: m always follows the max. Under setting "1": 8 for 16-bit P (P = exp2(s - m) then stays within 256,
    FA4's choice); 0.75 for FP8 (p_log2 != 0), whose P = exp2(s - m + p_log2) must stay within e4m3's 448:
    2^(8 + 0.75) = 431. A stale m changes nothing else: O and l carry the same m, and lse = m + log2(l)."""
    if setting != "1":
        return -1.0
    return 0.75 if p_log2 else 8.0


@triton.constexpr_function
def _skip_rescale_asm(n):
    """PTX of ``_rescale``'s skippable form over n (a multiple of 4) of a thread's O values, in the wgmma
    accumulator's register order (rows r, r, r + 8, r + 8, then the next 8 columns): $0..$n-1 = $n..$2n-1 times
    $2n..$3n-1 (alpha, broadcast along the row), unless no alpha of the warp's rows differs from 1, which
    ``vote.sync`` tells every thread alike, so the branch does not diverge and the warp issues no multiply."""
    moves = " ".join(f"mov.b32 ${i}, ${n + i};" for i in range(n))
    products = " ".join(f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    return (f"{{ .reg .pred %p; setp.neu.f32 %p, ${2 * n}, 0f3F800000; setp.neu.or.f32 %p, ${2 * n + 2}, "
            f"0f3F800000, %p; vote.sync.any.pred %p, %p, -1; {moves} @!%p bra.uni SKIP_${{:uid}}; {products} "
            f"SKIP_${{:uid}}: }}")


@triton.constexpr_function
def _asm_constraints(n, output, inputs):
    """Inline-asm constraints of n values a thread: n outputs of register kind ``output`` ("r" 32-bit, "f"
    float32), then n inputs of each kind in ``inputs``."""
    return ",".join([f"={output}"] * n + [kind for kind in inputs for _ in range(n)])


@triton.constexpr_function
def _exp2_split_asm(poly):
    """PTX of 2^x over 8 of a thread's values ($8..$15 in, $0..$7 out): the last ``poly`` by a polynomial on the FMA
    pipe, the others by MUFU's ex2.approx. The polynomial: x clamped to -126, rounded to the integer j by adding
    1.5 * 2^23 (j then sits in the sum's low mantissa bits), f = x - j in [-0.5, 0.5], 2^f by a cubic fitted for
    relative error (7.7e-5 at most, below bf16's rounding), and j added to its exponent field by an integer shift
    and add: 7 FMA-pipe and 2 integer instructions for one MUFU op, and x below -126 (a masked score's -inf
    among them) selected to exactly 0. (A clamp at -127 would take the exponent of 2^f < 1 below 0, into the sign
    bit: NaN; the clamp's own 2^-126 is not 0, and a row that saw no key must keep l = 0, or its O, 0 / l times
    v's descale, can overflow to 0 * inf.)"""
    lines = ["{ .reg .f32 t, r, f, q; .reg .b32 rb, qb; .reg .pred low;"]
    for i in range(8):
        if i < 8 - poly:
            lines.append(f"ex2.approx.ftz.f32 ${i}, ${8 + i};")
        else:
            lines.append(f"max.f32 t, ${8 + i}, 0fC2FC0000; add.rn.f32 r, t, 0f4B400000; "
                         f"sub.rn.f32 f, r, 0f4B400000; sub.rn.f32 f, t, f; "
                         f"fma.rn.f32 q, f, 0f3D61A4AC, 0f3E786D32; fma.rn.f32 q, q, f, 0f3F317A8D; "
                         f"fma.rn.f32 q, q, f, 0f3F7FFB58; mov.b32 rb, r; mov.b32 qb, q; shl.b32 rb, rb, 23; "
                         f"add.s32 qb, qb, rb; setp.lt.f32 low, ${8 + i}, 0fC2FC0000; selp.b32 ${i}, 0, qb, low;")
    lines.append("}")
    return " ".join(lines)


@gluon.jit
def _exp2_split(x, POLY: gl.constexpr):
    """gl.exp2(x) (float32, 8 or more values a thread), ``POLY`` of each 8 of a thread's values by a polynomial
    (``_exp2_split_asm``) so that MUFU issues fewer."""
    if POLY == 0:
        return gl.exp2(x)
    return gl.inline_asm_elementwise(_exp2_split_asm(POLY), _asm_constraints(8, "f", "f"), [x], dtype=gl.float32,
                                     is_pure=True, pack=8)


@gluon.jit
def _softmax_stats(qk, m_i, l_i, tile, start_m, seqlen_q, seqlen_k, qk_scale, s_layout: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                   RAW_MAX: gl.constexpr = False, P_LOG2: gl.constexpr = 0.0, TREE: gl.constexpr = False,
                   PERMUTED: gl.constexpr = False, LANE_SUM: gl.constexpr = False, POLY_EXP2: gl.constexpr = 0):
    """One key tile's online-softmax statistics: (P in fp32, alpha = the factor O must be rescaled by, m, l);
    m in log2 units. O itself is left alone, so that a caller whose PV wgmma is still in flight can rescale
    it after the wait. RAW_MAX (qk_scale > 0 only): the row max is taken over the unscaled scores and scaled
    once per row, so that each score costs one fused multiply-add (qk·scale - m) before its exp2 instead of a
    multiply and a subtract. P_LOG2: P is exp2(s - m + P_LOG2) (FP8's range, ``forward.FP8_P_LOG2``); l is
    summed in that scale, which the epilogue takes out of lse. PERMUTED: the columns hold keys in
    ``_key_of_column``'s order (the masks follow it; the row's max and sum do not depend on it). LANE_SUM: l is
    ``_lane_tree``'s (BLOCK_M, 4) partial sums."""
    if RAW_MAX:
        scores = qk
    else:
        scores = qk * qk_scale
    if MASKED:
        if CAUSAL:
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            keep = keys_kept(rows, tile, seqlen_q, seqlen_k, s_layout, BLOCK_N, True, PERMUTED)
        else:
            cols = tile * BLOCK_N + _key_of_column(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), PERMUTED)
            keep = gl.expand_dims(cols < seqlen_k, 0)
        scores = gl.where(keep, scores, float("-inf"))
    if RAW_MAX:
        m_tile = _row_max(scores, BLOCK_M, BLOCK_N, TREE) * qk_scale
    else:
        m_tile = _row_max(scores, BLOCK_M, BLOCK_N, TREE)
    SKIP_T: gl.constexpr = _skip_threshold(_RESCALE_SKIP, P_LOG2)
    if SKIP_T > 0:
        # (m = -inf, a row with no key yet, moves to any finite max: -inf + SKIP_T is -inf)
        m_new = gl.where(m_tile > m_i + SKIP_T, m_tile, m_i)
    else:
        m_new = gl.maximum(m_i, m_tile)
    if MASKED:
        # A row that has seen no key yet keeps m = -inf: subtract 0 there, not -inf (inf - inf = NaN).
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    if P_LOG2 != 0.0:
        m_exp = m_sub - P_LOG2
    else:
        m_exp = m_sub
    # (FP8 at d <= 128: _EXP2_POLY of each 8 exponentials by a polynomial, POLY_EXP2 passed by the FP8 callers)
    if RAW_MAX:
        p = _exp2_split(scores * qk_scale - gl.expand_dims(m_exp, 1), POLY_EXP2)
    else:
        p = _exp2_split(scores - gl.expand_dims(m_exp, 1), POLY_EXP2)
    alpha = gl.exp2(m_i - m_sub)
    if LANE_SUM:
        alpha_l = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))
        l_i = l_i * gl.expand_dims(alpha_l, 1) + _lane_tree(p, BLOCK_M, BLOCK_N, True)
    else:
        l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    """O (acc, (rows, head_dim) float32 in o_layout, a wgmma accumulator's) times each row's alpha. Under
    _RESCALE_SKIP ("exact", "1") a warp whose rows all have alpha = 1 skips its multiplies, a branch that
    ``vote.sync`` keeps uniform: the online softmax's max stops growing after a row's first tiles, and the
    rescale is a seventh of the FP8 loop's instructions."""
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    if _RESCALE_SKIP != "0":
        # (every value of a thread in one asm: 16 rows a warp, so a thread holds head_dim / 2)
        N: gl.constexpr = acc.shape[1] // 2
        gl.static_assert(o_layout.instr_shape[0] == 16 and o_layout.warps_per_cta[1] == 1, "16 rows a warp")
        alpha_b = gl.broadcast(gl.expand_dims(alpha_o, 1), acc)[0]
        return gl.inline_asm_elementwise(_skip_rescale_asm(N), _asm_constraints(N, "r", "rf"), [acc, alpha_b],
                                         dtype=gl.float32, is_pure=True, pack=N)
    return acc * gl.expand_dims(alpha_o, 1)


@gluon.jit
def _softmax_step(qk, acc, m_i, l_i, tile, start_m, seqlen_q, seqlen_k, qk_scale,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  CAUSAL: gl.constexpr, MASKED: gl.constexpr, RAW_MAX: gl.constexpr):
    """One key tile's online-softmax update: returns (P in fp32, acc rescaled, m, l); m in log2 units."""
    p, alpha, m_i, l_i = _softmax_stats(qk, m_i, l_i, tile, start_m, seqlen_q, seqlen_k, qk_scale, s_layout,
                                        BLOCK_M, BLOCK_N, CAUSAL, MASKED, RAW_MAX,
                                        TREE=_tree_max(_TREE_MAX, False, 2))
    return p, _rescale(acc, alpha, o_layout), m_i, l_i


@gluon.jit
def _consume_tile(q_tile, k_smem, v_smem, k_bars, v_bars, acc, m_i, l_i, tile, start_m, seqlen_q, seqlen_k,
                  qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  MASKED: gl.constexpr, RAW_MAX: gl.constexpr):
    """Wait for key tile ``tile`` in its stage, S = Q Kᵀ, softmax, O += P V; both wgmmas completed on return."""
    stage = tile % STAGES
    phase = (tile // STAGES) & 1
    k_tile = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])

    mbarrier.wait(k_bars.index(stage), phase)
    qk = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), qk, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))

    p, acc, m_i, l_i = _softmax_step(qk, acc, m_i, l_i, tile, start_m, seqlen_q, seqlen_k, qk_scale, s_layout,
                                     o_layout, BLOCK_M, BLOCK_N, CAUSAL, MASKED, RAW_MAX)
    p_op = gl.convert_layout(p.to(q_tile.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))

    mbarrier.wait(v_bars.index(stage), phase)
    acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, m_i, l_i


@gluon.jit
def _consumer_start(q_smem, q_bar, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                    HEAD_DIM: gl.constexpr):
    """A consumer's empty running state (O, m, l) and its Q tile, once Q has landed."""
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bar, 0)
    return acc, m_i, l_i, q_smem.reshape([BLOCK_M, HEAD_DIM])


@gluon.jit
def _single_partition(q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, k_desc, v_desc, batch, kv_head, full, n_tiles,
                      start_m, seqlen_q, seqlen_k, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, RAW_MAX: gl.constexpr):
    """The kernel's own warps load and compute: TMA loads run STAGES - 1 key tiles ahead of the wgmmas."""
    for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES - 1 key tiles in flight
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, batch, kv_head, BLOCK_N, STAGES, i < n_tiles)

    acc, m_i, l_i, q_tile = _consumer_start(q_smem, q_bar, s_layout, o_layout, BLOCK_M, HEAD_DIM)
    for tile in range(0, full):
        # Refill the stage tile - 1 used: its wgmmas completed in the previous iteration, and the compiler
        # puts a CTA barrier before each TMA issue, so no warpgroup still reads it.
        ahead = tile + STAGES - 1
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, ahead, batch, kv_head, BLOCK_N, STAGES,
                  ahead < n_tiles)
        acc, m_i, l_i = _consume_tile(q_tile, k_smem, v_smem, k_bars, v_bars, acc, m_i, l_i, tile, start_m,
                                      seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                                      STAGES, CAUSAL, False, RAW_MAX)
    for tile in range(full, n_tiles):
        ahead = tile + STAGES - 1
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, ahead, batch, kv_head, BLOCK_N, STAGES,
                  ahead < n_tiles)
        acc, m_i, l_i = _consume_tile(q_tile, k_smem, v_smem, k_bars, v_bars, acc, m_i, l_i, tile, start_m,
                                      seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                                      STAGES, CAUSAL, True, RAW_MAX)
    return acc, m_i, l_i


@gluon.jit
def _kv_descriptors(k_ptr, v_ptr, k_start, seqlen_k, nheads_k, stride_kt, stride_kh, stride_vt, stride_vh,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Packed sequences: K and V descriptors over this sequence's keys alone (made in the kernel, by the warps
    that then load through them: a made descriptor is fenced for its maker's own use), zero-filled past the
    sequence's end. A sequence without keys gets a 1-row one, never read."""
    elem: gl.constexpr = k_ptr.dtype.element_ty
    BOX: gl.constexpr = [1, BLOCK_N, 1, HEAD_DIM]
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(BOX, elem)
    rows = gl.maximum(seqlen_k, 1)
    k_desc = tma.make_tensor_descriptor(k_ptr + k_start.to(gl.int64) * stride_kt, [1, rows, nheads_k, HEAD_DIM],
                                        [stride_kt, stride_kt, stride_kh, 1], BOX, layout)
    v_desc = tma.make_tensor_descriptor(v_ptr + k_start.to(gl.int64) * stride_vt, [1, rows, nheads_k, HEAD_DIM],
                                        [stride_vt, stride_vt, stride_vh, 1], BOX, layout)
    return k_desc, v_desc


@gluon.jit
def _ws_producer(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty, batch, kv_head, n_tiles,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, EARLY_K: gl.constexpr,
                 V_KEYS_LAST: gl.constexpr = False, VARLEN: gl.constexpr = False, k_start=0, seqlen_k=0, nheads_k=0,
                 stride_kt=0, stride_kh=0, stride_vt=0, stride_vh=0, HEAD_DIM: gl.constexpr = 64,
                 NAMED: gl.constexpr = 0, CONSUMERS: gl.constexpr = 2, K_PERMUTED: gl.constexpr = False, k_block0=0,
                 k_col0=0):
    """Worker partition (1 warp): TMA loads of every key tile into the ring. The r-th refill of a stage
    (r >= 1) waits until the consumer released it for the r-th time (completion r - 1 of its empty barrier).
    EARLY_K: K and V of a stage are released apart (``k_empty``, ``empty_bars``), K as soon as S = Q Kᵀ
    completed, so the next K load need not wait for the PV of the tile before. VARLEN: k_desc and v_desc are
    the packed tensors' pointers; this partition makes the sequence's descriptors (``_kv_descriptors``).
    NAMED (``_NAMED_SYNC``, with EARLY_K): the releases are named barriers of that many threads, the consumers'
    and this warp's, instead of the empty barriers. K_PERMUTED: k_desc is ``_permuted_k_descriptor``'s, its
    tiles from block ``k_block0`` and column ``k_col0``."""
    if K_PERMUTED:
        k_batch, k_head = k_block0, k_col0
    else:
        k_batch, k_head = batch, kv_head
    if VARLEN:
        k_desc, v_desc = _kv_descriptors(k_desc, v_desc, k_start, seqlen_k, nheads_k, stride_kt, stride_kh, stride_vt,
                                         stride_vh, BLOCK_N, HEAD_DIM)
    for tile in range(0, n_tiles):
        stage = tile % STAGES
        phase = ((tile // STAGES) & 1) ^ 1
        if NAMED:
            if tile >= STAGES:
                _named_barrier(_free_barrier0(CONSUMERS) + stage, NAMED, False)
            _issue_tile(k_desc, k_smem, k_bars, tile, k_batch, k_head, BLOCK_N, STAGES, True, False, K_PERMUTED)
            if tile >= STAGES:
                _named_barrier(_free_barrier0(CONSUMERS) + STAGES + stage, NAMED, False)
            _issue_tile(v_desc, v_smem, v_bars, tile, batch, kv_head, BLOCK_N, STAGES, True, V_KEYS_LAST)
        elif EARLY_K:
            mbarrier.wait(k_empty.index(stage), phase, pred=tile >= STAGES)
            _issue_tile(k_desc, k_smem, k_bars, tile, k_batch, k_head, BLOCK_N, STAGES, True, False, K_PERMUTED)
            mbarrier.wait(empty_bars.index(stage), phase, pred=tile >= STAGES)
            _issue_tile(v_desc, v_smem, v_bars, tile, batch, kv_head, BLOCK_N, STAGES, True, V_KEYS_LAST)
        else:
            mbarrier.wait(empty_bars.index(stage), phase, pred=tile >= STAGES)
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, batch, kv_head, BLOCK_N, STAGES, True,
                      V_KEYS_LAST)


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empty_bars, full, n_tiles, start_m, seqlen_q,
                 seqlen_k, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """Default partition (the kernel's warps): wgmmas and softmax; releases each stage once both of its
    wgmmas completed. Returns (O unnormalised, m, l)."""
    acc, m_i, l_i, q_tile = _consumer_start(q_smem, q_bar, s_layout, o_layout, BLOCK_M, HEAD_DIM)
    for tile in range(0, full):
        acc, m_i, l_i = _consume_tile(q_tile, k_smem, v_smem, k_bars, v_bars, acc, m_i, l_i, tile, start_m,
                                      seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                                      STAGES, CAUSAL, False, False)
        _release(empty_bars, tile, STAGES)
    for tile in range(full, n_tiles):
        acc, m_i, l_i = _consume_tile(q_tile, k_smem, v_smem, k_bars, v_bars, acc, m_i, l_i, tile, start_m,
                                      seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM,
                                      STAGES, CAUSAL, True, False)
        _release(empty_bars, tile, STAGES)
    return acc, m_i, l_i


@gluon.jit
def _release(empty_bars, tile, STAGES: gl.constexpr):
    """Hand key tile ``tile``'s stage back to the producer: every warp of the partition has waited for its
    wgmmas (the CTA-wide barrier), then one arrival completes the stage's empty barrier (count 1)."""
    gl.thread_barrier()
    mbarrier.arrive(empty_bars.index(tile % STAGES))


@gluon.jit
def _free_stage(bars, tile, n_tiles, FIRST: gl.constexpr, STAGES: gl.constexpr, NAMED: gl.constexpr):
    """Hand ring stage ``tile % STAGES`` (of K or V, or the backward's Q and dO; FIRST: the named barrier of stage 0)
    back to the producer. NAMED (that many threads, the producer's with them): each thread's own arrival on the
    stage's named barrier, no barrier of the partition's warps (not for the last STAGES tiles, which the producer
    does not refill: every arrival has its producer's wait); else ``_release``'s barrier and mbarrier."""
    if NAMED:
        if tile + STAGES < n_tiles:
            _named_barrier(FIRST + tile % STAGES, NAMED, True)
    else:
        _release(bars, tile, STAGES)


@gluon.jit
def _issue_qk(q_tile, k_smem, k_bars, tile, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Wait for key tile ``tile``'s K and issue S = Q Kᵀ asynchronously (a wgmma accumulator token)."""
    stage = tile % STAGES
    mbarrier.wait(k_bars.index(stage), (tile // STAGES) & 1)
    k_tile = k_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    qk = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q_tile, k_tile.permute((1, 0)), qk, use_acc=False, is_async=True)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               FP8: gl.constexpr = False):
    """P (float32, in the S accumulator's layout) as P V's register operand in ``dtype``. FP8 (float8, K loaded
    by ``_permuted_k_descriptor``): of each 16 columns a thread holds 2·t + e and 8 + 2·t + e (t = lane % 4),
    the keys 4·t + e and 4·t + 2 + e, which are the 8-bit operand's columns of that thread: taken in key order
    the values stay in their threads, so the conversion moves no data between lanes and needs no shared memory."""
    if FP8:
        # In float32, where a change of a thread's register order only renames registers. Then (_P_CARRY) left
        # in float32 for _fp8_operand at the P V issue, or each 4 keys of a thread rounded into one int32, the
        # operand's register: Triton's own float8 tensors carried through the loop are split into bytes and
        # joined again (about 170 instructions a tile); an int32 that _fp8_operand unpacks next to the wgmma
        # folds into the rounding.
        p = _keys_in_order(p, o_layout, BLOCK_M, BLOCK_N)
        if not _P_CARRY:
            p = _e4m3_words(p, BLOCK_M, BLOCK_N)
        return p
    elif _P_PAIRS:
        # Each thread's keys 2j and 2j + 1 of a row (the accumulator's register pairs, the 16-bit operand's too) into
        # one word, ``_pair_operand`` taking it apart at the P V issue, which folds into that word.
        even, odd = gl.split(gl.reshape(p, [BLOCK_M, BLOCK_N // 2, 2]))
        return gl.inline_asm_elementwise(_CVT_PAIR[dtype == gl.float16], "=r,f,f", [even, odd], dtype=gl.int32,
                                         is_pure=True, pack=1)
    else:
        return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _pair_operand(words, dtype: gl.constexpr, acc):
    """``_p_operand``'s (rows, keys // 2) int32 words as the (rows, keys) 16-bit operand of P V into ``acc``."""
    low = (words & 65535).to(gl.int16)
    high = (words >> 16).to(gl.int16)
    x = gl.reshape(gl.join(low, high), [words.shape[0], words.shape[1] * 2]).to(dtype, bitcast=True)
    return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2))


@gluon.jit
def _keys_in_order(p, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A (BLOCK_M, BLOCK_N) float32 tile whose columns hold keys in ``_key_of_column``'s permuted order, in key order
    in the 8-bit operand's layout (k_width 4: a thread's 4 adjacent keys), which renames registers only."""
    p = gl.reshape(p, [BLOCK_M, BLOCK_N // 16, 2, 4, 2])
    p = gl.reshape(gl.permute(p, [0, 1, 3, 2, 4]), [BLOCK_M, BLOCK_N])
    return gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))


@gluon.jit
def _e4m3_words(p, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(BLOCK_M, BLOCK_N // 4) int32: float32 ``p``, each thread's 4 adjacent keys (in a layout that holds them so)
    rounded to e4m3 into one word, key 4j in its low byte (inline PTX: Triton's own float8 tensors carried through
    the loop are split into bytes and joined again)."""
    a, b = gl.split(gl.reshape(p, [BLOCK_M, BLOCK_N // 4, 2, 2]))
    x0, x2 = gl.split(a)
    x1, x3 = gl.split(b)
    return gl.inline_asm_elementwise(_E4M3X4, "=r,r,r,r,r", [x0, x1, x2, x3], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _fp8_operand(p, acc):
    """``_p_operand``'s FP8 P as the float8 operand of P V into ``acc``: float32 rounded, each 4 keys of a thread
    into one register; or int32 (rounded already) unpacked, which the compiler folds back into those registers."""
    if p.dtype == gl.float32:
        return gl.inline_asm_elementwise(_E4M3X4, "=r,r,r,r,r", [p], dtype=gl.float8e4nv, is_pure=True, pack=4)
    else:
        b0 = (p & 255).to(gl.int8)
        b1 = ((p >> 8) & 255).to(gl.int8)
        b2 = ((p >> 16) & 255).to(gl.int8)
        b3 = ((p >> 24) & 255).to(gl.int8)
        x = gl.permute(gl.join(gl.join(b0, b1), gl.join(b2, b3)), [0, 1, 3, 2])  # (row, key // 4, key % 4)
        x = gl.reshape(x, [x.shape[0], x.shape[1] * 4]).to(gl.float8e4nv, bitcast=True)
        return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=4))


@gluon.jit
def _issue_pv(p_op, v_smem, v_bars, acc, tile, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, FP8: gl.constexpr = False):
    """Wait for key tile ``tile``'s V and issue O += P V asynchronously (P from registers). FP8: V's tile is
    (head_dim, keys) in shared memory, which FP8 wgmma wants (both operands contiguous along the keys)."""
    stage = tile % STAGES
    mbarrier.wait(v_bars.index(stage), (tile // STAGES) & 1)
    if FP8:
        if p_op.dtype != gl.float8e4nv:  # (in registers: _p_operand's)
            p_op = _fp8_operand(p_op, acc)
        v_tile = v_smem.index(stage).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
    else:
        if p_op.dtype == gl.int32:  # (_P_PAIRS: two keys a word)
            p_op = _pair_operand(p_op, v_smem.dtype, acc)
        v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_DIM])
    return warpgroup_mma(p_op, v_tile, acc, is_async=True)


@gluon.jit
def _take_turn(turn_bars, group, PINGPONG: gl.constexpr, WG: gl.constexpr, NAMED: gl.constexpr = 0,
               CONSUMERS: gl.constexpr = 2):
    """Ping-pong: before issuing its ``group``-th batch of wgmmas, a consumer waits until the one before it (in a
    ring of CONSUMERS) issued its own batch of that rank, or consumer 0 until the last one issued the previous rank
    (consumer 0 goes first: its group 0 waits for nothing). turn_bars[w] is the mbarrier consumer w waits on; each
    completes once per arrival (count 1). NAMED: instead, named barrier ``_turn_barrier0`` + w of two consumers'
    threads (this one's wait, the one before's arrival)."""
    if PINGPONG and NAMED:
        pair: gl.constexpr = (NAMED - 32) // CONSUMERS * 2  # two consumers' threads
        if WG == 0:
            if group > 0:
                _named_barrier(_turn_barrier0(CONSUMERS), pair, False)
        else:
            _named_barrier(_turn_barrier0(CONSUMERS) + WG, pair, False)
    elif PINGPONG:
        if WG == 0:
            mbarrier.wait(turn_bars.index(0), (group - 1) & 1, pred=group > 0)
        else:
            mbarrier.wait(turn_bars.index(WG), group & 1)


@gluon.jit
def _pass_turn(turn_bars, PINGPONG: gl.constexpr, WG: gl.constexpr, NAMED: gl.constexpr = 0,
               LAST: gl.constexpr = False, CONSUMERS: gl.constexpr = 2):
    """Ping-pong: this consumer's wgmmas of the group are issued; let the next consumer of the ring issue its own.
    The partition's warps first meet, so that no warp of this consumer is still waiting on the phase that
    the other consumer's next arrival would complete a second time (a parity wait would then hang). NAMED: each
    thread's arrival on the next one's named barrier (the last consumer's LAST group has no wait to match)."""
    NEXT: gl.constexpr = (WG + 1) % CONSUMERS
    if PINGPONG and NAMED:
        if not (LAST and WG == CONSUMERS - 1):
            _named_barrier(_turn_barrier0(CONSUMERS) + NEXT, (NAMED - 32) // CONSUMERS * 2, True)
    elif PINGPONG:
        gl.thread_barrier()
        mbarrier.arrive(turn_bars.index(NEXT))


@gluon.jit
def _stage_p(p, p_smem, index, WORDS: gl.constexpr = False, o_layout: gl.constexpr = None,
             BLOCK_M: gl.constexpr = 0, BLOCK_N: gl.constexpr = 0):
    """FP8's P of a tile, rounded to float8, into shared-memory buffer ``index`` for its P V wgmma: every warp's
    rows written and visible to the async proxy before any warp issues it. WORDS (K's keys permuted, so that a
    thread holds 4 adjacent keys of a row where it held 2 and 2): each such 4 stored as one 32-bit word of the
    buffer seen as int32 (the same bytes: 128-byte rows swizzled by 16-byte chunks either way), in key order."""
    if WORDS:
        p = _keys_in_order(p, o_layout, BLOCK_M, BLOCK_N)
        WORDS_LAYOUT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=p_smem.type.layout.swizzle_byte_width,
                                                          element_bitwidth=32, rank=2)
        buffer = p_smem.index(index)._reinterpret(gl.int32, [BLOCK_M, BLOCK_N // 4], WORDS_LAYOUT)
        buffer.store(_e4m3_words(p, BLOCK_M, BLOCK_N))
    else:
        p_smem.index(index).store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _overlap_step(q_tile, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty, turn_bars, acc, p_op, alpha, m_i, l_i,
                  tile, p_smem, start_m, seqlen_q, seqlen_k, qk_scale, s_layout: gl.constexpr,
                  o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, MASKED: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr,
                  RAW_MAX: gl.constexpr, EARLY_K: gl.constexpr, LAG_RESCALE: gl.constexpr, FP8: gl.constexpr = False,
                  n_tiles=0, NAMED: gl.constexpr = 0, P_LOG2: gl.constexpr = 0.0, CONSUMERS: gl.constexpr = 2,
                  P_REGS: gl.constexpr = 0):
    """Key tile ``tile`` >= 1 with the previous tile's PV in flight during this tile's softmax.

    On entry p_op holds P of ``tile`` - 1 and acc O of the tiles before it, scaled to m after ``tile`` - 1
    (LAG_RESCALE: to m after ``tile`` - 2, alpha the factor still owed). Issues S = Q Kᵀ of ``tile``, then
    O += P V of ``tile`` - 1, waits for S only (the wgmma groups complete in order, so one may stay
    outstanding), runs the softmax, then waits for the PV and releases stage ``tile`` - 1. The rescale of O
    comes after that wait, or (LAG_RESCALE, FA3's order) one tile later, between the issue of S and of the
    PV, where it runs under the S wgmma instead of after the PV. FP8: P goes to P V through shared memory
    (``_stage_p``), or with P_REGS (K's keys permuted) from registers (``_p_operand``)."""
    SMEM_P: gl.constexpr = FP8 and P_REGS != 1
    _take_turn(turn_bars, tile, PINGPONG, WG, NAMED, CONSUMERS)
    qk = _issue_qk(q_tile, k_smem, k_bars, tile, s_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)
    if LAG_RESCALE:
        acc = _rescale(acc, alpha, o_layout)
    if SMEM_P:
        acc = _issue_pv(p_smem.index(2 * WG + (tile - 1) % 2), v_smem, v_bars, acc, tile - 1, BLOCK_N, HEAD_DIM,
                        STAGES, FP8)
    else:
        acc = _issue_pv(p_op, v_smem, v_bars, acc, tile - 1, BLOCK_N, HEAD_DIM, STAGES, FP8)
    _pass_turn(turn_bars, PINGPONG, WG, NAMED, False, CONSUMERS)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
    if EARLY_K:
        _free_stage(k_empty, tile, n_tiles, _free_barrier0(CONSUMERS), STAGES, NAMED)
    p, alpha, m_i, l_i = _softmax_stats(qk, m_i, l_i, tile, start_m, seqlen_q, seqlen_k, qk_scale, s_layout,
                                        BLOCK_M, BLOCK_N, CAUSAL, MASKED, RAW_MAX, P_LOG2,
                                        _tree_max(_TREE_MAX, FP8, CONSUMERS), P_REGS > 0, _LANE_SUM,
                                        _EXP2_POLY if FP8 and HEAD_DIM <= 128 else 0)
    if SMEM_P:
        # P of this tile into the other of the consumer's two buffers (the one its PV of tile - 2 read)
        _stage_p(p, p_smem, 2 * WG + tile % 2, P_REGS == 2, o_layout, BLOCK_M, BLOCK_N)
        p_next = p_op
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    elif FP8 and _P_CARRY:
        # (The wait cannot name an 8-bit operand in triton 3.6, "Unexpected bitwidth in WGMMAWaitGroupOp: 8": ptxas
        # keeps the in-flight P's registers until the wait, or serializes the wgmmas, which the compile check
        # refuses.) P stays in float32 until its P V issue.
        p_next = _p_operand(p, q_tile.dtype, o_layout, BLOCK_M, BLOCK_N, True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    elif FP8:
        # P rounded once the P V before has completed: the int32 carried to the next P V is that wgmma's operand
        # register, which ptxas will not see redefined while a wgmma reading it is in flight (it would serialize).
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        p_next = _p_operand(p, q_tile.dtype, o_layout, BLOCK_M, BLOCK_N, True)
    elif _P_PAIRS:
        # (as FP8's words: rounded once the P V before has completed, or ptxas serializes the wgmmas)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        p_next = _p_operand(p, q_tile.dtype, o_layout, BLOCK_M, BLOCK_N)
    else:
        # P of this tile in its operand registers before the wait: the previous P stays alive until its PV is done.
        p_next = _p_operand(p, q_tile.dtype, o_layout, BLOCK_M, BLOCK_N)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    _free_stage(empty_bars, tile - 1, n_tiles, _free_barrier0(CONSUMERS) + STAGES, STAGES, NAMED)
    if not LAG_RESCALE:
        acc = _rescale(acc, alpha, o_layout)
    return acc, p_next, alpha, m_i, l_i


@gluon.jit
def _overlap_mainloop(q_tile, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty, turn_bars, p_smem, full, n_tiles,
                      start_m,
                      seqlen_q, seqlen_k, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr, RAW_MAX: gl.constexpr,
                      EARLY_K: gl.constexpr, LAG_RESCALE: gl.constexpr, FP8: gl.constexpr = False,
                      NAMED: gl.constexpr = 0, P_LOG2: gl.constexpr = 0.0, CONSUMERS: gl.constexpr = 2,
                      n_own=0, P_REGS: gl.constexpr = 0):
    """All key tiles (n_tiles >= 1) software-pipelined by one tile: tile 0's S and softmax alone (masked,
    whatever it needs), then per tile j the overlapped step (unmasked for j < full), then the last PV.
    Returns (O unnormalised, m, l). Three consumers: only the first ``n_own`` (>= 1) tiles, those this consumer's
    rows see, then the turns of the program's other tiles without their work (``_idle_turns``). P_REGS: as
    ``_overlap_step``'s."""
    IDLE: gl.constexpr = CONSUMERS == 3
    SMEM_P: gl.constexpr = FP8 and P_REGS != 1
    if _Q_REGS and FP8 and (CONSUMERS == 2 or HEAD_DIM == 64):
        # (loaded once; a wgmma operand register that is never redefined does not make ptxas serialize)
        q_tile = q_tile.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4))
    if not IDLE:
        n_own = n_tiles
    _take_turn(turn_bars, 0, PINGPONG, WG, NAMED, CONSUMERS)
    qk = _issue_qk(q_tile, k_smem, k_bars, 0, s_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)
    _pass_turn(turn_bars, PINGPONG, WG, NAMED, False, CONSUMERS)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
    if EARLY_K:
        _free_stage(k_empty, 0, n_tiles, _free_barrier0(CONSUMERS), STAGES, NAMED)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    if _LANE_SUM:
        l_i = _lane_tree(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), BLOCK_M, BLOCK_N, True)
    else:
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    # (acc is zero: whatever factor tile 0 leaves owed, 0 or 1, scales nothing.)
    p, alpha, m_i, l_i = _softmax_stats(qk, m_i, l_i, 0, start_m, seqlen_q, seqlen_k, qk_scale, s_layout,
                                        BLOCK_M, BLOCK_N, CAUSAL, True, RAW_MAX, P_LOG2,
                                        _tree_max(_TREE_MAX, FP8, CONSUMERS), P_REGS > 0, _LANE_SUM,
                                        _EXP2_POLY if FP8 and HEAD_DIM <= 128 else 0)
    if SMEM_P:
        _stage_p(p, p_smem, 2 * WG, P_REGS == 2, o_layout, BLOCK_M, BLOCK_N)
        p_op = 0  # (unused: P lives in p_smem)
    else:
        p_op = _p_operand(p, q_tile.dtype, o_layout, BLOCK_M, BLOCK_N, FP8)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    for tile in range(1, full):
        acc, p_op, alpha, m_i, l_i = _overlap_step(
            q_tile, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty, turn_bars, acc, p_op, alpha, m_i, l_i,
            tile, p_smem, start_m, seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
            CAUSAL, False, PINGPONG, WG, RAW_MAX, EARLY_K, LAG_RESCALE, FP8, n_tiles, NAMED, P_LOG2, CONSUMERS,
            P_REGS)
    for tile in range(gl.maximum(full, 1), n_own):
        acc, p_op, alpha, m_i, l_i = _overlap_step(
            q_tile, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty, turn_bars, acc, p_op, alpha, m_i, l_i,
            tile, p_smem, start_m, seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
            CAUSAL, True, PINGPONG, WG, RAW_MAX, EARLY_K, LAG_RESCALE, FP8, n_tiles, NAMED, P_LOG2, CONSUMERS,
            P_REGS)
    _take_turn(turn_bars, n_own, PINGPONG, WG, NAMED, CONSUMERS)
    if LAG_RESCALE:
        acc = _rescale(acc, alpha, o_layout)
    if SMEM_P:
        acc = _issue_pv(p_smem.index(2 * WG + (n_own - 1) % 2), v_smem, v_bars, acc, n_own - 1, BLOCK_N,
                        HEAD_DIM, STAGES, FP8)
        if IDLE:
            _pass_turn_of(turn_bars, n_own, n_tiles, PINGPONG, WG, NAMED, CONSUMERS)
        else:
            _pass_turn(turn_bars, PINGPONG, WG, NAMED, True, CONSUMERS)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        acc = _issue_pv(p_op, v_smem, v_bars, acc, n_own - 1, BLOCK_N, HEAD_DIM, STAGES, FP8)
        if IDLE:
            _pass_turn_of(turn_bars, n_own, n_tiles, PINGPONG, WG, NAMED, CONSUMERS)
        else:
            _pass_turn(turn_bars, PINGPONG, WG, NAMED, True, CONSUMERS)
        if FP8:  # (an 8-bit operand cannot be named: see _overlap_step)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    _free_stage(empty_bars, n_own - 1, n_tiles, _free_barrier0(CONSUMERS) + STAGES, STAGES, NAMED)
    if IDLE:
        _idle_turns(k_bars, v_bars, empty_bars, k_empty, turn_bars, n_own + 1, n_tiles, STAGES, PINGPONG, WG, NAMED,
                    CONSUMERS)
    if _LANE_SUM:
        l_i = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, s_layout))
    return acc, m_i, l_i


@gluon.jit
def _pass_turn_of(turn_bars, group, n_tiles, PINGPONG: gl.constexpr, WG: gl.constexpr, NAMED: gl.constexpr,
                  CONSUMERS: gl.constexpr):
    """``_pass_turn`` after turn ``group`` of a program whose last turn is ``n_tiles`` (the last consumer's last
    turn has no wait to match)."""
    if WG == CONSUMERS - 1:
        if group < n_tiles:
            _pass_turn(turn_bars, PINGPONG, WG, NAMED, False, CONSUMERS)
    else:
        _pass_turn(turn_bars, PINGPONG, WG, NAMED, False, CONSUMERS)


@gluon.jit
def _idle_turns(k_bars, v_bars, empty_bars, k_empty, turn_bars, first, n_tiles, STAGES: gl.constexpr,
                PINGPONG: gl.constexpr, WG: gl.constexpr, NAMED: gl.constexpr, CONSUMERS: gl.constexpr):
    """Turns ``first`` to ``n_tiles`` of a consumer whose rows need no more key tiles (past its diagonal, or past
    seqlen_q): each taken and passed so that the ring goes on, and the stages of the tiles released, each once
    its loads landed as a working consumer would (so that no release runs ahead of the producer's next wait on
    that stage's barrier)."""
    for group in range(first, n_tiles + 1):
        _take_turn(turn_bars, group, PINGPONG, WG, NAMED, CONSUMERS)
        _pass_turn_of(turn_bars, group, n_tiles, PINGPONG, WG, NAMED, CONSUMERS)
        if group >= 1:
            tile = group - 1
            stage = tile % STAGES
            mbarrier.wait(k_bars.index(stage), (tile // STAGES) & 1)
            _free_stage(k_empty, tile, n_tiles, _free_barrier0(CONSUMERS), STAGES, NAMED)
            mbarrier.wait(v_bars.index(stage), (tile // STAGES) & 1)
            _free_stage(empty_bars, tile, n_tiles, _free_barrier0(CONSUMERS) + STAGES, STAGES, NAMED)


@gluon.jit
def _overlap_consumer(q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, empty_bars, k_empty, turn_bars, p_smem, o_desc,
                      Lse,
                      batch, head, nheads, start_m, full, n_tiles, seqlen_q, seqlen_k, qk_scale,
                      s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                      WG: gl.constexpr, RAW_MAX: gl.constexpr, EARLY_K: gl.constexpr, LAG_RESCALE: gl.constexpr,
                      Out, stride_ot, stride_oh, q_start, total_q, VARLEN: gl.constexpr, FP8: gl.constexpr = False,
                      v_scale=1.0, NAMED: gl.constexpr = 0, P_LOG2: gl.constexpr = 0.0,
                      CONSUMERS: gl.constexpr = 2, P_REGS: gl.constexpr = 0):
    """A consumer partition of the overlapped variants: the BLOCK_M query rows from start_m (its own Q tile,
    q_smem), every key tile of the program (n_tiles, shared with the other consumer if any; ``full`` is its
    own count of mask-free tiles), then its own epilogue (O through q_smem and TMA, lse)."""
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_bar, 0)
    if CONSUMERS == 3:
        # The tiles this consumer's own rows see (none for rows past seqlen_q); the program's others are turns only.
        _, n_own = _kv_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
        n_own = gl.where(start_m < seqlen_q, gl.minimum(n_own, n_tiles), 0)
        if n_own > 0:
            acc, m_i, l_i = _overlap_mainloop(q_smem.reshape([BLOCK_M, HEAD_DIM]), k_smem, v_smem, k_bars, v_bars,
                                              empty_bars, k_empty, turn_bars, p_smem, gl.minimum(full, n_own),
                                              n_tiles, start_m, seqlen_q, seqlen_k, qk_scale, s_layout, o_layout,
                                              BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, WG, RAW_MAX,
                                              EARLY_K, LAG_RESCALE, FP8, NAMED, P_LOG2, CONSUMERS, n_own, P_REGS)
        else:
            _idle_turns(k_bars, v_bars, empty_bars, k_empty, turn_bars, 0, n_tiles, STAGES, PINGPONG, WG, NAMED,
                        CONSUMERS)
    elif n_tiles > 0:  # causal rows with no key (seqlen_q > seqlen_k) skip the loop: O = 0, lse = -inf
        acc, m_i, l_i = _overlap_mainloop(q_smem.reshape([BLOCK_M, HEAD_DIM]), k_smem, v_smem, k_bars, v_bars,
                                          empty_bars, k_empty, turn_bars, p_smem, full, n_tiles, start_m, seqlen_q,
                                          seqlen_k,
                                          qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                          PINGPONG, WG, RAW_MAX, EARLY_K, LAG_RESCALE, FP8, NAMED, P_LOG2, CONSUMERS,
                                          0, P_REGS)
    _epilogue(acc, m_i, l_i, q_smem, o_desc, Lse, batch, head, nheads, start_m, seqlen_q, o_layout, s_layout,
              BLOCK_M, HEAD_DIM, Out, stride_ot, stride_oh, q_start, total_q, VARLEN, FP8, v_scale, P_LOG2)


@gluon.jit
def _epilogue(acc, m_i, l_i, q_smem, o_desc, Lse, batch, head, nheads, start_m, seqlen_q,
              o_layout: gl.constexpr, s_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
              Out, stride_ot, stride_oh, q_start, total_q, VARLEN: gl.constexpr, FP8: gl.constexpr = False,
              v_scale=1.0, P_LOG2: gl.constexpr = 0.0):
    """O / l through shared memory (Q's buffer, free now) and a TMA store that drops rows past seqlen_q;
    lse = (m + log2 l)·ln 2 (natural log; -inf for a row that saw no key, whose O is 0).

    VARLEN (packed sequences, out (total_q, heads, d), lse (heads, total_q)): the rows past this sequence's
    end are the next sequence's, which a TMA box would overwrite: O goes out by a masked store instead.
    FP8: O (16-bit, ``Out`` already at this batch's rows) times V's descale, by a masked store too (Q's
    buffer holds FP8)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    l_o = gl.where(l_o == 0.0, 1.0, l_o)
    if FP8:
        out = acc * (v_scale / gl.expand_dims(l_o, 1))
    else:
        out = acc / gl.expand_dims(l_o, 1)
    if VARLEN or FP8:
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_i) - P_LOG2) * LN2)
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        tokens = gl.expand_dims((q_start + offs_m).to(gl.int64), 1)
        o_ptrs = Out + tokens * stride_ot + head.to(gl.int64) * stride_oh + gl.expand_dims(offs_d, 0)
        keep = (gl.expand_dims(offs_m, 1) < seqlen_q) & (gl.expand_dims(offs_d, 0) < HEAD_DIM)
        gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=keep)
        if VARLEN:
            gl.store(Lse + head.to(gl.int64) * total_q + q_start + rows, lse, mask=rows < seqlen_q)
        else:
            gl.store(Lse + (batch * nheads + head).to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
    else:
        q_smem.reshape([BLOCK_M, HEAD_DIM]).store(out.to(o_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [batch, start_m, head, 0], q_smem)

        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_i) - P_LOG2) * LN2)
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        gl.store(Lse + (batch * nheads + head).to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
        tma.store_wait(pendings=0)


@gluon.jit
def _gluon_attn_fwd(q_desc, k_desc, v_desc, o_desc, Lse, seqlen_q, seqlen_k, nheads, group, qk_scale, n_bh,
                    bh_group, CuQ, CuK, Out, stride_ot, stride_oh, total_q, QDescale, KDescale, VDescale, stride_ob,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, VARLEN: gl.constexpr,
                    FP8: gl.constexpr, CAUSAL: gl.constexpr, LPT: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
                    OVERLAP: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
                    RAW_MAX: gl.constexpr, EARLY_K: gl.constexpr, LAG_RESCALE: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, P_LOG2: gl.constexpr = 0.0,
                    PDL: gl.constexpr = False, P_REGS: gl.constexpr = 0):
    # Programmatic dependent launch (configs.pdl_options): packed sequences read cu_seqlens and FP8 calls their
    # descales first, so they wait for the previous kernel here; dense calls only before Q's load, their
    # shared memory and barriers set up under that kernel's end.
    _await_prior_grids(PDL and (VARLEN or FP8))
    if LPT:  # sections of bh_group (batch, head) pairs whose K and V stay in L2 together
        n_m_blocks = gl.cdiv(seqlen_q, BLOCK_M)
        pid_m, pid_bh = section_order(n_m_blocks, n_bh, bh_group)
    else:
        n_m_blocks = gl.num_programs(0)
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
    batch = pid_bh // nheads
    if VARLEN:
        # Packed sequences (q, k, v, out (total, heads, d)): this program's sequence from cu_seqlens; the grid
        # covers the longest, so a shorter one's extra query blocks (pid_m past its own count) run no key
        # tile and store nothing.
        # Clamped into [0, total] as the Triton kernels' common.sequence_bounds does: the host checks cu_seqlens
        # once per tensor (not under graph capture or tracing), so values changed since must not send a load
        # or store outside the tensors. The launcher passes the packed keys' count in seqlen_k's place.
        total_k = seqlen_k
        q_start = gl.load(CuQ + batch)
        seqlen_q = gl.load(CuQ + batch + 1) - q_start
        q_start = gl.minimum(gl.maximum(q_start, 0), total_q)
        seqlen_q = gl.minimum(gl.maximum(seqlen_q, 0), total_q - q_start)
        k_start = gl.load(CuK + batch)
        seqlen_k = gl.load(CuK + batch + 1) - k_start
        k_start = gl.minimum(gl.maximum(k_start, 0), total_k)
        seqlen_k = gl.minimum(gl.maximum(seqlen_k, 0), total_k - k_start)
        n_m_blocks = gl.cdiv(seqlen_q, BLOCK_M)
        in_sequence = pid_m < n_m_blocks
        if CAUSAL:
            pid_m = gl.where(in_sequence, n_m_blocks - 1 - pid_m, pid_m)  # the longest rows first
        # Descriptors of this sequence alone, made in the kernel (q_desc, k_desc, v_desc are the packed tensors'
        # pointers): the copy engine zero-fills a box's rows past the sequence's end, so no tile reads the
        # next sequence's rows, as for dense calls. Q's here (this code loads Q); K's and V's by the warps
        # that load them: here without warp specialization, else the producer partition.
        elem: gl.constexpr = q_desc.dtype.element_ty
        Q_BOX: gl.constexpr = [1, BLOCK_M // CONSUMERS, 1, HEAD_DIM]
        KV_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, 1, HEAD_DIM], elem)
        q_desc = tma.make_tensor_descriptor(q_desc + q_start.to(gl.int64) * stride_qt,
                                            [1, gl.maximum(seqlen_q, 1), nheads, HEAD_DIM],
                                            [stride_qt, stride_qt, stride_qh, 1], Q_BOX,
                                            gl.NVMMASharedLayout.get_default_for(Q_BOX, elem))
        if WARP_SPECIALIZE:
            # (the producer's own arguments; dense calls pass constant zeros, which it never reads)
            p_start, p_seqlen_k, p_heads_k = k_start, seqlen_k, nheads // group
            p_kt, p_kh, p_vt, p_vh = stride_kt, stride_kh, stride_vt, stride_vh
        else:
            k_desc, v_desc = _kv_descriptors(k_desc, v_desc, k_start, seqlen_k, nheads // group, stride_kt, stride_kh,
                                             stride_vt, stride_vh, BLOCK_N, HEAD_DIM)
        tma_batch = 0
    else:
        q_start = 0
        p_start, p_seqlen_k, p_heads_k, p_kt, p_kh, p_vt, p_vh = 0, 0, 0, 0, 0, 0, 0
        in_sequence = True
        if CAUSAL:
            pid_m = n_m_blocks - 1 - pid_m  # the longest rows (most key tiles) first
        tma_batch = batch
    head = pid_bh % nheads
    kv_head = head // group
    if FP8:
        # float8 q, k, v with float32 descales per (batch, kv head): q·k's fold into the score scale, v's into
        # the output; O (16-bit) goes out by a masked store from this batch's rows.
        descale = batch * (nheads // group) + kv_head
        qk_scale = qk_scale * gl.load(QDescale + descale) * gl.load(KDescale + descale)
        v_scale = gl.load(VDescale + descale)
        Out = Out + batch.to(gl.int64) * stride_ob
    else:
        v_scale = 1.0
    start_m = pid_m * BLOCK_M
    dtype: gl.constexpr = q_desc.dtype
    # Each consumer (one, or two partitions of NUM_WARPS / 2 warps) owns BLOCK_M / CONSUMERS query rows: its
    # own Q buffer (q_desc's box has that many rows), barrier and O store.
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    WARPS: gl.constexpr = NUM_WARPS // CONSUMERS
    gl.static_assert(CONSUMERS == 1 or (WARP_SPECIALIZE and OVERLAP), "two consumers: warp-specialized, overlapped")
    gl.static_assert(not PINGPONG or CONSUMERS >= 2, "ping-pong orders two or three consumers")
    gl.static_assert(not OVERLAP or WARP_SPECIALIZE, "the overlapped consumer is a warp-specialized partition")
    gl.static_assert(not FP8 or (OVERLAP and not VARLEN and not LPT), "FP8: the overlapped variants, dense, grid")
    gl.static_assert(not P_REGS or (FP8 and CONSUMERS >= 2 and EARLY_K),
                     "K permuted (P from registers or stored as words): the FP8 variants of two or three consumers "
                     "releasing K early (their producer's loads know the permuted K's coordinates)")
    # P_REGS (FP8, 1 or 2): k_desc is _permuted_k_descriptor's; this sequence's first block of 16 keys and its
    # head's column
    k_block0 = batch * (seqlen_k // 16)
    k_col0 = kv_head * HEAD_DIM
    gl.static_assert(not (VARLEN and LPT), "packed sequences: the 2-D grid")
    gl.static_assert(OVERLAP or not (EARLY_K or LAG_RESCALE), "early K release, lagged rescale: overlapped only")

    INSTR_K: gl.constexpr = 32 if FP8 else 16  # a wgmma's reduction depth: 32 bytes of its operands
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, INSTR_K])

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, ROWS, 1, HEAD_DIM], q_desc.layout)
    if VARLEN:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], KV_SMEM)
    elif P_REGS:  # (_permuted_k_descriptor's boxes)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N // 16, 2, 4, 2, HEAD_DIM], k_desc.layout)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    if FP8:  # V keys-fastest: (head_dim, keys) tiles
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, HEAD_DIM, BLOCK_N], v_desc.layout)
    elif VARLEN:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], KV_SMEM)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bars.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(s), count=1)
        mbarrier.init(v_bars.index(s), count=1)
    fence_async_shared()

    _await_prior_grids(PDL and not (VARLEN or FP8))
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [tma_batch, start_m + c * ROWS, head, 0], q_bars.index(c),
                                        q_smem.index(c))

    # Key tiles of the whole program (the producer loads them all); the mask-free count is per consumer.
    full, n_tiles = _kv_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    if VARLEN:
        n_tiles = gl.where(in_sequence, n_tiles, 0)
        full = gl.minimum(full, n_tiles)
    if WARP_SPECIALIZE:
        # A stage is free again once every consumer released it (one arrival each).
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(empty_bars.index(s), count=CONSUMERS)
        if EARLY_K:
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(k_empty.index(s), count=CONSUMERS)
        else:
            k_empty = empty_bars  # K and V of a stage released together
        if FP8 and P_REGS != 1:  # two P buffers per consumer (see _stage_p)
            p_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, ROWS, BLOCK_N],
                                               gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], dtype))
        else:
            p_smem = q_smem  # unused
        if CONSUMERS >= 2:
            turn_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
            for c in gl.static_range(CONSUMERS):
                mbarrier.init(turn_bars.index(c), count=1)
        else:
            turn_bars = empty_bars  # unused without ping-pong
        fence_async_shared()
        # (The partitions' (function, args) pairs are written out in each call: a tuple holding a jit function
        # cannot be a variable of the kernel.)
        if OVERLAP:
            full0, _ = _kv_range(start_m, seqlen_q, seqlen_k, ROWS, BLOCK_N, CAUSAL)
            if CONSUMERS >= 2:
                full1, _ = _kv_range(start_m + ROWS, seqlen_q, seqlen_k, ROWS, BLOCK_N, CAUSAL)
                # Threads of the named barriers that release stages (the consumers' and the producer's).
                NAMED: gl.constexpr = 32 * (NUM_WARPS + 1) if _NAMED_SYNC and PINGPONG and EARLY_K else 0
                gl.static_assert(NAMED == 0 or _free_barrier0(CONSUMERS) + 2 * STAGES <= 16,
                                 "named barriers: 16 a CTA")
            if CONSUMERS == 3:
                gl.static_assert(NAMED > 0, "three consumers take turns by named barriers")
                full2, _ = _kv_range(start_m + 2 * ROWS, seqlen_q, seqlen_k, ROWS, BLOCK_N, CAUSAL)
                gl.warp_specialize(
                    [(_overlap_consumer,
                      (q_smem.index(0), k_smem, v_smem, q_bars.index(0), k_bars, v_bars, empty_bars, k_empty,
                       turn_bars, p_smem, o_desc, Lse, batch, head, nheads, start_m, full0, n_tiles, seqlen_q,
                       seqlen_k, qk_scale, s_layout, o_layout, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, 0,
                       RAW_MAX, EARLY_K, LAG_RESCALE, Out, stride_ot, stride_oh, q_start, total_q, VARLEN, FP8,
                       v_scale, NAMED, P_LOG2, CONSUMERS, P_REGS)),
                     (_overlap_consumer,
                      (q_smem.index(1), k_smem, v_smem, q_bars.index(1), k_bars, v_bars, empty_bars, k_empty,
                       turn_bars, p_smem, o_desc, Lse, batch, head, nheads, start_m + ROWS, full1, n_tiles, seqlen_q,
                       seqlen_k, qk_scale, s_layout, o_layout, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, 1,
                       RAW_MAX, EARLY_K, LAG_RESCALE, Out, stride_ot, stride_oh, q_start, total_q, VARLEN, FP8,
                       v_scale, NAMED, P_LOG2, CONSUMERS, P_REGS)),
                     (_overlap_consumer,
                      (q_smem.index(2), k_smem, v_smem, q_bars.index(2), k_bars, v_bars, empty_bars, k_empty,
                       turn_bars, p_smem, o_desc, Lse, batch, head, nheads, start_m + 2 * ROWS, full2, n_tiles,
                       seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                       PINGPONG, 2, RAW_MAX, EARLY_K, LAG_RESCALE, Out, stride_ot, stride_oh, q_start, total_q, VARLEN,
                       FP8, v_scale, NAMED, P_LOG2, CONSUMERS, P_REGS)),
                     (_ws_producer, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty,
                                     tma_batch, kv_head, n_tiles, BLOCK_N, STAGES, EARLY_K, FP8, VARLEN,
                                     p_start, p_seqlen_k, p_heads_k, p_kt, p_kh, p_vt, p_vh, HEAD_DIM, NAMED,
                                     CONSUMERS, P_REGS > 0, k_block0, k_col0))],
                    [WARPS, WARPS, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
            elif CONSUMERS == 2:
                gl.warp_specialize(
                    [(_overlap_consumer,
                      (q_smem.index(0), k_smem, v_smem, q_bars.index(0), k_bars, v_bars, empty_bars, k_empty,
                       turn_bars, p_smem, o_desc, Lse, batch, head, nheads, start_m, full0, n_tiles, seqlen_q,
                       seqlen_k, qk_scale, s_layout, o_layout, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, 0,
                       RAW_MAX, EARLY_K, LAG_RESCALE, Out, stride_ot, stride_oh, q_start, total_q, VARLEN, FP8,
                       v_scale, NAMED, P_LOG2, CONSUMERS, P_REGS)),
                     (_overlap_consumer,
                      (q_smem.index(1), k_smem, v_smem, q_bars.index(1), k_bars, v_bars, empty_bars, k_empty,
                       turn_bars, p_smem, o_desc, Lse, batch, head, nheads, start_m + ROWS, full1, n_tiles, seqlen_q,
                       seqlen_k, qk_scale, s_layout, o_layout, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, 1,
                       RAW_MAX, EARLY_K, LAG_RESCALE, Out, stride_ot, stride_oh, q_start, total_q, VARLEN, FP8,
                       v_scale, NAMED, P_LOG2, CONSUMERS, P_REGS)),
                     (_ws_producer, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty,
                                     tma_batch, kv_head, n_tiles, BLOCK_N, STAGES, EARLY_K, FP8, VARLEN,
                                     p_start, p_seqlen_k, p_heads_k, p_kt, p_kh, p_vt, p_vh, HEAD_DIM, NAMED,
                                     CONSUMERS, P_REGS > 0, k_block0, k_col0))],
                    [WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
            else:
                gl.warp_specialize(
                    [(_overlap_consumer,
                      (q_smem.index(0), k_smem, v_smem, q_bars.index(0), k_bars, v_bars, empty_bars, k_empty,
                       turn_bars, p_smem, o_desc, Lse, batch, head, nheads, start_m, full0, n_tiles, seqlen_q, seqlen_k,
                       qk_scale, s_layout, o_layout, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG, 0, RAW_MAX,
                       EARLY_K, LAG_RESCALE, Out, stride_ot, stride_oh, q_start, total_q, VARLEN, FP8,
                       v_scale, 0, P_LOG2)),
                     (_ws_producer, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, k_empty,
                                     tma_batch, kv_head, n_tiles, BLOCK_N, STAGES, EARLY_K, FP8, VARLEN,
                                     p_start, p_seqlen_k, p_heads_k, p_kt, p_kh, p_vt, p_vh, HEAD_DIM))],
                    [1], [PRODUCER_REGS])
        else:
            acc, m_i, l_i = gl.warp_specialize(
                [(_ws_consumer, (q_smem.index(0), k_smem, v_smem, q_bars.index(0), k_bars, v_bars, empty_bars,
                                 full, n_tiles, start_m, seqlen_q, seqlen_k, qk_scale, s_layout, o_layout, BLOCK_M,
                                 BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
                 (_ws_producer, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, empty_bars, tma_batch,
                                 kv_head, n_tiles, BLOCK_N, STAGES, False, False, VARLEN, p_start,
                                 p_seqlen_k, p_heads_k, p_kt, p_kh, p_vt, p_vh, HEAD_DIM))],
                [1], [PRODUCER_REGS])
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(empty_bars.index(s))
            if EARLY_K:
                mbarrier.invalidate(k_empty.index(s))
        if CONSUMERS >= 2:
            for c in gl.static_range(CONSUMERS):
                mbarrier.invalidate(turn_bars.index(c))
    else:
        acc, m_i, l_i = _single_partition(q_smem.index(0), k_smem, v_smem, q_bars.index(0), k_bars, v_bars, k_desc,
                                          v_desc, tma_batch, kv_head, full, n_tiles, start_m, seqlen_q, seqlen_k,
                                          qk_scale, s_layout, o_layout, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                          RAW_MAX)

    for c in gl.static_range(CONSUMERS):
        mbarrier.invalidate(q_bars.index(c))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(s))
        mbarrier.invalidate(v_bars.index(s))
    if not OVERLAP:  # the overlapped consumers wrote their own output
        _epilogue(acc, m_i, l_i, q_smem.index(0), o_desc, Lse, batch, head, nheads, start_m, seqlen_q, o_layout,
                  s_layout, BLOCK_M, HEAD_DIM, Out, stride_ot, stride_oh, q_start, total_q, VARLEN)


# ---------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, STAGES, num_warps) per head dim: 128 query rows over two warpgroups (16 rows a warp),
# 128-key tiles, K and V double-buffered. Shared memory at d=128: Q 32 KiB + 2 × (K 32 + V 32) = 160 KiB.
# d = 256: 64-key tiles, so that Q and two K/V stages fit (192 KiB).
DEFAULT_TILES = {64: (128, 128, 2, 8), 128: (128, 128, 2, 8), 256: (128, 64, 2, 8)}
# Registers a thread of the 1-warp producer partition asks for (setmaxnreg): it only issues TMA copies.
PRODUCER_REGS = 24
# Registers a thread of the second consumer partition asks for in the two-consumer variants (the default
# partition, the first consumer, gets what is left: (65536 - 128 x (24 + 240)) / 128 = 248, capped to fit).
CONSUMER_REGS = 240
# The same with three consumers: (65536 - 128 x 24) / (3 x 128) = 162, rounded down to setmaxnreg's multiple of 8.
CONSUMER_REGS_OF_THREE = 160
# The "lpt" schedule keeps the K and V of this many bytes' worth of (batch, head) pairs in flight at once
# (half of an H100/H200's 50 MiB L2, the rest for Q, O and other traffic).
LPT_KV_BYTES = 25 * 2**20
SCHEDULES = ("grid", "lpt")
# Kernel variants: name -> (WARP_SPECIALIZE, OVERLAP, CONSUMERS, PINGPONG, RAW_MAX, EARLY_K, LAG_RESCALE).
#   single      one partition; the kernel's warps issue the TMA loads STAGES - 1 tiles ahead.
#   ws          a 1-warp TMA producer partition + one consumer of num_warps warps (two warpgroups on one
#               BLOCK_M-row Q tile); each tile's QKᵀ, softmax, PV in sequence.
#   ws-overlap  as ws, and the consumer issues QKᵀ of tile j before the PV of tile j - 1 and runs tile j's
#               softmax while that PV is in flight (FA3's intra-warpgroup overlap).
#   ws2         two consumer partitions of num_warps / 2 warps, each with its own BLOCK_M / 2-row Q tile (own
#               Q buffer, own output), both overlapped, sharing the K/V ring; not ordered against each other.
#   pingpong    as ws2, and the two consumers take turns issuing their wgmmas (mbarriers), so that one's
#               softmax runs while the other's wgmmas use the tensor cores (FA3's ping-pong).
#   *-ffma      the row max over unscaled scores, so each score's exponent is one fused multiply-add
#               (RAW_MAX; only where softmax_scale > 0, else the variant runs without it).
#   pingpong-lag, pingpong-early  pingpong-ffma with LAG_RESCALE or EARLY_K alone (below).
#   pingpong-fa3  pingpong-ffma, with FA3's order of a consumer's step: K released as soon as its S
#               completed (EARLY_K), O rescaled under the next S wgmma instead of after the PV (LAG_RESCALE).
#   pingpong3-fa3  pingpong-fa3 with three consumers (12 warps, BLOCK_M / 3 rows each) taking turns in a ring, so that
#               each one's softmax has two others' wgmmas to run under (the FP8 forward, whose softmax takes as
#               long as its wgmmas, and the 16-bit forward at d = 64 from 4,096 tokens; named barriers only).
VARIANTS = {
    "single": (False, False, 1, False, False, False, False),
    "ws": (True, False, 1, False, False, False, False),
    "ws-overlap": (True, True, 1, False, False, False, False),
    "ws2": (True, True, 2, False, False, False, False),
    "pingpong": (True, True, 2, True, False, False, False),
    "single-ffma": (False, False, 1, False, True, False, False),
    "pingpong-ffma": (True, True, 2, True, True, False, False),
    "pingpong-lag": (True, True, 2, True, True, False, True),
    "pingpong-early": (True, True, 2, True, True, True, False),
    "pingpong-fa3": (True, True, 2, True, True, True, True),
    "pingpong3-fa3": (True, True, 3, True, True, True, True),
}
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
_GL_FP8 = {torch.float8_e4m3fn: gl.float8e4nv}
_GL_ACCUMULATORS = {torch.float32: gl.float32, torch.int32: gl.int32}  # the one-pass backward's dQ (gluon_backward)


def _power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _checked_tiles(tiles, d: int, variant: str, element_size: int = 2, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STAGES, num_warps): ``tiles``, or the head dim's default, checked against what the
    kernel's layouts and sm90's shared memory take (a ValueError naming the tile otherwise; or the variant, for three
    16-bit consumers past d = 64)."""
    block_m, block_n, stages, num_warps = tiles or DEFAULT_TILES[d]
    consumers = VARIANTS[variant][2]
    if consumers == 3 and d > 64 and not fp8:
        raise ValueError(f"variant {variant!r}: three consumers hold a 16-bit P in registers, which spills at head dim "
                         f"{d} (ptxas: 940 bytes at d = 128); gluon_attention_forward_fp8 takes it")
    if tiles is None and consumers == 3:
        block_m, num_warps = 192, 12  # the default tile's 64 rows a consumer
    # Q, and K and V per stage (the output reuses Q's buffer; FP8 adds two P buffers per consumer)
    smem = element_size * d * (block_m + 2 * stages * block_n) + (2 * block_m * block_n if fp8 else 0)
    min_n = 32 if fp8 else 16  # a wgmma reads 32 bytes of the reduction at a time: P V's is the keys
    rows = block_m // consumers  # each consumer's
    if (num_warps not in (4, 8, 12) or block_m % consumers or rows % (16 * num_warps // consumers)
            or not _power_of_2(rows) or rows > 256 // min(consumers, 2)
            or not _power_of_2(block_n) or not min_n <= block_n <= 256 or stages < 2 or smem > 227 * 1024):
        raise ValueError(f"tile {tiles}: 4, 8 or 12 warps, 16 query rows per warp (BLOCK_M a multiple of 16 x "
                         f"num_warps), BLOCK_M / consumers and BLOCK_N powers of two, BLOCK_M / consumers up to 256 "
                         f"(128 for two or three consumers), BLOCK_N up to 256 (and >= {min_n}), at least 2 stages, "
                         f"shared memory within 227 KiB (this tile: {smem // 1024} KiB)")
    if consumers >= 2 and num_warps != 4 * consumers:
        raise ValueError(f"tile {tiles}: variant {variant!r} splits the tile between {consumers} 4-warp consumers "
                         f"(one warpgroup each): num_warps must be {4 * consumers}")
    return block_m, block_n, stages, num_warps


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A 4-D TMA descriptor over a (batch, seqlen, heads, head_dim) tensor in (1, rows, 1, head_dim) boxes."""
    block = [1, rows, 1, t.shape[3]]
    layout = gl.NVMMASharedLayout.get_default_for(block, {**_GL_DTYPES, **_GL_FP8, **_GL_ACCUMULATORS}[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _permuted_k_descriptor(k: torch.Tensor, block_n: int) -> TensorDescriptor | None:
    """An FP8 K (batch, seqlen_k, heads_k, d) in 5-D TMA boxes (block_n / 16, 2, 4, 2, d) over its rows taken as
    one run of blocks of 16 keys, the strides of 2 and 4 rows swapped: box row 8·g + 2·t + e of a block is key
    4·t + 2·g + e. S = Q Kᵀ then holds in each thread the keys that P V's 8-bit register operand wants of it
    (``_p_operand``): P needs no trip through shared memory (``P_REGS`` 1), or goes there as words of 4 keys
    (``_stage_p``, ``P_REGS`` 2). None where the rows are not one
    evenly strided run (batch stride = seqlen_k rows, heads side by side in a row) or seqlen_k is not a multiple
    of 16 (a block would reach into the next sequence): P then goes through shared memory by pairs."""
    batch, seqlen_k, nheads_k, d = k.shape
    row = k.stride(1)
    if (seqlen_k % 16 or k.stride(3) != 1 or (nheads_k > 1 and k.stride(2) != d)
            or (batch > 1 and k.stride(0) != seqlen_k * row) or row % 16 or k.data_ptr() % 16):
        return None
    box = [block_n // 16, 2, 4, 2, d]
    return TensorDescriptor(k, [batch * seqlen_k // 16, 2, 4, 2, nheads_k * d], [16 * row, 2 * row, 4 * row, row, 1],
                            box, gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv))


def gluon_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            softmax_scale: float | None = None, *, tiles: tuple[int, int, int, int] | None = None,
                            variant: str = "single", schedule: str = "grid") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward of dense BSHD q (batch, seqlen_q, heads, d), k and v (batch, seqlen_k, heads_k, d)
    through the Gluon sm90 kernel: (out like q, lse float32 (batch, heads, seqlen_q), natural log).

    fp16/bf16, d in {64, 128}, heads a multiple of heads_k (query head h reads kv head h // (heads/heads_k)).
    ``tiles``: (BLOCK_M, BLOCK_N, STAGES, num_warps), default ``DEFAULT_TILES[d]``; num_warps counts the
    consumer warps (the producer warp of the warp-specialized variants comes on top). ``variant``: a key of
    ``VARIANTS`` (the two-consumer ones split BLOCK_M and num_warps between the consumers, so they need
    num_warps = 8). ``schedule``: "grid" (a 2-D grid, query blocks of one (batch, head) after another, the
    longest first under causal) or "lpt" (a 1-D grid over groups of (batch, head) pairs whose K and V fit
    ``LPT_KV_BYTES``, the query blocks of one rank for all pairs of a group together, longest first under
    causal). Not public API yet."""
    batch, seqlen_q, nheads, d = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"fp16 or bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in DEFAULT_TILES or k.shape[3] != d or v.shape != k.shape:
        raise ValueError(f"head dim 64, 128 or 256 and k, v of one shape, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if nheads_k == 0 or nheads % nheads_k or k.shape[0] != batch:
        raise ValueError(f"heads {nheads} must be a multiple of kv heads {nheads_k}, batch sizes equal")
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {', '.join(VARIANTS)}")
    consumers = VARIANTS[variant][2]
    block_m, block_n, stages, num_warps = _checked_tiles(tiles, d, variant)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
    # TMA wants a 16-byte aligned base and outer strides of whole 16 bytes; other views are copied.
    q, k, v = map(configs.tma_ready_or_copy, (q, k, v))
    if schedule == "grid" and batch * nheads > 65535:
        raise ValueError(f"batch x heads = {batch * nheads} exceeds the grid's second axis (65535)")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    if seqlen_q == 0 or batch * nheads == 0:
        return out, lse
    if seqlen_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    n_bh, n_m = batch * nheads, triton.cdiv(seqlen_q, block_m)
    if schedule == "lpt":
        # Query heads of one group share a K/V head: count each K/V head's bytes once per group of them.
        kv_bytes = max(1, 2 * seqlen_k * d * q.element_size() * nheads_k // nheads)
        bh_group = max(1, min(n_bh, LPT_KV_BYTES // kv_bytes))
        grid = (n_bh * n_m,)
    else:
        bh_group = 1
        grid = (n_m, n_bh)
    rows = block_m // consumers  # each consumer loads and stores its own Q / O rows
    configs.note_fixed_tile("_gluon_attn_fwd", f"{variant}{'/lpt' if schedule == 'lpt' else ''} BLOCK_M={block_m} "
                                               f"BLOCK_N={block_n} warps={num_warps} stages={stages}")
    # Through configs' direct launch, as flashtile's other kernels: a launch plan records it (its Gluon
    # descriptors included) and replays it.
    _launch(grid, (_descriptor(q, rows), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(out, rows),
                   lse, seqlen_q, seqlen_k, nheads, nheads // nheads_k, softmax_scale * LOG2E, n_bh, bh_group,
                   lse, lse, out, 0, 0, 0, lse, lse, lse, 0, 0, 0, 0, 0, 0, 0),
            variant, (block_m, block_n, stages, num_warps), d, causal, lpt=schedule == "lpt",
            raw_max=softmax_scale > 0)
    return out, lse


def _launch(grid, args: tuple, variant: str, tiles: tuple, d: int, causal: bool, *, varlen: bool = False,
            fp8: bool = False, lpt: bool = False, raw_max: bool = True, p_regs: int = 0) -> None:
    """``_gluon_attn_fwd[grid](*args, ...)`` through configs' direct launch (a launch plan records and replays
    it), its switches from the variant, the tile and the call's kind. ``raw_max``: whether the variant's
    RAW_MAX may apply (a positive score scale, known on the host). ``p_regs``: FP8 with k_desc from
    ``_permuted_k_descriptor``, P from registers (1) or through shared memory as words of 4 keys (2)."""
    from .forward import FP8_P_LOG2

    warp_specialize, overlap, consumers, pingpong, variant_raw_max, early_k, lag_rescale = VARIANTS[variant]
    block_m, block_n, stages, num_warps = tiles
    configs.launch_plain(
        _gluon_attn_fwd, grid, *args,
        VARLEN=varlen, FP8=fp8, CAUSAL=bool(causal), LPT=lpt, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
        STAGES=stages, NUM_WARPS=num_warps, WARP_SPECIALIZE=warp_specialize, OVERLAP=overlap, CONSUMERS=consumers,
        PINGPONG=pingpong, RAW_MAX=variant_raw_max and raw_max, EARLY_K=early_k, LAG_RESCALE=lag_rescale,
        PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS if consumers < 3 else CONSUMER_REGS_OF_THREE,
        P_LOG2=FP8_P_LOG2.value if fp8 else 0.0, **({"P_REGS": p_regs} if p_regs else {}),
        num_warps=num_warps // consumers, **configs.pdl_options(args[4].device))  # (args[4]: lse)


def gluon_attention_forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, causal: bool = False,
                                   softmax_scale: float | None = None, *,
                                   tiles: tuple[int, int, int, int] | None = None,
                                   variant: str = "single") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward of packed sequences through the Gluon sm90 kernel (``VARLEN``): q (total_q, heads, d),
    k and v (total_k, heads_k, d), cu_seqlens_q / cu_seqlens_k int32 (batch + 1,) cumulative lengths, as
    flash_attn_varlen_func takes them. Returns (out like q, lse float32 (heads, total_q), natural log).

    Each program makes its sequence's Q, K and V descriptors in the kernel (over the packed tensors, from the
    sequence's first row, as long as the sequence), so a box past the sequence's end is zero-filled as for
    dense calls; O goes out by a masked store. The kernel clamps each sequence's bounds into [0, total_q]
    and [0, total_k] as the Triton kernels do; max_seqlen_q must be at least the longest query length
    (flash_attn_varlen_func checks cu_seqlens before its launch). The 2-D grid covers
    ``max_seqlen_q``; "grid" schedule only. ``flash_attn_varlen_func`` calls it where
    ``configs.gluon_forward_choice`` admits the call."""
    total_q, nheads, d = q.shape
    total_k, nheads_k, _ = k.shape
    batch = cu_seqlens_q.shape[0] - 1
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"fp16 or bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d not in DEFAULT_TILES or k.shape[2] != d or v.shape != k.shape or nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"head dim 64, 128 or 256, k, v of one shape, heads a multiple of kv heads: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {', '.join(VARIANTS)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device or not cu.is_contiguous():
            raise ValueError(f"{name}: a contiguous int32 (batch + 1,) tensor on {q.device}, got {cu.dtype} "
                             f"{tuple(cu.shape)} on {cu.device}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k {tuple(cu_seqlens_k.shape)} must have cu_seqlens_q's length "
                         f"{tuple(cu_seqlens_q.shape)}")
    if batch * nheads > 65535:
        raise ValueError(f"batch x heads = {batch * nheads} exceeds the grid's second axis (65535)")
    block_m, block_n, stages, num_warps = _checked_tiles(tiles, d, variant)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(nheads, total_q, dtype=torch.float32, device=q.device)
    if batch <= 0 or total_q == 0 or max_seqlen_q <= 0:
        return out, lse
    if total_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    # The kernel makes each sequence's descriptors over these (16-byte aligned base, token and head strides).
    q, k, v = map(configs.tma_ready_or_copy, (q, k, v))
    triton.set_allocator(configs._tma_allocator)  # the descriptors made in the kernel live in its scratch
    grid = (triton.cdiv(max_seqlen_q, block_m), batch * nheads)
    configs.note_fixed_tile("_gluon_attn_fwd", f"{variant} varlen BLOCK_M={block_m} BLOCK_N={block_n} "
                                               f"warps={num_warps} stages={stages}")
    _launch(grid, (q, k, v, q, lse, 0, total_k, nheads, nheads // nheads_k, softmax_scale * LOG2E, batch * nheads,
                   1,
                   cu_seqlens_q, cu_seqlens_k, out, out.stride(0), out.stride(1), total_q, lse, lse, lse, 0,
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)),
            variant, (block_m, block_n, stages, num_warps), d, causal, varlen=True, raw_max=softmax_scale > 0)
    return out, lse


def gluon_attention_forward_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor,
                                k_descale: torch.Tensor, v_descale: torch.Tensor, causal: bool = False,
                                softmax_scale: float | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
                                tiles: tuple[int, int, int, int] | None = None,
                                variant: str = "pingpong-fa3") -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward (``FP8``): q (batch, seqlen_q, heads, d), k and v (batch, seqlen_k, heads_k, d) in
    float8_e4m3fn, descales float32 (batch, heads_k) as ``flash_attn_func`` takes them (FA3's convention).
    Returns (out (batch, seqlen_q, heads, d) in ``out_dtype``, lse float32 (batch, heads, seqlen_q)).

    Both products on FP8 wgmma, accumulated in float32: S = Q Kᵀ with q's and k's descales folded into the
    score scale (the row max taken over the raw scores: positive descales, as ``flashtile.fp8.quantize`` makes
    them); P = exp2(s - m + 8) (``forward.FP8_P_LOG2``, float8's range as the Triton FP8 forward uses it) rounded
    to float8 for P V, whose FP8 wgmma wants V contiguous along the keys: v is laid out keys-fastest first
    (``forward.keys_fastest``: used as it is where it already is, as ``flashtile.fp8.quantize(v,
    keys_fastest=True)`` makes it). The overlapped variants only; ``pingpong3-fa3`` (three consumers, 192-row
    tiles by default) is the dispatch's (``configs.GLUON_FP8_FORWARD``)."""
    from .forward import keys_fastest

    batch, seqlen_q, nheads, d = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if q.dtype not in _GL_FP8 or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"float8_e4m3fn q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}")
    if out_dtype not in _GL_DTYPES:
        raise TypeError(f"out_dtype float16 or bfloat16, got {out_dtype}")
    if d not in DEFAULT_TILES or k.shape[3] != d or v.shape != k.shape or nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"head dim 64, 128 or 256, k, v of one shape, heads a multiple of kv heads: "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got {k.shape[0]}")
    if batch * nheads > 65535:
        raise ValueError(f"batch x heads = {batch * nheads} exceeds the grid's second axis (65535)")
    for name, descale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if descale.shape != (batch, nheads_k) or descale.dtype != torch.float32 or descale.device != q.device:
            raise ValueError(f"{name}: float32 (batch, nheads_k) = ({batch}, {nheads_k}) on {q.device}, got "
                             f"{descale.dtype} {tuple(descale.shape)} on {descale.device}")
    if variant not in VARIANTS or not VARIANTS[variant][1]:
        raise ValueError(f"variant {variant!r}: one of the overlapped variants (ws-overlap, ws2, pingpong*)")
    consumers = VARIANTS[variant][2]
    block_m, block_n, stages, num_warps = _checked_tiles(tiles, d, variant, element_size=1, fp8=True)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    if seqlen_q == 0 or batch * nheads == 0:
        return out, lse
    if seqlen_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    q, k = map(configs.tma_ready_or_copy, (q, k))
    _, v_keys = keys_fastest(v)  # (batch, heads_k, d, >= seqlen_k) keys-fastest memory
    v_block = [1, 1, d, block_n]
    v_desc = TensorDescriptor(v_keys, [batch, nheads_k, d, seqlen_k], list(v_keys.stride()), v_block,
                              gl.NVMMASharedLayout.get_default_for(v_block, gl.float8e4nv))
    rows = block_m // consumers
    q_desc = _descriptor(q, rows)
    # P V's P from registers (K's keys permuted, configs.FP8_P_REGISTERS): two consumers at d <= 128 (d = 256 spills:
    # O takes 128 registers), three at d = 64 (at d = 128 their 160 registers spill 560 B, and it ran 0.64-0.69x
    # P through shared memory on an H100; carrying a float32 P spills at both)
    # (and only variants that release K early: pingpong-fa3, pingpong3-fa3, pingpong-early)
    # Else, under configs.FP8_P_WORDS, K permuted all the same where it can be, so that P goes to shared memory
    # as words of 4 keys (p_regs 2; 1: P from registers; 0: K in key order, P through shared memory by pairs).
    mode = configs.FP8_P_REGISTERS
    registers = VARIANTS[variant][5] and (consumers == 2 and d <= 128 and mode in ("carry", "wait")
                                          or consumers == 3 and d == 64 and mode == "wait")
    words = VARIANTS[variant][5] and configs.FP8_P_WORDS == "1"
    k_desc = _permuted_k_descriptor(k, block_n) if registers or words else None
    p_regs = 0 if k_desc is None else 1 if registers else 2
    k_desc = k_desc or _descriptor(k, block_n)
    configs.note_fixed_tile("_gluon_attn_fwd", f"{variant} fp8 BLOCK_M={block_m} BLOCK_N={block_n} "
                                               f"warps={num_warps} stages={stages}"
                                               f"{['', ' p_regs', ' p_words'][p_regs]}")
    # (raw_max: the row max over unscaled scores assumes a positive scale, descales included, as the Triton FP8
    # forward does: quantize's descales are positive)
    _launch((triton.cdiv(seqlen_q, block_m), batch * nheads),
            (q_desc, k_desc, v_desc, q_desc, lse, seqlen_q, seqlen_k, nheads, nheads // nheads_k,
             softmax_scale * LOG2E, batch * nheads, 1, lse, lse, out, out.stride(1), out.stride(2), 0,
             q_descale.contiguous(), k_descale.contiguous(), v_descale.contiguous(), out.stride(0), 0, 0, 0, 0, 0, 0),
            variant, (block_m, block_n, stages, num_warps), d, causal, fp8=True, raw_max=softmax_scale > 0,
            p_regs=p_regs)
    return out, lse
