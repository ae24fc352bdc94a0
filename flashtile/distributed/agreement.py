"""Argument checks that every rank passes or fails together.

A distributed function that raises on one rank while the others go on into a collective leaves them
waiting forever. So each entry point runs its local checks, then one ``all_gather_object`` shares every
rank's outcome (an error, or the facts the ranks must agree on: shard lengths, cu_seqlens), and all ranks
raise the same error — naming the rank — or go on together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..interface import value_checks_enabled

_ERRORS = {cls.__name__: cls for cls in (ValueError, TypeError, NotImplementedError)}


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashtile.distributed needs torch.distributed initialised (init_process_group)")


def agreed(group: dist.ProcessGroup | None, local_check: Callable[[], Any], what: str | tuple[str, ...],
           device: torch.device | None = None) -> Any:
    """Run ``local_check()`` on every rank; raise on all ranks if it failed anywhere, or if the facts it
    returned differ between ranks (``what`` names them: one name, or one per field of a tuple of facts);
    else return the common facts.

    The failing rank re-raises its own exception; the others raise the same type (ValueError,
    TypeError, NotImplementedError; RuntimeError for anything else) with the message, naming the rank.
    ``device``: the tensors' device; NCCL exchanges the objects through the current CUDA device, so a
    caller that never called ``torch.cuda.set_device`` still talks from the right GPU.
    The exchange is a host synchronisation per call; ``FLASHTILE_VALUE_CHECKS=0`` skips it, and so does
    torch.compile's tracing, which cannot put an object exchange in a graph (each rank then only checks its
    own arguments).
    """
    require_initialized()
    if group is not None and dist.get_rank(group) < 0:  # (-1: this rank is not in the group)
        raise ValueError(f"this rank ({dist.get_rank()}) is not in the process group it passed (group=): only the "
                         "group's ranks may call with it")
    if not value_checks_enabled() or torch.compiler.is_compiling():
        return local_check()  # local checks only, no exchange (no host sync)
    failure = None
    try:
        outcome = (None, local_check())
    except Exception as exc:  # every kind: a lone raise on one rank would leave the others waiting
        failure = exc
        outcome = ((type(exc).__name__, str(exc)), None)
    gathered: list = [None] * dist.get_world_size(group)
    with torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(gathered, outcome, group=group)
    if failure is not None:
        raise failure
    for rank, (error, _) in enumerate(gathered):
        if error is not None:
            kind, message = error
            raise _ERRORS.get(kind, RuntimeError)(f"rank {rank}: {message}")
    facts = [f for _, f in gathered]
    if any(f != facts[0] for f in facts):
        if isinstance(what, tuple):  # name the first field that differs
            field = next(i for i in range(len(what)) if any(f[i] != facts[0][i] for f in facts))
            raise ValueError(f"every rank must pass the same {what[field]}; got {[f[field] for f in facts]}")
        raise ValueError(f"every rank must pass the same {what}; got {facts}")
    return facts[0]
