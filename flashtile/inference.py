"""Inference: attention of a few new query tokens against a KV cache, appending the new keys in place.

``flash_attn_with_kvcache`` has flash-attn 2's signature. The cache is read where it lies: each batch
entry's keys are a (start, length) range of the flattened cache (or, paged, of its pages through the
block table), passed to the same forward kernel that packed sequences use, so no cache row is copied.
Split-KV decoding spreads long caches over more programs when batch x heads is small.
"""

from __future__ import annotations

import numbers
import os

import torch
from torch._subclasses.fake_tensor import is_fake

from . import _ops
from .interface import (
    _check_dtype_device,
    _check_options,
    _check_tensor,
    _is_bool,
    _window_pair,
    made_outside_graph_pool,
    pages_in_use_invalid,
    select_backend,
    tensor_state,
    tracing_or_capturing,
    unchanged_since,
    values_readable,
)
from .options import CacheLengths

# Fixed at import: "1" (the default) makes a decoding step on a 16-bit cache of pitch seqlen_cache (no
# cache_batch_idx, cache_leftpad or block_table) one launch: the attention kernel reads the new keys from k and v
# and writes them into the cache itself, instead of an append kernel first. "0": the two launches (A/B runs).
FUSED_APPEND = os.environ.get("FLASHTILE_FUSED_APPEND", "1") == "1"


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
    bounds = torch.stack([arange * step, torch.full_like(arange, step)], dim=1).contiguous()
    return arange, bounds, torch.zeros_like(arange)


# Never evicted: a freed entry could still be read by a kernel queued on another stream, or by a CUDA
# graph captured with it.
_INDEX_CONSTANTS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, ...]] = {}


def _index_constants(batch: int, step: int, device) -> tuple[torch.Tensor, ...]:
    """int32 index tensors: arange(batch), bounds [b * step, step] (batch, 2), zeros(batch); read only.

    Cached per shape, so a decoding step does not launch them each time; a CUDA graph captured after
    an eager call of the same shape reads the cached ones too (built during a capture, each would be
    five small kernels in every replay of the graph). A tensor first made while a graph is captured
    holds its values only once the graph replays, so it is not kept; nor under torch.compile tracing.
    Made first while torch.compile's CUDA graphs warm up, they are allocated outside the graph's pool.
    """
    if torch.compiler.is_compiling():
        return _build_index_constants(batch, step, device)
    key = (batch, step, torch.device(device))
    made = _INDEX_CONSTANTS.get(key)
    if made is not None:
        return made
    if tracing_or_capturing(device):
        return _build_index_constants(batch, step, device)
    # (outside a CUDA graph's private pool, where torch.compile's CUDA graphs would reject a kept tensor; ready
    # before any stream reads them)
    made = made_outside_graph_pool(lambda: _build_index_constants(batch, step, device), device)
    # (two threads may both build a key: the first kept is the one both use, so that no tensor a queued kernel
    # reads is freed)
    return _INDEX_CONSTANTS.setdefault(key, made)


def _check_cache_indices(seqlens, seqlen_new, limit, batch_idx, batch_cache, block_table, num_pages, leftpad,
                         page_size=1, conflict=None) -> tuple[int, int]:
    """Index values that would send the kernel out of bounds raise here, before any launch; so do appends
    of two new tokens into one cache slot (``conflict``: a 0-d int tensor, nonzero when some do; given
    when two batch entries could share a slot). Returns the longest cache_seqlens + seqlen_new (the most
    keys a sequence has) and the largest cache_seqlens.

    Device-resident indices need a device-to-host read: one, for all checks together. It is skipped
    while a CUDA graph is captured or torch.compile traces (no host read is possible there), and with
    ``FLASHTILE_VALUE_CHECKS=0``.
    """
    if seqlens.numel() == 0:  # batch 0: no index to check (aminmax refuses empty tensors)
        return seqlen_new, 0
    # Few small kernels: a decoding step makes this check once per layer.
    stats = [*torch.aminmax(seqlens)]
    if batch_idx is not None:
        stats += [*torch.aminmax(batch_idx)]
    if block_table is not None:
        # The pages holding positions < cache_seqlens + seqlen_new, the ones read or written.
        stats += [pages_in_use_invalid(block_table, seqlens + seqlen_new, page_size, num_pages)]
    if leftpad is not None:
        stats += [leftpad.min(), (seqlens - leftpad).min()]
    if conflict is not None:
        stats += [conflict]
    values = torch.stack([x if x.dtype == torch.int32 else x.to(torch.int32) for x in stats]).tolist()
    lo, first_max = values[:2]
    hi = first_max + seqlen_new
    values = values[2:]
    if lo < 0:
        raise ValueError(f"cache_seqlens must be >= 0; got {lo}")
    if hi > limit:
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
    if leftpad is not None:
        (pad_lo, room_lo), values = values[:2], values[2:]
        if pad_lo < 0 or room_lo < 0:
            raise ValueError("cache_leftpad must lie in [0, cache_seqlens]")
    if conflict is not None and values[0]:
        raise ValueError("two new tokens would be appended into the same cache slot (a repeated cache_batch_idx, "
                         "or block_table rows sharing the pages being written): their writes would race. Shared "
                         "pages may be read, not appended to")
    return hi, first_max


# cache_seqlens tensor -> (its state, the other index tensors' states, the call's sizes, (longest, first_max))
# when its values last passed ``_check_cache_indices``.
# A plain dict by id(): a lookup is a dict lookup (a WeakIdKeyDictionary's took ~2 µs of a decoding step's
# ~35). An entry's tensor_state holds the tensor weakly and ``_recorded_check`` compares it, so an id reused by
# another tensor finds a dead reference and is checked anew; the dict is cleared past _MAX_CHECKED entries.
_CHECKED_CACHE_INDICES: dict[int, tuple] = {}
_MAX_CHECKED = 4096


def _recorded_check(seqlens: torch.Tensor, others: tuple, sizes: tuple) -> tuple[int, int] | None:
    """(longest, first_max) of an earlier call whose index tensors were these very tensors, unwritten
    since (every layer of a decoding step passes the same cache_seqlens), for the same sizes; else None.

    A decoding step would otherwise read the device once per layer, waiting each time for the GPU. A value
    changed behind PyTorch's back (through ``.data``, DLPack, a collective) cannot send a kernel outside the
    tensors (the append kernel skips rows outside the cache, the forward kernel clamps each sequence to the
    cache's rows and each page number into the pool, rotary positions are clamped to the tables: the Triton
    backend's eager path only); the call computes with it, as flash-attn would. ``others``:
    cache_batch_idx, cache_leftpad and block_table (or None each). Inference tensors have no version counter:
    checked on every call."""
    # (loops rather than generators: a decoding step makes this check once per layer and token)
    if seqlens.is_inference():
        return None
    for t in others:
        if t is not None and t.is_inference():
            return None
    entry = _CHECKED_CACHE_INDICES.get(id(seqlens))
    if entry is None:
        return None
    own, other_states, recorded_sizes, result = entry
    if recorded_sizes != sizes or not unchanged_since(own, seqlens):
        return None
    for state, t in zip(other_states, others):
        if not unchanged_since(state, t):
            return None
    return result


def _record_check(seqlens: torch.Tensor, others: tuple, sizes: tuple, result: tuple[int, int]) -> None:
    if seqlens.is_inference() or any(t is not None and t.is_inference() for t in others):
        return
    if len(_CHECKED_CACHE_INDICES) >= _MAX_CHECKED:
        _CHECKED_CACHE_INDICES.clear()
    _CHECKED_CACHE_INDICES[id(seqlens)] = (tensor_state(seqlens), tuple(tensor_state(t) for t in others), sizes,
                                           result)


def _rotate_new_tokens(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       seqlens: torch.Tensor, local: bool, interleaved: bool, kernel: bool = False):
    """(q, k) rotated at their positions in the cache, as flash-attn counts them (cache_leftpad does not
    shift them): new key i of entry b at seqlens[b] + i; query i there too when ``local``, else all at
    seqlens[b]. k may be None. Unchecked values (CUDA-graph capture, FLASHTILE_VALUE_CHECKS=0) are clamped
    to the table: never an out-of-bounds read. ``kernel``: by the Triton kernel (``kernels.kvcache.rotate``,
    the same values; one launch per tensor, which a launch plan records), else by PyTorch's ops."""
    if kernel:
        rotate = _ops._triton_backend().rotate
        seqlens = seqlens.contiguous()
        with _ops._on_device(q):
            k = None if k is None else rotate(k, cos, sin, seqlens, True, interleaved)
            return rotate(q, cos, sin, seqlens, local, interleaved), k
    table = cos.shape[0]
    seqlen_q = q.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    start = seqlens.long()
    steps = torch.arange(max(seqlen_new, seqlen_q), device=q.device)
    if k is not None:
        pos_k = (start[:, None] + steps[None, :seqlen_new]).clamp(0, table - 1)
        k = _rotate(k, cos[pos_k], sin[pos_k], interleaved)
    pos_q = (start[:, None] + (steps[None, :seqlen_q] if local else 0 * steps[None, :seqlen_q])).clamp(0, table - 1)
    return _rotate(q, cos[pos_q], sin[pos_q], interleaved), k


def _check_cache_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        v_keys_fastest: bool = False, contiguous_rows: bool = False) -> int:
    """Ranks, matching shapes and head counts of q and a KV cache, and the cache's layout, for
    flash_attn_with_kvcache and its FP8 path; returns the cache's pitch (``cache_layout``).
    ``v_keys_fastest``: v_cache may also have unit stride over its positions (an FP8 cache,
    ``flashtile.fp8.zeros_cache``). ``contiguous_rows``: the cache must be contiguous over its first two dims
    (a paged pool, found at multiples of page_size; an FP8 cache, whose path indexes the cache's own rows)."""
    _check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_tensor("k_cache", k_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)")
    _check_tensor("v_cache", v_cache, 4, "(batch_cache, seqlen_cache, nheads_k, headdim)", keys_fastest=v_keys_fastest)
    batch, seqlen_q, nheads, headdim = q.shape
    batch_cache, seqlen_cache, nheads_k, _ = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if k_cache.shape[3] != headdim:
        raise ValueError(f"headdim must match: q {headdim}, k_cache {k_cache.shape[3]}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of the cache's nheads_k ({nheads_k})")
    k_layout, v_layout = cache_layout("k_cache", k_cache), cache_layout("v_cache", v_cache)
    if k_layout[0] != v_layout[0]:
        raise ValueError(f"k_cache and v_cache must have the same batch stride in position strides (flashtile reads "
                         f"both by one row pitch): k_cache {k_layout[0]}, v_cache {v_layout[0]} (strides "
                         f"{k_cache.stride()} and {v_cache.stride()})")
    if contiguous_rows:
        _require_contiguous_rows(k_cache, v_cache, k_layout[0])
    return k_layout[0]


def _require_contiguous_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, pitch: int) -> None:
    """A paged pool (found at multiples of page_size) and an FP8 cache (whose path indexes the cache's own rows)
    must be contiguous over their first two dims: a ``ValueError`` otherwise."""
    if pitch != k_cache.shape[1] and k_cache.shape[0] > 1 and k_cache.shape[1] > 0:  # (no positions: no rows)
        raise ValueError(f"k_cache and v_cache must be contiguous over their first two dims here (a paged or FP8 "
                         f"cache): strides {k_cache.stride()} and {v_cache.stride()}")


def _may_overlap(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` may share memory: False where, its dims taken by growing stride, each
    stride passes the farthest element the smaller ones reach (every layout a cache is made with); True
    otherwise (an expanded tensor, entries that overlap, a layout too intricate to tell)."""
    return _layout_may_overlap(x.shape, x.stride())


def _layout_may_overlap(shape, strides) -> bool:
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in zip(shape, strides) if size > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _may_share(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an element of ``a`` may share memory with one of ``b``. Two views of one layout at a distance
    (k and v caches sliced from one packed tensor, say) are one layout with a dim of 2 more, whose stride is the
    distance (``_layout_may_overlap``); others share memory where their byte ranges meet."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride():
        return _layout_may_overlap((2, *a.shape), (abs(b.storage_offset() - a.storage_offset()), *a.stride()))

    def byte_range(x: torch.Tensor) -> tuple[int, int]:
        first = x.storage_offset() + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()) if stride < 0)
        last = x.storage_offset() + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()) if stride > 0)
        return first * x.element_size(), (last + 1) * x.element_size()

    (a_first, a_end), (b_first, b_end) = byte_range(a), byte_range(b)
    return a_first < b_end and b_first < a_end


def _check_appendable(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int) -> None:
    """New tokens may be written into the caches: no two of their elements share memory (a cache expanded over
    its batch, say: two new tokens could land on one element). One sequence writes into one batch entry only."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _may_overlap(cache if batch > 1 else cache[:1]):
            raise ValueError(f"{name}'s elements may share memory (shape {tuple(cache.shape)}, strides "
                             f"{cache.stride()}); new k, v can only be appended to a cache whose elements each have "
                             "their own memory")
    if _may_share(k_cache if batch > 1 else k_cache[:1], v_cache if batch > 1 else v_cache[:1]):
        raise ValueError("k_cache and v_cache share memory (one tensor twice, or overlapping views of one); new k, v "
                         "can only be appended to caches that each have their own memory")


def cache_layout(name: str, cache: torch.Tensor) -> tuple[int, int]:
    """(pitch, row_stride): the kernels read a cache (batch_cache, seqlen_cache, nheads_k, headdim) as a flat
    view of rows ``row_stride`` elements apart (``cache_rows``), position t of batch entry b at row
    ``b * pitch + t``. The pitch is seqlen_cache for a contiguous cache, more for a slice of a longer one or a
    transposed (batch, nheads_k, seqlen_cache, headdim) one, 0 for one expanded over its batch: any batch
    stride that is a whole number of row strides, as flash-attn takes them. Others are a ``ValueError``."""
    batch_cache, seqlen_cache = cache.shape[:2]
    stride_b, stride_t = cache.stride(0), cache.stride(1)
    if seqlen_cache <= 1:  # one position per entry (or none): the entries are the rows, any row stride
        return (1, stride_b) if batch_cache > 1 and stride_b else (0, max(stride_t, 1))
    if cache.numel() == 0:  # no element to address (an empty batch's strides may be anything, 0 too)
        return seqlen_cache, max(cache.shape[2] * cache.shape[3], 1)
    if stride_t == 0:
        raise ValueError(f"{name} has stride 0 over its positions (an expanded tensor); give it memory of its own "
                         f"per position: strides {cache.stride()}")
    if batch_cache <= 1:
        return seqlen_cache, stride_t
    if stride_b % stride_t:
        raise ValueError(f"{name}'s batch stride must be a whole number of its position strides (flashtile reads "
                         f"a cache as rows of nheads_k x headdim values); got strides {cache.stride()}")
    return stride_b // stride_t, stride_t


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """(rows, nheads_k, headdim): the flat view of ``cache`` whose row ``b * pitch + t`` is position t of batch
    entry b (``cache_layout``), in the cache's memory (appends write through it)."""
    batch_cache, seqlen_cache, nheads_k, headdim = cache.shape
    pitch, row_stride = cache_layout("cache", cache)
    rows = (batch_cache - 1) * pitch + seqlen_cache if batch_cache and seqlen_cache else 0
    return cache.as_strided((rows, nheads_k, headdim), (row_stride, cache.stride(2), cache.stride(3)))


def _append_rows(seqlens, seqlen_new, rows, block_table, page_size, row_stride, clamp=False) -> torch.Tensor:
    """int64 (batch, seqlen_new): the flattened cache row of each new token, at logical position
    ``seqlens[b] + t`` of cache row ``rows[b]`` (``row_stride`` rows each), or, paged, row ``position %
    page_size`` of page ``block_table[b, position // page_size]``. ``clamp`` keeps the page lookup inside
    the table (for a check that runs before the positions are known to fit)."""
    slots = seqlens.long()[:, None] + torch.arange(seqlen_new, device=seqlens.device)[None, :]
    if block_table is None:
        return rows.long()[:, None] * row_stride + slots
    columns = slots // page_size
    if clamp:
        columns = columns.clamp(0, block_table.shape[1] - 1)
    return block_table.long().gather(1, columns) * page_size + slots % page_size


def _check_rotary(cos: object, sin: object, headdim: int, device) -> None:
    """rotary_cos and rotary_sin: float tensors (seqlen_ro, rotary_dim / 2) on q's device, rotary_dim <= headdim."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    for name, table in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(table, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (seqlen_ro, rotary_dim / 2), got {type(table).__name__}")
        if not table.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {table.dtype}")
        if table.device != device:
            raise ValueError(f"{name} is on {table.device}, expected {device} (the device of q)")
    if cos.dim() != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > headdim or cos.shape[0] == 0:
        raise ValueError(f"rotary_cos/rotary_sin must be (seqlen_ro, rotary_dim / 2) with seqlen_ro >= 1 and "
                         f"rotary_dim <= {headdim}, got {tuple(cos.shape)} and {tuple(sin.shape)}")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of the first 2 * cos.shape[-1] features of x (B, T, heads, D); cos/sin (B, T, R/2).
    In float32, or in float64 where x is float64 (the PyTorch path's float64 calls)."""
    rotary_dim = 2 * cos.shape[-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    rot, rest = x[..., :rotary_dim].to(acc), x[..., rotary_dim:]
    cos, sin = cos[:, :, None, :].to(acc), sin[:, :, None, :].to(acc)
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
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """Attention of q against a KV cache, after writing the new k, v into it in place. Forward only.

    Args:
        q: (batch, seqlen_q, nheads, headdim), the new queries (1 for decoding, more for chunked
            prefill or speculative decoding).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), headdim contiguous, a batch stride
            that is a whole number of position strides (a transposed (batch, nheads_k, seqlen_cache, headdim)
            cache, a slice of a longer one), the same number for both; a paged pool (num_pages, page_size,
            nheads_k, headdim) contiguous over its first two dims. Updated in place when k, v are given.
        k, v: None, or (batch, seqlen_new, nheads_k, headdim) new keys/values, written at positions
            ``cache_seqlens .. cache_seqlens + seqlen_new - 1`` of their cache rows.
        rotary_cos, rotary_sin: None, or float (seqlen_ro, rotary_dim / 2) tables; rotary is applied to the
            new k at cache positions ``cache_seqlens + i`` and to q at the same positions when causal or
            windowed (a window bound below the cache length), else all at ``cache_seqlens``, as in
            flash-attn: ``cache_leftpad`` does not shift the positions. The tables must cover every
            position rotated. ``rotary_interleaved`` rotates pairs (0, 1), (2, 3), ... instead of the two
            halves.
        cache_seqlens: int or int32 (batch,): tokens already in each cache row (before the append).
            None means the whole cache, every page of block_table when paged (then k, v must be None).
        cache_batch_idx: None or int32 (batch,): the cache row of each batch entry (rows may repeat
            only when nothing is appended: two appends into one slot are an error).
        cache_leftpad: None or int32 (batch,): each row's first valid cache position.
        block_table: None, or int32 (batch, max_pages): a paged cache. k_cache/v_cache are then a pool
            (num_pages, page_size, nheads_k, headdim) of pages of any size; entry b's logical position p
            lives in page ``block_table[b, p // page_size]`` at row ``p % page_size``. Entries may share
            pages they read; the slots new k, v are written to must be distinct.
        causal, window_size, softcap, alibi_slopes, softmax_scale: as in ``flash_attn_func``; the new
            queries are aligned to the end of each row's keys (bottom-right).
        num_splits: split-KV decoding: the keys of each query block are split across this many programs
            and the partial results merged by lse; 0 chooses from the shape and the multiprocessor
            count (the PyTorch path computes the same result unsplit).
        return_softmax_lse: also return the float32 lse (batch, nheads, seqlen_q).
        q_descale, k_descale, v_descale: None, or float32 (batch, nheads_k) descale factors of a
            float8_e4m3fn q and FP8 cache (FA3's convention, per batch entry of q: entry b reads its cache
            row, its ``cache_batch_idx`` row or its pages with ``k_descale[b]``, ``v_descale[b]``; query head
            h takes ``q_descale[:, h // (nheads // nheads_k)]``). q may also be bfloat16/float16 over the FP8
            cache, without q_descale (its output then has q's dtype). New k, v are then bfloat16/float16,
            rotated (if rotary) and quantized with the entry's descales as they are written, or
            float8_e4m3fn already in that scale; this call attends to the quantized values. On the GPU the
            kernel reads the FP8 cache in place (converted to 16 bits in registers); on the CPU each
            entry's cache is dequantized into a copy in ``out_dtype``. See docs/fp8.md.
        out_dtype: output dtype for FP8 q, torch.bfloat16 (default) or torch.float16; with a 16-bit q,
            None or q's dtype.

    Returns:
        out (batch, seqlen_q, nheads, headdim), dtype of q (out_dtype for FP8 inputs), and lse if
        ``return_softmax_lse``.

    Under torch.compile the call is one custom op, ``flashtile::kvcache_attention``, that mutates k_cache
    and v_cache (window_size must then be a pair of ints).
    """
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
               block_table, alibi_slopes, q_descale, k_descale, v_descale)
    if rotary_interleaved is not True and rotary_interleaved is not False and not _is_bool(rotary_interleaved):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if not torch.compiler.is_compiling():
        # A decoding step of a key seen before replays its recorded launches (_decode_plan_key).
        planned = _planned_decode_call(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size,
                                       softcap, num_splits, return_softmax_lse,
                                       (rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                                        alibi_slopes, q_descale, k_descale, v_descale, out_dtype), rotary_interleaved)
        if planned is not None:
            return _contiguous_lse(planned)
    if not _ops._plain_eager(*(t for t in tensors if isinstance(t, torch.Tensor))):
        # torch.compile, tracing, modes: through the custom op (the call itself runs as below)
        out, lse = _kvcache_op_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                    rotary_interleaved, alibi_slopes, num_splits, q_descale, k_descale, v_descale,
                                    out_dtype)
        return (out, lse) if return_softmax_lse else out
    return _contiguous_lse(_kvcache_eager(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                          cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                          window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                          return_softmax_lse, q_descale, k_descale, v_descale, out_dtype))


def _contiguous_lse(result):
    """``(out, lse)`` with lse contiguous, as flash-attn returns it (the kernels write (nheads, batch, seqlen_q),
    which the call returns permuted; code that views it or reads its pointer needs it in order); ``out`` alone as
    it is. Outside launch plans: the copy is not one of their launches."""
    return (result[0], result[1].contiguous()) if isinstance(result, tuple) else result


def _decode_plan_key(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, softcap,
                     num_splits, return_softmax_lse, fp8: tuple | None = None, block_table=None,
                     cache_batch_idx=None, rotary: tuple | None = None) -> tuple | None:
    """The launch-plan key of a decoding step on a cache (no left padding or ALiBi; a paged pool with its
    ``block_table``, or rows picked by ``cache_batch_idx``, or neither; ``rotary``: None, or a 16-bit cache's
    (rotary_cos, rotary_sin, rotary_interleaved)) with cache_seqlens a tensor, or None: see ``_ops.plan_key``.
    Tensors must be distinct (one tensor in two roles is left to the ordinary path). ``fp8``: an FP8 cache's
    (q_descale, k_descale, v_descale, out_dtype), the descales tensors (q_descale None for a 16-bit q); its new
    tokens, if any, float8 or 16-bit (quantized by the append kernel, which the plan records)."""
    tensor = torch.Tensor
    if (type(q) is not tensor or type(k_cache) is not tensor or type(v_cache) is not tensor
            or type(cache_seqlens) is not tensor or (k is None) != (v is None)
            or (k is not None and (type(k) is not tensor or type(v) is not tensor))
            or (block_table is not None and type(block_table) is not tensor)
            or (cache_batch_idx is not None and type(cache_batch_idx) is not tensor)
            or (rotary is not None and (fp8 is not None or type(rotary[0]) is not tensor
                                        or type(rotary[1]) is not tensor or type(rotary[2]) is not bool))
            or type(num_splits) is not int or type(return_softmax_lse) is not bool):
        return None
    tables = (None, None) if rotary is None else rotary[:2]
    key = _ops.plan_key(q, k_cache, v_cache, softmax_scale, causal, window_size, softcap,
                        (k, v, cache_seqlens, block_table, cache_batch_idx, *tables))
    if key is None or _ops.aliased(key):  # q, k_cache, v_cache not distinct
        return None
    if k is None:
        new = None
    elif k is v or any(k is t or v is t for t in (q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx)):
        return None
    else:
        new = (k.shape, k.stride(), v.shape, v.stride(), k.dtype, v.dtype, k.device, v.device)
    indices = []  # the layouts of the block table, the batch index and the rotary tables
    extra = (block_table, cache_batch_idx, *tables)
    for index in extra:
        if index is None:
            indices.append(None)
        elif any(index is t for t in (q, k_cache, v_cache, cache_seqlens)) or sum(index is t for t in extra) > 1:
            return None
        else:
            indices.append((index.shape, index.stride(), index.dtype, index.device))
    if rotary is not None:
        if k is not None and any(t is k or t is v for t in tables):
            return None
        indices.append(rotary[2])
    scales = None
    if fp8 is not None:
        *descales, out_dtype = fp8
        if q.dtype != torch.float8_e4m3fn and descales[0] is None:
            descales = descales[1:]  # a 16-bit q over the cache: no q_descale (the ordinary path checks the rest)
        if any(type(d) is not tensor for d in descales) or not (
                out_dtype is None or isinstance(out_dtype, torch.dtype)):
            return None
        others = (q, k_cache, v_cache, k, v, cache_seqlens)
        if any(d is t for d in descales for t in others) or len({id(d) for d in descales}) < len(descales):
            return None  # one tensor in two roles (the same descale for k and v): the ordinary path
        if any(d.requires_grad for d in descales) or any(
                t is not None and t.requires_grad and t.dtype == torch.float8_e4m3fn for t in others):
            return None  # float8 inputs have no backward: the ordinary path raises, a replay must not run
        scales = (out_dtype, *((d.shape, d.stride(), d.dtype, d.device) for d in descales))
    return (key, new, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device,
            num_splits, return_softmax_lse, scales, *indices,
            _ops.environ_get("FLASHTILE_VALUE_CHECKS"))  # (settings: in key)


def _planned_decode_call(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, softcap,
                         num_splits, return_softmax_lse, others: tuple, rotary_interleaved=True):
    """``_planned_decode``'s result for a step that may take a decoding plan (``_decode_plan_key``; ``others``:
    the step's rotary tables, batch index, left padding, block table and ALiBi, left padding and ALiBi None,
    then its FP8 descales and out_dtype: all None, or an FP8 cache's), else None."""
    rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes = others[:6]
    if cache_leftpad is not None or alibi_slopes is not None or (rotary_cos is None) != (rotary_sin is None):
        return None
    rotary = None if rotary_cos is None else (rotary_cos, rotary_sin, rotary_interleaved)
    fp8 = None
    for option in others[6:]:
        if option is not None:
            fp8 = others[6:]
            break
    key = _decode_plan_key(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, softcap,
                           num_splits, return_softmax_lse, fp8, block_table, cache_batch_idx, rotary)
    if key is None:
        return None
    return _planned_decode(key, q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size,
                           softcap, num_splits, return_softmax_lse, fp8, block_table, cache_batch_idx, rotary)


class _DecodePlans:
    """A decoding key's recorded calls, by their split count (which follows the cache's length)."""

    __slots__ = ("plans", "replayable", "splits")

    def __init__(self, replayable: bool):
        self.plans: dict = {}  # splits -> Plan, or the count of failed recordings
        self.replayable = replayable  # plans on, the Triton backend (both fixed by the key's settings)
        self.splits: dict = {}  # the longest sequence (None: not read) -> the split count (``_splits``)


_DECODE_PLANS: dict[tuple, _DecodePlans] = {}


def _planned_decode(key, q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, softcap,
                    num_splits, return_softmax_lse, fp8: tuple | None = None, block_table=None, cache_batch_idx=None,
                    rotary: tuple | None = None):
    """``flash_attn_with_kvcache`` for a ``_decode_plan_key`` call: the recorded launches of its key and split
    count where the cache indices are these very tensors, checked and unwritten since (``_recorded_check``;
    else, and on a key's first call, the ordinary path, which checks and records them)."""

    q_descale, k_descale, v_descale, out_dtype = fp8 if fp8 is not None else (None, None, None, None)
    *tables, interleaved = rotary if rotary is not None else (None, None, True)

    def ordinary():
        return _kvcache_eager(q, k_cache, v_cache, k, v, *tables, cache_seqlens, cache_batch_idx, None, block_table,
                              softmax_scale, causal, window_size, softcap, interleaved, None, num_splits,
                              return_softmax_lse, q_descale, k_descale, v_descale, out_dtype)

    entry = _DECODE_PLANS.get(key)
    if entry is None:
        if len(_DECODE_PLANS) >= _ops._MAX_PLANS:
            _DECODE_PLANS.clear()
        _DECODE_PLANS[key] = _DecodePlans(os.environ.get("FLASHTILE_LAUNCH_PLANS", "1") != "0"
                                          and select_backend(q.device) == "triton")
        return ordinary()
    if fp8 is None and block_table is None and cache_batch_idx is None and rotary is None:
        inputs = (q, k_cache, v_cache, cache_seqlens) if k is None else (q, k_cache, v_cache, k, v, cache_seqlens)
    else:
        inputs = tuple(t for t in (q, k_cache, v_cache, k, v, cache_seqlens, q_descale, k_descale, v_descale,
                                   block_table, cache_batch_idx, *tables) if t is not None)
    if not entry.replayable or not _ops._aligned(*inputs):
        return ordinary()
    batch, seqlen_q, nheads, _ = q.shape
    batch_cache, seqlen_cache, nheads_k, _ = k_cache.shape
    seqlen_new = 0 if k is None else k.shape[1]
    key_rows = seqlen_cache if block_table is None else block_table.shape[1] * seqlen_cache  # (a pool's pages)
    longest = None
    if values_readable(q.device):
        recorded = _recorded_check(cache_seqlens, (cache_batch_idx, None, block_table),
                                   (seqlen_new, key_rows, batch_cache))
        if recorded is None:
            return ordinary()
        longest = recorded[0]
        if rotary is not None:  # positions past the tables: the ordinary path raises
            left, right = window_size
            local = causal or 0 <= left < key_rows or 0 <= right < key_rows
            if recorded[1] + max(seqlen_new, seqlen_q if local else 1) > tables[0].shape[0]:
                return ordinary()
    splits = entry.splits.get(longest)
    if splits is None:  # the key fixes every other input of the choice
        if len(entry.splits) >= 4096:
            entry.splits.clear()
        splits = entry.splits[longest] = _splits(q, num_splits, batch, nheads, nheads_k, seqlen_q, key_rows, longest)
    kept = None
    if isinstance(entry.plans.get(splits, 0), int) and entry.plans.get(splits, 0) < _ops._TRIES:
        # a recording: the cache's index constants stay as they are (the values copied into a tuple at once,
        # under the GIL: another thread's first call of a new shape may add to the dict meanwhile)
        kept = {id(t) for made in tuple(_INDEX_CONSTANTS.values()) for t in made} | _ops._placeholders()
    with _ops._on_device(q):
        result, replayed = _ops.replayed_or_recorded(entry.plans, splits, inputs, lambda: _as_tuple(ordinary()), kept)
    if replayed and k is not None:
        for cache in (k_cache, v_cache):
            if not cache.is_inference():  # written in place by the append, as the ordinary path records it
                torch.autograd.graph.increment_version(cache)
    return result if return_softmax_lse else result[0]


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _splits(q, num_splits: int, batch: int, nheads: int, nheads_k: int, seqlen_q: int, key_rows: int,
            longest: int | None) -> int:
    """The split count of a call: ``num_splits``, or by the keys there are (``longest``, when its value was
    read) or else by the capacity ``key_rows``."""
    if num_splits > 0:  # (below 1: chosen by size, as flash-attn reads it; the plan path passes it unnormalized)
        return num_splits
    if q.device.type != "cuda":  # (configs.split_count's answer there, without importing Triton, which a CPU
        return 1                  # install may lack)
    from .kernels import configs  # the launch layout (GQA packing) decides how many programs there are

    return configs.split_count(q.device, batch, nheads, nheads_k, seqlen_q, key_rows if longest is None else longest,
                               False)


def _kvcache_eager(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                   num_splits, return_softmax_lse, q_descale, k_descale, v_descale, out_dtype):
    """flash_attn_with_kvcache's call itself (eager, or inside its custom op)."""
    # FP8 inputs come with descales; without them they fail the dtype check of the path below.
    if q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None:
        from . import fp8

        def run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_leftpad, block_table,
                cache_batch_idx=None, fp8=None):
            return _kvcache_attention(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                      cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                                      rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, fp8)

        return fp8.kvcache_func(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table, causal, window_size, rotary_interleaved, q_descale,
                                k_descale, v_descale, out_dtype, run)
    return _kvcache_attention(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                              cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                              rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)


@torch.library.custom_op("flashtile::kvcache_attention", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None, cache_seqlens: torch.Tensor | None,
    cache_seqlens_int: int | None, cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
    block_table: torch.Tensor | None, softmax_scale: float | None, causal: bool, window_left: int, window_right: int,
    softcap: float, rotary_interleaved: bool, alibi_slopes: torch.Tensor | None, num_splits: int,
    q_descale: torch.Tensor | None, k_descale: torch.Tensor | None, v_descale: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache as one op for torch.compile: appends k, v into the caches in place and returns
    (out, lse) with lse contiguous (batch, nheads, seqlen_q) float32. Its body is the eager call."""
    return _kvcache_op_body(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                            cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left,
                            window_right, softcap, rotary_interleaved, alibi_slopes, num_splits, q_descale, k_descale,
                            v_descale, out_dtype)


def _kvcache_op_body(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                     cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left, window_right,
                     softcap, rotary_interleaved, alibi_slopes, num_splits, q_descale, k_descale, v_descale,
                     out_dtype):
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    # torch.compile's generated code calls the op once per layer and step on plain tensors: a decoding step replays
    # its recorded launches, as the eager call does.
    planned = _planned_decode_call(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal,
                                   (window_left, window_right), softcap, num_splits, True,
                                   (rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                                    q_descale, k_descale, v_descale, out_dtype), rotary_interleaved)
    if planned is not None:
        return planned[0], planned[1].contiguous()
    out, lse = _kvcache_eager(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx,
                              cache_leftpad, block_table, softmax_scale, causal, (window_left, window_right), softcap,
                              rotary_interleaved, alibi_slopes, num_splits, True, q_descale, k_descale, v_descale,
                              out_dtype)
    return out, lse.contiguous()


@torch.library.custom_op("flashtile::kvcache_attention_read", mutates_args=())
def _kvcache_read_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int | None,
    cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None,
    softmax_scale: float | None, causal: bool, window_left: int, window_right: int, softcap: float,
    rotary_interleaved: bool, alibi_slopes: torch.Tensor | None, num_splits: int, q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, out_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_kvcache_op`` without new k, v: the caches are only read (declared so, a traced graph need not
    copy them)."""
    return _kvcache_op_body(q, k_cache, v_cache, None, None, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                            cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left,
                            window_right, softcap, rotary_interleaved, alibi_slopes, num_splits, q_descale, k_descale,
                            v_descale, out_dtype)


def _kvcache_fake(q, out_dtype):
    # float8 q: out_dtype (bfloat16 by default); otherwise q's dtype
    dtype = (out_dtype or torch.bfloat16) if q.dtype == torch.float8_e4m3fn else q.dtype
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape, dtype=dtype), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, *args):
    return _kvcache_fake(q, args[-1])


@_kvcache_read_op.register_fake
def _(q, k_cache, v_cache, *args):
    return _kvcache_fake(q, args[-1])


def _fast_version_bump(op, mutated: tuple[int, ...]) -> None:
    """Replace ``torch.library.custom_op``'s ADInplaceOrView kernel of ``op`` (which bumps the version counters
    of the arguments it mutates, then dispatches on) by one that does the same without binding every argument
    to the schema first: ``torch._library.utils.fill_defaults`` reads the schema's argument list anew for each
    argument, which took about 200 µs per call of the decoding op's 24 arguments on the CI machine's CPU,
    four times the rest of a replayed decoding step (torch 2.13). ``mutated``: positions of the mutated
    tensors, required arguments. Where this torch's internals differ, the custom op's own kernel stays."""
    try:
        lib, name = op._lib, op._name
        overload = getattr(getattr(torch.ops, lib.ns), name).default
        names = [argument.name for argument in overload._schema.arguments]
        below = getattr(torch._C, "_after_ADInplaceOrView_keyset", None)
    except AttributeError:
        return
    bump = torch.autograd.graph.increment_version

    def kernel(keyset, *args, **kwargs):
        for position in mutated:
            bump(args[position] if position < len(args) else kwargs[names[position]])
        if below is not None:
            return overload.redispatch(keyset & below, *args, **kwargs)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return overload(*args, **kwargs)

    try:
        lib.impl(name, kernel, "ADInplaceOrView", with_keyset=True)
    except (RuntimeError, TypeError, AttributeError):
        pass


_fast_version_bump(_kvcache_op, (1, 2))  # k_cache, v_cache


MAX_SPLITS = 128  # flash-attn's limit on num_splits


def _check_num_splits(num_splits) -> int:
    """num_splits as the kernels take it: 0 (chosen by size) for any value below 1, as flash-attn reads it."""
    if (num_splits is None or isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral)
            or not num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an int at most {MAX_SPLITS} (below 1: chosen by size), got "
                         f"{num_splits!r}")
    return max(int(num_splits), 0)


def _kvcache_op_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                     num_splits, q_descale, k_descale, v_descale, out_dtype):
    """The op's arguments from flash_attn_with_kvcache's: an int cache_seqlens apart from a tensor one, the
    window as two ints (a traced call takes them as Python values)."""
    # The eager call's own argument checks (types and ranges, with its messages): the op's schema would
    # otherwise coerce or refuse them differently. Tensors are checked by the op's body, as eager.
    if isinstance(window_size, torch.Tensor) and (tracing_or_capturing(window_size.device) or torch.jit.is_tracing()
                                                  or is_fake(window_size)):
        # (Read on the host, as the eager call reads it, under modes and subclasses; not while tracing or capturing)
        raise TypeError(f"window_size must be a pair of ints under torch.compile, tracing or CUDA-graph capture, got "
                        f"{window_size!r}")
    window_size = _window_pair(window_size)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D torch.Tensor (batch, seqlen_q, nheads, headdim)")
    opts = _check_options(0.0, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q, q.shape[0])
    if not _is_bool(rotary_interleaved):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    seqlens_int = None
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral):
            raise TypeError(f"cache_seqlens must be an int or a torch.Tensor, got {type(cache_seqlens).__name__}")
        seqlens_int, cache_seqlens = int(cache_seqlens), None
    num_splits = _check_num_splits(num_splits)
    named = {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos,
             "rotary_sin": rotary_sin, "cache_seqlens": cache_seqlens, "cache_batch_idx": cache_batch_idx,
             "cache_leftpad": cache_leftpad, "block_table": block_table, "q_descale": q_descale,
             "k_descale": k_descale, "v_descale": v_descale}
    for name, tensor in named.items():
        # (the op's fake implementation, which runs for meta tensors and under tracing, checks nothing: a tensor
        # on another device would give an uninitialised output there)
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(tensor).__name__}")
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, expected {q.device} (the device of q)")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    scale = None if softmax_scale is None else opts.softmax_scale
    args = (rotary_cos, rotary_sin, cache_seqlens, seqlens_int, cache_batch_idx, cache_leftpad, block_table, scale,
            opts.causal, window_size[0], window_size[1], opts.softcap, bool(rotary_interleaved), alibi_slopes,
            num_splits, q_descale, k_descale, v_descale, out_dtype)
    if k is None and v is None:  # nothing appended: the op that writes nothing (no cache copies when traced)
        return _kvcache_read_op(q, k_cache, v_cache, *args)
    return _kvcache_op(q, k_cache, v_cache, k, v, *args)


def _kvcache_attention(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                       block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                       num_splits, return_softmax_lse, fp8=None):
    """flash_attn_with_kvcache past its FP8 branch. ``fp8``: (q_descale, k_descale, v_descale, out_dtype) of an
    FP8 cache (float8_e4m3fn, with float8 q or, q_descale None, q in out_dtype; new k, v float8 in the
    cache's scale; all checked by ``flashtile.fp8``) that the kernel reads in 16-bit precision."""
    num_splits = _check_num_splits(num_splits)
    paged = block_table is not None
    pitch = _check_cache_shapes(q, k_cache, v_cache, v_keys_fastest=fp8 is not None,
                                contiguous_rows=paged or fp8 is not None)
    batch, seqlen_q, nheads, headdim = q.shape
    batch_cache, seqlen_cache, nheads_k, _ = k_cache.shape
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
    num_rows = (batch_cache - 1) * pitch + seqlen_cache if batch_cache and seqlen_cache else 0  # of cache_rows
    if backend == "triton" and not paged and num_rows >= 2**31:
        # The kernels address a contiguous cache by int32 rows (cache_rows).
        raise ValueError(f"k_cache spans {num_rows} rows ((batch_cache - 1) x {pitch} + seqlen_cache, batch_cache "
                         f"{batch_cache}, seqlen_cache {seqlen_cache}); the Triton kernels take fewer than 2**31")
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
        if seqlen_new:
            _check_appendable(k_cache, v_cache, batch)
    if fp8 is None:
        _check_dtype_device(tensors, backend)
    key_rows = capacity if paged else seqlen_cache  # the most keys one sequence can have
    left, right = _window_pair(window_size)  # read once (a tensor on the GPU is a device-to-host copy)
    opts = _check_options(0.0, softmax_scale, (left, right), softcap, alibi_slopes, headdim, causal, q, batch,
                          seqlens=(seqlen_q, key_rows))
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        _check_rotary(rotary_cos, rotary_sin, headdim, q.device)
        # flash-attn places the queries at successive positions when its kernel masks (causal, or a window
        # bound below the cache length, its cutoff for "unbounded"), else all at the first new position.
        local = opts.causal or 0 <= left < key_rows or 0 <= right < key_rows

    device = q.device
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when new k, v are appended")
        # The whole cache, as flash-attn reads it: every row, or every page of the table (its capacity). Made
        # per call as for an int: cached per capacity, a cache grown step by step added an entry (and a stream
        # synchronisation) every step.
        seqlens = torch.full((batch,), key_rows, dtype=torch.int32, device=device)
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = int(cache_seqlens)
        if not 0 <= cache_seqlens <= key_rows - seqlen_new:  # (before an int32 tensor is made of it)
            raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {key_rows}] (the cache length); got "
                             f"{cache_seqlens + seqlen_new}")
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        seqlens = _int32_vector("cache_seqlens", cache_seqlens, batch, device)
    rows = (_int32_vector("cache_batch_idx", cache_batch_idx, batch, device) if cache_batch_idx is not None
            else _index_constants(batch, 1, device)[0])
    leftpad = (_int32_vector("cache_leftpad", cache_leftpad, batch, device) if cache_leftpad is not None
               else None)
    if not paged and cache_batch_idx is None and batch > batch_cache:
        raise ValueError(f"batch ({batch}) exceeds the cache's batch ({batch_cache}) and no cache_batch_idx is given")
    # Two new tokens can go to one cache slot only through cache_batch_idx or a page a block table repeats.
    overlap_possible = k is not None and batch * seqlen_new > 1 and (paged or cache_batch_idx is not None)
    if paged and k is not None and block_table.shape[1] == 0:
        raise ValueError("block_table has no columns: there is no page to append k, v to")
    append_kernel = k is not None and backend == "triton" and _ops._plain_eager(k, v, k_cache, v_cache, seqlens,
                                                                                rows, block_table)
    longest = None  # the most keys of any sequence, when known
    first_max = None  # the largest cache_seqlens, when known
    if not isinstance(cache_seqlens, torch.Tensor) and not paged and cache_batch_idx is None and cache_leftpad is None:
        # Every index is known here (an int or the whole cache): checked without reading the GPU.
        first_max = seqlen_cache if cache_seqlens is None else cache_seqlens
        longest = first_max + seqlen_new
        if first_max < 0 or longest > seqlen_cache:
            raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache length); got "
                             f"{longest}")
    elif values_readable(device) and (append_kernel or k is None) and backend == "triton" \
            and (recorded := _recorded_check(
            seqlens, (cache_batch_idx, cache_leftpad, block_table), (seqlen_new, key_rows, batch_cache))) is not None:
        longest, first_max = recorded  # these index tensors, unchanged since their values were checked
    elif values_readable(device):
        conflict = None
        if overlap_possible:
            if append_kernel:  # one launch, as the append: no index tensors built per call
                conflict = _ops._triton_backend().append_conflicts(
                    seqlens.contiguous(), rows.contiguous() if cache_batch_idx is not None else None,
                    block_table.contiguous() if paged else None, page_size if paged else 0, seqlen_new,
                    pitch, key_rows, num_rows)
            else:
                slots = _append_rows(seqlens, seqlen_new, rows, block_table if paged else None,
                                     page_size if paged else 0, pitch, clamp=True).reshape(-1).sort().values
                conflict = (slots[1:] == slots[:-1]).any()
        longest, first_max = _check_cache_indices(seqlens, seqlen_new, key_rows,
                                                  rows if cache_batch_idx is not None else None, batch_cache,
                                                  block_table, num_pages if paged else 0, leftpad,
                                                  page_size if paged else 1, conflict)
        if backend == "triton":
            _record_check(seqlens, (cache_batch_idx, cache_leftpad, block_table), (seqlen_new, key_rows, batch_cache),
                          (longest, first_max))
    if leftpad is None:
        leftpad = _index_constants(batch, 1, device)[2]

    if rotary:
        # Positions in the cache, as flash-attn counts them (cache_leftpad does not shift them): new key i at
        # cache_seqlens + i, queries there too (or all at cache_seqlens when not local).
        table = rotary_cos.shape[0]
        if first_max is not None:
            needed = first_max + max(seqlen_new, seqlen_q if local else 1)
            if needed > table:
                raise ValueError(f"rotary_cos/rotary_sin have {table} positions, but this call rotates up to position "
                                 f"{needed - 1} (cache_seqlens up to {first_max}, {seqlen_new} new keys, "
                                 f"{seqlen_q} queries); give tables of at least {needed} rows")
        kernel = backend == "triton" and q.dtype != torch.float64 and _ops._plain_eager(
            q, k, rotary_cos, rotary_sin, seqlens)
        q, k = _rotate_new_tokens(q, k, rotary_cos, rotary_sin, seqlens, local, rotary_interleaved, kernel)

    with torch.no_grad():
        k_flat, v_flat = cache_rows(k_cache), cache_rows(v_cache)
        # FUSED_APPEND: the attention kernel itself reads the new keys and writes them into the cache (one launch
        # instead of two), where the cache is contiguous, 16-bit and indexed by cache_seqlens alone, on NVIDIA
        # targets (triton 3.6's AMD pipeline fails on the kernel's pointer-selected loads).
        # (Not where rows are pitched otherwise: the fused writes take the cache's length as its pitch.)
        fused_append = (FUSED_APPEND and append_kernel and not paged and cache_batch_idx is None
                        and pitch == seqlen_cache and cache_leftpad is None and fp8 is None and q.numel() > 0
                        and k_cache.numel() > 0
                        and _ops._triton_backend().target_of(device).vendor == "nvidia")
        # The keys' lengths as the kernels read them (cache_seqlens + seqlen_new), when the append can write them
        lengths_by_append = None
        if append_kernel and cache_leftpad is None and not fused_append:
            lengths_by_append = torch.empty(batch, dtype=torch.int32, device=device)
        if append_kernel:
            if not fused_append:
                # One launch for both caches instead of an index computation and two scatters (under tracing,
                # modes and subclasses PyTorch's indexing below stays visible to them).
                with _ops._on_device(q):  # Triton launches on the current device
                    _ops._triton_backend().append_kv(
                        k, v, k_flat, v_flat, seqlens.contiguous(),
                        rows.contiguous() if cache_batch_idx is not None else None,
                        block_table.contiguous() if paged else None, page_size if paged else 0, pitch,
                        capacity if paged else seqlen_cache, lengths_by_append,
                        None if fp8 is None else (fp8[1], fp8[2]))
            for cache in (k_cache, v_cache):  # written in place by the kernels (fused: the attention's launch below)
                if not cache.is_inference():  # recorded as index_put would (inference tensors have no version
                    torch.autograd.graph.increment_version(cache)  # counter)
        elif k is not None:
            flat = _append_rows(seqlens, seqlen_new, rows, block_table if paged else None, page_size if paged else 0,
                                pitch)
            if fp8 is not None:  # an FP8 cache's new tokens, 16-bit ones quantized with the entry's descales
                from .fp8 import FP8_DTYPE, _quantize_with

                k, v = (x if x.dtype == FP8_DTYPE else _quantize_with(x, d) for x, d in ((k, fp8[1]), (v, fp8[2])))
            k_flat[flat] = k
            v_flat[flat] = v
        # Each batch entry's keys: positions [leftpad, seqlens + seqlen_new) of its cache row (or of its
        # pages, when paged: the kernel then starts from logical positions).
        # Few small ops on purpose: in a decoding step each one is a launch next to a kernel of ~0.1 ms.
        bounds_q = _index_constants(batch, seqlen_q, device)[1]
        if cache_leftpad is None:
            # Sequence b's keys start at row b (or cache_batch_idx[b]) of the cache (a paged cache: at logical
            # position 0 of its pages, row stride 0): the kernels read the lengths and the batch index as they
            # are, no bounds kernel per step.
            if fused_append:
                length = seqlens.contiguous()  # the lengths before the append: the kernel adds seqlen_new
            elif lengths_by_append is not None:
                length = lengths_by_append  # no addition launched per step
            else:
                length = (seqlens + seqlen_new if seqlen_new else seqlens).contiguous()
            entries = rows.contiguous() if cache_batch_idx is not None else None
            bounds_k = CacheLengths(length, 0 if paged else pitch, entries)
        else:
            start = leftpad if paged else rows * pitch + leftpad
            length = seqlens + seqlen_new - leftpad
            bounds_k = torch.stack([start, length], dim=1)
        q_flat = q.reshape(batch * seqlen_q, nheads, headdim)
        varlen = (bounds_q, bounds_k, seqlen_q, capacity if paged else seqlen_cache)
        # Split by the keys there are (the same for a paged and a contiguous cache). Without the read
        # (CUDA-graph capture, FLASHTILE_VALUE_CHECKS=0) by capacity, which a paged table's padding
        # columns can make larger: the split count, and so the last bits of out, can then differ.
        splits = _splits(q, num_splits, batch, nheads, nheads_k, seqlen_q, varlen[3], longest)
        out, lse = _ops.run_forward(q_flat, k_flat, v_flat, opts, backend, varlen,
                                    (block_table.contiguous(), page_size) if paged else None, splits,
                                    fp8=None if fp8 is None else (*fp8, True), append=(k, v) if fused_append else None)
    out = out.view(batch, seqlen_q, nheads, headdim)
    if return_softmax_lse:
        return out, lse.float().view(nheads, batch, seqlen_q).permute(1, 0, 2)
    return out
