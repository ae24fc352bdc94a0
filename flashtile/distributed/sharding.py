"""Cutting one sequence into per-rank shards and putting it back together.

Layouts, for P ranks and a sequence cut into chunks along ``dim``:

* ``"contiguous"``: P chunks, rank r holds chunk r.
* ``"zigzag"``: 2P chunks, rank r holds chunks r and 2P-1-r (in that order). Under a causal mask every
  rank then does the same amount of work: an early chunk (few keys) paired with a late one (many).

The same helpers shard position ids ``(batch, seqlen)`` or anything else with a sequence dimension.
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
