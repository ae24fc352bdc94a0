"""flash_attn_with_kvcache on the PyTorch path (fp32/fp64), bad input, and a generation loop."""

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from flashtile import flash_attn_with_kvcache
from flashtile.nn import GPT, GPTConfig
from tests.kvcache_cases import (
    CASES,
    LAYOUT_CASES,
    check_cache_lengths,
    check_expanded_cache,
    check_kvcache,
    check_overlapping_appends,
    check_paged_matches_contiguous,
    check_split_kv_matches_unsplit,
)
from tests.utils import run_without_triton


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-new{c[2]}-causal{c[6]}-rot{c[8]}")
def test_kvcache_against_oracle(case, dtype):
    check_kvcache(case, dtype, "cpu")


@pytest.mark.parametrize("layout", ["heads-first", "sliced", "kv-interleaved", "mixed"])
@pytest.mark.parametrize("case", LAYOUT_CASES,
                         ids=lambda c: f"b{c[0]}-q{c[1]}-new{c[2]}-idx{c[10]}-leftpad{c[11]}")
def test_kvcache_any_batch_stride(case, layout):
    """Caches laid out as flash-attn takes them, any batch stride with the positions' rows in it."""
    check_kvcache(case, torch.float64, "cpu", layout)


def test_cache_expanded_over_its_batch_is_read_as_its_copy():
    check_expanded_cache(torch.float32, "cpu")


def test_one_sequence_appends_to_a_cache_expanded_over_its_batch():
    """One sequence writes into one batch entry: new tokens may go into a cache whose entries share memory."""
    shared = [torch.randn(1, 16, 2, 8, dtype=torch.float64) for _ in range(2)]
    k_new, v_new = (torch.randn(1, 2, 2, 8, dtype=torch.float64) for _ in range(2))
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    copies = [c.clone() for c in shared]
    out = flash_attn_with_kvcache(q, *(c.expand(3, -1, -1, -1) for c in shared), k_new, v_new, cache_seqlens=5)
    assert torch.equal(out, flash_attn_with_kvcache(q, *copies, k_new, v_new, cache_seqlens=5))
    assert torch.equal(shared[0], copies[0]) and torch.equal(shared[1], copies[1])


def test_strided_fp8_cache_refused_after_its_dtype():
    """An FP8 cache must be contiguous over its first two dims (its own rows are indexed); a 16-bit cache given
    FP8 arguments is refused for its dtype first, whatever its layout."""
    from flashtile import fp8

    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    (k8, kd), (v8, vd) = (fp8.quantize(torch.randn(2, 16, 2, 16)) for _ in range(2))
    k8, v8 = (torch.empty(2, 2, 16, 16, dtype=x.dtype).transpose(1, 2).copy_(x) for x in (k8, v8))  # transposed
    with pytest.raises(ValueError, match="contiguous over their first two dims"):
        flash_attn_with_kvcache(q, k8, v8, cache_seqlens=5, k_descale=kd, v_descale=vd)
    strided = torch.randn(2, 2, 16, 16, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(TypeError, match="k_cache"):
        flash_attn_with_kvcache(q, strided, strided.clone(), cache_seqlens=5, out_dtype=torch.bfloat16)


class Passthrough(TorchFunctionMode):
    """A torch-function mode that changes nothing: calls under it take the custom ops' path, as traced ones."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _cache(batch=2, length=16, heads=2, d=8):
    return torch.randn(batch, length, heads, d), torch.randn(batch, length, heads, d)


BAD = [
    ("cache too small", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, torch.randn(2, 3, 2, 8),
                                                                  torch.randn(2, 3, 2, 8), cache_seqlens=14),
     ValueError, "cache length"),
    ("seqlens negative", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError,
     "cache_seqlens must be >= 0; got -1"),
    ("seqlens int64", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, 2])),
     TypeError, "cache_seqlens must be int32"),
    ("batch idx range", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=3, cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)), ValueError,
     "cache_batch_idx"),
    ("k without v", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, torch.randn(2, 1, 2, 8), cache_seqlens=3),
     ValueError, "k and v"),
    ("k wrong heads", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, torch.randn(2, 1, 1, 8),
                                                                torch.randn(2, 1, 1, 8), cache_seqlens=3),
     ValueError, "k and v must have shape"),
    ("cache dtype", lambda q, kc, vc: flash_attn_with_kvcache(q, kc.double(), vc.double()), TypeError,
     "k_cache has dtype"),
    ("block_table range", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=3, block_table=torch.tensor([[0], [2]], dtype=torch.int32)), ValueError,
     "block_table values"),
    ("block_table int64", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, block_table=torch.zeros(2, 1).long()),
     TypeError, "block_table must be an int32"),
    ("paged cache too small", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8), cache_seqlens=15,
        block_table=torch.tensor([[0], [1]], dtype=torch.int32)), ValueError, "cache length"),
    ("new tokens without seqlens", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, torch.randn(2, 1, 2, 8),
                                                                             torch.randn(2, 1, 2, 8)),
     ValueError, "cache_seqlens is required"),
    ("num_splits", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, num_splits=1.5), ValueError, "num_splits"),
    ("num_splits past flash-attn's 128, before the append", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8), cache_seqlens=3, num_splits=2**40), ValueError,
     r"num_splits must be an int at most 128"),
    ("int cache_seqlens past int32", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2**31),
     ValueError, r"cache_seqlens \+ seqlen_new must lie in \[0, 16\]"),
    ("int cache_seqlens past int32, paged", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=2**31, block_table=torch.tensor([[0], [1]], dtype=torch.int32)), ValueError,
     r"cache_seqlens \+ seqlen_new must lie in \[0, 16\]"),
    ("rotary_interleaved not a bool", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=3, rotary_interleaved="no"), TypeError, "rotary_interleaved must be a bool"),
    ("rotary half", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.ones(16, 2)), ValueError,
     "rotary_cos and rotary_sin"),
    ("rotary list", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, rotary_cos=[[1.0, 1.0]] * 16,
                                                              rotary_sin=[[0.0, 0.0]] * 16), TypeError, "rotary_cos"),
    ("rotary int table", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.ones(16, 2).long(),
                                                                   rotary_sin=torch.ones(16, 2)), TypeError,
     "rotary_cos must be a float"),
    ("rotary table short", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8), torch.ones(8, 2), torch.zeros(8, 2),
        cache_seqlens=torch.tensor([3, 7], dtype=torch.int32)), ValueError, "rotary_cos/rotary_sin have 8 positions"),
    ("rotary table short, int seqlens", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8), torch.ones(8, 2), torch.zeros(8, 2),
        cache_seqlens=7), ValueError, "give tables of at least 9 rows"),
    ("repeated batch idx with append", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc, vc, torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8), cache_seqlens=3,
        cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "same cache slot"),
    ("cache batch stride not whole rows", lambda q, kc, vc: flash_attn_with_kvcache(
        q, *(torch.randn(600).as_strided((2, 16, 2, 8), (260, 16, 8, 1)) for _ in range(2))), ValueError,
     "k_cache's batch stride must be a whole number of its position strides"),
    ("cache pitches differ", lambda q, kc, vc: flash_attn_with_kvcache(q, torch.randn(2, 20, 2, 8)[:, :16], vc),
     ValueError, r"same batch stride in position strides .*: k_cache 20, v_cache 16"),
    ("cache expanded over positions", lambda q, kc, vc: flash_attn_with_kvcache(
        q, *(torch.randn(2, 1, 2, 8).expand(2, 16, 2, 8) for _ in range(2))), ValueError,
     "stride 0 over its positions"),
    ("append to a cache expanded over its batch", lambda q, kc, vc: flash_attn_with_kvcache(
        q, *(torch.randn(1, 16, 2, 8).expand(2, 16, 2, 8) for _ in range(2)), torch.randn(2, 1, 2, 8),
        torch.randn(2, 1, 2, 8), cache_seqlens=3), ValueError, "k_cache's elements may share memory"),
    ("append to a cache whose heads overlap the next entry's", lambda q, kc, vc: flash_attn_with_kvcache(
        q, *(torch.randn(600).as_strided((2, 16, 2, 8), (128, 8, 128, 1)) for _ in range(2)),
        torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8), cache_seqlens=3), ValueError,
     "k_cache's elements may share memory"),
    ("paged pool strided", lambda q, kc, vc: flash_attn_with_kvcache(
        q, *(torch.randn(2, 20, 2, 8)[:, :16] for _ in range(2)), cache_seqlens=3,
        block_table=torch.tensor([[0], [1]], dtype=torch.int32)), ValueError, "contiguous over their first two dims"),
    ("pages appended twice", lambda q, kc, vc: flash_attn_with_kvcache(
        q, kc.view(4, 8, 2, 8), vc.view(4, 8, 2, 8), torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8),
        cache_seqlens=torch.tensor([9, 9], dtype=torch.int32),
        block_table=torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)), ValueError, "same cache slot"),
]


@pytest.mark.parametrize("call,exc,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_kvcache_bad_input(call, exc, words):
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = _cache()
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(exc, match=words):
        call(q, k_cache, v_cache)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a rejected call must not write"


META = [("rotary_cos", "rotary_sin"), ("cache_seqlens",), ("cache_batch_idx",), ("cache_leftpad",), ("k", "v")]


@pytest.mark.parametrize("names", META, ids=[m[0] for m in META])
def test_kvcache_tensors_on_another_device_are_named(names):
    """A meta tensor takes the custom op's path, whose fake implementation checks nothing: the op's caller
    names the tensor (it returned uninitialised memory and appended nothing)."""
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = _cache()
    values = {"rotary_cos": torch.ones(16, 2), "rotary_sin": torch.zeros(16, 2),
              "cache_seqlens": torch.tensor([3, 5], dtype=torch.int32), "cache_batch_idx": torch.tensor([1, 0]),
              "cache_leftpad": torch.zeros(2, dtype=torch.int32), "k": torch.randn(2, 1, 2, 8),
              "v": torch.randn(2, 1, 2, 8)}
    kwargs = {"cache_seqlens": values["cache_seqlens"]}
    kwargs.update({name: values[name].to("meta") for name in names})
    with pytest.raises(ValueError, match=f"{names[0]} is on meta, expected cpu"):
        flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom op"])
def test_kvcache_argument_types_are_checked_alike_eager_and_traced(traced):
    """The same calls are refused with the same errors whether the call runs eagerly or through the custom op
    (a torch-function mode, as torch.compile's tracing, takes that path)."""
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = _cache()
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    calls = [(dict(cache_seqlens=True), TypeError, "cache_seqlens must be"),
             (dict(cache_seqlens=3.5), TypeError, "cache_seqlens must be"),
             (dict(cache_seqlens=seqlens, rotary_interleaved="no"), TypeError, "rotary_interleaved must be a bool"),
             (dict(cache_seqlens=seqlens, block_table=[[0], [1]]), TypeError, "block_table must be"),
             (dict(cache_seqlens=seqlens, k=[1], v=[1]), TypeError, "k must be a torch.Tensor"),
             (dict(cache_seqlens=seqlens, num_splits=129), ValueError, "num_splits")]
    for kwargs, exc, words in calls:
        with Passthrough() if traced else contextlib.nullcontext(), pytest.raises(exc, match=words):
            flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)


def test_kvcache_batch_zero_with_a_tensor_cache_seqlens():
    q = torch.randn(0, 1, 4, 8)
    k_cache, v_cache = _cache()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.zeros(0, dtype=torch.int32),
                                       return_softmax_lse=True)
    assert out.shape == (0, 1, 4, 8) and lse.shape == (0, 4, 1)


def test_greedy_generation_with_cache_matches_recomputation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)).eval()
    prompt = torch.randint(0, 30, (2, 6))
    assert torch.equal(model.generate(prompt, 25, greedy=True, use_cache=True),
                       model.generate(prompt, 25, greedy=True, use_cache=False))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", [16, 32, 256])
def test_paged_cache_matches_contiguous(page_size, dtype):
    check_paged_matches_contiguous(page_size, dtype, "cpu")


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_matches_unsplit(num_splits):
    check_split_kv_matches_unsplit(num_splits, [torch.float32][0], "cpu")


@pytest.mark.parametrize("form", ["int", "none", "strided", "paged"])
def test_contiguous_cache_lengths(form):
    check_cache_lengths(form, torch.float32, "cpu")


def test_int_cache_seqlens_checked_without_a_read(monkeypatch):
    """An int cache_seqlens (no index tensors) is checked on the host: no device read of the indices."""
    import flashtile.inference as inference

    def no_read(*args, **kwargs):
        raise AssertionError("the index values were read back")

    monkeypatch.setattr(inference, "_check_cache_indices", no_read)
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = _cache()
    new = torch.randn(2, 1, 2, 8)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=15)
    assert torch.equal(k_cache[:, 15], new[:, 0]) and out.isfinite().all()
    flash_attn_with_kvcache(q, k_cache, v_cache)  # no cache_seqlens: the whole cache
    for bad in (16, -1):
        with pytest.raises(ValueError, match="cache length"):
            flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=bad)


def test_unchanged_index_tensors_are_read_once(monkeypatch, backend):
    """The same cache_seqlens tensor, unwritten, is read back once by the Triton kernels' path (every layer of
    a decoding step passes it), with a paged pool's block table too (the kernels clamp its pages into the pool);
    an in-place write, other sizes, another tensor, rotary tables or the PyTorch path (whose indexing does not
    clamp) read it again."""
    import os

    import flashtile.inference as inference

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels' path runs on CPU tensors in the interpreter only")
    backend("triton")

    reads = []
    check = inference._check_cache_indices
    monkeypatch.setattr(inference, "_check_cache_indices", lambda *args, **kw: reads.append(1) or check(*args, **kw))
    q = torch.randn(2, 1, 4, 8).half()
    k_cache, v_cache = (c.half() for c in _cache())
    new = torch.randn(2, 1, 2, 8).half()
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    for _ in range(3):  # three layers of one step
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens)
    assert len(reads) == 1
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # no new tokens: other sizes
    assert len(reads) == 2
    seqlens += 1  # the next step
    flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens)
    flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens.clone())
    assert len(reads) == 4
    seqlens[1] = 16  # past the cache once the token is appended: an in-place write is seen
    with pytest.raises(ValueError, match="cache length"):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens)
    seqlens[1] = 3
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    pages = (k_cache.view(4, 8, 2, 8), v_cache.view(4, 8, 2, 8))
    before = len(reads)
    for _ in range(2):  # paged: once for these tensors
        flash_attn_with_kvcache(q, *pages, new, new, cache_seqlens=seqlens, block_table=table)
    assert len(reads) == before + 1
    table[1, 0] = 3  # an in-place write to the table is seen
    flash_attn_with_kvcache(q, *pages, new, new, cache_seqlens=seqlens, block_table=table)
    assert len(reads) == before + 2
    backend("torch")
    for _ in range(2):
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens)
    assert len(reads) == before + 4


def test_rotary_positions_ignore_leftpad():
    """flash-attn rotates new key i at cache position cache_seqlens + i whatever cache_leftpad is (its suite's
    reference: apply_rotary_emb(k, cos, sin, seqlen_offsets=cache_seqlens)); so are the queries."""
    from flashtile.inference import _rotate

    torch.manual_seed(0)
    q = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    k_cache, v_cache = (x.double() for x in _cache())
    k_new, v_new = torch.randn(2, 2, 2, 8, dtype=torch.float64), torch.randn(2, 2, 2, 8, dtype=torch.float64)
    angles = torch.rand(16, 4, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    seqlens = torch.tensor([9, 5], dtype=torch.int32)
    leftpad = torch.tensor([4, 2], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, cache_leftpad=leftpad,
                                  causal=True)
    for b, s in enumerate(seqlens.tolist()):
        positions = torch.arange(s, s + 2)
        rotated = _rotate(k_new[b:b + 1], cos[positions][None], sin[positions][None], True)[0]
        assert torch.equal(k_cache[b, s:s + 2], rotated)
    # The queries at the same positions: attention over the cache with leftpad as an offset only.
    q_rot = torch.stack([_rotate(q[b:b + 1], cos[s:s + 2][None], sin[s:s + 2][None], True)[0]
                         for b, s in enumerate(seqlens.tolist())])
    plain = flash_attn_with_kvcache(q_rot, k_cache, v_cache, cache_seqlens=seqlens + 2, cache_leftpad=leftpad,
                                    causal=True)
    torch.testing.assert_close(out, plain)


def test_rotary_steps_reusing_buffers():
    """Decoding steps that write each new token into the same q, k buffers (static buffers, CUDA-graph style) are
    rotated from their values now: nothing about a call's rotation is kept from an earlier call (a memo on the
    tensors once returned the first step's rotated q and k and kept every call's tensors alive)."""
    import gc
    import weakref

    torch.manual_seed(0)
    angles = torch.rand(32, 4, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    k_cache, v_cache = (x.double() for x in _cache())
    q, k_new, v_new = torch.empty(2, 1, 4, 8, dtype=torch.float64), *torch.empty(2, 2, 1, 2, 8, dtype=torch.float64)

    def step(q, k_new):
        caches = k_cache.clone(), v_cache.clone()
        out = flash_attn_with_kvcache(q, *caches, k_new, v_new, cos, sin, seqlens, causal=True)
        return out, caches[0]

    for _ in range(2):
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        out, appended = step(q, k_new)
        want, want_appended = step(q.clone(), k_new.clone())
        assert torch.equal(out, want) and torch.equal(appended, want_appended)
    passed = torch.randn(2, 1, 4, 8, dtype=torch.float64)
    gone = weakref.ref(passed)
    step(passed, k_new)
    del passed
    gc.collect()
    assert gone() is None


def test_shared_pages_may_be_read():
    """Two sequences may share pages they read (a common prefix); only appends into one slot are refused."""
    torch.manual_seed(0)
    pool_k, pool_v = torch.randn(4, 8, 2, 8), torch.randn(4, 8, 2, 8)
    q = torch.randn(2, 1, 4, 8)
    table = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)  # page 0 shared, appends into pages 1 and 2
    new = torch.randn(2, 1, 2, 8)
    out = flash_attn_with_kvcache(q, pool_k, pool_v, new, new, cache_seqlens=torch.tensor([9, 9], dtype=torch.int32),
                                  block_table=table)
    assert out.isfinite().all() and torch.equal(pool_k[1, 1], new[0, 0]) and torch.equal(pool_k[2, 1], new[1, 0])
    rows = torch.tensor([1, 1], dtype=torch.int32)  # a repeated cache row without an append: a read
    k_cache, v_cache = _cache()
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, cache_batch_idx=rows)


def test_overlapping_appends_refused():
    check_overlapping_appends(torch.float32, "cpu")


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_paged_cache_without_cache_seqlens_reads_every_page(backend_name, backend):
    """cache_seqlens=None with a block table means the whole table (max_pages * page_size keys per entry),
    as in flash-attn, not one page."""
    backend(backend_name)
    torch.manual_seed(5)
    dtype = torch.float32 if backend_name == "torch" else torch.float16
    # Triton: the interpreter's CPU tensors, or the GPU's where there is one
    device = "cuda" if backend_name == "triton" and torch.cuda.is_available() else "cpu"
    pool_k, pool_v = (torch.randn(6, 4, 2, 16, dtype=dtype, device=device) for _ in range(2))  # 6 pages of 4 tokens
    table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32, device=device)
    q = torch.randn(2, 3, 4, 16, dtype=dtype, device=device)
    whole = flash_attn_with_kvcache(q, pool_k, pool_v, block_table=table)
    full = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=torch.full((2,), 12, dtype=torch.int32,
                                                                               device=device), block_table=table)
    torch.testing.assert_close(whole, full, rtol=0, atol=0)
    contiguous_k, contiguous_v = (pool[table.long()].reshape(2, 12, 2, 16) for pool in (pool_k, pool_v))
    expected = flash_attn_with_kvcache(q, contiguous_k, contiguous_v)
    torch.testing.assert_close(whole, expected, rtol=1e-3, atol=1e-3)


def test_whole_cache_reads_keep_no_constant_per_length():
    """cache_seqlens=None (the whole cache) over caches of many lengths, as a cache grown by concatenation
    gives: no cached index tensor per length (each had cost a stream synchronisation and stayed forever)."""
    from flashtile import inference

    q = torch.randn(2, 1, 4, 8)
    before = len(inference._INDEX_CONSTANTS)
    for length in range(3, 40):
        k_cache, v_cache = torch.randn(2, length, 2, 8), torch.randn(2, length, 2, 8)
        flash_attn_with_kvcache(q, k_cache, v_cache)
    assert len(inference._INDEX_CONSTANTS) - before <= 2


def test_contiguous_cache_of_2_31_rows_is_refused_before_any_launch(monkeypatch):
    """The kernels address a contiguous cache by int32 rows: batch_cache * seqlen_cache >= 2**31 is refused,
    naming k_cache, before anything runs (meta tensors: nothing is allocated)."""
    import flashtile.inference as inference

    monkeypatch.setattr(inference, "select_backend", lambda device: "triton")
    q = torch.empty(2, 1, 4, 16, device="meta", dtype=torch.float16)
    cache = torch.empty(2, 2**30, 2, 16, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache spans 2147483648 rows"):
        # (the call past its entry: meta tensors take the custom op, whose fake kernel allocates nothing)
        inference._kvcache_attention(q, cache, cache.clone(), None, None, None, None, 5, None, None, None, None, False,
                                     (-1, -1), 0.0, False, None, 0, False)


def test_decoding_plan_key_refuses_one_tensor_in_two_roles():
    """A step that passes one tensor as two of q, k_cache and v_cache takes the ordinary path: a plan's slots
    could not tell the roles apart (``_ops.aliased`` reads plan_key's aliasing flags by name)."""
    from flashtile import _ops
    from flashtile.inference import _decode_plan_key

    q = torch.zeros(2, 1, 4, 16, dtype=torch.float16)
    kc, vc = torch.zeros(2, 8, 2, 16, dtype=torch.float16), torch.zeros(2, 8, 2, 16, dtype=torch.float16)
    lengths = torch.tensor([1, 2], dtype=torch.int32)

    def key(k_cache, v_cache):
        return _decode_plan_key(q, k_cache, v_cache, None, None, lengths, None, False, (-1, -1), 0.0, 0, False)

    assert key(kc, vc) is not None
    assert key(kc, kc) is None
    assert not _ops.aliased(_ops.plan_key(q, kc, vc, None, False, (-1, -1), 0.0))
    for k, v in ((q, vc), (kc, kc), (kc, q)):
        assert _ops.aliased(_ops.plan_key(q, k, v, None, False, (-1, -1), 0.0))


def test_tensor_window_under_a_function_mode_is_read_as_in_eager():
    """Under a torch-function mode (not tracing) a call takes the custom op's path; a window_size given as a
    tensor (flash-attn's own tests pass one) is read on the host as the eager call reads it, not refused."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 32, 2, 16), torch.randn(2, 32, 2, 16)
    q, k_new, v_new = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    lengths = torch.tensor([5, 20], dtype=torch.int32)
    caches = k_cache.clone(), v_cache.clone()
    want = flash_attn_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=lengths, window_size=(3, 1))
    with Passthrough():
        got_caches = k_cache.clone(), v_cache.clone()
        got = flash_attn_with_kvcache(q, *got_caches, k_new, v_new, cache_seqlens=lengths,
                                      window_size=torch.tensor([3, 1]))
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, caches))


def test_paged_cache_on_the_pytorch_path_copies_only_the_positions_read(monkeypatch):
    """The PyTorch path copies a paged cache's pages into rows up to the last position a sequence reads, not
    the block table's whole capacity (a decoding step early in a long cache copied every page), with the same
    output as the contiguous cache."""
    from flashtile import _ops

    gathered = []
    gather = _ops._gather_pages
    monkeypatch.setattr(_ops, "_gather_pages", lambda k, *rest: gathered.append(gather(k, *rest)[0].shape[0])
                        or gather(k, *rest))
    batch, page_size, max_pages, nheads, headdim = 2, 16, 32, 2, 8
    pool_k, pool_v = (torch.randn(batch * max_pages, page_size, nheads, headdim) for _ in range(2))
    block_table = torch.randperm(batch * max_pages, dtype=torch.int32).view(batch, max_pages)
    cache_seqlens = torch.tensor([37, 20], dtype=torch.int32)
    q = torch.randn(batch, 1, nheads, headdim)
    out = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=cache_seqlens, block_table=block_table)
    assert gathered == [batch * 37]
    rows = (block_table.long()[:, :, None] * page_size + torch.arange(page_size)).view(batch, -1)
    contiguous = flash_attn_with_kvcache(q, pool_k.flatten(0, 1)[rows], pool_v.flatten(0, 1)[rows],
                                         cache_seqlens=cache_seqlens)
    torch.testing.assert_close(out, contiguous)


def test_num_splits_below_one_is_chosen_by_size_as_in_flash_attn():
    """flash-attn takes any num_splits < 1 as "use the heuristic"; so does flashtile (0)."""
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 16) for _ in range(2))
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33, num_splits=0)
    for splits in (-1, -7):
        assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33, num_splits=splits), want)


def test_decoding_on_the_cpu_needs_no_triton():
    """A CPU install may lack Triton (flashtile does not require it): flash_attn_with_kvcache's default split
    count, and GPT.generate through it, import none (the split count asked the kernels' configs before)."""
    out = run_without_triton("""
        import sys, torch
        from flashtile import flash_attn_with_kvcache
        from flashtile.nn import GPT, GPTConfig
        q, kc, vc = torch.randn(2, 1, 4, 16), torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)
        out = flash_attn_with_kvcache(q, kc, vc, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16),
                                      cache_seqlens=torch.tensor([3, 7], dtype=torch.int32))
        model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
        tokens = model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=4)
        print(tuple(out.shape), tuple(tokens.shape), sys.modules["triton"] is not None)
        """)
    assert "(2, 1, 4, 16) (1, 7) False" in out


def test_head_dims_past_256_and_caches_sharing_memory_are_refused_by_name():
    """flash_attn_with_kvcache checks the head dim as flash_attn_func does (it was unchecked: 0 divided by zero,
    257 ran, 1024 failed to compile after the append), and refuses to append to k and v caches that share
    memory (one tensor passed twice: the value overwrote the key); views of one packed (.., 2, ..) cache are
    separate memory and take appends."""
    for headdim in (0, 257):
        q = torch.randn(2, 1, 4, headdim)
        cache = torch.zeros(2, 8, 2, headdim)
        with pytest.raises(ValueError, match="headdim must be between 1 and 256"):
            flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3)
    q, new_k, new_v = torch.randn(2, 1, 4, 8), torch.ones(2, 1, 2, 8), torch.full((2, 1, 2, 8), 2.0)
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    cache = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        flash_attn_with_kvcache(q, cache, cache, new_k, new_v, cache_seqlens=seqlens)
    flat = torch.zeros(2 * 16 * 2 * 8 + 16)
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        flash_attn_with_kvcache(q, flat[:512].view(2, 16, 2, 8), flat[16:].view(2, 16, 2, 8), new_k, new_v,
                                cache_seqlens=seqlens)
    packed = torch.zeros(2, 16, 2, 2, 8)
    flash_attn_with_kvcache(q, packed[:, :, 0], packed[:, :, 1], new_k, new_v, cache_seqlens=seqlens)
    assert packed[0, 3, 0].eq(1).all() and packed[0, 3, 1].eq(2).all() and packed[1, 5, 1].eq(2).all()
    flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens)  # reading one tensor twice is fine
