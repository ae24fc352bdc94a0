"""Where one call's time goes on the GPU: device time of its kernels against host time per call.

    python benchmarks/lab/profile_call.py [--seqlens 512,4096] [--headdim 128] [--causal] [--calls 20]

For each sequence length (batch·seqlen = 16384, heads·headdim = 2048, bf16) and each of flashtile and
SDPA's flash backend, forward and forward+backward: the summed CUDA kernel time per call from
``torch.profiler`` and the host wall time per call with the GPU idle in between (synchronised), and
the same calls enqueued back to back. If back-to-back time per call is near the host time and well
above the kernel time, the call is bound by the host (Python and launches), not by the kernels.

``--cprofile N``: then the Python functions where flashtile's forward+backward spends its host time
(cProfile over N calls, the top of the list by own time and by cumulative time).
``--overhead-rows``: the same measures for every row of ``flashtile bench --overhead`` (its shapes, views of
one projection, decoding steps), flashtile against SDPA's flash and cuDNN backends, every kernel listed.
``--cprofile-rows N``: cProfile of flashtile's host time over N calls of three wall-time rows (b=1 s=256
causal forward, its forward+backward with autograd's device thread off, a decoding step b=8 cache=4096),
and the host cost of the primitives a replay calls (allocation, TMA descriptor fill, stream lookup).
``--split``: host µs per forward+backward in flashtile's parts (launches, run_forward, run_backward),
with autograd's device thread and without; ``--split --finer`` adds Triton's binder and launcher (inside
the launches), host-made descriptors, allocations, the side stream and the argument checks.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flashtile.bench import _implementation, _naive


def _sdpa(q, k, v, causal):
    # The harness's SDPA-flash peer on a GPU; its naive attention for the CPU dry run.
    return (_implementation("sdpa_flash", 0, 0, causal) if torch.cuda.is_available() else _naive)(q, k, v, causal)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn, calls: int) -> dict:
    for _ in range(3):
        fn()  # compile, autotune, warm
    _sync()
    host = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)  # enqueue time: the GPU was idle when it began
        _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    back_to_back = (time.perf_counter() - start) / calls
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: a dry run
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        _sync()
    kernels = {}
    for event in prof.key_averages():
        device_us = (getattr(event, "self_device_time_total", 0) if torch.cuda.is_available()
                     else 0)
        if device_us:
            kernels[event.key[:60]] = device_us / calls
    return {"host_us": sorted(host)[len(host) // 2] * 1e6, "back_to_back_us": back_to_back * 1e6,
            "kernel_us": sum(kernels.values()), "kernels": kernels}


def report(seqlen: int, headdim: int, causal: bool, calls: int) -> None:
    batch, nheads = 16384 // seqlen, 2048 // headdim
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    for name, impl in (("flashtile", _implementation("flashtile", seqlen, seqlen, causal)), ("sdpa_flash", _sdpa)):
        calls_of = {"fwd": lambda impl=impl: impl(q, k, v, causal),
                    "fwd+bwd": lambda impl=impl: torch.autograd.grad(impl(q, k, v, causal), (q, k, v), dout)}
        for mode, fn in calls_of.items():
            m = measure(fn, calls)
            heaviest = sorted(m["kernels"].items(), key=lambda kv: -kv[1])[:4]
            top = ", ".join(f"{key} {us:.0f}" for key, us in heaviest)
            print(f"s={seqlen:<6d} {name:10s} {mode:8s} kernels {m['kernel_us']:8.1f} us  "
                  f"host {m['host_us']:8.1f} us  back-to-back {m['back_to_back_us']:8.1f} us  [{top}]", flush=True)


def overhead_rows(calls: int) -> None:
    """``measure`` on each wall-time row of ``flashtile bench --overhead``, with its own call builders."""
    from flashtile import bench_overhead as bo

    device, dtype = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    cases = []
    for shape in bo.OVERHEAD_SHAPES:
        for causal in (False, True):
            per_impl = bo._training_calls(shape, causal, dtype, device)
            for mode in ("fwd", "fwd_bwd"):
                cases.append((f"{shape} {'causal' if causal else 'full'} {mode}",
                              {name: fns[mode] for name, fns in per_impl.items()}))
    for batch, length in bo.DECODE_STEPS:
        cases.append((f"decode b={batch} cache={length}", bo._decode_calls(batch, length, dtype, device)))
    for label, fns in cases:
        for name in ("flashtile", "sdpa_flash", "sdpa_cudnn"):
            with bo._backend_context(name):
                m = measure(fns[name], calls)
            heaviest_first = sorted(m["kernels"].items(), key=lambda kv: -kv[1])
            listed = ", ".join(f"{key[:40]} {us:.1f}" for key, us in heaviest_first)
            print(f"{label:40s} {name:10s} kernels {m['kernel_us']:7.1f}  host {m['host_us']:7.1f}  "
                  f"back-to-back {m['back_to_back_us']:7.1f} us  [{listed}]", flush=True)


def row_profiles(calls: int, top: int = 22) -> None:
    """cProfile over ``calls`` of flashtile's calls in three wall-time rows, then primitives' µs."""
    import cProfile
    import pstats

    from flashtile import bench_overhead as bo

    device, dtype = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    training = bo._training_calls((1, 256, 32, 128), True, dtype, device)["flashtile"]
    decode = bo._decode_calls(8, 4096, dtype, device)["flashtile"]
    for label, fn in (("fwd b=1 s=256 causal", training["fwd"]), ("fwd_bwd b=1 s=256 causal", training["fwd_bwd"]),
                      ("decode b=8 cache=4096", decode)):
        with torch.autograd.set_multithreading_enabled(False):
            for _ in range(5):
                fn()
            _sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync()
            plain = (time.perf_counter() - start) / calls * 1e6
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                fn()
            _sync()
            profiler.disable()
        print(f"--- {label}: {plain:.1f} us per call unprofiled (device thread off), cProfile of {calls} calls")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)

    peers = bo._training_calls((1, 256, 32, 128), True, dtype, device)
    for name in ("sdpa", "flashtile"):  # the same row, autograd's device thread on (as a model runs) and off
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                for _ in range(5):
                    peers[name]["fwd_bwd"]()
                _sync()
                start = time.perf_counter()
                for _ in range(calls):
                    peers[name]["fwd_bwd"]()
                _sync()
            print(f"{name} fwd_bwd b=1 s=256 causal, device thread {'on' if threads else 'off'}: "
                  f"{(time.perf_counter() - start) / calls * 1e6:.1f} us per call")

    def per_call(name, fn, n=2000):
        fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        print(f"primitive {name:50s} {(time.perf_counter() - start) / n * 1e6:7.2f} us")

    per_call("torch.empty (1, 256, 32, 128) bf16", lambda: torch.empty((1, 256, 32, 128), dtype=dtype, device=device))
    per_call("torch.empty_strided", lambda: torch.empty_strided((1, 32, 256), (8192, 256, 1), dtype=torch.float32,
                                                                device=device))
    x = torch.empty((1, 256, 32, 128), dtype=dtype, device=device)
    per_call("tensor.data_ptr()", x.data_ptr)
    per_call("tensor.as_strided", lambda: x.as_strided((256, 32, 128), (4096, 128, 1), 0))
    if torch.cuda.is_available():
        from triton.runtime.driver import driver

        active = driver.active
        per_call("driver.get_current_stream", lambda: active.get_current_stream(0))
        per_call("driver.get_current_device", active.get_current_device)
        per_call("torch.cuda.current_stream", torch.cuda.current_stream)
        fill = active.utils.fill_tma_descriptor
        # (address, swizzle, element bytes, CUtensorMapDataType (9: bfloat16), box, shape, strides, padding)
        args = (128, 2, 9, [64, 128], [256, 32, 128], [4096, 128, 1], 0)
        try:
            per_call("fill_tma_descriptor (3-d, 64x128 bf16 box)", lambda: fill(x.data_ptr(), *args))
        except Exception as exc:  # the encoder's signature differs: report, do not fail the run
            print(f"primitive fill_tma_descriptor: n/a ({type(exc).__name__}: {exc})")


def host_profile(seqlen: int, headdim: int, causal: bool, calls: int, top: int = 30) -> None:
    import cProfile
    import pstats

    batch, nheads = 16384 // seqlen, 2048 // headdim
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    impl = _implementation("flashtile", seqlen, seqlen, causal)

    def call():
        return torch.autograd.grad(impl(q, k, v, causal), (q, k, v), dout)

    for _ in range(3):
        call()
    _sync()
    profiler = cProfile.Profile()
    # cProfile sees one thread; on a GPU autograd runs the backward on a device thread unless told not to.
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(calls):
            call()
            _sync()
        profiler.disable()
    print(f"--- host profile, flashtile fwd+bwd, s={seqlen} causal={causal}, {calls} calls (times are totals)")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


def _patch(target, attr: str, wrap):
    """Replace ``target.attr`` by ``wrap(original)``; returns the function that puts it back."""
    original = getattr(target, attr)
    setattr(target, attr, wrap(original))
    return lambda: setattr(target, attr, original)


def _finer_parts(timed) -> list:
    """Time the pieces inside flashtile's calls, once the first calls have set up direct launches:
    Triton's argument binder and its launcher (descriptor arguments, the driver's launch) under every
    kernel launch, the host-made TMA descriptors, CUDA tensor allocations, the side stream's set-up and
    event waits, the argument checks. Returns the functions that undo the patches."""
    import flashtile.interface as interface
    from flashtile.kernels import backward, configs, forward

    undo = []
    for module in (forward, backward):
        for name in dir(module):
            jit = getattr(getattr(module, name), "fn", getattr(module, name))
            caches = getattr(jit, "device_caches", None)
            if not name.startswith("_attn") or not isinstance(caches, dict):
                continue
            for device, cache in list(caches.items()):
                # (kernel cache, key cache, target, backend, binder): the binder specializes every argument.
                caches[device] = (*cache[:4], timed("binder", cache[4]))
                undo.append(lambda caches=caches, device=device, cache=cache: caches.__setitem__(device, cache))
    for direct in configs._DIRECT.values():
        for on_device in direct.compiled.values():
            for compiled in on_device.values():
                undo.append(_patch(compiled, "_run", lambda run: timed("launcher", run)))
    undo.append(_patch(configs, "host_descriptors", lambda fn: timed("descriptors", fn)))
    undo.append(_patch(configs, "side_stream", lambda fn: timed("streams", fn)))
    undo.append(_patch(torch.cuda.Stream, "wait_stream", lambda fn: timed("streams", fn)))
    for name in ("empty", "empty_like", "zeros"):
        undo.append(_patch(torch, name, lambda fn: timed("allocations", fn)))
    for name in ("_check_qkv", "_check_options"):
        undo.append(_patch(interface, name, lambda fn: timed("checks", fn)))
    return undo


def _unpatch(undo: list) -> None:
    for restore in reversed(undo):
        restore()


def host_split(seqlen: int, headdim: int, causal: bool, calls: int, finer: bool = False) -> None:
    """Host µs per forward+backward call inside flashtile's run_forward / run_backward / kernel launches (all
    four: the autotuned three and the delta preprocess),
    against the whole call, with autograd's device thread (the default) and without it. ``finer``: also the
    pieces of ``_finer_parts`` (binder and launcher are parts of the launches)."""
    import flashtile._ops as ops
    from flashtile.kernels import configs

    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    originals = (ops.run_forward, ops.run_backward, configs.launch, configs.launch_plain)
    ops.run_forward, ops.run_backward = timed("run_forward", ops.run_forward), timed("run_backward", ops.run_backward)
    configs.launch = timed("launches", configs.launch)
    configs.launch_plain = timed("launches", configs.launch_plain)
    patches: list = []
    try:
        batch, nheads = 16384 // seqlen, 2048 // headdim
        device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
        q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
        for name in ("flashtile", "sdpa_flash"):
            impl = _implementation(name, seqlen, seqlen, causal) if name == "flashtile" else _sdpa
            for threads in (True, False):
                with torch.autograd.set_multithreading_enabled(threads):
                    for _ in range(3):
                        torch.autograd.grad(impl(q, k, v, causal), (q, k, v), dout)
                    _sync()
                    if finer and name == "flashtile" and not patches:
                        patches = _finer_parts(timed)
                    spent.clear()
                    total = 0.0
                    for _ in range(calls):
                        start = time.perf_counter()
                        torch.autograd.grad(impl(q, k, v, causal), (q, k, v), dout)
                        total += time.perf_counter() - start
                        _sync()
                if name == "flashtile" and patches and not threads:
                    _unpatch(patches)
                    patches = []
                parts = "  ".join(f"{key} {value / calls * 1e6:7.1f}" for key, value in spent.items())
                print(f"s={seqlen:<6d} {name:10s} fwd+bwd device thread {'on ' if threads else 'off'}: host "
                      f"{total / calls * 1e6:7.1f} us per call  [{parts}]", flush=True)
    finally:
        _unpatch(patches)
        ops.run_forward, ops.run_backward, configs.launch, configs.launch_plain = originals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", default="512,2048,4096")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="profile the host over N calls instead")
    parser.add_argument("--split", action="store_true", help="host time in flashtile's parts, autograd threads on/off")
    parser.add_argument("--finer", action="store_true",
                        help="with --split: also binder, launcher, descriptors, allocations, streams, checks")
    parser.add_argument("--overhead-rows", action="store_true", help="every row of flashtile bench --overhead")
    parser.add_argument("--cprofile-rows", type=int, default=0, metavar="N",
                        help="cProfile of three wall-time rows over N calls, and primitives' host cost")
    args = parser.parse_args()
    if args.cprofile_rows:
        row_profiles(args.cprofile_rows)
        return
    if args.overhead_rows:
        overhead_rows(args.calls)
        return
    if args.split:
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            host_split(seqlen, args.headdim, args.causal, args.calls, args.finer)
        return
    if args.cprofile:
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            host_profile(seqlen, args.headdim, args.causal, args.cprofile)
        return
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        report(seqlen, args.headdim, args.causal, args.calls)


if __name__ == "__main__":
    main()
