"""Benchmark harness: flashtile against its peers, in one process, on the same inputs.

Peers (each reported as "n/a: <reason>" when it cannot run here, never skipped silently):

* ``flashtile``    this package's Triton kernels
* ``sdpa_flash``   ``scaled_dot_product_attention`` with the flash backend (FlashAttention-2)
* ``sdpa_cudnn``   ``scaled_dot_product_attention`` with the cuDNN backend
* ``flex``         FlexAttention, ``torch.compile``d, dynamo reset per shape
* ``naive``        materialised ``softmax(q k^T) v`` in PyTorch, while it fits in memory
* ``fa4``          flash-attn-4 (``flash_attn.cute.flash_attn_func``, CuTe DSL) where it is installed; named with
                   ``--peers`` only, not in the default grids (``benchmarks/lab/fa4_carry.sh``: taking it to the GPU
                   machine)

TFLOP/s follow flash-attn's formula: forward ``4 * batch * nheads * seqlen^2 * headdim`` (halved when
causal), backward 2.5x forward, forward+backward 3.5x. Times are medians of CUDA-event timings after
warm-up (``triton.testing.do_bench``). Without a GPU the harness compares the tiled PyTorch path with
the naive one on CPU (time and peak memory) instead.

Kinds of run (``RUNS`` at the end, chosen in ``main``): the speed grid (by default a headline subset,
``--full`` the whole grid), ``--memory``, ``--decode``, ``--variants``, ``--overhead`` (wall time per eager call,
``flashtile.bench_overhead``), and the CPU comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .interface import flash_attn_func

PEERS = ("flashtile", "sdpa_flash", "sdpa_cudnn", "flex", "naive", "fa4")
MODES = ("fwd", "bwd", "fwd_bwd")
_MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


@contextlib.contextmanager
def env_setting(name: str, value: str):
    """An environment variable set for the duration (flashtile reads its settings per call)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, headdim: int, causal: bool,
                    mode: str = "fwd") -> float:
    """flash-attn's FLOP count: 4·b·h·sq·sk·d for the forward, halved when causal."""
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        flops /= 2
    return flops * _MODE_FLOP_FACTOR[mode]


@dataclass
class Row:
    impl: str
    mode: str
    dtype: str
    headdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
    ms: float | None = None
    tflops: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# Implementations: each takes BSHD q, k, v and returns BSHD out
# ---------------------------------------------------------------------------------------------------


def _sdpa(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            )
        return out.transpose(1, 2)

    return run


def _naive(q, k, v, causal):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = (qt @ kt.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores.float(), dim=-1).to(q.dtype) @ vt).transpose(1, 2)


def _flex_factory(seqlen_q: int, seqlen_k: int, causal: bool) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compiled function per shape, after a reset: a single compiled flex_attention reused over many
    # shapes hits dynamo's recompile limit and silently falls back to an unfused path.
    torch._dynamo.reset()
    # The backward is timed by re-running autograd on one graph (retain_graph=True), which a compiled
    # backward with donated buffers refuses; donation only saves memory.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    compiled = torch.compile(flex_attention)
    block_mask = None
    if causal:
        offset = seqlen_k - seqlen_q

        def causal_mask(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(causal_mask, None, None, seqlen_q, seqlen_k, device="cuda")

    def run(q, k, v, causal_flag):
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return out.transpose(1, 2)

    return run


def _flashtile(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


def _fa4(q, k, v, causal):
    """flash-attn-4's CuTe DSL kernels on the same BSHD tensors (an ImportError where it is not installed,
    reported as the row's n/a)."""
    from flash_attn.cute import flash_attn_func as fa4_func

    out, _lse = fa4_func(q, k, v, causal=causal)  # (out, lse), lse None unless asked for
    return out


def _implementation(name: str, seqlen_q: int, seqlen_k: int, causal: bool) -> Callable:
    if name == "flashtile":
        return _flashtile
    if name in ("sdpa_flash", "sdpa_cudnn"):
        return _sdpa(name)
    if name == "flex":
        return _flex_factory(seqlen_q, seqlen_k, causal)
    if name == "naive":
        return _naive
    if name == "fa4":
        return _fa4
    raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(PEERS)}")


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    if warm_only():
        fn()
        return math.nan
    # FLASHTILE_BENCH_MS="warm-up,repeat" milliseconds per measurement (default 25,100).
    warmup, rep = (int(x) for x in os.environ.get("FLASHTILE_BENCH_MS", "25,100").split(","))
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def warm_only() -> bool:
    """``FLASHTILE_BENCH_WARM=1``: every measured call runs once, untimed (NaN). With
    ``FLASHTILE_AUTOTUNE=compile`` such runs fill the compile caches in parallel before the run that
    measures (benchmarks/gpu_run.sh); their tables are meaningless."""
    return os.environ.get("FLASHTILE_BENCH_WARM", "0") == "1"


def _mode_callable(impl: Callable, mode: str, q, k, v, dout, causal) -> Callable[[], object]:
    if mode == "fwd":
        return lambda: impl(q, k, v, causal)
    if mode == "fwd_bwd":
        return lambda: torch.autograd.grad(impl(q, k, v, causal), (q, k, v), dout)
    out = impl(q, k, v, causal)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"n/a: {type(exc).__name__}: {text[:120]}"


def run_speed(dtypes, headdims, causals, seqlens, modes, peers, total_tokens=16384, model_dim=2048,
              log=print, shard=(0, 1), rows: list[Row] | None = None, rounds: int = 1) -> list[Row]:
    """The speed grid: batch = total_tokens / seqlen, nheads = model_dim / headdim.

    ``shard=(i, n)`` runs only every n-th grid point from the i-th (parallel cache warming, one process
    per GPU). ``rows``: a list to append each point's rows to once the point is measured (read by ``log`` for
    partial output).
    ``rounds``: each point's peers are timed this many times, in turn, the order rotated each round (round r
    starts with the r-th peer), and each row gets the median (its ``extra["ms_rounds"]``: every round's time).
    A peer timed right after another runs in the state the other left the GPU in (its clocks, its
    temperature), so in one fixed order a short timing favours whichever peer follows a slower one.
    """
    rows = [] if rows is None else rows
    point = -1
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for headdim in headdims:
            for causal in causals:
                for seqlen in seqlens:
                    point += 1
                    if point % shard[1] != shard[0]:
                        continue
                    batch, nheads = max(1, total_tokens // seqlen), model_dim // headdim
                    gen = torch.Generator(device="cuda").manual_seed(seqlen * 1000 + headdim)
                    shape = (batch, seqlen, nheads, headdim)
                    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
                    for x in (q, k, v):
                        x.requires_grad_(True)
                    key = (dtype_name, headdim, causal, seqlen, batch, nheads)
                    ready, why_not = _first_calls(peers, modes, key, q, k, v, dout, causal)
                    timed = _time_point(ready, modes, key, q, k, v, dout, causal, rounds)
                    for peer in peers:  # the point's rows once all its rounds ran, in the peers' order
                        for row in timed.get(peer) or [Row(peer, mode, *key, note=why_not[peer]) for mode in modes]:
                            rows.append(row)
                            log(_row_line(row))
                    torch.cuda.empty_cache()
    return rows


def _first_calls(peers, modes, key, q, k, v, dout, causal) -> tuple[dict, dict]:
    """Each peer's first call at one grid point, forward and (when timed) backward: compile / autotune outside the
    timing; its wall time is reported (the cost a user pays once per shape bucket). Returns ({peer: (callable,
    first call seconds, backward error or None)} of the peers that ran, {peer: why not} of the others)."""
    seqlen = key[3]
    ready, why_not = {}, {}
    for peer in peers:
        if peer == "naive" and seqlen > 8192:
            why_not[peer] = "n/a: skipped, the score matrix would not fit"
            continue
        try:
            t0 = time.perf_counter()
            impl = _implementation(peer, seqlen, seqlen, causal)
            out = impl(q, k, v, causal)
            backward_error = None
            if any(mode != "fwd" for mode in modes):
                try:
                    torch.autograd.grad(out, (q, k, v), dout)
                except Exception as exc:  # its backward rows say so; its forward still runs
                    backward_error = _short_error(exc)
            del out
            torch.cuda.synchronize()
            ready[peer] = (impl, time.perf_counter() - t0, backward_error)
        except Exception as exc:  # a peer that cannot run here is reported, not hidden
            why_not[peer] = _short_error(exc)
    return ready, why_not


def _time_point(ready, modes, key, q, k, v, dout, causal, rounds) -> dict:
    """{peer: its rows} of one grid point's peers that ran (``_first_calls``), each mode timed ``rounds`` times
    in turn."""
    batch, nheads, seqlen, headdim = key[4], key[5], key[3], key[1]
    order = list(ready)
    timed: dict = {}
    if not order:
        return timed
    times: dict = {}
    tiles: dict = {}
    errors: dict = {}
    for round_ in range(rounds):
        first = round_ % len(order)
        for peer in order[first:] + order[:first]:
            impl, _, backward_error = ready[peer]
            for mode in modes:
                if (mode != "fwd" and backward_error is not None) or (peer, mode) in errors:
                    continue
                try:
                    if peer == "flashtile":
                        from .kernels.configs import tiles_used

                        tiles_used(reset=True)
                    times.setdefault((peer, mode), []).append(
                        _time_ms(_mode_callable(impl, mode, q, k, v, dout, causal)))
                    if peer == "flashtile":  # which tiles ran: run-to-run differences start here
                        tiles.setdefault(mode, tiles_used())
                except Exception as exc:
                    errors[(peer, mode)] = _short_error(exc)
    for peer in order:
        _, first_call_s, backward_error = ready[peer]
        for mode in modes:
            row = Row(peer, mode, *key)
            timed.setdefault(peer, []).append(row)
            row.extra["first_call_s"] = round(first_call_s, 2)
            if mode != "fwd" and backward_error is not None:
                row.note = backward_error
            elif (peer, mode) in errors:
                row.note = errors[(peer, mode)]
            else:
                measured = times[(peer, mode)]
                if peer == "flashtile":
                    row.extra["tiles"] = tiles[mode]
                if len(measured) > 1:
                    row.extra["ms_rounds"] = [round(ms, 4) for ms in measured]
                row.ms = statistics.median(measured)
                flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, mode)
                row.tflops = flops / (row.ms * 1e-3) / 1e12
    return timed


def run_speed_on_gpus(args: argparse.Namespace, num_gpus: int, log=print) -> tuple[list[Row], int]:
    """The speed grid spread over ``num_gpus`` GPUs of this host, as one run: one process per GPU takes
    every num_gpus-th grid point (all peers and modes of a point on one GPU, so its ratios compare the
    same device), and their rows come back merged in grid order. Each process writes its rows as
    they come to ``<json>.gpu<i>`` (a temporary folder without ``--json``).

    Returns (rows, exit status): 0, 1 when a GPU's process failed (its points are missing), 143 when
    this process was stopped by SIGTERM (the per-GPU processes are stopped too; what they measured is
    still merged)."""
    import shutil
    import tempfile

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if num_gpus > len(devices):
        raise SystemExit(f"--gpus {num_gpus}: only {len(devices)} GPU(s) visible")
    folder = None if args.json else tempfile.mkdtemp(prefix="flashtile_bench_")
    outputs = [f"{args.json}.gpu{i}" if args.json else os.path.join(folder, f"gpu{i}.json") for i in range(num_gpus)]
    for output in outputs:  # an earlier run's rows must not pass for this run's
        for path in (output, output + ".tmp"):
            if os.path.exists(path):
                os.remove(path)
    children = []
    stopped = []
    # A time limit that stops this process (SIGTERM from `timeout`) stops the per-GPU ones too, so that
    # none keeps a GPU busy under whatever is timed next.
    def stop(*_):
        stopped.append(True)
        sys.exit(143)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        for i, output in enumerate(outputs):
            argv = [sys.executable, "-m", "flashtile", "bench", "--dtypes", args.dtypes, "--headdims", args.headdims,
                    "--causal", args.causal, "--seqlens", args.seqlens, "--modes", args.modes, "--peers", args.peers,
                    "--shard", f"{i}/{num_gpus}", "--rounds", str(args.rounds), "--json", output]
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices[i])
            log(f"gpu {devices[i]}: grid points {i}, {i + num_gpus}, ... of the grid")
            children.append(subprocess.Popen(argv, env=env))
        failed = [devices[i] for i, child in enumerate(children) if child.wait() != 0]
    except SystemExit:
        if not stopped:
            raise
        failed = list(devices[:num_gpus])
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        signal.signal(signal.SIGTERM, previous)
    rows = []
    for output in outputs:
        if os.path.exists(output):
            with open(output) as fh:
                rows += [Row(**r) for r in json.load(fh)["rows"]]
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if failed:
        log(f"the processes of GPU(s) {', '.join(failed)} failed or were stopped: points may be missing")
    axes = (("dtype", _csv(args.dtypes)), ("headdim", _csv(args.headdims, int)), ("causal", _csv(args.causal, _flag)),
            ("seqlen", _csv(args.seqlens, int)), ("impl", _csv(args.peers)), ("mode", _csv(args.modes)))

    def place(row: Row) -> tuple:
        return tuple(values.index(getattr(row, field)) for field, values in axes)

    return sorted(rows, key=place), 143 if stopped else (1 if failed else 0)


def _row_line(row: Row) -> str:
    value = f"{row.tflops:7.1f} TFLOP/s {row.ms:9.3f} ms" if row.tflops is not None else row.note
    if "first_call_s" in row.extra:
        value += f"  (first call {row.extra['first_call_s']:.1f} s)"
    return (f"{row.impl:10s} {row.mode:7s} {row.dtype:8s} d={row.headdim:<3d} causal={row.causal!s:5s} "
            f"s={row.seqlen:<6d} {value}")


# ---------------------------------------------------------------------------------------------------
# Variants: sliding window against full causal, varlen against the dense batch
# ---------------------------------------------------------------------------------------------------


def _fwd_bwd_ms(fn, inputs, dout) -> float:
    fn(*inputs)
    return _time_ms(lambda: torch.autograd.grad(fn(*inputs), inputs, dout))


VARIANT_PARTS = ("window", "sparse", "varlen")


def run_variants(dtype_name="bfloat16", headdim=128, nheads=16, window_seqlen=32768, window_left=1024,
                 varlen_tokens=16384, varlen_seqs=16, log=print, parts=VARIANT_PARTS) -> list[Row]:
    """Attention variants: forward+backward wall time and TFLOP/s of the useful work.

    * window: sliding window (left=window_left, causal) against full causal, one sequence of window_seqlen;
    * sparse: block-sparse local+global (about 10% density) against dense, same sequence length;
    * varlen: varlen_seqs sequences of mixed lengths totalling varlen_tokens, against a dense batch of
      equal-length sequences with the same token count (TFLOP/s from each one's own sum of s_i^2).
    """

    dtype = getattr(torch, dtype_name)
    rows = []
    if "window" in parts or "sparse" in parts:
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (1, window_seqlen, nheads, headdim)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_(True)
    windows = (("full_causal", (-1, -1)), (f"window_{window_left}", (window_left, 0))) if "window" in parts else ()
    for name, window in windows:
        ms = _fwd_bwd_ms(lambda q, k, v, w=window: flash_attn_func(q, k, v, causal=True, window_size=w), (q, k, v),
                         dout)
        # Useful FLOPs: keys each row sees (window rows see at most left + 1).
        seen = sum(min(i + 1, window[0] + 1) if window[0] >= 0 else i + 1 for i in range(window_seqlen))
        flops = 4.0 * nheads * seen * headdim * 3.5
        row = Row(name, "fwd_bwd", dtype_name, headdim, True, window_seqlen, 1, nheads, ms=ms,
                  tflops=flops / (ms * 1e-3) / 1e12)
        rows.append(row)
        log(f"{name:16s} s={window_seqlen} fwd+bwd {ms:9.3f} ms  {row.tflops:6.1f} TFLOP/s (useful)")
    if "window" in parts:
        full, windowed = rows[-2].ms, rows[-1].ms
        log(f"sliding window speed-up over full causal: {full / windowed:.1f}x")
        rows[-1].extra["speedup_vs_full_causal"] = full / windowed
    if "sparse" in parts:
        rows += _sparse_rows(q, k, v, dout, dtype_name, headdim, nheads, window_seqlen, log)
    if "varlen" in parts:
        rows += _varlen_rows(dtype, dtype_name, headdim, nheads, varlen_tokens, varlen_seqs, log)
    return rows


def _sparse_rows(q, k, v, dout, dtype_name, headdim, nheads, window_seqlen, log) -> list[Row]:
    rows = []

    # Block-sparse local + global at about 10% density, against dense (non-causal) on the same inputs.
    from .sparse import block_sparse_attn_func, local_global_block_mask

    mask = local_global_block_mask(window_seqlen, window_seqlen, 11, 1, device="cuda")
    density = mask.float().mean().item()
    ms_dense = _fwd_bwd_ms(lambda q, k, v: flash_attn_func(q, k, v), (q, k, v), dout)
    ms_sparse = _fwd_bwd_ms(lambda q, k, v: block_sparse_attn_func(q, k, v, mask), (q, k, v), dout)
    dense_flops = attention_flops(1, nheads, window_seqlen, window_seqlen, headdim, False, "fwd_bwd")
    rows.append(Row("dense", "fwd_bwd", dtype_name, headdim, False, window_seqlen, 1, nheads, ms=ms_dense,
                    tflops=dense_flops / (ms_dense * 1e-3) / 1e12))
    sparse_row = Row("block_sparse", "fwd_bwd", dtype_name, headdim, False, window_seqlen, 1, nheads, ms=ms_sparse,
                     tflops=density * dense_flops / (ms_sparse * 1e-3) / 1e12)
    sparse_row.extra.update(density=density, speedup_vs_dense=ms_dense / ms_sparse)
    rows.append(sparse_row)
    log(f"block-sparse local+global density {density:.1%}: {ms_sparse:.3f} ms vs dense {ms_dense:.3f} ms "
        f"({ms_dense / ms_sparse:.1f}x)")
    return rows


def _varlen_rows(dtype, dtype_name, headdim, nheads, varlen_tokens, varlen_seqs, log) -> list[Row]:
    from .interface import flash_attn_varlen_func

    rows = []

    # Mixed lengths: a fixed pseudo-random split of the tokens, every length a multiple of 8.
    weights = torch.rand(varlen_seqs, generator=torch.Generator().manual_seed(1)) + 0.25
    lengths = (weights / weights.sum() * varlen_tokens / 8).floor().int() * 8
    lengths[-1] += varlen_tokens - int(lengths.sum())
    lengths = lengths.tolist()
    cu = torch.zeros(varlen_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu = cu.cuda()
    packed = [torch.randn(varlen_tokens, nheads, headdim, device="cuda", dtype=dtype) for _ in range(4)]
    for x in packed[:3]:
        x.requires_grad_(True)
    for causal in (False, True):
        ms = _fwd_bwd_ms(lambda q, k, v, c=causal: flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                                          causal=c), packed[:3], packed[3])
        flops = sum(attention_flops(1, nheads, n, n, headdim, causal, "fwd_bwd") for n in lengths)
        varlen_row = Row("varlen", "fwd_bwd", dtype_name, headdim, causal, max(lengths), varlen_seqs, nheads, ms=ms,
                         tflops=flops / (ms * 1e-3) / 1e12)
        dense_len = varlen_tokens // varlen_seqs
        dense = [x.view(varlen_seqs, dense_len, nheads, headdim) for x in packed]
        ms_dense = _fwd_bwd_ms(lambda q, k, v, c=causal: flash_attn_func(q, k, v, causal=c), dense[:3], dense[3])
        flops_dense = attention_flops(varlen_seqs, nheads, dense_len, dense_len, headdim, causal, "fwd_bwd")
        dense_row = Row("dense_batch", "fwd_bwd", dtype_name, headdim, causal, dense_len, varlen_seqs, nheads,
                        ms=ms_dense, tflops=flops_dense / (ms_dense * 1e-3) / 1e12)
        varlen_row.extra["lengths"] = lengths
        varlen_row.extra["fraction_of_dense_tflops"] = varlen_row.tflops / dense_row.tflops
        # The same call without the cu_seqlens value check (its device-to-host read each call).
        with env_setting("FLASHTILE_VALUE_CHECKS", "0"):
            ms_unchecked = _fwd_bwd_ms(lambda q, k, v, c=causal: flash_attn_varlen_func(
                q, k, v, cu, cu, max(lengths), max(lengths), causal=c), packed[:3], packed[3])
        unchecked_tflops = flops / (ms_unchecked * 1e-3) / 1e12
        varlen_row.extra["tflops_value_checks_off"] = unchecked_tflops
        rows += [varlen_row, dense_row]
        log(f"varlen  causal={causal!s:5s} {varlen_row.tflops:6.1f} TFLOP/s vs dense batch {dense_row.tflops:6.1f} "
            f"({varlen_row.tflops / dense_row.tflops:.0%}); with FLASHTILE_VALUE_CHECKS=0 {unchecked_tflops:6.1f} "
            f"({unchecked_tflops / dense_row.tflops:.0%})  lengths {lengths}")
    return rows


# ---------------------------------------------------------------------------------------------------
# Decoding: one new query token against a KV cache
# ---------------------------------------------------------------------------------------------------

DECODE_SHAPES = ((1, 32, 8, 131072), (8, 32, 8, 32768), (64, 32, 8, 4096), (32, 32, 32, 8192))


def copy_bandwidth_tbps(nbytes: int = 2**30) -> float:
    """Device-to-device copy rate, bytes read + written: the ceiling for memory-bound kernels."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = _time_ms(lambda: buffer.clone())
    return 2 * nbytes / (ms * 1e-3) / 1e12


def run_decode(shapes=DECODE_SHAPES, headdim=128, dtype_name="bfloat16", log=print,
               splits: tuple[int, ...] = ()) -> list[Row]:
    """flashtile's flash_attn_with_kvcache (contiguous, paged 16 and 256) against SDPA with enable_gqa.

    Each call is timed replayed from a CUDA graph (as serving engines run decoding steps: no Python or
    launch overhead, which at ~0.1 ms per kernel would otherwise be most of what is measured), and
    also eagerly (``eager_us``; flashtile's eager call includes its one host read of the index checks).
    Bandwidth = bytes of K and V read once / graph time, against the device-to-device copy rate
    measured in the same run. SDPA has no paged cache: its paged rows say so. ``splits`` adds rows of
    flashtile's contiguous cache at those fixed ``num_splits`` (a sweep of the split-KV heuristic).
    """
    copy_tbps = copy_bandwidth_tbps()
    log(f"device-to-device copy: {copy_tbps:.2f} TB/s (bytes read + written)")
    rows = []
    for shape in shapes:
        rows += _decode_shape(*shape, headdim, dtype_name, copy_tbps, log, splits)
    return rows


def _decode_shape(batch, nheads, nheads_k, length, headdim, dtype_name, copy_tbps, log, splits=()) -> list[Row]:
    from .inference import flash_attn_with_kvcache

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=dtype, generator=gen)
    k_cache = torch.randn(batch, length, nheads_k, headdim, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn_like(k_cache)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    calls = {
        "flashtile": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
        "sdpa_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), enable_gqa=True),
    }
    for page in (16, 256):
        pages = batch * length // page
        # The pool holds the same rows in shuffled pages: only the layout differs from contiguous.
        k_pool = k_cache.view(pages, page, nheads_k, headdim)
        v_pool = v_cache.view(pages, page, nheads_k, headdim)
        table = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, length // page)
        calls[f"flashtile_paged{page}"] = (lambda k_pool=k_pool, v_pool=v_pool, table=table: flash_attn_with_kvcache(
            q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table))
        calls[f"sdpa_paged{page}"] = None
    for count in splits:
        calls[f"flashtile_splits{count}"] = (lambda count=count: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=count))
    rows = []
    for name, fn in calls.items():
        row = Row(name, "decode", dtype_name, headdim, False, length, batch, nheads)
        row.extra.update(nheads_k=nheads_k, copy_tbps=copy_tbps)
        if fn is None:
            row.note = "n/a: SDPA has no paged KV cache"
        else:
            try:
                import triton.testing

                fn()
                row.extra["eager_us"] = _time_ms(fn) * 1e3
                row.ms = math.nan if warm_only() else triton.testing.do_bench_cudagraph(fn, rep=100,
                                                                                     return_mode="median")
                row.extra["tbps"] = kv_bytes / (row.ms * 1e-3) / 1e12
                row.extra["of_copy"] = row.extra["tbps"] / copy_tbps
            except Exception as exc:
                row.note = _short_error(exc)
        rows.append(row)
        value = (f"{row.ms * 1e3:8.1f} us {row.extra['tbps']:5.2f} TB/s ({row.extra['of_copy']:.0%} of copy)"
                 f"  eager {row.extra['eager_us']:7.1f} us" if row.ms else row.note)
        log(f"decode B={batch:<3d} H={nheads} Hk={nheads_k} L={length:<7d} {name:18s} {value}")
    return rows


# ---------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------


def run_memory_gpu(seqlens, impls=("flashtile", "naive"), nheads=16, headdim=128, dtype_name="bfloat16",
                   causal=True, log=print) -> list[Row]:
    """Peak memory beyond q, k, v, dout of one forward+backward of one sequence."""
    dtype = getattr(torch, dtype_name)
    rows = []
    for impl_name in impls:
        stop = False
        for seqlen in seqlens:
            row = Row(impl_name, "memory", dtype_name, headdim, causal, seqlen, 1, nheads)
            if stop:
                row.note = "n/a: out of memory at a shorter length"
                rows.append(row)
                continue
            try:
                impl = _implementation(impl_name, seqlen, seqlen, causal)
                shape = (1, seqlen, nheads, headdim)
                q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
                for x in (q, k, v):
                    x.requires_grad_(True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start = time.perf_counter()
                out = impl(q, k, v, causal)
                torch.cuda.synchronize()
                fwd_s = time.perf_counter() - start
                grads = torch.autograd.grad(out, (q, k, v), dout)
                torch.cuda.synchronize()
                total_s = time.perf_counter() - start
                row.extra["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                row.extra["fwd_s"], row.extra["bwd_s"] = fwd_s, total_s - fwd_s
                row.ms = total_s * 1e3
                row.tflops = attention_flops(1, nheads, seqlen, seqlen, headdim, causal, "fwd_bwd") / total_s / 1e12
                del out, grads
            except torch.cuda.OutOfMemoryError as exc:
                row.note = _short_error(exc)
                stop = True
            finally:
                q = k = v = dout = None
                torch.cuda.empty_cache()
            rows.append(row)
            log(f"{row.impl:10s} memory s={seqlen:<8d} " + (
                f"peak extra {row.extra['peak_extra_gib']:.3f} GiB, fwd {row.extra['fwd_s']:.3f} s, "
                f"bwd {row.extra['bwd_s']:.3f} s" if row.note == "" else row.note))
    return rows


class PeakMemoryTracker(TorchDispatchMode):
    """Live bytes of tensors created inside the mode (CPU has no allocator statistics).

    Counts each new storage once, when an operator returns it, and releases it when the tensor that
    brought it in is collected. Views do not count. Good enough to tell O(n) from O(n^2).
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr in self._storages or ptr == 0:
                    continue
                nbytes = t.untyped_storage().nbytes()
                self._storages.add(ptr)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._release, ptr, nbytes)
        return result

    def _release(self, ptr: int, nbytes: int) -> None:
        if ptr in self._storages:
            self._storages.discard(ptr)
            self.live -= nbytes


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensors alive at once while ``fn`` runs (its result released at the end)."""
    tracker = PeakMemoryTracker()
    with tracker:
        result = fn()
        del result
    return tracker.peak


def run_cpu(seqlens=(256, 512, 1024, 2048), nheads=4, headdims=(64,), dtypes=("float32",), causals=(True,),
            peers=("flashtile", "naive"), log=print) -> list[Row]:
    """CPU mode: the tiled PyTorch path against naive attention, forward+backward time and peak memory, batch 1."""
    rows = []
    # The CPU comparison is of the tiled PyTorch path, also where TRITON_INTERPRET=1 is set.
    with env_setting("FLASHTILE_BACKEND", "torch"):
        for dtype_name in dtypes:
            for headdim in headdims:
                for causal in causals:
                    for seqlen in seqlens:
                        rows += _run_cpu_seqlen(seqlen, nheads, headdim, getattr(torch, dtype_name), dtype_name,
                                                causal, peers, log)
    return rows


def _run_cpu_seqlen(seqlen, nheads, headdim, dtype, dtype_name, causal, peers, log) -> list[Row]:
    rows = []
    gen = torch.Generator().manual_seed(seqlen)
    shape = (1, seqlen, nheads, headdim)
    q, k, v, dout = (torch.randn(shape, dtype=dtype, generator=gen) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    impls = {
        "flashtile": lambda: flash_attn_func(q, k, v, causal=causal),
        "naive": lambda: _naive(q, k, v, causal),
    }
    for name in peers:
        forward = impls[name]

        def step(forward=forward):
            return torch.autograd.grad(forward(), (q, k, v), dout)

        step()  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        ms = sorted(times)[1] * 1e3
        row = Row(name, "fwd_bwd", dtype_name, headdim, causal, seqlen, 1, nheads, ms=ms)
        row.tflops = attention_flops(1, nheads, seqlen, seqlen, headdim, causal, "fwd_bwd") / (ms * 1e-3) / 1e12
        row.extra["peak_extra_mib"] = cpu_peak_bytes(step) / 2**20
        rows.append(row)
        log(f"cpu {name:10s} fwd+bwd {dtype_name} d={headdim} causal={causal!s:5s} s={seqlen:<6d} {ms:9.1f} ms  "
            f"peak extra {row.extra['peak_extra_mib']:8.1f} MiB")
    return rows


# ---------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cudnn"] = str(torch.backends.cudnn.version())
    try:
        # FLASHTILE_COMMIT names the commit where the tree was copied without its .git (the GPU machine).
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
        info["commit"] = os.environ.get("FLASHTILE_COMMIT") or git.stdout.strip() or "unknown"
    except OSError:
        info["commit"] = "unknown"
    return info


def speed_table(rows: list[Row], peers: list[str]) -> str:
    """Markdown: one line per (dtype, d, causal, s), TFLOP/s per peer and mode, flashtile's ratios."""
    keyed: dict[tuple, dict[tuple[str, str], Row]] = {}
    for r in rows:
        keyed.setdefault((r.dtype, r.headdim, r.causal, r.seqlen), {})[(r.impl, r.mode)] = r
    modes = [m for m in MODES if any(r.mode == m for r in rows)]
    others = [p for p in peers if p != "flashtile"]
    head = ["dtype", "d", "causal", "s"]
    for mode in modes:
        head += [f"{p} {mode}" for p in peers]
        if "flashtile" in peers:
            head += [f"ratio vs {p} {mode}" for p in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(row: Row | None) -> str:
        if row is None:
            return "-"
        return f"{row.tflops:.0f}" if row.tflops is not None else row.note.split(":")[0] + "*"

    for (dtype, d, causal, s), by in sorted(keyed.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3])):
        cells = [dtype, str(d), "yes" if causal else "no", str(s)]
        for mode in modes:
            cells += [fmt(by.get((p, mode))) for p in peers]
            if "flashtile" in peers:
                mine = by.get(("flashtile", mode))
                for p in others:
                    theirs = by.get((p, mode))
                    ok = mine and theirs and mine.tflops and theirs.tflops
                    cells.append(f"{mine.tflops / theirs.tflops:.2f}" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values))


def summary_line(rows: list[Row], peers: list[str]) -> str:
    """One line: flashtile's TFLOP/s over each peer's per mode, geometric mean and range over the points
    where both were measured."""
    by = {(r.impl, r.mode, r.dtype, r.headdim, r.causal, r.seqlen): r.tflops for r in rows if r.tflops}
    modes = [m for m in MODES if any(r.mode == m for r in rows)]
    parts = []
    for peer in (p for p in peers if p != "flashtile"):
        cells = []
        for mode in modes:
            ratios = [tflops / by[(peer,) + key[1:]] for key, tflops in by.items()
                      if key[0] == "flashtile" and key[1] == mode and (peer,) + key[1:] in by]
            if ratios:
                cells.append(f"{mode} {_geomean(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        parts.append(f"vs {peer} " + (", ".join(cells) if cells else "not measured"))
    return "summary, flashtile's TFLOP/s over each peer's (geometric mean, range): " + "; ".join(parts)


def cpu_summary_line(rows: list[Row]) -> str:
    """One line at the longest CPU point: time and peak memory of the tiled path against naive attention."""
    longest = max(r.seqlen for r in rows)
    by = {r.impl: r for r in rows if r.seqlen == longest}
    if set(by) != {"flashtile", "naive"}:
        return f"summary: at s={longest} " + ", ".join(f"{r.impl} {r.ms:.1f} ms" for r in by.values())
    mine, naive = by["flashtile"], by["naive"]
    return (f"summary at s={longest} ({mine.dtype}, d={mine.headdim}, forward+backward): the tiled path "
            f"{mine.ms:.1f} ms and {mine.extra['peak_extra_mib']:.1f} MiB beyond its inputs, naive attention "
            f"{naive.ms:.1f} ms and {naive.extra['peak_extra_mib']:.1f} MiB")


def _series(ax, points: dict[str, list[tuple[float, float]]]) -> None:
    for impl, pts in points.items():
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", label=impl)
    ax.set_xscale("log", base=2)
    lengths = sorted({x for pts in points.values() for x, _ in pts})
    ax.set_xticks(lengths, [f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in lengths])
    ax.minorticks_off()


def plot(rows: list[Row], path_prefix: str) -> list[str]:
    """PNG charts of a run's rows: PREFIX_speed.png (TFLOP/s against sequence length for the first dtype of
    the run: a column per head dim, a row per mode and causal or not; forward+backward only when the run
    has no separate forward and backward) and PREFIX_memory.png (peak memory against sequence length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    speed = [r for r in rows if r.mode in MODES and r.tflops is not None and r.impl in PEERS]
    if speed:
        dtype = speed[0].dtype
        speed = [r for r in speed if r.dtype == dtype]
        if {"fwd", "bwd"} <= {r.mode for r in speed}:
            speed = [r for r in speed if r.mode != "fwd_bwd"]
        headdims = sorted({r.headdim for r in speed})
        panels = sorted({(MODES.index(r.mode), r.causal) for r in speed})
        fig, axes = plt.subplots(len(panels), len(headdims), figsize=(4.2 * len(headdims), 0.6 + 2.9 * len(panels)),
                                 squeeze=False)
        for i, (mode_index, causal) in enumerate(panels):
            mode = MODES[mode_index]
            for j, d in enumerate(headdims):
                ax = axes[i][j]
                _series(ax, {impl: [(r.seqlen, r.tflops) for r in speed if (r.impl, r.mode, r.causal, r.headdim)
                                    == (impl, mode, causal, d)] for impl in PEERS})
                ax.set_title(f"{mode.replace('_', '+')}, d={d}, {'causal' if causal else 'not causal'}", fontsize=10)
                ax.set_ylim(bottom=0)
                if j == 0:
                    ax.set_ylabel("TFLOP/s")
                if i == len(panels) - 1:
                    ax.set_xlabel("sequence length")
        handles, labels = axes[0][0].get_legend_handles_labels()
        first = speed[0]
        shape = [dtype, f"batch {first.batch}" if len({r.batch for r in speed}) == 1 else
                 f"batch x seqlen = {first.batch * first.seqlen}",
                 f"{first.nheads} heads" if len({r.nheads for r in speed}) == 1 else
                 f"heads x head dim = {first.nheads * first.headdim}"]
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / (0.6 + 2.9 * len(panels))))
        fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False, title=", ".join(shape))
        fig.savefig(f"{path_prefix}_speed.png", dpi=100)
        written.append(f"{path_prefix}_speed.png")
    memory = [r for r in rows if "peak_extra_gib" in r.extra or "peak_extra_mib" in r.extra]
    if memory:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        _series(ax, {impl: [(r.seqlen, r.extra.get("peak_extra_gib", r.extra.get("peak_extra_mib", 0) / 1024))
                            for r in memory if r.impl == impl] for impl in sorted({r.impl for r in memory})})
        ax.set_yscale("log")
        ax.set_xlabel("seqlen (tokens)")
        ax.set_ylabel("peak memory beyond inputs (GiB)")
        ax.set_title("forward+backward memory")
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{path_prefix}_memory.png", dpi=110)
        written.append(f"{path_prefix}_memory.png")
    return written


def _csv(value: str, cast=str) -> list:
    return [cast(x) for x in value.split(",") if x]


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


# ---------------------------------------------------------------------------------------------------
# Command line: `flashtile bench`
# ---------------------------------------------------------------------------------------------------

# The speed grid's axes: the headline run (the default: a few shapes, one summary line), the whole grid
# (--full), and the CPU comparison (no GPU, or --cpu). A grid flag given on the command line replaces
# that axis of whichever applies.
GRID_AXES = ("dtypes", "headdims", "causal", "seqlens", "modes", "peers")
HEADLINE = {"dtypes": "bfloat16", "headdims": "64,128", "causal": "false,true", "seqlens": "1024,8192",
            "modes": ",".join(MODES), "peers": "flashtile,sdpa_flash,sdpa_cudnn"}
FULL_GRID = {"dtypes": "bfloat16,float16", "headdims": "64,128,256", "causal": "false,true",
             "seqlens": "512,1024,2048,4096,8192,16384", "modes": ",".join(MODES),
             "peers": ",".join(p for p in PEERS if p != "fa4")}
CPU_GRID = {"dtypes": "float32", "headdims": "64", "causal": "true", "seqlens": "256,512,1024,2048",
            "modes": "fwd_bwd", "peers": "flashtile,naive"}
CPU_HEADS = 4


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="flashtile bench", description=__doc__.split("\n")[0])
    parser.description = (
        "Time flashtile against its peers on the same inputs in one process. By default a headline run: "
        "bf16, head dims 64 and 128, causal and not, a short and a long sequence (batch x seqlen = 16384, "
        "heads x head dim = 2048), forward, backward and both, against SDPA's flash and cuDNN backends; "
        "--full runs the whole grid. Without a GPU: the tiled PyTorch path against naive attention on CPU.")

    def axis_help(name: str, text: str) -> str:
        return (f"{text} (default {HEADLINE[name]}; with --full {FULL_GRID[name]}; on CPU {CPU_GRID[name]})")

    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument("--full", action="store_true",
                       help="the whole speed grid: bf16 and fp16, d=64/128/256, causal and not, s=512..16384, all "
                            "five implementations (more than 9 minutes on one H200; --gpus spreads it)")
    kinds.add_argument("--memory", action="store_true",
                       help="peak memory of one forward+backward of one sequence, up to 1M tokens (GPU)")
    kinds.add_argument("--decode", action="store_true",
                       help="one new token against KV caches: contiguous, paged, SDPA with enable_gqa (GPU)")
    kinds.add_argument("--overhead", action="store_true",
                       help="wall time per eager call as a model makes it (q, k, v views of one projection, "
                            "backward through autograd, no CUDA graphs): short-sequence forward and "
                            "forward+backward and KV-cache decoding steps, against SDPA (GPU)")
    kinds.add_argument("--variants", action="store_true",
                       help="sliding window vs full causal at 32k, block-sparse vs dense, varlen vs dense batch (GPU)")
    parser.add_argument("--dtypes", help=axis_help("dtypes", "comma list of torch dtypes"))
    parser.add_argument("--headdims", help=axis_help("headdims", "comma list of head dims"))
    parser.add_argument("--causal", help=axis_help("causal", "comma list of true/false"))
    parser.add_argument("--seqlens", help=axis_help("seqlens", "comma list of sequence lengths"))
    parser.add_argument("--modes", help=axis_help("modes", f"comma list of {', '.join(MODES)}"))
    parser.add_argument("--peers", help=axis_help("peers", f"comma list of {', '.join(PEERS)}") +
                        "; with --memory: of flashtile, sdpa_flash, sdpa_cudnn, naive")
    parser.add_argument("--fp8", action="store_true",
                        help="with --overhead: FP8 inference forwards at its training shapes instead, against the "
                             "16-bit forward and SDPA (GPU)")
    parser.add_argument("--variant-parts", default=",".join(VARIANT_PARTS),
                        help="with --variants: a comma list of window, sparse, varlen (default all)")
    parser.add_argument("--decode-splits", default="",
                        help="with --decode: also time flashtile at these fixed num_splits (comma list)")
    parser.add_argument("--memory-seqlens", default="4096,16384,65536,262144,1048576",
                        help="with --memory: the sequence lengths (default 4096,...,1048576)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every row, with the environment, as JSON")
    parser.add_argument("--plot", default=None, metavar="PREFIX",
                        help="write PREFIX_speed.png and/or PREFIX_memory.png (needs matplotlib)")
    parser.add_argument("--cpu", action="store_true", help="the CPU comparison even when a GPU is present")
    parser.add_argument("--shard", default="0/1", metavar="I/N",
                        help="speed grid: only every N-th point from the I-th (for parallel cache warming)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="speed grid: time each point's peers N times in turn, the order rotated each round, "
                             "and report the median (a peer timed after another runs in the state it left the GPU in)")
    parser.add_argument("--gpus", type=int, default=1, metavar="N",
                        help="speed grid: spread the points over N GPUs of this host (one process each; "
                             "every point's peers on one GPU)")
    return parser


def _write_json(path: str, env: dict, rows: list[Row]) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump({"environment": env, "rows": [asdict(r) for r in rows]}, fh, indent=1)
    os.replace(path + ".tmp", path)  # whole or not at all, also when the run is stopped mid-write


def _kind(args: argparse.Namespace) -> str:
    """Which run: "cpu", "grid" (the headline or, with --full, the whole grid) or another of RUNS."""
    other = [name for name in RUNS if name not in ("cpu", "grid") and getattr(args, name)]
    if args.cpu or not torch.cuda.is_available():
        gpu_only = other + ["full"] * args.full + ["gpus"] * (args.gpus > 1) + ["shard"] * (args.shard != "0/1")
        if gpu_only:
            raise SystemExit(f"flashtile bench: {', '.join('--' + f for f in gpu_only)} "
                             f"need{'s' if len(gpu_only) == 1 else ''} a CUDA GPU; on CPU the "
                             "harness compares the tiled PyTorch path with naive attention (options --dtypes, "
                             "--headdims, --causal, --seqlens, --peers)")
        return "cpu"
    if other and args.gpus > 1:
        raise SystemExit(f"--gpus spreads the speed grid only, not --{other[0]}")
    return other[0] if other else "grid"


def _resolve_axes(args: argparse.Namespace, kind: str) -> None:
    """Fill the grid flags left out with the defaults of this kind of run (in place)."""
    base = CPU_GRID if kind == "cpu" else FULL_GRID if args.full else HEADLINE
    for name in GRID_AXES:
        if getattr(args, name) is None:
            setattr(args, name, base[name])
    if kind == "cpu":
        if set(_csv(args.peers)) - {"flashtile", "naive"}:
            raise SystemExit(f"--peers {args.peers}: on CPU the harness compares flashtile and naive only")
        if _csv(args.modes) != ["fwd_bwd"]:
            raise SystemExit(f"--modes {args.modes}: on CPU the harness times forward+backward only (fwd_bwd)")
    unknown = set(_csv(args.peers)) - set(PEERS) or set(_csv(args.modes)) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown peer or mode {', '.join(sorted(unknown))}: peers {', '.join(PEERS)}; "
                         f"modes {', '.join(MODES)}")


def _describe(args: argparse.Namespace, kind: str) -> str:
    causal = {"false": "not causal", "true": "causal"}
    causals = " and ".join(causal.get(c.strip().lower(), c) for c in _csv(args.causal))
    if kind == "cpu":
        return (f"CPU: the tiled PyTorch path against naive attention, forward+backward, batch 1, {CPU_HEADS} heads, "
                f"d={args.headdims}, {args.dtypes}, {causals}, s={args.seqlens} (--dtypes, --headdims, --causal "
                "and --seqlens change these)")
    which = "the whole grid" if args.full else "headline run (--full: the whole grid)"
    return (f"{which}: {args.dtypes}, d={args.headdims}, {causals}, s={args.seqlens}, batch x seqlen = 16384, "
            f"heads x head dim = 2048; modes {args.modes}; peers {args.peers}")


def _run_cpu(args, env, log) -> tuple[list[Row], int]:
    rows = run_cpu(seqlens=_csv(args.seqlens, int), nheads=CPU_HEADS, headdims=_csv(args.headdims, int),
                   dtypes=_csv(args.dtypes), causals=_csv(args.causal, _flag), peers=_csv(args.peers), log=log)
    print(cpu_summary_line(rows))
    return rows, 0


def _run_grid(args, env, log) -> tuple[list[Row], int]:
    peers = _csv(args.peers)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: at least 1")
    if args.gpus > 1:
        if args.shard != "0/1":
            raise SystemExit("--gpus and --shard cannot be combined (--gpus shards the grid itself)")
        rows, status = run_speed_on_gpus(args, args.gpus, log=log)
    else:
        rows, status = [], 0

        def log(line, rows=rows):
            print(line, flush=True)
            if args.json:  # rows so far: a run ended by a time limit still leaves what it measured
                _write_json(args.json, env, rows)

        run_speed(_csv(args.dtypes), _csv(args.headdims, int), _csv(args.causal, _flag), _csv(args.seqlens, int),
                  _csv(args.modes), peers, log=log, shard=tuple(int(x) for x in args.shard.split("/")), rows=rows,
                  rounds=args.rounds)
    if any(r.mode in MODES for r in rows):
        print()
        print(speed_table(rows, peers))
        print()
        print(summary_line(rows, peers))
    return rows, status


def _run_memory(args, env, log) -> tuple[list[Row], int]:
    peers = _csv(args.peers or "flashtile,sdpa_flash,sdpa_cudnn,naive")
    impls = [p for p in peers if p in ("flashtile", "naive", "sdpa_flash", "sdpa_cudnn")]
    return run_memory_gpu(_csv(args.memory_seqlens, int), impls=impls, log=log), 0


def _run_decode(args, env, log) -> tuple[list[Row], int]:
    splits = tuple(_csv(args.decode_splits, int)) if args.decode_splits else ()
    return run_decode(log=log, splits=splits), 0


def _run_variants(args, env, log) -> tuple[list[Row], int]:
    parts = _csv(args.variant_parts)
    if set(parts) - set(VARIANT_PARTS):
        raise SystemExit(f"--variant-parts: choose from {', '.join(VARIANT_PARTS)}, got {args.variant_parts}")
    return run_variants(log=log, parts=tuple(parts)), 0


def _run_overhead(args, env, log) -> tuple[list[Row], int]:
    from . import bench_overhead

    results = bench_overhead.run_fp8_overhead(log=log) if args.fp8 else bench_overhead.run_overhead(log=log)
    print()
    print(bench_overhead.overhead_table(results))
    print()
    print(bench_overhead.summary(results))
    rows = []
    for result in results:
        if result["kind"] == "decode":
            (batch, length), (nheads, _, headdim), seqlen = result["shape"], bench_overhead.DECODE_HEADS, 1
        else:
            (batch, seqlen, nheads, headdim), length = result["shape"], None
        for impl, us in result["us"].items():
            dtype = "float8_e4m3fn" if impl.startswith("flashtile_fp8") else "bfloat16"
            rows.append(Row(impl, result["mode"], dtype, headdim, result["causal"], seqlen, batch, nheads,
                            ms=us / 1e3 if isinstance(us, float) else None, note="" if isinstance(us, float) else us,
                            extra={"overhead": result["kind"], **({"cache": length} if length else {}),
                                   **({"variant": result["variant"]} if result.get("variant") else {}),
                                   **({"loops_us": result["spread"][impl]} if impl in result.get("spread", {})
                                      else {})}))
    return rows, 0


# Each kind of run: (args, environment, log) -> (rows, exit status). Besides "cpu" and "grid", each has a
# flag of its own in build_parser's `kinds` group (mutually exclusive) named as its key here; a new kind is
# a flag there, a function like these and its entry here.
RUNS = {"cpu": _run_cpu, "grid": _run_grid, "memory": _run_memory, "decode": _run_decode, "variants": _run_variants,
        "overhead": _run_overhead}


def main(args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args()
    # Checks that need no work first: a run must not end, minutes later, on a missing plotting library.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(or pip install -e \".[plot]\" in a checkout)")
    if args.fp8 and not args.overhead:
        raise SystemExit("--fp8 goes with --overhead (FP8 inference forwards' wall time per call)")
    kind = _kind(args)
    if kind in ("cpu", "grid"):
        _resolve_axes(args, kind)
    env = environment()
    print("flashtile bench: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if kind in ("cpu", "grid"):
        print(_describe(args, kind), flush=True)
    log = lambda line: print(line, flush=True)
    rows, status = RUNS[kind](args, env, log)
    if args.json:
        _write_json(args.json, env, rows)
    if args.plot:
        for path in plot(rows, args.plot):
            print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
