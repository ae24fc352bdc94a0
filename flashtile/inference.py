"""Inference: attention of a few new query tokens against a KV cache, appending the new keys in place.

``flash_attn_with_kvcache`` has flash-attn 2's signature. The cache is read where it lies: each batch
entry's keys are a (start, length) range of the flattened cache (or, paged, of its pages through the
block table), passed to the same forward kernel that packed sequences use, so no cache row is copied.
Split-KV decoding spreads long caches over more programs when batch x heads is small.
"""

from __future__ import annotations

import functools

import torch

from . import _ops
from .interface import (
    _check_dtype_device,
    _check_options,
    _check_tensor,
    pages_in_use_invalid,
    select_backend,
    tracing_or_capturing,
    values_readable,
)
from .options import CacheLengths


def _int32_vector(name: str, x: object, batch: int, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")
    return x


def _build_index_constants(batch: int, step: int, device) -> tuple[torch.Tensor, ...]:
    arange = torch.arange(batch, dtype=torch.int32, device=device)
    steps = torch.full_like(arange, step)
    bounds = torch.stack([arange * step, steps], dim=1).contiguous()
    return arange, bounds, torch.zeros_like(arange), steps


# Never evicted: a freed entry could still be read by a kernel queued on another stream, or by a CUDA
# graph captured with it.
_INDEX_CONSTANTS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}


def _index_constants(batch: int, step: int, device) -> tuple[torch.Tensor, ...]:
    """int32 index tensors: arange(batch), bounds [b * step, step] (batch, 2), zeros(batch),
    full(batch, step); read only.

    Cached per shape, so a decoding step does not launch them each time; a CUDA graph captured after
    an eager call of the same shape reads the cached ones too (built during a capture, each would be
    five small kernels in every replay of the graph). A tensor first made while a graph is captured
    holds its values only once the graph replays, so it is not kept; nor under torch.compile tracing.
    """
    if torch.compiler.is_compiling():
        return _build_index_constants(batch, step, device)
    key = (batch, step, torch.device(device))
    made = _INDEX_CONSTANTS.get(key)
    if made is not None:
        return made
    if tracing_or_capturing(device):
        return _build_index_constants(batch, step, device)
    made = _build_index_constants(batch, step, device)
    if key[2].type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # once per shape: ready before any stream reads them
    _INDEX_CONSTANTS[key] = made
    return made


def _check_cache_indices(seqlens, seqlen_new, limit, batch_idx, batch_cache, block_table, num_pages, leftpad,
                         page_size=1) -> int:
    """Index values that would send the kernel out of bounds raise here, before any launch. Returns the
    longest cache_seqlens + seqlen_new (the most keys a sequence has).

    Device-resident indices need a device-to-host read: one, for all checks together. It is skipped
    while a CUDA graph is captured or torch.compile traces (no host read is possible there), and with
    ``FLASHTILE_VALUE_CHECKS=0``.
    """
    # Few small kernels: a decoding step makes this check once per layer.
    stats = [*torch.aminmax(seqlens)]
    if batch_idx is not None:
        stats += [*torch.aminmax(batch_idx)]
    if block_table is not None:
        # The pages holding positions < cache_seqlens + seqlen_new, the ones read or written.
        stats += [pages_in_use_invalid(block_table, seqlens + seqlen_new, page_size, num_pages)]
    if leftpad is not None:
        stats += [leftpad.min(), (seqlens - leftpad).min()]
    values = torch.stack([x if x.dtype == torch.int32 else x.to(torch.int32) for x in stats]).tolist()
    lo, hi = values[0], values[1] + seqlen_new
    values = values[2:]
    if lo < 0 or hi > limit:
        raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {limit}] (the cache length); got up to {hi}")
    if batch_idx is not None:
        (idx_lo, idx_hi), values = values[:2], values[2:]
        if idx_lo < 0 or idx_hi >= batch_cache:
            raise ValueError(f"cache_batch_idx values must lie in [0, {batch_cache})")
    if block_table is not None:
        bad_page, values = values[0], values[1:]
        if bad_page:
            raise ValueError(f"block_table values of the pages in use must lie in [0, {num_pages}) (the pages of "
                             f"k_cache)")
    if leftpad is not None and (values[0] < 0 or values[1] < 0):
        raise ValueError("cache_leftpad must lie in [0, cache_seqlens]")
    return hi


@functools.cache
def _multiprocessors(device_index: int) -> int:
    # get_device_properties costs microseconds per call; a decoding step asks once per layer.
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_splits(q: torch.Tensor, batch: int, nheads: int, nheads_k: int, seqlen_q: int, max_keys: int,
                   per_head_state: bool) -> int:
    """Split-KV heuristic for ``num_splits=0``: as many splits as keep the programs within two per
    multiprocessor (rounded down: a third program on some of them makes those the last to finish),
    each split keeping at least 512 keys, at most 64 splits; 1 (no split) off the GPU."""
    if not q.is_cuda:
        return 1
    from .kernels import configs  # the launch layout (GQA packing) decides how many programs there are

    if configs.pack_gqa(nheads, nheads_k, seqlen_q, per_head_state):
        rows, programs = seqlen_q * (nheads // nheads_k), batch * nheads_k
    else:
        rows, programs = seqlen_q, batch * nheads
    sms = _multiprocessors(q.device.index if q.device.index is not None else torch.cuda.current_device())
    blocks = programs * max(1, -(-rows // configs.FEW_ROWS))
    splits = min(2 * sms // blocks, max_keys // 512, 64)
    return max(1, splits)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of the first 2 * cos.shape[-1] features of x (B, T, heads, D); cos/sin (B, T, R/2)."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    cos, sin = cos[:, :, None, :].float(), sin[:, :, None, :].float()
    if interleaved:  # pairs (0, 1), (2, 3), ...
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:  # halves (i, i + R/2), GPT-NeoX style
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of q against a KV cache, after writing the new k, v into it in place. Forward only.

    Args:
        q: (batch, seqlen_q, nheads, headdim), the new queries (1 for decoding, more for chunked
            prefill or speculative decoding).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), contiguous over the first two
            dims; updated in place when k, v are given.
        k, v: None, or (batch, seqlen_new, nheads_k, headdim) new keys/values, written at positions
            ``cache_seqlens .. cache_seqlens + seqlen_new - 1`` of their cache rows.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2) tables; rotary is applied to the new
            k at positions ``cache_seqlens - cache_leftpad + i`` and to q at the same positions when
            causal or windowed, else at ``cache_seqlens - cache_leftpad``. ``rotary_interleaved`` rotates
            pairs (0, 1), (2, 3), ... instead of the two halves.
        cache_seqlens: int or int32 (batch,): tokens already in each cache row (before the append).
            None means the whole cache (then k, v must be None).
        cache_batch_idx: None or int32 (batch,): the cache row of each batch entry.
        cache_leftpad: None or int32 (batch,): each row's first valid cache position.
        block_table: None, or int32 (batch, max_pages): a paged cache. k_cache/v_cache are then a pool
            (num_pages, page_size, nheads_k, headdim) of pages of any size; entry b's logical position p
            lives in page ``block_table[b, p // page_size]`` at row ``p % page_size``.
        causal, window_size, softcap, alibi_slopes, softmax_scale: as in ``flash_attn_func``; the new
            queries are aligned to the end of each row's keys (bottom-right).
        num_splits: split-KV decoding: the keys of each query block are split across this many programs
            and the partial results merged by lse; 0 chooses from the shape and the multiprocessor
            count (the PyTorch path computes the same result unsplit).
        return_softmax_lse: also return the float32 lse (batch, nheads, seqlen_q).

    Returns:
        out (batch, seqlen_q, nheads, headdim), and lse if ``return_softmax_lse``.
    """
    _check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_tensor("k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _check_tensor("v_cache", v_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    batch, seqlen_q, nheads, headdim = q.shape
    batch_cache, seqlen_cache, nheads_k, _ = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if k_cache.shape[3] != headdim:
        raise ValueError(f"headdim must match: q {headdim}, k_cache {k_cache.shape[3]}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(0) != seqlen_cache * cache.stride(1):
            raise ValueError(f"{name} must be contiguous over its first two dims: strides {cache.stride()}")
    paged = block_table is not None
    if paged:
        # Paged: k_cache is a pool (num_pages, page_size, nheads_k, headdim); block_table maps each batch
        # entry's logical pages to pool pages.
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be an int32 tensor, got "
                            f"{block_table.dtype if isinstance(block_table, torch.Tensor) else type(block_table)}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape ({batch}, max_pages), got {tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device}, expected {q.device}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the table already maps rows)")
        num_pages, page_size = batch_cache, seqlen_cache
        capacity = block_table.shape[1] * page_size  # longest sequence the table can hold
    backend = select_backend(q.device)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens) or both be None")
    seqlen_new = 0
    if k is not None:
        _check_tensor("k", k, 4, "(batch, seqlen_new, nheads_k, headdim)")
        _check_tensor("v", v, 4, "(batch, seqlen_new, nheads_k, headdim)")
        expected = (batch, k.shape[1], nheads_k, headdim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"k and v must have shape {expected}, got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
        tensors.update(k=k, v=v)
    _check_dtype_device(tensors, backend)
    opts = _check_options(0.0, softmax_scale, window_size, softcap, alibi_slopes, headdim, causal, q, batch)

    device = q.device
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when new k, v are appended")
        seqlens = _index_constants(batch, seqlen_cache, device)[3]  # the whole cache: one per shape
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        seqlens = _int32_vector("cache_seqlens", cache_seqlens, batch, device)
    rows = (_int32_vector("cache_batch_idx", cache_batch_idx, batch, device) if cache_batch_idx is not None
            else _index_constants(batch, 1, device)[0])
    leftpad = (_int32_vector("cache_leftpad", cache_leftpad, batch, device) if cache_leftpad is not None
               else None)
    if not paged and cache_batch_idx is None and batch > batch_cache:
        raise ValueError(f"batch ({batch}) exceeds the cache's batch ({batch_cache}) and no cache_batch_idx is given")
    longest = None  # the most keys of any sequence, when known
    if not isinstance(cache_seqlens, torch.Tensor) and not paged and cache_batch_idx is None and cache_leftpad is None:
        # Every index is known here (an int or the whole cache): checked without reading the GPU.
        longest = (seqlen_cache if cache_seqlens is None else cache_seqlens) + seqlen_new
        if longest - seqlen_new < 0 or longest > seqlen_cache:
            raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache length); got "
                             f"{longest}")
    elif values_readable(device):
        longest = _check_cache_indices(seqlens, seqlen_new, capacity if paged else seqlen_cache,
                             rows if cache_batch_idx is not None else None, batch_cache,
                             block_table, num_pages if paged else 0, leftpad, page_size if paged else 1)
    if leftpad is None:
        leftpad = _index_constants(batch, 1, device)[2]

    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape or 2 * rotary_cos.shape[1] > headdim:
            raise ValueError(f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
                             f"{headdim}, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        start = (seqlens - leftpad).long()  # position of the first new token in its sequence
        steps = torch.arange(max(seqlen_new, seqlen_q), device=device)
        if k is not None:
            pos_k = start[:, None] + steps[None, :seqlen_new]
            k = _rotate(k, rotary_cos[pos_k], rotary_sin[pos_k], rotary_interleaved)
        local = causal or tuple(window_size) != (-1, -1)
        pos_q = start[:, None] + (steps[None, :seqlen_q] if local else 0 * steps[None, :seqlen_q])
        q = _rotate(q, rotary_cos[pos_q], rotary_sin[pos_q], rotary_interleaved)

    with torch.no_grad():
        k_flat = k_cache.view(batch_cache * seqlen_cache, nheads_k, headdim)
        v_flat = v_cache.view(batch_cache * seqlen_cache, nheads_k, headdim)
        if k is not None and backend == "triton" and not torch.compiler.is_compiling():
            # One launch for both caches instead of an index computation and two scatters.
            _ops._triton_backend().append_kv(
                k, v, k_flat, v_flat, seqlens.contiguous(), rows.contiguous() if cache_batch_idx is not None else None,
                block_table.contiguous() if paged else None, page_size if paged else 0, seqlen_cache,
                capacity if paged else seqlen_cache)
        elif k is not None:
            slots = seqlens.long()[:, None] + torch.arange(seqlen_new, device=device)[None, :]  # logical
            if paged:
                flat = block_table.long().gather(1, slots // page_size) * page_size + slots % page_size
            else:
                flat = rows.long()[:, None] * seqlen_cache + slots
            k_flat[flat] = k
            v_flat[flat] = v
        # Each batch entry's keys: positions [leftpad, seqlens + seqlen_new) of its cache row (or of its
        # pages, when paged: the kernel then starts from logical positions).
        # Few small ops on purpose: in a decoding step each one is a launch next to a kernel of ~0.1 ms.
        bounds_q = _index_constants(batch, seqlen_q, device)[1]
        if cache_leftpad is None and cache_batch_idx is None:
            # Sequence b's keys start at row b of the cache (a paged cache: at logical position 0 of its
            # pages, row stride 0): the kernels read the lengths as they are, no bounds kernel per step.
            length = (seqlens + seqlen_new if seqlen_new else seqlens).contiguous()
            bounds_k = CacheLengths(length, 0 if paged else seqlen_cache)
        else:
            if cache_leftpad is None:
                start = rows * seqlen_cache  # not paged here: a paged cache takes no cache_batch_idx
                length = seqlens + seqlen_new if seqlen_new else seqlens
            else:
                start = leftpad if paged else rows * seqlen_cache + leftpad
                length = seqlens + seqlen_new - leftpad
            bounds_k = torch.stack([start, length], dim=1)
        q_flat = q.reshape(batch * seqlen_q, nheads, headdim)
        varlen = (bounds_q, bounds_k, seqlen_q, capacity if paged else seqlen_cache)
        # Split by the keys there are (the same for a paged and a contiguous cache). Without the read
        # (CUDA-graph capture, FLASHTILE_VALUE_CHECKS=0) by capacity, which a paged table's padding
        # columns can make larger: the split count, and so the last bits of out, can then differ.
        splits = num_splits or _choose_splits(q, batch, nheads, nheads_k, seqlen_q,
                                              varlen[3] if longest is None else longest, False)
        out, lse = _ops.run_forward(q_flat, k_flat, v_flat, opts, backend, varlen,
                                    (block_table.contiguous(), page_size) if paged else None, splits)
    out = out.view(batch, seqlen_q, nheads, headdim)
    if return_softmax_lse:
        return out, lse.float().view(nheads, batch, seqlen_q).permute(1, 0, 2)
    return out
