"""Train the same compiled GPT twice, with flashtile attention and with PyTorch SDPA, and compare.

Same seed, same initial weights, same batches (characters of the standard library's source), bf16
autocast, AdamW, ``torch.compile(fullgraph=True)``. Prints the loss every 10 steps for both, the largest
and mean loss difference, and tokens/s of each (steps after the first 20, which include compilation).

    python benchmarks/train_compare.py --steps 200 --json out/train.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time

import torch
import torch.nn.functional as F

import flashtile.nn.attention as attention_module
from flashtile.demo import load_corpus
from flashtile.nn import GPT, GPTConfig


def sdpa_attention(q, k, v, dropout_p=0.0, causal=False, window_size=(-1, -1), **_):
    """flash_attn_func's contract (BSHD in and out) on top of SDPA, for the comparison run."""
    if tuple(window_size) != (-1, -1):
        raise ValueError("the SDPA baseline has no sliding window")
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
                                         is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def fp8_attention(q, k, v, dropout_p=0.0, causal=False, window_size=(-1, -1), **_):
    """flash_attn_func's contract on top of ``flashtile.fp8.fp8_attn_func`` (FP8 inputs, for training)."""
    from flashtile.fp8 import fp8_attn_func

    if dropout_p:
        raise ValueError("fp8_attn_func has no dropout")
    return fp8_attn_func(q, k, v, causal=causal, window_size=window_size)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _sdpa_backends(name: str):
    """The SDPA backends a run may use: PyTorch's own choice ("auto"), or one forced."""
    from torch.nn.attention import SDPBackend

    chosen = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
              "efficient": [SDPBackend.EFFICIENT_ATTENTION]}
    return chosen.get(name, list(SDPBackend.__members__.values()))


def train(impl: str, args, data: torch.Tensor, seed: int) -> dict:
    """impl: "flashtile", "flashtile-fp8" (FP8 attention inputs), or "sdpa" / "sdpa:flash" / "sdpa:cudnn" (a
    forced SDPA backend)."""
    from torch.nn.attention import sdpa_kernel

    original = attention_module.flash_attn_func
    if impl.startswith("sdpa"):
        attention_module.flash_attn_func = sdpa_attention
    elif impl == "flashtile-fp8":
        attention_module.flash_attn_func = fp8_attention
    # The backend is fixed when torch.compile traces (the first step), so the context covers the run.
    backends = _sdpa_backends(impl.partition(":")[2] or "auto")
    counted = impl == "flashtile-fp8" and not args.compile
    with sdpa_kernel([b for b in backends if b.name != "ERROR"]), _count_fp8_backwards(counted) as counts:
        result = _train(impl, args, data, seed, original)
    if counted:  # which backward ran: FLASHTILE_FP8_BACKWARD=1 asks for the FP8 products
        print(f"[{impl}] backward calls with FP8 products: {counts['fp8']} of {counts['fp8'] + counts['16-bit']}")
        result["fp8_backward_calls"] = dict(counts)
    return result


@contextlib.contextmanager
def _count_fp8_backwards(counted: bool):
    """Counts an eager FP8 run's backward calls by kind: FP8 products or 16-bit (``--profile``'s steps included).
    Not for a compiled run: its backward op reaches ``run_backward`` only on the calls that record launch plans."""
    from flashtile import _ops

    counts = {"fp8": 0, "16-bit": 0}
    if not counted:
        yield counts
        return
    run_backward = _ops.run_backward

    def counted(*args, fp8=None, **kwargs):
        counts["fp8" if fp8 is not None else "16-bit"] += 1
        return run_backward(*args, fp8=fp8, **kwargs)
    _ops.run_backward = counted
    try:
        yield counts
    finally:
        _ops.run_backward = run_backward


def _train(impl: str, args, data: torch.Tensor, seed: int, original) -> dict:
    try:
        torch.manual_seed(seed)
        config = GPTConfig(vocab_size=256, block_size=args.seqlen, n_layer=args.layers, n_head=args.heads,
                           n_embd=args.heads * args.headdim)
        model = GPT(config).to(args.device)
        mode = args.compile_mode
        step_fn = torch.compile(model, fullgraph=True, mode=mode) if args.compile else model
        graphs = args.compile and mode is not None and "reduce-overhead" in mode
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        batches = torch.Generator().manual_seed(seed + 1)

        def one_step(rows):
            if graphs:  # CUDA graphs: a new step begins (outputs of the last replay may be overwritten)
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
                _, loss = step_fn(rows[:, :-1], rows[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().clone() if graphs else loss.detach()
        losses, start, marks, gc_ms = [], None, [], [0.0, 0]
        for step in range(args.steps):
            if step == args.warmup_steps:
                _sync(args.device)
                start = time.perf_counter()
                gc.callbacks.append(_gc_timer(gc_ms))
            if start is not None and args.device == "cuda":
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
            offsets = torch.randint(0, data.numel() - args.seqlen - 1, (args.batch,), generator=batches)
            rows = torch.stack([data[o: o + args.seqlen + 1] for o in offsets.tolist()])
            # Pageable memory: the copy waits for the GPU (a sync per step); pinned, as nanoGPT's loader, it
            # is queued behind the last step and the host runs ahead.
            rows = (rows.pin_memory().to(args.device, non_blocking=True) if args.pinned and args.device == "cuda"
                    else rows.to(args.device))
            losses.append(one_step(rows))
        _sync(args.device)
        elapsed = time.perf_counter() - start
        gc.callbacks.pop()
        tokens = (args.steps - args.warmup_steps) * args.batch * args.seqlen
        if len(marks) > 2:
            # Step times on the GPU's clock (start to start): a median well under the mean means hiccups.
            steps_ms = sorted(a.elapsed_time(b) for a, b in zip(marks, marks[1:]))
            print(f"[{impl}] step ms: median {steps_ms[len(steps_ms) // 2]:.2f}, mean "
                  f"{sum(steps_ms) / len(steps_ms):.2f}, max {steps_ms[-1]:.2f}; Python's gc: {gc_ms[1]} "
                  f"collections, {gc_ms[0]:.1f} ms in the timed steps")
        if args.profile:
            _profile(impl, lambda: one_step(rows), trace_dir=args.trace_dir)
        return {"impl": impl, "losses": [float(x) for x in losses], "tokens_per_s": tokens / elapsed}
    finally:
        attention_module.flash_attn_func = original


def _gc_timer(total: list):
    """A ``gc.callbacks`` entry adding each collection's milliseconds and count to ``total``."""
    began = []

    def callback(phase, info):
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            total[0] += (time.perf_counter() - began.pop()) * 1e3
            total[1] += 1
    return callback


def _profile(impl: str, step, steps: int = 3, trace_dir: str | None = None) -> None:
    """Kernel time per training step by kernel, largest first: where the step's GPU time goes. Also the
    GPU timeline's span per step against the time some kernel runs (idle GPU = host or sync bound) and the
    busy time per CUDA stream; ``trace_dir``: the Chrome trace saved there (gzip) for a closer look."""
    import gzip
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / steps
    print(f"[profile {impl}] GPU kernel time per step {total / 1e3:.2f} ms; the largest kernels (ms per step, calls):")
    for e in events[:24]:
        print(f"  {e.self_device_time_total / steps / 1e3:8.3f}  {e.count // steps:4d}  {e.key[:110]}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            name = os.path.join(trace_dir, f"{impl.replace(':', '_')}.json.gz")
            with open(path, "rb") as f, gzip.open(name, "wb") as g:
                g.write(f.read())
    _timeline(impl, trace, steps)


def _timeline(impl: str, trace: dict, steps: int) -> None:
    """GPU span, busy union and per-stream busy time per step, and the largest idle gaps, from a trace."""
    gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return
    gpu.sort(key=lambda e: e["ts"])
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy, gaps, end, last = 0.0, [], gpu[0]["ts"], None
    streams: dict = {}
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e["dur"]
        stream = e.get("args", {}).get("stream", "?")
        streams[stream] = streams.get(stream, 0.0) + e["dur"]
        if start > end:
            gaps.append((start - end, last, e["name"]))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, e["name"]
    per = {k: round(v / steps / 1e3, 2) for k, v in sorted(streams.items(), key=lambda kv: -kv[1])}
    print(f"[timeline {impl}] per step: GPU span {span / steps / 1e3:.2f} ms, some kernel running "
          f"{busy / steps / 1e3:.2f} ms, idle {(span - busy) / steps / 1e3:.2f} ms; busy ms per stream {per}")
    # Host time of the attention calls themselves (the op's Python and its launches, as the profiler sees them).
    host: dict = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and (
                e["name"].startswith("flashtile::") or "attention" in e["name"] and e["name"].startswith("aten::")):
            host.setdefault(e["name"], []).append(e["dur"])
    for name, durations in sorted(host.items()):
        durations.sort()
        median = durations[len(durations) // 2]
        print(f"  host {name}: {len(durations) // steps} calls per step, median {median:.0f} us, "
              f"max {durations[-1]:.0f} us")
    gaps.sort(key=lambda g: -g[0])
    for gap, before, after in gaps[:8]:
        print(f"  idle {gap:8.1f} us  after {str(before)[:60]}  before {after[:60]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--noise-run", action="store_true", help="also train SDPA with another seed")
    parser.add_argument("--sdpa-backends", default="", help="also train with these SDPA backends forced, e.g. "
                        "flash,cudnn (tokens/s of each)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode, e.g. reduce-overhead (CUDA graphs); default: the default mode")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile 3 steps of each run and print GPU time per kernel")
    parser.add_argument("--pinned", action="store_true",
                        help="copy each batch from pinned memory without blocking (no sync per step)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="train each attention this many times (ABBA order) and report mean tokens/s")
    parser.add_argument("--trace-dir", default=None,
                        help="with --profile: save each run's Chrome trace there (gzip)")
    parser.add_argument("--fp8", action="store_true",
                        help="also train with FP8 attention inputs (flashtile.fp8.fp8_attn_func)")
    args = parser.parse_args()
    if args.profile and args.device != "cuda":
        parser.error("--profile times GPU kernels: it needs --device cuda")
    if args.steps <= args.warmup_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup-steps ({args.warmup_steps})")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.trace_dir and not args.profile:
        parser.error("--trace-dir saves the traces of --profile: give --profile too")
    text = load_corpus(20_000_000)
    data = torch.tensor(list(text.encode("utf-8", errors="replace")), dtype=torch.long)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {data.numel():,} training bytes, "
          f"GPT {args.layers}x{args.heads}x{args.headdim}, batch {args.batch} x {args.seqlen}, {args.steps} steps")
    runs = [train(impl, args, data, args.seed) for impl in ("flashtile", "sdpa")]
    # More rounds for the throughput, in ABBA order (sdpa, flashtile, flashtile, sdpa, ...) so that a drift
    # of the GPU's clocks over the runs hits both alike: the tokens/s reported are the mean over rounds.
    speeds = {"flashtile": [runs[0]["tokens_per_s"]], "sdpa": [runs[1]["tokens_per_s"]]}
    for round_ in range(1, args.rounds):
        for impl in (("sdpa", "flashtile") if round_ % 2 else ("flashtile", "sdpa")):
            speeds[impl].append(train(impl, args, data, args.seed)["tokens_per_s"])
    if args.rounds > 1:
        print("tokens/s by round:", json.dumps({impl: [round(x) for x in xs] for impl, xs in speeds.items()}))
        for run in runs[:2]:
            run["tokens_per_s"] = sum(speeds[run["impl"]]) / len(speeds[run["impl"]])
    runs += [train(f"sdpa:{name}", args, data, args.seed) for name in args.sdpa_backends.split(",") if name]
    ours, theirs = runs[:2]
    for step in range(0, args.steps, 10):
        print(f"step {step:4d}  flashtile {ours['losses'][step]:.4f}  sdpa {theirs['losses'][step]:.4f}")
    diffs = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])]
    tail = min(50, args.steps)
    last = slice(args.steps - tail, args.steps)
    summary = {
        "final_loss": {r["impl"]: r["losses"][-1] for r in runs},
        f"mean_loss_last{tail}": {r["impl"]: sum(r["losses"][last]) / tail for r in runs},
        "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
        "tokens_per_s": {r["impl"]: r["tokens_per_s"] for r in runs},
    }
    if args.fp8:
        fp8_run = train("flashtile-fp8", args, data, args.seed)
        runs.append(fp8_run)
        summary[f"fp8_mean_loss_last{tail}"] = sum(fp8_run["losses"][last]) / tail
        fp8_diffs = [abs(a - b) for a, b in zip(fp8_run["losses"], ours["losses"])]
        summary["fp8_to_flashtile_mean_abs_diff"] = sum(fp8_diffs) / len(fp8_diffs)
        summary["final_loss"][fp8_run["impl"]] = fp8_run["losses"][-1]
        summary["tokens_per_s"][fp8_run["impl"]] = fp8_run["tokens_per_s"]
    if args.noise_run:
        # The yardstick for "within noise": SDPA against itself with another seed (weights and batches).
        other = train("sdpa", args, data, args.seed + 100)
        runs.append(other)
        summary[f"sdpa_other_seed_mean_loss_last{tail}"] = sum(other["losses"][last]) / tail
        seed_diffs = [abs(a - b) for a, b in zip(theirs["losses"], other["losses"])]
        summary["seed_to_seed_mean_abs_diff"] = sum(seed_diffs) / len(seed_diffs)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": runs}, f)


if __name__ == "__main__":
    main()
