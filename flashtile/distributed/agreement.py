"""Argument checks that every rank passes or fails together.

A distributed function that raises on one rank while the others go on into a collective leaves them
waiting forever. So each entry point runs its local checks, then one ``all_gather_object`` shares every
rank's outcome (an error, or the facts the ranks must agree on: shard lengths, cu_seqlens), and all ranks
raise the same error — naming the rank — or go on together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_ERRORS = {cls.__name__: cls for cls in (ValueError, TypeError, NotImplementedError)}


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashtile.distributed needs torch.distributed initialised (init_process_group)")


def agreed(group: dist.ProcessGroup | None, local_check: Callable[[], Any], what: str) -> Any:
    """Run ``local_check()`` on every rank; raise its error on all ranks if it failed anywhere, or if the
    facts it returned differ between ranks (``what`` names them); else return the common facts."""
    require_initialized()
    try:
        outcome = (None, local_check())
    except tuple(_ERRORS.values()) as exc:
        outcome = ((type(exc).__name__, str(exc)), None)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, outcome, group=group)
    for rank, (error, _) in enumerate(gathered):
        if error is not None:
            kind, message = error
            raise _ERRORS[kind](f"rank {rank}: {message}")
    facts = [f for _, f in gathered]
    if any(f != facts[0] for f in facts):
        raise ValueError(f"every rank must pass the same {what}; got {facts}")
    return facts[0]
