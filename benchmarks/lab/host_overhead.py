"""Host (Python) time of one flash_attn_func call, on any machine, GPU or not.

    python benchmarks/lab/host_overhead.py [--calls 500] [--loops 3] [--stub-jit] [--cprofile] [--raw] [--floors]
                                           [--varlen | --decode | --fp8-decode | --fp8 | --growing | --compiled-decode]

The backend is forced to "triton" on CPU tensors and Triton's active driver is replaced by a stand-in
for an H200 (sm_90) whose launcher does nothing: Triton's whole launch path runs (argument binding and
specialization, cache lookup, the first call compiling every kernel for sm_90 with ptxas), only the
final driver call is skipped. ``--stub-jit`` replaces Triton's JIT launch itself by a no-op (what is left
is flashtile's own Python, autograd and the autotuner's dispatch; no launch is direct, so no call is
replayed from a launch plan). ``--cprofile`` prints where the
forward+backward's host time goes. TMA paths are not taken (CPU tensors), and the default tiles are
used (``FLASHTILE_AUTOTUNE=0`` is set here). Small tensors keep the CPU allocator out of the picture.
``--varlen`` times ``flash_attn_varlen_func`` on the same tokens packed (two sequences) instead; its
cu_seqlens values are read and checked once per tensor (on a GPU: a pinned copy and an event), later calls
replay. ``--growing`` times a Hugging Face-like decoding loop (16 layers a step over a cache that grows by
concatenation) at new cache lengths and at lengths seen before. ``--decode`` times a decoding step
instead: ``flash_attn_with_kvcache`` appending one token per sequence (GQA 8/2 heads, a 128-token cache,
cache_seqlens a tensor), forward only; its index check reads the tensor once (on a GPU: a device-to-host
copy that waits for the GPU), later steps replay. ``--fp8-decode`` times that step over the float16 cache and
over the same cache in FP8 (FP8 q): with new tokens already float8 in the cache's scale, with float16 new tokens
given to the call (quantized by the append kernel), with them quantized first by ``flashtile.fp8.quantize_with``
(PyTorch ops, then the step), and a float16 q with float16 new tokens (no q_descale); every step replays.
``--fp8`` times ``flash_attn_func``'s forward on FP8 q, k, v (``fp8.quantize``'d, causal) beside the float16
call without grad: v in rows (copied keys-fastest by its Triton kernel, as on a GPU) and v keys-fastest, and
``flash_attn_varlen_func`` on the same tokens packed as two sequences, with launch plans on and off
(``FLASHTILE_LAUNCH_PLANS``).
``--packed`` makes q, k, v ``unbind(2)``'s slices of one leaf projection output ``(2, 64, 3, 4, 64)``, as a model's
fused QKV projection does (``FLASHTILE_PACKED_GRADS``: autograd takes the projection; the gradient is asked of it).
``--decode-variants`` times that step on the contiguous cache and on other ways of giving it: a paged pool (pages
of 16, a block table), ``cache_batch_idx``, rotary tables.
``--paged-varlen`` times ``flash_attn_varlen_func`` with a block table (two sequences of 100 and 120 keys in
pages of 16, 32 queries each), forward only.
``--compiled-decode`` times a 4-layer decoding step under ``torch.compile`` (Inductor's generated code calling
the ``flashtile::kvcache_attention`` op per layer), with launch plans off and on.
``--floors`` adds, on the same tensors, an empty ``autograd.Function`` saving what flashtile's saves (forward, and
forward+backward through ``torch.autograd.grad``) and an ATen op's forward+backward: PyTorch's own floors.
``--raw``: the stand-in's launchers are Triton's CUDA launcher but for its compiled module, so launch plans
replay through their raw launches as on a GPU, instead of through Triton's launcher.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from stand_in_hopper import Launcher, install  # noqa: E402

import flashtile.inference as inference  # noqa: E402
import flashtile.interface as interface  # noqa: E402
from flashtile import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, fp8  # noqa: E402
from flashtile.kernels import backward, forward  # noqa: E402


def _no_launch(*args, grid, warmup, **kwargs):
    """Stands in for ``JITFunction.run``: evaluates the grid (with the config's block sizes) and returns."""
    if callable(grid):
        grid(kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--loops", type=int, default=3, help="timed loops of --calls calls; the fastest is reported")
    parser.add_argument("--stub-jit", action="store_true", help="replace Triton's JIT launch by a no-op")
    parser.add_argument("--cprofile", action="store_true", help="profile the forward+backward calls")
    parser.add_argument("--varlen", action="store_true", help="flash_attn_varlen_func on two packed sequences")
    parser.add_argument("--decode", action="store_true", help="flash_attn_with_kvcache appending one token")
    parser.add_argument("--fp8-decode", action="store_true",
                        help="that step over a float16 cache and over FP8 caches (new tokens float8 or float16)")
    parser.add_argument("--fp8", action="store_true", help="flash_attn_func's forward on FP8 q, k, v")
    parser.add_argument("--packed", action="store_true",
                        help="q, k, v as unbind(2)'s slices of one projection output (the gradient asked of it)")
    parser.add_argument("--decode-variants", action="store_true",
                        help="the decoding step on a contiguous cache, a paged pool, with cache_batch_idx, with rotary")
    parser.add_argument("--paged-varlen", action="store_true", help="flash_attn_varlen_func with a block table")
    parser.add_argument("--raw", action="store_true", help="plans replay through raw launches, as on a GPU")
    parser.add_argument("--floors", action="store_true",
                        help="also an empty autograd.Function (saving q, k, v, out, lse) and an ATen op, same tensors")
    parser.add_argument("--compiled-decode", action="store_true",
                        help="a 4-layer decoding step under torch.compile, launch plans off and on")
    parser.add_argument("--growing", action="store_true",
                        help="a Hugging Face-like decoding loop instead: 16 layers per step through flash_attn_func, "
                             "keys a BHSD cache that grows by concatenation, at new lengths and at lengths seen before")
    args = parser.parse_args()
    # The autotuned kernels keep Triton's Autotuner (its first call "tunes" with zero timings, one
    # candidate compiled) and flashtile's launch path.
    os.environ["FLASHTILE_AUTOTUNE"] = "0"
    for kernel in (forward._attn_fwd, backward._attn_bwd_dkdv, backward._attn_bwd_dq):
        kernel.cache_results = False
        if args.stub_jit:
            kernel.fn.run = _no_launch
    if args.stub_jit:
        backward._attn_bwd_preprocess.run = _no_launch
    install(raw=args.raw)  # the stand-in GPU is the target either way (configs.target_of)
    interface.select_backend = inference.select_backend = lambda device: "triton"
    q, k, v = (torch.randn(2, 64, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    grad_of = (q, k, v)
    if args.packed:
        projection = torch.randn(2, 64, 3 * 4 * 64, dtype=torch.float16, requires_grad=True)
        q, k, v = projection.view(2, 64, 3, 4, 64).unbind(2)
        grad_of = (projection,)

    if args.varlen:
        q, k, v = (x.detach().reshape(-1, 4, 64).requires_grad_() for x in (q, k, v))
        dout = dout.reshape(-1, 4, 64)
        cu = torch.tensor([0, 64, 128], dtype=torch.int32)

    if args.decode or args.fp8_decode or args.decode_variants:
        k_cache, v_cache = (torch.randn(2, 128, 2, 64, dtype=torch.float16) for _ in range(2))
        q_step = torch.randn(2, 1, 8, 64, dtype=torch.float16)
        k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2))
        cache_seqlens = torch.tensor([100, 120], dtype=torch.int32)

    causal = os.environ.get("HO_CAUSAL", "1") == "1"  # (read once: a read per call would be timed with the call)

    def attention(q, k, v):
        if args.decode:
            return flash_attn_with_kvcache(q_step, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens)
        if args.varlen:
            return flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, causal=True)
        return flash_attn_func(q, k, v, causal=causal)

    def forward_only():
        return attention(q, k, v)

    def forward_backward():
        return torch.autograd.grad(attention(q, k, v), grad_of, dout)

    def forward_no_grad():  # inference: a decoding step through flash_attn_func
        with torch.no_grad():
            return attention(q, k, v)

    if args.growing:
        _growing_cache_loop()
        return
    if args.compiled_decode:
        _compiled_decoding_step(args.calls)
        return

    steps = (("forward", forward_only),) if args.decode else (("forward", forward_only),
                                                             ("forward, no grad", forward_no_grad),
                                                             ("forward+backward", forward_backward))
    if args.decode_variants:
        pools = [c.view(-1, 16, *c.shape[2:]) for c in (k_cache, v_cache)]
        table = torch.arange(pools[0].shape[0], dtype=torch.int32).flip(0).view(2, -1)
        rows = torch.tensor([1, 0], dtype=torch.int32)
        cos, sin = (torch.randn(k_cache.shape[1] + 8, 32, dtype=torch.float16) for _ in range(2))
        steps = (
            ("contiguous cache", lambda: flash_attn_with_kvcache(q_step, k_cache, v_cache, k_new, v_new,
                                                                 cache_seqlens=cache_seqlens)),
            ("paged pool", lambda: flash_attn_with_kvcache(q_step, *pools, k_new, v_new, cache_seqlens=cache_seqlens,
                                                           block_table=table)),
            ("cache_batch_idx", lambda: flash_attn_with_kvcache(q_step, k_cache, v_cache, k_new, v_new,
                                                                cache_seqlens=cache_seqlens, cache_batch_idx=rows)),
            ("rotary tables", lambda: flash_attn_with_kvcache(q_step, k_cache, v_cache, k_new, v_new, cos, sin,
                                                              cache_seqlens=cache_seqlens, causal=True)),
        )
    if args.paged_varlen:
        q_packed = torch.randn(64, 8, 64, dtype=torch.float16)
        pool = torch.randn(16, 16, 2, 64, dtype=torch.float16)
        cu_q_paged = torch.tensor([0, 32, 64], dtype=torch.int32)
        cu_k_paged = torch.tensor([0, 100, 220], dtype=torch.int32)
        pages = torch.arange(16, dtype=torch.int32).flip(0).view(2, 8)
        steps = (("paged varlen forward", lambda: flash_attn_varlen_func(
            q_packed, pool, pool, cu_q_paged, cu_k_paged, 32, 120, causal=True, block_table=pages)),)
    if args.fp8_decode:
        (k8, kd), (v8, vd) = fp8.quantize(k_cache), fp8.quantize(v_cache)
        q8, qd = fp8.quantize(q_step, 2)
        k_new8, v_new8 = fp8.quantize_with(k_new, kd), fp8.quantize_with(v_new, vd)
        scales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        steps = (
            ("decoding step, float16 cache",
             lambda: flash_attn_with_kvcache(q_step, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens)),
            ("FP8 cache, FP8 new tokens",
             lambda: flash_attn_with_kvcache(q8, k8, v8, k_new8, v_new8, cache_seqlens=cache_seqlens, **scales)),
            ("FP8 cache, float16 new tokens",
             lambda: flash_attn_with_kvcache(q8, k8, v8, k_new, v_new, cache_seqlens=cache_seqlens, **scales)),
            ("FP8 cache, quantize_with + step",
             lambda: flash_attn_with_kvcache(q8, k8, v8, fp8.quantize_with(k_new, kd), fp8.quantize_with(v_new, vd),
                                             cache_seqlens=cache_seqlens, **scales)),
            ("FP8 cache, float16 q and new tokens",
             lambda: flash_attn_with_kvcache(q_step, k8, v8, k_new, v_new, cache_seqlens=cache_seqlens, k_descale=kd,
                                             v_descale=vd)),
        )
    if args.fp8:
        # The FP8 kernels on the stand-in's CPU tensors (the dispatch takes them on CUDA devices only), and V's
        # keys-fastest copy by its Triton kernel, as on a GPU (off it torch copies).
        fp8.kernels_run = lambda device, headdim, dropout_p: headdim > 16 and dropout_p == 0
        forward._torch_transposes = lambda device: False
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x.detach()) for x in (q, k, v))
        v8_keys, vd_keys = fp8.quantize(v.detach(), keys_fastest=True)

        # packed: the same tokens as two sequences, descales per (sequence, head)
        cu_fp8 = torch.tensor([0, 64, 128], dtype=torch.int32)
        (q8p, qdp), (k8p, kdp), (v8p, vdp) = (fp8.quantize_varlen(x.detach().reshape(-1, 4, 64), cu_fp8)
                                              for x in (q, k, v))
        steps = (("float16 forward, no grad", forward_no_grad),)
        for setting, label in (("1", "plans on"), ("0", "plans off")):  # (set before each step's calls)
            env = {"FLASHTILE_LAUNCH_PLANS": setting}
            steps += ((f"FP8 forward, v in rows, {label}", lambda: flash_attn_func(
                          q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd), env),
                      (f"FP8 forward, v keys-fastest, {label}", lambda: flash_attn_func(
                          q8, k8, v8_keys, causal=True, q_descale=qd, k_descale=kd, v_descale=vd_keys), env),
                      (f"FP8 varlen forward, {label}", lambda: flash_attn_varlen_func(
                          q8p, k8p, v8p, cu_fp8, cu_fp8, 64, 64, causal=True, q_descale=qdp, k_descale=kdp,
                          v_descale=vdp), env))
    if args.floors and not args.decode:
        steps = (*steps,
                 ("null forward", lambda: _Null.apply(q, k, v)),
                 ("null forward+backward", lambda: torch.autograd.grad(_Null.apply(q, k, v), (q, k, v), dout)),
                 ("ATen op forward+backward", lambda: torch.autograd.grad(q.mul(1.0), (q,), dout)))
    width = max(len(name) for name, *_ in steps)
    for name, fn, *env in steps:
        os.environ.update(*env)  # (a step's settings, if it has any)
        for _ in range(50):
            fn()
        launches_before = Launcher.launches
        fn()
        per_call = Launcher.launches - launches_before
        best = float("inf")
        for _ in range(args.loops):
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - start) / args.calls)
        what = "Triton's JIT launch stubbed" if args.stub_jit else "Triton's launch path, no driver call"
        launches = f", {per_call} kernel launches per call" if not args.stub_jit else ""
        print(f"{name:{width}s} {best * 1e6:7.1f} us per call (host only; {what}{launches})")
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            steps[-1][1]()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


class _Null(torch.autograd.Function):
    """What any Python attention op pays: an autograd.Function that saves what flashtile's saves, launches nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1])
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _compiled_decoding_step(calls: int, layers: int = 4) -> None:
    """Host time of a compiled decoding step: each layer appends one token per sequence to its own contiguous
    cache (GQA 8/2 heads, 128 positions) with one cache_seqlens tensor, through the decoding op."""
    k_caches, v_caches = ([torch.randn(2, 128, 2, 64, dtype=torch.float16) for _ in range(layers)] for _ in range(2))
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([100, 120], dtype=torch.int32)

    def step(q, k_new, v_new, seqlens):
        out = q
        for i in range(layers):
            out = flash_attn_with_kvcache(out, k_caches[i], v_caches[i], k_new, v_new, cache_seqlens=seqlens)
        return out

    compiled = torch.compile(step, fullgraph=True)
    for setting in ("0", "1", "0", "1"):  # twice each, alternating
        os.environ["FLASHTILE_LAUNCH_PLANS"] = setting
        for _ in range(10):
            compiled(q, k_new, v_new, seqlens)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                compiled(q, k_new, v_new, seqlens)
            best = min(best, (time.perf_counter() - start) / calls)
        print(f"launch plans {'on' if setting == '1' else 'off'}: {best * 1e6:7.1f} us per compiled {layers}-layer "
              "decoding step (host only)")


def _growing_cache_loop(layers: int = 16, steps: int = 100) -> None:
    """Host time per decoding step of a Hugging Face-like loop (no grad): each step concatenates one token to a
    BHSD cache and every layer attends it as BSHD views. At lengths no step saw, the first layer's call is
    recorded (the family rule, flashtile/_ops.py) and the others replay; at lengths seen before, all replay."""
    q = torch.randn(2, 8, 1, 64, dtype=torch.float16).transpose(1, 2)

    def loop(start: int) -> float:
        k = torch.randn(2, 2, start, 64, dtype=torch.float16)
        begin = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                k = torch.cat([k, torch.randn(2, 2, 1, 64, dtype=torch.float16)], 2)
                keys, values = k.transpose(1, 2), (k + 1).transpose(1, 2)
                for _ in range(layers):
                    flash_attn_func(q, keys, values, causal=True)
        return (time.perf_counter() - begin) / steps

    loop(300)
    new = loop(400)
    seen = loop(400)
    print(f"{layers}-layer step: {new * 1e6:.0f} us at new lengths, {seen * 1e6:.0f} us at lengths seen before "
          "(host only, the step's concatenations included)")


if __name__ == "__main__":
    main()
