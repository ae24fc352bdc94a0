"""Cutting one sequence into per-rank shards and putting it back together.

Layouts, for P ranks and a sequence cut into chunks along ``dim``:

* ``"contiguous"``: P chunks, rank r holds chunk r.
* ``"zigzag"``: 2P chunks, rank r holds chunks r and 2P-1-r (in that order). Under a causal mask every
  rank then does the same amount of work: an early chunk (few keys) paired with a late one (many).

The same helpers shard position ids ``(batch, seqlen)`` or anything else with a sequence dimension.
Packed variable-length batches (``cu_seqlens``) are sharded sequence by sequence: rank r's packed tensor
is the concatenation of its shard of every sequence, so its local ``cu_seqlens`` is the global one
divided by the world size (``shard_varlen`` / ``unshard_varlen`` / ``gather_varlen``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The part of the full sequence ``x`` that ``rank`` holds.

    Args:
        x: full tensor; ``x.shape[dim]`` must divide into ``2 * world_size`` (zigzag) or
            ``world_size`` (contiguous) equal chunks.

    Returns:
        (..., seqlen / world_size, ...) along ``dim``.
    """
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    chunks = 2 * world_size if layout == "zigzag" else world_size
    seqlen = x.shape[dim]
    if seqlen % chunks:
        raise ValueError(f"the sequence length {seqlen} (dim {dim}) must be a multiple of {chunks} for the "
                         f"{layout} layout over {world_size} ranks")
    parts = x.chunk(chunks, dim)
    if layout == "zigzag":
        return torch.cat([parts[rank], parts[chunks - 1 - rank]], dim)
    return parts[rank]


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from every rank's shard, in rank order."""
    _check_layout(layout)
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    halves = [s.chunk(2, dim) for s in shards]
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim)


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1,
                    layout: str = "zigzag") -> torch.Tensor:
    """All-gather every rank's shard and return the full sequence (on every rank). No autograd."""
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return unshard_sequence(shards, dim, layout)


def _varlen_bounds(cu_seqlens: torch.Tensor | Sequence[int], world_size: int, layout: str,
                   total: int | None = None) -> list[int]:
    """Host copy of cu_seqlens, checked: starts at 0, non-decreasing, ends at ``total`` (when given),
    each sequence's length a multiple of the layout's chunk count."""
    _check_layout(layout)
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not bounds or bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {bounds}")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"cu_seqlens[-1] ({bounds[-1]}) must equal the packed length ({total})")
    chunks = 2 * world_size if layout == "zigzag" else world_size
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if (end - start) % chunks:
            raise ValueError(f"cu_seqlens: sequence {i} has length {end - start}; every packed sequence's length "
                             f"must be a multiple of {chunks} for the {layout} layout over {world_size} ranks")
    return bounds


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world_size: int, dim: int = 0,
                 layout: str = "zigzag") -> torch.Tensor:
    """This rank's part of a packed batch: its shard of each sequence (see :func:`shard_sequence`), packed.

    Args:
        x: (total_tokens, ...) along ``dim``, sequences delimited by ``cu_seqlens`` (batch + 1,).

    Returns:
        (total_tokens / world_size, ...); its cu_seqlens is ``cu_seqlens // world_size``.
    """
    bounds = _varlen_bounds(cu_seqlens, world_size, layout, total=x.shape[dim])
    parts = [shard_sequence(x.narrow(dim, a, b - a), rank, world_size, dim, layout) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts, dim)


def unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor, dim: int = 0,
                   layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_varlen`: the packed batch from every rank's part, in rank order."""
    world = len(shards)
    local = [b // world for b in _varlen_bounds(cu_seqlens, world, layout, total=sum(s.shape[dim] for s in shards))]
    sequences = [unshard_sequence([s.narrow(dim, a, b - a) for s in shards], dim, layout)
                 for a, b in zip(local, local[1:])]
    return torch.cat(sequences, dim)


def gather_varlen(local: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None,
                  dim: int = 0, layout: str = "zigzag") -> torch.Tensor:
    """All-gather every rank's part of a packed batch and return the whole batch. No autograd."""
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return unshard_varlen(shards, cu_seqlens, dim, layout)
