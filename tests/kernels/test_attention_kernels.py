"""Triton kernels against the float64 oracle: on CPU through the interpreter, on CUDA when present.

fp16 only here: bf16 arithmetic is wrong inside the interpreter (bf16 runs in tests/kernels/test_gpu.py).
"""

import pytest
import torch

from flashtile import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from tests.utils import check_against_oracle, covering, make_qkv, random_cu_seqlens, stable_seed
from tests.variant_cases import check_dropout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]
HEADDIMS = [16, 40, 64, 96, 111, 128]
SEQLENS = [(1, 1), (1, 17), (17, 1), (113, 203), (128, 217), (256, 128)]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


def _flash(causal, softmax_scale=None):
    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True)
        return out, lse

    return run


@pytest.mark.parametrize(("headdim", "seqlens", "causal", "heads"), covering(
    HEADDIMS, SEQLENS, [False, True], list(HEADS),
    ids=lambda d, s, c, h: f"d{d}-sq{s[0]}-sk{s[1]}-{'causal' if c else 'full'}-{h}"))
def test_forward_backward(headdim, seqlens, causal, heads, poison):
    """Every head dim, length pair, mask and head grouping; without a GPU (and --slow) the 36 cases that
    meet each head dim with each length pair and with each mask and grouping."""
    torch.manual_seed(stable_seed(headdim, seqlens, causal, heads))  # heads is a str: hash() varied per run
    nheads, nheads_k = HEADS[heads]
    batch = 2 if seqlens[0] * seqlens[1] <= 128 * 256 else 1
    q, k, v = make_qkv(batch, *seqlens, nheads, nheads_k, headdim, torch.float16, DEVICE)
    check_against_oracle(_flash(causal), q, k, v, causal)


def test_softmax_scale_and_large_logits(poison):
    torch.manual_seed(1)
    q, k, v = make_qkv(1, 70, 90, 2, 1, 32, torch.float16, DEVICE)
    check_against_oracle(_flash(True, softmax_scale=0.9), q, k, v, True, softmax_scale=0.9)


def test_packed_variants(poison):
    torch.manual_seed(2)
    qkv = torch.randn(2, 45, 3, 2, 32, dtype=torch.float16, device=DEVICE, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(2))
    check_against_oracle(_flash(True), q, k, v, True)
    ref = flash_attn_func(*(x.detach() for x in qkv.unbind(2)), causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and not torch.isnan(qkv.grad).any()

    q = torch.randn(2, 33, 4, 40, dtype=torch.float16, device=DEVICE)
    kv = torch.randn(2, 50, 2, 2, 40, dtype=torch.float16, device=DEVICE)
    out_kv = flash_attn_kvpacked_func(q, kv)
    assert torch.equal(out_kv, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1]))


def test_strided_inputs_and_dout(poison):
    """Non-contiguous q/k/v (last dim contiguous) and a transposed dout give the contiguous answer."""
    torch.manual_seed(3)
    base = torch.randn(2, 4, 60, 48, dtype=torch.float16, device=DEVICE)  # BHSD storage
    q = base.transpose(1, 2).requires_grad_()  # BSHD view with permuted strides
    k = torch.randn(2, 70, 8, 48, dtype=torch.float16, device=DEVICE)[:, :, ::4].requires_grad_()
    v = torch.randn(2, 70, 2, 48, dtype=torch.float16, device=DEVICE).requires_grad_()
    out = flash_attn_func(q, k, v, causal=True)
    dout = torch.randn(2, 4, 60, 48, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qc, kc, vc = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    out_c = flash_attn_func(qc, kc, vc, causal=True)
    grads_c = torch.autograd.grad(out_c, (qc, kc, vc), dout.contiguous())
    assert torch.equal(out, out_c)
    for g, gc in zip(grads, grads_c):
        assert torch.equal(g, gc)


@pytest.mark.parametrize(("seqlens", "heads", "variant"), [
    ((1, 300), "gqa", dict(causal=True)),
    ((1, 257), "mha", dict(causal=False)),
    ((3, 200), "mqa", dict(causal=True, window_size=(250, 0))),
    ((2, 150), "gqa", dict(causal=False, softcap=2.0)),
    ((1, 190), "mha", dict(causal=True, alibi_slopes=True)),
    ((1, 220), "gqa", dict(causal=True, sink=True)),
    ((40, 30), "mha", dict(causal=True)),  # rows that see no key
    ((60, 300), "mha", dict(causal=False)),  # several query blocks
], ids=["decode-gqa", "decode-mha", "q3-window-mqa", "q2-softcap-gqa", "decode-alibi", "decode-sink",
        "q40-k30-causal", "q60-blocks"])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_dense_split_kv(seqlens, heads, variant, num_splits, monkeypatch, poison):
    """A dense call with few queries over many keys splits the keys (configs.split_count; forced here, since
    off a GPU it never splits): out, lse and gradients pass the oracle's rule, with keys laid out as a
    Hugging Face dynamic cache's (a BHSD tensor seen as BSHD)."""
    from flashtile.kernels import configs

    asked = []
    monkeypatch.setattr(configs, "split_count", lambda *args: asked.append(args) or num_splits)
    torch.manual_seed(stable_seed(seqlens, heads, num_splits, *variant))
    nheads, nheads_k = HEADS[heads]
    q, k, v = make_qkv(2, *seqlens, nheads, nheads_k, 32, torch.float16, DEVICE)
    k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (k, v))
    variant = dict(variant)
    if variant.pop("alibi_slopes", False):
        variant["alibi_slopes"] = torch.rand(nheads, device=DEVICE) * 0.3
    if variant.pop("sink", False):
        variant["sink"] = torch.randn(nheads, device=DEVICE)
    causal = variant.pop("causal")

    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **variant)
        return out, lse

    check_against_oracle(run, q, k, v, causal, **variant)
    assert asked, "the dense forward did not ask for a split count"


def test_dense_split_kv_only_for_few_queries_and_whole_windows(monkeypatch):
    """Dense calls ask for splits only with few query rows per program (decoding) and no window that sees
    fewer keys than there are (the splits would cut all keys: most of them empty)."""
    from flashtile.kernels import configs

    asked = []
    monkeypatch.setattr(configs, "split_count", lambda *args: asked.append(args) or 1)
    q, k, v = make_qkv(1, 1, 300, 4, 1, 32, torch.float16, DEVICE, requires_grad=False)
    flash_attn_func(q, k, v, causal=True, window_size=(100, 0))
    assert not asked
    flash_attn_func(*make_qkv(1, 65, 300, 4, 4, 32, torch.float16, DEVICE, requires_grad=False))
    assert not asked  # 65 query rows
    flash_attn_func(q, k, v, causal=True, window_size=(400, 0))
    flash_attn_func(q, k, v, dropout_p=0.0)
    assert len(asked) == 2


def test_split_count(monkeypatch):
    """configs.split_count: programs within two per multiprocessor, at least 512 keys a split, at most 64,
    GQA heads packed when the queries are few; 1 off CUDA devices."""
    from flashtile.kernels import configs

    monkeypatch.setattr(configs, "multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert configs.split_count(torch.device("cpu"), 8, 32, 8, 1, 4096, False) == 1
    assert configs.split_count(cuda, 8, 32, 8, 1, 1023, False) == 1
    assert configs.split_count(cuda, 8, 32, 8, 1, 4097, False) == 4  # 64 programs (GQA packed): 264 // 64
    assert configs.split_count(cuda, 8, 32, 8, 1, 4097, True) == 1  # per-head state: 256 programs
    assert configs.split_count(cuda, 1, 32, 8, 1, 32769, False) == 33  # 8 programs: 264 // 8
    assert configs.split_count(cuda, 1, 8, 8, 1, 1 << 20, False) == 33
    assert configs.split_count(cuda, 1, 1, 1, 1, 1 << 20, False) == 64
    assert configs.split_count(cuda, 64, 32, 8, 1, 2049, False) == 1


def test_backward_is_deterministic():
    torch.manual_seed(4)
    q, k, v = make_qkv(1, 77, 130, 4, 1, 40, torch.float16, DEVICE)
    dout = torch.randn_like(q)
    runs = [torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), dout) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("variant", [dict(causal=False), dict(causal=True, softcap=3.0),
                                     dict(causal=False, window_size=(20, 5)), dict(causal=True, dropout_p=0.3)],
                         ids=["full", "causal-softcap", "window", "causal-dropout"])
def test_large_head_dim_kv_grads_in_two_launches(variant, poison):
    """d > 128: dV and dK come from two launches (dV alone, then dK alone), each recomputing the scores,
    the probabilities and (with dropout) the mask: both within the oracle's bounds, dropout against the
    mask the forward drew."""
    torch.manual_seed(9)
    if "dropout_p" in variant:
        check_dropout(DTYPES[0], DEVICE, variant["causal"], dropout_p=variant["dropout_p"], headdim=160,
                      keep_fraction=False)  # the kernels' keep fraction: test_variant_kernels.test_dropout
        return
    q, k, v = make_qkv(2, 70, 90, 4, 2, 160, torch.float16, DEVICE)
    extra = {name: value for name, value in variant.items() if name != "causal"}
    check_against_oracle(lambda *t: flash_attn_func(*t, **variant, return_attn_probs=True)[:2], q, k, v,
                         variant["causal"], **extra)


@pytest.mark.parametrize("section_mb", ["0", "0.02", "1000"], ids=["head-by-head", "sections-4-1", "one-section"])
def test_causal_schedule_sections(section_mb, monkeypatch, poison):
    """Longest-first order over sections of heads, a short last section included (5 heads of 2*40*32*2
    bytes of K/V each in 0.02 MB: sections of 4 and 1), against the oracle."""
    monkeypatch.setenv("FLASHTILE_L2_SECTION_MB", section_mb)
    torch.manual_seed(3)
    q, k, v = make_qkv(1, 37, 40, 5, 5, 32, torch.float16, DEVICE)
    check_against_oracle(_flash(True), q, k, v, True)


def test_flat_grid_limit_is_a_clear_error():
    """Blocks x (sequence, head) pairs share one grid axis: past 2**31 - 1 programs, a ValueError."""
    from flashtile.kernels import configs

    assert configs.flat_programs(2**15, 2**15) == 2**30
    with pytest.raises(ValueError, match="split the batch"):
        configs.flat_programs(2**16, 2**15 + 1)


@pytest.mark.parametrize(("causal", "headdim"), [
    pytest.param(causal, headdim, id=f"{'causal' if causal else 'full'}-{headdim}",
                 marks=() if (causal, headdim) in ((True, 40), (False, 64)) else pytest.mark.slow)
    for causal in (False, True) for headdim in (64, 40)])
def test_tma_descriptor_path(causal, headdim, monkeypatch, poison):
    """The TMA-descriptor loads (Hopper's copy engine; emulated by the interpreter on CPU) through
    descriptors made on the host over the whole batch, in the forward and both backward passes: two
    sequences, a head dim below the tile's zero-filled width, GQA, a ragged last tile."""
    monkeypatch.setenv("FLASHTILE_TMA", "1")
    torch.manual_seed(4)
    q, k, v = make_qkv(2, 113, 203, 4, 2, headdim, torch.float16, DEVICE)
    check_against_oracle(_flash(causal), q, k, v, causal)


def test_tma_descriptor_path_broadcast_keys(monkeypatch):
    """Keys and values broadcast over the batch (stride 0) keep the descriptors made in the kernel (forward
    and dQ pass) and give what their materialized copies give, gradients included."""
    monkeypatch.setenv("FLASHTILE_TMA", "1")
    torch.manual_seed(6)
    q = torch.randn(3, 50, 4, 64, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k0, v0 = (torch.randn(1, 70, 2, 64, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(2))
    dout = torch.randn(3, 50, 4, 64, dtype=torch.float16, device=DEVICE)
    results = []
    for materialize in (False, True):
        k, v = (t.expand(3, -1, -1, -1) for t in (k0, v0))
        if materialize:
            k, v = k.contiguous(), v.contiguous()
        out = flash_attn_func(q, k, v, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k0, v0), dout)))
    for broadcast, materialized in zip(*results):
        torch.testing.assert_close(broadcast, materialized, atol=0, rtol=0)


def test_tma_descriptor_path_varlen(monkeypatch, poison):
    """Packed sequences keep the descriptors made in the kernel, one per (sequence, head), in the forward
    and both backward passes."""
    monkeypatch.setenv("FLASHTILE_TMA", "1")
    torch.manual_seed(5)
    lengths_q, lengths_k = [40, 77], [90, 33]
    cu_q, cu_k = random_cu_seqlens(lengths_q, DEVICE), random_cu_seqlens(lengths_k, DEVICE)
    q = torch.randn(sum(lengths_q), 4, 64, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), 2, 64, dtype=torch.float16, device=DEVICE, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for i in range(2):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ref = flash_attn_func(q[rows][None], k[keys][None], v[keys][None], causal=True)[0]
        torch.testing.assert_close(out[rows], ref, atol=2e-3, rtol=0)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout[rows])
        for grad, ref_grad, part in zip(grads, ref_grads, (rows, keys, keys)):
            torch.testing.assert_close(grad[part], ref_grad[part], atol=4e-3, rtol=0)


@pytest.mark.parametrize(("headdim", "case"), [
    pytest.param(headdim, case, id=f"{headdim}-{case}",
                 marks=() if (headdim, case) in ((64, "full"), (128, "causal"), (128, "window_alibi_softcap"))
                 else pytest.mark.slow)
    for headdim in (64, 128) for case in ("causal", "window_alibi_softcap", "full")])
def test_early_dp_changes_no_bit(headdim, case, monkeypatch):
    """``FLASHTILE_BWD_OVERLAP`` (dP issued before P's exponentials, the default for 64 < d <= 128) only
    reorders the same operations: gradients are bitwise the same with it forced off and on, at d=64 and
    d=128 (without a GPU each mask once and each head dim, unless --slow)."""
    torch.manual_seed(8)
    variant = {"window_alibi_softcap": {"window_size": (40, 10), "softcap": 4.0,
                                        "alibi_slopes": torch.rand(4, device=DEVICE)}}.get(case, {})
    q, k, v = make_qkv(2, 113, 150, 4, 2, headdim, torch.float16, DEVICE)
    dout = torch.randn_like(q)

    def run(early_dp):
        monkeypatch.setenv("FLASHTILE_BWD_OVERLAP", early_dp)
        out = flash_attn_func(q, k, v, causal=case == "causal", **variant)
        return torch.autograd.grad(out, (q, k, v), dout)

    for got, want in zip(run("1"), run("0")):
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["causal-d40", "window_alibi_softcap", "varlen", "block_sparse"])
def test_row_stats_in_the_dq_pass_match_the_preprocess(case, monkeypatch, poison):
    """A small backward has its dQ pass make the rows' delta and lse₂ (``ROW_STATS``) for the dK/dV pass after it; a
    large one (and FP8) has the preprocess kernel make them. The gradients agree: bitwise in the interpreter,
    within rounding of delta's sum on a GPU. Ragged lengths (rows past seqlen_q in the last tiles), ALiBi (those
    rows' lse₂ read as +inf), packed sequences with an empty one, a block mask, a head dim that is not a power of
    two (O's tile masked by columns)."""
    from flashtile import block_sparse_attn_func, local_global_block_mask
    from flashtile.kernels import backward

    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")  # each call takes the path its switch says
    preprocessed_calls = []
    real_preprocess = backward.preprocess
    monkeypatch.setattr(backward, "preprocess", lambda *a, **kw: (preprocessed_calls.append(1),
                                                                   real_preprocess(*a, **kw))[1])
    torch.manual_seed(stable_seed(case, "row-stats"))
    headdim = 40 if case == "causal-d40" else 64
    if case == "varlen":
        cu = torch.tensor([0, 37, 37, 130], dtype=torch.int32, device=DEVICE)
        q, k, v = (torch.randn(130, 4, 64, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))

        def call():
            return flash_attn_varlen_func(q, k, v, cu, cu, 93, 93, causal=True)
    elif case == "block_sparse":
        q, k, v = make_qkv(1, 256, 256, 2, 2, 64, torch.float16, DEVICE)
        mask = local_global_block_mask(256, 256, 1, 1, causal=True).to(DEVICE)

        def call():
            return block_sparse_attn_func(q, k, v, mask, causal=True)
    else:
        variant = {"window_alibi_softcap": {"window_size": (40, 10), "softcap": 4.0,
                                            "alibi_slopes": torch.rand(4, device=DEVICE)}}.get(case, {})
        q, k, v = make_qkv(2, 113, 150, 4, 2, headdim, torch.float16, DEVICE)

        def call():
            return flash_attn_func(q, k, v, causal=case != "window_alibi_softcap", **variant)
    dout = torch.randn_like(q)
    in_dq_pass = torch.autograd.grad(call(), (q, k, v), dout)
    assert not preprocessed_calls
    monkeypatch.setattr(backward, "_stats_in_dq_pass", lambda large, fp8: False)
    preprocessed = torch.autograd.grad(call(), (q, k, v), dout)
    assert preprocessed_calls
    for got, want in zip(in_dq_pass, preprocessed):
        assert not got.isnan().any()
        if DEVICE == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_first_calls_of_two_keys_in_two_threads_keep_their_own_tiles(monkeypatch):
    """A key's tile choice is read back after its first launch, which releases the GIL (and may compile
    for seconds): a second thread's first call of another key must not slip its choice in between."""
    import threading
    import time

    import triton

    from flashtile.kernels import configs

    class Autotuned:  # the parts of triton.autotune's object that configs.launch touches
        def __init__(self):
            self.best_config = None
            self.fn = self

        def __getitem__(self, grid):
            def first_call(*args, **kwargs):
                self.best_config = triton.Config({"BLOCK": args[1]}, num_warps=4)
                time.sleep(0.3)  # the launch (and compile) with the GIL released

            return first_call

        def run(self, *args, grid, warmup, **kwargs):
            pass

    kernel = Autotuned()
    monkeypatch.setattr(configs, "_CHOSEN", {})
    q = torch.empty(1)

    def call(block, delay):
        time.sleep(delay)
        configs.launch(kernel, None, q, block, 1, 1, HEAD_DIM=block)  # q first, the two buckets last

    threads = [threading.Thread(target=call, args=(256, 0.0)), threading.Thread(target=call, args=(32, 0.1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    chosen = {key[-1][1]: config.kwargs["BLOCK"] for key, config in configs._CHOSEN.items()}
    assert chosen == {256: 256, 32: 32}


def test_tiles_used_names_each_kernels_latest_tiles():
    """What the benchmark records per flashtile row: the tiles of the forward, dK/dV and dQ launches."""
    from flashtile.kernels import configs

    q, k, v = make_qkv(1, 33, 33, 2, 2, 64, torch.float16, DEVICE)
    assert configs.tiles_used(reset=True) == {}
    flash_attn_func(q, k, v, causal=True).sum().backward()
    used = configs.tiles_used()
    assert set(used) == {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"}
    assert all("BLOCK_M=" in tiles and "warps=" in tiles and "stages=" in tiles for tiles in used.values())


def test_tile_candidates_may_cap_registers(monkeypatch):
    """A fifth candidate element is the cap on registers per thread (Triton's ``maxnreg``): it reaches the
    config, tells capped and uncapped entries of the same tile apart, and shows in ``tiles_used``."""
    from flashtile.kernels import backward, configs

    names = configs._BWD_KV_NAMES
    capped, plain = configs._config((64, 32, 4, 3, 128), names), configs._config((64, 32, 4, 3), names)
    assert capped.kwargs == plain.kwargs == {"BLOCK_N": 64, "BLOCK_M": 32}
    assert (capped.maxnreg, plain.maxnreg) == (128, None)
    assert configs._matches(capped, (64, 32, 4, 3, 128), names) and not configs._matches(capped, (64, 32, 4, 3), names)
    assert configs._matches(plain, (64, 32, 4, 3), names) and not configs._matches(plain, (64, 32, 4, 3, 128), names)
    key = ("dK/dV", "test")
    monkeypatch.setattr(configs, "_LAST_KEY", {(backward._attn_bwd_dkdv, 3): key})
    monkeypatch.setattr(configs, "_CHOSEN", {key: capped})
    assert configs.tiles_used() == {"_attn_bwd_dkdv": "BLOCK_N=64 BLOCK_M=32 warps=4 stages=3 maxnreg=128"}


@pytest.mark.parametrize(("autotune", "store", "kept"), [("1", "1", True), ("1", "0", False), ("compile", "1", False)])
def test_autotune_choices_are_stored_unless_untimed_or_turned_off(autotune, store, kept, monkeypatch):
    """Triton keeps a timed choice on disk for later processes; not an untimed one (compile-only runs)
    nor with ``FLASHTILE_AUTOTUNE_CACHE=0`` (the test suite's setting: its workers tune side by side)."""
    from flashtile.kernels import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", autotune)
    monkeypatch.setenv("FLASHTILE_AUTOTUNE_CACHE", store)

    class Autotuned:
        cache_results = None

    kernel = Autotuned()
    configs.keep_choices_on_disk(kernel)
    assert kernel.cache_results is kept
