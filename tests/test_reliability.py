"""Reliability on CPU: more invalid calls, special values, fuzzing against the oracle.

GPU-only parts (huge tensors, 50/250-run determinism, CUDA graphs) are in tests/kernels/test_gpu_reliability.py;
RELIABILITY.md gives the figures and the commands.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flashtile
from flashtile import (
    flash_attn_backward,
    flash_attn_forward,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    merge_attention_states,
    merge_attention_states_many,
)
from flashtile.distributed import ring_flash_attn_func, shard_sequence, ulysses_attn_func, unshard_sequence
from tests.test_interface import BAD_CALLS
from tests.utils import assert_lse_close, check_against_oracle, make_qkv


def _packed(total_q=10, total_k=12, h=2, hk=2, d=16, dtype=torch.float32):
    return (torch.randn(total_q, h, d, dtype=dtype), torch.randn(total_k, hk, d, dtype=dtype),
            torch.randn(total_k, hk, d, dtype=dtype))


CU_Q = torch.tensor([0, 4, 10], dtype=torch.int32)
CU_K = torch.tensor([0, 5, 12], dtype=torch.int32)


def _varlen(q, k, v, cu_q=CU_Q, cu_k=CU_K, max_q=6, max_k=7, **kw):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def _paged(q, table=None, max_k=7):
    """Paged varlen: a pool of 3 pages of 4 keys; sequences of 5 and 7 keys (two pages each)."""
    pool = torch.randn(3, 4, 2, 16)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32) if table is None else table
    return flash_attn_varlen_func(q, pool, pool, CU_Q, CU_K, 6, max_k, block_table=table)


def _lse_out(q=None):
    q = torch.randn(1, 8, 2, 16) if q is None else q
    return torch.randn_like(q), torch.randn(1, 2, 8)


MORE_BAD_CALLS = [
    # varlen
    ("varlen q rank 4", lambda q, k, v: _varlen(q[None], k, v), ValueError, "q must have 3 dimensions"),
    ("varlen cu int64", lambda q, k, v: _varlen(q, k, v, cu_q=CU_Q.long()), TypeError, "cu_seqlens_q must be int32"),
    ("varlen cu 2-D", lambda q, k, v: _varlen(q, k, v, cu_k=CU_K[None]), ValueError, "cu_seqlens_k must be 1-D"),
    ("varlen cu too short", lambda q, k, v: _varlen(q, k, v, cu_q=CU_Q[:1]), ValueError, "cu_seqlens_q must be 1-D"),
    ("varlen cu below 0", lambda q, k, v: _varlen(q, k, v, cu_q=torch.tensor([-1, 4, 10], dtype=torch.int32)),
     ValueError, r"cu_seqlens_q\[0\] must be >= 0"),
    ("varlen cu decreasing", lambda q, k, v: _varlen(q, k, v, cu_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32),
                                                     cu_k=torch.tensor([0, 5, 6, 12], dtype=torch.int32)),
     ValueError, "non-decreasing"),
    ("varlen cu past the rows", lambda q, k, v: _varlen(q, k, v, cu_k=torch.tensor([0, 5, 13], dtype=torch.int32)),
     ValueError, "must be at most the number of packed tokens"),
    ("varlen cu lengths differ",
     lambda q, k, v: _varlen(q, k, v, cu_k=torch.tensor([0, 12], dtype=torch.int32), max_k=12),
     ValueError, "same length"),
    ("varlen cu tensor list", lambda q, k, v: _varlen(q, k, v, cu_q=[0, 4, 10]), TypeError, "cu_seqlens_q"),
    ("varlen max too small", lambda q, k, v: _varlen(q, k, v, max_q=5), ValueError, "max_seqlen_q"),
    ("varlen max float", lambda q, k, v: _varlen(q, k, v, max_k=7.0), TypeError, "max_seqlen_k"),
    ("varlen max negative", lambda q, k, v: _varlen(q, k, v, max_k=-1), ValueError, "max_seqlen_k"),
    ("varlen block_table with 3-D k",
     lambda q, k, v: _varlen(q, k, v, block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     "k must have 4 dimensions"),
    ("varlen block_table int64", lambda q, k, v: _paged(q, table=torch.zeros(2, 2, dtype=torch.int64)), TypeError,
     "block_table must be an int32"),
    ("varlen block_table rows", lambda q, k, v: _paged(q, table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
     "block_table has 3 rows"),
    ("varlen block_table range", lambda q, k, v: _paged(q, table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)),
     ValueError, "block_table values of the pages in use"),
    ("varlen block_table capacity", lambda q, k, v: _paged(q, table=torch.tensor([[0], [1]], dtype=torch.int32)),
     ValueError, "exceeds what block_table holds"),
    ("varlen k heads", lambda q, k, v: _varlen(q, k[:, :1], v), ValueError, "nheads_k"),
    ("varlen dtype", lambda q, k, v: _varlen(q, k.double(), v.double()), TypeError, "k has dtype"),
    ("varlen alibi batch", lambda q, k, v: _varlen(q, k, v, alibi_slopes=torch.ones(3, 2)), ValueError,
     "alibi_slopes must have shape"),
    ("varlen dropout negative", lambda q, k, v: _varlen(q, k, v, dropout_p=-0.5), ValueError, "dropout_p"),
    ("varlen qkv shape", lambda q, k, v: flash_attn_varlen_qkvpacked_func(q, CU_Q, 6), ValueError, "qkv"),
    ("varlen kv shape", lambda q, k, v: flash_attn_varlen_kvpacked_func(q, k, CU_Q, CU_K, 6, 7), ValueError, "kv"),
    # sinks
    ("sink float64", lambda q, k, v: flash_attn_func(q[None], k[None], v[None], sink=torch.zeros(2).double()),
     TypeError, "sink must be float32"),
    ("sink shape", lambda q, k, v: flash_attn_func(q[None], k[None], v[None], sink=torch.zeros(3)), ValueError,
     "sink must have shape"),
    ("sink list", lambda q, k, v: flash_attn_func(q[None], k[None], v[None], sink=[0.0, 0.0]), TypeError, "sink"),
    # low-level forward/backward
    ("forward rank", lambda q, k, v: flash_attn_forward(q, k, v), ValueError, "q must have 4 dimensions"),
    ("backward dout shape", lambda q, k, v: flash_attn_backward(torch.randn(1, 7, 2, 16), torch.randn(1, 8, 2, 16),
                                                                torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16),
                                                                *_lse_out()), ValueError, "dout must match q"),
    ("backward out dtype", lambda q, k, v: flash_attn_backward(torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16),
                                                               torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16),
                                                               torch.randn(1, 8, 2, 16).double(),
                                                               torch.randn(1, 2, 8)), ValueError, "out must match q"),
    ("backward lse shape", lambda q, k, v: flash_attn_backward(*[torch.randn(1, 8, 2, 16)] * 5,
                                                               torch.randn(1, 8, 2)), ValueError,
     "lse must have shape"),
    ("backward lse bf16", lambda q, k, v: flash_attn_backward(*[torch.randn(1, 8, 2, 16)] * 5,
                                                              torch.randn(1, 2, 8).bfloat16()), TypeError,
     "lse must be a float32 tensor"),
    # merge
    ("merge count", lambda q, k, v: merge_attention_states_many([torch.randn(1, 4, 2, 8)], []), ValueError,
     "as many outs as lses"),
    ("merge lse shape", lambda q, k, v: merge_attention_states(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2),
                                                               torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)),
     ValueError, "lses"),
    ("merge parts of different lengths", lambda q, k, v: merge_attention_states(
        torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4), torch.randn(1, 5, 2, 8), torch.randn(1, 2, 5)), ValueError,
     "shape of outs"),
    ("merge None", lambda q, k, v: merge_attention_states(torch.randn(1, 4, 2, 8), None, torch.randn(1, 4, 2, 8),
                                                          torch.randn(1, 2, 4)), TypeError, r"lses\[0\] must be"),
    ("merge not a list", lambda q, k, v: merge_attention_states_many(torch.randn(2, 1, 4, 2, 8),
                                                                     torch.randn(2, 1, 2, 4)), TypeError,
     "outs must be a list"),
    ("merge int lse", lambda q, k, v: merge_attention_states(torch.randn(1, 4, 2, 8), torch.ones(1, 2, 4).long(),
                                                             torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)),
     TypeError, "float tensor"),
    # distributed helpers
    ("shard length", lambda q, k, v: shard_sequence(torch.zeros(1, 10), 0, 3), ValueError, "multiple of 6"),
    ("shard rank", lambda q, k, v: shard_sequence(torch.zeros(1, 12), 3, 3), ValueError, "rank must be in"),
    ("shard layout", lambda q, k, v: shard_sequence(torch.zeros(1, 12), 0, 3, layout="x"), ValueError, "layout"),
    ("unshard layout", lambda q, k, v: unshard_sequence([torch.zeros(1, 4)], layout="x"), ValueError, "layout"),
    ("ring without init", lambda q, k, v: ring_flash_attn_func(q[None], k[None], v[None]), RuntimeError,
     "torch.distributed"),
    ("ulysses without init", lambda q, k, v: ulysses_attn_func(q[None], k[None], v[None]), RuntimeError,
     "torch.distributed"),
]


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in MORE_BAD_CALLS], ids=[c[0] for c in MORE_BAD_CALLS])
def test_more_bad_input(call, exc, words, monkeypatch):
    launched = []
    for name in ("attention_forward", "attention_backward", "varlen_attention_forward", "varlen_attention_backward"):
        monkeypatch.setattr(flashtile.reference, name, lambda *a, **kw: launched.append(a))
    q, k, v = _packed()
    snapshot = [x.clone() for x in (q, k, v, CU_Q, CU_K)]
    with pytest.raises(exc, match=words):
        call(q, k, v)
    assert not launched, "no kernel may run for an invalid call"
    for before, after in zip(snapshot, (q, k, v, CU_Q, CU_K)):
        assert torch.equal(before, after), "an invalid call must not touch its inputs"


def test_bad_input_matrix_size():
    assert len(BAD_CALLS) + len(MORE_BAD_CALLS) >= 60


# --------------------------------------------------------------------------------------------------
# Special values
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_large_logits_stay_finite(backend_name, backend):
    """Scores around 1e4: float32 statistics keep the result finite and correct."""
    backend(backend_name)
    dtype = torch.float64 if backend_name == "torch" else torch.float16
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 40, 50, 2, 2, 16, dtype)
    scale = 1e4 / 16  # |q.k| ~ 4 for N(0,1) d=16 -> scores ~ 1e4 in magnitude

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_attn_probs=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        return out, lse

    check_against_oracle(run, q, k, v, True, softmax_scale=scale, grads=False)


def test_nan_propagates_only_where_it_must():
    """NaN in query row i poisons out row i only; NaN in key j poisons exactly the rows that see j."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 12, 12, 1, 1, 8, torch.float64, requires_grad=False)
    q_bad = q.clone()
    q_bad[0, 5] = float("nan")
    out = flash_attn_func(q_bad, k, v, causal=True)
    rows_nan = torch.isnan(out).any(-1).any(-1)[0]
    assert rows_nan.tolist() == [i == 5 for i in range(12)]
    k_bad = k.clone()
    k_bad[0, 7] = float("nan")
    out = flash_attn_func(q, k_bad, v, causal=True)
    rows_nan = torch.isnan(out).any(-1).any(-1)[0]
    assert rows_nan.tolist() == [i >= 7 for i in range(12)]  # causal: rows < 7 never see key 7


def test_inf_in_value_reaches_rows_that_attend_it():
    """Inf in value row j: every row that attends key j is non-finite (it must be). Rows of query tiles
    that never visit j's key tile stay finite; rows sharing a tile with j may turn NaN through 0 * inf
    in the tile's P @ V product, as in flash-attn (documented in RELIABILITY.md)."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 300, 300, 1, 1, 8, torch.float64, requires_grad=False)
    v = v.clone()
    v[0, 280, 0, 0] = float("inf")
    out = flash_attn_func(q, k, v, causal=True)
    assert not torch.isfinite(out[0, 280:, 0, 0]).any()
    assert torch.isfinite(out[0, :256]).all()  # query tiles of 128 rows below 256 never visit keys >= 256


def test_fully_masked_rows_by_window():
    """A window that leaves a row nothing: out 0, lse -inf, zero gradient (documented)."""
    q, k, v = make_qkv(1, 6, 2, 1, 1, 8, torch.float64)
    out, lse, _ = flash_attn_func(q, k, v, window_size=(0, 0), return_attn_probs=True)
    # shift = sk - sq = -4: row i sees only key i - 4; rows 0..3 see nothing.
    assert torch.equal(out[0, :4], torch.zeros_like(out[0, :4])) and torch.isneginf(lse[0, 0, :4]).all()
    dq, = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq[0, :4], torch.zeros_like(dq[0, :4]))


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8)])
def test_empty_tensors(shape):
    q = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    k = torch.randn(shape[0], 5, 2, 8, dtype=torch.float64, requires_grad=True)
    out = flash_attn_func(q, k, k)
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_varlen_empty_batch_entries():
    q, k, v = _packed(total_q=4, total_k=4)
    cu = torch.tensor([0, 0, 4, 4], dtype=torch.int32)
    out = _varlen(q, k, v, cu_q=cu, cu_k=cu, max_q=4, max_k=4, causal=True)
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------------
# Fuzzing: shapes and options drawn by hypothesis, checked against the oracle
# --------------------------------------------------------------------------------------------------

_FUZZ = settings(max_examples=int(__import__("os").environ.get("FLASHTILE_FUZZ_EXAMPLES", "25")), deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def _problems(draw, max_seqlen):
    nheads_k = draw(st.sampled_from([1, 2]))
    return dict(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(st.integers(1, max_seqlen)),
        seqlen_k=draw(st.integers(1, max_seqlen)),
        nheads_k=nheads_k,
        nheads=nheads_k * draw(st.sampled_from([1, 2])),
        headdim=draw(st.sampled_from([8, 16, 24, 40])),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (4, 0), (8, 3), (-1, 2)])),
        softcap=draw(st.sampled_from([0.0, 3.0])),
        alibi=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _fuzz_case(p, dtype, device="cpu"):
    torch.manual_seed(p["seed"])
    q, k, v = make_qkv(p["batch"], p["seqlen_q"], p["seqlen_k"], p["nheads"], p["nheads_k"], p["headdim"], dtype,
                       device)
    variant = dict(window_size=p["window"], softcap=p["softcap"])
    if p["alibi"]:
        variant["alibi_slopes"] = torch.rand(p["nheads"], device=device) * 0.2

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=p["causal"], return_attn_probs=True, **variant)
        return out, lse

    check_against_oracle(run, q, k, v, p["causal"], **variant)


@_FUZZ
@given(p=_problems(max_seqlen=150))
def test_fuzz_torch_path(p, backend):
    backend("torch")
    _fuzz_case(p, torch.float64)


@_FUZZ
@given(p=_problems(max_seqlen=70))
def test_fuzz_triton_interpreter(p, backend):
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and no interpreter")
    backend("triton")
    _fuzz_case(p, torch.float16, "cuda" if torch.cuda.is_available() else "cpu")


def test_nothing_nan_in_merge_of_empty_parts():
    out = torch.zeros(1, 3, 1, 4)
    lse = torch.full((1, 1, 3), -math.inf)
    merged, merged_lse = merge_attention_states(out, lse, out, lse)
    assert torch.equal(merged, out) and torch.isneginf(merged_lse).all()


def test_merge_gradients_of_empty_rows_are_zero_and_nan_parts_stay_nan():
    """A row empty in every part: lse -inf, out 0, and gradients 0 (logsumexp's own would be NaN). A NaN lse in
    one part makes its row NaN, not a quiet 0."""
    out_a, out_b = (torch.randn(1, 3, 1, 4, requires_grad=True) for _ in range(2))
    lse_a, lse_b = torch.randn(1, 1, 3), torch.randn(1, 1, 3)
    lse_a[..., 0] = lse_b[..., 0] = -math.inf
    lse_a.requires_grad_()
    lse_b.requires_grad_()
    merged, merged_lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.isneginf(merged_lse[..., 0]).all() and torch.equal(merged[:, 0], torch.zeros_like(merged[:, 0]))
    (merged.sum() + merged_lse[..., 1:].sum()).backward()
    for grad in (lse_a.grad, lse_b.grad, out_a.grad, out_b.grad):
        assert torch.isfinite(grad).all()
    assert lse_a.grad[..., 0].eq(0).all() and out_a.grad[:, 0].eq(0).all()
    lse_nan = torch.zeros(1, 1, 3)
    lse_nan[..., 1] = math.nan
    merged, merged_lse = merge_attention_states(out_a.detach(), lse_nan, out_b.detach(), torch.zeros(1, 1, 3))
    assert torch.isnan(merged[:, 1]).all() and torch.isnan(merged_lse[..., 1]).all()
    assert torch.isfinite(merged[:, [0, 2]]).all()


@st.composite
def _cache_problems(draw):
    nheads_k = draw(st.sampled_from([1, 2]))
    seqlen_q = draw(st.integers(1, 6))
    page = draw(st.sampled_from([None, 16, 32]))
    return dict(
        batch=draw(st.integers(1, 3)),
        seqlen_q=seqlen_q,
        seqlen_new=draw(st.sampled_from([0, seqlen_q])),
        nheads_k=nheads_k,
        nheads=nheads_k * draw(st.sampled_from([1, 2, 4])),  # group 2, 4: GQA rows packed in one block
        headdim=draw(st.sampled_from([16, 32, 40])),
        page=page,
        cache_len=page * draw(st.integers(1, 5)) if page else draw(st.integers(8, 160)),
        num_splits=draw(st.integers(0, 4)),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([(-1, -1), (6, 0), (10, 2)])),
        softcap=draw(st.sampled_from([0.0, 3.0])),
        alibi=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@_FUZZ
@given(p=_cache_problems())
@example(p=dict(batch=2, seqlen_q=3, seqlen_new=0, nheads_k=1, nheads=2, headdim=16, page=None, cache_len=8,
                num_splits=0, causal=False, window=(-1, -1), softcap=0.0, alibi=False, seed=0, empty_cache=True))
def test_fuzz_kvcache_triton_interpreter(p, backend):
    """flash_attn_with_kvcache through the kernels (GQA packing, paged pools, split-KV) against the PyTorch
    path in float64 on the same cache, and the in-place appends identical."""
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and no interpreter")
    from flashtile import flash_attn_with_kvcache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(p["seed"])
    b, sq, new, h, hk, d = p["batch"], p["seqlen_q"], p["seqlen_new"], p["nheads"], p["nheads_k"], p["headdim"]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.float16).to(device)

    if p["page"]:
        pages_per_seq = p["cache_len"] // p["page"]
        pool = (b * pages_per_seq + 2, p["page"], hk, d)  # two spare pages
        k_cache, v_cache = randn(*pool), randn(*pool)
        table = torch.randperm(b * pages_per_seq + 2, generator=gen)[: b * pages_per_seq].view(b, pages_per_seq)
        extra = dict(block_table=table.to(torch.int32).to(device))
    else:
        k_cache, v_cache = randn(b, p["cache_len"], hk, d), randn(b, p["cache_len"], hk, d)
        extra = {}
    q = randn(b, sq, h, d)
    k_new, v_new = (randn(b, new, hk, d), randn(b, new, hk, d)) if new else (None, None)
    seqlens = torch.randint(0, p["cache_len"] - new + 1, (b,), generator=gen).to(torch.int32).to(device)
    if p.get("empty_cache"):
        seqlens.zero_()  # with seqlen_new = 0: no row sees a key, every lse is -inf
    if p["alibi"]:
        extra["alibi_slopes"] = (torch.rand(h, generator=gen) * 0.2).to(device)
    kwargs = dict(cache_seqlens=seqlens, causal=p["causal"], window_size=p["window"], softcap=p["softcap"],
                  return_softmax_lse=True, **extra)

    backend("torch")
    k64, v64 = k_cache.double(), v_cache.double()
    out_ref, lse_ref = flash_attn_with_kvcache(q.double(), k64, v64, None if k_new is None else k_new.double(),
                                               None if v_new is None else v_new.double(), **kwargs)
    backend("triton")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, num_splits=p["num_splits"], **kwargs)
    assert torch.equal(k_cache.double(), k64) and torch.equal(v_cache.double(), v64)  # same appends
    assert not torch.isnan(out).any()
    assert (out.double() - out_ref).abs().max().item() < 4e-3
    assert_lse_close(lse, lse_ref, floor=2e-3)  # seqlen_new = 0 with an empty cache leaves no finite row
