"""The Gluon sm90 backward (``flashtile.kernels.gluon_backward``): its two passes (a prototype, not dispatched) and
the one pass that flash_attn_func's backward takes on sm90 from ``configs.GLUON_BACKWARD_MIN_SEQLEN``.

On an H200 the GPU tests take flashtile's forward (out, lse) and the Gluon backward's dq, dk, dv, and check
them against the float64 oracle by the suite's rule (3x PyTorch's error for gradients), d = 64 and 128,
causal (bottom-right aligned) or not, GQA, lengths that are no multiple of any tile; and that two runs are
bitwise equal. Without a GPU one test compiles both kernels for sm_90 through the stand-in driver, in a
subprocess, and checks ptxas's resources (no spills, asynchronous wgmmas).
"""

import sys
from pathlib import Path

import pytest
import torch

from tests.utils import (
    check_against_oracle,
    gluon_sm90_report,
    make_qkv,
    needs_triton_36,
    skip_unless_gluon_dispatch,
    stable_seed,
)

pytestmark = needs_triton_36

REPO = Path(__file__).resolve().parents[2]
SEQLENS = [(1, 1), (113, 203), (203, 113), (128, 128), (1023, 1024)]


def _gluon_backward():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Gluon backward is written for sm90 (wgmma, TMA)")
    from flashtile.kernels import gluon_backward

    return gluon_backward


# The backward variants: the two passes, plain and pipelined; the one pass with float32 or fixed-point dQ
# reductions, plain and warp-specialized (and then pipelined: the next pair's scores under the products).
VARIANT_ARGS = {
    "plain": {}, "pipelined": dict(pipelined=True),
    "atomic": dict(one_pass="atomic"), "fixed": dict(one_pass="fixed"),
    "atomic-ws": dict(one_pass="atomic", warp_specialize=True),
    "fixed-ws": dict(one_pass="fixed", warp_specialize=True),
    "fixed-ws-pipelined": dict(one_pass="fixed", warp_specialize=True, pipelined=True),
    "atomic-ws-pipelined": dict(one_pass="atomic", warp_specialize=True, pipelined=True),
    "fixed-keys-m": dict(one_pass="fixed", keys_as_m=True),
    "fixed-ws-keys-m": dict(one_pass="fixed", warp_specialize=True, keys_as_m=True),
    "fixed-ws-keys-m-fa3": dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", dkdv_tiles=(64, 128, 2, 8)),
    "fixed-ws-keys-m-fa3-early-dv": dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3-early-dv"),
    # the last wave of key blocks split into pieces as on a GPU of 6 multiprocessors (without a causal mask; of the
    # oracle's cases d = 64 and 128 at 1023 x 1024, d = 128 at 203 x 113, and the GQA fp16 case split)
    "fixed-ws-keys-m-fa3-tail-split": dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", split_sms=6),
    # the units from every key's maxima (no check), and from bounds of 0, which every program's check fails: dQ by
    # the flagged Triton pass (``backward.dq_where_flagged``)
    "fixed-ws-keys-m-fa3-exact-bound": dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3",
                                            sampled_bound=False),
    "fixed-ws-keys-m-fa3-recomputed": dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3",
                                           sampled_bound=True, estimate_margin=0.0),
}
VARIANTS = pytest.mark.parametrize("variant", list(VARIANT_ARGS))
# Variants at one head dim only (their tiles fit no other): not in VARIANTS.
D64_VARIANT_ARGS = {
    "fixed-ws-keys-m-fa3-128-rows": dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3",
                                         dkdv_tiles=(128, 128, 2, 8)),
}
PIPELINED = pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
ONE_PASS = pytest.mark.parametrize("one_pass", ["atomic", "fixed", "atomic-ws", "fixed-ws", "fixed-ws-pipelined"])


def _attention(causal, variant="plain"):
    """(q, k, v) -> (out, lse): flashtile's forward, gradients from the Gluon backward's ``variant``."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func

    class GluonGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            return gluon_backward.gluon_attention_backward(dout.contiguous(), *ctx.saved_tensors, causal,
                                                           **{**VARIANT_ARGS, **D64_VARIANT_ARGS}[variant])

    return GluonGrad.apply


@pytest.mark.gpu
@VARIANTS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"sq{s[0]}-sk{s[1]}")
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_gluon_backward_matches_oracle(headdim, seqlens, causal, variant, poison):
    run = _attention(causal, variant)
    torch.manual_seed(stable_seed(headdim, seqlens, causal, variant, "gluon-bwd"))
    q, k, v = make_qkv(2, *seqlens, 4, 4, headdim, torch.bfloat16, "cuda")
    check_against_oracle(run, q, k, v, causal, oracle_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(D64_VARIANT_ARGS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"sq{s[0]}-sk{s[1]}")
def test_gluon_backward_d64_variants_match_oracle(seqlens, causal, variant, poison):
    """The variants whose tiles fit d = 64 only (FA3's order with 128 query rows: one dQ buffer), GQA; the same bits
    twice."""
    run = _attention(causal, variant)
    torch.manual_seed(stable_seed(seqlens, causal, variant, "gluon-bwd-d64"))
    q, k, v = make_qkv(2, *seqlens, 4, 2, 64, torch.bfloat16, "cuda")
    check_against_oracle(run, q, k, v, causal, oracle_dtype=torch.float32)
    dout = torch.randn_like(q)
    out = run(q, k, v)[0]
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@VARIANTS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_backward_gqa_fp16(causal, variant, poison):
    run = _attention(causal, variant)
    torch.manual_seed(stable_seed(causal, variant, "gluon-bwd-gqa"))
    q, k, v = make_qkv(2, 333, 517, 8, 2, 128, torch.float16, "cuda")
    check_against_oracle(run, q, k, v, causal, oracle_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["plain", "ws", "ws-pipelined"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_gluon_one_pass_fixed_point_is_bitwise_reproducible(headdim, causal, loop):
    """The int32 fixed-point dQ accumulation does not depend on the order the key blocks' adds land in; dK and
    dV are the two passes' (the same products in the same order) at equal tiles; every loop gives the same
    bits (the pipelined one reorders the products' issue, not any sum)."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func

    torch.manual_seed(5)
    q, k, v = make_qkv(2, 2500, 2500, 8, 2, headdim, torch.bfloat16, "cuda", requires_grad=False)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(q)
    # (the plain loop makes its units from every key: the warp-specialized ones too, for the same bits)
    kwargs = dict(one_pass="fixed", warp_specialize=loop != "plain", pipelined=loop == "ws-pipelined")
    if loop != "plain":
        sampled = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, causal, **kwargs)
        for _ in range(3):
            again = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, causal, **kwargs)
            assert all(torch.equal(a, b) for a, b in zip(sampled, again))
        kwargs["sampled_bound"] = False
    first = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, causal, **kwargs)
    for _ in range(5):
        again = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, causal, **kwargs)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    tiles = gluon_backward.ONE_PASS_TILES[headdim]
    two_pass = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, causal, dkdv_tiles=tiles)
    assert torch.equal(first[1], two_pass[1]) and torch.equal(first[2], two_pass[2])
    plain = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, causal, one_pass="fixed")
    assert all(torch.equal(a, b) for a, b in zip(first, plain))


@pytest.mark.gpu
@pytest.mark.parametrize("section_mb", ["11", "21", "1000"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_gluon_one_pass_causal_schedule_changes_no_bit(headdim, section_mb, monkeypatch):
    """The causal one pass starts the longest key blocks first across sections of (batch, KV head) pairs
    (``FLASHTILE_L2_SECTION_MB``; 0: head by head). The order moves programs, never a result: dK and dV are each
    one program's, dQ's integer sums do not depend on the order. Six pairs: at d = 128, sections of 2, 4 (the last
    one short) and all 6."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func

    torch.manual_seed(stable_seed(headdim, section_mb, "one-pass-schedule"))
    q, k, v = make_qkv(3, 2500, 2600, 8, 2, headdim, torch.bfloat16, "cuda", requires_grad=False)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = torch.randn_like(q)
    kwargs = dict(one_pass="fixed", warp_specialize=True, pipelined=True)
    monkeypatch.setenv("FLASHTILE_L2_SECTION_MB", "0")
    first = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, True, **kwargs)
    monkeypatch.setenv("FLASHTILE_L2_SECTION_MB", section_mb)
    again = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, True, **kwargs)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
@ONE_PASS
def test_gluon_one_pass_masks_keys_past_seqlen_k(one_pass, poison):
    """Without a causal mask too, the one pass masks the zero-filled keys past seqlen_k: their P would be
    2^-lse, which with strongly negative scores (lse about -40 here) overflows fp16's dS and would reach dQ as
    inf * 0 = NaN (float32 adds) or as lost key blocks (fixed point)."""
    run = _attention(False, one_pass)
    torch.manual_seed(stable_seed(one_pass, "gluon-1pass-padded-keys"))
    q, k, v = make_qkv(2, 203, 333, 4, 4, 128, torch.float16, "cuda", requires_grad=False)
    q = (q * 0.1 - 2).requires_grad_()
    k = (k * 0.1 + 2).requires_grad_()
    check_against_oracle(run, q, k, v.requires_grad_(), False, oracle_dtype=torch.float32)


@pytest.mark.gpu
@PIPELINED
def test_gluon_backward_is_bitwise_reproducible(pipelined):
    """Two runs give the same bits; the pipelined passes, whose products are the plain passes' in the same
    order per accumulator, give the plain passes' bits at equal tiles, with the dQ pass on a side stream too."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func

    torch.manual_seed(3)
    q, k, v = make_qkv(2, 1500, 1500, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=False)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = torch.randn_like(q)
    first = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, True, pipelined=pipelined)
    for _ in range(5):
        again = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, True, pipelined=pipelined)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    if pipelined:
        tiles = dict(dkdv_tiles=gluon_backward.PIPELINED_DKDV_TILES[128],
                     dq_tiles=gluon_backward.PIPELINED_DQ_TILES[128])
        plain = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, True, **tiles)
        piped = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, True, **tiles, pipelined=True)
        overlapped = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, True, **tiles, pipelined=True,
                                                             overlap=True)
        torch.cuda.synchronize()
        for a, b, c in zip(plain, piped, overlapped):
            assert torch.equal(a, b) and torch.equal(a, c)


CPU_COMPILE = """
from flashtile.kernels import gluon_backward as gb
records = []
for d in (64, 128):
    for causal in (False, True):
        q = torch.randn(2, 300, 4, d, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 333, 2, d, dtype=torch.bfloat16) for _ in range(2))
        gb.gluon_attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(2, 4, 300), causal)
        for kernel in (gb._gluon_bwd_dkdv, gb._gluon_bwd_dq):
            record = kernel_record(kernel, d=d, causal=causal)
            records.append({**record, "kernel": kernel.__name__, "wgmma": record["ptx"]})
        gb.gluon_attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(2, 4, 300), causal,
                                    pipelined=True)
        for kernel in (gb._gluon_bwd_dkdv, gb._gluon_bwd_dq):
            record = kernel_record(kernel, d=d, causal=causal, pipelined=True)
            records.append({**record, "kernel": kernel.__name__ + " pipelined", "wgmma": record["ptx"]})
print(json.dumps({"records": records}))
"""


def assert_async_without_spills(records, wgmma_count="ptx"):
    """Every build's wgmmas present (``wgmma_count``: the record's count of them) and asynchronous, its registers
    within 255, no spills."""
    for record in records:
        assert record[wgmma_count] > 0 and not record["serialized"], record
        assert 0 < record["registers"] <= 255 and record["spills"] == 0, record


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_backward_compiles_for_sm90_without_a_gpu(tmp_path):
    report = gluon_sm90_report(CPU_COMPILE, tmp_path, timeout=600)
    assert len(report["records"]) == 16
    assert_async_without_spills(report["records"], "wgmma")


ONE_PASS_COMPILE = """
from flashtile.kernels import gluon_backward as gb
records = []
for d in (64, 128):
    # The dispatch's loop (fixed point, warp-specialized, pipelined) causal and not; the others causal.
    for mode, ws, pipelined, causal in (("atomic", False, False, True), ("fixed", False, False, True),
                                        ("fixed", True, False, True), ("fixed", True, True, True),
                                        ("fixed", True, True, False)):
        q = torch.randn(2, 300, 4, d, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 333, 2, d, dtype=torch.bfloat16) for _ in range(2))
        # The default d = 64 tile (128 query rows) is the pipelined loop's, the dispatch's; the plain
        # warp-specialized loop spills with it (48 bytes causal) and is checked at 64 rows.
        tiles = (64, 128, 2, 8) if (d, ws, pipelined) == (64, True, False) else None
        gb.gluon_attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(2, 4, 300), causal,
                                    one_pass=mode, warp_specialize=ws, pipelined=pipelined, dkdv_tiles=tiles)
        records.append(kernel_record(gb._gluon_bwd_dkdv, {"bulk_reductions": "cp.reduce.async.bulk.tensor"}, d=d,
                                     mode=mode, ws=ws, pipelined=pipelined, causal=causal))
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_one_pass_backward_compiles_for_sm90_without_a_gpu(tmp_path):
    """The one-pass dK/dV pass builds for sm_90, warp-specialized too (and pipelined), with its dQ shares going out
    as TMA bulk reductions, its wgmmas asynchronous and no spills at d = 64 or 128 at their default tiles (d = 64's
    plain warp-specialized loop at 64 query rows, not the default 128; addressed once before the loop,
    the stationary tiles' wgmma descriptors were hoisted and spilled at d = 128: ``_stationary``; the pipelined loop
    with the next scores in flight beside dQ's share spilled and serialized its wgmmas)."""
    report = gluon_sm90_report(ONE_PASS_COMPILE, tmp_path, timeout=600)
    assert len(report["records"]) == 10
    assert_async_without_spills(report["records"])
    for record in report["records"]:
        assert record["bulk_reductions"] > 0, record


# Builds the one pass in FA3's order (or keys_as_m=order) for sm_90a at head dim d: its kernel record.
KEYS_M_BUILD = """
from flashtile.kernels import gluon_backward as gb
def build(d, causal, order="fa3", tiles=None, ptx_counts=None, dropout_p=0.0):
    q = torch.randn(2, 300, 4, d, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 333, 2, d, dtype=torch.bfloat16) for _ in range(2))
    gb.gluon_attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(2, 4, 300), causal,
                                one_pass="fixed", warp_specialize=True, keys_as_m=order, dkdv_tiles=tiles,
                                dropout_p=dropout_p, dropout_seed=(1 << 40) + 3)
    return kernel_record(gb._gluon_bwd_dkdv, ptx_counts, d=d, causal=causal)
"""
KEYS_M_FA3_COMPILE = KEYS_M_BUILD + """
records = [build(d, causal, order, (64, 128, 2, 8))
           for order in ("fa3", "fa3-early-dv") for d in (64, 128) for causal in (False, True)]
# d = 64 with 128 query rows (one dQ buffer), the dispatch's
records += [build(64, causal, tiles=(128, 128, 2, 8)) for causal in (False, True)]
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_keys_as_m_fa3_order_compiles_without_spills(tmp_path):
    """The keys-as-M one pass in FA3's order (the statistics through shared memory) builds for sm_90a at d = 64
    and 128, causal and not, with 64 query rows, and so does its lab variant with dV's product issued before the wait
    for dPᵀ ("fa3-early-dv"); the FA3 order at d = 64 with 128 query rows too (its default, ``KEYS_AS_M_TILES``; one
    dQ buffer: two would pass the 227 KiB): asynchronous wgmmas, no spills, within sm90's shared memory. (The lab
    variant with 128 rows at d = 64 spills 8 bytes.)"""
    report = gluon_sm90_report(KEYS_M_FA3_COMPILE, tmp_path, timeout=600)
    assert len(report["records"]) == 10
    assert_async_without_spills(report["records"])
    for record in report["records"]:
        assert record["shared"] <= 232448, record


KEYS_M_DROPOUT_COMPILE = KEYS_M_BUILD + """
# its default tiles with dropout (gb.KEYS_AS_M_DROPOUT_TILES)
records = [build(d, causal, dropout_p=0.1) for d in (128, 64) for causal in (False, True)]
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_fa3_order_with_dropout_compiles(tmp_path):
    """FA3's order regenerating the forward's dropout mask (``_dropout_keep_t``) builds for sm_90a at its dropout
    tiles, d = 64 and 128, causal and not: asynchronous wgmmas; no spills at d = 64, at most 8 bytes a thread at
    d = 128 (4 and 8 with triton 3.6: one register short of the warp-specialized consumer's 168)."""
    report = gluon_sm90_report(KEYS_M_DROPOUT_COMPILE, tmp_path, timeout=600)
    assert len(report["records"]) == 4
    for record in report["records"]:
        assert record["ptx"] > 0 and not record["serialized"], record
        assert 0 < record["registers"] <= 255 and record["spills"] <= (8 if record["d"] == 128 else 0), record


KEYS_M_EVERY_PAIR_COMPILE = """
import os
os.environ["FLASHTILE_BWD_MASK_EDGES_ONLY"] = "0"  # both read when gluon_backward is imported, below
os.environ["FLASHTILE_BWD_DQ_WAIT_AT_DS"] = "0"
os.environ["FLASHTILE_BWD_NAMED_RELEASE"] = "0"
os.environ["FLASHTILE_BWD_DQ_SEND_LATE"] = "0"
""" + KEYS_M_BUILD + """
assert not gb._MASK_EDGES_ONLY and not gb._DQ_WAIT_AT_DS and not gb._NAMED_RELEASE and not gb._DQ_SEND_LATE
records = [build(128, causal) for causal in (False, True)] + [build(64, True, tiles=(128, 128, 2, 8))]
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_keys_as_m_every_pair_masked_compiles_without_spills(tmp_path):
    """FA3's order with FLASHTILE_BWD_MASK_EDGES_ONLY, FLASHTILE_BWD_DQ_WAIT_AT_DS, FLASHTILE_BWD_NAMED_RELEASE and
    FLASHTILE_BWD_DQ_SEND_LATE at 0 (every pair masked, the dQ buffer freed by a barrier of its own, the stages
    released by an mbarrier, each dQ share sent in its own step: the A/B runs' baselines) builds for sm_90a at
    d = 128 and at d = 64 causal with 128 query rows: asynchronous wgmmas, no spills."""
    report = gluon_sm90_report(KEYS_M_EVERY_PAIR_COMPILE, tmp_path, timeout=600)
    assert len(report["records"]) == 3
    assert_async_without_spills(report["records"])


KEYS_M_DEFAULT_SYNC_COMPILE = """
import os
# the defaults, whatever the calling environment (gpu_run.sh's A/B phases run the tests with a switch at 0)
os.environ["FLASHTILE_BWD_DQ_WAIT_AT_DS"] = "1"  # both read when gluon_backward is imported, below
os.environ["FLASHTILE_BWD_NAMED_RELEASE"] = "1"
os.environ["FLASHTILE_BWD_DQ_SEND_LATE"] = "1"
""" + KEYS_M_BUILD + """
assert gb._DQ_WAIT_AT_DS and gb._NAMED_RELEASE and gb._DQ_SEND_LATE
# the bulk wait's own inline assembly (the buffer's last reduction: the latest issued, with one buffer at d = 64 or,
# at d = 128, sent a step late), the named releases, the bulk reductions
SYNC_COUNTS = {"own_bulk_waits": "cp.async.bulk.wait_group.read 0; mov.u32", "named_arrivals": "bar.arrive %r",
               "named_waits": "bar.sync %r", "reductions": "cp.reduce.async.bulk"}
records = [build(d, causal, tiles=tiles, ptx_counts=SYNC_COUNTS)
           for d, tiles in ((128, None), (64, (128, 128, 2, 8))) for causal in (False, True)]
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_fa3_order_default_waits_compile_without_spills(tmp_path):
    """FA3's order by default builds for sm_90a at d = 128 and at d = 64 with 128 query rows with the dQ buffer's
    last reduction waited for before dSᵀ's barrier (FLASHTILE_BWD_DQ_WAIT_AT_DS=1: a bulk wait of its own, without the
    barrier Gluon's store_wait brings; none left pending: at d = 64 one dQ buffer, at d = 128 two whose shares go out
    a step late, FLASHTILE_BWD_DQ_SEND_LATE=1) and, at d = 128 only, the ring stages released by named barriers
    (FLASHTILE_BWD_NAMED_RELEASE=1: the consumer's bar.arrive, the producer's bar.sync of 288 threads):
    asynchronous wgmmas, no spills (the late sends' two-step turns included)."""
    report = gluon_sm90_report(KEYS_M_DEFAULT_SYNC_COMPILE, tmp_path, timeout=600)
    assert len(report["records"]) == 4
    assert_async_without_spills(report["records"])
    for record in report["records"]:
        assert record["own_bulk_waits"] >= 1, record
        named = record["d"] == 128
        assert (record["named_arrivals"] >= 1 and record["named_waits"] >= 1) == named, record
        assert (record["named_arrivals"] + record["named_waits"] == 0) == (not named), record
        if named:  # the late sends: the turn's two steps and the odd step's copy, each with its bulk wait and the
            # step before's reduction, then the last share's reduction after the loop
            assert record["own_bulk_waits"] == 3 and record["reductions"] == 4, record


def test_gluon_backward_pipelined_needs_two_stages():
    """One stage would let the pipelined passes' deferred product read a stage the next tile is loading into
    (and wait on a load not yet issued): refused before any launch."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashtile.kernels import gluon_backward

    q = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2 stages"):
        gluon_backward.gluon_attention_backward(q, q, q, q, q, torch.zeros(1, 2, 64), pipelined=True,
                                                dkdv_tiles=(64, 128, 1, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("outlier", [1.0, 64.0], ids=["plain", "outlier-v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen", [65536, 131072], ids=["64k", "128k"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_one_pass_fixed_point_holds_the_rule_at_long_lengths(headdim, seqlen, causal, outlier, monkeypatch, capsys):
    """dQ in int32 counts of a per-row unit at 64k and 128k tokens, the backward flash_attn_func takes there: each
    count rounds, and a long row sums many of them, while the unit grows with the head's largest V row (one row
    made ``outlier`` times larger, which every later causal row sees). The rule (3x PyTorch's bf16 error) against a
    float64 oracle computed by blocks of query rows."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func
    from tests.utils import assert_rule, attention_grads_by_rows, max_err

    calls = []
    one_pass = gluon_backward.gluon_attention_backward
    monkeypatch.setattr(gluon_backward, "gluon_attention_backward",
                        lambda *args, **kwargs: calls.append(kwargs) or one_pass(*args, **kwargs))
    torch.manual_seed(stable_seed(seqlen, causal, outlier, headdim, "one-pass-long"))
    q, k, v = make_qkv(1, seqlen, seqlen, 2, 2, headdim, torch.bfloat16, "cuda", requires_grad=False)
    v[:, 5] *= outlier
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=causal)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    assert calls == [dict(one_pass="fixed", warp_specialize=True, pipelined=False, keys_as_m="fa3", grads=None)], calls
    want = attention_grads_by_rows(q, k, v, dout, causal, torch.float64)
    base = attention_grads_by_rows(q, k, v, dout, causal, torch.bfloat16)
    with capsys.disabled():
        print(f"\nd={headdim} {seqlen} causal={causal} outlier={outlier}: " + ", ".join(
            f"{name} {max_err(g, w):.2e} (torch {max_err(b, w):.2e})"
            for name, g, w, b in zip(("out", "dq", "dk", "dv"), got, want, base)))
    for name, g, w, b, factor in zip(("out", "dq", "dk", "dv"), got, want, base, (2.0, 3.0, 3.0, 3.0)):
        assert_rule(name, g, w, b, factor)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["none", "sampled", "unsampled", "nan"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_one_pass_checks_its_keys_against_the_sampled_bounds(headdim, causal, where, monkeypatch):
    """The dispatch's one pass makes dQ's units from K and V maxima guessed from a sample of the keys
    (``fixed_point.sampled_keys``); each program checks its keys and sets the flag on which dQ is recomputed
    (``backward.dq_where_flagged``). Random inputs pass (flag 0); a V row 200x the rest inside the sample raises the
    guess (flag 0); outside it the check fails (its KV head's flag 1, the others' 0), as it does for a NaN in K
    (which the causal rows well before it do not see: their dQ stays finite; rows whose last tile of keys holds it
    get 0 x NaN in dS K). The two KV heads 30x apart in size (each program checks against its own head's bounds),
    4,000 tokens (a last key block zero-filled past seqlen_k). The rule against float64 in every case but NaN's, and
    the same bits twice."""
    _gluon_backward()
    from flashtile import flash_attn_func
    from flashtile.kernels import backward, fixed_point
    from tests.utils import assert_rule, attention_grads_by_rows

    flags = []
    recompute = backward.dq_where_flagged
    monkeypatch.setattr(backward, "dq_where_flagged", lambda flag, *args: flags.append(flag) or recompute(flag, *args))
    torch.manual_seed(stable_seed(headdim, causal, where, "sampled-bounds"))
    seqlen = 4000
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, headdim, torch.bfloat16, "cuda", requires_grad=False)
    k[:, :, 1] *= 30.0
    v[:, :, 1] *= 30.0
    sample = set(fixed_point.sampled_keys(seqlen).tolist())
    key = {"sampled": 515, "unsampled": 2801, "nan": 2801}.get(where)
    if key is not None:
        assert (key in sample) == (where == "sampled")
        if where == "nan":
            k[1, key, 0, 3] = float("nan")
        else:
            v[1, key, 1] *= 200.0
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=causal)
    got = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    # (batch, KV head) flags: the outlier's (1, 1) and the NaN's (1, 0) alone
    expected = {"unsampled": [0, 0, 0, 1], "nan": [0, 0, 1, 0]}.get(where, [0, 0, 0, 0])
    assert len(flags) == 2 and all(f.tolist() == expected for f in flags), flags
    for a, b in zip(got, again):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    if where == "nan":
        if causal:  # rows before the NaN key: finite dQ
            assert torch.isfinite(got[0][1, :2048]).all() and got[0][1, key:].isnan().any()
        return
    want = attention_grads_by_rows(q, k, v, dout, causal, torch.float64)
    base = attention_grads_by_rows(q, k, v, dout, causal, torch.bfloat16)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want[1:], base[1:]):
        assert_rule(name, g, w, b, 3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("extra, heads_k", [((0, 0), 4), ((4, 131), 2)], ids=["mha", "gqa-ragged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_flash_attn_backward_takes_the_one_pass_where_it_is_faster(headdim, extra, heads_k, causal, monkeypatch,
                                                                     poison):
    """flash_attn_func's backward from ``configs.GLUON_BACKWARD_MIN_SEQLEN`` tokens (sm90: d = 128 from 2,048 tokens,
    d = 64 from 1,024 without a mask and 2,048 causal) is the Gluon one pass in fixed point with the keys
    as M in FA3's order (``configs.GLUON_BACKWARD_KEYS_AS_M``):
    the oracle rule (float32 oracle), the same bits twice; a token shorter, or with FLASHTILE_GLUON=0, the Triton two
    passes."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func
    from flashtile.kernels import configs

    calls = []
    one_pass = gluon_backward.gluon_attention_backward
    monkeypatch.setattr(gluon_backward, "gluon_attention_backward",
                        lambda *args, **kwargs: calls.append(kwargs) or one_pass(*args, **kwargs))
    skip_unless_gluon_dispatch()
    threshold = configs.GLUON_BACKWARD_MIN_SEQLEN[headdim, causal]
    seqlens = (threshold + extra[0], threshold + extra[1])
    torch.manual_seed(stable_seed(seqlens, heads_k, causal, headdim, "one-pass-dispatch"))
    q, k, v = make_qkv(1, *seqlens, 4, heads_k, headdim, torch.bfloat16, "cuda")

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return out, lse

    check_against_oracle(run, q, k, v, causal, oracle_dtype=torch.float32)
    keys_as_m = (headdim, causal) in configs.GLUON_BACKWARD_KEYS_AS_M
    assert calls == [dict(one_pass="fixed", warp_specialize=True, pipelined=not keys_as_m,
                          keys_as_m="fa3" if keys_as_m else False, grads=None)], calls
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=causal)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    calls.clear()
    short = [x.detach()[:, :threshold - 1].requires_grad_() for x in (q, k, v)]
    flash_attn_func(*short, causal=causal).sum().backward()
    monkeypatch.setenv("FLASHTILE_GLUON", "0")
    flash_attn_func(q, k, v, causal=causal).sum().backward()
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_flash_attn_backward_with_dropout_in_the_one_pass(headdim, causal, monkeypatch, poison):
    """With FLASHTILE_GLUON_DROPOUT=1 a dense backward with dropout takes the one pass in FA3's order, which
    regenerates the Triton forward's mask: gradients against the float64 oracle on the mask the kernels drew
    (S_dmask) by the 3x rule, two sequences (the kernel folds the batch's first counter into the seed), GQA, a length
    no tile divides; the same bits twice."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func
    from flashtile.kernels import configs
    from flashtile.reference import attention_ref
    from tests.utils import assert_rule

    calls = []
    one_pass = gluon_backward.gluon_attention_backward
    monkeypatch.setattr(gluon_backward, "gluon_attention_backward",
                        lambda *args, **kwargs: calls.append(kwargs) or one_pass(*args, **kwargs))
    monkeypatch.setenv("FLASHTILE_GLUON_DROPOUT", "1")
    skip_unless_gluon_dispatch()
    seqlen = configs.GLUON_BACKWARD_MIN_SEQLEN[headdim, causal] + 77
    torch.manual_seed(stable_seed(headdim, causal, "one-pass-dropout"))
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 2, headdim, torch.bfloat16, "cuda")
    dropout_p = 0.17
    torch.manual_seed(3)
    out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, return_attn_probs=True)
    keep = s_dmask >= 0
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert [call.get("dropout_p") for call in calls] == [dropout_p], calls
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out_ref, _ = attention_ref(*leaves, causal=causal, dropout_mask=keep, dropout_p=dropout_p)
    plain = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out_pt, _ = attention_ref(*plain, causal=causal, dropout_mask=keep, dropout_p=dropout_p)
    assert_rule("out", out, out_ref, out_pt, 2.0)
    want = torch.autograd.grad(out_ref, leaves, dout.double())
    base = torch.autograd.grad(out_pt, plain, dout)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert_rule(name, g, w, b, 3.0)
    torch.manual_seed(3)
    again = flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal)
    assert torch.equal(out, again), "the same seed, the same mask"
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(again, (q, k, v), dout)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(warp_specialize=True), "one-pass backward's"),
    (dict(one_pass="sum"), "one_pass"),
    (dict(one_pass="fixed", pipelined=True), "warp_specialize=True"),
    (dict(one_pass="fixed", dq_tiles=(128, 64, 2, 8)), "dq_tiles"),
    (dict(one_pass="fixed", dkdv_tiles=(32, 128, 2, 8)), "multiple of 64"),
    (dict(one_pass="fixed", dkdv_tiles=(64, 128, 2, 4)), "8 warps"),
    (dict(one_pass="fixed", warp_specialize=True, dkdv_tiles=(64, 128, 3, 8)), "227 KiB"),
    (dict(one_pass="fixed", warp_specialize=True, dropout_p=0.1), "dropout_p"),
    (dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", dropout_p=1.0), "dropout_p"),
], ids=["ws-alone", "mode", "pipelined", "dq-tiles", "rows", "warps", "shared-memory", "dropout-order", "dropout-1"])
def test_gluon_one_pass_refuses_what_it_cannot_run(kwargs, match):
    """Refused before any launch, naming the argument: modes and tiles the one-pass kernel cannot take."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashtile.kernels import gluon_backward

    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        gluon_backward.gluon_attention_backward(q, q, q, q, q, torch.zeros(1, 2, 64), **kwargs)


TAIL_SPLIT_COMPILE = """
from flashtile.kernels import gluon_backward as gb
records = []
for d in (64, 128):
    q = torch.randn(2, 600, 4, d, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 333, 2, d, dtype=torch.bfloat16) for _ in range(2))
    gb.gluon_attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(2, 4, 600), False,
                                one_pass="fixed", warp_specialize=True, keys_as_m="fa3", split_sms=5)
    records.append(kernel_record(gb._gluon_bwd_dkdv, {"piece_stores": "st.global"}, d=d))
print(json.dumps({"records": records}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_gluon_tail_split_compiles_without_spills(tmp_path):
    """The one pass in FA3's order with its last wave split (``split_sms``; 12 blocks on 5 multiprocessors: 10 whole,
    2 in two pieces) builds for sm_90a at d = 64 and 128: the pieces' float32 stores, asynchronous wgmmas, no
    spills."""
    report = gluon_sm90_report(TAIL_SPLIT_COMPILE, tmp_path, timeout=600)
    assert len(report["records"]) == 2
    assert_async_without_spills(report["records"])
    for record in report["records"]:
        assert record["piece_stores"] > 0, record


@pytest.mark.parametrize("units, multiprocessors, query_tiles, plan", [
    (2048, 132, 32, (1980, 3)),  # d = 128 in the harness's shapes: 68 blocks alone in the 16th wave
    (4096, 132, 32, (4092, 5)),  # d = 64: 4 blocks alone in the 32nd
    (64, 132, 64, (0, 2)),  # fewer blocks than multiprocessors: every block in two halves
    (264, 132, 32, (264, 1)),  # whole waves
    (2048, 132, 3, (2048, 1)),  # too few query tiles for pieces of two
    (2048, 0, 32, (2048, 1)),  # no multiprocessors given: no split
])
def test_tail_plan_splits_the_partial_wave_only(units, multiprocessors, query_tiles, plan):
    """``tail_plan``: (whole blocks, pieces per remaining block), where the split ends the grid at least a fifth of a
    block's time sooner on a greedy schedule."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashtile.kernels import gluon_backward

    assert gluon_backward.tail_plan(units, multiprocessors, query_tiles) == plan


def test_merge_tail_pieces_sums_each_block_in_piece_order():
    """``_merge_tail_pieces`` (Triton; the interpreter on CPU): each split block's dK and dV are the float32 sum of its
    pieces in piece order, rounded to the gradients' dtype, written at its (batch, keys, KV head) and nowhere else,
    rows past seqlen_k dropped."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashtile.kernels import gluon_backward

    torch.manual_seed(stable_seed("merge-tail-pieces"))
    batch, seqlen_k, heads_k, d, block_n, parts = 2, 300, 3, 32, 128, 3
    n_blocks = -(-seqlen_k // block_n)
    units = n_blocks * batch * heads_k
    n_whole = units - 4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pieces = torch.randn(4 * parts, 2, block_n, d, device=device)
    # (float16: the interpreter rounds to bfloat16 otherwise than the GPU, docs of triton-on-this-setup)
    dk = torch.full((batch, seqlen_k, heads_k, d), 7.0, dtype=torch.float16, device=device)
    # dv: every other head of a (seqlen_k, batch, ...) tensor, strides unlike dk's
    packed = torch.full((seqlen_k, batch, 2 * heads_k, d), 7.0, dtype=torch.float16, device=device)
    dv = packed.transpose(0, 1)[:, :, 1::2]
    gluon_backward._merge_tail_pieces[(4, 2, block_n // 32)](
        pieces, dk, dv, n_whole, parts, n_blocks, heads_k, seqlen_k, *dk.stride()[:3], *dv.stride()[:3],
        BLOCK_N=block_n, HEAD_DIM=d, ROWS=32)
    want_k, want_v = torch.full_like(dk, 7.0), dv.clone().fill_(7.0)
    for split in range(4):
        unit = n_whole + split
        bh, block = divmod(unit, n_blocks)
        b, head = divmod(bh, heads_k)
        keys = slice(block * block_n, min((block + 1) * block_n, seqlen_k))
        rows = keys.stop - keys.start
        for which, want in ((0, want_k), (1, want_v)):
            total = pieces[split * parts, which].clone()
            for j in range(1, parts):
                total += pieces[split * parts + j, which]
            want[b, keys, head] = total[:rows].to(torch.float16)
    assert torch.equal(dk, want_k) and torch.equal(dv, want_v)
    assert (packed[:, :, 0::2] == 7.0).all()  # the view's neighbours untouched


@pytest.mark.gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["plain", "dropout"])
@pytest.mark.parametrize("headdim", [64, 128], ids=lambda d: f"d{d}")
def test_gluon_one_pass_tail_split_moves_no_dq_bit(headdim, dropout_p):
    """The one pass with its last wave split (``tail_plan`` for 6, 13 and 30 multiprocessors) against the same call
    whole: dQ's fixed-point sums take the same pairs, so the same bits; dK and dV differ only by the order of their
    float32 sums (within a 16-bit rounding); each split gives the same bits every run."""
    gluon_backward = _gluon_backward()
    from flashtile import flash_attn_func

    torch.manual_seed(stable_seed(headdim, dropout_p, "tail-split"))
    q, k, v = make_qkv(2, 1500, 1300, 8, 2, headdim, torch.bfloat16, "cuda", requires_grad=False)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn_like(q)
    kwargs = dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", dropout_p=dropout_p, dropout_seed=11)
    whole = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, False, split_sms=0, **kwargs)
    units = -(-1300 // 128) * 2 * 2
    for sms in (6, 13, 30):  # (44 blocks: 2 in thirds, 5 in halves, 14 in halves)
        tiles = (gluon_backward.KEYS_AS_M_DROPOUT_TILES if dropout_p else gluon_backward.KEYS_AS_M_TILES)[headdim]
        assert gluon_backward.tail_plan(units, sms, -(-1500 // tiles[0]))[1] > 1
        split = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, False, split_sms=sms, **kwargs)
        assert torch.equal(split[0], whole[0])
        for got, want in zip(split[1:], whole[1:]):
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
        again = gluon_backward.gluon_attention_backward(dout, q, k, v, out, lse, False, split_sms=sms, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(split, again))
