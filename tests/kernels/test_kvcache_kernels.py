"""flash_attn_with_kvcache through the Triton kernels (interpreter fp16 on CPU; fp16 and bf16 on a GPU)."""

import pytest
import torch

from tests.kvcache_cases import CASES, check_kvcache, check_paged_matches_contiguous, check_split_kv_matches_unsplit

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


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_matches_unsplit(num_splits):
    check_split_kv_matches_unsplit(num_splits, DTYPES[0], DEVICE)
