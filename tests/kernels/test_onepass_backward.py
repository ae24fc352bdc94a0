"""The one-pass backward (``FLASHTILE_BWD_ONEPASS``, ``backward.onepass_splits``): dK, dV and dQ from one pass
over the key blocks, dQ summed from per-split float32 rows in a fixed order.

Against the float64 oracle by the suite's rule (3x PyTorch's error for gradients), and against the two
passes: dK and dV are the same products in the same order (bitwise equal), dQ a sum in another order
(within float32 rounding); two runs bitwise equal. On CPU through the interpreter (fp16), on CUDA when
present. Splits given explicitly: one, several, and (forced past ``onepass_splits``' cap) more splits than
key blocks, whose extra programs only zero their rows.
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
    (1, 100, 257, 2, 2, 32, True, None, "9"),  # asked for more splits than 128-key blocks: capped
]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


def _check_onepass(shape, causal, window, setting, chooser, monkeypatch, repeat=False):
    """Under FLASHTILE_BWD_ONEPASS=``setting``: the call takes the one-pass backward (``chooser``, the function
    of ``backward`` that picks it, gives a non-zero answer), meets the oracle's rule, and matches the two
    passes (dK, dV bitwise, dQ within rounding); ``repeat``: two runs bitwise equal."""
    q, k, v = make_qkv(*shape, torch.float16, DEVICE)
    kwargs = {"causal": causal, "window_size": window or (-1, -1)}

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        return out, lse

    taken, pick = [], getattr(backward, chooser)
    monkeypatch.setattr(backward, chooser, lambda *a: taken.append(pick(*a)) or taken[-1])
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", setting)
    check_against_oracle(run, q, k, v, causal, **({"window_size": window} if window else {}))
    assert taken and taken[-1], "the call did not take the one-pass backward"

    dout = torch.randn(q.shape, dtype=q.dtype, device=DEVICE)
    onepass = torch.autograd.grad(flash_attn_func(q, k, v, **kwargs), (q, k, v), dout)
    if repeat:
        again = torch.autograd.grad(flash_attn_func(q, k, v, **kwargs), (q, k, v), dout)
        assert all(torch.equal(a, b) for a, b in zip(onepass, again)), "the one-pass backward is not repeatable"
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "0")
    dq, dk, dv = torch.autograd.grad(flash_attn_func(q, k, v, **kwargs), (q, k, v), dout)
    assert torch.equal(onepass[1], dk) and torch.equal(onepass[2], dv)
    assert (onepass[0].float() - dq.float()).abs().max().item() <= 1e-3 * max(dq.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}"
                         f"-{'causal' if c[6] else 'full'}{'-window' if c[7] else ''}-splits{c[8]}")
def test_onepass_backward_meets_the_rule_and_matches_two_passes(case, monkeypatch, poison):
    *shape, causal, window, splits = case
    torch.manual_seed(stable_seed(case, "onepass"))
    _check_onepass(shape, causal, window, splits, "onepass_splits", monkeypatch, repeat=True)


ORDERED_CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal, window)
    (1, 70, 70, 2, 2, 32, False, None),
    (1, 130, 200, 4, 1, 40, True, None),  # MQA: four query heads add into their own accumulators in turn
    (2, 200, 130, 4, 2, 64, True, None),  # rows that see no key: key block 0 zeroes them
    (1, 150, 300, 2, 2, 32, False, (-1, 10)),  # a right window alone keeps key block 0 first at every tile
]


@pytest.mark.parametrize("case", ORDERED_CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}"
                         f"-{'causal' if c[6] else 'full'}{'-window' if c[7] else ''}")
def test_ordered_onepass_backward(case, monkeypatch, poison):
    """``FLASHTILE_BWD_ONEPASS=ordered``: one shared dQ accumulator per head, key blocks adding in turn. On a
    GPU a wrong turn would hang (each program waits for the one before it); here programs run one after
    another. The oracle's rule, and dK, dV bitwise equal to the two passes'."""
    *shape, causal, window = case
    torch.manual_seed(stable_seed(case, "ordered"))
    _check_onepass(shape, causal, window, "ordered", "onepass_ordered_tile", monkeypatch)


def test_ordered_onepass_rule(monkeypatch):
    """Opt-in; not for packed calls, a left window, d > 128 or 32-bit inputs; a tile from the setting."""
    from flashtile.options import AttentionOptions

    q = torch.zeros(2, 1000, 4, 128, dtype=torch.float16)
    plain = AttentionOptions(softmax_scale=0.1)
    monkeypatch.delenv("FLASHTILE_BWD_ONEPASS", raising=False)
    assert backward.onepass_ordered_tile(q, q, plain, None, None, 128) is None
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "ordered")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert backward.onepass_ordered_tile(q, q, plain, None, None, 128) == (64, 64, 8, 2)
    assert backward.onepass_splits(q, q, plain, None, None, 128) == 0  # the split design is off then
    left = AttentionOptions(softmax_scale=0.1, window_left=64)
    assert backward.onepass_ordered_tile(q, q, left, None, None, 128) is None
    assert backward.onepass_ordered_tile(q, q, plain, (None,) * 4, None, 128) is None
    assert backward.onepass_ordered_tile(q, q, plain, None, None, 256) is None
    assert backward.onepass_ordered_tile(q.float(), q.float(), plain, None, None, 128) is None
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS_TILE", "128x32x8x3")
    assert backward.onepass_ordered_tile(q, q, plain, None, None, 128) == (128, 32, 8, 3)


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


def test_onepass_backward_more_splits_than_key_blocks(monkeypatch, poison):
    """Splits past the last key block (forced: the rule caps them) zero their rows of dQ; GQA, causal."""
    torch.manual_seed(5)
    q, k, v = make_qkv(1, 90, 70, 4, 2, 32, torch.float16, DEVICE)
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "1")
    monkeypatch.setattr(backward, "onepass_splits", lambda *args: 7)  # 70 keys: at most 3 blocks of 32

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out, lse

    check_against_oracle(run, q, k, v, True)


def test_onepass_backward_ignores_padded_keys_with_extreme_scores(monkeypatch):
    """Keys past seqlen_k in the last key block load as zeros, but their P and dS need not be 0 or finite
    (a very negative lse here): dQ must stay finite and equal the two passes' (within rounding)."""
    q = torch.full((1, 64, 1, 32), 3.0, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k = torch.full((1, 40, 1, 32), -1.0, dtype=torch.float16, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 40, 1, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    dout = torch.randn(q.shape, dtype=q.dtype, device=DEVICE)
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "2")
    dq, dk, dv = torch.autograd.grad(flash_attn_func(q, k, v), (q, k, v), dout)
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "0")
    want = torch.autograd.grad(flash_attn_func(q, k, v), (q, k, v), dout)
    assert torch.isfinite(dq).all()
    assert (dq.float() - want[0].float()).abs().max().item() <= 1e-3 * max(want[0].float().abs().max().item(), 1.0)
    assert torch.equal(dk, want[1]) and torch.equal(dv, want[2])


def test_onepass_settings_of_another_form_are_refused_before_a_launch(monkeypatch):
    """A FLASHTILE_BWD_ONEPASS or FLASHTILE_BWD_ONEPASS_TILE value of no known form: a ValueError naming it,
    from the functions the backward asks before its first launch."""
    from flashtile.options import AttentionOptions

    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    plain = AttentionOptions(softmax_scale=0.1)
    for value in ("on", "-2", "2.5"):
        monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", value)
        with pytest.raises(ValueError, match="FLASHTILE_BWD_ONEPASS"):
            backward.onepass_splits(q, q, plain, None, None, 64)
    monkeypatch.setenv("FLASHTILE_BWD_ONEPASS", "ordered")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for value in ("64x64", "64x64x8xtwo", "0x64x8x2"):
        monkeypatch.setenv("FLASHTILE_BWD_ONEPASS_TILE", value)
        with pytest.raises(ValueError, match="FLASHTILE_BWD_ONEPASS_TILE"):
            backward.onepass_ordered_tile(q, q, plain, None, None, 64)
