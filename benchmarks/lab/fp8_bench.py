"""FP8 against bf16, side by side in one run (Hopper or Ada GPU).

    python benchmarks/lab/fp8_bench.py [--seqlens 4096,8192,16384] [--headdims 128] [--decode-only]
                                       [--forward-only] [--backward] [--sweep] [--quantize]

Forward: ``flash_attn_func`` on FP8 q, k, v (``flashtile.fp8.quantize``'d, bf16 out) against flashtile's
bf16 forward and SDPA's cuDNN and flash backends on the same (dequantized) inputs; batch * seqlen = 16k
tokens, 16 heads. TFLOP/s by the flash-attn formula (4 * b * h * s^2 * d, halved when causal). ``fp8``: v
in the usual layout, so the call's time includes copying it keys-fastest; ``fp8 kf``: v quantized
keys-fastest (``quantize(v, keys_fastest=True)``), taken as it is; ``fp8+q``: the call from bf16 q, k, v, each
quantized first (as an eager model that keeps 16-bit activations calls it). Decoding: one query token per sequence
against a KV cache (32 query heads over 8 KV heads, d=128) in bf16 and in FP8, ``flash_attn_with_kvcache`` without new
tokens, and the bytes of K and V read per second against this GPU's copy rate (a large
``Tensor.copy_``, reading and writing); decoding times are GPU times of the calls replayed as a CUDA graph.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

import flashtile
from flashtile import fp8
from flashtile.kernels import forward as forward_kernels

TOKENS = 16384
NHEADS = 16


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")  # (RESULTS' tables until d3dbd70: means)


def _points(seqlens, headdims):
    """(headdim, causal, seqlen, batch) of every row: batch * seqlen = TOKENS."""
    for headdim in headdims:
        for causal in (False, True):
            for seqlen in seqlens:
                yield headdim, causal, seqlen, max(1, TOKENS // seqlen)


def _quantized_call(q, k, v, causal):
    """An eager model's FP8 call from bf16 q, k, v: each quantized (``fp8.quantize``), then the FP8 forward."""
    (q8, qd), (k8, kd) = fp8.quantize(q), fp8.quantize(k)
    v8, vd = fp8.quantize(v, keys_fastest=True)
    return flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)


def forward_rows(seqlens, headdims):
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | {'fp8':>8} {'fp8 kf':>8} {'fp8+q':>8} {'bf16':>8} {'cudnn':>8} "
          f"{'sdpa_fl':>8} | {'fp8/bf16':>8} {'kf/bf16':>8} {'kf/cudnn':>8} {'+q/bf16':>8}  (TFLOP/s; fp8+q: bf16 "
          "q, k, v quantized in the call)")
    for headdim, causal, seqlen, batch in _points(seqlens, headdims):
        q, k, v = (torch.randn(batch, seqlen, NHEADS, headdim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x) for x in (q, k, v))
        v8_keys_fastest, _ = fp8.quantize(v, keys_fastest=True)
        qb, kb, vb = (fp8.dequantize(x, d) for x, d in ((q8, qd), (k8, kd), (v8, vd)))
        flops = 4 * batch * NHEADS * seqlen * seqlen * headdim / (2 if causal else 1)
        times = {
            "fp8": _ms(partial(flashtile.flash_attn_func, q8, k8, v8, causal=causal, q_descale=qd,
                               k_descale=kd, v_descale=vd)),
            "fp8 kf": _ms(partial(flashtile.flash_attn_func, q8, k8, v8_keys_fastest, causal=causal,
                                  q_descale=qd, k_descale=kd, v_descale=vd)),
            "bf16": _ms(partial(flashtile.flash_attn_func, qb, kb, vb, causal=causal)),
            "fp8+q": _ms(partial(_quantized_call, qb, kb, vb, causal)),
        }
        qt, kt, vt = (x.transpose(1, 2) for x in (qb, kb, vb))
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_fl", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    times[name] = _ms(partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=causal))
            except RuntimeError:
                times[name] = float("nan")
        tf = {n: flops / t / 1e9 for n, t in times.items()}
        print(f"{headdim:>4} {str(causal):>6} {seqlen:>6} | {tf['fp8']:8.1f} {tf['fp8 kf']:8.1f} {tf['fp8+q']:8.1f} "
              f"{tf['bf16']:8.1f} {tf['cudnn']:8.1f} {tf['sdpa_fl']:8.1f} | {tf['fp8'] / tf['bf16']:8.2f} "
              f"{tf['fp8 kf'] / tf['bf16']:8.2f} {tf['fp8 kf'] / tf['cudnn']:8.2f} {tf['fp8+q'] / tf['bf16']:8.2f}",
              flush=True)


# --sweep: each tile below forced in turn (FLASHTILE_AUTOTUNE=0 runs a list's first entry), timed alone.
SWEEP = {
    "fp8_mid_d": [(64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 256, 8, 2), (64, 128, 4, 2),
                  (64, 128, 4, 4), (64, 256, 4, 2), (64, 128, 4, 2, 168), (64, 128, 4, 3, 168), (128, 256, 8, 3)],
    "fp8_few_rows": [(16, 128, 4, 3), (16, 128, 4, 4), (16, 256, 4, 2), (16, 128, 4, 3, 168),
                     (16, 128, 4, 4, 168), (16, 64, 4, 4, 128), (16, 128, 8, 3), (16, 256, 8, 2),
                     # taller tiles: 4 real rows of 32 or 64, but wgmma (64 rows) reads V from shared memory
                     # itself, where the 16-row MMA reads FP8 V a byte at a time
                     (32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3)],
}


def force_tile(table: str, entry: tuple) -> None:
    from flashtile.kernels import configs

    configs.TARGETS["sm90"].fwd[table] = [entry]
    for chosen in (configs._CHOSEN, configs._DIRECT, forward_kernels._attn_fwd.cache):
        chosen.clear()
    forward_kernels._attn_fwd.configs = configs._all_configs("fwd", configs._FWD_NAMES)


def sweep(seqlens) -> None:
    assert os.environ.get("FLASHTILE_AUTOTUNE") == "0", "--sweep needs FLASHTILE_AUTOTUNE=0"
    headdim = 128
    for causal in (False, True):
        for seqlen in seqlens:
            batch = max(1, TOKENS // seqlen)
            q, k, v = (torch.randn(batch, seqlen, NHEADS, headdim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v, keys_fastest=True)
            flops = 4 * batch * NHEADS * seqlen * seqlen * headdim / (2 if causal else 1)
            for entry in SWEEP["fp8_mid_d"]:
                force_tile("fp8_mid_d", entry)
                ms = _ms(partial(flashtile.flash_attn_func, q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                 v_descale=vd))
                print(f"fwd causal={causal} s={seqlen} tile {entry}: {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, cache in ((8, 32768), (1, 131072)):
        k_cache, v_cache = (torch.randn(batch, cache, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        (kc8, kd), (vc8, vd) = fp8.quantize(k_cache), fp8.quantize(v_cache)
        q8, qd = fp8.quantize(torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16), 8)
        seqlens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        for entry in SWEEP["fp8_few_rows"]:
            force_tile("fp8_few_rows", entry)
            for per_sm in (2, 3, 4):
                splits = min(per_sm * sms // (batch * 8), 64)
                t = do_bench_cudagraph(partial(flashtile.flash_attn_with_kvcache, q8, kc8, vc8, cache_seqlens=seqlens,
                                               q_descale=qd, k_descale=kd, v_descale=vd, num_splits=splits),
                                       return_mode="median")
                kv = 2 * batch * cache * 8 * 128
                print(f"decode b={batch} cache={cache} tile {entry} splits {splits}: {t * 1e3:7.1f} us "
                      f"{kv / t / 1e9:5.2f} TB/s", flush=True)


def backward_rows(seqlens, headdims):
    """The backward alone (``torch.autograd.grad`` of a kept forward), TFLOP/s at 2.5x the forward's flops:
    flashtile's bf16 backward, ``fp8_attn_func``'s 16-bit backward and its FP8 one (FLASHTILE_FP8_BACKWARD=1),
    both of which include dequantizing q, k, v (and quantizing dO), and SDPA cuDNN's on the same inputs."""
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | {'bf16':>8} {'fp8 16b':>8} {'fp8 bwd':>8} {'cudnn':>8} | "
          f"{'fp8bwd/bf16':>11}  (backward TFLOP/s)")
    for headdim, causal, seqlen, batch in _points(seqlens, headdims):
        q, k, v, dout = (torch.randn(batch, seqlen, NHEADS, headdim, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        flops = 2.5 * 4 * batch * NHEADS * seqlen * seqlen * headdim / (2 if causal else 1)

        def grad_ms(out, inputs, dout=dout):
            return _ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))

        times = {"bf16": grad_ms(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v))}
        for name, setting in (("fp8 16b", "0"), ("fp8 bwd", "1")):
            os.environ["FLASHTILE_FP8_BACKWARD"] = setting
            times[name] = grad_ms(fp8.fp8_attn_func(q, k, v, causal=causal), (q, k, v))
        os.environ.pop("FLASHTILE_FP8_BACKWARD")
        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            times["cudnn"] = grad_ms(out, (qt, kt, vt), dout.transpose(1, 2))
        tf = {n: flops / t / 1e9 for n, t in times.items()}
        print(f"{headdim:>4} {str(causal):>6} {seqlen:>6} | {tf['bf16']:8.1f} {tf['fp8 16b']:8.1f} "
              f"{tf['fp8 bwd']:8.1f} {tf['cudnn']:8.1f} | {tf['fp8 bwd'] / tf['bf16']:11.2f}", flush=True)


def copy_rate() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting reads and writes."""
    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * a.element_size() / (_ms(lambda: b.copy_(a)) * 1e-3)


def decode_rows(points, splits=(0,)):
    rate = copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s (read + write)")
    print(f"{'batch':>5} {'cache':>7} {'splits':>6} | {'bf16 us':>8} {'fp8 us':>8} {'speedup':>7} | {'bf16 TB/s':>9} "
          f"{'fp8 TB/s':>9} | {'fp8 V pos-fastest us':>20} {'speedup':>7} {'TB/s':>6}")
    nheads, nheads_k, headdim = 32, 8, 128
    for batch, cache in points:
        k_cache, v_cache = (torch.randn(batch, cache, nheads_k, headdim, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        (kc8, kd), (vc8, vd) = fp8.quantize(k_cache), fp8.quantize(v_cache)
        vc8_fast = fp8.zeros_cache(*vc8.shape, device="cuda")[1].copy_(vc8)  # V positions-fastest
        q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=torch.bfloat16)
        q8, qd = fp8.quantize(q, nheads_k)
        kb, vb = fp8.dequantize(kc8, kd), fp8.dequantize(vc8, vd)
        qb = fp8.dequantize(q8, qd)
        seqlens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()  # do_bench_cudagraph runs on a stream of its own
        # GPU time: the steps replayed as a CUDA graph (eager steps are bound by the host's time per call,
        # which would hide the kernels' difference).
        for num_splits in splits:  # 0: flashtile's choice
            t_bf16 = do_bench_cudagraph(partial(flashtile.flash_attn_with_kvcache, qb, kb, vb, cache_seqlens=seqlens,
                                                num_splits=num_splits), return_mode="median")
            t_fp8 = do_bench_cudagraph(partial(flashtile.flash_attn_with_kvcache, q8, kc8, vc8, cache_seqlens=seqlens,
                                               q_descale=qd, k_descale=kd, v_descale=vd, num_splits=num_splits),
                                       return_mode="median")
            t_fast = do_bench_cudagraph(partial(flashtile.flash_attn_with_kvcache, q8, kc8, vc8_fast,
                                                cache_seqlens=seqlens, q_descale=qd, k_descale=kd, v_descale=vd,
                                                num_splits=num_splits), return_mode="median")
            kv = 2 * batch * cache * nheads_k * headdim
            print(f"{batch:>5} {cache:>7} {num_splits or 'auto':>6} | {t_bf16 * 1e3:8.1f} {t_fp8 * 1e3:8.1f} "
                  f"{t_bf16 / t_fp8:7.2f} | {2 * kv / t_bf16 / 1e9:9.2f} {kv / t_fp8 / 1e9:9.2f} | "
                  f"{t_fast * 1e3:20.1f} {t_bf16 / t_fast:7.2f} {kv / t_fast / 1e9:6.2f}", flush=True)


def quantize_rows(seqlens, headdims) -> None:
    """``fp8.quantize`` of one bf16 (batch, seqlen, 16, d) tensor at batch * seqlen = 16k tokens, and its inverse
    (``fp8._dequantize`` back to bf16, as ``fp8_attn_func``'s backward runs it) and ``fp8.quantize_with`` (the
    descales given, as a cache's new tokens take them), and ``quantize(v, keys_fastest=True)`` ("kf": the kernel
    writing that layout; "copied": into rows, then the transpose kernel): the kernels (kernels/fp8_quantize.py,
    what a CUDA tensor takes) against the PyTorch ops they replace (the path under torch.compile and off the GPU),
    the same bits checked; µs per call and the bf16 tensor's GB/s (its bytes over the time)."""
    from flashtile.kernels.fp8_quantize import dequantize_heads, quantize_given, quantize_heads

    def torch_quantize(x):
        scale, descale = fp8._scale_from_amax(x.abs().amax(dim=(1, 3)))
        return fp8._to_fp8(x, scale[:, None, :, None]), descale

    def torch_dequantize(x8, descale):
        return (x8.float() * descale[:, None, :, None]).to(torch.bfloat16).contiguous()

    def copied_keys_fastest(x):  # (before the kernel wrote the layout itself: quantized into rows, then copied)
        x8, descale = quantize_heads(x)
        return fp8._keys_fastest_copy(x8), descale

    def torch_quantize_with(x, descale):
        return (x.float() / descale[:, None, :, None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)

    print(f"{'d':>4} {'seqlen':>7} | {'quantize us':>11} {'torch us':>9} {'ratio':>6} {'GB/s':>6} | "
          f"{'dequantize us':>13} {'torch us':>9} {'ratio':>6} {'GB/s':>6} | "
          f"{'quantize_with us':>16} {'torch us':>9} {'ratio':>6} | {'kf us':>6} {'copied us':>9} | same bits",
          flush=True)
    for d in headdims:
        for s in seqlens:
            x = torch.randn(TOKENS // s, s, NHEADS, d, device="cuda", dtype=torch.bfloat16)
            (x8, descale), (x8_torch, descale_torch) = quantize_heads(x), torch_quantize(x)
            same = (torch.equal(x8.view(torch.uint8), x8_torch.view(torch.uint8))
                    and torch.equal(descale, descale_torch)
                    and torch.equal(dequantize_heads(x8, descale, torch.bfloat16), torch_dequantize(x8, descale))
                    and torch.equal(quantize_given(x, descale).view(torch.uint8),
                                    torch_quantize_with(x, descale).view(torch.uint8))
                    and torch.equal(quantize_heads(x, keys_fastest=True)[0].contiguous().view(torch.uint8),
                                    x8_torch.view(torch.uint8)))
            times = [_ms(partial(quantize_heads, x)), _ms(partial(torch_quantize, x)),
                     _ms(partial(dequantize_heads, x8, descale, torch.bfloat16)),
                     _ms(partial(torch_dequantize, x8, descale)), _ms(partial(quantize_given, x, descale)),
                     _ms(partial(torch_quantize_with, x, descale)),
                     _ms(partial(quantize_heads, x, keys_fastest=True)), _ms(partial(copied_keys_fastest, x))]
            gb = x.numel() * x.element_size() / 1e9
            print(f"{d:>4} {s:>7} | {times[0] * 1e3:11.1f} {times[1] * 1e3:9.1f} {times[1] / times[0]:6.2f} "
                  f"{gb / times[0] * 1e3:6.0f} | {times[2] * 1e3:13.1f} {times[3] * 1e3:9.1f} "
                  f"{times[3] / times[2]:6.2f} {gb / times[2] * 1e3:6.0f} | {times[4] * 1e3:16.1f} "
                  f"{times[5] * 1e3:9.1f} {times[5] / times[4]:6.2f} | {times[6] * 1e3:6.1f} {times[7] * 1e3:9.1f} | "
                  f"{same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="4096,8192,16384")
    parser.add_argument("--headdims", default="128")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time each tile of SWEEP alone (d=128), then stop")
    parser.add_argument("--backward", action="store_true", help="also the backward rows (FP8 backward products)")
    parser.add_argument("--decode-splits", default="0", help="num_splits values of the decoding rows (0: auto)")
    parser.add_argument("--quantize", action="store_true",
                        help="fp8.quantize's and dequantize's kernels against their PyTorch ops, then stop")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if args.quantize:
        return quantize_rows([int(s) for s in args.seqlens.split(",")], [int(d) for d in args.headdims.split(",")])
    if args.sweep:
        return sweep([int(s) for s in args.seqlens.split(",")])
    if not args.decode_only:
        forward_rows([int(s) for s in args.seqlens.split(",")], [int(d) for d in args.headdims.split(",")])
    if args.backward:
        backward_rows([int(s) for s in args.seqlens.split(",")], [int(d) for d in args.headdims.split(",")])
    if not args.forward_only:
        decode_rows([(8, 32768), (1, 131072), (32, 32768), (64, 4096)], [int(n) for n in args.decode_splits.split(",")])


if __name__ == "__main__":
    main()
