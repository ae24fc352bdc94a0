"""GPU time of each backward pass, kernel by kernel: the Triton backward's (flash_attn_func's autograd), the Gluon
prototype's plain and pipelined passes, and cuDNN's kernels, at one point each; then the Triton passes' tiles.

    python benchmarks/lab/bwd_passes.py [--headdims 64,128] [--causal false,true] [--seqlens 4096,16384]
                                        [--calls 10] [--overlap] [--impls flashtile,cudnn]
                                        [--flagged-tiles "64,64,4,3;128,64,8,3"]

bf16, batch · seqlen = 16,384, 16 heads. Each backward runs ``--calls`` times under ``torch.profiler``; a kernel's
time is its mean GPU time per call, and TFLOP/s next to it is the whole backward's count (the flash-attn formula,
2.5x the forward's) over that one kernel's time, so the passes of one implementation read as shares of one budget.
Which pass of which implementation is the faster tells whether a backward mixing them would gain. flashtile's
passes run one after the other (``--overlap``: its dQ pass on a side stream, as calls this large run by default).
``--flagged-tiles``: the one pass's flagged dQ pass (``flashtile-recomputed``, ``flashtile-one-head``) once at each
(BLOCK_M, BLOCK_N, num_warps, num_stages) given (``backward.FLAGGED_TILES``).
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F
from gluon_bench import backward_point
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from flashtile.bench import attention_flops


def _kernel_times(fn, calls: int) -> dict[str, float]:
    """Mean GPU µs per call of each kernel ``fn`` launches (summed over the launches of one name)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] += event.device_time / calls
    return dict(times)


def measure(d: int, causal: bool, s: int, calls: int, impls: tuple[str, ...] | None = None,
            flagged_tiles: list[tuple[int, ...]] | None = None) -> list[str]:
    from flashtile.kernels.fixed_point import sampled_keys
    from flashtile.kernels.gluon_backward import gluon_attention_backward

    batch, heads, q, k, v, dout, out, lse, (qt, kt, vt) = backward_point(d, causal, s)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        sdpa_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    plain = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, causal)
    v_outlier = v.detach().clone()
    unsampled = sorted(set(range(s)) - set(sampled_keys(s).tolist()))
    v_outlier[0, unsampled[len(unsampled) // 2], 0] *= 100.0  # (a key outside the sample)
    one_head = (dout, q.detach(), k.detach(), v_outlier, out.detach(), lse, causal)
    runs = {
        "flashtile": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "gluon": lambda: gluon_attention_backward(*plain),
        "gluon-pipelined": lambda: gluon_attention_backward(*plain, pipelined=True),
        "cudnn": lambda: torch.autograd.grad(sdpa_out, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True),
        # the one pass with bounds of 0: every program's check fails, and the flagged dQ pass recomputes every
        # head's dQ (what a model whose keys fail the sampled bounds in every head pays on every call)
        "flashtile-recomputed": lambda: gluon_attention_backward(*plain, one_pass="fixed", warp_specialize=True,
                                                                 keys_as_m="fa3", sampled_bound=True,
                                                                 estimate_margin=0.0),
        # one KV head's V with an outlier outside the sample: that head's dQ recomputed, the others' from the counts
        "flashtile-one-head": lambda: gluon_attention_backward(*one_head, one_pass="fixed", warp_specialize=True,
                                                               keys_as_m="fa3", sampled_bound=True),
    }
    flops = attention_flops(batch, heads, s, s, d, causal, "bwd")
    lines = []
    from flashtile.kernels import backward

    todo = [(name, fn, tile) for name, fn in runs.items() if impls is None or name in impls
            for tile in (flagged_tiles if name.startswith("flashtile-") and flagged_tiles else [None])]
    default_tile = backward.FLAGGED_TILES.get(d)
    for impl, fn, tile in todo:
        name = impl
        backward.FLAGGED_TILES[d] = tile or default_tile
        if tile is not None:
            name = f"{impl} {'x'.join(map(str, tile))}"
        times = _kernel_times(fn, calls)
        total = sum(times.values())
        parts = ", ".join(f"{kernel} {us:.0f} us ({flops / us / 1e6:.0f})"
                          for kernel, us in sorted(times.items(), key=lambda kv: -kv[1]) if us >= 1)
        lines.append(f"d={d} causal={causal} s={s} {name}: total {total:.0f} us ({flops / total / 1e6:.0f} TFLOP/s)"
                     f" | {parts}")
    backward.FLAGGED_TILES[d] = default_tile
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--causal", default="false,true")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--impls", default="flashtile,gluon,gluon-pipelined,cudnn",
                        help="which backwards to time (of flashtile, gluon, gluon-pipelined, cudnn, "
                             "flashtile-recomputed: the one pass in FA3's order with every head's dQ recomputed, "
                             "flashtile-one-head: with one KV head's)")
    parser.add_argument("--flagged-tiles", default="",
                        help="the flagged dQ pass's tiles to time, BLOCK_M,BLOCK_N,warps,stages;...")
    parser.add_argument("--overlap", action="store_true",
                        help="flashtile's dQ pass on its side stream beside the dK/dV pass, as calls this large run "
                             "(each pass's time then includes the stretch where they share the GPU)")
    args = parser.parse_args()
    from flashtile.kernels import backward

    if not args.overlap:  # one pass after the other: each kernel's time is its own, the sum the elapsed time
        backward.SIDE_STREAM_MIN_WORK = float("inf")
    for d in map(int, args.headdims.split(",")):
        for causal in (c == "true" for c in args.causal.split(",")):
            for s in map(int, args.seqlens.split(",")):
                tiles = [tuple(map(int, t.split(","))) for t in args.flagged_tiles.split(";") if t]
                for line in measure(d, causal, s, args.calls, tuple(args.impls.split(",")), tiles):
                    print(line, flush=True)
    for kernel in (backward._attn_bwd_dkdv, backward._attn_bwd_dq):  # the tiles the Triton passes ran with
        for key, config in kernel.cache.items():
            print(f"{kernel.fn.__name__} {key[:6]}: {config}")


if __name__ == "__main__":
    main()
