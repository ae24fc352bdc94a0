"""KV-cache cases shared by the PyTorch-path and kernel tests: oracle on the gathered, rotated, appended cache."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.inference import _rotate
from flashtile.reference import attention_ref
from tests.utils import assert_lse_close, assert_rule

CASES = [
    # (batch, seqlen_q, seqlen_new, cache_len, nheads, nheads_k, causal, window, rotary, interleaved,
    #  batch_idx, leftpad)
    (2, 1, 1, 64, 4, 2, True, (-1, -1), False, True, False, False),  # decode, GQA
    (3, 5, 5, 80, 4, 4, True, (-1, -1), True, False, False, False),  # chunked prefill, rotary halves
    (2, 3, 3, 50, 4, 1, True, (8, 0), True, True, True, False),  # MQA, window, interleaved, batch_idx
    (2, 1, 0, 40, 2, 2, False, (-1, -1), False, True, False, True),  # no new tokens, leftpad
    (2, 4, 2, 48, 4, 2, False, (-1, -1), True, True, False, True),  # q longer than new k, not causal
]


# Cache layouts flash-attn takes (any batch stride): their memory, and the (batch_cache, seqlen_cache, nheads_k,
# headdim) view of it that flash_attn_with_kvcache is given.
LAYOUTS = {
    "contiguous": lambda b, s, h, d, **kw: [torch.zeros(b, s, h, d, **kw) for _ in range(2)],
    # Hugging Face's static cache, (batch, heads, seqlen, headdim), transposed
    "heads-first": lambda b, s, h, d, **kw: [torch.zeros(b, h, s, d, **kw).transpose(1, 2) for _ in range(2)],
    # the first seqlen_cache positions of a longer cache
    "sliced": lambda b, s, h, d, **kw: [torch.zeros(b, s + 5, h, d, **kw)[:, i:s + i] for i in (0, 5)],
    # keys and values of a position side by side in one buffer
    "kv-interleaved": lambda b, s, h, d, **kw: list(torch.zeros(b, s, 2, h, d, **kw).unbind(2)),
    # the same pitch, other row strides: k contiguous, v interleaved with another buffer
    "mixed": lambda b, s, h, d, **kw: [torch.zeros(b, s, h, d, **kw), torch.zeros(b, s, 2, h, d, **kw)[:, :, 1]],
}


# Cases for the strided layouts: a decoding step; GQA with a window, rotary and cache_batch_idx; left padding.
LAYOUT_CASES = [
    CASES[0],
    (2, 3, 3, 50, 4, 2, True, (8, 0), True, True, True, False),
    CASES[3],
]


def cache_pair(layout, batch_cache, cache_len, nheads_k, headdim, dtype, device):
    """Random k_cache, v_cache in ``LAYOUTS[layout]``."""
    caches = LAYOUTS[layout](batch_cache, cache_len, nheads_k, headdim, dtype=dtype, device=device)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, dtype=dtype, device=device))
    return caches


def check_kvcache(case, dtype, device, layout="contiguous"):
    (batch, seqlen_q, seqlen_new, cache_len, nheads, nheads_k, causal, window, rotary, interleaved, use_idx,
     use_leftpad) = case
    torch.manual_seed(sum(case[:6]))
    headdim = 32
    batch_cache = batch + 2 if use_idx else batch
    k_cache, v_cache = cache_pair(layout, batch_cache, cache_len, nheads_k, headdim, dtype, device)
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype, device=device)
    k_new = torch.randn(batch, seqlen_new, nheads_k, headdim, dtype=dtype, device=device) if seqlen_new else None
    v_new = torch.randn_like(k_new) if seqlen_new else None
    seqlens = torch.randint(cache_len // 4, cache_len - seqlen_new, (batch,), dtype=torch.int32).to(device)
    rows = torch.randperm(batch_cache)[:batch].to(torch.int32).to(device) if use_idx else None
    leftpad = torch.randint(0, cache_len // 4, (batch,), dtype=torch.int32).to(device) if use_leftpad else None
    cos = sin = None
    if rotary:
        angles = torch.rand(cache_len, headdim // 4, device=device) * 6  # rotary_dim = headdim / 2
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    bases = {c._base.data_ptr(): c._base for c in (k_cache, v_cache) if c._base is not None}
    bases_before = {key: base.clone() for key, base in bases.items()}

    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, rows, leftpad,
                                       causal=causal, window_size=window, rotary_interleaved=interleaved,
                                       return_softmax_lse=True)
    assert lse.is_contiguous() and lse.shape == (batch, nheads, seqlen_q)  # as flash-attn's: views of it work

    # The append, element by element; nothing else changed.
    rows_l = rows.tolist() if rows is not None else list(range(batch))
    lefts = leftpad.tolist() if leftpad is not None else [0] * batch
    expected_k, expected_v = k_before.clone(), v_before.clone()
    for b, r in enumerate(rows_l):
        s = int(seqlens[b])
        if seqlen_new:
            kb = k_new[b:b + 1]
            if rotary:
                pos = torch.arange(s, s + seqlen_new, device=device)  # cache positions: leftpad shifts nothing
                kb = _rotate(kb, cos[pos][None], sin[pos][None], interleaved)
            expected_k[r, s:s + seqlen_new] = kb[0]
            expected_v[r, s:s + seqlen_new] = v_new[b]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for key, base in bases.items():  # memory around a strided cache untouched
        expected = bases_before[key]
        for cache, values in ((k_cache, expected_k), (v_cache, expected_v)):
            if cache._base is not None and cache._base.data_ptr() == key:
                expected.as_strided(cache.shape, cache.stride(), cache.storage_offset()).copy_(values)
        assert torch.equal(base, expected)

    # The oracle on each entry's gathered cache.
    outs_ref, outs_pt, lses_ref = [], [], []
    for b, r in enumerate(rows_l):
        s = int(seqlens[b])
        keys = expected_k[r:r + 1, lefts[b]:s + seqlen_new]
        values = expected_v[r:r + 1, lefts[b]:s + seqlen_new]
        qb = q[b:b + 1]
        if rotary:
            local = causal or window != (-1, -1)
            pos = torch.arange(s, s + seqlen_q, device=device) if local else torch.full((seqlen_q,), s, device=device)
            qb = _rotate(qb, cos[pos][None], sin[pos][None], interleaved)
        o, lse_b = attention_ref(qb, keys, values, causal=causal, window_size=window, compute_dtype=torch.float64)
        outs_ref.append(o)
        lses_ref.append(lse_b)
        outs_pt.append(attention_ref(qb, keys, values, causal=causal, window_size=window)[0])
    out_ref, out_pt, lse_ref = torch.cat(outs_ref), torch.cat(outs_pt), torch.cat(lses_ref)
    assert_rule("out", out, out_ref, out_pt, 2.0)
    assert_lse_close(lse, lse_ref)


def check_expanded_cache(dtype, device):
    """One prompt's cache expanded over a batch (batch stride 0, as flash-attn reads it) gives the bits of its
    copy per entry."""
    torch.manual_seed(3)
    batch, cache_len, nheads, nheads_k, headdim = 3, 70, 4, 2, 32
    shared = [torch.randn(1, cache_len, nheads_k, headdim, dtype=dtype, device=device) for _ in range(2)]
    q = torch.randn(batch, 1, nheads, headdim, dtype=dtype, device=device)
    seqlens = torch.tensor([70, 9, 41], dtype=torch.int32, device=device)
    out = flash_attn_with_kvcache(q, *(c.expand(batch, -1, -1, -1) for c in shared), cache_seqlens=seqlens)
    copies = [c.expand(batch, -1, -1, -1).contiguous() for c in shared]
    assert torch.equal(out, flash_attn_with_kvcache(q, *copies, cache_seqlens=seqlens))


def check_paged_matches_contiguous(page_size, dtype, device, causal=True, new=2):
    """The same cache laid out in shuffled pages gives the same output and the same appended tokens."""
    torch.manual_seed(page_size)
    batch, nheads, nheads_k, headdim, max_pages = 3, 4, 2, 32, 5
    cache_len = max_pages * page_size
    k_cache = torch.randn(batch, cache_len, nheads_k, headdim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, new, nheads, headdim, dtype=dtype, device=device)
    k_new, v_new = (torch.randn(batch, new, nheads_k, headdim, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.randint(1, cache_len - new, (batch,), dtype=torch.int32).to(device)

    num_pages = batch * max_pages + 3  # a pool with spare pages, in shuffled order
    order = torch.randperm(num_pages)[: batch * max_pages].view(batch, max_pages)
    # Two columns of -1 after the pages in use: padding, as serving engines leave it (never read).
    block_table = torch.cat([order.to(torch.int32), torch.full((batch, 2), -1, dtype=torch.int32)], 1).to(device)
    k_pool = torch.zeros(num_pages, page_size, nheads_k, headdim, dtype=dtype, device=device)
    v_pool = torch.zeros_like(k_pool)
    for b in range(batch):
        for p in range(max_pages):
            k_pool[order[b, p]] = k_cache[b, p * page_size:(p + 1) * page_size]
            v_pool[order[b, p]] = v_cache[b, p * page_size:(p + 1) * page_size]

    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal)
    out_paged = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens,
                                        block_table=block_table, causal=causal)
    torch.testing.assert_close(out_paged, out, rtol=0, atol=0)
    for b in range(batch):
        for p in range(max_pages):
            assert torch.equal(k_pool[order[b, p]], k_cache[b, p * page_size:(p + 1) * page_size])
            assert torch.equal(v_pool[order[b, p]], v_cache[b, p * page_size:(p + 1) * page_size])


def check_split_kv_matches_unsplit(num_splits, dtype, device, paged=False):
    """Split-KV gives the unsplit result (to rounding): same out and lse, sinks counted once."""
    torch.manual_seed(num_splits)
    batch, nheads, nheads_k, headdim, cache_len = 2, 4, 2, 32, 200
    k_cache = torch.randn(batch, cache_len, nheads_k, headdim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 1, nheads, headdim, dtype=dtype, device=device)
    seqlens = torch.tensor([37, 200], dtype=torch.int32, device=device)
    kwargs = dict(cache_seqlens=seqlens, causal=True, return_softmax_lse=True)
    one, lse_one = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1, **kwargs)
    many, lse_many = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, **kwargs)
    torch.testing.assert_close(many, one, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse_many, lse_one, atol=1e-4, rtol=0)


def check_cache_lengths(form, dtype, device):
    """A contiguous cache read in place (no batch_idx, leftpad or pages): the kernels take the lengths as
    they are (``CacheLengths``) — given as an int, as a strided int32 view, or not at all (the whole
    cache). Checked against the oracle on each sequence's keys; the bounds tensor of the other forms
    (cache_leftpad of zeros) must give the same bits."""
    torch.manual_seed(len(form))
    batch, seqlen_q, nheads, nheads_k, headdim, cache_len, page = 3, 2, 4, 2, 32, 80, 16
    k_cache = torch.randn(batch, cache_len, nheads_k, headdim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype, device=device)
    paged = {}
    if form == "int":
        seqlens, lengths = 41, [41] * batch
    elif form == "none":
        seqlens, lengths = None, [cache_len] * batch
    else:
        pairs = torch.tensor([[5, 0], [80, 0], [33, 0]], dtype=torch.int32, device=device)
        seqlens, lengths = pairs[:, 0], [5, 80, 33]  # a view with stride 2
        if form == "paged":  # the same rows in shuffled pages of a pool (positions 0.. of each sequence)
            order = torch.randperm(batch * cache_len // page)
            pool_k, pool_v = (x.reshape(-1, page, nheads_k, headdim)[order.argsort()] for x in (k_cache, v_cache))
            paged = dict(block_table=order.view(batch, -1).to(torch.int32).to(device))
    caches = (pool_k, pool_v) if paged else (k_cache, v_cache)
    out = flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens, causal=True, **paged)
    zeros = torch.zeros(batch, dtype=torch.int32, device=device)
    as_tensor = torch.tensor(lengths, dtype=torch.int32, device=device)
    out_bounds = flash_attn_with_kvcache(q, *caches, cache_seqlens=as_tensor, cache_leftpad=zeros, causal=True,
                                         **paged)
    assert torch.equal(out, out_bounds)
    for b, length in enumerate(lengths):
        keys, values = k_cache[b:b + 1, :length], v_cache[b:b + 1, :length]
        ref, _ = attention_ref(q[b:b + 1], keys, values, causal=True, compute_dtype=torch.float64)
        pt, _ = attention_ref(q[b:b + 1], keys, values, causal=True)
        assert_rule(f"out[{b}]", out[b:b + 1], ref, pt, 2.0)


def check_overlapping_appends(dtype, device):
    """Two new tokens bound for one cache slot (a repeated cache_batch_idx, block-table rows appending into
    a shared page slot) are refused before anything is written; appends into
    distinct slots of shared pages, and repeated rows or pages that are only read, are fine."""
    torch.manual_seed(0)
    q = torch.randn(3, 2, 4, 16, dtype=dtype, device=device)
    new = torch.randn(3, 2, 2, 16, dtype=dtype, device=device)
    pool_k, pool_v = (torch.randn(6, 8, 2, 16, dtype=dtype, device=device) for _ in range(2))

    def table(rows):
        return torch.tensor(rows, dtype=torch.int32, device=device)

    def paged(rows, seqlens, k=new):
        before = (pool_k.clone(), pool_v.clone())
        try:
            return flash_attn_with_kvcache(q, pool_k, pool_v, k, k, cache_seqlens=table(seqlens),
                                           block_table=table(rows))
        except ValueError:
            assert torch.equal(pool_k, before[0]) and torch.equal(pool_v, before[1]), "a refused call wrote"
            raise

    with pytest.raises(ValueError, match="same cache slot"):  # entries 0 and 2 append at slot 9 of page 1
        paged([[0, 1], [2, 3], [4, 1]], [9, 9, 9])
    paged([[0, 1], [2, 3], [4, 1]], [9, 9, 11])  # page 1 shared, slots 9-10 and 11-12 apart
    paged([[0, 1], [0, 3], [0, 5]], [9, 9, 9])  # page 0 shared by all three, read only
    cache_k, cache_v = (torch.randn(4, 16, 2, 16, dtype=dtype, device=device) for _ in range(2))
    with pytest.raises(ValueError, match="same cache slot"):
        flash_attn_with_kvcache(q, cache_k, cache_v, new, new, cache_seqlens=3,
                                cache_batch_idx=table([1, 3, 1]))
    flash_attn_with_kvcache(q, cache_k, cache_v, new, new, cache_seqlens=3, cache_batch_idx=table([1, 3, 0]))
    flash_attn_with_kvcache(q, cache_k, cache_v, cache_seqlens=3, cache_batch_idx=table([1, 1, 1]))  # read only
