"""GPU suite (skipped without CUDA): the incumbent's head dims, bf16 and fp16, long and odd lengths."""

import pytest
import torch

from flashtile import flash_attn_func
from flashtile.kernels import backward, configs
from tests.utils import check_against_oracle, make_qkv, stable_seed

pytestmark = pytest.mark.gpu

# The lists this GPU runs (its target's, or FLASHTILE_TARGET's: =sm80 runs the Ampere path on a Hopper GPU).
TARGET = configs.target_of(torch.device("cuda")) if torch.cuda.is_available() else configs.TARGETS["sm90"]

HEADDIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
SEQLENS = [(1, 1), (1, 17), (17, 1), (113, 203), (128, 217), (108, 256), (512, 256), (1023, 1024),
           (4096, 4096)]


def _flash(causal):
    def run(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        return out, lse

    return run


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"sq{s[0]}-sk{s[1]}")
@pytest.mark.parametrize("headdim", HEADDIMS, ids=lambda d: f"d{d}")
def test_gpu_grid(headdim, seqlens, causal, dtype, poison):
    torch.manual_seed(stable_seed(headdim, seqlens, causal))
    tokens = seqlens[0] * seqlens[1]
    batch = 4 if tokens <= 512 * 512 else 1
    nheads, nheads_k = (6, 2) if headdim % 2 else (4, 4)  # GQA on the odd head dims
    q, k, v = make_qkv(batch, *seqlens, nheads, nheads_k, headdim, dtype, "cuda")
    # The oracle in float32 on the GPU: float64 matmuls at s=4096 would dominate the suite's time.
    oracle = torch.float32 if tokens > 1024 * 1024 else torch.float64
    check_against_oracle(_flash(causal), q, k, v, causal, oracle_dtype=oracle)


@pytest.mark.parametrize("nheads_k", [1, 2, 8])
def test_gpu_gqa(nheads_k, poison):
    torch.manual_seed(nheads_k)
    q, k, v = make_qkv(2, 1000, 1500, 8, nheads_k, 128, torch.bfloat16, "cuda")
    check_against_oracle(_flash(True), q, k, v, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_gpu_autotuned(headdim, causal, monkeypatch, poison):
    """The configuration autotuning picks is checked too (every candidate runs while tuning)."""
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    torch.manual_seed(headdim)
    q, k, v = make_qkv(2, 1536, 1536, 8, 4, headdim, torch.bfloat16, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


def _force_tiles(monkeypatch, *forced: tuple) -> None:
    """Autotuning off and each named candidate list ((table, dim_class, entry) triples) cut to the one
    entry, with every remembered choice forgotten (flashtile's and the autotuners'), so the entry runs."""
    from flashtile.kernels import forward

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    for table, dim_class, entry in forced:
        monkeypatch.setitem(table, dim_class, [entry])
    for name in ("_CHOSEN", "_DIRECT"):
        monkeypatch.setattr(configs, name, {})
    for kernel in (forward._attn_fwd, backward._attn_bwd_dkdv, backward._attn_bwd_dq):
        monkeypatch.setattr(kernel, "cache", {})


@pytest.mark.parametrize("index", range(max(len(TARGET.bwd_kv["large_d"]), len(TARGET.bwd_q["large_d"]))))
def test_gpu_each_large_head_dim_backward_tile(index, monkeypatch, poison):
    """Every d > 128 dK/dV and dQ tile candidate, forced one at a time (autotuning keeps only the winner's
    output), d=256 causal and d=192 non-causal, GQA, lengths that are no multiple of any tile."""
    kv_tiles, q_tiles = TARGET.bwd_kv["large_d"], TARGET.bwd_q["large_d"]
    _force_tiles(monkeypatch, (TARGET.bwd_kv, "large_d", kv_tiles[index % len(kv_tiles)]),
                 (TARGET.bwd_q, "large_d", q_tiles[index % len(q_tiles)]))
    causal = index % 2 == 0
    torch.manual_seed(index)
    q, k, v = make_qkv(2, 300, 333, 4, 2, 256 if causal else 192, torch.bfloat16, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("entry", [(dim_class, i) for dim_class in ("small_d", "mid_d")
                                   for i in range(len(TARGET.fwd[dim_class]))], ids=str)
def test_gpu_each_forward_tile(entry, monkeypatch, poison):
    """Every d=64 and d=128 forward tile candidate forced once, causal (diagonal tiles of every shape)
    and with lengths that are no multiple of any tile."""
    dim_class, index = entry
    _force_tiles(monkeypatch, (TARGET.fwd, dim_class, TARGET.fwd[dim_class][index]))
    torch.manual_seed(index)
    q, k, v = make_qkv(2, 777, 901, 4, 2, 64 if dim_class == "small_d" else 128, torch.bfloat16, "cuda")
    check_against_oracle(_flash(True), q, k, v, True)


@pytest.mark.parametrize("tma", ["0", "auto"])
def test_gpu_pointer_and_tma_paths_agree(tma, monkeypatch):
    monkeypatch.setenv("FLASHTILE_TMA", tma)
    torch.manual_seed(11)
    q, k, v = make_qkv(2, 777, 901, 4, 2, 64, torch.float16, "cuda")
    check_against_oracle(_flash(True), q, k, v, True)


@pytest.mark.parametrize("causal", [False, True])
def test_gpu_deterministic(causal):
    torch.manual_seed(5)
    q, k, v = make_qkv(2, 1500, 1500, 8, 2, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    first = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
    for _ in range(10):
        again = torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_more_heads_than_one_grid_axis(causal, poison):
    """batch * heads = 67,200: more programs per block than a grid's second axis holds (65,535)."""
    torch.manual_seed(7)
    q, k, v = make_qkv(4200, 3, 5, 16, 16, 64, torch.bfloat16, "cuda")
    check_against_oracle(_flash(causal), q, k, v, causal)


@pytest.mark.parametrize("section_mb", ["1", "24", "1000"])
def test_gpu_causal_schedule_changes_no_bit(section_mb, monkeypatch):
    """The longest-first order over sections of heads moves programs, never their results."""
    torch.manual_seed(9)
    q, k, v = make_qkv(3, 1100, 1300, 8, 2, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    monkeypatch.setenv("FLASHTILE_L2_SECTION_MB", "0")  # one head per section: head by head
    first = (flash_attn_func(q, k, v, causal=True), *torch.autograd.grad(flash_attn_func(q, k, v, causal=True),
                                                                         (q, k, v), dout))
    monkeypatch.setenv("FLASHTILE_L2_SECTION_MB", section_mb)
    again = (flash_attn_func(q, k, v, causal=True), *torch.autograd.grad(flash_attn_func(q, k, v, causal=True),
                                                                         (q, k, v), dout))
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_gpu_memory_linear_65k():
    """Forward+backward of one 65,536-token sequence, 16 heads, d=128, bf16: < 2 GiB beyond inputs/outputs."""
    seqlen = 65536
    q, k, v = make_qkv(1, seqlen, seqlen, 16, 16, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    tensor_bytes = sum(t.numel() * t.element_size() for t in (out, dq, dk, dv))
    extra = torch.cuda.max_memory_allocated() - base - tensor_bytes
    print(f"\n65k-token fwd+bwd: peak beyond inputs and outputs = {extra / 2**30:.3f} GiB")
    assert extra < 2 * 2**30


# Variants at realistic sizes (the small cases run everywhere in test_variant_kernels.py).
GPU_DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


@GPU_DTYPES
@pytest.mark.parametrize("window,causal", [((256, 0), True), ((300, 300), False), ((1024, 0), True)], ids=str)
def test_gpu_window_large(window, causal, dtype, poison):
    from tests.variant_cases import check_window

    check_window(window, causal, (1500, 2048), dtype, "cuda", headdim=128)


@GPU_DTYPES
@pytest.mark.parametrize("kind", ["softcap", "alibi_batch", "softcap_alibi"])
def test_gpu_softcap_alibi_large(kind, dtype, poison):
    from tests.variant_cases import check_softcap_alibi

    check_softcap_alibi(kind, dtype, "cuda", seqlens=(1024, 1400), headdim=128)


@GPU_DTYPES
def test_gpu_varlen_window_gqa_large(dtype, poison):
    """varlen + causal + window + GQA together, sequences of 0 to 1500 tokens."""
    from tests.variant_cases import check_varlen

    lengths = [1500, 0, 1, 700, 333, 1024]
    check_varlen(lengths, lengths, True, (200, 0), 2, dtype, "cuda", headdim=128)


@GPU_DTYPES
def test_gpu_sink_large(dtype, poison):
    from tests.variant_cases import check_sink

    check_sink(dtype, "cuda", causal=True, seqlens=(1024, 1024))


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_gpu_decode_autotuned(headdim, monkeypatch):
    """Decoding through the autotuner (every few-rows candidate compiles and runs), GQA packed, split-KV."""
    from flashtile import flash_attn_with_kvcache

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    torch.manual_seed(headdim)
    q = torch.randn(2, 1, 8, headdim, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 3000, 2, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([1234, 3000], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=0)
    for b in range(2):
        keys, values = (x[b, : seqlens[b]].double().repeat_interleave(4, 1) for x in (k_cache, v_cache))
        scores = torch.einsum("hd,khd->hk", q[b, 0].double(), keys) * headdim**-0.5
        want = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), values)
        assert (out[b, 0].double() - want).abs().max().item() < 2e-2
