"""Variants through the Triton kernels (interpreter on CPU, fp16; bf16 and fp16 on a GPU)."""

import pytest
import torch

from tests.variant_cases import (
    SEQ_PAIRS,
    VARLEN_CASES,
    WINDOWS,
    check_dropout,
    check_paged_varlen,
    check_sink,
    check_softcap_alibi,
    check_varlen,
    check_window,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seqlens", SEQ_PAIRS, ids=str)
@pytest.mark.parametrize("window,causal", WINDOWS, ids=str)
def test_window(window, causal, seqlens, dtype, poison):
    check_window(window, causal, seqlens, dtype, DEVICE)


@pytest.mark.parametrize("kind", ["softcap", "alibi", "alibi_batch", "softcap_alibi"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_alibi(kind, dtype, poison):
    check_softcap_alibi(kind, dtype, DEVICE)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{len(c[0])}seqs-causal{c[2]}-w{c[3]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen(case, dtype, poison):
    check_varlen(*case, dtype, DEVICE)


def test_varlen_alibi(poison):
    check_varlen([20, 7], [25, 7], True, (-1, -1), 2, DTYPES[0], DEVICE, alibi=True)


@pytest.mark.parametrize("causal", [False, True])
def test_sink(causal, poison):
    check_sink(DTYPES[0], DEVICE, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout(causal):
    check_dropout(DTYPES[0], DEVICE, causal)


@pytest.mark.parametrize("kind", ["alibi_batch", "softcap_alibi", "sink", "sink_full"])
def test_packed_gqa_variants(kind, poison):
    """Few query rows with GQA: the forward packs the group's heads into one block (per-row head for the
    ALiBi slope, the sink, out and lse); the backward keeps the plain layout and reads that lse."""
    if kind.startswith("sink"):
        check_sink(DTYPES[0], DEVICE, causal=kind == "sink", seqlens=(13, 90))
    else:
        check_softcap_alibi(kind, DTYPES[0], DEVICE, seqlens=(17, 130))


@pytest.mark.parametrize("page_size,causal", [(16, True), (32, False)])
def test_paged_varlen(page_size, causal):
    check_paged_varlen(DTYPES[0], DEVICE, page_size, causal)
