"""Block-sparse attention through the Triton kernels (interpreter fp16; GPU fp16 and bf16)."""

import pytest
import torch

from tests.sparse_cases import check_block_sparse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_head", [False, True], ids=["local_global", "random_per_head"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(300, 300), (200, 390)], ids=str)
def test_block_sparse_kernels(seqlens, causal, per_head, dtype):
    check_block_sparse(*seqlens, causal, per_head, dtype, DEVICE)
