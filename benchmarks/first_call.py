"""First call against second call at long sequence lengths, each size in a fresh process with empty caches.

    python benchmarks/first_call.py [--seqlens 16384,262144,1048576] [--headdim 128] [--nheads 16]
                                    [--impls flashtile,sdpa] [--profile 2 [--top 30]] [--compiles]

One sequence, bf16, causal, default settings (autotuning on): each size runs in a new Python process
whose Triton cache directory is new and empty, so the first forward+backward pays for compilation and
tuning as a new user's does; the second call is the steady state. Prints one markdown row per size and
implementation: ``sdpa`` is PyTorch's ``scaled_dot_product_attention`` (its default backend) on the same inputs,
whose first call pays only what any first attention call pays in PyTorch (its kernels are prebuilt), such as the first
``backward(grad)``'s import of ``torch.fx.experimental.symbolic_shapes`` (0.4-0.6 s on a 2-core CPU).
``--profile N``: the N-th call (1: the first, compiling; 2: the second, which records the launch plans) runs under
cProfile, and its ``--top`` rows by cumulative time follow each row (the profile slows that call).
``--compiles``: each kernel compile of the process follows its row, stamped when it ended (seconds since the process
started, beside each call's start), with its thread and the compiler's stage times: where a first call's seconds go,
and whether ``FLASHTILE_COMPILE_THREADS`` > 1 compiled the one-pass backward's kernels side by side
(``configs.compile_together``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = """
import sys, threading, time
START = time.perf_counter()
seqlen, nheads, headdim, profiled, top, compiles = (int(x) for x in sys.argv[1:7])
impl = sys.argv[7]
if compiles:  # each compile as it ends: seconds since start, kernel, thread, the compiler's stage times (s)
    from triton import knobs

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
        stages = ", ".join(f"{stage} {us / 1e6:.2f}" for stage, us in times.lowering_stages)
        print(f"COMPILE [{time.perf_counter() - START:7.2f} s] {name} on {threading.current_thread().name}: "
              f"{times.total / 1e6:.2f} s (ir {times.ir_initialization / 1e6:.2f}, {stages})", flush=True)

    knobs.compilation.listener = listener
import torch
if impl == "sdpa":
    def attention(q, k, v):
        bhsd = (x.transpose(1, 2) for x in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(*bhsd, is_causal=True).transpose(1, 2)
else:
    from flashtile import flash_attn_func

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True)
profiler = None
q, k, v = (torch.randn(1, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
dout = torch.randn_like(q)
times = []
for call in range(1, 3):
    torch.cuda.synchronize()
    if compiles:
        print(f"COMPILE [{time.perf_counter() - START:7.2f} s] call {call} starts", flush=True)
    if call == profiled:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    out = attention(q, k, v)
    torch.cuda.synchronize()
    middle = time.perf_counter()
    out.backward(dout)
    torch.cuda.synchronize()
    times.append((middle - start, time.perf_counter() - middle))
    if call == profiled:
        profiler.disable()
    q.grad = k.grad = v.grad = None
print("TIMES", *(f"{t:.3f}" for pair in times for t in pair))
if profiler is not None:
    import pstats
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", default="16384,262144,1048576", help="comma list of sequence lengths")
    parser.add_argument("--headdim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--nheads", type=int, default=16, help="heads (default 16)")
    parser.add_argument("--impls", default="flashtile,sdpa", help="comma list of flashtile, sdpa")
    parser.add_argument("--profile", type=int, default=0, choices=(0, 1, 2),
                        help="the call profiled (1 or 2; default none)")
    parser.add_argument("--top", type=int, default=30, help="--profile: rows by cumulative time")
    parser.add_argument("--compiles", action="store_true",
                        help="after each row, every kernel compile of its process as it ended (Triton's compilation "
                             "listener): seconds since start, thread, stage times")
    args = parser.parse_args()
    impls = args.impls.split(",")
    if unknown := set(impls) - {"flashtile", "sdpa"}:
        parser.error(f"--impls: unknown {sorted(unknown)}; expected flashtile, sdpa")
    print("| tokens | impl | first fwd s | first bwd s | second fwd s | second bwd s | first - second s |")
    print("|---|---|---|---|---|---|---|")
    for seqlen, impl in ((int(s), impl) for s in args.seqlens.split(",") for impl in impls):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            done = subprocess.run([sys.executable, "-c", CHILD, str(seqlen), str(args.nheads), str(args.headdim),
                                   str(args.profile), str(args.top), str(int(args.compiles)), impl], env=env,
                                  capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("TIMES")), None)
        if line is None:
            print(f"| {seqlen:,} | {impl} | failed: {done.stderr.strip().splitlines()[-1:]} | | | | |", flush=True)
            continue
        first_f, first_b, second_f, second_b = (float(x) for x in line.split()[1:])
        extra = first_f + first_b - second_f - second_b
        print(f"| {seqlen:,} | {impl} | {first_f:.1f} | {first_b:.1f} | {second_f:.2f} | {second_b:.2f} | "
              f"{extra:.1f} |", flush=True)
        if args.compiles:
            print("\n".join(x[len("COMPILE "):] for x in done.stdout.splitlines() if x.startswith("COMPILE ")),
                  flush=True)
        if args.profile:
            print(done.stdout.partition(line)[2].strip("\n"), flush=True)  # the profile, after the times


if __name__ == "__main__":
    main()
