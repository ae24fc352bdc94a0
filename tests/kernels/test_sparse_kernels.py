"""Block-sparse attention through the Triton kernels (interpreter fp16; GPU fp16 and bf16)."""

import pytest
import torch

from tests.sparse_cases import check_block_sparse
from tests.utils import covering

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


@pytest.mark.parametrize(("per_head", "seqlens", "causal", "dtype"), covering(
    [False, True], [(300, 300), (200, 390)], [False, True], DTYPES,
    ids=lambda p, s, c, t: f"{s}-{c}-{'random_per_head' if p else 'local_global'}-{t}"))
def test_block_sparse_kernels(seqlens, causal, per_head, dtype):
    """Each mask kind with each length pair and with each of causal or not (all combinations on a GPU)."""
    check_block_sparse(*seqlens, causal, per_head, dtype, DEVICE)
