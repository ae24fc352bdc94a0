"""One call of a chosen workload between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --set full -o $OUT/decode \\
        python3 benchmarks/lab/ncu_targets.py decode

Targets (bf16): ``decode`` one new token against (B, H, Hk, L) = (1, 32, 8, 131072), d=128, flashtile
and SDPA with enable_gqa; ``decode_fp8`` flashtile's same step from the bf16 cache and from an FP8 one;
``bwd_causal`` flashtile's backward at s=4096 (batch 4, 16 heads, d=128,
causal) and SDPA flash's; ``fwd_d64c2048``, ``bwd_d64c2048``, ``bwd_d256n2048`` and ``bwd_d64n8192``: the
forward or backward at a harness grid point (batch·s = 16384, heads·d = 2048; d=64 causal or d=256 not at
s=2048, d=64 not at s=8192), flashtile
and SDPA flash; ``one_pass_d128c16k`` the Gluon one-pass backward (warp-specialized; fixed point, pipelined as
dispatched, and float32), cuDNN's backward and flashtile's two passes at d=128 causal, 16,384 tokens, 16 heads;
``bwd_d128n4096_cudnn`` and ``fwd_d128n8192_cudnn``: flashtile's backward or forward as dispatched and cuDNN's
at those grid points (d=128, not causal), ``fwd_d128n2048b4_cudnn`` the same forwards at the wall-time rows' (4, 2048,
16, 128); ``fwd_fp8_d128n16k`` the FP8 forward as dispatched (the Gluon kernel
with three consumers) and the bf16 forward, d=128, 16,384 tokens, 16 heads, not causal.
Warm-up calls (compilation, autotuning) run before profiling starts, so only the
measured call's kernels are captured. ``ncu`` reads hardware counters on the Firecracker runtime only
(the device library's KINDS.md); on gVisor it fails to start the profiler.
"""

from __future__ import annotations

import argparse

import torch

from flashtile import flash_attn_func, flash_attn_with_kvcache


def _decode():
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, 131072, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((1,), 131072, dtype=torch.int32, device="cuda")

    def flashtile():
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2),
                                                         v_cache.transpose(1, 2), enable_gqa=True)

    return [flashtile, sdpa]


def _decode_fp8():
    """The decode target's step from a bf16 cache and from its FP8 copy (FP8 q), one after the other."""
    from flashtile import fp8

    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(1, 131072, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    (k8, kd), (v8, vd), (q8, qd) = fp8.quantize(k_cache), fp8.quantize(v_cache), fp8.quantize(q, 8)
    seqlens = torch.full((1,), 131072, dtype=torch.int32, device="cuda")

    def bf16():
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)

    def fp8_cache():
        flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=seqlens, q_descale=qd, k_descale=kd, v_descale=vd)

    return [bf16, fp8_cache]


def _sdpa_backend(peer: str):
    backends = torch.nn.attention.SDPBackend
    return {"flash": backends.FLASH_ATTENTION, "cudnn": backends.CUDNN_ATTENTION}[peer]


def _bwd_causal(shape=(4, 4096, 16, 128), causal=True, peer="flash"):
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=causal)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(_sdpa_backend(peer)):
        out_sdpa = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def flashtile():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def sdpa():
        torch.autograd.grad(out_sdpa, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)

    return [flashtile, sdpa]


def _fwd(shape, causal, peer="flash"):
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def flashtile():
        flash_attn_func(q, k, v, causal=causal)

    def sdpa():
        with torch.nn.attention.sdpa_kernel(_sdpa_backend(peer)):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return [flashtile, sdpa]


def _one_pass(shape=(1, 16384, 16, 128), causal=True):
    """The Gluon one-pass backward (warp-specialized; fixed-point and float32 dQ reductions) beside cuDNN's
    backward and flashtile's two passes, on one point's inputs (gluon_bench.backward_point's layout)."""
    from flashtile.kernels.gluon_backward import gluon_attention_backward

    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    plain = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, causal)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        out_sdpa = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def fixed():
        gluon_attention_backward(*plain, one_pass="fixed", warp_specialize=True, pipelined=True)

    def float32():
        gluon_attention_backward(*plain, one_pass="atomic", warp_specialize=True)

    def cudnn():
        torch.autograd.grad(out_sdpa, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)

    def flashtile():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return [fixed, float32, cudnn, flashtile]


def _fwd_fp8(shape=(1, 16384, 16, 128), causal=False):
    """flash_attn_func on FP8 q, k, v (V keys-fastest, as ``fp8.quantize`` makes it: the kernel alone) and on
    their bf16 originals."""
    from flashtile import fp8

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    (q8, qd), (k8, kd) = fp8.quantize(q), fp8.quantize(k)
    v8, vd = fp8.quantize(v, keys_fastest=True)

    def fp8_call():
        flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)

    def bf16():
        flash_attn_func(q, k, v, causal=causal)

    return [fp8_call, bf16]


def _grid_shape(headdim: int, seqlen: int) -> tuple[int, int, int, int]:
    return (16384 // seqlen, seqlen, 2048 // headdim, headdim)


TARGETS = {
    "decode": _decode,
    "decode_fp8": _decode_fp8,
    "bwd_causal": _bwd_causal,
    "fwd_d64c2048": lambda: _fwd(_grid_shape(64, 2048), True),
    "bwd_d64c2048": lambda: _bwd_causal(_grid_shape(64, 2048), True),
    "bwd_d256n2048": lambda: _bwd_causal(_grid_shape(256, 2048), False),
    "bwd_d64n8192": lambda: _bwd_causal(_grid_shape(64, 8192), False),
    "one_pass_d128c16k": _one_pass,
    "bwd_d128n4096_cudnn": lambda: _bwd_causal(_grid_shape(128, 4096), False, "cudnn"),
    "fwd_d128n8192_cudnn": lambda: _fwd(_grid_shape(128, 8192), False, "cudnn"),
    "fwd_d128n2048b4_cudnn": lambda: _fwd((4, 2048, 16, 128), False, "cudnn"),  # bench --overhead's row
    "fwd_fp8_d128n16k": _fwd_fp8,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", choices=tuple(TARGETS))
    args = parser.parse_args()
    calls = TARGETS[args.target]()
    for call in calls:
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
