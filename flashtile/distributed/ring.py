"""Ring attention: context parallelism over a sequence sharded across the ranks of a process group.

Each rank keeps its queries; K/V blocks travel around the ring (rank r sends to r+1 and receives from
r-1) with ``batch_isend_irecv``, the next block in flight while the current one is attended. Partial
outputs merge in float32 (float64 for float64 inputs) by their logsumexp (``flashtile.merge``). The
backward sends K/V around again; every block's gradients are computed against the final ``out`` and
``lse`` of the whole sequence, so they are exact shares that simply add up. dK/dV accumulators travel
with their block and arrive home after a full turn. With ``causal=True`` use the zigzag layout (see
``sharding.py``): every step then costs every rank the same.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..interface import _check_options, _check_qkv, flash_attn_backward, flash_attn_forward, flash_attn_varlen_func
from ..merge import merge_attention_states
from .agreement import agreed
from .sharding import _check_layout, _varlen_bounds

_KV_TAG, _GRAD_TAG = 0, 1


class _Ring:
    """Neighbours in the group and a non-blocking shift of tensors one step around the ring."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group or dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def shift(self, tensors: list[torch.Tensor], tag: int):
        """Start sending ``tensors`` to the next rank and receiving their likes from the previous one."""
        if self.world == 1:
            # A ring of one rank (context-parallel degree 1 inside data parallelism): the shift is the identity.
            # A send to oneself is refused by gloo ("Pair is not connected").
            return [], list(tensors), list(tensors)
        # The send buffers must outlive the asynchronous sends: they travel with the handle until wait().
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        return dist.batch_isend_irecv(ops), received, sent

    @staticmethod
    def wait(pending) -> list[torch.Tensor]:
        requests, received, _sent = pending
        for request in requests:
            request.wait()
        return received


def _plan(step: int, source: int, rank: int, causal: bool, layout: str):
    """What this step computes: (query rows, key rows, causal) as slices of the halves, or None to skip.

    ``"all"`` means every local row; ``"first"``/``"second"`` the first/second half of the local shard.
    """
    if not causal:
        return "all", "all", False
    if step == 0:
        return "all", "all", True  # the diagonal block: local causal mask
    if layout == "zigzag":
        # An earlier source: both local chunks see its first chunk in full and not its second.
        # A later source: only the local second chunk sees it, in full.
        return ("all", "first", False) if source < rank else ("second", "all", False)
    return ("all", "all", False) if source < rank else None


def _rows(x: torch.Tensor, part: str, dim: int = 1) -> torch.Tensor:
    if part == "all":
        return x
    half = x.shape[dim] // 2
    return x.narrow(dim, 0, half) if part == "first" else x.narrow(dim, half, x.shape[dim] - half)


def _ring_forward(q, k, v, scale, causal, layout, ring: _Ring, softcap: float = 0.0):
    batch, seqlen, nheads, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((batch, nheads, seqlen), -math.inf, dtype=acc, device=q.device)
    cur_k, cur_v = k, v
    for step in range(ring.world):
        pending = ring.shift([cur_k, cur_v], _KV_TAG) if step + 1 < ring.world else None
        plan = _plan(step, (ring.rank - step) % ring.world, ring.rank, causal, layout)
        if plan is not None:
            q_part, kv_part, block_causal = plan
            # Softcap acts on each score alone, so it applies block by block unchanged.
            part_out, part_lse = flash_attn_forward(_rows(q, q_part), _rows(cur_k, kv_part), _rows(cur_v, kv_part),
                                                    scale, block_causal, softcap=softcap)
            rows_out, rows_lse = _rows(out, q_part), _rows(lse, q_part, dim=2)
            merged_out, merged_lse = merge_attention_states(rows_out, rows_lse, part_out, part_lse, out_dtype=acc)
            rows_out.copy_(merged_out)
            rows_lse.copy_(merged_lse)
        if pending is not None:
            cur_k, cur_v = _Ring.wait(pending)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, scale, causal, layout, ring: _Ring, softcap: float = 0.0):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    cur_k, cur_v = k, v
    grads_pending = None
    for step in range(ring.world):
        kv_pending = ring.shift([cur_k, cur_v], _KV_TAG) if step + 1 < ring.world else None
        plan = _plan(step, (ring.rank - step) % ring.world, ring.rank, causal, layout)
        dk_p = dv_p = None
        if plan is not None:
            q_part, kv_part, block_causal = plan
            dq_p, dk_p, dv_p = flash_attn_backward(
                _rows(dout, q_part), _rows(q, q_part), _rows(cur_k, kv_part), _rows(cur_v, kv_part),
                _rows(out, q_part), _rows(lse, q_part, dim=2).contiguous(), scale, block_causal, softcap=softcap,
            )
            _rows(dq, q_part).add_(dq_p)
            del dq_p
        if grads_pending is None:
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            # The accumulated gradients of the block now held arrive from the previous rank (their
            # transfer overlapped this step's kernels); this step's share is added in place, so only the
            # buffers in flight are held in float32, not a per-step copy as well (the 2M-token run on two
            # H200s peaked at 110 GiB per GPU with one).
            dk_acc, dv_acc = _Ring.wait(grads_pending)
        if dk_p is not None:
            _rows(dk_acc, kv_part).add_(dk_p)
            _rows(dv_acc, kv_part).add_(dv_p)
            del dk_p, dv_p
        grads_pending = ring.shift([dk_acc, dv_acc], _GRAD_TAG)
        del dk_acc, dv_acc  # the pending send holds them until it completes
        if kv_pending is not None:
            cur_k, cur_v = _Ring.wait(kv_pending)
    dk, dv = _Ring.wait(grads_pending)  # this rank's own block, after a full turn
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, group, softcap=0.0):
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, scale, causal, layout, ring, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.layout, ctx.group, ctx.softcap = scale, causal, layout, group, softcap
        lse_user = lse.float()
        ctx.mark_non_differentiable(lse_user)
        ctx.set_materialize_grads(False)  # no zero tensor made for lse's gradient on each backward
        return out, lse_user

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out's gradient undefined (not materialized)
            return (None,) * len(ctx.needs_input_grad)
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.causal, ctx.layout,
                               _Ring(ctx.group), ctx.softcap)
        return (*grads, None, None, None, None, None)


def _check_local_shards(q: torch.Tensor, k: torch.Tensor, layout: str) -> int:
    """This rank's shard checks; returns its local sequence length."""
    _check_layout(layout)
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (batch, seqlen_local, heads, headdim) tensors; got "
                         f"{getattr(q, 'shape', type(q).__name__)}, {getattr(k, 'shape', type(k).__name__)}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same local sequence length, got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout needs an even local sequence length (two chunks), got {q.shape[1]}")
    return q.shape[1]


def _check_shards(q: torch.Tensor, k: torch.Tensor, layout: str, group, extra=None,
                  options: str = "options (softmax_scale, causal, softcap)"):
    """Shard checks on every rank together (see ``agreement``): every rank must hold a shard of the same
    length, batch, heads, head dim and dtype, in the same layout. ``extra()`` runs more local checks
    inside the same agreement and returns more facts that must match (the options, named by ``options``)."""

    def local():
        facts = (_check_local_shards(q, k, layout), q.shape[0], q.shape[2], k.shape[2], q.shape[3], str(q.dtype),
                 layout)
        return facts + (extra(),) if extra is not None else facts

    fields = ("local sequence length", "batch", "nheads", "nheads_k", "headdim", "dtype", "layout", options)
    return agreed(group, local, fields if extra is not None else fields[:-1],
                  device=q.device if isinstance(q, torch.Tensor) else None)


def _check_packed(x, parts: int, name: str, shape: str, group) -> None:
    """A packed argument's shape, checked before it is unbound; where it is wrong, this rank's error goes
    through the ranks' agreement (``agreed``): the others, in that same exchange from their own call, raise it
    too instead of waiting in it."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[2] != parts:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__

        def fail():
            raise ValueError(f"{name} must be a tensor of shape {shape}, got {got}")

        agreed(group, fail, name)


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
):
    """Attention over a sequence sharded across ``group``; flash-attn's tail of arguments.

    Args:
        q: (batch, seqlen / world_size, nheads, headdim), this rank's shard (see ``shard_sequence``).
        k, v: (batch, seqlen / world_size, nheads_k, headdim), sharded the same way.
        layout: ``"zigzag"`` (default; balanced under ``causal``) or ``"contiguous"``.
        group: the process group (default: the world).

    Returns:
        out: this rank's shard of the output; with ``return_attn_probs=True`` also its float32 lse
        (batch, nheads, seqlen / world_size) and None. Gradients flow to q, k, v.
    """
    def options():
        _check_qkv(q, k, v)
        return _ring_options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)

    scale, causal, softcap = _check_shards(q, k, layout, group, extra=options)[-1]
    out, lse = _RingAttention.apply(q, k, v, scale, causal, layout, group, softcap)
    return (out, lse, None) if return_attn_probs else out


def _ring_options(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes) -> tuple:
    """The checked (softmax_scale, causal, softcap) of a ring call: facts every rank must share."""
    opts = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q,
                          q.shape[0])
    if (opts.window_left, opts.window_right) != (-1, -1) or alibi_slopes is not None or dropout_p > 0:
        # These depend on global positions (window, ALiBi) or a global RNG layout (dropout).
        raise NotImplementedError("ring attention supports causal, full and softcap attention (no window_size, "
                                  "alibi_slopes or dropout_p yet)")
    return (opts.softmax_scale, bool(causal), opts.softcap)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                  group=None, layout="zigzag"):
    """:func:`ring_flash_attn_func` with kv packed as (batch, seqlen / world_size, 2, nheads_k, headdim)."""
    _check_packed(kv, 2, "kv", "(batch, seqlen_local, 2, nheads_k, headdim)", group)
    return ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                                softcap, alibi_slopes, deterministic, return_attn_probs, group, layout)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                   group=None, layout="zigzag"):
    """:func:`ring_flash_attn_func` with qkv packed as (batch, seqlen / world_size, 3, nheads, headdim)."""
    _check_packed(qkv, 3, "qkv", "(batch, seqlen_local, 3, nheads, headdim)", group)
    return ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                                window_size, softcap, alibi_slopes, deterministic, return_attn_probs, group, layout)


def ring_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
):
    """Ring attention over a packed batch of sequences, each sharded across ``group`` on its own.

    One ring pass per sequence (the dense ring on that sequence's shard): meant for a few long
    sequences, what ring attention is for. Many short sequences are better served by
    ``ulysses_attn_varlen_func`` (one all-to-all for the whole batch).

    Args:
        q: (total / world_size, nheads, headdim): this rank's part, from ``shard_varlen``.
        k, v: (total / world_size, nheads_k, headdim), sharded the same way (self-attention: one
            ``cu_seqlens`` for queries and keys).
        cu_seqlens: int32 (batch + 1,), the *global* cumulative lengths, the same on every rank; each
            length a multiple of 2 * world_size (zigzag) or world_size (contiguous).
        max_seqlen: the longest global sequence.

    Returns:
        out (total / world_size, nheads, headdim); with ``return_attn_probs`` also lse float32
        (nheads, total / world_size) and None. Gradients flow to q, k, v.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1

    def local_check():
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                raise ValueError(f"{name} must be (total_tokens / world_size, heads, headdim), got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise TypeError("cu_seqlens must be a 1-D int32 tensor (the global cumulative sequence lengths)")
        bounds = _varlen_bounds(cu_seqlens, world, layout)
        if q.shape[0] * world != bounds[-1] or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            raise ValueError(f"q, k, v must hold total / world_size = {bounds[-1]} / {world} tokens each; got "
                             f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
        longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or longest > max_seqlen:
            raise ValueError(f"max_seqlen ({max_seqlen!r}) must be an int >= the longest sequence ({longest})")
        _check_qkv(q[None], k[None], v[None])
        options = _ring_options(q[None], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
        return (bounds, q.shape[1:], k.shape[1:], str(q.dtype), layout, options)

    # One agreement up front: a rank that stopped here, or arguments that differ between ranks, would
    # otherwise leave the others waiting in the first ring pass (or compute something else).
    bounds, *_, (scale, causal, softcap) = agreed(
        group, local_check, ("cu_seqlens", "q (nheads, headdim)", "k (nheads_k, headdim)", "dtype", "layout",
                             "options (softmax_scale, causal, softcap)"),
        device=q.device if isinstance(q, torch.Tensor) else None)
    outs, lses = [], []
    local = [b // world for b in bounds]
    for start, end in zip(local, local[1:]):
        if start == end:
            continue  # an empty sequence: no rows, no pass (every rank skips it alike)
        # Checked above, for every sequence and on every rank: straight to the ring.
        out, lse = _RingAttention.apply(q[None, start:end], k[None, start:end], v[None, start:end], scale, causal,
                                        layout, group, softcap)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:
        # No rows at all: the single-process call's empty result, with its autograd history (gradients of q, k
        # and v come back empty instead of an error).
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, 0, 0, softmax_scale=scale, causal=causal,
                                             softcap=softcap, return_attn_probs=True)
    else:
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse, None) if return_attn_probs else out
