"""Context parallelism on torch.distributed (NCCL on GPUs, gloo on CPU).

    from flashtile.distributed import ring_flash_attn_func, shard_sequence
    q_local = shard_sequence(q, rank, world_size)           # zigzag layout by default
    out_local = ring_flash_attn_func(q_local, k_local, v_local, causal=True)

Built on the public forward/backward with lse (``flashtile.interface``) and the lse merge
(``flashtile.merge``); it never reaches into the kernels. Varlen packing: ``ulysses_attn_varlen_func``
(each rank holds an equal slice of the packed token stream; sequences may cross slices) and
``ring_flash_attn_varlen_func`` (every sequence sharded on its own with ``shard_varlen``; one ring pass
per sequence, so meant for a few long sequences). Every rank holds the same local length.
"""

from .ring import (
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
)
from .sharding import gather_sequence, gather_varlen, shard_sequence, shard_varlen, unshard_sequence, unshard_varlen
from .ulysses import ulysses_attn_func, ulysses_attn_varlen_func

__all__ = [
    "gather_sequence",
    "gather_varlen",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "shard_sequence",
    "shard_varlen",
    "ulysses_attn_func",
    "ulysses_attn_varlen_func",
    "unshard_sequence",
    "unshard_varlen",
]
