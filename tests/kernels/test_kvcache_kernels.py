"""flash_attn_with_kvcache through the Triton kernels (interpreter fp16 on CPU; fp16 and bf16 on a GPU)."""

import pytest
import torch

from tests.kvcache_cases import (
    CASES,
    LAYOUT_CASES,
    check_cache_lengths,
    check_expanded_cache,
    check_kvcache,
    check_overlapping_appends,
    check_paged_matches_contiguous,
    check_split_kv_matches_unsplit,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


@pytest.fixture(autouse=True)
def _triton(backend):
    backend("triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-q{c[1]}-new{c[2]}-causal{c[6]}-rot{c[8]}")
def test_kvcache_kernels(case, dtype):
    check_kvcache(case, dtype, DEVICE)


@pytest.mark.parametrize("layout", ["heads-first", "sliced", "kv-interleaved", "mixed"])
@pytest.mark.parametrize("case", LAYOUT_CASES,
                         ids=lambda c: f"b{c[0]}-q{c[1]}-new{c[2]}-idx{c[10]}-leftpad{c[11]}")
def test_kvcache_any_batch_stride(case, layout):
    check_kvcache(case, DTYPES[-1], DEVICE, layout)


def test_cache_expanded_over_its_batch_is_read_as_its_copy():
    check_expanded_cache(DTYPES[-1], DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [16, 32, 256])
def test_paged_cache_matches_contiguous(page_size, dtype):
    check_paged_matches_contiguous(page_size, dtype, DEVICE)


@pytest.mark.parametrize("form", ["int", "none", "strided", "paged"])
def test_contiguous_cache_lengths(form):
    check_cache_lengths(form, DTYPES[0], DEVICE)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_matches_unsplit(num_splits):
    check_split_kv_matches_unsplit(num_splits, DTYPES[0], DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("eager_first", [True, False], ids=["eager-first", "capture-first"])
def test_decode_cuda_graph_replay(eager_first):
    """A decoding step captured in a CUDA graph replays to the eager result on new inputs. After an eager
    call of the shape, the capture reads the cached index constants (no small index kernels in each
    replay); captured first, it builds its own and keeps none of them."""
    from flashtile import flash_attn_with_kvcache, inference

    batch, nheads, nheads_k, length, headdim = 3, 8, 2, 1000, 64
    q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(batch, length, nheads_k, headdim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor([1000, 1, 517], dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and autotune outside the capture
        inference._INDEX_CONSTANTS.clear()
        step()
        if not eager_first:
            inference._INDEX_CONSTANTS.clear()
    torch.cuda.current_stream().wait_stream(side)
    cached = dict(inference._INDEX_CONSTANTS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert inference._INDEX_CONSTANTS == cached  # nothing made during the capture is kept
    q.copy_(torch.randn_like(q))
    seqlens.copy_(torch.tensor([3, 999, 64], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())


@pytest.mark.parametrize("v_layout", ["rows", "positions-fastest"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_append_writes_only_valid_slots(paged, v_layout):
    """The append kernel writes each new token at its position and nothing for a position or page outside
    the cache (values the host checks, but that may change behind its back): no write lands elsewhere. The
    V cache in rows, or with unit stride over its rows (an FP8 cache from ``flashtile.fp8.zeros_cache``)."""
    from flashtile.kernels import append_kv

    batch, seqlen_new, nheads_k, headdim, row_len = 3, 2, 2, 40, 8
    dtype = DTYPES[0]
    k_new = torch.randn(batch, seqlen_new, nheads_k, headdim, dtype=dtype, device=DEVICE)
    v_new = torch.randn_like(k_new)
    # seqlens: sequence 0 fits, sequence 1 overflows after its first token, sequence 2 is negative.
    seqlens = torch.tensor([3, row_len - 1, -5], dtype=torch.int32, device=DEVICE)
    k_cache = torch.zeros(batch * row_len, nheads_k, headdim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    if v_layout != "rows":
        v_cache = torch.zeros(nheads_k, headdim, batch * row_len, dtype=dtype, device=DEVICE).permute(2, 0, 1)
    table = None
    if paged:  # pages of 4 rows; sequence 2's table points outside the pool
        table = torch.tensor([[0, 1], [2, 3], [7, -1]], dtype=torch.int32, device=DEVICE)
        k_cache, v_cache = k_cache[:16], v_cache[:16]
        seqlens[2] = 1
    append_kv(k_new, v_new, k_cache, v_cache, seqlens, None, table, 4 if paged else 0, row_len, row_len)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for b in range(batch):
        for t in range(seqlen_new):
            position = int(seqlens[b]) + t
            if not 0 <= position < row_len:
                continue
            if paged:
                page = int(table[b, position // 4])
                if not 0 <= page < 4:
                    continue
                row = page * 4 + position % 4
            else:
                row = b * row_len + position
            expected_k[row], expected_v[row] = k_new[b, t], v_new[b, t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_overlapping_appends_refused():
    check_overlapping_appends(DTYPES[0], DEVICE)


def _count_launches(monkeypatch) -> list:
    """The kernels launched from now on (autotuned and plain), in order, in the returned list."""
    from flashtile.kernels import configs

    launched = []
    launch, launch_plain = configs.launch, configs.launch_plain
    monkeypatch.setattr(configs, "launch", lambda kernel, *a, **kw: launched.append(kernel) or launch(kernel, *a, **kw))
    monkeypatch.setattr(configs, "launch_plain",
                        lambda kernel, *a, **kw: launched.append(kernel) or launch_plain(kernel, *a, **kw))
    return launched


# (batch, seqlen_q, seqlen_new, nheads_k, group, headdim, causal, num_splits, window_size, alibi, softcap)
FUSED_APPEND_CASES = [
    (2, 1, 1, 2, 4, 64, False, 0, (-1, -1), False, 0.0),  # a decoding step, GQA packed
    (3, 1, 2, 2, 2, 96, False, 5, (-1, -1), True, 2.0),  # split-KV, ALiBi, softcap
    (2, 5, 70, 2, 1, 64, True, 2, (-1, -1), False, 0.0),  # new keys over two tiles, split
    (2, 4, 4, 2, 2, 40, True, 3, (16, 0), False, 0.0),  # a window, split; odd head dim
    (2, 3, 3, 1, 4, 32, False, 2, (200, 7), False, 0.0),  # a left window past unmasked tiles, split
    (2, 150, 150, 2, 4, 32, True, 0, (-1, -1), False, 0.0),  # a prefill into the cache, heads not packed
]


@pytest.mark.parametrize("case", FUSED_APPEND_CASES,
                         ids=lambda c: f"b{c[0]}-q{c[1]}-new{c[2]}-g{c[4]}-d{c[5]}-causal{c[6]}-splits{c[7]}")
def test_fused_append_matches_the_append_kernel(case, monkeypatch):
    """``FLASHTILE_FUSED_APPEND``: the attention kernel reading the new keys from k and v and writing them into
    the cache itself gives the output, lse and caches of the append kernel and the attention, bit for bit (the
    same tiles in the same order), in one launch fewer. A sequence with an empty cache takes part."""
    from flashtile import flash_attn_with_kvcache, inference

    batch, seqlen_q, seqlen_new, nheads_k, group, headdim, causal, splits, window, alibi, softcap = case
    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")  # (the switch is no part of a plan's key: the ordinary path)
    capacity = 400
    dtype = DTYPES[0]
    k_cache = torch.randn(batch, capacity, nheads_k, headdim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, seqlen_q, nheads_k * group, headdim, dtype=dtype, device=DEVICE)
    k_new = torch.randn(batch, seqlen_new, nheads_k, headdim, dtype=dtype, device=DEVICE)
    v_new = torch.randn_like(k_new)
    seqlens = torch.randint(0, capacity - seqlen_new + 1, (batch,), dtype=torch.int32, device=DEVICE)
    seqlens[0] = 0
    seqlens[-1] = capacity - seqlen_new  # (a left window then skips the first tiles)
    slopes = torch.rand(nheads_k * group, device=DEVICE) if alibi else None
    launched = _count_launches(monkeypatch)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(inference, "FUSED_APPEND", fused)
        caches = k_cache.clone(), v_cache.clone()
        launched.clear()
        out, lse = flash_attn_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=seqlens.clone(), causal=causal,
                                           num_splits=splits, window_size=window, alibi_slopes=slopes,
                                           softcap=softcap, return_softmax_lse=True)
        results.append((out, lse, *caches, len(launched)))
    for unfused, fused in zip(results[0][:4], results[1][:4]):
        assert torch.equal(unfused, fused)
    assert results[1][4] == results[0][4] - 1


@pytest.mark.parametrize("layout,fuses", [("kv-interleaved", True), ("heads-first", False), ("sliced", False)])
def test_fused_append_over_strided_caches(layout, fuses, monkeypatch):
    """The fused append writes rows at the cache's length as its pitch: taken where the pitch is that (keys and
    values interleaved), left to the append kernel elsewhere (a transposed or sliced cache); the same bits."""
    from flashtile import flash_attn_with_kvcache, inference
    from tests.kvcache_cases import cache_pair

    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
    torch.manual_seed(5)
    k_cache, v_cache = cache_pair(layout, 3, 90, 2, 32, DTYPES[0], DEVICE)
    q = torch.randn(3, 2, 4, 32, dtype=DTYPES[0], device=DEVICE)
    k_new, v_new = (torch.randn(3, 2, 2, 32, dtype=DTYPES[0], device=DEVICE) for _ in range(2))
    seqlens = torch.tensor([0, 41, 88], dtype=torch.int32, device=DEVICE)
    launched = _count_launches(monkeypatch)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(inference, "FUSED_APPEND", fused)
        caches = cache_pair(layout, 3, 90, 2, 32, DTYPES[0], DEVICE)  # copies in the same layout
        for copy, original in zip(caches, (k_cache, v_cache)):
            copy.copy_(original)
        launched.clear()
        out = flash_attn_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=seqlens, causal=True, num_splits=2)
        results.append((out, *caches, len(launched)))
    for unfused, fused in zip(results[0][:3], results[1][:3]):
        assert torch.equal(unfused, fused)
    assert results[1][3] == results[0][3] - (1 if fuses else 0)


@pytest.mark.skipif(DEVICE != "cuda", reason="Inductor and CUDA graphs on a GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_decoding_step(mode):
    """A decoding step under torch.compile (Inductor; CUDA graphs with reduce-overhead), replayed over
    several steps: the caches and outputs equal the eager steps'."""
    from flashtile import flash_attn_with_kvcache

    torch._dynamo.reset()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    caches = [torch.randn(4, 64, 2, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    eager_caches = [c.clone() for c in caches]

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    seqlens = torch.tensor([3, 10, 20, 40], dtype=torch.int32, device=DEVICE)
    for _ in range(4):
        q = torch.randn(4, 1, 8, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(4, 1, 2, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        want = step(q, *eager_caches, k, v, seqlens)
        got = compiled(q, *caches, k, v, seqlens).clone()
        assert torch.equal(got, want)
        seqlens += 1
    for a, b in zip(caches, eager_caches):
        assert torch.equal(a, b)


@pytest.mark.skipif(DEVICE != "cuda", reason="Inductor on a GPU")
def test_compiled_decoding_layers_replay_plans(monkeypatch):
    """A compiled decoding step of three layers (one cache_seqlens tensor, unwritten within the step): the
    layers after the first replay the step's launch plan from the second step on, and every step's caches and
    outputs equal the eager steps'."""
    from flashtile import flash_attn_with_kvcache
    from flashtile.kernels import replay

    runs = []
    monkeypatch.setattr(replay.Plan, "run", lambda self, t, run=replay.Plan.run: runs.append(1) or run(self, t))
    torch._dynamo.reset()
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    caches = [torch.randn(4, 64, 2, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(6)]
    eager_caches = [c.clone() for c in caches]

    def step(q, seqlens, k, v, *layer_caches):
        outs = []
        for layer in range(3):
            outs.append(flash_attn_with_kvcache(q, layer_caches[2 * layer], layer_caches[2 * layer + 1], k, v,
                                                cache_seqlens=seqlens, causal=True))
        return torch.stack(outs)

    compiled = torch.compile(step, fullgraph=True)
    seqlens = torch.tensor([3, 10, 20, 40], dtype=torch.int32, device=DEVICE)
    for _ in range(4):
        q = torch.randn(4, 1, 8, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(4, 1, 2, 128, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")  # the eager reference: the ordinary path, no replays
        want = step(q, seqlens, k, v, *eager_caches)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "1")
        got = compiled(q, seqlens, k, v, *caches)
        assert torch.equal(got, want)
        seqlens += 1
    for a, b in zip(caches, eager_caches):
        assert torch.equal(a, b)
    assert runs, "no layer of the compiled steps replayed a plan"


@pytest.mark.parametrize("v_layout", ["rows", "positions-fastest"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_cache_append_quantizes_in_the_kernel(v_layout, dtype):
    """16-bit new tokens appended to an FP8 cache are quantized by the append kernel bit for bit as
    ``fp8.quantize_with`` (an IEEE division, saturation at ±448, round to nearest even), float8 ones written
    as they are, and the step attends to what was written, under a 16-bit q (no q_descale) or a float8 q.
    On a GPU the tokens span float8's whole range: subnormals, values past 448, infinities, signed zeros. The
    interpreter's float8 conversion flushes subnormals and misrounds values that round up into the next power
    of two, so on the CPU the tokens are float8 values times power-of-two descales: nothing to round."""
    from flashtile import flash_attn_with_kvcache, fp8

    batch, seqlen_new, length, nheads, nheads_k, headdim = 3, 5, 64, 8, 2, 64
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    shape = (batch, seqlen_new, nheads_k, headdim)
    signs = torch.randint(0, 2, shape, generator=gen, device=DEVICE) * 2 - 1
    if DEVICE == "cuda":
        k_descale, v_descale = (torch.rand(batch, nheads_k, generator=gen, device=DEVICE) + 0.05 for _ in range(2))
        # |x / descale| log-uniform over 2^-12 .. 2^10 (float8's subnormals start below 2^-6)
        scaled = torch.exp2(torch.rand(shape, generator=gen, device=DEVICE) * 22 - 12) * signs
        scaled.view(-1)[:4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0], device=DEVICE)
    else:
        k_descale, v_descale = (torch.exp2(torch.randint(-4, 1, (batch, nheads_k), generator=gen).float())
                                for _ in range(2))
        scaled = (torch.rand(shape, generator=gen) * 8 + 0.02).to(fp8.FP8_DTYPE).float() * signs
    k_new = (scaled * k_descale[:, None, :, None]).to(dtype)
    v_new = (scaled.flip(-1) * v_descale[:, None, :, None]).to(dtype)
    k_cache, v_cache = (torch.randn(batch, length, nheads_k, headdim, generator=gen, device=DEVICE).to(fp8.FP8_DTYPE)
                        for _ in range(2))
    if v_layout != "rows":
        v_cache = fp8.zeros_cache(*v_cache.shape, device=DEVICE)[1].copy_(v_cache)
    seqlens = torch.tensor([0, 17, length - seqlen_new], dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, seqlen_new, nheads, headdim, generator=gen, device=DEVICE).to(dtype)
    rows = torch.arange(batch, device=DEVICE)[:, None]
    positions = seqlens.long()[:, None] + torch.arange(seqlen_new, device=DEVICE)
    want_k, want_v = fp8.quantize_with(k_new, k_descale), fp8.quantize_with(v_new, v_descale)
    for q_kind in ("16-bit", "float8"):
        kc, vc = k_cache.clone(), v_cache.clone()
        if q_kind == "16-bit":
            scales, q_in, new = dict(k_descale=k_descale, v_descale=v_descale), q, (k_new, v_new)
        else:  # float8 q and float8 tokens, written as they are
            q_in, q_descale = fp8.quantize(q.float(), nheads_k)
            scales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_dtype=dtype)
            new = (want_k, want_v)
        out = flash_attn_with_kvcache(q_in, kc, vc, *new, cache_seqlens=seqlens, causal=True, **scales)
        assert out.dtype == dtype
        assert torch.equal(kc.view(torch.uint8)[rows, positions], want_k.view(torch.uint8)), q_kind
        assert torch.equal(vc.view(torch.uint8)[rows, positions], want_v.view(torch.uint8)), q_kind
        if DEVICE == "cuda":
            continue  # (the tokens' infinities saturate to 448 * descale: the output check needs finite scores)
        q_ref = q if q_kind == "16-bit" else fp8.dequantize(q_in, q_descale, dtype)
        ref = flash_attn_with_kvcache(q_ref, fp8.dequantize(kc, k_descale, dtype), fp8.dequantize(vc, v_descale, dtype),
                                      cache_seqlens=seqlens + seqlen_new, causal=True)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("index", [None, "paged", "batch_idx", "rotary"])
@pytest.mark.parametrize("value_checks", ["1", "0"])
def test_decoding_steps_take_their_plans_with_value_checks_on_or_off(value_checks, index, monkeypatch):
    """Steps of one key reach the launch-plan path after their first call, with FLASHTILE_VALUE_CHECKS on (the
    lengths tensor's values, and a paged pool's block table or the batch index, checked once and unwritten
    since) or off (nothing to check)."""
    from flashtile import _ops, flash_attn_with_kvcache

    monkeypatch.setenv("FLASHTILE_VALUE_CHECKS", value_checks)
    reached = []
    original = _ops.replayed_or_recorded
    monkeypatch.setattr(_ops, "replayed_or_recorded", lambda *a, **kw: reached.append(1) or original(*a, **kw))
    k_cache = torch.zeros(2, 32, 2, 16, dtype=DTYPES[0], device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    extra = {}
    if index == "paged":  # pages of 8 positions, the second sequence's first
        k_cache, v_cache = (c.view(8, 8, 2, 16) for c in (k_cache, v_cache))
        extra["block_table"] = torch.tensor([[4, 5, 6, 7], [0, 1, 2, 3]], dtype=torch.int32, device=DEVICE)
    if index == "batch_idx":
        extra["cache_batch_idx"] = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    if index == "rotary":
        angles = torch.rand(40, 4, device=DEVICE)
        extra.update(rotary_cos=angles.cos(), rotary_sin=angles.sin(), causal=True)
    q = torch.randn(2, 1, 4, 16, dtype=DTYPES[0], device=DEVICE)
    lengths = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    for _ in range(4):  # four layers of one step: the same lengths tensor, new tokens each
        new = torch.randn(2, 1, 2, 16, dtype=DTYPES[0], device=DEVICE)
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new.clone(), cache_seqlens=lengths, **extra)
    assert len(reached) == 3


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 4, 32, 16), (3, 1, 2, 40, 20), (1, 2, 3, 24, 8), (2, 2, 40, 16, 4),
                                   (1, 1, 2, 16, 0)],
                         ids=["full", "half-of-20", "quarter", "many-heads", "none"])
def test_rotary_kernel_matches_the_pytorch_rotation(shape, interleaved):
    """kernels.kvcache.rotate gives the bits of inference._rotate (float32, each product and difference rounded),
    positions by token or per sequence, past the table clamped to its last row; x a strided view (q's heads
    picked from a wider projection), tables of two dtypes, one transposed."""
    from flashtile.inference import _rotate
    from flashtile.kernels.kvcache import rotate

    batch, seqlen, heads, headdim, half = shape
    torch.manual_seed(sum(shape))
    x = torch.randn(batch, seqlen, heads + 3, headdim, dtype=DTYPES[-1], device=DEVICE)[:, :, 1:heads + 1]
    angles = torch.rand(12, half, device=DEVICE) * 6
    cos, sin = angles.cos().to(DTYPES[-1]), angles.sin().t().contiguous().t()  # fp16/fp32, row- and column-major
    seqlens = torch.tensor([3, 11, 0][:batch], dtype=torch.int32, device=DEVICE)
    for by_token in (True, False):
        positions = seqlens.long()[:, None] + (torch.arange(seqlen, device=DEVICE)[None, :] if by_token else 0)
        positions = positions.clamp(0, 11).expand(batch, seqlen)
        want = _rotate(x, cos[positions], sin[positions], interleaved)
        assert torch.equal(rotate(x, cos, sin, seqlens, by_token, interleaved), want), by_token


@pytest.mark.parametrize("entries", [(2**30, -5), (2**28 + 1, 1), (1, 7)])
def test_unchecked_batch_index_stays_inside_the_cache(entries, monkeypatch):
    """With value checks off, cache_batch_idx values outside the cache's entries (with an append) read and
    write inside it: the kernels clamp the entries and skip the rows outside, and the output is finite."""
    from flashtile import flash_attn_with_kvcache

    monkeypatch.setenv("FLASHTILE_VALUE_CHECKS", "0")
    k_cache, v_cache = (torch.randn(3, 24, 2, 16, dtype=DTYPES[0], device=DEVICE) for _ in range(2))
    q = torch.randn(2, 1, 4, 16, dtype=DTYPES[0], device=DEVICE)
    new = torch.randn(2, 1, 2, 16, dtype=DTYPES[0], device=DEVICE)
    rows = torch.tensor(entries, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, new, new.clone(), cache_batch_idx=rows,
                                  cache_seqlens=torch.tensor([5, 9], dtype=torch.int32, device=DEVICE))
    assert torch.isfinite(out).all()


def test_paged_pages_are_clamped_into_the_pool(monkeypatch):
    """With value checks off, a block table naming pages outside the pool reads pages inside it (clamped),
    never memory past the pool: the result is that of the table clamped on the host."""
    from flashtile import flash_attn_with_kvcache

    torch.manual_seed(9)
    pool = [torch.randn(6, 8, 2, 16, dtype=DTYPES[0], device=DEVICE) for _ in range(2)]
    q = torch.randn(2, 1, 4, 16, dtype=DTYPES[0], device=DEVICE)
    lengths = torch.tensor([20, 13], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[1, 9, -3], [5, 0, 2]], dtype=torch.int32, device=DEVICE)
    monkeypatch.setenv("FLASHTILE_VALUE_CHECKS", "0")
    got = flash_attn_with_kvcache(q, *pool, cache_seqlens=lengths, block_table=table)
    monkeypatch.setenv("FLASHTILE_VALUE_CHECKS", "1")
    want = flash_attn_with_kvcache(q, *pool, cache_seqlens=lengths, block_table=table.clamp(0, 5))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_row_pages_over_a_cache_in_place(dtype):
    """Pages of one row viewing a (batch, heads_k, positions, d) cache in place, a block table listing each row's
    real keys in order (the Hugging Face step's ``FLASHTILE_HF_STEP_IN_GRAPH=paged``): the same output as those
    keys gathered into a contiguous cache."""
    from flashtile import flash_attn_with_kvcache

    batch, nheads, nheads_k, length, headdim = 3, 8, 2, (1500 if DEVICE == "cuda" else 40), 64
    k_bhsd, v_bhsd = (torch.randn(batch, nheads_k, length, headdim, device=DEVICE, dtype=dtype) for _ in range(2))
    k, v = k_bhsd.transpose(1, 2), v_bhsd.transpose(1, 2)
    q = torch.randn(batch, 1, nheads, headdim, device=DEVICE, dtype=dtype)
    real = torch.rand(batch, length, device=DEVICE) < 0.7
    real[0, : length // 2] = False  # left padding, holes, all real
    real[2] = True
    count = real.sum(-1, dtype=torch.int32)
    positions = torch.arange(length, device=DEVICE)
    order = torch.argsort(torch.where(real, positions, positions + length), dim=1)
    pitch = k.stride(0) // k.stride(1)
    rows = (batch - 1) * pitch + length
    pool_k, pool_v = (c.as_strided((rows, 1, nheads_k, headdim), (c.stride(1), c.stride(1), *c.stride()[2:]))
                      for c in (k, v))
    table = (torch.arange(batch, device=DEVICE)[:, None] * pitch + order).to(torch.int32)
    got = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=count, block_table=table, causal=True)
    gather = order[:, :, None, None].expand(-1, -1, nheads_k, headdim)
    want = flash_attn_with_kvcache(q, torch.gather(k, 1, gather), torch.gather(v, 1, gather), cache_seqlens=count,
                                   causal=True)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)
