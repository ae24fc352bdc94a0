"""Compile every kernel for every target without its GPU, and check what the compiled code needs.

    python -m flashtile.kernels.compile_check [--targets sm80,gfx942] [--cases causal,decode | all]
                                              [--headdims 64,128,256] [--full] [--verbose] [--json PATH]

The process becomes a stand-in driver for each target's GPU in turn (``stand_in``) and calls the public
functions on small CPU tensors for each variant case below, so that the launchers choose the kernels'
switches, the target's tile candidates and its TMA paths as they would on that GPU, and Triton's real
compiler builds them: PTX and cubins through the bundled ptxas for NVIDIA; AMDGCN and code objects through
the LLVM AMDGPU backend and linker inside libtriton for AMD (no ROCm needed). Each compiled kernel is then
checked against its target:

- shared memory (LDS on AMD) within ``Target.smem_limit``: 163 KiB on sm80, 99 KiB on sm89 and sm120,
  227 KiB on sm90 and sm100, 64 KiB on gfx942, 160 KiB on gfx950;
- register spills within ``spill_budget`` bytes per thread (ptxas -v's spill stores; on AMD 4 bytes per
  spilled VGPR or SGPR in the code object's metadata): 128, or for sm90's measured lists a ceiling;
- tensor memory within sm100's 512 columns.

By default each kernel's first candidate that fits (what ``FLASHTILE_AUTOTUNE=0`` runs); ``--full``
compiles every candidate of the target's lists (``FLASHTILE_AUTOTUNE=compile``). Run it without
``TRITON_INTERPRET=1`` (the interpreter replaces the compiler). Exit status 1 when a kernel fails to
compile or a check fails; each failure names the target, the case, the head dim, the kernel and its tile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import triton
import triton.language as tl

# Spilled bytes per thread a compiled kernel may have (NVIDIA: ptxas's spill stores; AMD: 4 per spilled
# register): 128, 32 registers' worth, for the lists chosen from compiled resources (sm80, sm89, sm120,
# sm100, gfx942, gfx950: where they spill at all, 4-96 bytes, mostly in the dropout and window variants;
# the tiles that spilled more were taken out of them).
SPILL_BUDGET_BYTES = 128
# sm90's lists are the H200's measured winners and their neighbours, kept as they are: some of their tiles
# spill, up to 1.8 KB a thread in the other variants and 17 KB with dropout (the (128, 128, 4 warps) forward
# tiles), and ran so on the H200. For them the budget is a ceiling that catches a change making it worse.
HOPPER_SPILL_CEILING_BYTES = {"dropout": 20 * 1024, "other": 2 * 1024}


def spill_budget(target: str, case: str) -> int:
    if target == "sm90":
        return HOPPER_SPILL_CEILING_BYTES["dropout" if case == "dropout" else "other"]
    return SPILL_BUDGET_BYTES


TMEM_COLUMNS = 512  # tensor memory per multiprocessor on sm100


@dataclasses.dataclass
class Resources:
    registers: int  # per thread (AMD: VGPRs, AGPRs included)
    spill_bytes: int  # per thread
    shared_bytes: int  # per block
    tmem_columns: int = 0


def ptxas_log(ptx: str) -> str:
    """``ptxas -v`` of a PTX module (the one bundled with Triton, as Triton runs it): its stderr."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"^\.target\s+(sm_(\d+)\w*)", ptx, re.M)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        try:
            ptxas = get_ptxas(int(arch.group(2)))
        except TypeError:  # triton 3.5: one ptxas for every architecture
            ptxas = get_ptxas()
        run = subprocess.run([ptxas.path, "-v", f"--gpu-name={arch.group(1)}", path, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    return run.stderr


def disassemble(cubin: bytes) -> str | None:
    """SASS of a cubin by the ``nvdisasm`` bundled with Triton; None where Triton has none."""
    import triton.backends.nvidia

    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([tool, "-c", fh.name], capture_output=True, text=True, check=True).stdout


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[^;]*;")
_SASS_TARGET = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")


def sass_loops(sass: str, innermost: bool = False, min_length: int = 17) -> list[list[str]]:
    """Opcodes of each loop body: from a label to the last branch back to it. The outermost loops, or
    (``innermost``) those of at least ``min_length`` instructions that hold no other such loop."""
    opcodes, labels, bodies = [], {}, []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        ins = _SASS_LINE.match(line)
        if not ins:
            continue
        opcodes.append(ins.group(2))
        target = _SASS_TARGET.search(line)
        if ins.group(2) == "BRA" and target and target.group(1) in labels:
            bodies.append((labels[target.group(1)], len(opcodes)))
    if innermost:
        long = sorted({r for r in bodies if r[1] - r[0] >= min_length})
        kept = [r for r in long if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in long)]
        return [opcodes[start:end] for start, end in kept]
    # Keep the outermost ranges of backward branches (a loop's inner retry spins share its range).
    bodies.sort(key=lambda r: (r[0], -r[1]))
    kept = []
    for start, end in bodies:
        if not kept or start >= kept[-1][1]:
            kept.append((start, end))
    return [opcodes[start:end] for start, end in kept]


@triton.jit
def _probe(X):
    tl.store(X + tl.arange(0, 64), tl.load(X + tl.arange(0, 64)) * 2)


def toolchain_problem(name: str) -> str | None:
    """Why Triton cannot compile for target ``name`` on this machine (a tiny kernel), or None."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .configs import TARGETS

    target = TARGETS[name]
    gpu = GPUTarget("hip" if target.vendor == "amd" else "cuda", target.arch, target.warp_size)
    try:
        triton.compile(ASTSource(_probe, signature={"X": "*fp32"}), target=gpu)
    except Exception as exc:
        return f"triton {triton.__version__} cannot compile for {name} ({gpu}) on this machine: {_first_line(exc)}"
    return None


_PTXAS_LOG_LOCK = threading.Lock()


def keep_ptxas_logs() -> None:
    """Make Triton keep the ``ptxas -v`` log of each kernel it compiles for NVIDIA in the kernel's metadata
    (``ptxas_log``, stored with it in Triton's cache), instead of running ptxas again to read it."""
    from triton import knobs

    def hook(backend, stages, options, language, capability):
        if "cubin" not in stages:
            return
        make_cubin = stages["cubin"]

        def cubin(src, metadata):
            log = io.StringIO()
            # One at a time: the knob and sys.stdout are the process's, and kernels may compile on several threads
            # (configs.compile_together, the autotuner's candidates side by side).
            with _PTXAS_LOG_LOCK:
                knobs.nvidia.dump_ptxas_log = True  # Triton runs ptxas -v and prints its log with this knob
                try:
                    with contextlib.redirect_stdout(log):
                        binary = make_cubin(src, metadata)
                finally:
                    knobs.nvidia.dump_ptxas_log = False
            metadata["ptxas_log"] = log.getvalue()
            return binary

        stages["cubin"] = cubin

    knobs.runtime.add_stages_inspection_hook = hook


def resources(compiled) -> Resources:
    """Registers, spills and shared memory of one of Triton's compiled kernels, read from its code."""
    meta = compiled.metadata
    tmem = getattr(meta, "tmem_size", None) or 0
    if "amdgcn" in compiled.asm:
        notes = compiled.asm["amdgcn"]

        def field(name):
            found = re.search(rf"^\s*-?\s*\.{name}:\s+(\d+)", notes, re.M)
            return int(found.group(1)) if found else 0

        # On CDNA (gfx90a and later) .vgpr_count already counts the AGPRs: the unified 512 per lane.
        return Resources(field("vgpr_count"),
                         4 * (field("vgpr_spill_count") + field("sgpr_spill_count")),
                         max(meta.shared, field("group_segment_fixed_size")), tmem)
    log = getattr(meta, "ptxas_log", None) or ptxas_log(compiled.asm["ptx"])
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    smem = re.search(r"(\d+) bytes smem", log)
    return Resources(int(used.group(1)) if used else -1, int(spills.group(1)) if spills else -1,
                     max(meta.shared, int(smem.group(1)) if smem else 0), tmem)


def problems(res: Resources, target, case: str) -> list[str]:
    """What is wrong with a compiled kernel of ``target`` (a ``configs.Target``) in variant ``case``."""
    found = []
    if res.registers < 0 or res.spill_bytes < 0:
        found.append("ptxas reported no resources")
    budget = spill_budget(target.name, case)
    if res.spill_bytes > budget:
        found.append(f"spills {res.spill_bytes} B per thread (budget {budget} B)")
    if res.shared_bytes > target.smem_limit:
        found.append(f"shared memory {res.shared_bytes} B > {target.smem_limit} B")
    if res.tmem_columns > TMEM_COLUMNS:
        found.append(f"tensor memory {res.tmem_columns} columns > {TMEM_COLUMNS}")
    return found


# ---------------------------------------------------------------------------------------------------
# Variant cases: what a user can call, on CPU tensors small enough to run in no time
# ---------------------------------------------------------------------------------------------------


def _attention_cases():
    import torch

    from flashtile import (
        block_sparse_attn_func,
        flash_attn_func,
        flash_attn_varlen_func,
        flash_attn_with_kvcache,
        local_global_block_mask,
    )

    dtype = torch.bfloat16

    def qkv(d, seqlen=512, heads=4, heads_k=2):
        return [torch.randn(1, seqlen, h, d, dtype=dtype, requires_grad=True) for h in (heads, heads_k, heads_k)]

    def train(d, **kwargs):
        q, k, v = qkv(d)
        out = flash_attn_func(q, k, v, **kwargs)
        out.backward(torch.randn_like(out))

    def both_orders(case):
        """The case, then again with its backward in a large GPU call's order (the preprocess kernel, then the dQ
        pass reading its statistics beside the dK/dV pass) rather than a small call's (these shapes': the dQ pass
        first, making them), so that both forms of the dQ pass, and the preprocess kernel, compile. For the cases
        whose row statistics differ (ALiBi's +inf rows, packed rows) and the plain ones: each second form costs
        a compile per target in CI."""
        from . import backward

        def run(d):
            case(d)
            keep = backward._stats_in_dq_pass
            backward._stats_in_dq_pass = lambda large, fp8: False
            try:
                case(d)
            finally:
                backward._stats_in_dq_pass = keep
        return run

    def varlen(d):
        cu = torch.tensor([0, 200, 512], dtype=torch.int32)
        q, k, v = (t[0] for t in qkv(d))
        out = flash_attn_varlen_func(q, k, v, cu, cu, 312, 312, causal=True)
        out.backward(torch.randn_like(out))

    def paged(d):
        # Chunked prefill against a paged pool (forward only), then a paged decode step with an append.
        pool_k, pool_v = (torch.randn(8, 64, 2, d, dtype=dtype) for _ in range(2))
        table = torch.arange(8, dtype=torch.int32).view(2, 4)
        q = torch.randn(96, 4, d, dtype=dtype)
        cu_q = torch.tensor([0, 32, 96], dtype=torch.int32)
        cu_k = torch.tensor([0, 200, 400], dtype=torch.int32)
        flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 64, 200, causal=True, block_table=table)
        new = torch.randn(2, 1, 2, d, dtype=dtype)
        flash_attn_with_kvcache(q[:2].view(2, 1, 4, d), pool_k, pool_v, new, new,
                                cache_seqlens=torch.tensor([100, 250], dtype=torch.int32), block_table=table)

    def decode(d):
        # One token of 8 query heads per kv head (GQA packed), split-KV, the new token appended.
        cache_k, cache_v = (torch.randn(2, 1024, 2, d, dtype=dtype) for _ in range(2))
        q = torch.randn(2, 1, 16, d, dtype=dtype)
        new = torch.randn(2, 1, 2, d, dtype=dtype)
        lengths = torch.tensor([700, 1000], dtype=torch.int32)
        flash_attn_with_kvcache(q, cache_k, cache_v, new, new, cache_seqlens=lengths, num_splits=4)
        # The same through a batch index (each sequence's entry read by the kernel)
        flash_attn_with_kvcache(q, cache_k, cache_v, new, new, cache_seqlens=lengths, num_splits=4,
                                cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32))
        # With rotary tables (q and the new keys rotated by their own kernel)
        table = torch.rand(1024, d // 2)
        flash_attn_with_kvcache(q, cache_k, cache_v, new, new, table.cos(), table.sin(), cache_seqlens=lengths,
                                num_splits=4)

    def sparse(d):
        q, k, v = qkv(d)
        mask = local_global_block_mask(512, 512, 1, 1, causal=True)
        out = block_sparse_attn_func(q, k, v, mask, causal=True)
        out.backward(torch.randn_like(out))

    def dropout(d):
        q, k, v = qkv(d)
        out, _, _ = flash_attn_func(q, k, v, dropout_p=0.1, causal=True, return_attn_probs=True)
        out.backward(torch.randn_like(out))

    def fp8_case(d):
        # FP8 q, k, v on FP8 tensor cores, causal and not, forward and the backward's FP8 variant (called
        # below the API, which takes this path on CUDA tensors only), then decoding steps against an FP8
        # cache read in bf16, its V in rows and positions-fastest (``zeros_cache``: the forward's FP8 mode 3).
        from ..fp8 import quantize, zeros_cache
        from ..options import AttentionOptions
        from .backward import attention_backward
        from .forward import attention_forward

        q, k, v = (t.detach() for t in qkv(d))
        (q8, qd), (k8, kd), (v8, vd) = quantize(q, 2), quantize(k), quantize(v)
        for causal in (False, True):
            opts = AttentionOptions(d ** -0.5, causal, -1, 0 if causal else -1)
            out, lse = attention_forward(q8, k8, v8, opts, fp8=(qd, kd, vd, dtype, False))
            # The backward's FP8 variant (QK^T and dO V^T on FP8 tensor cores; fp8_attn_func's opt-in)
            dout = torch.randn_like(out)
            do8, scales = quantize(dout)[0], torch.ones(q.shape[0], q.shape[2], 2)
            attention_backward(dout, *(x.float().to(dtype) for x in (q8, k8, v8)), out, lse, opts,
                               fp8=(q8, k8, v8, do8, scales))
        (cache_k, k_descale), (cache_v, v_descale) = (quantize(torch.randn(2, 1024, 2, d)) for _ in range(2))
        q1, q1_descale = quantize(torch.randn(2, 1, 16, d), 2)
        new = torch.randn(2, 1, 2, d, dtype=dtype)
        lengths = torch.tensor([700, 1000], dtype=torch.int32)
        flash_attn_with_kvcache(q1, cache_k, cache_v, new, new, cache_seqlens=lengths, num_splits=4,
                                q_descale=q1_descale, k_descale=k_descale, v_descale=v_descale)
        fast_v = zeros_cache(*cache_v.shape)[1].copy_(cache_v)
        flash_attn_with_kvcache(q1, cache_k, fast_v, new, new, cache_seqlens=lengths, num_splits=4,
                                q_descale=q1_descale, k_descale=k_descale, v_descale=v_descale)
        # A 16-bit model's q over the FP8 cache (read in q's precision), its new tokens quantized by the append
        flash_attn_with_kvcache(torch.randn(2, 1, 16, d, dtype=dtype), cache_k, fast_v, new, new,
                                cache_seqlens=lengths, num_splits=4, k_descale=k_descale, v_descale=v_descale)

    return {
        "fp8": fp8_case,
        "dense": both_orders(train),
        "causal": both_orders(lambda d: train(d, causal=True)),
        "window": lambda d: train(d, window_size=(128, 64)),
        "softcap": lambda d: train(d, causal=True, softcap=30.0),
        "alibi": both_orders(lambda d: train(d, causal=True, alibi_slopes=torch.rand(4))),
        "sink": lambda d: train(d, causal=True, sink=torch.randn(4)),
        "varlen": both_orders(varlen),
        "paged": paged,
        "decode": decode,
        "dropout": dropout,
        "block_sparse": sparse,
    }


CASES = ("dense", "causal", "window", "softcap", "alibi", "sink", "varlen", "paged", "decode", "dropout",
         "block_sparse", "fp8")  # fp8: on targets with FP8 tensor cores only (NVIDIA sm89 and newer)
HEADDIMS = (64, 128, 256)  # the largest of each head-dim class
# CI: every variant case with the default tiles at this head dim (about half a minute per target on two
# cores); the sweep adds every tile candidate at each of HEADDIMS.
CI_HEADDIMS = (128,)


# ---------------------------------------------------------------------------------------------------
# The check, in this process
# ---------------------------------------------------------------------------------------------------


def _kernels():
    from . import backward, dropout, forward, kvcache

    return {"_attn_fwd": forward._attn_fwd, "_combine_kernel": forward._combine_kernel,
            "_attn_bwd_preprocess": backward._attn_bwd_preprocess, "_attn_bwd_dkdv": backward._attn_bwd_dkdv,
            "_attn_bwd_dq": backward._attn_bwd_dq, "_append_kv": kvcache._append_kv, "_rotary": kvcache._rotary,
            "_dropout_mask_kernel": dropout._dropout_mask_kernel}


def _compiled(kernel, device: int) -> list:
    fn = kernel if hasattr(kernel, "device_caches") else kernel.fn  # a JITFunction, or an autotuner's
    caches = fn.device_caches.get(device)
    return list(caches[0].values()) if caches else []


def _describe(name: str, compiled) -> str:
    const = compiled.src.constants
    values = {n: const.get((i,)) for i, n in enumerate(compiled.src.fn.arg_names)}
    shown = " ".join(f"{n}={values[n]}" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_H", "USE_TMA", "SPLIT_KV", "PACK_GQA",
                                                  "KV_GRADS") if values.get(n) not in (None, False, 0))
    meta = compiled.metadata
    return f"{name} {shown} warps={meta.num_warps} stages={meta.num_stages}"


def _report_compile_errors(kernel, errors: list[str]) -> None:
    """Compile each candidate the autotuner is about to run, so that an error is reported with its tile
    (Triton's autotuner would time a failing candidate as infinitely slow and say nothing)."""
    bench_one = kernel._bench

    def bench(*args, config, **meta):
        current = {key: value for key, value in {**meta, **config.all_kwargs()}.items() if key != "warmup"}
        try:
            kernel.fn.warmup(*args, **current)
        except Exception as exc:
            tile = " ".join(f"{n}={v}" for n, v in config.kwargs.items())
            errors.append(f"{kernel.fn.__name__} {tile} warps={config.num_warps} stages={config.num_stages}: "
                          f"{_first_line(exc)}")
            return [float("inf")] * 3
        return bench_one(*args, config=config, **meta)

    kernel._bench = bench


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def check_targets(names, cases=CASES, headdims=CI_HEADDIMS, full: bool = False, verbose: bool = False) -> dict:
    """Compile ``cases`` at ``headdims`` for each target of ``names`` in this process, which becomes a stand-in
    for each GPU in turn (for good: run it in a process of its own), and check each kernel.

    Returns {target: {"failures": [...], "kernels": [one record per compiled kernel]}}. Each target gets its
    own device index of the stand-in driver, so Triton keeps its compiled kernels apart; flashtile's
    remembered tile choices are forgotten between targets."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_check needs Triton's compiler: run it without TRITON_INTERPRET=1")
    os.environ["FLASHTILE_AUTOTUNE"] = "compile" if full else "0"
    os.environ["FLASHTILE_COMPILE_THREADS"] = "1"
    os.environ.pop("FLASHTILE_TARGET", None)
    import torch

    import flashtile.inference as inference
    import flashtile.interface as interface

    from . import configs, stand_in

    interface.select_backend = inference.select_backend = lambda device: "triton"
    keep_ptxas_logs()
    kernels = _kernels()
    errors: list[str] = []
    for kernel in kernels.values():
        if hasattr(kernel, "_bench"):
            _report_compile_errors(kernel, errors)
            configs.keep_choices_on_disk(kernel)  # read again: no choice stored or found in compile-only runs
    calls = _attention_cases()
    results = {}
    for device, name in enumerate(names):
        target = configs.TARGETS[name]
        problem = toolchain_problem(name)
        if problem is not None:
            results[name] = {"skipped": problem, "failures": [], "kernels": []}
            continue
        # Shared memory is checked below, against the target's limit, rather than refused at launch.
        stand_in.install(name, max_shared=2**31 - 1)
        stand_in.current_device[0] = device
        for chosen in (configs._CHOSEN, configs._DIRECT, configs._LAST_KEY):
            chosen.clear()
        for kernel in kernels.values():
            getattr(kernel, "cache", {}).clear()  # the autotuners' choices
        # As on the GPU with aligned tensors (use_tma checks that the tensors are CUDA ones).
        configs.use_tma = lambda *tensors, rows, target=target: target.tma and rows >= configs.TMA_MIN_ROWS
        seen: set[int] = set()
        failures, records = [], []
        for case in cases:
            if case == "fp8" and (target.vendor != "nvidia" or target.arch < 89):
                continue
            for d in headdims:
                where = f"{name} {case} d={d}"
                torch.manual_seed(0)
                start = time.perf_counter()
                del errors[:]
                try:
                    calls[case](d)
                except Exception as exc:  # a compile error (of the one candidate), or a launch refused
                    failures.append(f"{where}: {_first_line(exc)}")
                failures.extend(f"{where}: {error}" for error in errors)
                for kernel_name, kernel in kernels.items():
                    for compiled in _compiled(kernel, device):
                        if id(compiled) in seen:
                            continue
                        seen.add(id(compiled))
                        res = resources(compiled)
                        label = _describe(kernel_name, compiled)
                        found = problems(res, target, case)
                        records.append({"case": case, "headdim": d, "kernel": label, **dataclasses.asdict(res),
                                        "problems": found})
                        failures.extend(f"{where}: {label}: {problem}" for problem in found)
                        if verbose:
                            print(f"  {where}: {label}: {res.registers} regs, {res.spill_bytes} B spills, "
                                  f"{res.shared_bytes} B shared" + (f" PROBLEM: {'; '.join(found)}" if found else ""),
                                  flush=True)
                if verbose:
                    print(f"{where}: {time.perf_counter() - start:.1f} s", flush=True)
        results[name] = {"failures": failures, "kernels": records}
    return results


def main(argv=None) -> int:
    from .configs import TARGETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--cases", default="all",
                        help=f"of {','.join(CASES)}, or 'all' (the default)")
    parser.add_argument("--headdims", default=",".join(map(str, CI_HEADDIMS)))
    parser.add_argument("--full", action="store_true", help="every tile candidate, not only the default")
    parser.add_argument("--verbose", action="store_true", help="every kernel's resources and each case's time")
    parser.add_argument("--json", metavar="PATH", help="also write every kernel's record there")
    args = parser.parse_args(argv)
    cases = CASES if args.cases == "all" else tuple(args.cases.split(","))
    headdims = tuple(int(d) for d in args.headdims.split(","))
    results = check_targets(args.targets.split(","), cases, headdims, args.full, args.verbose)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh)
    for name, result in results.items():
        print(f"{name}: " + (f"skipped: {result['skipped']}" if "skipped" in result else
                             f"{len(result['kernels'])} kernels compiled, {len(result['failures'])} failures"))
    failures = [failure for result in results.values() for failure in result["failures"]]
    for failure in failures:
        print("FAIL", failure)
    if results and all("skipped" in result for result in results.values()):
        print("FAIL: every target was skipped, nothing was compiled")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
