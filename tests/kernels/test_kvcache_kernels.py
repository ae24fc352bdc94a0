"""flash_attn_with_kvcache through the Triton kernels (interpreter fp16 on CPU; fp16 and bf16 on a GPU)."""

import pytest
import torch

from tests.kvcache_cases import (
    CASES,
    check_cache_lengths,
    check_kvcache,
    check_paged_matches_contiguous,
    check_split_kv_matches_unsplit,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-new{c[2]}-causal{c[6]}-rot{c[8]}")
def test_kvcache_kernels(case, dtype):
    check_kvcache(case, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [16, 32, 256])
def test_paged_cache_matches_contiguous(page_size, dtype):
    check_paged_matches_contiguous(page_size, dtype, DEVICE)


@pytest.mark.parametrize("form", ["int", "none", "strided", "paged"])
def test_contiguous_cache_lengths(form):
    check_cache_lengths(form, DTYPES[0], DEVICE)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_matches_unsplit(num_splits):
    check_split_kv_matches_unsplit(num_splits, DTYPES[0], DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("eager_first", [True, False], ids=["eager-first", "capture-first"])
def test_decode_cuda_graph_replay(eager_first):
    """A decoding step captured in a CUDA graph replays to the eager result on new inputs. After an eager
    call of the shape, the capture reads the cached index constants (no small index kernels in each
    replay); captured first, it builds its own and keeps none of them."""
    from flashtile import flash_attn_with_kvcache, inference

    batch, nheads, nheads_k, length, headdim = 3, 8, 2, 1000, 64
    q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(batch, length, nheads_k, headdim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor([1000, 1, 517], dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and autotune outside the capture
        inference._INDEX_CONSTANTS.clear()
        step()
        if not eager_first:
            inference._INDEX_CONSTANTS.clear()
    torch.cuda.current_stream().wait_stream(side)
    cached = dict(inference._INDEX_CONSTANTS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert inference._INDEX_CONSTANTS == cached  # nothing made during the capture is kept
    q.copy_(torch.randn_like(q))
    seqlens.copy_(torch.tensor([3, 999, 64], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
