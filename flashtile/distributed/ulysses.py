"""Ulysses (head-parallel) attention: trade the sequence shard for a head shard with two all-to-alls.

Each rank starts with a shard of the sequence and all heads, exchanges pieces so that it holds the whole
sequence for ``nheads / world_size`` heads, runs ordinary flashtile attention locally, and exchanges the
output back. Each rank sends and receives about its own shard's bytes per all-to-all, whatever the number of
ranks, but the head count must divide by the world size. K/V heads of GQA that do not divide are replicated
up to the query heads first.

``ulysses_attn_varlen_func`` does the same for packed variable-length batches: each rank holds an equal
contiguous slice of the packed token stream (sequences may cross slice boundaries), the all-to-all
gathers the whole stream for its head group, and the varlen kernel sees the global ``cu_seqlens``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..interface import _check_options, _check_qkv, flash_attn_func, flash_attn_varlen_func
from .agreement import agreed
from .ring import _check_shards
from .sharding import shard_sequence, unshard_sequence


def _seq_to_heads(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """(batch, seqlen_local, heads, d) sharded on sequence -> (batch, seqlen, heads / P, d) on heads."""
    world = dist.get_world_size(group)
    batch, seqlen_local, heads, headdim = x.shape
    send = x.reshape(batch, seqlen_local, world, heads // world, headdim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)  # (P: source rank's sequence shard, B, S_local, H/P, D)
    dist.all_to_all_single(received, send, group=group)
    shards = list(received.unbind(0))
    return unshard_sequence(shards, dim=1, layout=layout)


def _heads_to_seq(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    world = dist.get_world_size(group)
    shards = [shard_sequence(x, r, world, dim=1, layout=layout) for r in range(world)]
    send = torch.stack(shards).contiguous()  # (P: destination rank, B, S_local, H/P, D)
    received = torch.empty_like(send)  # (P: source rank's head group, B, S_local, H/P, D)
    dist.all_to_all_single(received, send, group=group)
    batch, seqlen_local, heads_local, headdim = received.shape[1:]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, seqlen_local, world * heads_local, headdim)


class _AllToAll(torch.autograd.Function):
    """Sequence shards -> head shards (``to_heads``) or back; the gradient takes the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, layout, to_heads: bool):
        ctx.group, ctx.layout, ctx.to_heads = group, layout, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, layout)

    @staticmethod
    def backward(ctx, grad):
        exchange = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return exchange(grad.contiguous(), ctx.group, ctx.layout), None, None, None


def ulysses_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
) -> torch.Tensor:
    """Head-parallel attention over a sequence sharded across ``group``.

    Args:
        q: (batch, seqlen / world_size, nheads, headdim), this rank's shard; nheads % world_size == 0.
        k, v: (batch, seqlen / world_size, nheads_k, headdim); kv heads are replicated up to nheads when
            nheads_k does not divide by the world size.
        layout: how the sequence was sharded (``"zigzag"`` or ``"contiguous"``), so that the gathered
            sequence is put back in order before the causal mask applies.

    Returns:
        this rank's shard of the output, (batch, seqlen / world_size, nheads, headdim).
    """
    def local():
        _check_qkv(q, k, v)
        _check_heads(q.shape[2], k.shape[2], dist.get_world_size(group))
        opts = _check_options(0.0, softmax_scale, (-1, -1), 0.0, None, q.shape[-1], causal, q, q.shape[0])
        return (opts.softmax_scale, bool(causal))

    _check_shards(q, k, layout, group, extra=local, options="options (softmax_scale, causal)")
    k, v = _replicate_kv_heads(k, v, q.shape[2], dist.get_world_size(group), head_dim=2)
    q_h, k_h, v_h = (_AllToAll.apply(x, group, layout, True) for x in (q, k, v))
    out_h = flash_attn_func(q_h, k_h, v_h, softmax_scale=softmax_scale, causal=causal)
    return _AllToAll.apply(out_h, group, layout, False)


def _check_heads(nheads: int, nheads_k: int, world: int) -> None:
    if nheads % world:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the world size ({world}) for Ulysses")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")


def _replicate_kv_heads(k: torch.Tensor, v: torch.Tensor, nheads: int, world: int, head_dim: int):
    nheads_k = k.shape[head_dim]
    if nheads_k % world:
        # Replicate kv heads so that each rank's head group finds its own kv heads locally.
        k = k.repeat_interleave(nheads // nheads_k, dim=head_dim)
        v = v.repeat_interleave(nheads // nheads_k, dim=head_dim)
    return k, v


def ulysses_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Head-parallel attention over a packed variable-length batch whose tokens are sharded across ``group``.

    Args:
        q: (total_q / world_size, nheads, headdim): this rank's contiguous slice of the packed queries
            (rank r holds tokens [r * total_q / P, (r + 1) * total_q / P)); nheads % world_size == 0.
        k, v: (total_k / world_size, nheads_k, headdim), sliced the same way.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), the *global* cumulative lengths, the same on
            every rank. max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size: as in
            ``flash_attn_varlen_func``.

    Returns:
        this rank's slice of the output, (total_q / world_size, nheads, headdim).
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1

    def local_check():
        if not all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (q, k, v)):
            raise ValueError("q, k, v must be (tokens_local, heads, headdim) tensors; got "
                             f"{[getattr(x, 'shape', type(x).__name__) for x in (q, k, v)]}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        _check_qkv(q[None], k[None], v[None])
        _check_heads(q.shape[1], k.shape[1], world)
        cu = []
        for name, x, tokens in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
            if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.dim() != 1 or x.numel() < 2:
                raise TypeError(f"{name} must be a 1-D int32 tensor of batch + 1 >= 2 entries (the global "
                                "cumulative lengths)")
            values = x.tolist()
            if values[-1] != tokens * world:
                raise ValueError(f"{name}[-1] ({values[-1]}) must equal world_size x this rank's tokens "
                                 f"({world} x {tokens}); every rank holds an equal slice")
            longest = max((b - a for a, b in zip(values, values[1:])), default=0)
            max_seqlen = max_seqlen_q if name == "cu_seqlens_q" else max_seqlen_k
            if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or longest > max_seqlen:
                raise ValueError(f"max_seqlen for {name} ({max_seqlen!r}) must be an int >= the longest sequence "
                                 f"({longest})")
            cu.append(values)
        opts = _check_options(0.0, softmax_scale, window_size, 0.0, None, q.shape[-1], causal, q, len(cu[0]) - 1)
        return (q.shape[0], k.shape[0], cu, q.shape[1:], k.shape[1:], str(q.dtype),
                (opts.softmax_scale, bool(causal), (opts.window_left, opts.window_right)))

    # Equal slices and the same cu_seqlens on every rank, agreed before the first all-to-all: a rank that
    # stopped alone would leave the others waiting, and differing cu_seqlens would be silently wrong.
    agreed(group, local_check, ("q tokens", "k tokens", "cu_seqlens (q, k)", "q (nheads, headdim)",
                                "k (nheads_k, headdim)", "dtype", "options (softmax_scale, causal, window_size)"),
           device=q.device if isinstance(q, torch.Tensor) else None)
    k, v = _replicate_kv_heads(k, v, q.shape[1], world, head_dim=1)
    q_h, k_h, v_h = (_AllToAll.apply(x.unsqueeze(0), group, "contiguous", True).squeeze(0) for x in (q, k, v))
    out_h = flash_attn_varlen_func(q_h, k_h, v_h, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    return _AllToAll.apply(out_h.unsqueeze(0), group, "contiguous", False).squeeze(0)
