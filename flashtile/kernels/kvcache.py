"""Appending new keys and values to a KV cache in place: one launch for k and v.

A decoding step appends one token per sequence; written with PyTorch's indexing that is an index
computation and two scatters, about eight launches of host time for a few kilobytes of data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs


@triton.jit
def _cache_row(batch, step, in_range, Seqlens, Rows, BlockTable, stride_table_b, row_stride, capacity, num_rows,
               PAGE_SIZE: tl.constexpr, HAS_ROWS: tl.constexpr):
    """(row, valid): the flattened cache row of new token ``step`` of sequence ``batch`` (scalars, or
    vectors of tokens with ``in_range`` masking the padding), and whether it lies inside the cache.

    Its logical position is ``Seqlens[b] + t``; its row in the flattened cache (rows, nheads_k, head_dim)
    is ``Rows[b] * row_stride + position`` (``Rows`` = cache_batch_idx, or b), or, paged, row
    ``position % PAGE_SIZE`` of page ``BlockTable[b, position // PAGE_SIZE]``. A position outside
    [0, capacity) or a row outside the cache is not valid.
    """
    position = tl.load(Seqlens + batch, mask=in_range, other=-1) + step
    valid = in_range & (position >= 0) & (position < capacity)
    if PAGE_SIZE > 0:
        page = tl.load(BlockTable + batch.to(tl.int64) * stride_table_b + position // PAGE_SIZE, mask=valid,
                       other=-1)
        row = page.to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE
        valid = valid & (page >= 0)
    else:
        if HAS_ROWS:
            cache_row = tl.load(Rows + batch, mask=in_range, other=0)
        else:
            cache_row = batch
        row = cache_row.to(tl.int64) * row_stride + position
    valid = valid & (row >= 0) & (row < num_rows)
    return row, valid


@triton.jit
def _quantized(x, Descale, batch, heads, stride_descale_b, stride_descale_h, nheads_k):
    """float8_e4m3fn ``x / descale[batch, head]`` saturated at +-448 (NaN kept), rounded to nearest even: the
    bits of ``flashtile.fp8.quantize_with`` (an IEEE division, as PyTorch's; Triton's ``/`` is approximate)."""
    descale = tl.load(Descale + batch.to(tl.int64) * stride_descale_b + heads * stride_descale_h,
                      mask=heads < nheads_k, other=1.0)
    scaled = tl.math.div_rn(x.to(tl.float32), descale[:, None])
    return tl.clamp(scaled, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)


@triton.jit
def _append_kv(
    KNew, VNew, KCache, VCache, Seqlens, Rows, BlockTable, Lengths, KDescale, VDescale,
    stride_knew_b, stride_knew_t, stride_knew_h, stride_vnew_b, stride_vnew_t, stride_vnew_h,
    stride_kcache_row, stride_kcache_h, stride_vcache_row, stride_vcache_h, stride_vcache_d, stride_table_b,
    stride_kdescale_b, stride_kdescale_h, stride_vdescale_b, stride_vdescale_h,
    seqlen_new, nheads_k, row_stride, capacity, num_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_ROWS: tl.constexpr, WRITE_LENGTHS: tl.constexpr,
):
    """Program (b * seqlen_new + t, head block): copy token t of sequence b into its cache row
    (``_cache_row``). A token whose row is not valid writes nothing: the host checks these values, and a
    value changed behind its back must still not write outside the tensors. WRITE_LENGTHS: program
    (b * seqlen_new, 0) also stores ``Seqlens[b] + seqlen_new`` into ``Lengths[b]`` (the keys the
    attention kernel then reads). Into an FP8 cache, tokens of another dtype are quantized with the
    descales (float32 (batch, nheads_k)) of their batch entry b (``_quantized``).
    """
    QUANTIZE_K: tl.constexpr = (KCache.dtype.element_ty == tl.float8e4nv) and (KNew.dtype.element_ty != tl.float8e4nv)
    QUANTIZE_V: tl.constexpr = (VCache.dtype.element_ty == tl.float8e4nv) and (VNew.dtype.element_ty != tl.float8e4nv)
    token = tl.program_id(0)
    batch = token // seqlen_new
    step = token % seqlen_new
    if WRITE_LENGTHS:
        if (step == 0) & (tl.program_id(1) == 0):
            tl.store(Lengths + batch, tl.load(Seqlens + batch) + seqlen_new)
    row, valid = _cache_row(batch, step, True, Seqlens, Rows, BlockTable, stride_table_b, row_stride, capacity,
                            num_rows, PAGE_SIZE, HAS_ROWS)
    # 64-bit head offsets: an FP8 V cache laid out positions-fastest has a head stride of head_dim * rows
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid & (heads[:, None] < nheads_k) & (offs_d[None, :] < HEAD_DIM)
    k_new = tl.load(KNew + batch.to(tl.int64) * stride_knew_b + step.to(tl.int64) * stride_knew_t
                    + heads[:, None] * stride_knew_h + offs_d[None, :], mask=mask)
    v_new = tl.load(VNew + batch.to(tl.int64) * stride_vnew_b + step.to(tl.int64) * stride_vnew_t
                    + heads[:, None] * stride_vnew_h + offs_d[None, :], mask=mask)
    if QUANTIZE_K:
        k_new = _quantized(k_new, KDescale, batch, heads, stride_kdescale_b, stride_kdescale_h, nheads_k)
    if QUANTIZE_V:
        v_new = _quantized(v_new, VDescale, batch, heads, stride_vdescale_b, stride_vdescale_h, nheads_k)
    tl.store(KCache + row * stride_kcache_row + heads[:, None] * stride_kcache_h + offs_d[None, :], k_new, mask=mask)
    # stride_vcache_d: 1 (specialized away), or an FP8 V cache laid out positions-fastest
    tl.store(VCache + row * stride_vcache_row + heads[:, None] * stride_vcache_h
             + offs_d.to(tl.int64)[None, :] * stride_vcache_d, v_new, mask=mask)


@triton.jit
def _append_conflicts(
    Seqlens, Rows, BlockTable, Conflict, stride_table_b, seqlen_new, num_tokens, row_stride, capacity, num_rows,
    BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    """Program (i, j), i <= j: Conflict becomes 1 if a token of tile i and another token of tile j would be
    appended to the same cache row (a repeated cache_batch_idx, a page two block-table entries share)."""
    tile_i = tl.program_id(0)
    tile_j = tl.program_id(1)
    if tile_j >= tile_i:  # the pairs are symmetric: one program per unordered pair of tiles
        tokens_i = tile_i * BLOCK + tl.arange(0, BLOCK)
        tokens_j = tile_j * BLOCK + tl.arange(0, BLOCK)
        row_i, valid_i = _cache_row(tokens_i // seqlen_new, tokens_i % seqlen_new, tokens_i < num_tokens, Seqlens,
                                    Rows, BlockTable, stride_table_b, row_stride, capacity, num_rows, PAGE_SIZE,
                                    HAS_ROWS)
        row_j, valid_j = _cache_row(tokens_j // seqlen_new, tokens_j % seqlen_new, tokens_j < num_tokens, Seqlens,
                                    Rows, BlockTable, stride_table_b, row_stride, capacity, num_rows, PAGE_SIZE,
                                    HAS_ROWS)
        same = ((row_i[:, None] == row_j[None, :]) & valid_i[:, None] & valid_j[None, :]
                & (tokens_i[:, None] != tokens_j[None, :]))
        tl.atomic_max(Conflict, tl.max(tl.max(same.to(tl.int32), 1), 0))


def append_kv(k_new: torch.Tensor, v_new: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
              seqlens: torch.Tensor, rows: torch.Tensor | None, block_table: torch.Tensor | None, page_size: int,
              row_stride: int, capacity: int, lengths: torch.Tensor | None = None,
              descales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``k_new``, ``v_new`` (batch, seqlen_new, nheads_k, head_dim) into the flattened caches
    ``k_flat``, ``v_flat`` (rows, nheads_k, head_dim; ``k_flat``'s last dim contiguous, ``v_flat`` any
    strides) at positions ``seqlens[b] + t``; with ``lengths``
    (int32 (batch,)) also store ``seqlens + seqlen_new`` there, in the same launch. ``descales``: an FP8
    cache's (k_descale, v_descale), float32 (batch, nheads_k): new tokens that are not float8 are quantized
    with them (``x / descale`` saturated, as ``flashtile.fp8.quantize_with``).

    Args:
        seqlens: int32 (batch,), tokens already in each sequence.
        rows: None, or int32 (batch,) cache entry of each sequence (cache_batch_idx; not paged).
        block_table: None, or int32 (batch, max_pages) with ``page_size`` rows per page (paged cache).
        row_stride: rows of the cache's row view per entry (``inference.cache_layout``'s pitch).
        capacity: the most positions a sequence holds (seqlen_cache, or max_pages * page_size).
    """
    configs.target_of(k_new.device)  # a GPU the kernels do not run on: its error before the cache is written
    batch, seqlen_new, nheads_k, headdim = k_new.shape
    if batch * seqlen_new == 0:
        if lengths is not None:
            lengths.copy_(seqlens)
        return
    block_d = configs.next_power_of_2(headdim)
    # About 4096 elements per program: one (token, all heads) row for common head counts.
    block_h = max(1, min(configs.next_power_of_2(nheads_k), 4096 // block_d))
    placeholder = seqlens  # any int32 pointer for the variant's unused index tensor
    table = block_table if block_table is not None else placeholder
    quantizing = [x.dtype != cache.dtype and cache.dtype == torch.float8_e4m3fn
                  for x, cache in ((k_new, k_flat), (v_new, v_flat))]
    if any(quantizing) and descales is None:
        raise ValueError("append_kv: new tokens for an FP8 cache need its descales")
    k_descale, v_descale = (d if q else placeholder for d, q in zip(descales or (None, None), quantizing))
    configs.launch_plain(
        _append_kv, (batch * seqlen_new, configs.cdiv(nheads_k, block_h)),
        k_new, v_new, k_flat, v_flat, seqlens, rows if rows is not None else placeholder, table,
        lengths if lengths is not None else placeholder, k_descale, v_descale,
        k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1), v_flat.stride(2),
        table.stride(0) if block_table is not None else 0,
        *(k_descale.stride() if quantizing[0] else (0, 0)), *(v_descale.stride() if quantizing[1] else (0, 0)),
        seqlen_new, nheads_k, row_stride, capacity, k_flat.shape[0],
        HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_H=block_h, PAGE_SIZE=page_size if block_table is not None else 0,
        HAS_ROWS=rows is not None, WRITE_LENGTHS=lengths is not None,
    )


def append_conflicts(seqlens: torch.Tensor, rows: torch.Tensor | None, block_table: torch.Tensor | None,
                     page_size: int, seqlen_new: int, row_stride: int, capacity: int, num_rows: int) -> torch.Tensor:
    """0-d int32 tensor on the device, 1 if two of the batch * seqlen_new new tokens would be appended to one
    cache row (arguments as in ``append_kv``; ``num_rows`` the flattened cache's rows). Not read here: the
    caller reads it with its other index checks, in one device-to-host copy.

    One launch of pairwise comparisons between tiles of tokens, instead of building and sorting the rows
    with some ten PyTorch launches: a decoding step of 256 sequences is 4 x 4 programs (10 compare).
    """
    num_tokens = seqlens.shape[0] * seqlen_new
    conflict = torch.zeros(1, dtype=torch.int32, device=seqlens.device)
    block = max(16, min(64, configs.next_power_of_2(num_tokens)))
    tiles = configs.cdiv(num_tokens, block)
    configs.launch_plain(
        _append_conflicts, (tiles, tiles),
        seqlens, rows if rows is not None else seqlens, block_table if block_table is not None else seqlens,
        conflict, block_table.stride(0) if block_table is not None else 0, seqlen_new, num_tokens, row_stride,
        capacity, num_rows,
        BLOCK=block, PAGE_SIZE=page_size if block_table is not None else 0, HAS_ROWS=rows is not None,
    )
    return conflict[0]


@triton.jit
def _rotary(
    X, Out, Cos, Sin, Seqlens, seqlen_x, nheads, table_len,
    stride_xb, stride_xt, stride_xh, stride_ob, stride_ot, stride_oh, stride_cos_t, stride_cos_d, stride_sin_t,
    stride_sin_d,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, BY_TOKEN: tl.constexpr,
):
    """Program (b * seqlen_x + t, head block): Out[b, t] = X[b, t] with its first 2 * HALF features rotated at
    cache position ``Seqlens[b] (+ t with BY_TOKEN)``, clamped to the table's ``table_len`` rows; the rest
    copied. Pairs (2j, 2j + 1) when INTERLEAVED, else (j, j + HALF); in float32, each product and difference
    rounded (launched without FMA contraction), as ``inference._rotate`` computes it."""
    token = tl.program_id(0)
    batch = token // seqlen_x
    step = token % seqlen_x
    position = tl.load(Seqlens + batch).to(tl.int64)  # (64-bit: unchecked lengths near 2**31 do not wrap)
    if BY_TOKEN:
        position += step
    position = tl.minimum(tl.maximum(position, 0), table_len - 1)
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(Cos + position * stride_cos_t + pairs * stride_cos_d, mask=pairs < HALF).to(tl.float32)[None, :]
    sin = tl.load(Sin + position * stride_sin_t + pairs * stride_sin_d, mask=pairs < HALF).to(tl.float32)[None, :]
    if INTERLEAVED:
        first = 2 * pairs
        second = first + 1
    else:
        first = pairs
        second = pairs + HALF
    x_row = X + batch.to(tl.int64) * stride_xb + step.to(tl.int64) * stride_xt + heads[:, None] * stride_xh
    out_row = Out + batch.to(tl.int64) * stride_ob + step.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    mask = (heads[:, None] < nheads) & (pairs[None, :] < HALF)
    x1 = tl.load(x_row + first[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=mask).to(tl.float32)
    tl.store(out_row + first[None, :], (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(out_row + second[None, :], (x1 * sin + x2 * cos).to(Out.dtype.element_ty), mask=mask)
    if HEAD_DIM > 2 * HALF:
        rest = 2 * HALF + tl.arange(0, BLOCK_REST)
        rest_mask = (heads[:, None] < nheads) & (rest[None, :] < HEAD_DIM)
        tl.store(out_row + rest[None, :], tl.load(x_row + rest[None, :], mask=rest_mask), mask=rest_mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: torch.Tensor, by_token: bool,
           interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen_x, nheads, head_dim), last dim contiguous, rotated at the cache positions
    ``seqlens[b] + t`` (``by_token``) or ``seqlens[b]``, clamped to the tables: a new contiguous tensor of x's
    dtype, the rotation of ``inference._rotate`` (float32, the same roundings) in one launch instead of a dozen
    PyTorch ones, which a launch plan records.

    Args:
        cos, sin: float (seqlen_ro, rotary_dim / 2) tables, rotary_dim <= head_dim.
        seqlens: int32 (batch,), contiguous.
    """
    batch, seqlen_x, nheads, headdim = x.shape
    out = torch.empty((batch, seqlen_x, nheads, headdim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    half = cos.shape[1]
    block_half = configs.next_power_of_2(max(half, 1))
    block_rest = configs.next_power_of_2(max(headdim - 2 * half, 1))
    block_h = max(1, min(configs.next_power_of_2(nheads), 4096 // max(2 * block_half, block_rest)))
    configs.launch_plain(
        _rotary, (batch * seqlen_x, configs.cdiv(nheads, block_h)),
        x, out, cos, sin, seqlens, seqlen_x, nheads, cos.shape[0],
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        HEAD_DIM=headdim, HALF=half, BLOCK_HALF=block_half, BLOCK_REST=block_rest, BLOCK_H=block_h,
        INTERLEAVED=interleaved, BY_TOKEN=by_token, enable_fp_fusion=False,
    )
    return out
