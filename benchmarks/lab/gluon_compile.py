"""Registers, spills and shared memory of the Gluon sm90 forward prototype's variants, compiled without a GPU.

    python benchmarks/lab/gluon_compile.py [--headdims 64,128] [--tiles 128x128x2x8,128x64x3x8]
                                           [--variants single,ws,ws-overlap,ws2,pingpong] [--schedule grid]
                                           [--fp8] [--json PATH]

The process becomes a stand-in sm_90 driver (``flashtile.kernels.stand_in``) and calls
``gluon_attention_forward`` on small CPU tensors for each (head dim, causal, variant, tile), so
Triton's Gluon frontend and the bundled ptxas build the kernel as for an H200 (``--fp8``:
``gluon_attention_forward_fp8`` on float8 tensors, the overlapped variants only, its default pingpong-fa3;
grid schedule); each kernel's ``ptxas -v``
log gives its registers, spills and shared memory, and whether ptxas serialized its wgmma instructions.
For the warp-specialized kernels ``regs`` is the launch allocation (65536 / threads, the producer warp
padded to a warpgroup); the partitions then move to the ``setmaxnreg`` values noted (every distinct value
in the PTX, highest first: the consumers' and the producer's, and 120, where the idle worker warps wait
while the default partition runs the prologue). The variants are ``gluon_forward.VARIANTS``; a
(variant, tile) pair the launcher refuses (the two-consumer variants need num_warps = 8) is listed as
skipped. ``peak`` is the highest register the cubin's SASS names, plus one (``nvdisasm``, bundled with
Triton): the most any partition of the kernel really uses, to compare with its ``setmaxnreg`` ceiling.
A tile is (BLOCK_M, BLOCK_N, STAGES, num_warps). Exit status 1 when a variant fails to compile,
spills, or needs more shared memory than sm90's 227 KiB.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from flashtile.kernels import stand_in  # noqa: E402
from flashtile.kernels.compile_check import disassemble, keep_ptxas_logs, resources, sass_loops  # noqa: E402

SMEM_LIMIT = 227 * 1024


def sass_register_peak(cubin: bytes) -> int | None:
    """Highest general register (R<n>) in the cubin's disassembly, plus one; None without nvdisasm."""
    sass = disassemble(cubin)
    if sass is None:
        return None
    numbers = [int(n) for n in re.findall(r"\bR(\d+)\b", sass)]
    return max(numbers) + 1 if numbers else 0


def compile_variant(d: int, causal: bool, variant: str, tile: tuple[int, int, int, int],
                    schedule: str = "grid", fp8: bool = False, innermost: bool = False) -> dict:
    from flashtile.kernels import gluon_forward

    kernel = gluon_forward._gluon_attn_fwd
    caches = kernel.device_caches.get(0)
    before = set(map(id, caches[0].values())) if caches else set()
    q = torch.randn(2, 300, 4, d, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 333, 4, d, dtype=torch.bfloat16) for _ in range(2))
    record = {"headdim": d, "causal": causal, "variant": variant, "schedule": "grid" if fp8 else schedule,
              "tile": "x".join(map(str, tile)), "fp8": fp8}
    if gluon_forward.VARIANTS[variant][2] == 2 and tile[3] != 8:
        record["skipped"] = "two consumers need num_warps = 8"
        return record
    start = time.perf_counter()
    try:
        if fp8:
            descale = torch.ones(2, 4)
            q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            gluon_forward.gluon_attention_forward_fp8(q8, k8, v8, descale, descale, descale, causal, tiles=tile,
                                                      variant=variant)
        else:
            gluon_forward.gluon_attention_forward(q, k, v, causal=causal, tiles=tile, variant=variant,
                                                  schedule=schedule)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        record["error"] = f"{type(exc).__name__}: {text[0][:300] if text else ''}"
        return record
    record["seconds"] = round(time.perf_counter() - start, 1)
    new = [c for c in kernel.device_caches[0][0].values() if id(c) not in before]
    compiled = new[-1]
    res = resources(compiled)
    log = getattr(compiled.metadata, "ptxas_log", None) or ""  # (none for a kernel from the cache)
    serialized = re.search(r"wgmma.mma_async instructions are serialized due to (.*?) in the function", log)
    ptx = compiled.asm["ptx"]
    threads = re.search(r"\.reqntid (\d+)", ptx)
    maxnreg = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}, reverse=True)
    record.update(registers=res.registers, spill_bytes=res.spill_bytes, shared_bytes=res.shared_bytes,
                  threads=int(threads.group(1)) if threads else 32 * compiled.metadata.num_warps,
                  wgmma_serialized=serialized.group(1) if serialized else None, setmaxnreg=maxnreg,
                  sass_peak=sass_register_peak(compiled.asm["cubin"]))
    sass = disassemble(compiled.asm["cubin"])
    if sass is not None:  # (loops of a few instructions are barrier waits' retries)
        record["loops"] = [collections.Counter(body).most_common() for body in sass_loops(sass, innermost)
                           if len(body) > 16]
    return record



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--tiles", default="128x128x2x8,128x64x3x8,64x128x2x4,64x64x4x4",
                        help="BLOCK_MxBLOCK_NxSTAGESxnum_warps, comma-separated")
    parser.add_argument("--variants", default=None,
                        help="keys of gluon_forward.VARIANTS, comma-separated (default single,ws,ws-overlap,ws2,"
                             "pingpong; with --fp8 pingpong-fa3)")
    parser.add_argument("--schedule", default="grid", help="grid or lpt (gluon_forward.SCHEDULES)")
    parser.add_argument("--fp8", action="store_true", help="the FP8 forward (gluon_attention_forward_fp8)")
    parser.add_argument("--loops", type=int, default=0, metavar="N",
                        help="also print each loop's length in SASS instructions and its N most frequent opcodes")
    parser.add_argument("--inner", action="store_true",
                        help="with --loops: the innermost loops (a key tile's step) instead of the outermost")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    stand_in.install("sm90", max_shared=2**31 - 1)  # shared memory is checked below, not refused at launch
    keep_ptxas_logs()
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    records = []
    variants = (args.variants or ("pingpong-fa3" if args.fp8 else "single,ws,ws-overlap,ws2,pingpong")).split(",")
    print(f"{'d':>4} {'causal':>6} {'variant':>10} {'tile':>11} {'threads':>7} {'regs':>5} {'peak':>5} "
          f"{'spills':>7} {'smem KiB':>9}  notes")
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (False, True):
            for variant in variants:
                for tile in tiles:
                    r = compile_variant(d, causal, variant, tile, args.schedule, args.fp8, args.inner)
                    records.append(r)
                    head = f"{d:>4} {'yes' if causal else 'no':>6} {variant:>10} {r['tile']:>11}"
                    if "skipped" in r:
                        print(f"{head}  skipped: {r['skipped']}", flush=True)
                        continue
                    if "error" in r:
                        print(f"{head}  FAILED {r['error']}", flush=True)
                        continue
                    notes = []
                    if r["setmaxnreg"]:
                        notes.append("setmaxnreg " + "/".join(map(str, r["setmaxnreg"])))
                    if r["wgmma_serialized"]:
                        notes.append(f"wgmma serialized ({r['wgmma_serialized']})")
                    if r["shared_bytes"] > SMEM_LIMIT:
                        notes.append("OVER sm90's 227 KiB")
                    print(f"{head} {r['threads']:>7} {r['registers']:>5} "
                          f"{r['sass_peak'] if r['sass_peak'] is not None else '?':>5} {r['spill_bytes']:>7} "
                          f"{r['shared_bytes'] / 1024:>9.1f}  {'; '.join(notes)}", flush=True)
                    for i, mix in enumerate(r.get("loops", []) if args.loops else []):
                        print(f"      loop {i}: {sum(n for _, n in mix)} instructions: "
                              + " ".join(f"{op} {n}" for op, n in mix[:args.loops]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    bad = [r for r in records if "skipped" not in r
           and ("error" in r or r["spill_bytes"] != 0 or r["shared_bytes"] > SMEM_LIMIT)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
