"""Wall-clock time per call as a model makes it: ``flashtile bench --overhead``.

Kernel TFLOP/s say nothing about short sequences, where a call's host time (Python, autograd, launches)
is longer than its kernels. This mode times eager calls the way a transformer layer makes them:

* q, k, v are views of one projection's output ``(batch, seqlen, 3 * nheads * headdim)`` (a leaf that
  requires grad), so their strides are a model's, not contiguous tensors';
* forward alone (grad enabled, as in training) and forward + ``out.backward(dout)`` through autograd,
  which runs the backward on its device thread as in training;
* decoding steps: ``flash_attn_with_kvcache`` appending one new token (d=128, 32 query heads over 8 KV
  heads) against SDPA appending the same token with a slice write and attending the cache with
  ``enable_gqa=True``;
* the same decoding step with a paged cache (pages of 256 positions, a shuffled block table), with
  ``cache_batch_idx`` (the batch's entries shuffled in the cache) and with rotary tables (GPT-NeoX halves
  over the whole head), at batch 8 and cache 4096 (``DECODE_VARIANTS``). SDPA has none of these: its peer
  there is the contiguous step, with q and the new key rotated by PyTorch ops in the rotary row (as a
  Hugging Face model rotates them). These rows are left out of the summary's count;
* loops of ``calls`` eager calls, synchronised once at the end, no CUDA graphs; the median over
  ``repeats`` loops, the implementations taking turns loop by loop. Each row also keeps the fastest and
  slowest loop per implementation (``spread``; the log line shows them): host-bound rows move with
  whatever else the host does, and the spread says by how much in that run.

``--fp8`` (``run_fp8_overhead``): inference forwards on FP8 q, k, v at the training rows' shapes instead, beside
flashtile's and SDPA's forwards on the same 16-bit inputs.

Peers in the same run: SDPA's own choice of backend, and its flash and cuDNN backends forced (set once
around each loop, as a model sets it once). ``flashtile_unplanned`` is flashtile with its launch plans
off (``FLASHTILE_LAUNCH_PLANS=0``: every call takes the checked, ordinary path).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from .inference import flash_attn_with_kvcache
from .interface import flash_attn_func

# (batch, seqlen, nheads, headdim): short-sequence training shapes, host-bound for every implementation.
OVERHEAD_SHAPES = ((32, 512, 12, 64), (8, 1024, 16, 64), (4, 2048, 16, 128), (1, 256, 32, 128))
# (batch, cache length): one decoding step, d=128, 32 query heads over 8 KV heads.
DECODE_STEPS = ((8, 4096), (1, 32768), (64, 2048))
DECODE_HEADS = (32, 8, 128)
# (variant, batch, cache length): decoding steps that give flash_attn_with_kvcache more than a cache.
DECODE_VARIANTS = (("paged", 8, 4096), ("batch_idx", 8, 4096), ("rotary", 8, 4096))
PAGE_SIZE = 256  # flash-attn 2's paged caches take pages of multiples of 256 positions


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def _sdpa_call(q, k, v, causal, enable_gqa=False):
    """SDPA on BSHD views (the backend is chosen around the timed loop, see ``_backend_context``)."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=causal, enable_gqa=enable_gqa)
    return out.transpose(1, 2)


def _backend_context(name: str):
    """The SDPA backend of a peer, entered once around its loop (entering ``sdpa_kernel`` costs tens of
    microseconds, which no model pays per call); flashtile and SDPA's own choice run without."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name.endswith("_unplanned"):
        from .bench import env_setting

        return env_setting("FLASHTILE_LAUNCH_PLANS", "0")
    forced = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}.get(name)
    return sdpa_kernel([forced]) if forced is not None else contextlib.nullcontext()


def _flashtile_call(q, k, v, causal, enable_gqa=False):
    return flash_attn_func(q, k, v, causal=causal)


def _training_calls(shape, causal: bool, dtype, device) -> dict[str, dict[str, Callable[[], object]]]:
    """{impl: {"fwd": fn, "fwd_bwd": fn}} over one projection output's views."""
    batch, seqlen, nheads, headdim = shape
    projection = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=dtype, device=device, requires_grad=True)
    dout = torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, device=device)

    def views():
        # (batch, seqlen, 3, nheads, headdim) -> three strided views, as a fused QKV projection gives
        return projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)

    calls = {}
    for name, attend in (("flashtile", _flashtile_call), ("flashtile_unplanned", _flashtile_call),
                         ("sdpa", _sdpa_call), ("sdpa_flash", _sdpa_call), ("sdpa_cudnn", _sdpa_call)):
        def fwd(attend=attend):
            return attend(*views(), causal)

        def fwd_bwd(attend=attend):
            attend(*views(), causal).backward(dout)

        calls[name] = {"fwd": fwd, "fwd_bwd": fwd_bwd}
    return calls


def _fp8_forward_calls(shape, causal: bool, dtype, device) -> dict[str, Callable[[], object]]:
    """Inference forwards at a training shape (no autograd): flashtile on FP8 q, k, v (``flashtile.fp8.quantize``'d
    once, per (batch, head), v in rows as a projection gives it: the call copies it keys-fastest), with launch plans
    and without; flashtile and SDPA on the same 16-bit q, k, v."""
    from . import fp8

    batch, seqlen, nheads, headdim = shape
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, device=device) for _ in range(3))
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)

    def flashtile_fp8():
        return flash_attn_func(q8, k8, v8, causal=causal, q_descale=q_descale, k_descale=k_descale,
                               v_descale=v_descale)

    def flashtile():
        return flash_attn_func(q, k, v, causal=causal)

    def sdpa():
        return _sdpa_call(q, k, v, causal)

    return {"flashtile_fp8": flashtile_fp8, "flashtile_fp8_unplanned": flashtile_fp8, "flashtile": flashtile,
            "sdpa": sdpa, "sdpa_flash": sdpa, "sdpa_cudnn": sdpa}


def run_fp8_overhead(shapes=OVERHEAD_SHAPES, dtype_name: str = "bfloat16", calls: int = 30, repeats: int = 11,
                     log=print, device: str | None = None) -> list[dict]:
    """``flashtile bench --overhead --fp8``: the FP8 forward's wall time per eager inference call at the training
    rows' shapes, causal and not (``_fp8_forward_calls``), rows as ``run_overhead``'s with ``lead``
    "flashtile_fp8" (the implementation compared with the fastest SDPA backend)."""
    device = torch.device(device or "cuda")
    dtype = getattr(torch, dtype_name)
    rows = []
    for shape in shapes:
        for causal in (False, True):
            timings, spread = _time_round_robin(_fp8_forward_calls(shape, causal, dtype, device), calls, repeats,
                                                device)
            row = {"kind": "fp8", "shape": shape, "causal": causal, "mode": "fwd", "us": timings, "spread": spread,
                   "lead": "flashtile_fp8"}
            rows.append(row)
            log(_row_line(row))
    return rows


def _decode_calls(batch: int, length: int, dtype, device, variant: str = "contiguous"
                  ) -> dict[str, Callable[[], object]]:
    """One new token appended at position length - 1 of a cache of ``length``, then attended to it all.
    ``variant``: "contiguous", or "paged", "batch_idx", "rotary" (``DECODE_VARIANTS``)."""
    nheads, nheads_k, headdim = DECODE_HEADS
    k_cache = torch.randn(batch, length, nheads_k, headdim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    projection = torch.randn(batch, 1, (nheads + 2 * nheads_k) * headdim, dtype=dtype, device=device)
    q, k_new, v_new = projection.split((nheads * headdim, nheads_k * headdim, nheads_k * headdim), dim=-1)
    q = q.view(batch, 1, nheads, headdim)
    k_new, v_new = k_new.view(batch, 1, nheads_k, headdim), v_new.view(batch, 1, nheads_k, headdim)
    cache_seqlens = torch.full((batch,), length - 1, dtype=torch.int32, device=device)
    options: dict[str, object] = {}
    k_ours, v_ours = k_cache, v_cache
    if variant == "paged":
        page = min(PAGE_SIZE, length)
        pages = batch * length // page
        order = torch.randperm(pages, device=device)
        options["block_table"] = order.view(batch, length // page).to(torch.int32)
        # pool[order[i]] holds logical page i, so the pool reads as the contiguous cache
        k_ours = torch.empty_like(k_cache).view(pages, page, nheads_k, headdim)
        v_ours = torch.empty_like(k_ours)
        k_ours[order] = k_cache.view(pages, page, nheads_k, headdim)
        v_ours[order] = v_cache.view(pages, page, nheads_k, headdim)
    elif variant == "batch_idx":
        order = torch.randperm(batch, device=device)
        options["cache_batch_idx"] = order.to(torch.int32)
        k_ours, v_ours = torch.empty_like(k_cache), torch.empty_like(v_cache)
        k_ours[order], v_ours[order] = k_cache, v_cache
    elif variant == "rotary":
        angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32),
                             1e4 ** -torch.linspace(0, 1, headdim // 2, device=device))
        options["rotary_cos"], options["rotary_sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
        options["rotary_interleaved"] = False  # flash-attn's default is interleaved pairs
    elif variant != "contiguous":
        raise ValueError(f"variant: expected 'contiguous' or one of {[v for v, *_ in DECODE_VARIANTS]}, "
                         f"got {variant!r}")

    def rotated(x):  # the position is length - 1 for every sequence
        cos, sin = options["rotary_cos"][length - 1], options["rotary_sin"][length - 1]
        x1, x2 = x.float().chunk(2, dim=-1)
        cos, sin = cos.float(), sin.float()
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def flashtile():
        return flash_attn_with_kvcache(q, k_ours, v_ours, k=k_new, v=v_new, cache_seqlens=cache_seqlens, **options)

    def sdpa():
        q_in, k_in = (rotated(q), rotated(k_new)) if variant == "rotary" else (q, k_new)
        k_cache[:, length - 1:length] = k_in
        v_cache[:, length - 1:length] = v_new
        return _sdpa_call(q_in, k_cache, v_cache, False, enable_gqa=True)

    return {"flashtile": flashtile, "flashtile_unplanned": flashtile, "sdpa": sdpa, "sdpa_flash": sdpa,
            "sdpa_cudnn": sdpa}


def _time_round_robin(calls: dict[str, Callable[[], object]], num_calls: int, repeats: int,
                      device: torch.device) -> tuple[dict[str, float | str], dict[str, tuple[float, float]]]:
    """(median µs per call of each implementation, "n/a: reason" for one that fails on its first call;
    its fastest and slowest loop)."""
    usable, results = {}, {}
    for name, fn in calls.items():
        try:
            with _backend_context(name):
                for _ in range(3):  # compile, tune, warm
                    fn()
                _sync(device)
            usable[name] = fn
        except Exception as exc:  # a peer that cannot run here is reported, not skipped silently
            results[name] = f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    samples: dict[str, list[float]] = {name: [] for name in usable}
    for repeat in range(repeats):
        order = list(usable) if repeat % 2 == 0 else list(reversed(usable))
        for name in order:
            with _backend_context(name):
                samples[name].append(_loop_us(usable[name], num_calls, device))
    for name, values in samples.items():
        results[name] = statistics.median(values)
    spreads = {name: (min(values), max(values)) for name, values in samples.items()}
    return results, spreads


def run_overhead(shapes=OVERHEAD_SHAPES, decode_steps=DECODE_STEPS, dtype_name: str = "bfloat16", calls: int = 30,
                 repeats: int = 11, log=print, device: str | None = None,
                 decode_variants=DECODE_VARIANTS) -> list[dict]:
    """Time every row; returns dicts with the row's description, µs per call by implementation (``us``) and
    each implementation's fastest and slowest loop (``spread``).
    ``device`` defaults to CUDA (a CPU run only checks that the rows run: its timings mean little)."""
    device = torch.device(device or "cuda")
    dtype = getattr(torch, dtype_name)
    rows = []
    for shape in shapes:
        for causal in (False, True):
            per_impl = _training_calls(shape, causal, dtype, device)
            for mode in ("fwd", "fwd_bwd"):
                timings, spread = _time_round_robin({name: fns[mode] for name, fns in per_impl.items()}, calls,
                                                    repeats, device)
                row = {"kind": "train", "shape": shape, "causal": causal, "mode": mode, "us": timings,
                       "spread": spread}
                rows.append(row)
                log(_row_line(row))
    for batch, length in decode_steps:
        timings, spread = _time_round_robin(_decode_calls(batch, length, dtype, device), calls, repeats, device)
        row = {"kind": "decode", "shape": (batch, length), "causal": False, "mode": "decode", "us": timings,
               "spread": spread}
        rows.append(row)
        log(_row_line(row))
    for variant, batch, length in decode_variants:
        timings, spread = _time_round_robin(_decode_calls(batch, length, dtype, device, variant), calls, repeats,
                                            device)
        row = {"kind": "decode", "variant": variant, "shape": (batch, length), "causal": False, "mode": "decode",
               "us": timings, "spread": spread}
        rows.append(row)
        log(_row_line(row))
    return rows


def _peer_best(us: dict) -> tuple[str, float] | None:
    peers = [(name, value) for name, value in us.items() if name.startswith("sdpa") and isinstance(value, float)]
    return min(peers, key=lambda item: item[1]) if peers else None


def _fmt(value) -> str:
    return f"{value:.0f}" if isinstance(value, float) else str(value)


def _describe(row: dict) -> str:
    if row["kind"] == "decode":
        batch, length = row["shape"]
        nheads, nheads_k, headdim = DECODE_HEADS
        variant = f" {row['variant']}" if row.get("variant") else ""
        return f"decode{variant} b={batch} cache={length} (h {nheads}/{nheads_k}, d={headdim})"
    batch, seqlen, nheads, headdim = row["shape"]
    return f"b={batch} s={seqlen} h={nheads} d={headdim} {'causal' if row['causal'] else 'non-causal'} {row['mode']}"


def _row_line(row: dict) -> str:
    spread = row.get("spread", {})
    parts = "  ".join(f"{name} {_fmt(value)}" + (f" ({spread[name][0]:.0f}-{spread[name][1]:.0f})"
                                                 if name in spread else "")
                      for name, value in row["us"].items())
    best = _peer_best(row["us"])
    lead = row.get("lead", "flashtile")
    ratio = ""
    if best is not None and isinstance(row["us"].get(lead), float):
        ratio = f"  {lead}/{best[0]} {row['us'][lead] / best[1]:.2f}x"
    return f"{_describe(row):55s} µs per call: {parts}{ratio}"


def overhead_table(rows: list[dict]) -> str:
    """Markdown: one row per case, µs per call of each implementation and flashtile over the fastest peer."""
    names = []
    for row in rows:
        names += [name for name in row["us"] if name not in names]
    lead = rows[0].get("lead", "flashtile") if rows else "flashtile"
    lines = ["| case | " + " | ".join(f"{name} µs" for name in names) + f" | {lead} / fastest SDPA |",
             "|---|" + "---|" * (len(names) + 1)]
    for row in rows:
        best = _peer_best(row["us"])
        ours = row["us"].get(lead)
        ratio = f"{ours / best[1]:.2f}× ({best[0]})" if best and isinstance(ours, float) else "n/a"
        lines.append(f"| {_describe(row)} | " + " | ".join(_fmt(row["us"].get(name, "–")) for name in names)
                     + f" | {ratio} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """flashtile over the fastest SDPA backend across the rows, decoding variants left out (SDPA has none)."""
    ratios = []
    for row in rows:
        if row.get("variant"):
            continue
        best = _peer_best(row["us"])
        lead = row.get("lead", "flashtile")
        if best and isinstance(row["us"].get(lead), float):
            ratios.append(row["us"][lead] / best[1])
    if not ratios:
        return "no row had both flashtile and an SDPA peer"
    within = sum(r <= 1.0 for r in ratios)
    lead = rows[0].get("lead", "flashtile")
    return (f"{lead}'s wall time over the fastest SDPA backend: {min(ratios):.2f}-{max(ratios):.2f}x; "
            f"{within} of {len(ratios)} rows at or under 1.0x")
