"""Block-sparse attention on the PyTorch path."""

import pytest
import torch

from flashtile import block_sparse_attn_func
from tests.sparse_cases import check_block_sparse, check_local_global_mask


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


@pytest.mark.parametrize("per_head", [False, True], ids=["local_global", "random_per_head"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(300, 300), (200, 390), (129, 128)], ids=str)
def test_block_sparse(seqlens, causal, per_head):
    check_block_sparse(*seqlens, causal, per_head, torch.float64, "cpu")


def test_local_global_mask():
    check_local_global_mask()


def test_block_sparse_bad_mask():
    q = torch.randn(1, 200, 2, 16)
    with pytest.raises(TypeError, match="bool"):
        block_sparse_attn_func(q, q, q, torch.ones(1, 1, 2, 2))
    with pytest.raises(ValueError, match="block_mask must have shape"):
        block_sparse_attn_func(q, q, q, torch.ones(1, 1, 3, 2, dtype=torch.bool))
