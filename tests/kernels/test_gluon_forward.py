"""The Gluon sm90 forward (``flashtile.kernels.gluon_forward``): flashtile's forward of plain dense and packed
attention on sm90 where ``configs.gluon_forward_choice`` admits the call, and the FP8 prototype.

On an H200 (sm90) the GPU tests check it against the float64 oracle with the suite's rule (max|out - ref| <=
2 max|out_torch - ref|, lse to float32 precision), every variant of ``gluon_forward.VARIANTS`` (single
partition, warp-specialized, overlapped, two consumers, ping-pong), d = 64 and 128, causal (bottom-right
aligned) or not, lengths that are no multiple of any tile, and the "lpt" schedule. Without a GPU one test
compiles the d=128 non-causal kernel (every variant, ping-pong on the "lpt" grid, pingpong-fa3 with three
stages) for sm_90a through the stand-in driver, in a subprocess, and checks ptxas's resources.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from tests.utils import check_against_oracle, gluon_sm90_report, make_qkv, needs_triton_36, stable_seed

pytestmark = needs_triton_36

REPO = Path(__file__).resolve().parents[2]
SEQLENS = [(1, 1), (113, 203), (128, 217), (203, 113), (1023, 1024), (4096, 4096)]
# The keys of gluon_forward.VARIANTS, written out so that collecting the tests needs no Gluon.
VARIANTS = ["single", "ws", "ws-overlap", "ws2", "pingpong", "single-ffma", "pingpong-ffma", "pingpong-lag",
            "pingpong-early", "pingpong-fa3"]
# Three 4-warp consumers (num_warps = 12): FP8, and 16-bit at d = 64 only (16-bit P held in registers spills at
# d = 128).
FP8_ONLY = ["pingpong3-fa3"]
# These split the tile between two 4-warp consumers: num_warps = 8.
TWO_CONSUMERS = {"ws2", "pingpong", "pingpong-ffma", "pingpong-lag", "pingpong-early", "pingpong-fa3"}
# (tiles, head dim): BLOCK_M 256 gives each consumer of the two-consumer variants 128 rows (d = 64 only: at
# d = 128 the overlapped consumers spill).
OTHER_TILES = [((128, 64, 3, 8), 128), ((64, 128, 2, 4), 128), ((64, 64, 4, 4), 128), ((256, 64, 2, 8), 64),
               ((128, 128, 3, 8), 128)]
OTHER_CASES = [(tiles, d, variant) for tiles, d in OTHER_TILES for variant in VARIANTS
               if tiles[3] == 8 or variant not in TWO_CONSUMERS]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _gluon_forward():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    if not _hopper():
        pytest.skip("the Gluon forward is written for sm90 (wgmma, TMA)")
    from flashtile.kernels import gluon_forward

    return gluon_forward


def _run(causal, **kwargs):
    gluon_forward = _gluon_forward()

    def run(q, k, v):
        return gluon_forward.gluon_attention_forward(q, k, v, causal=causal, **kwargs)

    return run


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"sq{s[0]}-sk{s[1]}")
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_gluon_forward_matches_oracle(headdim, seqlens, causal, variant, poison):
    run = _run(causal, variant=variant)
    torch.manual_seed(stable_seed(headdim, seqlens, causal, variant))
    q, k, v = make_qkv(2, *seqlens, 4, 4, headdim, torch.bfloat16, "cuda", requires_grad=False)
    oracle = torch.float32 if seqlens[0] * seqlens[1] > 1024 * 1024 else torch.float64
    check_against_oracle(run, q, k, v, causal, grads=False, oracle_dtype=oracle)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS + [(4100, 4500), (4500, 4100)], ids=lambda s: f"sq{s[0]}-sk{s[1]}")
def test_gluon_forward_three_consumers_d64(seqlens, causal, dtype, poison):
    """16-bit d = 64 with three consumers (``pingpong3-fa3``, 192 query rows a program: the dispatch's from 4,096
    tokens), GQA 4 over 2 heads: a last block with consumers past seqlen_q, causal rows that see no key (seqlen_q >
    seqlen_k) and consumers whose rows need fewer key tiles than their program's."""
    run = _run(causal, variant="pingpong3-fa3", tiles=(192, 128, 2, 12))
    torch.manual_seed(stable_seed(seqlens, causal, dtype, "three-d64"))
    q, k, v = make_qkv(2, *seqlens, 4, 2, 64, dtype, "cuda", requires_grad=False)
    oracle = torch.float32 if seqlens[0] * seqlens[1] > 1024 * 1024 else torch.float64
    check_against_oracle(run, q, k, v, causal, grads=False, oracle_dtype=oracle)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["single-ffma", "pingpong-fa3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_gluon_forward_running_max_that_keeps_climbing(headdim, causal, variant, poison):
    """Scores that grow along the keys, each row at its own pace (0 to about 17 log2 units a 128-key tile), so that
    the running max moves by more than FLASHTILE_FWD_RESCALE_SKIP's threshold (8) in some tiles and by less in
    others: the stale max and the skipped rescales (``_skip_threshold``, ``_rescale``) still give attention by the
    rule (random inputs almost never move a row's max by 8 after its first tile)."""
    run = _run(causal, variant=variant)
    torch.manual_seed(stable_seed(headdim, causal, variant, "climbing"))
    seqlen, nheads = 1000, 2
    direction = torch.nn.functional.normalize(torch.randn(headdim), dim=0)
    # s_ij = q_i . k_j / sqrt(d) grows by pace_i * 0.09 a key, at most about 0.09 * 128 * log2(e) = 17 a tile
    pace = torch.rand(1, seqlen, nheads, 1) * 4
    q = torch.randn(1, seqlen, nheads, headdim) * 0.5 + pace * direction
    keys = torch.arange(seqlen, dtype=torch.float32).view(1, seqlen, 1, 1)
    k = torch.randn(1, seqlen, nheads, headdim) * 0.5 + keys * (0.09 * math.sqrt(headdim) / 4) * direction
    v = torch.randn(1, seqlen, nheads, headdim)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    check_against_oracle(run, q, k, v, causal, grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["single-ffma", "ws-overlap", "pingpong-fa3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (203, 113), (1023, 1024)], ids=lambda s: f"sq{s[0]}-sk{s[1]}")
def test_gluon_forward_d256(seqlens, causal, variant, poison):
    """d = 256 (its default tile: 64 keys a stage), GQA 4 over 2 heads."""
    run = _run(causal, variant=variant)
    torch.manual_seed(stable_seed(seqlens, causal, variant, "d256"))
    q, k, v = make_qkv(2, *seqlens, 4, 2, 256, torch.bfloat16, "cuda", requires_grad=False)
    check_against_oracle(run, q, k, v, causal, grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles, headdim, variant", OTHER_CASES,
                         ids=[f"{'x'.join(map(str, t))}-d{d}-{v}" for t, d, v in OTHER_CASES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_forward_other_tiles(tiles, headdim, variant, causal, poison):
    run = _run(causal, variant=variant, tiles=tiles)
    torch.manual_seed(stable_seed(tiles, causal, variant))
    q, k, v = make_qkv(2, 333, 517, 4, 4, headdim, torch.bfloat16, "cuda", requires_grad=False)
    check_against_oracle(run, q, k, v, causal, grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gluon_forward_fp16_gqa_and_scale(variant, poison):
    """fp16, 8 query heads over 2 kv heads, an explicit softmax scale, causal with seqlen_q > seqlen_k (the
    first rows see no key: O = 0, lse = -inf; whole programs see none and skip the key loop)."""
    run = _run(True, variant=variant, softmax_scale=0.3)
    torch.manual_seed(7)
    q, k, v = make_qkv(2, 700, 450, 8, 2, 64, torch.float16, "cuda", requires_grad=False)
    check_against_oracle(run, q, k, v, True, softmax_scale=0.3, grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["single", "ws-overlap", "pingpong"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", [(1, 1), (203, 113), (1023, 1024)], ids=lambda s: f"sq{s[0]}-sk{s[1]}")
def test_gluon_forward_lpt_schedule(seqlens, causal, variant, monkeypatch, poison):
    """The 1-D "lpt" grid: 3 x 10 (batch, head) pairs in groups of 4 (the K/V budget shrunk to 4 pairs' worth,
    so the last group has 2), 10 query heads over 2 kv heads, d = 64."""
    gluon_forward = _gluon_forward()
    kv_bytes = 2 * seqlens[1] * 64 * 2 * 2 // 10  # what the launcher counts per (batch, head) pair
    monkeypatch.setattr(gluon_forward, "LPT_KV_BYTES", 4 * kv_bytes)
    run = _run(causal, variant=variant, schedule="lpt")
    torch.manual_seed(stable_seed(seqlens, causal, variant, "lpt"))
    q, k, v = make_qkv(3, *seqlens, 10, 2, 64, torch.bfloat16, "cuda", requires_grad=False)
    check_against_oracle(run, q, k, v, causal, grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["single", "pingpong"])
@pytest.mark.parametrize("aligned", [True, False], ids=["views", "misaligned"])
def test_gluon_forward_strided_inputs(aligned, variant, poison):
    """q, k, v as views of one projection's output (descriptors over the strides as they are), and views
    whose base is not 16-byte aligned (copied before the descriptors are made)."""
    run = _run(True, variant=variant)
    torch.manual_seed(11 if aligned else 12)
    qkv = torch.randn(2, 389, 3 * 4 * 128 + (0 if aligned else 1), device="cuda", dtype=torch.bfloat16)
    start = 0 if aligned else 1
    q, k, v = (qkv[..., start + i * 512: start + (i + 1) * 512].unflatten(-1, (4, 128)) for i in range(3))
    check_against_oracle(run, q, k, v, True, grads=False)


DISPATCH_CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal)
    (2, 1024, 1024, 4, 4, 128, torch.bfloat16, True),
    (1, 1100, 1300, 8, 2, 128, torch.float16, False),
    (1, 1300, 1100, 4, 4, 128, torch.bfloat16, True),  # rows that see no key: O = 0, lse = -inf
    (2, 1024, 1500, 4, 1, 64, torch.bfloat16, False),
    (1, 1100, 1300, 4, 2, 256, torch.bfloat16, True),
    (2, 600, 700, 4, 2, 64, torch.bfloat16, False),  # from 512 tokens without a causal mask (d = 64, 128)
    (1, 512, 530, 4, 4, 128, torch.float16, False),
    (2, 600, 700, 4, 2, 64, torch.bfloat16, True),  # d = 64 causal from 512 tokens
    (1, 1500, 1100, 4, 4, 64, torch.float16, True),  # rows that see no key
    (1, 700, 530, 4, 2, 128, torch.bfloat16, True),  # d = 128 causal under 2048 tokens: single-ffma 128x64
    (1, 4096, 4200, 4, 2, 64, torch.bfloat16, False),  # d = 64 from 4,096 tokens: three consumers
    (1, 4500, 4100, 4, 4, 64, torch.float16, True),  # (causal rows that see no key)
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DISPATCH_CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}"
                         f"-{'causal' if c[7] else 'full'}")
def test_flash_attn_func_takes_the_gluon_forward_on_sm90(case, monkeypatch, poison):
    """flash_attn_func's default forward on an H200 at these shapes is the Gluon kernel (each call counted),
    forward and backward (the backward reads its lse) by flash-attn's rule against the oracle."""
    gluon_forward = _gluon_forward()
    from flashtile import flash_attn_func

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    calls = []
    monkeypatch.setattr(gluon_forward, "gluon_attention_forward",
                        lambda *a, run=gluon_forward.gluon_attention_forward, **kw: calls.append(kw) or run(*a, **kw))
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal = case
    torch.manual_seed(stable_seed(case))
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, "cuda", requires_grad=True)

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return out, lse

    check_against_oracle(run, q, k, v, causal, grads=True, oracle_dtype=torch.float32)
    assert calls, "the call did not take the Gluon forward"
    if headdim == 64 and min(seqlen_q, seqlen_k) >= 4096:  # (configs.GLUON_FORWARD: three consumers from there)
        assert {kw["variant"] for kw in calls} == {"pingpong3-fa3"}, calls


VARLEN_DISPATCH_CASES = [  # (query lengths, key lengths, nheads, nheads_k, headdim, dtype, causal)
    ((4100, 5000, 3500), (4100, 5000, 3500), 2, 2, 128, torch.bfloat16, True),
    ((2500, 700, 3400), (2600, 1500, 3000), 4, 2, 128, torch.float16, False),
    ((5300, 4100), (5000, 4400), 2, 2, 128, torch.bfloat16, True),  # rows that see no key: O = 0, lse = -inf
    ((2048, 2500), (2200, 2500), 4, 1, 64, torch.bfloat16, False),
    ((2100, 3000, 1500), (2100, 3100, 1500), 4, 2, 64, torch.bfloat16, True),  # d = 64 causal from a mean of 2048
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_DISPATCH_CASES, ids=lambda c: f"sq{sum(c[0])}-sk{sum(c[1])}-h{c[2]}/{c[3]}"
                         f"-d{c[4]}-{'causal' if c[6] else 'full'}")
def test_flash_attn_varlen_func_takes_the_gluon_forward_on_sm90(case, monkeypatch, poison):
    """flash_attn_varlen_func's default forward on an H200 for packed sequences this long is the Gluon varlen
    kernel (each call counted); out, lse and the gradients (the Triton backward reads its lse) by the
    suite's rule against the per-sequence oracle."""
    gluon_forward = _gluon_forward()
    from flashtile import flash_attn_varlen_func
    from tests.utils import assert_lse_close, assert_rule, random_cu_seqlens, varlen_oracle

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    calls = []
    monkeypatch.setattr(gluon_forward, "gluon_attention_forward_varlen",
                        lambda *a, run=gluon_forward.gluon_attention_forward_varlen, **kw: calls.append(kw)
                        or run(*a, **kw))
    lengths_q, lengths_k, nheads, nheads_k, headdim, dtype, causal = case
    torch.manual_seed(stable_seed(case, "varlen-dispatch"))
    cu_q, cu_k = random_cu_seqlens(lengths_q, "cuda"), random_cu_seqlens(lengths_k, "cuda")
    q = torch.randn(sum(lengths_q), nheads, headdim, dtype=dtype, device="cuda", requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), nheads_k, headdim, dtype=dtype, device="cuda", requires_grad=True)
            for _ in range(2))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                         return_attn_probs=True)
    assert calls, "the call did not take the Gluon varlen forward"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out_ref, lse_ref = varlen_oracle(q32, k32, v32, cu_q, cu_k, causal=causal, dtype=torch.float32)
    grads_ref = torch.autograd.grad(out_ref, (q32, k32, v32), dout.float())
    qd, kd, vd = (x.detach().requires_grad_() for x in (q, k, v))
    out_pt, _ = varlen_oracle(qd, kd, vd, cu_q, cu_k, dtype=None, causal=causal)
    grads_pt = torch.autograd.grad(out_pt, (qd, kd, vd), dout)
    assert_rule("out", out, out_ref, out_pt, 2)
    assert_lse_close(lse, lse_ref.float())
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert_rule(name, got, want, base, 3)


@pytest.mark.gpu
def test_gluon_forward_not_taken_where_not_measured(monkeypatch):
    """Short sequences, windows, softcap and FLASHTILE_GLUON=0 keep the Triton forward."""
    _gluon_forward()
    from flashtile.kernels import configs
    from flashtile.options import AttentionOptions

    q = torch.zeros(1, 2048, 4, 128, dtype=torch.bfloat16, device="cuda")
    plain = AttentionOptions(softmax_scale=0.1)
    assert configs.gluon_forward_choice(q, q, q, plain) is not None
    assert configs.gluon_forward_choice(q, q, q, AttentionOptions(softmax_scale=0.1, causal=True)) is not None
    short, shorter = q[:, :512], q[:, :511]  # (configs.GLUON_FORWARD: from 512 at d = 64 and 128)
    causal = AttentionOptions(softmax_scale=0.1, causal=True)
    assert configs.gluon_forward_choice(short, short, short, plain) is not None
    assert configs.gluon_forward_choice(shorter, shorter, shorter, plain) is None
    # d = 128 causal: single-ffma 128x64 under 2048 tokens (its first tier), pingpong-fa3 from there
    assert configs.gluon_forward_choice(short, short, short, causal) == ("single-ffma", (128, 64, 2, 8))
    assert configs.gluon_forward_choice(shorter, shorter, shorter, causal) is None
    assert configs.gluon_forward_choice(q, q, q, causal) == ("pingpong-fa3", (128, 128, 2, 8))
    assert configs.gluon_forward_choice(q[:, :2047], q, q, causal) == ("single-ffma", (128, 64, 2, 8))
    long = torch.zeros(1, 4096, 4, 128, dtype=torch.bfloat16, device="cuda")  # d = 128 from 4,096: three stages
    for opts in (plain, causal):
        assert configs.gluon_forward_choice(long, long, long, opts) == ("pingpong-fa3", (128, 128, 3, 8))
        assert configs.gluon_forward_choice(long[:, :4095], long, long, opts)[1] == (128, 128, 2, 8)
    assert configs.gluon_forward_choice(q, q, q, AttentionOptions(softmax_scale=0.1, softcap=5.0)) is None
    assert configs.gluon_forward_choice(q, q, q, AttentionOptions(softmax_scale=0.1, window_left=64)) is None
    assert configs.gluon_forward_choice(q.float(), q.float(), q.float(), plain) is None
    q64 = torch.zeros(1, 2048, 4, 64, dtype=torch.bfloat16, device="cuda")
    assert configs.gluon_forward_choice(q64, q64, q64, plain) is not None
    assert configs.gluon_forward_choice(q64, q64, q64, causal) is not None
    assert configs.gluon_forward_choice(q64[:, :511], q64, q64, causal) is None
    long64 = torch.zeros(1, 4096, 4, 64, dtype=torch.bfloat16, device="cuda")  # d = 64 from 4,096: three consumers
    for opts in (plain, causal):
        assert configs.gluon_forward_choice(long64, long64, long64, opts) == ("pingpong3-fa3", (192, 128, 2, 12))
        assert configs.gluon_forward_choice(long64[:, :4095], long64, long64, opts)[0] == "single-ffma"
    # packed sequences: by their mean lengths, from cu_seqlens that are a plain int32 vector
    packed = torch.zeros(8192, 4, 128, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 3000, 8192], dtype=torch.int32, device="cuda")  # a mean of 4096
    for opts in (plain, causal):
        assert configs.gluon_forward_choice(packed, packed, packed, opts, (cu, cu, 5192, 5192)) is not None
    cu3 = torch.tensor([0, 3000, 5000, 8192], dtype=torch.int32, device="cuda")  # a mean of 2731: non-causal only
    assert configs.gluon_forward_choice(packed, packed, packed, plain, (cu3, cu3, 3192, 3192)) is not None
    assert configs.gluon_forward_choice(packed, packed, packed, causal, (cu3, cu3, 3192, 3192)) is None
    many = torch.arange(0, 8193, 512, dtype=torch.int32, device="cuda")  # 16 sequences of 512
    q256 = torch.zeros(1, 2048, 4, 256, dtype=torch.bfloat16, device="cuda")
    assert configs.gluon_forward_choice(q256, q256, q256, causal) is not None
    packed256 = torch.zeros(8192, 4, 256, dtype=torch.bfloat16, device="cuda")  # d = 256: from shorter means
    for opts in (plain, causal):
        assert configs.gluon_forward_choice(packed256, packed256, packed256, opts, (cu, cu, 5192, 5192)) is not None
    assert configs.gluon_forward_choice(packed256, packed256, packed256, plain, (many, many, 512, 512)) is not None
    assert configs.gluon_forward_choice(packed256, packed256, packed256, causal, (many, many, 512, 512)) is None
    assert configs.gluon_forward_choice(packed, packed, packed, plain, (many, many, 512, 512)) is None
    bounds = torch.stack([cu[:-1], cu.diff()], 1)  # (batch, 2) [start, length] bounds: the Triton forward's
    assert configs.gluon_forward_choice(packed, packed, packed, plain, (bounds, bounds, 5192, 5192)) is None
    monkeypatch.setenv("FLASHTILE_GLUON", "0")
    assert configs.gluon_forward_choice(q, q, q, plain) is None


def test_gluon_forward_rejects_bad_tiles():
    """Host checks only (no launch): tiles the kernel's layouts or the shared memory cannot take."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashtile.kernels import gluon_forward

    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    for tiles in [(96, 64, 2, 4), (128, 48, 2, 8), (128, 128, 4, 8), (128, 64, 2, 12), (128, 64, 1, 8)]:
        with pytest.raises(ValueError, match="tile"):
            gluon_forward.gluon_attention_forward(q, q, q, tiles=tiles)
    for variant in TWO_CONSUMERS:  # two 4-warp consumers: 8 warps
        with pytest.raises(ValueError, match="num_warps must be 8"):
            gluon_forward.gluon_attention_forward(q, q, q, tiles=(64, 128, 2, 4), variant=variant)
    with pytest.raises(ValueError, match="variant"):
        gluon_forward.gluon_attention_forward(q, q, q, variant="fa3")
    with pytest.raises(ValueError, match="three consumers"):  # 16-bit P in registers spills at d = 128: FP8 only
        gluon_forward.gluon_attention_forward(q, q, q, variant=FP8_ONLY[0])
    packed, cu = torch.zeros(8, 2, 128, dtype=torch.bfloat16), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="three consumers"):  # the packed kernel too
        gluon_forward.gluon_attention_forward_varlen(packed, packed, packed, cu, cu, 8, variant=FP8_ONLY[0])
    with pytest.raises(ValueError, match="schedule"):
        gluon_forward.gluon_attention_forward(q, q, q, schedule="persistent")
    assert list(gluon_forward.VARIANTS) == VARIANTS + FP8_ONLY


CPU_COMPILE = """
import flashtile
from flashtile.kernels import gluon_forward
q, k, v = (torch.randn(2, n, 4, 128, dtype=torch.bfloat16) for n in (300, 333, 333))
records = []
runs = [(variant, "grid", None) for variant, switches in gluon_forward.VARIANTS.items() if switches[2] < 3] + [
    ("pingpong", "lpt", None), ("pingpong-fa3", "grid", (128, 128, 3, 8))]
for variant, schedule, tiles in runs:
    out, lse = gluon_forward.gluon_attention_forward(q, k, v, variant=variant, schedule=schedule, tiles=tiles)
    records.append(kernel_record(gluon_forward._gluon_attn_fwd, variant=variant, schedule=schedule))
print(json.dumps({"file": flashtile.__file__, "launches": stand_in.Launcher.launches, "records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_forward_compiles_for_sm90_without_a_gpu(tmp_path):
    report = gluon_sm90_report(CPU_COMPILE, tmp_path)
    assert report["file"].startswith(str(REPO)), report["file"]
    assert report["launches"] == len(VARIANTS) + 2
    assert [record["variant"] for record in report["records"]] == VARIANTS + ["pingpong", "pingpong-fa3"]
    assert report["records"][-2]["schedule"] == "lpt"
    for record in report["records"]:
        assert record["target"] == 90, record
        assert record["ptx"] > 0, record  # wgmma instructions made it to the PTX
        assert not record["serialized"], record  # ptxas kept the wgmmas asynchronous
        # The three-stage build (the dispatch's from 4,096 tokens): ptxas keeps one 4-byte value in local memory
        # across the warp-specialized entry, stored once at the kernel's start and loaded once as each partition
        # starts, outside every loop (its SASS at edb64b3); any other spill fails.
        allowed = 4 if record is report["records"][-1] else 0
        assert record["registers"] > 0 and record["spills"] <= allowed, record
        assert 160 * 1024 <= record["shared"] <= 227 * 1024, record  # Q + two (three) K/V stages at d=128, within sm90


CPU_COMPILE_THREE = """
from flashtile.kernels import gluon_forward
q, k, v = (torch.randn(2, n, 4, 64, dtype=torch.bfloat16) for n in (300, 333, 333))
records = []
for causal in (False, True):
    gluon_forward.gluon_attention_forward(q, k, v, causal, variant="pingpong3-fa3", tiles=(192, 128, 2, 12))
    records.append(kernel_record(gluon_forward._gluon_attn_fwd, causal=causal))
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_forward_three_consumers_d64_compiles_for_sm90_without_a_gpu(tmp_path):
    """The d = 64 dispatch's kernel from 4,096 tokens (16-bit, three consumers holding P in registers): for sm_90a,
    causal or not, no spills, the wgmmas asynchronous, shared memory within sm90's."""
    report = gluon_sm90_report(CPU_COMPILE_THREE, tmp_path)
    assert [record["causal"] for record in report["records"]] == [False, True]
    for record in report["records"]:
        assert record["target"] == 90 and record["ptx"] > 0 and not record["serialized"], record
        assert record["registers"] > 0 and record["spills"] == 0, record
        assert record["shared"] <= 227 * 1024, record


def test_gluon_forward_choice_leaves_cpu_tensors_to_the_triton_forward():
    """The rule runs for every dense call: on CPU tensors (the interpreter, the stand-in) it declines."""
    from flashtile.kernels import configs
    from flashtile.options import AttentionOptions

    for dtype in (torch.bfloat16, torch.float32):
        q = torch.zeros(1, 2048, 4, 128, dtype=dtype)
        assert configs.gluon_forward_choice(q, q, q, AttentionOptions(softmax_scale=0.1)) is None


def test_gluon_fp8_forward_choice_follows_its_tiers(monkeypatch):
    """Which FP8 calls the Gluon FP8 forward takes (the GPU and plain-attention tests stubbed, as on an sm90 GPU):
    dense calls reaching ``GLUON_FP8_FORWARD``'s length for their head dim and mask, with three descales; never an
    FP8 cache, missing descales, other head dims, or with the named turns switched off."""
    from flashtile.kernels import configs
    from flashtile.options import AttentionOptions

    monkeypatch.setattr(configs, "_plain_attention", lambda *args, **kwargs: True)
    monkeypatch.setattr(configs, "_gluon_device", lambda device: True)
    monkeypatch.setattr(configs, "FWD_NAMED_SYNC", True)  # (the default, whatever the calling environment)
    descale = torch.ones(1, 2)
    fp8 = (descale, descale, descale, torch.bfloat16, False)

    def choice(seqlen, headdim=128, causal=False, fp8=fp8):
        q = torch.zeros(1, seqlen, 2, headdim)
        opts = AttentionOptions(headdim ** -0.5, causal, -1, 0 if causal else -1)
        return configs.gluon_fp8_forward_choice(q, q, q, opts, fp8)

    for (headdim, causal), (length, variant, tiles) in configs.GLUON_FP8_FORWARD.items():
        assert choice(length, headdim, causal) == (variant, tiles)
        assert choice(length - 1, headdim, causal) is None
    assert choice(4096, 96) is None
    assert choice(4096, fp8=(descale, descale, descale, torch.bfloat16, True)) is None  # an FP8 cache
    assert choice(4096, fp8=(None, descale, descale, torch.bfloat16, False)) is None
    monkeypatch.setattr(configs, "FWD_NAMED_SYNC", False)  # FLASHTILE_FWD_NAMED_SYNC=0 at import
    assert choice(4096) is None


def test_gluon_forward_choice_takes_three_consumers_for_dense_calls_only(monkeypatch):
    """d = 64 from 4,096 tokens: dense calls take the three consumers (``pingpong3-fa3``), packed calls the tier
    before (the varlen kernel is not tested with three consumers), whatever their mean length; no call under
    ``FLASHTILE_FWD_NAMED_SYNC=0``. (The GPU and plain-attention tests stubbed, as on an sm90 GPU.)"""
    from flashtile.kernels import configs
    from flashtile.options import AttentionOptions

    for name in ("_plain_attention", "_gluon_device", "_tma_ready"):
        monkeypatch.setattr(configs, name, lambda *args, **kwargs: True)
    monkeypatch.setattr(configs, "FWD_NAMED_SYNC", True)  # (the default, whatever the calling environment)
    for causal in (False, True):
        opts = AttentionOptions(0.125, causal, -1, 0 if causal else -1)
        q = torch.zeros(1, 4096, 2, 64)
        assert configs.gluon_forward_choice(q, q, q, opts) == ("pingpong3-fa3", (192, 128, 2, 12))
        assert configs.gluon_forward_choice(q[:, :4095], q, q, opts) == ("single-ffma", (128, 128, 2, 8))
        packed = torch.zeros(16384, 2, 64)
        cu = torch.tensor([0, 8192, 16384], dtype=torch.int32)  # a mean of 8,192 tokens
        assert configs.gluon_forward_choice(packed, packed, packed, opts, (cu, cu, 8192, 8192)) == (
            "single-ffma", (128, 128, 2, 8))
    for tiers in configs.GLUON_FORWARD.values():  # every packed tier has at most two consumers
        assert any(variant not in configs.THREE_CONSUMERS for _, variant, _ in tiers)
    monkeypatch.setattr(configs, "FWD_NAMED_SYNC", False)  # FLASHTILE_FWD_NAMED_SYNC=0 at import: no named turns
    q = torch.zeros(1, 4096, 2, 64)
    assert configs.gluon_forward_choice(q, q, q, AttentionOptions(0.125)) == ("single-ffma", (128, 128, 2, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gluon_forward_under_torch_compile(mode, monkeypatch):
    """torch.compile(fullgraph=True) traces flashtile's ops whose forward is the Gluon kernel (and, with
    mode="reduce-overhead", captures it in CUDA graphs): the step's gradient as eager's (Inductor fuses the
    loss's reduction its own way, so within rounding, as test_gpu_reliability's compiled steps)."""
    gluon_forward = _gluon_forward()
    from tests.utils import projection_step

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    # Every call takes the ordinary path, which the patch below sees: a launch plan recorded for this key by
    # an earlier test in the process would replay without it.
    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
    calls = []
    monkeypatch.setattr(gluon_forward, "gluon_attention_forward",
                        lambda *a, run=gluon_forward.gluon_attention_forward, **kw: calls.append(kw) or run(*a, **kw))
    torch._dynamo.reset()
    torch.manual_seed(stable_seed("compile", mode))
    x, weight, step = projection_step(2, 1024, 4, 128)

    expected = torch.autograd.grad(step(x, weight), weight)[0]
    assert calls, "the eager step did not take the Gluon forward"
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for _ in range(4):  # (reduce-overhead: warm-up, recording, replays)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        grad = torch.autograd.grad(compiled(x, weight), weight)[0].clone()
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=1e-4)


def test_tma_ready_refuses_broadcast_and_unaligned_strides():
    """The Gluon forward reads q, k, v through host descriptors only where a descriptor can cover them in
    place: not a stride-0 (expanded) dim, not a stride that is no multiple of 16 bytes."""
    from flashtile.kernels import configs

    base = torch.zeros(2, 64, 4, 128, dtype=torch.bfloat16)
    assert configs._tma_ready(base)
    assert not configs._tma_ready(base[:1].expand(3, -1, -1, -1))
    assert not configs._tma_ready(torch.zeros(2, 64, 4, 130, dtype=torch.bfloat16)[..., :128])
    assert not configs._tma_ready(base.transpose(-1, -2))


VARLEN_CASES = [  # (lengths q, lengths k, nheads, nheads_k, headdim, variant)
    ([1, 130, 257, 64], [1, 130, 257, 64], 4, 4, 128, "pingpong-fa3"),
    ([300, 17, 1024], [512, 200, 900], 8, 2, 128, "pingpong-fa3"),
    ([129, 5, 700], [129, 300, 64], 4, 1, 64, "single-ffma"),
    ([333, 1], [517, 1000], 4, 2, 128, "single"),
    ([0, 130, 0, 5], [10, 130, 7, 5], 4, 4, 128, "pingpong-early"),  # empty query sequences
    ([200, 300], [300, 200], 4, 2, 64, "ws"),
    ([77, 400, 129], [400, 77, 129], 4, 4, 128, "ws2"),
    ([300, 17, 700], [512, 200, 650], 4, 2, 256, "pingpong-fa3"),
    ([129, 5, 700, 400], [129, 300, 64, 500], 4, 2, 64, "pingpong3-fa3"),  # (not the dispatch's for packed calls)
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[5]}-d{c[4]}-h{c[2]}/{c[3]}-b{len(c[0])}")
def test_gluon_forward_varlen_matches_oracle(case, causal, poison):
    """Packed sequences (VARLEN): tiles that run past their sequence's end, sequences shorter than a tile,
    seqlen_q != seqlen_k (bottom-right causal, rows that see no key), GQA; out and lse against the per-sequence
    float64 oracle by the suite's rule, and the rows past each sequence untouched by its neighbours."""
    gluon_forward = _gluon_forward()
    from tests.utils import assert_lse_close, assert_rule, random_cu_seqlens, varlen_oracle

    lengths_q, lengths_k, nheads, nheads_k, headdim, variant = case
    torch.manual_seed(stable_seed(case, causal, "varlen"))
    cu_q, cu_k = random_cu_seqlens(lengths_q, "cuda"), random_cu_seqlens(lengths_k, "cuda")
    q = torch.randn(sum(lengths_q), nheads, headdim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(sum(lengths_k), nheads_k, headdim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out, lse = gluon_forward.gluon_attention_forward_varlen(q, k, v, cu_q, cu_k, max(lengths_q), causal,
                                                            variant=variant)
    out_ref, lse_ref = varlen_oracle(q, k, v, cu_q, cu_k, causal=causal)
    out_pt, _ = varlen_oracle(q, k, v, cu_q, cu_k, dtype=None, causal=causal)
    assert_rule("out", out, out_ref, out_pt, 2)
    assert_lse_close(lse, lse_ref.float())


VARLEN_COMPILE = """
from flashtile.kernels import gluon_forward
cu = torch.tensor([0, 100, 333], dtype=torch.int32)
records = []
for d, variant in ((128, "pingpong-fa3"), (64, "single-ffma")):
    for causal in (False, True):
        q, k, v = (torch.randn(333, 4, d, dtype=torch.bfloat16) for _ in range(3))
        gluon_forward.gluon_attention_forward_varlen(q, k, v, cu, cu, 233, causal, variant=variant)
        records.append(kernel_record(gluon_forward._gluon_attn_fwd, variant=variant, causal=causal))
print(json.dumps({"records": records}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("variant, tiles", [("pingpong-fa3", None), ("ws-overlap", None), ("pingpong3-fa3", None),
                                            ("pingpong-fa3", (128, 256, 2, 8)), ("pingpong-fa3", (128, 128, 3, 8))],
                         ids=["pingpong-fa3", "ws-overlap", "pingpong3-fa3", "pingpong-fa3-256keys",
                              "pingpong-fa3-3stages"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", [(257, 257, 8, 8, 128), (100, 515, 8, 2, 128), (1024, 1100, 4, 4, 64),
                                  (600, 300, 4, 2, 128),  # causal: rows that see no key (lse -inf)
                                  # seqlen_k a multiple of 16: P from registers (K's keys permuted)
                                  (300, 528, 8, 2, 128), (1024, 1104, 4, 4, 64), (600, 320, 4, 1, 128)],
                         ids=lambda c: f"sq{c[0]}-sk{c[1]}-h{c[2]}/{c[3]}-d{c[4]}")
def test_gluon_forward_fp8_meets_the_fp8_rule(case, causal, variant, tiles):
    """FP8 q, k, v (FP8): out within the FP8 forward's rule (test_fp8_kernels: FA3's, on the dequantized inputs),
    lse within twice bf16 PyTorch's error (test_fp8_kernels.check_lse), and bitwise reproducible. Over a seqlen_k
    that is a multiple of 16, two consumers at d <= 128 and three at d = 64 take P V's P from registers (``P_REGS``,
    FLASHTILE_FP8_P_REGISTERS)."""
    gluon_forward = _gluon_forward()
    from flashtile.fp8 import quantize
    from tests.kernels.test_fp8_kernels import _check, check_lse

    seqlen_q, seqlen_k, nheads, nheads_k, headdim = case
    gen = torch.Generator(device="cuda").manual_seed(stable_seed(case, causal))

    def spread(nheads):  # a magnitude per (batch, head): a descale read for the wrong one shows
        return 2.0 ** torch.randint(-3, 4, (2, 1, nheads, 1), device="cuda", generator=gen)

    q = torch.randn(2, seqlen_q, nheads, headdim, device="cuda", generator=gen) * spread(nheads)
    k, v = (torch.randn(2, seqlen_k, nheads_k, headdim, device="cuda", generator=gen) * spread(nheads_k)
            for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = quantize(q, nheads_k), quantize(k), quantize(v)
    descales = (qd, kd, vd)
    out, lse = gluon_forward.gluon_attention_forward_fp8(q8, k8, v8, *descales, causal, tiles=tiles, variant=variant)
    assert out.dtype == torch.bfloat16 and out.shape == q8.shape
    _check(out, q8, k8, v8, descales, causal)
    check_lse(lse, q8, k8, descales, causal)
    again, _ = gluon_forward.gluon_attention_forward_fp8(q8, k8, v8, *descales, causal, tiles=tiles,
                                                         variant=variant)
    assert torch.equal(out, again)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, seqlen, nheads_k, headdim",
                         [(False, 4096, 2, 128), (True, 4096, 1, 128), (True, 8192, 2, 128), (False, 2048, 2, 64),
                          (True, 2048, 1, 64), (False, 2048, 2, 256), (True, 2048, 1, 256)],
                         ids=["full-4096-gqa", "causal-4096-mqa", "causal-8192-gqa", "d64-full-2048",
                              "d64-causal-2048", "d256-full-2048", "d256-causal-2048"])
def test_flash_attn_func_takes_the_gluon_fp8_forward_from_its_lengths(causal, seqlen, nheads_k, headdim):
    """Dense FP8 calls reaching ``configs.GLUON_FP8_FORWARD``'s lengths run the Gluon FP8 kernel (three consumer
    warpgroups) through flash_attn_func: its bits, within the FP8 rule, lse as the FP8 kernels' check takes it."""
    gluon_forward = _gluon_forward()
    from flashtile import flash_attn_func
    from flashtile.fp8 import quantize
    from flashtile.kernels import configs
    from tests.kernels.test_fp8_kernels import _check, check_lse

    gen = torch.Generator(device="cuda").manual_seed(stable_seed(causal, seqlen, headdim))
    q = torch.randn(1, seqlen, 2, headdim, device="cuda", generator=gen)
    k, v = (torch.randn(1, seqlen, nheads_k, headdim, device="cuda", generator=gen) for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = quantize(q, nheads_k), quantize(k), quantize(v)
    out, lse, _ = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                  return_attn_probs=True)
    variant, tiles = configs.GLUON_FP8_FORWARD[headdim, causal][1:]
    direct, direct_lse = gluon_forward.gluon_attention_forward_fp8(q8, k8, v8, qd, kd, vd, causal, tiles=tiles,
                                                                   variant=variant)
    assert torch.equal(out, direct) and torch.equal(lse, direct_lse)
    _check(out, q8, k8, v8, (qd, kd, vd), causal)
    check_lse(lse, q8, k8, (qd, kd, vd), causal)


FP8_COMPILE = """
from flashtile.kernels import gluon_forward
records = []
for d, variant in ((128, "pingpong-fa3"), (64, "ws-overlap"), (128, "pingpong3-fa3")):
    for causal in (False, True):
        q, k, v = (torch.randn(2, n, 4, d).to(torch.float8_e4m3fn) for n in (300, 333, 333))
        gluon_forward.gluon_attention_forward_fp8(q, k, v, *(torch.ones(2, 4) for _ in range(3)), causal,
                                                  variant=variant)
        records.append(kernel_record(gluon_forward._gluon_attn_fwd, variant=variant, causal=causal))
print(json.dumps({"records": records}))
"""


@pytest.mark.parametrize("batch, seqlen_k, nheads_k, headdim, view",
                         [(2, 320, 4, 64, "contiguous"), (1, 1104, 2, 128, "contiguous"), (3, 256, 1, 64, "packed"),
                          (2, 300, 2, 64, "contiguous"), (2, 320, 2, 64, "cache slice")])
def test_permuted_k_descriptor_boxes_hold_the_keys_the_fp8_operand_wants(batch, seqlen_k, nheads_k, headdim, view):
    """``_permuted_k_descriptor``'s 5-D boxes read as TMA reads them (the descriptor's shape and strides over K's
    storage): box row 8·g + 2·t + e of each block of 16 is key 4·t + 2·g + e of the tile, every row within K's own
    keys of the (batch, kv head); None where the rows are no even run (seqlen_k % 16, a cache's batch stride)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashtile.kernels import gluon_forward

    block_n = 128
    def keys(*shape):  # distinct values (float64: exact); only strides and addresses matter
        return torch.arange(math.prod(shape), dtype=torch.float64).view(*shape)

    if view == "packed":  # k of a packed qkv (batch, seqlen, 3, heads, d): rows 3 x heads x d apart
        k = keys(batch, seqlen_k, 3, nheads_k, headdim)[:, :, 1]
    elif view == "cache slice":  # the first seqlen_k rows of a longer cache: the batch stride is the cache's
        k = keys(batch, 2 * seqlen_k, nheads_k, headdim)[:, :seqlen_k]
    else:
        k = keys(batch, seqlen_k, nheads_k, headdim)
    desc = gluon_forward._permuted_k_descriptor(k, block_n)
    if seqlen_k % 16 or view == "cache slice":
        assert desc is None
        return
    boxes = torch.as_strided(k, desc.shape, desc.strides, k.storage_offset())
    assert desc.block_shape == [block_n // 16, 2, 4, 2, headdim]
    for b in range(batch):
        for kv_head in range(nheads_k):
            for tile in range(-(-seqlen_k // block_n)):
                first = b * (seqlen_k // 16) + tile * (block_n // 16)  # the kernel's k_block0 + tile's blocks
                box = boxes[first:first + block_n // 16, :, :, :, kv_head * headdim:(kv_head + 1) * headdim]
                box = box.reshape(-1, headdim)
                for row in range(box.shape[0]):
                    g, t, e = (row >> 3) & 1, (row >> 1) & 3, row & 1
                    key = tile * block_n + (row & -16) + 4 * t + 2 * g + e
                    if key < seqlen_k:
                        assert torch.equal(box[row], k[b, key, kv_head]), (b, kv_head, tile, row)


P_REGS_COMPILE = """
import os
from flashtile.kernels import gluon_forward
records = []
cases = ((128, "pingpong-fa3"), (64, "pingpong3-fa3")) if os.environ["FLASHTILE_FP8_P_REGISTERS"] == "wait" else \
    ((128, "pingpong-fa3"),)
for d, variant in cases:
    for causal in (False, True):
        q, k, v = (torch.randn(2, n, 4, d).to(torch.float8_e4m3fn) for n in (300, 320, 320))
        assert gluon_forward._permuted_k_descriptor(k, 128) is not None
        gluon_forward.gluon_attention_forward_fp8(q, k, v, *(torch.ones(2, 4) for _ in range(3)), causal,
                                                  variant=variant)
        records.append(kernel_record(gluon_forward._gluon_attn_fwd, {"rounded": "e4m3x2"}, variant=variant,
                                     causal=causal))
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
@pytest.mark.parametrize("setting", ["wait", "carry"])
def test_gluon_fp8_p_from_registers_compiles_for_sm90_without_a_gpu(setting, tmp_path, monkeypatch):
    """The FP8 forward with P V's P from registers (FLASHTILE_FP8_P_REGISTERS, K's keys permuted): two consumers at
    d = 128 under both settings, three at d = 64 under ``wait``, compile for sm_90a without spills, their wgmmas
    asynchronous (an operand register made while a wgmma reading it is in flight would serialize them), P rounded
    by the kernel's inline PTX."""
    monkeypatch.setenv("FLASHTILE_FP8_P_REGISTERS", setting)
    report = gluon_sm90_report(P_REGS_COMPILE, tmp_path)
    assert len(report["records"]) == {"wait": 4, "carry": 2}[setting]
    for record in report["records"]:
        assert record["spills"] == 0 and not record["serialized"] and record["rounded"] > 0, record


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
@pytest.mark.parametrize("switch", ["varlen", "fp8"])
def test_gluon_forward_switch_compiles_for_sm90_without_a_gpu(switch, tmp_path):
    """The VARLEN and FP8 switches' kernels (two variants, causal or not; FP8 also with three consumers) compile for
    sm_90a without spills, their wgmma asynchronous."""
    body = {"varlen": VARLEN_COMPILE, "fp8": FP8_COMPILE}[switch]
    assert f"gluon_attention_forward_{switch}" in body
    report = gluon_sm90_report(body, tmp_path)
    assert len(report["records"]) == {"varlen": 4, "fp8": 6}[switch]
    for record in report["records"]:
        assert record["registers"] > 0 and record["spills"] == 0 and not record["serialized"], record


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["pingpong-fa3", "single"])
def test_gluon_forward_varlen_reads_no_neighbour_rows(variant, poison):
    """A sequence's last tiles stop at its own end (descriptors made per sequence): inf in the next sequence's
    first K and V rows leaves this one's output finite and by the rule."""
    gluon_forward = _gluon_forward()
    from tests.utils import assert_rule, random_cu_seqlens, varlen_oracle

    lengths = [100, 37]  # the first sequence ends inside a tile of every tile size
    torch.manual_seed(stable_seed(variant, "neighbour"))
    cu = random_cu_seqlens(lengths, "cuda")
    q, k, v = (torch.randn(sum(lengths), 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    k[lengths[0]], v[lengths[0]] = float("inf"), float("inf")
    out, _ = gluon_forward.gluon_attention_forward_varlen(q, k, v, cu, cu, max(lengths), False, variant=variant)
    first = slice(0, lengths[0])
    cu_first = random_cu_seqlens(lengths[:1], "cuda")
    out_ref, _ = varlen_oracle(q[first], k[first], v[first], cu_first, cu_first)
    out_pt, _ = varlen_oracle(q[first], k[first], v[first], cu_first, cu_first, dtype=None)
    assert_rule("out of the first sequence", out[first], out_ref, out_pt, 2)


RESCALE_SKIP_COMPILE = """
from flashtile.kernels import configs, gluon_forward
records = []
for d, fp8, variant, tiles in ((128, False, "pingpong-fa3", (128, 128, 2, 8)), (64, False, "pingpong-fa3", None),
                               (128, True, "pingpong3-fa3", None), (64, True, "pingpong3-fa3", None)):
    for causal in (False, True):
        q, k, v = (torch.randn(2, n, 4, d) for n in (300, 320, 320))
        if fp8:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            gluon_forward.gluon_attention_forward_fp8(q, k, v, *(torch.ones(2, 4) for _ in range(3)), causal,
                                                      variant=variant)
        else:
            gluon_forward.gluon_attention_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal, tiles=tiles,
                                                  variant=variant)
        records.append(kernel_record(gluon_forward._gluon_attn_fwd, {"votes": "vote.sync.any.pred"}, d=d, fp8=fp8,
                                     causal=causal, tile=configs._LAST_FIXED.get("_gluon_attn_fwd", "")))
print(json.dumps({"records": records}))
"""


EXP2_POLY_COMPILE = """
from flashtile.kernels import gluon_forward
records = []
for d in (128, 64):
    for causal in (False, True):
        q, k, v = (torch.randn(2, n, 4, d).to(torch.float8_e4m3fn) for n in (300, 320, 320))
        gluon_forward.gluon_attention_forward_fp8(q, k, v, *(torch.ones(2, 4) for _ in range(3)), causal,
                                                  variant="pingpong3-fa3")
        records.append(kernel_record(gluon_forward._gluon_attn_fwd, {"ex2": "ex2.approx", "poly": "0f3D61A4AC"},
                                     d=d, causal=causal))
print(json.dumps({"records": records}))
"""


Q_REGS_COMPILE = """
from flashtile.kernels import gluon_forward
records = []
for d, variant, tiles in ((128, "pingpong-fa3", (128, 128, 2, 8)), (64, "pingpong3-fa3", None)):
    for causal in (False, True):
        q, k, v = (torch.randn(2, n, 4, d).to(torch.float8_e4m3fn) for n in (300, 320, 320))
        gluon_forward.gluon_attention_forward_fp8(q, k, v, *(torch.ones(2, 4) for _ in range(3)), causal,
                                                  variant=variant, tiles=tiles)
        records.append(kernel_record(gluon_forward._gluon_attn_fwd, d=d, causal=causal))
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_fp8_q_in_registers_compiles_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    """FLASHTILE_FP8_Q_REGISTERS=1: two FP8 consumers at d = 128 and three at d = 64, with Q and P from registers
    (K's keys permuted), compile for sm_90a without spills, their wgmmas asynchronous (Q's registers are never
    redefined)."""
    monkeypatch.setenv("FLASHTILE_FP8_Q_REGISTERS", "1")
    report = gluon_sm90_report(Q_REGS_COMPILE, tmp_path)
    assert len(report["records"]) == 4
    for record in report["records"]:
        assert record["spills"] == 0 and not record["serialized"], record


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_fp8_exp2_polynomial_compiles_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    """FLASHTILE_FP8_EXP2_POLY=2: the FP8 forward's three consumers at d = 128 and 64 compile for sm_90a with the
    polynomial beside MUFU's ex2 in the PTX, without spills, their wgmmas asynchronous."""
    monkeypatch.setenv("FLASHTILE_FP8_EXP2_POLY", "2")
    report = gluon_sm90_report(EXP2_POLY_COMPILE, tmp_path)
    assert len(report["records"]) == 4
    for record in report["records"]:
        assert record["spills"] == 0 and not record["serialized"], record
        assert record["poly"] > 0 and record["ex2"] > 0, record


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
@pytest.mark.parametrize("lane_sum_and_words", ["0", "1"])
def test_gluon_forward_skipping_rescales_compiles_for_sm90_without_a_gpu(lane_sum_and_words, tmp_path, monkeypatch):
    """FLASHTILE_FWD_RESCALE_SKIP=1, with and without FLASHTILE_FWD_LANE_SUM, FLASHTILE_FP8_P_WORDS and
    FLASHTILE_FWD_P_PAIRS (16-bit P rounded two keys a word by inline PTX after the P V wait): the 16-bit
    and FP8 forwards of the dispatch (two and three consumers, d = 64 and 128; keys a multiple of 16, so that the
    FP8 d = 128 kernel stores P as words under the latter) compile for sm_90a with O's skippable rescale (the warp's
    vote in the PTX), without spills beyond the same kernel's without it, their wgmmas asynchronous (the branch
    around the multiplies must not serialize them)."""
    monkeypatch.setenv("FLASHTILE_FWD_RESCALE_SKIP", "1")
    monkeypatch.setenv("FLASHTILE_FWD_LANE_SUM", lane_sum_and_words)
    monkeypatch.setenv("FLASHTILE_FP8_P_WORDS", lane_sum_and_words)
    monkeypatch.setenv("FLASHTILE_FWD_P_PAIRS", lane_sum_and_words)
    report = gluon_sm90_report(RESCALE_SKIP_COMPILE, tmp_path)
    assert len(report["records"]) == 8
    for record in report["records"]:
        # (the 16-bit d = 128 causal 128 x 128 tile spills 4 bytes with or without the skip)
        assert record["spills"] <= 4 and not record["serialized"] and record["votes"] > 0, record
    words = [record for record in report["records"] if record["tile"].endswith("p_words")]
    assert len(words) == (2 if lane_sum_and_words == "1" else 0), report["records"]
