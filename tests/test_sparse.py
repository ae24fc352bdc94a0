"""Block-sparse attention on the PyTorch path."""

import pytest
import torch

from flashtile import block_sparse_attn_func, local_global_block_mask
from tests.sparse_cases import check_block_sparse, check_local_global_mask, check_local_global_mask_keeps_each_diagonal


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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(100, 300), (129, 128), (200, 390), (300, 100), (256, 384)], ids=str)
def test_local_global_mask_keeps_each_diagonal(seqlens, causal):
    check_local_global_mask_keeps_each_diagonal(*seqlens, causal)


def test_block_sparse_bad_mask():
    q = torch.randn(1, 200, 2, 16)
    with pytest.raises(TypeError, match="bool"):
        block_sparse_attn_func(q, q, q, torch.ones(1, 1, 2, 2))
    with pytest.raises(ValueError, match="block_mask must have shape"):
        block_sparse_attn_func(q, q, q, torch.ones(1, 1, 3, 2, dtype=torch.bool))


@pytest.mark.parametrize("args,exc,words", [
    ((256, 256, -1), ValueError, "local_blocks must be an int >= 0"),
    ((256, 256, 1, -2), ValueError, "global_blocks"),
    ((256, -1, 1), ValueError, "seqlen_k"),
    ((256.0, 256, 1), ValueError, "seqlen_q"),
    ((256, 256, True), ValueError, "local_blocks"),
], ids=["negative local", "negative global", "negative seqlen", "float seqlen", "bool local"])
def test_local_global_mask_bad_arguments(args, exc, words):
    with pytest.raises(exc, match=words):
        local_global_block_mask(*args)


def test_local_global_mask_takes_numpy_bools_as_the_api_does():
    import numpy as np

    assert torch.equal(local_global_block_mask(512, 512, 1, 1, causal=np.bool_(True)),
                       local_global_block_mask(512, 512, 1, 1, causal=True))
