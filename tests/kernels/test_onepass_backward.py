"""The one-pass backward (``FLASHTILE_BWD_ONEPASS``, ``backward.onepass_splits``): dK, dV and dQ from one pass
over the key blocks, dQ summed from per-split float32 rows in a fixed order.

Against the float64 oracle by the suite's rule (3x PyTorch's error for gradients), and against the two
passes: dK and dV are the same products in the same order (bitwise equal), dQ a sum in another order
(within float32 rounding); two runs bitwise equal. On CPU through the interpreter (fp16), on CUDA when
present. Splits given explicitly, so one split, several, and more splits than the key blocks leave room
for all run here.
"""

import pytest
import torch

from flashtile import flash_attn_func
from flashtile.kernels import backward
from tests.utils import check_against_oracle, make_qkv, stable_seed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window, splits)
    (1, 70, 70, 2, 2, 32, False, None, "2"),
    (1, 130, 200, 4, 1, 40, True, None, "2"),  # MQA, rows that see every key
    (2, 200, 130, 4, 2, 64, True, None, "1"),  # rows that see no key (seqlen_q > seqlen_k)
    (1, 150, 300, 2, 2, 32, False, (40, 10), "3"),  # a window: later key blocks reach later rows
    (1, 100, 257, 2, 2, 32, True, None, "9"),  # more splits than key blocks: capped
]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}"
                         f"-{'causal' if c[6] else 'full'}{'-window' if c[7] else ''}-splits{c[8]}")
def test_onepass_backward_meets_the_rule_and_matches_two_passes(case, monkeypatch, poison):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window, splits = case
    torch.manual_seed(stable_seed(case, "onepass"))
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, torch.float16, DEVICE)
    kwargs = {"causal": causal, "window_size": window or (-1, -1)}

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        return out, lse

    launched = []
    monkeypatch.setattr(backward, "onepass_splits",
                        lambda *a, pick=backward.onepass_splits: launched.append(pick(*a)) or launched[-1])
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", splits)
    check_against_oracle(run, q, k, v, causal, **({"window_size": window} if window else {}))
    assert launched and launched[-1] >= 1, "the call did not take the one-pass backward"

    dout = torch.randn(q.shape, dtype=q.dtype, device=DEVICE)
    onepass = torch.autograd.grad(flash_attn_func(q, k, v, **kwargs), (q, k, v), dout)
    again = torch.autograd.grad(flash_attn_func(q, k, v, **kwargs), (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(onepass, again)), "the one-pass backward is not repeatable"
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "0")
    dq, dk, dv = torch.autograd.grad(flash_attn_func(q, k, v, **kwargs), (q, k, v), dout)
    assert torch.equal(onepass[1], dk) and torch.equal(onepass[2], dv)
    assert (onepass[0].float() - dq.float()).abs().max().item() <= 1e-3 * max(dq.float().abs().max().item(), 1.0)


def test_onepass_splits_rule(monkeypatch):
    """Off unless asked; dense 16-bit calls with d <= 128 only; capped by key blocks and memory."""
    from flashtile.options import AttentionOptions

    q = torch.zeros(2, 1000, 4, 128, dtype=torch.float16)
    k = torch.zeros(2, 1000, 2, 128, dtype=torch.float16)
    plain = AttentionOptions(softmax_scale=0.1)
    monkeypatch.delenv("FLASHTILE_BWD_ONEPASS", raising=False)
    assert backward.onepass_splits(q, k, plain, None, None, 128) == 0
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "1")
    assert backward.onepass_splits(q, k, plain, None, None, 128) == 8  # 264 programs over 4 heads: 66; 8 key blocks
    assert backward.onepass_splits(q, k, plain, (None,) * 4, None, 128) == 0  # packed sequences
    assert backward.onepass_splits(q.float(), k.float(), plain, None, None, 128) == 0
    assert backward.onepass_splits(q, k, plain, None, None, 256) == 0
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "3")
    assert backward.onepass_splits(q, k, plain, None, None, 128) == 3
    monkeypatch.setattr(backward, "ONEPASS_PARTIAL_BYTES", 2 * 4 * 1000 * 128 * 4 * 2)
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "1")
    assert backward.onepass_splits(q, k, plain, None, None, 128) == 2
