"""Context parallelism on torch.distributed (NCCL on GPUs, gloo on CPU).

    from flashtile.distributed import ring_flash_attn_func, shard_sequence
    q_local = shard_sequence(q, rank, world_size)           # zigzag layout by default
    out_local = ring_flash_attn_func(q_local, k_local, v_local, causal=True)

Built on the public forward/backward with lse (``flashtile.interface``) and the lse merge
(``flashtile.merge``); it never reaches into the kernels. Varlen packing: ``ulysses_attn_varlen_func``
(each rank holds an equal slice of the packed token stream; sequences may cross slices). The ring
functions take dense (batch, seqlen) shards only: a packed stream would need each sequence zigzagged on
its own, which is not built. Every rank holds the same local length.
"""

from .ring import ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func
from .sharding import gather_sequence, shard_sequence, unshard_sequence
from .ulysses import ulysses_attn_func, ulysses_attn_varlen_func

__all__ = [
    "gather_sequence",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "shard_sequence",
    "ulysses_attn_func",
    "ulysses_attn_varlen_func",
    "unshard_sequence",
]
