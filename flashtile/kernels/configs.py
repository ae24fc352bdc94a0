"""Tile shapes, pipeline depths and warp counts: the one place launch parameters come from.

Each kernel is wrapped in ``triton.autotune`` over the candidate list below, keyed on the shape bucket
(sequence lengths rounded up to a power of two), head dim, causal flag and dtype, so a choice is made
once per key and cached for the process (and on disk, in Triton's cache, across processes). The prune
hook keeps the head-dim class's candidates whose shared memory fits. On a GPU every survivor is timed
on first use; ``FLASHTILE_AUTOTUNE=0`` keeps only the first survivor (the default measured best for
the non-causal case), so the test suites compile one variant per kernel. The candidate lists hold the
winners of measurements on an H200 (benchmarks/RESULTS.md) and their neighbours.

Under ``TRITON_INTERPRET=1`` small tiles are used: the interpreter runs one program at a time on numpy
and its cost grows with the tile area.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
import threading
import warnings
from typing import TYPE_CHECKING

import triton
import triton.testing

# The oldest triton whose compilers build every kernel for every target (``compile_check``; with 3.4 the sm100
# backward fails to compile); refused here, before any kernel module defines its kernels (each imports this
# one first). The kernels have run on a GPU with triton 3.6 only.
MIN_TRITON = (3, 5)
if tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2]) < MIN_TRITON:
    raise RuntimeError(f"flashtile's Triton kernels need triton >= {'.'.join(map(str, MIN_TRITON))} (torch >= 2.9 "
                       f"brings it); this is triton {triton.__version__}. Upgrade torch and triton, or run the "
                       "PyTorch path: FLASHTILE_BACKEND=torch")
TRITON_36 = triton.__version__.startswith("3.6.")  # the version whose internals (direct launches, Gluon) are known
from triton.runtime import _async_compile  # noqa: E402 (after the check: older Tritons lack it)

if TYPE_CHECKING:
    import torch

# Shared memory per block on Hopper (sm90) is 227 KiB; leave room for the compiler's own scratch.
SMEM_BUDGET_BYTES = 200 * 1024


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def env_switch(name: str, default: str, choices: tuple[str, ...] = ("0", "1")) -> str:
    """An A/B switch's setting (docs/settings.md), read once at import: its value, one of ``choices``. Any other value
    is an error at import, before any kernel is built, as it would otherwise read as one of them without a word."""
    setting = os.environ.get(name, default)
    if setting not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {setting!r}")
    return setting


_PDL_ON = {"PDL": True, "launch_pdl": True}


def pdl_options(device) -> dict:
    """Keyword arguments that launch a kernel with programmatic dependent launch, for the kernels that take a
    ``PDL`` switch (``{}``: an ordinary launch). Lab switch ``FLASHTILE_PDL=1``, off by default; sm90 and later.

    Such a launch may start while the previous kernel on the stream still runs; the kernel's ``PDL`` code
    waits for that kernel's completion (``griddepcontrol.wait``) before any other instruction that reads or
    writes global memory, and lets the next such kernel launch at once (``griddepcontrol.launch_dependents``),
    so the launch's latency and the programs' setup run under the previous kernel's last wave. Only a kernel
    compiled with that wait may be launched so: both come from these options together."""
    if os.environ.get("FLASHTILE_PDL", "0") != "1" or interpreting() or getattr(device, "type", None) != "cuda":
        return {}
    target = target_of(device)  # (cached per device; NVIDIA only: griddepcontrol is PTX)
    return _PDL_ON if target.vendor == "nvidia" and target.arch >= 90 else {}


def autotune_enabled() -> bool:
    """Time every candidate (default on a GPU) unless ``FLASHTILE_AUTOTUNE=0``."""
    return os.environ.get("FLASHTILE_AUTOTUNE", "1") != "0" and not interpreting()


def host_descriptors(tensors, block_d: int, use_tma: bool, packed: bool) -> tuple | None:
    """4-D TMA descriptors made on the host over dense (batch, seqlen, heads, head_dim) tensors, or None
    (the kernel then makes its own per program, or loads without TMA): without TMA (``use_tma``), for
    packed sequences (each program's descriptor must stop at its own sequence's end), or where a stride
    is 0 (a broadcast dimension). Their boxes, (1, rows, 1, block_d), get the tile's rows from
    ``fit_host_descriptors`` at each launch."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if (not use_tma or packed or not _HOST_DESCRIPTOR_HOOKS
            or any(stride <= 0 for t in tensors for stride in t.stride()[:-1])):
        return None
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 1, block_d]) for t in tensors)


def fit_host_descriptors(kernel, names: tuple[str, ...], rows: str) -> None:
    """Register a pre-run hook on an autotuned kernel: with ``HOST_TMA`` its host-made descriptor
    arguments ``names`` load (1, rows, 1, BLOCK_D) boxes, rows being the tile parameter ``rows``. The tile
    is known only once the autotuner (or the remembered choice) has picked it, so the boxes are set
    before every launch, each timed candidate's included; JIT pre-run hooks, unlike config pre-hooks,
    leave Triton's on-disk record of the choice on. Arguments are positional, meta-parameters keywords,
    on every launch path (``launch``, the autotuner, ``_DirectLaunch``)."""
    indices = [kernel.fn.arg_names.index(name) for name in names]

    def fit(*args, **kwargs) -> None:
        if kwargs.get("HOST_TMA"):
            box = [1, kwargs[rows], 1, kwargs["BLOCK_D"]]
            for index in indices:
                args[index].block_shape = box
            if kwargs.get("FP8") == 2:  # the forward's keys-fastest V: (batch, heads, head_dim, keys) boxes
                args[indices[-1]].block_shape = [1, 1, kwargs["BLOCK_D"], kwargs[rows]]

    fit.replayable = True  # a function of the launch's switches and tile only: a recorded plan keeps its boxes
    if not hasattr(kernel.fn, "add_pre_run_hook"):  # the interpreter of triton 3.5: kernels make their own
        global _HOST_DESCRIPTOR_HOOKS
        _HOST_DESCRIPTOR_HOOKS = False
        return
    kernel.fn.add_pre_run_hook(fit)


_HOST_DESCRIPTOR_HOOKS = True  # whether fit_host_descriptors could register its hooks


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """An extra CUDA stream per (device, current stream), made once, for the backward's dQ pass beside
    its dK/dV pass, at the current stream's priority. Taken from PyTorch's pool (``torch.cuda.Stream``),
    which hands out its streams in turn, so it may be one that other code also uses: work on it stays
    ordered by the events of ``wait_stream``, and the caller checks that it is not the current stream
    itself. (Streams are not freed; a graph may capture work forked onto it from the capturing stream.)"""
    import torch

    current = torch.cuda.current_stream(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), current.cuda_stream)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0], priority=current.priority)
    return _SIDE_STREAMS[key]


def compile_only() -> bool:
    """``FLASHTILE_AUTOTUNE=compile``: compile and run every candidate once, time none, remember no
    choice. Several such processes fill Triton's on-disk cache in parallel (benchmarks/gpu_run.sh),
    so that the process that then tunes and measures spends its time on the GPU, not in compilers."""
    return os.environ.get("FLASHTILE_AUTOTUNE", "1") == "compile"


def keep_choices_on_disk(*kernels) -> None:
    """Autotuning choices are kept in Triton's cache across processes, except in compile-only runs,
    whose untimed choices must not be found later (``TRITON_CACHE_AUTOTUNING=1`` would store them too:
    Triton ORs it into ``cache_results``, hence the attribute set here, after construction), and with
    ``FLASHTILE_AUTOTUNE_CACHE=0``: the test suite sets it, since choices timed while a dozen workers share
    a GPU were found by a later benchmark run and cost it up to 22% at three points (H200, 2026-11-30;
    docs/tuning.md). Read when the kernel modules are imported."""
    store = os.environ.get("FLASHTILE_AUTOTUNE_CACHE", "1") != "0"
    for kernel in kernels:
        kernel.cache_results = store and not compile_only() and not interpreting()


def compile_threads() -> int:
    """Threads that compile a key's tile candidates side by side before the autotuner times them
    (``FLASHTILE_COMPILE_THREADS``; default up to 8, one per core; 1 compiles them one by one as Triton's
    autotuner does). The compiler's passes and ptxas run outside Python's lock for much of the time."""
    setting = os.environ.get("FLASHTILE_COMPILE_THREADS", "")
    if setting.strip():
        return max(1, int(setting))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def compile_candidates_together(kernel) -> None:
    """Make an autotuned kernel compile all of a key's surviving candidates at once, on
    ``compile_threads()`` threads (Triton's ``AsyncCompileMode``), when it starts timing them; Triton's
    autotuner would compile each just before timing it. Nothing changes for a key whose choice is found
    (in memory or on disk), which times nothing. A candidate that fails to compile here is compiled again,
    and its error handled, by the autotuner's own timing of it."""
    bench_one = kernel._bench

    def bench(*args, config, **meta):
        # The autotuner times the pruned candidates in their order: the first one starts a tuning. (No
        # reference to the tuning's arguments is kept: they may be a whole KV cache.)
        if config is kernel.prune_configs(meta)[0]:
            _compile_all(kernel, args, meta)
        return bench_one(*args, config=config, **meta)

    kernel._bench = bench


def _compile_all(kernel, args, meta) -> None:
    if compile_threads() <= 1 or interpreting() or _async_compile.active_mode.get() is not None:
        return
    candidates = kernel.prune_configs(meta)
    launch_kwargs = {name: value for name, value in meta.items() if name != "warmup"}
    # (the autotuner compiles each candidate again and reports its error)
    _compile_on_threads([functools.partial(kernel.fn.warmup, *args, **launch_kwargs, **config.all_kwargs())
                         for config in candidates])


def _compile_on_threads(warmups: list) -> None:
    """Call each of ``warmups`` (a kernel's compile-only call: ``warmup``, or ``run`` with ``warmup=True``) under
    Triton's ``AsyncCompileMode``, so that their compiles run side by side on up to ``compile_threads()`` threads,
    then build the compiled kernels' launchers on the same threads (``_build_launcher``); returns when all are done.
    A compile that fails is left for the kernel's next call to repeat and report."""
    if len(warmups) < 2:
        return
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(min(compile_threads(), len(warmups)))
    try:
        mode = _async_compile.AsyncCompileMode(pool, ignore_errors=True)
    except TypeError:  # triton 3.5: no ignore_errors; a failed compile ends its exit early, its mode still set
        mode = _async_compile.AsyncCompileMode(pool)
    try:
        with pool:
            with mode:
                kernels = [warmup() for warmup in warmups]
            sources = set()  # (a tuning's candidates share one launcher source: built once)
            for kernel in filter(None, map(_unbuilt_launcher, kernels)):
                source = (tuple(map(str, kernel.src.signature.values())),
                          repr(getattr(kernel.metadata, "tensordesc_meta", None)))
                if source not in sources:
                    sources.add(source)
                    pool.submit(_build_launcher, kernel)
    except Exception:
        pass
    finally:
        _async_compile.active_mode.set(None)


def _unbuilt_launcher(kernel):
    """The compiled kernel behind a compile-only call's result (a compiled kernel or a future of one) whose launcher
    is not made yet, else None."""
    try:
        if hasattr(kernel, "result"):
            kernel = kernel.result(ignore_errors=True)
        return kernel if kernel is not None and getattr(kernel, "_run", None) is None else None
    except Exception:
        return None


def _build_launcher(kernel) -> None:
    """Build a compiled kernel's launcher ahead of its first launch. Triton 3.6 makes each kernel's launcher on that
    launch, a C module built by the system compiler (0.4-0.55 s on the CI machine) unless its cache directory holds
    one for that source (the argument types and TMA descriptors' layout); built here on a compile thread, the first
    launch finds it there. Errors are left for the launch to raise."""
    from triton.runtime.driver import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:
        pass


def autotune_bench(kernel_call, quantiles):
    """Timing hook of ``triton.autotune``: with tuning off the single surviving config is not timed."""
    if compile_only():
        kernel_call()
        return [0.0 for _ in quantiles]
    if not autotune_enabled():
        return [0.0 for _ in quantiles]
    # 25 ms of warm-up per candidate, not Triton's 5: the first candidates of a key may otherwise be
    # timed while an idle GPU's clocks are still rising (an H200 idles at 345 MHz). A guess at why two
    # grids differed by 3-8% on the same forward kernels, not a measured cause.
    return triton.testing.do_bench(kernel_call, warmup=25, rep=40, quantiles=quantiles)


def _tma_allocator(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


TMA_MIN_ROWS = 16


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    # torch.cuda.get_device_capability reads the device properties each call: ~17 µs per launch on the
    # H200 machine's host (profile_call.py --cprofile), three launches per forward+backward.
    import torch

    return torch.cuda.get_device_capability(device_index)


def use_tma(*tensors, rows: int) -> bool:
    """Whether the copy engine (TMA descriptors: made on the host for dense inputs, the streamed ones
    of the forward and both backward passes; in the kernel otherwise) can load these BSHD tensors.

    Needs a target with TMA (``Target.tma``: sm90, sm100), 16-byte aligned base addresses and 16-byte
    multiples for every stride but the last, and at least ``TMA_MIN_ROWS`` rows (the sequence length the
    descriptors cover): short sequences gain nothing from it, and Triton specializes a length of 1 into a
    constant, for which triton 3.6 failed to compile descriptor code (a ptxas crash in the forward, a pipeliner error
    in the backward; seen on the H200). ``FLASHTILE_TMA=0`` turns it off; ``FLASHTILE_TMA=1`` also asks
    the interpreter.
    """
    setting = os.environ.get("FLASHTILE_TMA", "auto")
    if setting == "0" or rows < TMA_MIN_ROWS:
        return False
    first = tensors[0]
    if interpreting():
        # The interpreter emulates descriptors; only an explicit FLASHTILE_TMA=1 asks for that (tests).
        if setting != "1":
            return False
    else:
        if not first.is_cuda or not target_of(first.device).tma:
            return False
    for t in tensors:
        elem = t.element_size()
        if t.data_ptr() % 16 or any((s * elem) % 16 for s in t.stride()[:-1]):
            return False
    if not interpreting():
        # Device-side descriptors live in a scratch buffer from this allocator. Triton keeps the
        # allocator per thread (a ContextVar) and autograd runs the backward on its own thread, so it
        # is set on every call that uses TMA.
        triton.set_allocator(_tma_allocator)
    return True


PACK_GQA_MAX_ROWS = 128


def pack_gqa(nheads: int, nheads_k: int, seqlen_q: int, per_head_state: bool) -> bool:
    """Whether the forward packs the query heads of each KV head into one block (``PACK_GQA``).

    Worth it when the queries are few (decoding, chunked prefill): then the K/V reads dominate and
    packing divides them by the group size. Long queries re-read K/V from L2 anyway and keep the
    plain layout. Dropout and block-sparse masks index by head, so they keep it too.
    """
    group = nheads // nheads_k
    return group > 1 and seqlen_q * group <= PACK_GQA_MAX_ROWS and not per_head_state


@functools.cache
def multiprocessors(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (``get_device_properties`` costs microseconds a call)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The Gluon forward (``gluon_forward``: warp-specialized, TMA, wgmma) where it measured faster than the Triton
# forward on an H200 (docs/tuning.md, "Gluon forward"; the tables in git,
# `git show f485c4b:benchmarks/RESULTS.md`): (head_dim, causal) -> tiers ((from_length, variant,
# tile), ...) by increasing length. A dense call takes the last tier that both its lengths reach; a shorter one,
# the Triton forward's smaller tiles. Packed calls take the last tier of at most two consumers (from
# GLUON_VARLEN_MIN_MEAN below; ``gluon_tier``).
# - Without a causal mask (benchmarks/lab/gluon_bench.py at 256-1024 tokens, 16k tokens a call): at 512 tokens
#   the Gluon kernel ran 1.27x the Triton forward at d = 64 and 1.10x at d = 128; at 256 tokens 0.86x and 0.54x.
# - d = 64 causal: 1.09-1.21x the Triton forward at 512-16384 tokens (kernel time, benchmarks/lab/dispatch_choice.py)
#   once its diagonal mask stopped costing 60 registers a thread (two programs per multiprocessor).
# - d = 128 causal: single-ffma 128x64 ran 1.21x and 1.14x the Triton forward at 512 and 1,024 tokens, and 1.05x
#   pingpong-fa3 at 1,024; from 2,048 pingpong-fa3 leads (dispatch_choice.py).
# - d = 128, from 4,096 tokens: a third K/V stage, since the named turns and releases (edb64b3): 1.007-1.020x two
#   stages at 4,096-16,384 tokens without a mask and 1.002-1.010x causal, 0.988-0.999x at 1,024 and 2,048
#   (dispatch_choice.py, two runs; docs/tuning.md). Packed calls take it too (the last tier): 0.999-1.008x two
#   stages at means of 2,048-8,192 tokens (dispatch_choice.py --varlen, two runs).
# - d = 256: 1.32-1.43x the Triton forward at 1024-16384 tokens, causal or not (1,024: the shortest measured).
# - d = 64, from 4,096 tokens: three consumers (pingpong3-fa3, 192 query rows a program, 16-bit P in registers)
#   ran 1.06-1.10x single-ffma without a mask at 4,096-16,384 tokens and 1.03-1.12x causal (one H100, two runs
#   of dispatch_choice.py, 2026-12-07; a third K/V stage 0.99x two). Shorter lengths are not measured. Packed
#   calls keep single-ffma (``gluon_tier``: the varlen kernel is not tested with three consumers).
GLUON_FORWARD = {
    (64, False): ((512, "single-ffma", (128, 128, 2, 8)), (4096, "pingpong3-fa3", (192, 128, 2, 12))),
    (64, True): ((512, "single-ffma", (128, 128, 2, 8)), (4096, "pingpong3-fa3", (192, 128, 2, 12))),
    (128, False): ((512, "pingpong-fa3", (128, 128, 2, 8)), (4096, "pingpong-fa3", (128, 128, 3, 8))),
    (128, True): ((512, "single-ffma", (128, 64, 2, 8)), (2048, "pingpong-fa3", (128, 128, 2, 8)),
                  (4096, "pingpong-fa3", (128, 128, 3, 8))),
    (256, False): ((1024, "pingpong-fa3", (128, 64, 2, 8)),),
    (256, True): ((1024, "pingpong-fa3", (128, 64, 2, 8)),),
}
# Packed sequences (flash_attn_varlen_func): the Gluon kernel where their mean query and key lengths are at
# least this, by (head_dim, causal) (total tokens / sequences: a host-side number, no read of cu_seqlens). On
# an H200 (benchmarks/lab/gluon_bench.py --varlen, 16k tokens of lengths 0.25-1.75x the mean): d = 64/128 ran
# 1.03-1.07x the Triton varlen forward at these means and above, below them 0.62-1.00x (d=128 causal at a mean
# of 2048: 0.91x), but for one point, d=64 at a mean of 256 (1.17x), which no other short mean bore out;
# d = 256 1.10-1.24x from these means up, 0.94x causal at a mean of 512. Kernel times through
# flash_attn_varlen_func (benchmarks/lab/dispatch_choice.py --varlen) bore out d = 64/128 and put d = 64 causal
# (since its mask's fix) at 1.03x from a mean of 2048 and 1.08x at 4096, 0.79-0.87x below.
GLUON_VARLEN_MIN_MEAN = {(64, False): 2048, (128, False): 2048, (64, True): 2048, (128, True): 4096,
                         (256, False): 512, (256, True): 2048}


def gluon_forward_choice(q, k, v, opts, varlen=None) -> tuple[str, tuple] | None:
    """(variant, tile) of the Gluon forward for a 16-bit call on an sm90 GPU, or None (the Triton forward).
    Plain attention only: causal or not, MHA/GQA, no window, softcap, ALiBi, sink, dropout or block mask;
    both lengths reaching a tier of ``GLUON_FORWARD`` (dense; the longest tier reached gives the kernel) or, for
    packed sequences (``varlen``: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of contiguous int32
    cumulative lengths), mean lengths at least ``GLUON_VARLEN_MIN_MEAN[head_dim, causal]`` (its last tier of at most two
    consumers, ``gluon_tier``);
    inputs the copy engine can read in place (16-byte aligned base, outer strides positive multiples of 16
    bytes); triton 3.6 (the kernel is written against its Gluon API); the GPU itself sm90 (whatever
    ``FLASHTILE_TARGET`` forces). ``FLASHTILE_GLUON=0`` or ``FLASHTILE_TMA=0`` turns it off."""
    import torch

    if not _plain_attention(q, k, v, opts):
        return None
    causal = opts.right_limit == 0
    if varlen is None:
        headdim, heads = q.shape[3], q.shape[0] * q.shape[2]
        choice = gluon_tier(headdim, causal, min(q.shape[1], k.shape[1]))
    else:
        cu_q, cu_k = varlen[:2]
        if not all(isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu.dim() == 1 and cu.stride(0) == 1
                   for cu in (cu_q, cu_k)) or cu_q.shape != cu_k.shape:
            return None
        sequences = cu_q.shape[0] - 1
        min_mean = GLUON_VARLEN_MIN_MEAN.get((q.shape[2], causal))
        if min_mean is None or sequences <= 0 or min(q.shape[0], k.shape[0]) < min_mean * sequences:
            return None
        headdim, heads = q.shape[2], sequences * q.shape[1]
        choice = gluon_tier(headdim, causal)
    if (choice is None or v.shape[-1] != headdim or heads > 65535
            or not _gluon_device(q.device) or not all(map(_tma_ready, (q, k, v)))):
        return None
    return choice


# The Gluon FP8 forward (``gluon_forward.gluon_attention_forward_fp8``: at d = 64 and 128 three consumer warpgroups
# taking turns, 192 query rows a program; at d = 256 two) where it ran faster than the Triton FP8 forward, by
# (head_dim, causal): (from this shorter length, variant, tile). On an H100 (benchmarks/RESULTS.md, "FP8";
# gluon_bench.py --fp8), d = 128, two processes: without a mask 1.17x at 4,096 tokens, 1.15x at 8,192, 1.11-1.18x at
# 16,384; causal 1.03x at 8,192, 1.02-1.13x at 16,384, 0.95-0.99x at 4,096, where since its consumers skip the tiles
# past their rows (102150b) it ran 1.05x; at 2,048 tokens 1.08x without a mask, 0.90x causal, at 1,024 0.97x and
# 0.87x (one process, 8bcd6f3). Two consumers (the 16-bit kernel's ping-pong) ran 0.97-1.06x the Triton kernel.
# d = 64 (three consumers; one process, 2026-12-05): 1.31x the Triton FP8 forward at 2,048 tokens without a mask,
# 1.38x at 8,192; causal 1.10x and 1.25x. d = 256 (two consumers, 128-key tiles; the 16-bit kernel's 64-key tiles
# ran 0.78-0.83x them): 1.48-1.59x without a mask, 1.45-1.73x causal, at 2,048 and 8,192 tokens.
# Fixed at import (an A/B switch, docs/settings.md): the sm90 forward's ping-pong consumers take turns and release
# stages by named barriers ("1") or by mbarriers ("0"); read here for the kernel (``gluon_forward._NAMED_SYNC``) and
# for the FP8 dispatch, whose three consumers have named turns only.
FWD_NAMED_SYNC = env_switch("FLASHTILE_FWD_NAMED_SYNC", "1") == "1"
# Fixed at import (an A/B switch, docs/settings.md): where the sm90 forward takes a row's max of a score tile in a tree
# (``gluon_forward._row_max``) instead of Triton's reduction, one chain of a thread's values: "fp8" (the default) the
# FP8 forward with three consumers, "1" every forward, "0" none (``gpu_run.sh tree`` tests and times it).
FWD_TREE_MAX = env_switch("FLASHTILE_FWD_TREE_MAX", "fp8", ("fp8", "1", "0"))
# Read at import (a switch for A/B runs, benchmarks/lab/env_ab.py --mode fwd8): whether the FP8 Gluon forward takes
# P V's P from registers where K's layout lets its keys be loaded permuted (gluon_forward._permuted_k_descriptor):
# "wait" (the default) rounded into its operand registers after the P V before completed, "carry" kept in float32
# until its own P V (two consumers only: three spill), "0" P through shared memory. Where it applies
# (gluon_attention_forward_fp8): the dispatch's three consumers at d = 64, 1.03-1.07x P through shared memory on an
# H100; two consumers at d <= 128 (0.995-1.15x; not the dispatch's at d = 128, where three through shared memory run
# faster still).
FP8_P_REGISTERS = env_switch("FLASHTILE_FP8_P_REGISTERS", "wait", ("wait", "carry", "0"))
# Read at import (an A/B switch, env_ab.py): whether the sm90 Gluon forward skips O's rescale by alpha in a warp whose
# rows kept their running max (gluon_forward._rescale): "0" never skips, "exact" skips only where every alpha is 1 (the
# same bits as "0"), "1" also keeps a row's max until a tile's exceeds it by more than a threshold (8 in log2 units for
# 16-bit P, as FA4 does; 0.75 for FP8, whose P, exp2(s - m + 8), must stay within e4m3's 448), so that a warp
# almost never rescales after its first tiles ("1", the default).
FWD_RESCALE_SKIP = env_switch("FLASHTILE_FWD_RESCALE_SKIP", "1", ("0", "exact", "1"))
# Read at import (an A/B switch, env_ab.py): "1" the sm90 Gluon forward's overlapped consumers keep each row's running
# sum l as four partial sums, one per lane of the row's quad (gluon_forward._lane_tree), summed once after the last
# key tile (the default), instead of summing across the quad by shuffles every tile ("0").
FWD_LANE_SUM = env_switch("FLASHTILE_FWD_LANE_SUM", "1")
# Read at import (an A/B switch, env_ab.py --mode fwd8): "1" where the FP8 Gluon forward's P goes through shared memory
# and K's keys can be loaded permuted (as for FP8_P_REGISTERS), load them so, and store each thread's 4 adjacent keys
# of P as one 32-bit word (gluon_forward._stage_p; the default): half the shared-memory stores of 2-key pairs; "0"
# K in key order, P stored by pairs.
FP8_P_WORDS = env_switch("FLASHTILE_FP8_P_WORDS", "1")
# Read at import (an A/B switch, env_ab.py --mode fwd): "1" the sm90 Gluon forward's overlapped consumers round P to
# 16 bits two keys at a time into one 32-bit word by inline PTX (gluon_forward._p_operand), the register P V reads,
# instead of Triton's conversion, whose halves ptxas joins again by a byte permute each (the default); "0" the latter.
FWD_P_PAIRS = env_switch("FLASHTILE_FWD_P_PAIRS", "1")
# Read at import (an A/B switch, env_ab.py --mode fwd8): of each 8 exponentials of P in the FP8 Gluon forward at
# d <= 128, how many (0, 1 or 2) are computed by a cubic polynomial on the FMA pipe instead of MUFU's ex2
# (gluon_forward._exp2_split): with FP8 operands the 64 exponentials a thread issues per tile need as many MUFU
# cycles as the tile's two wgmmas need tensor-core cycles; yet on an H100 "1" ran 0.95-0.98x and "2" 0.92-0.94x
# "0" (benchmarks/RESULTS.md): MUFU is not the bound. "0" (the default): all on MUFU.
FP8_EXP2_POLY = env_switch("FLASHTILE_FP8_EXP2_POLY", "0", ("0", "1", "2"))
# Read at import (a lab switch for A/B runs, env_ab.py --mode fwd8 / gluon_bench.py --fp8): "1" the FP8 Gluon forward's
# two-consumer variants, and three consumers at d = 64, load each consumer's Q tile into registers once, so that every
# Q Kᵀ wgmma reads only K from shared memory (gluon_forward._overlap_mainloop); "0" (the default) Q from shared
# memory. (Three consumers at d = 128 have no 16 registers to spare.)
FP8_Q_REGISTERS = env_switch("FLASHTILE_FP8_Q_REGISTERS", "0")
GLUON_FP8_FORWARD = {(128, False): (2048, "pingpong3-fa3", (192, 128, 2, 12)),
                     (128, True): (4096, "pingpong3-fa3", (192, 128, 2, 12)),
                     (64, False): (2048, "pingpong3-fa3", (192, 128, 2, 12)),
                     (64, True): (2048, "pingpong3-fa3", (192, 128, 2, 12)),
                     (256, False): (2048, "pingpong-fa3", (128, 128, 2, 8)),
                     (256, True): (2048, "pingpong-fa3", (128, 128, 2, 8))}


def gluon_fp8_forward_choice(q, k, v, opts, fp8) -> tuple[str, tuple] | None:
    """(variant, tile) of the Gluon FP8 forward for a dense call on FP8 q, k, v (``attention_forward``'s ``fp8``:
    three descales, not a cache) on an sm90 GPU, or None (the Triton FP8 forward): plain attention as
    ``gluon_forward_choice`` takes it, both lengths reaching ``GLUON_FP8_FORWARD``'s for (head_dim, causal). Three
    consumers take turns by named barriers only: ``FLASHTILE_FWD_NAMED_SYNC=0`` (mbarriers, an A/B switch of the
    16-bit forward) leaves FP8 calls to the Triton kernel."""
    if fp8 is None or fp8[4] or any(descale is None for descale in fp8[:3]):
        return None
    if not FWD_NAMED_SYNC:
        return None
    if not _plain_attention(q, k, v, opts, fp8=True):
        return None
    headdim = q.shape[3]
    tier = GLUON_FP8_FORWARD.get((headdim, opts.right_limit == 0))
    if (tier is None or min(q.shape[1], k.shape[1]) < tier[0] or v.shape != k.shape or k.shape[3] != headdim
            or q.shape[0] * q.shape[2] > 65535 or not _gluon_device(q.device)):
        return None
    return tier[1], tier[2]


# The Gluon one-pass backward (``gluon_backward``, ``one_pass="fixed"``, warp-specialized: dQ's shares added as int32
# counts by the copy engine, the same bits every run, though not the two passes' bits) where it measured faster
# than the Triton two passes on an H200 (docs/tuning.md, "Backward: the one pass"; the tables in git, `git show
# f485c4b:benchmarks/RESULTS.md`, "Against FA4"): (head_dim, causal) -> the shorter length from which a dense call
# takes it. d = 128 without a mask: 1.01-1.07x at 4,096 tokens (against the two
# passes at their default and tuned tiles, runs of several days), 1.05-1.11x at 16,384. Causal: 0.95-1.03x at
# 4,096 tokens, so from 8,192, where a compiled GPT's step (2 x 8,192 tokens, 8 heads) ran 0.980x SDPA's with it
# against 0.958-0.961x without; 1.07-1.14x at 16,384. d = 64 (64-row tiles): 0.90-1.03x. Since a1d1a52 the
# pipelined loop, 1.00-1.05x the plain one; at causal 4,096 it ran 1.09-1.11x the Triton passes at their default
# tiles, 0.99-1.11x against their tuned runs (387 and 414 TFLOP/s); moved since (below).
# d = 64 causal from 16,384 with 128-row query tiles (``gluon_backward.ONE_PASS_TILES``): 1.07-1.09x the Triton
# passes there in three runs (2026-12-03); at 4,096 tokens 0.93-0.95x, without a mask 0.94-1.02x.
# Since the one pass replays launch plans (2026-12-03), d = 128 from 2,048 tokens without a mask (kernels 1.07x the
# Triton passes there, a b=4 x 16-head eager forward+backward 0.96x their wall time, two runs each) and from 4,096
# causal (kernels 1.07-1.11x in five runs over two days; at 2,048 causal 1.05x, but 1.02x the wall time).
# Since d = 64's dQ share is split by query rows (2026-12-03: the one pass 1.03-1.10x faster), d = 64 from 4,096
# tokens without a mask (1.09-1.10x the Triton passes at their default tiles there, 1.12x at 8,192, 1.14x at 16,384;
# at 2,048 1.03x) and from 8,192 causal (1.04-1.06x; at 4,096 1.00x). Three runs, two of them the split.
# Since the small backward's two launches and delta made by the units' kernel (2026-12-03, b837003): d = 128 causal
# from 2,048 too (kernels 1.02x and 1.02x in two rounds; eager forward+backward wall time 0.97x at b=4 and 0.89x at
# b=1, 16 heads, two processes each). At d = 64 the kernels ran 1.06x at 2,048 without a mask and 1.03-1.07x at 4,096
# causal, but the wall time 0.98-1.01x and 1.01x: unchanged.
# d = 64 without a mask from 2,048 since 2026-12-04: in the speed grid the two passes ran 354 TFLOP/s there (1.335x SDPA
# flash, under the grid's 1.35x target), the one pass 379 and 377 in two runs (1.42-1.43x); eager forward+backward wall
# time 0.96x at b=8 and 1.60x at b=1 (16 heads), where cuDNN's own time moved 1.54x between the same processes
# (backward_wall.py --rounds 2); against cuDNN in each process 1.08x against 1.09x at b=8, 1.36x against 1.31x at b=1
# (where the one pass launches four kernels to the two passes' two).
# d = 64 with the keys as M in FA3's order at 128 query rows (2026-12-04, dispatch_choice.py --backward, two rounds):
# without a mask from 1,024 tokens (1.08-1.11x the Triton passes there), causal from 2,048 (1.01-1.03x the Triton
# passes; at 1,024 0.76-0.91x).
GLUON_BACKWARD_MIN_SEQLEN = {(128, False): 2048, (128, True): 2048, (64, False): 1024, (64, True): 2048}
# Where the one pass takes the keys as M in FA3's order (``keys_as_m="fa3"``: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued
# together, dV's product before dSᵀ's store, dSᵀ double-buffered, the rows' statistics through shared memory;
# 64-row query tiles at d = 128, 128 at d = 64) instead of the pipelined loop: d = 128, where on an H200 (2026-12-04,
# one_pass_bench.py, 64x128 tiles both) it ran 1.03x/1.01x the pipelined loop without a mask at 4,096/16,384 tokens
# and 1.05x/1.04x causal; in a later run 1.04-1.07x without a mask and 1.02-1.05x causal at 2,048-16,384 tokens.
# d = 64 since its 128-row tile (``gluon_backward.KEYS_AS_M_TILES``, one dQ buffer; 2026-12-04; its 64-row tile had
# run 0.94-0.96x the loop's 128 rows): 1.04-1.14x the pipelined loop without a mask and 1.04-1.10x causal at
# 2,048-8,192 tokens; against cuDNN 0.97-1.04x and 0.94-0.99x (dispatch_choice.py --backward, two rounds).
GLUON_BACKWARD_KEYS_AS_M = {(128, False), (128, True), (64, False), (64, True)}


def _plain_attention(q, k, v, opts, fp8: bool = False, dropout: bool = False) -> bool:
    """A 16-bit (``fp8``: float8_e4m3fn) CUDA call without window, softcap, ALiBi, sink, dropout (but where
    ``dropout``) or block mask (causal or not), and the Gluon kernels not turned off (``FLASHTILE_GLUON=0``,
    ``FLASHTILE_TMA=0``, the interpreter): what the Gluon forward and backward serve."""
    import torch

    dtypes = (torch.float8_e4m3fn,) if fp8 else (torch.float16, torch.bfloat16)
    return not (q.dtype not in dtypes or not q.is_cuda or k.dtype != q.dtype
                or v.dtype != q.dtype or (opts.dropout_p > 0 and not dropout) or opts.block_mask is not None
                or opts.alibi_slopes is not None or opts.sink is not None or opts.softcap != 0
                or opts.left_limit is not None or opts.right_limit not in (None, 0) or _gluon_switched_off())


def _gluon_switched_off() -> bool:
    return (os.environ.get("FLASHTILE_GLUON", "1") == "0" or os.environ.get("FLASHTILE_TMA", "auto") == "0"
            or interpreting())


def _gluon_device(device) -> bool:
    """An sm90 target (``FLASHTILE_TARGET`` included) whose GPU and toolchain run the Gluon kernels."""
    return target_of(device).name == "sm90" and _gluon_runs_on(device.index)


def gluon_available(device) -> bool:
    """Whether the dispatch may take the Gluon kernels on ``device`` at all (a CUDA device): not turned off
    (``FLASHTILE_GLUON=0``, ``FLASHTILE_TMA=0``, the interpreter) and ``_gluon_device``."""
    return not _gluon_switched_off() and _gluon_device(device)


def gluon_backward_dropout() -> bool:
    """Whether the Gluon one pass takes dense calls with dropout (FA3's order, ``GLUON_BACKWARD_KEYS_AS_M``):
    ``FLASHTILE_GLUON_DROPOUT=1``; else they take the Triton two passes, which ran 1.16x faster on an H100
    (benchmarks/RESULTS.md, "Dropout")."""
    return os.environ.get("FLASHTILE_GLUON_DROPOUT", "0") == "1"


def gluon_backward_choice(q, k, v, dout, opts, varlen=None) -> bool:
    """Whether a backward takes the Gluon one pass: a dense call of ``_plain_attention`` on an sm90 GPU, both lengths
    at least ``GLUON_BACKWARD_MIN_SEQLEN[head_dim, causal]``, inputs the copy engine reads in place (with dropout,
    where ``gluon_backward_dropout`` and the keys as M in FA3's order serve the head dim)."""
    causal = opts.right_limit == 0
    # (the setting read only for a call with dropout: every backward passes here)
    dropout = opts.dropout_p > 0 and gluon_backward_dropout() and (q.shape[-1], causal) in GLUON_BACKWARD_KEYS_AS_M
    if (varlen is not None or q.dim() != 4 or dout.dtype != q.dtype
            or not _plain_attention(q, k, v, opts, dropout=dropout)):
        return False
    min_seqlen = GLUON_BACKWARD_MIN_SEQLEN.get((q.shape[3], causal))
    return (min_seqlen is not None and min(q.shape[1], k.shape[1]) >= min_seqlen and v.shape[3] == q.shape[3]
            and q.shape[0] * q.shape[2] <= 65535 and _gluon_device(q.device) and all(map(_tma_ready, (q, k, v, dout))))


# Variants of the Gluon forward with three consumers: dense calls only (packed calls take the tier before), and only
# with the named turns (FWD_NAMED_SYNC, which three consumers need).
THREE_CONSUMERS = ("pingpong3-fa3",)


def gluon_tier(headdim: int, causal: bool, length: int | None = None) -> tuple[str, tuple] | None:
    """(variant, tile) of ``GLUON_FORWARD``'s last tier for (headdim, causal) that ``length`` reaches, or None where
    there is none. ``length`` None: packed sequences, the last tier of a variant of at most two consumers. Under
    ``FLASHTILE_FWD_NAMED_SYNC=0`` no call takes three consumers (their turns are named barriers only)."""
    choice = None
    for from_length, variant, tile in GLUON_FORWARD.get((headdim, causal), ()):
        if variant in THREE_CONSUMERS and (length is None or not FWD_NAMED_SYNC):
            continue
        if length is None or length >= from_length:
            choice = (variant, tile)
    return choice


@functools.cache
def _gluon_runs_on(index: int | None) -> bool:
    """The Gluon kernels' toolchain and GPU: triton 3.6 with Gluon's Hopper module, and an sm90 device."""
    import torch

    if not TRITON_36:  # the Gluon API it is written against
        return False
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(index) == (9, 0)


def tma_ready_or_copy(t):
    """``t`` where a TMA descriptor can cover it in place (``_tma_ready``), else a contiguous copy."""
    return t if _tma_ready(t) else t.contiguous()


def _tma_ready(t) -> bool:
    """A tensor a TMA descriptor can cover in place: last dim contiguous, 16-byte aligned base, every other
    stride a positive multiple of 16 bytes (broadcast, stride-0 dims are kept off host descriptors)."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and s * size % 16 == 0 for s in t.stride()[:-1]))


def split_count(device, batch: int, nheads: int, nheads_k: int, seqlen_q: int, max_keys: int,
                per_head_state: bool) -> int:
    """Split-KV programs per query block when the call's own blocks leave the GPU idle (decoding, a few
    query tokens over many keys): as many splits as keep the programs within two per multiprocessor
    (rounded down: a third program on some of them makes those the last to finish), each split keeping
    at least 512 keys, at most 64 splits; 1 (no split) off CUDA devices.

    ``device``: the queries' torch device; ``per_head_state``: dropout or a block mask (no GQA packing).
    """
    if device.type != "cuda" or max_keys < 1024:
        return 1
    import torch

    if pack_gqa(nheads, nheads_k, seqlen_q, per_head_state):
        rows, programs = seqlen_q * (nheads // nheads_k), batch * nheads_k
    else:
        rows, programs = seqlen_q, batch * nheads
    blocks = programs * max(1, -(-rows // FEW_ROWS))
    sms = multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(2 * sms // blocks, max_keys // 512, 64))


def heads_per_section(num_heads: int, streamed_bytes_per_head: int, opts) -> int:
    """Heads that take their blocks together in the longest-first order (``common.schedule``).

    Only a causal limit without a left limit makes blocks differ much in work; otherwise 1, the
    head-by-head order whose consecutive programs share K/V in L2. The section's streamed K/V (or
    Q/dO in the dK/dV pass) is kept within ``FLASHTILE_L2_SECTION_MB`` (default 8, the best of
    0/8/24/64 measured on the H200 at s=4096, d=128: docs/tuning.md, "Causal schedule").
    """
    if opts.right_limit is None or opts.left_limit is not None:
        return 1
    return section_heads(num_heads, streamed_bytes_per_head)


def section_heads(num_heads: int, streamed_bytes_per_head: int) -> int:
    """``heads_per_section`` of a grid known to be causal (no left limit): as many heads, 1 to ``num_heads``, as
    stream at most ``FLASHTILE_L2_SECTION_MB`` together."""
    budget = int(float(os.environ.get("FLASHTILE_L2_SECTION_MB", "8")) * 2**20)
    return max(1, min(num_heads, budget // max(1, streamed_bytes_per_head)))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host (``triton.cdiv`` is a constexpr function: microseconds per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (>= 1), on the host."""
    return 1 << max(n - 1, 0).bit_length()


_CHOSEN: dict[tuple, triton.Config] = {}
_FIRST_CALL = threading.Lock()


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for one of the autotuned kernels, its tile choice remembered here.

    Triton's ``Autotuner.run`` rebuilds its key from every argument on each call (about 100 µs of Python
    for ~60 arguments, measured with benchmarks/lab/host_overhead.py: more than a short kernel runs). The
    first call of a key goes through it (tuning, or finding the choice on disk); later calls launch the
    chosen config directly (``_DirectLaunch``). The key here is at least as fine as Triton's: the
    sequence-length buckets (the last two positional arguments by convention of the launchers), every
    keyword argument (the compile-time switches) and q's dtype (every other tensor's dtype follows from
    it and the switches).
    """
    key = (kernel, args[0].dtype, args[-2], args[-1], *kwargs.items())
    _LAST_KEY[(kernel, kwargs.get("KV_GRADS", 3))] = key
    direct = _DIRECT.get(key)
    if direct is not None and direct(grid, args):
        return
    if _RECORDING_ON:
        _note_indirect()
    config = _CHOSEN.get(key)
    if config is None:
        # First call of a key: under a lock, since the choice is read back from the autotuner's shared
        # ``best_config`` after a launch that releases the GIL (and may compile for seconds); another
        # thread's first call of another key must not overwrite it in between.
        with _FIRST_CALL:
            config = _CHOSEN.get(key)
            if config is None:
                kernel[grid](*args, **kwargs)
                _CHOSEN[key] = kernel.best_config
                return
    full_kwargs = {**kwargs, **config.all_kwargs()}
    kernel.fn.run(*args, grid=grid, warmup=False, **full_kwargs)
    if direct is None and _direct_launch_possible(kernel.fn):
        _DIRECT[key] = _DirectLaunch(kernel.fn, full_kwargs)


_LAST_KEY: dict = {}  # (autotuned kernel, KV_GRADS) -> the key of its latest launch


def tiles_used(reset: bool = False) -> dict[str, str]:
    """The tile config of each autotuned kernel's latest launch since the last reset, by kernel name
    (the split dK/dV launches as ``_attn_bwd_dkdv[dV]`` and ``[dK]``), e.g.
    ``{"_attn_fwd": "BLOCK_M=128 BLOCK_N=64 warps=4 stages=3"}``: what a benchmark row ran.
    ``reset=True`` forgets them and returns {}."""
    if reset:
        _LAST_KEY.clear()
        _LAST_FIXED.clear()
        return {}
    used = dict(_LAST_FIXED)
    for (kernel, kv_grads), key in _LAST_KEY.items():
        config = _CHOSEN.get(key)
        if config is not None:
            tiles = " ".join(f"{name}={value}" for name, value in config.kwargs.items())
            name = kernel.fn.__name__ + {1: "[dV]", 2: "[dK]"}.get(kv_grads, "")
            cap = f" maxnreg={config.maxnreg}" if config.maxnreg else ""
            used[name] = f"{tiles} warps={config.num_warps} stages={config.num_stages}{cap}"
    return used


_LAST_FIXED: dict[str, str] = {}  # kernels of a fixed tile (the Gluon forward): name -> its tile, for tiles_used


def note_fixed_tile(name: str, tile: str) -> None:
    """Report a kernel without autotuning in ``tiles_used`` (its latest launch's tile)."""
    _LAST_FIXED[name] = tile


def launch_plain(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for a kernel without autotuning, through ``_DirectLaunch`` after
    its first call with these keyword arguments (inside ``compile_together``'s first run of a key: held, and made on
    its exit)."""
    held = _HELD_LAUNCHES.get()
    if held is not None:
        held.append((kernel, grid, args, kwargs))
        return
    key = (kernel, *kwargs.items())
    direct = _DIRECT.get(key)
    if direct is not None and direct(grid, args):
        return
    if _RECORDING_ON:
        _note_indirect()
    kernel.run(*args, grid=grid, warmup=False, **kwargs)
    if direct is None and _direct_launch_possible(kernel):
        _DIRECT[key] = _DirectLaunch(kernel, kwargs)


# compile_together: the launches held in this context (None: launches are made at once), and the keys whose launches
# were compiled together (cleared past 4,096: a key is a few of a call's properties).
_HELD_LAUNCHES: contextvars.ContextVar[list | None] = contextvars.ContextVar("flashtile_held_launches", default=None)
_COMPILED_TOGETHER: set = set()


@contextlib.contextmanager
def compile_together(key):
    """Run a block of ``launch_plain`` launches with their kernels compiled side by side on its first run for ``key``.

    A first call compiles each kernel as it reaches it, one after another (the one-pass backward: five kernels,
    5.0-5.8 s on the CI machine's two cores at d = 128, about 2.6 of them the Gluon kernel; side by side 3.0-3.5 s;
    on an H100 machine's first backward at 16k tokens 0.2-2.7 s of 7.9-9.9: benchmarks/RESULTS.md "First call").
    Here the block's launches are held, compiled on ``compile_threads()`` threads (Triton's ``AsyncCompileMode``;
    ptxas and much of the compiler run outside Python's lock) and their launchers built there (``_build_launcher``),
    then made in their order when the block ends, on the stream that was current (the block must not change it, and
    nothing in it may read what its launches write: allocations and launches only). Later runs with ``key``, nested
    blocks, the interpreter and one compile thread launch as they go."""
    if (key in _COMPILED_TOGETHER or _HELD_LAUNCHES.get() is not None or interpreting() or compile_threads() <= 1
            or _async_compile.active_mode.get() is not None):
        yield
        return
    held: list = []
    token = _HELD_LAUNCHES.set(held)
    try:
        yield
    finally:
        _HELD_LAUNCHES.reset(token)
    _compile_on_threads([functools.partial(kernel.run, *args, grid=grid, warmup=True, **kwargs)
                         for kernel, grid, args, kwargs in held])
    for kernel, grid, args, kwargs in held:
        launch_plain(kernel, grid, *args, **kwargs)
    if len(_COMPILED_TOGETHER) > 4096:
        _COMPILED_TOGETHER.clear()
    _COMPILED_TOGETHER.add(key)


def _note_indirect(reason: str = "a launch through Triton's own path") -> None:
    from . import replay

    replay.note_indirect(reason)


def direct_launches_possible() -> bool:
    """Triton 3.6's JITFunction internals are known (below); the interpreter and other versions take
    Triton's path, as does everything after a direct launch failed, or with FLASHTILE_DIRECT_LAUNCH=0."""
    return (_DIRECT_LAUNCH and not _DIRECT_BROKEN and not interpreting()
            and os.environ.get("FLASHTILE_DIRECT_LAUNCH", "1") != "0")


def _direct_launch_possible(fn) -> bool:
    return direct_launches_possible() and hasattr(fn, "device_caches")


class _DirectLaunch:
    """What Triton 3.6's ``JITFunction.run`` does on a launch of an already compiled kernel, less its
    per-call bookkeeping, for one kernel with fixed keyword arguments (switches and tile config) on each
    device.

    Arguments are bound and specialized by Triton's own binder, and the compiled kernel is the one
    Triton's cache holds under Triton's own key for that specialization; a specialization not yet
    compiled returns False (the caller then takes Triton's path, which compiles it). Skipped: the
    launch-hook chain and its metadata when no hook is registered (Triton 3.6 builds them on every
    launch; a registered hook, e.g. a profiler's, sends every launch back through Triton, as do
    changed ``debug``/``instrumentation_mode`` knobs; pre-run hooks run here as there), the check that the kernels'
    global constants were not reassigned (flashtile's are constants), and the options' string form
    rebuilt per call. About 7 µs per launch on the CI machine's CPU (benchmarks/lab/host_overhead.py). A
    call the launcher refuses turns direct launches off for the process and goes through Triton's path.
    """

    __slots__ = ("fn", "kwargs", "knobs", "compiled")

    def __init__(self, fn, kwargs: dict):
        self.fn = fn
        # JITFunction.run adds these two from Triton's knobs on every call (both are part of the options,
        # so of the cache key); a call made after either knob changed goes through Triton's path.
        self.knobs = launch_knobs()
        self.kwargs = {**kwargs, "debug": kwargs.get("debug", fn.debug) or self.knobs[0],
                       "instrumentation_mode": self.knobs[1]}
        self.compiled: dict = {}  # device -> {specialization: compiled kernel}

    def __call__(self, grid, args) -> bool:
        if not plain_launches(self.knobs):
            return False
        for hook in self.fn.pre_run_hooks:  # as JITFunction.run calls them, before binding
            hook(*args, **self.kwargs)
        driver = _driver.active
        device = driver.get_current_device()
        caches = self.fn.device_caches.get(device)
        if caches is None:
            return False
        kernel_cache, kernel_key_cache, _target, _backend, binder = caches
        bound_args, specialization, options = binder(*args, **self.kwargs)
        spec = tuple(specialization)
        on_device = self.compiled.get(device)
        if on_device is None:
            on_device = self.compiled[device] = {}
        compiled = on_device.get(spec)
        if compiled is None:
            compiled = kernel_cache.get(_compute_cache_key(kernel_key_cache, specialization, options))
            if compiled is None or hasattr(compiled, "result"):
                return False  # not compiled yet (or compiling asynchronously): Triton's path
            on_device[spec] = compiled
        size = grid(bound_args) if callable(grid) else grid
        run = compiled.run  # loads the module on first use
        stream = driver.get_current_stream(device)
        try:
            run(size[0], size[1] if len(size) > 1 else 1, size[2] if len(size) > 2 else 1,
                stream, compiled.function, compiled.packed_metadata, None, None, None, *bound_args.values())
        except Exception as exc:
            # The launcher refused the call before enqueuing anything (no hook runs after a launch here):
            # direct launches stop for the process, and Triton's path repeats the launch (and raises
            # whatever error is real, e.g. out of memory for the descriptors' scratch).
            stop_direct_launches(exc)
            return False
        if _RECORDING_ON:
            from . import replay

            replay.note_launch(self.fn, compiled, size, device, stream, tuple(bound_args.values()))
        return True


def stop_direct_launches(exc: Exception) -> None:
    """After a launcher refused a direct call: Triton's own path from now on, for the whole process."""
    _DIRECT_BROKEN.append(True)
    _DIRECT.clear()
    warnings.warn(f"flashtile: direct kernel launches turned off after {type(exc).__name__}: {exc}; "
                  "launching through Triton's own path", RuntimeWarning, stacklevel=4)


def launch_knobs() -> tuple:
    """Triton's knobs that are part of a compiled kernel's options: (debug, instrumentation mode)."""
    return _knobs.runtime.debug, _knobs.compilation.instrumentation_mode


def plain_launches(knobs: tuple) -> bool:
    """No launch hook registered (a hook chain with hooks, or a function set directly: a profiler's) and
    ``launch_knobs()`` as ``knobs``: launches may skip Triton's own path (``_DirectLaunch``,
    ``replay.Plan``)."""
    runtime = _knobs.runtime
    return not (getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)
                or getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook)
                or launch_knobs() != knobs)


def launch_driver():
    """Triton's active driver (current device and stream as Triton launches on them)."""
    return _driver.active


_DIRECT_LAUNCH = TRITON_36
if _DIRECT_LAUNCH:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import compute_cache_key as _compute_cache_key

_DIRECT: dict[tuple, _DirectLaunch] = {}
_RECORDING_ON = 0  # threads recording a launch plan now (replay.record): launches report to them
_DIRECT_BROKEN: list[bool] = []  # non-empty once a direct launch failed


MAX_PROGRAMS = 2**31 - 1  # a grid's first axis


def flat_programs(blocks: int, heads: int) -> int:
    """Programs of a flat grid (``common.schedule``): blocks x (sequence, head) pairs, within one axis.

    Evaluated by the launch's grid function, so the error comes before that kernel runs (a packed batch
    with one very long sequence among very many short ones is the way to reach it)."""
    programs = blocks * heads
    if programs > MAX_PROGRAMS:
        raise ValueError(f"{blocks} blocks x {heads} (sequence, head) pairs = {programs} programs exceed one launch's "
                         f"{MAX_PROGRAMS}: split the batch, or shorten max_seqlen")
    return programs


def head_block(headdim: int) -> int:
    """Head dim padded to a power of two (tl.dot needs at least 16 along the reduction)."""
    return max(16, next_power_of_2(headdim))


# Sequence lengths beyond this share one tuning decision: their tiles are chosen by timing the candidates
# on the first TUNE_SEQLEN_CAP tokens (``proxy_tuning_needed``), since timing every candidate at full
# length cost a first call at 262,144 tokens 150 s (33.6 s forward, 118.6 s backward, on an H200) and the
# same tiles win at every long length.
TUNE_SEQLEN_CAP = 16384


def seqlen_bucket(seqlen: int) -> int:
    """Autotune key: sequence lengths within a power of two share a tuning decision, and every length
    from ``TUNE_SEQLEN_CAP`` up shares one."""
    return min(next_power_of_2(max(seqlen, 1)), TUNE_SEQLEN_CAP)


_PROXY_TUNED: set = set()


def proxy_tuning_needed(kind: str, q, k, opts, seqlen_q: int, seqlen_k: int) -> tuple | None:
    """For a dense call with a sequence longer than ``TUNE_SEQLEN_CAP``: the variant to tune first by
    running the same attention on its first ``TUNE_SEQLEN_CAP`` queries and keys (the autotuner times
    the candidates there, and the long call finds the choice under the same, capped key), or None.
    The caller passes the variant to ``proxy_tuned`` once that run is done: once per process for each
    kind ("fwd"/"bwd") and variant. None under the interpreter, with tuning off, for block-sparse masks
    (sized to the full lengths) and while a CUDA graph is captured."""
    if max(seqlen_q, seqlen_k) <= TUNE_SEQLEN_CAP or not autotune_enabled() or opts.block_mask is not None:
        return None
    if q.is_cuda:
        import torch

        if torch.cuda.is_current_stream_capturing():
            return None
    # What the kernels' compile-time switches and tuning keys depend on, less the lengths' exact values.
    variant = (kind, q.dtype, q.shape[-1], q.shape[-2], k.shape[-2], seqlen_bucket(seqlen_q), seqlen_bucket(seqlen_k),
               opts.left_limit is None, opts.right_limit is None, opts.softcap > 0, opts.alibi_slopes is None,
               opts.sink is None, opts.dropout_p > 0)
    if variant in _PROXY_TUNED:
        return None
    if _RECORDING_ON:
        # A launch plan must not keep the one-time proxy run: every replay would repeat it.
        _note_indirect("a one-time tuning run on the first tokens")
    return variant


def proxy_tuned(variant: tuple) -> None:
    _PROXY_TUNED.add(variant)


def _config(entry: tuple, names: tuple[str, str]) -> triton.Config:
    block_a, block_b, warps, stages, *maxnreg = entry
    return triton.Config({names[0]: block_a, names[1]: block_b}, num_warps=warps, num_stages=stages,
                         maxnreg=maxnreg[0] if maxnreg else None)


_FWD_NAMES = ("BLOCK_M", "BLOCK_N")
_BWD_KV_NAMES = ("BLOCK_N", "BLOCK_M")
_BWD_Q_NAMES = ("BLOCK_M", "BLOCK_N")

# (block_a, block_b, num_warps, num_stages[, maxnreg]); the first entry that fits is the default. A fifth
# element caps the registers per thread (PTX .maxnreg): at 128, four 4-warp blocks fit a multiprocessor's
# 64K registers where 129-168 registers allow three.
_FWD_CANDIDATES = {
    "small_d": [(128, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3)],
    "mid_d": [(128, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 4, 2)],
    # With dropout (the mask made from counters in the loop: more registers a tile; mid_d's first spills 204 B at
    # d = 128): (64, 64, 4 warps, 3 stages) first, no spills. d = 128 causal, 8 heads, p = 0.1 (bwd_at_tiles.py
    # --fwd-sweep, one H100, 2026-12-06): 292 / 334 TFLOP/s at 8 x 2,048 / 2 x 8,192 tokens against 245 / 288 for
    # mid_d's first, 243 / 298 for (128, 64, 8, 3), 240 / 288 for (128, 128, 8, 2), 116 / 133 for (128, 128, 4, 2).
    "dropout_mid_d": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 2)],
    "large_d": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
    # At most 64 rows per (sequence, head) block, e.g. decoding: a tall tile would be mostly padding and
    # turn a read-bound kernel into a compute-bound one. Deep pipelines keep the K/V reads in flight.
    "few_rows": [(16, 64, 4, 3), (16, 128, 4, 2), (16, 64, 4, 4), (32, 64, 4, 3), (64, 64, 4, 3), (16, 128, 4, 3),
                 (32, 128, 4, 2), (16, 32, 4, 4), (16, 64, 2, 3), (16, 64, 2, 4)],  # 2 warps: more blocks per SM
    # FP8 q, k, v (FP8 == 2): tiles take half the shared memory and an FP8 product twice the work per
    # cycle, so wider key tiles and deeper pipelines; 64 rows per warpgroup keep P and O in registers.
    "fp8_small_d": [(128, 128, 8, 3), (128, 128, 4, 3), (128, 256, 8, 2), (128, 64, 4, 4), (64, 128, 4, 3)],
    # d=128 on an H200 (benchmarks/lab/fp8_bench.py --sweep): (64, 128, 4, 3) 704-798 TFLOP/s at s=4k-16k,
    # causal and not, the register-capped 2-stage one 1-2% behind, the 8-warp tiles 8-20%.
    "fp8_mid_d": [(64, 128, 4, 3), (64, 128, 4, 2, 168), (128, 128, 8, 3), (128, 256, 8, 3), (128, 64, 8, 4)],
    "fp8_large_d": [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3)],
    # Decoding from an FP8 cache: a byte per element, so twice the keys per tile keep as many bytes in flight.
    "fp8_few_rows": [(16, 128, 4, 3), (16, 256, 4, 2), (16, 128, 4, 4), (16, 64, 4, 4), (16, 256, 4, 3),
                     (32, 128, 4, 3), (16, 128, 2, 4)],
}
FEW_ROWS = 64
_BWD_KV_CANDIDATES = {
    # Not the register-capped (64, 32, 4, 3, 128) nor (128, 32, 4, 5) (benchmarks/lab/tune.py's wide list; the
    # capped tile fits four blocks per multiprocessor instead of three and ran its pass alone 4% faster at
    # d=64 causal s=2048): with both added the whole d=64 backward ran 0.997-1.009x at s=2048-16384 and
    # 1.056x only at non-causal s=2048, where this list's (128, 32, 4, 3) does as well when the tuner picks
    # it (H200, 2026-11-30, on ae943ef).
    # Not (128, 32, 8 warps) at d <= 64: timed alone it can win the tuning, but beside the dQ pass on its
    # second stream the whole d=64 causal backward at s=16384 ran 349-358 TFLOP/s with it against 359-372
    # without (H200, 2026-11-30); it was chosen at no other grid point.
    "small_d": [(128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    # (128, 32, 8 warps): the causal pass's only d=128 tiles with 3 or 2 stages, no spills and pipelined wgmma.
    # (64, 64, 4 warps, 2 stages) first: the tuner's choice at every d=128 point timed on an H200, causal and not,
    # 2,048-16,384 tokens (benchmarks/lab/bwd_passes.py, 2026-12-02); with FLASHTILE_AUTOTUNE=0 the first
    # entry, (128, 64, 8, 3) until then, ran the causal pass 1.35x slower at 16,384 tokens.
    "mid_d": [(64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3),
              (128, 32, 8, 2)],
    # With dropout (the mask regenerated from counters: more registers a tile): (64, 32, 4 warps, 3 stages) first,
    # the tuner's choice, and (128, 32, 4, 3) left out. The whole backward, d = 128 causal, 8 x 2,048 tokens,
    # 8 heads, p = 0.1, dQ's first tile (bwd_at_tiles.py --dropout 0.1 --sweep, one H100, 2026-12-06): 242.9 TFLOP/s
    # against 224.0 for mid_d's first, 230.7 for (128, 32, 8, 3), 70.5 for (128, 32, 4, 3); every other under 224.
    "dropout_mid_d": [(64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2),
                      (128, 64, 8, 3)],
    # d > 128: the pass runs as two launches, dV then dK (backward.py), one float32 (BLOCK_N, d) accumulator
    # each, so 128 keys per block fit, one warpgroup per 64 of them. All pipelined and spill-free in both
    # launches (kernel_resources.py); 2-stage (128, 64) and 3-stage (128, 32) tiles would exceed the
    # shared-memory budget. The 4-warp tiles of 16-32 rows use under 210 registers per thread; where they
    # take at most 113 KB of shared memory (the dV launch's 16-row and 2-stage 32-row tiles, the dK
    # launch's 2-stage 16-row tile: 66-98 KB per ptxas) two blocks fit on a multiprocessor.
    # (64, 32, 4 warps, 3 stages) first: the tuner's choice at d = 256 in the speed grid (both launches without a
    # mask, dV's causal), and as the default of both launches with the dQ pass's (64, 32, 4, 3) the whole backward
    # ran 1.46-1.64x the first entry before, (128, 32, 8, 2) with the dQ pass's (64, 32, 8, 2) (one H100,
    # 2026-12-05, benchmarks/lab/bwd_at_tiles.py --sweep, 2,048-8,192 tokens, causal and not).
    "large_d": [(64, 32, 4, 3), (128, 32, 8, 2), (128, 64, 8, 1), (64, 64, 8, 2), (128, 16, 8, 3), (64, 32, 4, 2),
                (64, 16, 4, 2), (64, 16, 4, 3)],
    # The FP8 backward (its float8 Q and dO tiles beside the 16-bit ones) at d <= 128, not timed yet: by ptxas
    # for sm_90a at d=128, (128, 32, 8 warps, 3 stages) spills 0-8 B a thread, (128, 64, 8 warps, 3 stages) 168-392 B.
    "fp8_mid_d": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2)],
}
_BWD_Q_CANDIDATES = {
    "small_d": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3)],
    "mid_d": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 64, 4, 2)],
    # 4 warps: one warpgroup owns the 64 rows, where 8 warps split each wgmma of a 64-row tile in two.
    # (64, 32, 4, 3) first: the tuner's choice at every d = 256 point of the speed grid (one H100, 2026-12-05).
    "large_d": [(64, 32, 4, 3), (64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 1),
                (64, 32, 4, 2), (64, 16, 4, 2), (64, 16, 4, 3)],
}
_INTERPRETER_CONFIG = (32, 32, 4, 1)


# ---------------------------------------------------------------------------------------------------
# Targets: the GPU families flashtile compiles for, each with its own candidate lists and switches
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """What the launchers need to know about a GPU family: its tile candidates and which paths it takes.

    The lists are (block_a, block_b, num_warps, num_stages) per head-dim class, as above; on AMD a warp is a
    64-lane wavefront. ``smem_limit`` is the shared memory (LDS on AMD) one block may use on that GPU,
    checked against every compiled candidate by ``compile_check``; ``smem_budget`` what the prune's
    estimate of a candidate's tiles (``_fwd_smem``, ``_bwd_smem``) may take. Stages above ``max_stages``
    are not in the lists: deep pipelines need shared memory the smaller GPUs do not have.
    """

    name: str  # FLASHTILE_TARGET's value
    vendor: str  # "nvidia" or "amd"
    arch: int | str  # Triton's GPUTarget arch: 80, 90, ..., or "gfx942"
    warp_size: int
    smem_limit: int
    smem_budget: int
    tma: bool  # the copy-engine (TMA descriptor) loads: Hopper and datacenter Blackwell only
    max_stages: int
    fwd: dict = dataclasses.field(repr=False)
    bwd_kv: dict = dataclasses.field(repr=False)
    bwd_q: dict = dataclasses.field(repr=False)
    gpus: str = ""  # what users know it as


# Ampere (A100, A30: 163 KiB per block) has no TMA and no wgmma: mma.sync keeps each warp's share of the
# accumulators, the Q tile and the probabilities in its registers, so tiles that suit Hopper's warpgroups
# spill here (the d=128 forward's (128, 64, 4 warps) by 936 bytes a thread). These lists were chosen from
# compiled resources, not from timings (compile_check over every variant: spills within its 128-byte budget,
# most kernels none; registers under the 255 cap where possible; shared memory within the limit): 8 warps
# for 128-row tiles, 16-32 row streams in the backward.
_SM80_FWD = {
    "small_d": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3)],
    "mid_d": [(128, 32, 8, 3), (64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 4, 3), (64, 32, 8, 3)],
    "large_d": [(64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 3), (64, 16, 8, 2)],
    "few_rows": [(16, 64, 4, 3), (16, 128, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3), (16, 32, 4, 3), (16, 64, 2, 3)],
}
_SM80_BWD_KV = {  # (BLOCK_N, BLOCK_M, warps, stages): keys stationary, queries streamed
    "small_d": [(128, 16, 8, 3), (64, 16, 4, 3), (64, 16, 8, 3)],
    "mid_d": [(64, 32, 8, 3), (64, 32, 8, 2), (64, 16, 8, 3), (64, 64, 8, 2)],
    "large_d": [(64, 32, 8, 2), (64, 16, 8, 3), (32, 32, 8, 3), (64, 32, 8, 3), (32, 16, 8, 3)],
}
_SM80_BWD_Q = {
    "small_d": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
    "mid_d": [(128, 32, 8, 3), (64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2)],
    "large_d": [(64, 32, 8, 2), (64, 16, 8, 3), (64, 32, 8, 3), (32, 32, 8, 3), (64, 16, 8, 2)],
}
# Ada, consumer Ampere and consumer Blackwell: 99 KiB per block, so 2 stages at most and smaller streamed
# tiles at d=256; chosen the same way (sm89 and sm120 compiled each).
_SM89_FWD = {
    "small_d": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)],
    "mid_d": [(64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2)],
    "large_d": [(64, 32, 8, 2), (64, 16, 8, 2), (64, 32, 8, 1), (64, 16, 8, 1)],
    "few_rows": [(16, 64, 4, 2), (16, 128, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2), (16, 32, 4, 2), (16, 64, 2, 2)],
}
_SM89_BWD_KV = {
    "small_d": [(128, 16, 8, 2), (64, 16, 4, 2), (64, 16, 8, 2)],
    "mid_d": [(64, 32, 8, 2), (64, 16, 8, 2)],
    "large_d": [(64, 16, 8, 2), (32, 32, 8, 2), (32, 16, 8, 2), (64, 16, 8, 1)],
}
_SM89_BWD_Q = {
    "small_d": [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)],
    "mid_d": [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2)],
    "large_d": [(64, 16, 8, 2), (32, 32, 8, 2), (64, 32, 8, 1), (32, 16, 8, 2)],
}
# Datacenter Blackwell (B200, B300: 227 KiB per block, TMA): Hopper's lists less the tiles that spill past
# compile_check's budget there in some variant, and for the dK/dV pass, whose Hopper tiles all do (up to
# 4.9 KB a thread with packed sequences), 8-warp tiles that do not.
_SM100_FWD = {
    "small_d": [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    "mid_d": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    "large_d": [(128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
    "few_rows": [entry for entry in _FWD_CANDIDATES["few_rows"] if entry != (16, 64, 2, 3)],
}
_SM100_BWD_KV = {
    "small_d": [(64, 32, 8, 3), (128, 16, 8, 3), (64, 16, 4, 3), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2)],
    "mid_d": [(64, 32, 8, 3), (64, 16, 8, 3), (32, 32, 8, 3), (64, 32, 8, 2), (64, 16, 8, 2)],
    "large_d": [(64, 32, 8, 1), (64, 16, 8, 1), (32, 32, 8, 2), (64, 16, 4, 1), (32, 32, 8, 1), (32, 16, 8, 2)],
}
_SM100_BWD_Q = {
    "small_d": list(_BWD_Q_CANDIDATES["small_d"]),
    "mid_d": list(_BWD_Q_CANDIDATES["mid_d"]),
    "large_d": [(64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2), (64, 64, 8, 1), (64, 16, 4, 2), (64, 16, 4, 3)],
}
# AMD CDNA3/4 (MI300X, MI355X): 64-lane wavefronts and a unified file of 512 VGPRs (AGPRs included) per
# lane; at most 256 keep two waves per SIMD, and an 8-wave block gets no more than 256. Triton's AMD
# backend keeps Q and P in registers and stages K and V through LDS (64 KiB per block on gfx942, 160 KiB
# on gfx950), its stream pipeliner one more copy per stage; 1 and 2 stages only. Chosen from compiled
# resources like the sm80 lists: within the spill budget in every variant (dropout's random numbers cost
# the 8-wave 64-key tiles 250-1500 bytes a thread), LDS within gfx942's 64 KiB, so gfx950 shares them.
_CDNA_FWD = {
    "small_d": [(128, 32, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2)],
    "mid_d": [(128, 32, 8, 2), (64, 32, 4, 2), (128, 32, 8, 1), (64, 32, 8, 2)],
    "large_d": [(64, 16, 8, 2), (64, 16, 4, 2), (64, 16, 8, 1)],
    "few_rows": [(16, 64, 4, 2), (16, 128, 4, 1), (32, 64, 4, 2), (64, 64, 4, 1), (16, 64, 4, 1), (16, 32, 4, 2)],
}
_CDNA_BWD_KV = {
    "small_d": [(64, 32, 4, 1), (128, 16, 8, 2), (64, 16, 4, 2)],
    "mid_d": [(128, 16, 8, 2), (64, 16, 8, 2), (64, 16, 4, 1), (128, 16, 8, 1)],
    "large_d": [(64, 16, 8, 2), (64, 16, 8, 1), (32, 16, 8, 2), (32, 16, 4, 1)],
}
_CDNA_BWD_Q = {
    "small_d": [(128, 32, 8, 2), (64, 32, 4, 2), (128, 32, 4, 2), (64, 32, 8, 2)],
    "mid_d": [(128, 32, 8, 1), (64, 32, 4, 1), (128, 16, 8, 2), (64, 16, 8, 2)],
    "large_d": [(64, 16, 8, 2), (64, 16, 8, 1), (32, 16, 4, 2), (64, 16, 4, 1)],
}

KIB = 1024
TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target("sm80", "nvidia", 80, 32, 163 * KIB, 160 * KIB, False, 3, _SM80_FWD, _SM80_BWD_KV, _SM80_BWD_Q,
               gpus="A100, A800, A30, Jetson Orin (sm87)"),
        Target("sm89", "nvidia", 89, 32, 99 * KIB, 96 * KIB, False, 2, _SM89_FWD, _SM89_BWD_KV, _SM89_BWD_Q,
               gpus="L4, L40S, RTX 4090, RTX 3090, A10, A40 (sm86)"),
        Target("sm90", "nvidia", 90, 32, 227 * KIB, SMEM_BUDGET_BYTES, True, 4, _FWD_CANDIDATES,
               _BWD_KV_CANDIDATES, _BWD_Q_CANDIDATES, gpus="H100, H200, H20, GH200"),
        Target("sm100", "nvidia", 100, 32, 227 * KIB, SMEM_BUDGET_BYTES, True, 4, _SM100_FWD, _SM100_BWD_KV,
               _SM100_BWD_Q, gpus="B200, B300, GB200, GB300"),
        Target("sm120", "nvidia", 120, 32, 99 * KIB, 96 * KIB, False, 2, _SM89_FWD, _SM89_BWD_KV, _SM89_BWD_Q,
               gpus="RTX 5090, RTX PRO 6000 Blackwell, DGX Spark (sm121)"),
        # The prune's estimate counts every tile in shared memory; the AMD backend keeps about half of that
        # in LDS (compiled: 36-48 KiB where it estimates 96), hence budgets of twice the LDS. compile_check
        # holds every candidate to the real 64 / 160 KiB.
        Target("gfx942", "amd", "gfx942", 64, 64 * KIB, 128 * KIB, False, 2, _CDNA_FWD, _CDNA_BWD_KV, _CDNA_BWD_Q,
               gpus="MI300X, MI300A, MI325X"),
        Target("gfx950", "amd", "gfx950", 64, 160 * KIB, 320 * KIB, False, 2, _CDNA_FWD, _CDNA_BWD_KV,
               _CDNA_BWD_Q, gpus="MI350X, MI355X"),
    )
}
# NVIDIA compute capabilities -> target; any other 10.x or 12.x is its major's target.
_NVIDIA_TARGETS = {(8, 0): "sm80", (8, 7): "sm80", (8, 6): "sm89", (8, 9): "sm89", (9, 0): "sm90"}
_NVIDIA_MAJOR_TARGETS = {10: "sm100", 12: "sm120"}


def target_of(device: torch.device) -> Target:
    """The target whose tile lists and switches run tensors on ``device``, or a RuntimeError naming the GPU
    when flashtile's kernels do not run on it (raised before anything is launched).

    CUDA devices (NVIDIA, or AMD under ROCm's ``torch.version.hip``) are looked up once per device and
    ``FLASHTILE_TARGET`` value. ``FLASHTILE_TARGET=sm80`` (any name of ``TARGETS``) forces that target's
    lists and switches on any GPU of the same vendor that has its shared memory and TMA (sm80 on an H200:
    the Ampere path, TMA off). CPU tensors take the target of Triton's active driver (a stand-in when
    there is no GPU: ``stand_in``), or sm90's under the interpreter."""
    forced = os.environ.get("FLASHTILE_TARGET", "")
    if device.type == "cuda":
        return _device_target(device.index, forced)
    return _stand_in_target(forced)


@functools.cache
def _device_target(index: int | None, forced: str) -> Target:
    import torch

    if index is None:
        index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    if torch.version.hip:
        vendor, arch = "amd", torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    else:
        vendor, arch = "nvidia", _capability(index)
    return _resolve(vendor, arch, name, forced)


def _stand_in_target(forced: str) -> Target:
    if interpreting():
        if forced and forced not in TARGETS:  # (refused as on a GPU)
            raise ValueError(f"FLASHTILE_TARGET must be one of {', '.join(TARGETS)}, got {forced!r}")
        return TARGETS[forced or "sm90"]
    from triton.runtime.driver import driver

    gpu = driver.active.get_current_target()
    if gpu.backend == "hip":
        return _resolve("amd", gpu.arch, gpu.arch, forced)
    return _resolve("nvidia", divmod(gpu.arch, 10), f"sm{gpu.arch}", forced)


def _resolve(vendor: str, arch, name: str, forced: str) -> Target:
    """The target for a GPU (``arch``: (major, minor) capability, or the gfx name), forced or not."""
    if vendor == "nvidia":
        major, minor = arch
        label = f"{name} (compute capability {major}.{minor})"
        if major < 8:
            raise RuntimeError(f"flashtile's Triton kernels need an NVIDIA GPU of compute capability 8.0 (Ampere) "
                               f"or newer; {label} is older. FLASHTILE_BACKEND=torch runs the PyTorch path on it.")
        native = _NVIDIA_TARGETS.get((major, minor)) or _NVIDIA_MAJOR_TARGETS.get(major)
    else:
        label = f"{name} ({arch})"
        native = arch if arch in TARGETS and TARGETS[arch].vendor == "amd" else None
    names = ", ".join(TARGETS)
    if not forced:
        if native is None:
            known = ("sm80 (sm87 too), sm89 (sm86 too), sm90, sm10x, sm12x" if vendor == "nvidia"
                     else "gfx942, gfx950")
            raise RuntimeError(f"flashtile has no tile lists for {label}: its kernels run on the targets "
                               f"{known}. FLASHTILE_TARGET=<one of {names}> forces a target's lists (untested on this "
                               f"GPU); FLASHTILE_BACKEND=torch runs the PyTorch path.")
        return TARGETS[native]
    if forced not in TARGETS:
        raise ValueError(f"FLASHTILE_TARGET must be one of {names}, got {forced!r}")
    target = TARGETS[forced]
    if target.vendor != vendor:
        raise RuntimeError(f"FLASHTILE_TARGET={forced} is a target for {target.vendor} GPUs; {label} is {vendor}")
    if native is not None:
        own = TARGETS[native]
        if target.tma and not own.tma:
            raise RuntimeError(f"FLASHTILE_TARGET={forced} loads through TMA, which {label} does not have")
        if target.smem_limit > own.smem_limit:
            raise RuntimeError(f"FLASHTILE_TARGET={forced}'s tiles take up to {target.smem_limit // KIB} KiB of "
                               f"shared memory per block; {label} has {own.smem_limit // KIB} KiB")
    return target


def _dim_class(block_d: int) -> str:
    if block_d <= 64:
        return "small_d"
    if block_d <= 128:
        return "mid_d"
    return "large_d"


def _all_configs(table: str, names: tuple[str, str]) -> list[triton.Config]:
    """Every target's candidates of one kernel (``table``: "fwd", "bwd_kv" or "bwd_q"), sm90's first: the
    autotuner's full list, which the prune cuts to the running target's head-dim class."""
    if interpreting():
        return [_config(_INTERPRETER_CONFIG, names)]
    seen, configs = set(), []
    for target in (TARGETS["sm90"], *TARGETS.values()):
        for entries in getattr(target, table).values():
            for entry in entries:
                if entry not in seen:
                    seen.add(entry)
                    configs.append(_config(entry, names))
    return configs


def _prune(table: str, names: tuple[str, str], smem_tiles):
    """Build an early_config_prune hook: keep the running target's list for the head-dim class (or the
    few-rows list when the candidates have one and the row bucket is small), in its order, that fits in
    the target's shared memory."""

    def prune(configs, named_args, **kwargs):
        if interpreting():
            return configs[:1]
        target = target_of(named_args["Q"].device)
        candidates = getattr(target, table)
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        elem = named_args["Q"].element_size()
        few_rows = "few_rows" in candidates and named_args.get("SEQ_BUCKET_Q", FEW_ROWS + 1) <= FEW_ROWS
        dim_class = _dim_class(block_d)
        listed = "few_rows" if few_rows else dim_class
        fp8 = kwargs.get("FP8", named_args.get("FP8"))
        if fp8 and f"fp8_{listed}" in candidates:
            listed = f"fp8_{listed}"
        if kwargs.get("DROPOUT", named_args.get("DROPOUT")) and f"dropout_{listed}" in candidates:
            listed = f"dropout_{listed}"
        wanted = candidates[listed]
        if fp8 and few_rows and block_d > 128:
            # FP8 decoding at d > 128: the float8 conversions need registers that the wider tiles spill (per
            # compile_check: a 16-bit list's on sm89, sm100 and sm120; sm90's FP8 list's (16, 128, 4 warps) by 15.4 KB
            # a thread for a cache read without TMA): 4+ warps, at most 1024 scores a tile.
            wanted = [e for e in wanted if e[2] >= 4 and e[0] * e[1] <= 1024] or wanted
        if kwargs.get("FP8", named_args.get("FP8")) == 2:
            # An FP8 product reduces over at least 32 elements: P V over 32 keys or more (the 16-key
            # tiles of some 16-bit lists do not compile).
            wanted = [entry for entry in wanted if entry[1] >= 32] or [(64, 32, 4, 2)]
        kept = []
        for entry in wanted:
            block_a, block_b, _, stages = entry[:4]
            if smem_tiles(block_a, block_b, block_d, stages) * elem <= target.smem_budget:
                kept.append(next(c for c in configs if _matches(c, entry, names)))
        if not kept:  # nothing fits the budget: the list's smallest, for the compiler to refuse or not
            smallest = min(wanted, key=lambda entry: smem_tiles(entry[0], entry[1], block_d, entry[3]))
            kept = [next(c for c in configs if _matches(c, smallest, names))]
        return kept if autotune_enabled() else kept[:1]

    return prune


def _matches(config: triton.Config, entry: tuple, names: tuple[str, str]) -> bool:
    block_a, block_b, warps, stages, *maxnreg = entry
    return (
        config.kwargs[names[0]] == block_a
        and config.kwargs[names[1]] == block_b
        and config.num_warps == warps
        and config.num_stages == stages
        and config.maxnreg == (maxnreg[0] if maxnreg else None)
    )


# Elements held in shared memory: the stationary tile plus `stages` copies of the streamed tiles.
def _fwd_smem(block_m, block_n, block_d, stages):
    return block_m * block_d + stages * 2 * block_n * block_d


def _bwd_smem(block_stationary, block_streamed, block_d, stages):
    return 2 * block_stationary * block_d + max(stages, 1) * 2 * block_streamed * block_d


@functools.cache
def fwd_configs() -> list[triton.Config]:
    return _all_configs("fwd", _FWD_NAMES)


@functools.cache
def bwd_kv_configs() -> list[triton.Config]:
    return _all_configs("bwd_kv", _BWD_KV_NAMES)


@functools.cache
def bwd_q_configs() -> list[triton.Config]:
    return _all_configs("bwd_q", _BWD_Q_NAMES)


fwd_prune = _prune("fwd", _FWD_NAMES, _fwd_smem)
bwd_kv_prune = _prune("bwd_kv", _BWD_KV_NAMES, _bwd_smem)
bwd_q_prune = _prune("bwd_q", _BWD_Q_NAMES, _bwd_smem)

PREPROCESS_BLOCK_M = 64
