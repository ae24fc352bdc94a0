"""On an H200: the one-pass backward (dQ added by the dK/dV pass, ``FLASHTILE_BWD_ONE_PASS``) against the
two-pass one and SDPA's flash and cuDNN backwards, backward TFLOP/s.

    FLASHTILE_LAUNCH_PLANS=0 python benchmarks/lab/one_pass_bench.py [--headdims 64,128] [--seqlens 4096,16384]
        [--modes ,atomic,ordered] [--causal false,true]

Batch x seqlen = 16k tokens, 16 heads, bf16. Modes: "" two passes (the default); "atomic" float32 atomic
adds of dQ, "tma-atomic" bulk float32 adds by the copy engine (TMA), the order of the adds not fixed in
either; "ordered" adds in key-block order (deterministic). Each mode's gradients are compared with the
first mode's (max abs difference), and "ordered" with itself over two calls (bitwise).
The tiles the tuner chose are printed per mode.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_func
from flashtile.kernels import configs


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _grad_call(out, inputs, dout):
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def measure(d: int, causal: bool, s: int, modes: list[str]) -> str:
    """One row: backward TFLOP/s of each mode, SDPA flash and cuDNN, and the notes."""
    batch, heads = max(1, 16384 // s), 16
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    flops = 2.5 * 4 * batch * heads * s * s * d / (2 if causal else 1)
    tflops, notes, grads = {}, [], {}
    for mode in modes:
        os.environ["FLASHTILE_BWD_ONE_PASS"] = mode
        call = _grad_call(flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)
        call()  # tunes
        configs.tiles_used(reset=True)
        grads[mode] = call()
        tiles = configs.tiles_used()
        if mode == "ordered":
            same = all(torch.equal(a, b) for a, b in zip(call(), grads[mode]))
            notes.append(f"ordered bitwise equal over two calls: {same}")
        tflops[mode] = flops / _ms(call) / 1e9
        diff = ",".join(f"{(a.float() - b.float()).abs().max().item():.1e}"
                        for a, b in zip(grads[mode], grads[modes[0]]))
        notes.append(f"{mode or 'two-pass'}: {diff} {tiles}")
    os.environ["FLASHTILE_BWD_ONE_PASS"] = ""
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            tflops[name] = flops / _ms(_grad_call(out, (qt, kt, vt), dout.transpose(1, 2))) / 1e9
    return (f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} | " + " ".join(f"{tflops[m]:>10.1f}" for m in modes)
            + f" {tflops['sdpa_flash']:>10.1f} {tflops['cudnn']:>10.1f} | " + "; ".join(notes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--modes", default=",atomic,ordered")
    parser.add_argument("--causal", default="false,true")
    args = parser.parse_args()
    modes = args.modes.split(",")
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | " + " ".join(f"{m or 'two-pass':>10}" for m in modes)
          + f" {'sdpa_flash':>10} {'cudnn':>10} | max|mode - first mode| (dq, dk, dv), tiles", flush=True)
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (c == "true" for c in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                print(measure(d, causal, s, modes), flush=True)


if __name__ == "__main__":
    main()
