"""flash_attn_with_kvcache on the PyTorch path (fp32/fp64), bad input, and a generation loop."""

import pytest
import torch

from flashtile import flash_attn_with_kvcache
from flashtile.nn import GPT, GPTConfig
from tests.kvcache_cases import (
    CASES,
    check_cache_lengths,
    check_kvcache,
    check_paged_matches_contiguous,
    check_split_kv_matches_unsplit,
)


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-new{c[2]}-causal{c[6]}-rot{c[8]}")
def test_kvcache_against_oracle(case, dtype):
    check_kvcache(case, dtype, "cpu")


def _cache(batch=2, length=16, heads=2, d=8):
    return torch.randn(batch, length, heads, d), torch.randn(batch, length, heads, d)


BAD = [
    ("cache too small", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, torch.randn(2, 3, 2, 8),
                                                                  torch.randn(2, 3, 2, 8), cache_seqlens=14),
     ValueError, "cache length"),
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
    ("num_splits", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, num_splits=-1), ValueError, "num_splits"),
    ("rotary half", lambda q, kc, vc: flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.ones(16, 2)), ValueError,
     "rotary_cos and rotary_sin"),
]


@pytest.mark.parametrize("call,exc,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_kvcache_bad_input(call, exc, words):
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = _cache()
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(exc, match=words):
        call(q, k_cache, v_cache)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "a rejected call must not write"


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
