"""Set compute-sanitizer racecheck's reported kernel offsets beside the SASS instructions at them.

    python benchmarks/lab/racecheck_map.py --log racecheck.txt [--sass build.sass ...] [--build three16|one_pass]

racecheck names each access of a hazard as ``<kernel>+0x<offset>`` (``sanitize.sh`` keeps the log, or prints each
hazard on one line with ``SANITIZE_PAIRS``). The SASS comes from ``--sass`` files (nvdisasm's text, each instruction
preceded by ``/*<offset>*/``) or from ``--build``, which builds on this machine, as a stand-in sm_90 driver, the
kernels of a ``sanitize.sh`` part with the same arguments, so that the offsets match the GPU's build: ``three16``,
the 16-bit forward with three consumers (causal and not); ``one_pass``, the backward in FA3's order as
SANITIZE_VARIANTS=5,7,8 build it (its forward builds are left out). Each distinct offset is printed once per build
with its instruction, so that shared-memory loads and stores (LDS, STS, and the barrier and mbarrier operations
around them) can be told from the tables triton's ``warp_specialize`` keeps (docs: RELIABILITY.md, "sanitizer
errors").
"""

from __future__ import annotations

import argparse
import os
import re

OFFSET = re.compile(r"(\w+)\+0x([0-9a-fA-F]+)")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*(?:/\*.*)?$")


def offsets_in(log_text: str) -> dict[str, set[int]]:
    """{kernel: the offsets racecheck named in it}."""
    found: dict[str, set[int]] = {}
    for line in log_text.splitlines():
        if "access at" not in line:
            continue
        for kernel, offset in OFFSET.findall(line):
            found.setdefault(kernel, set()).add(int(offset, 16))
    return found


def instructions(sass_text: str) -> dict[int, str]:
    """{offset: instruction} of nvdisasm's text."""
    table = {}
    for line in sass_text.splitlines():
        match = SASS_LINE.search(line)
        if match:
            table[int(match.group(1), 16)] = match.group(2).strip()
    return table


def build_three16() -> dict[str, str]:
    """{build name: SASS} of sanitize.sh's three16 part's kernels, built here for sm_90a."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FLASHTILE_AUTOTUNE"] = "0"
    import torch

    from flashtile.kernels import stand_in

    stand_in.install("sm90")
    from flashtile.kernels import gluon_forward
    from flashtile.kernels.compile_check import _compiled, disassemble

    kernel = gluon_forward._gluon_attn_fwd
    q = torch.randn(1, 700, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 900, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    builds = {}
    for causal in (False, True):
        before = set(map(id, _compiled(kernel, 0)))
        gluon_forward.gluon_attention_forward(q, k, v, causal, tiles=(192, 128, 2, 12), variant="pingpong3-fa3")
        new = [c for c in _compiled(kernel, 0) if id(c) not in before]
        builds[f"pingpong3-fa3 d=64 causal={causal}"] = disassemble(new[-1].asm["cubin"]) or ""
    return builds


def build_one_pass(multiprocessors: int = 132) -> dict[str, str]:
    """{build name: SASS} of the one pass in FA3's order as ``sanitize.sh``'s one_pass part builds it with
    SANITIZE_VARIANTS=5,7,8 (1,100 x 1,300 tokens, 4 query heads over 2 KV heads): d = 128 with 64 query rows, d = 64
    with 64 and with 128, causal and not; without a causal mask the last wave split as on a GPU of
    ``multiprocessors`` (the H100's 132; the split is a compiled switch)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FLASHTILE_AUTOTUNE"] = "0"
    import torch

    from flashtile.kernels import stand_in

    stand_in.install("sm90")
    from flashtile.kernels import gluon_backward
    from flashtile.kernels.compile_check import _compiled, disassemble

    kernel = gluon_backward._gluon_bwd_dkdv
    builds = {}
    for d, tiles in ((128, (64, 128, 2, 8)), (64, (64, 128, 2, 8)), (64, (128, 128, 2, 8))):
        q, dout, out = (torch.randn(1, 1100, 4, d, dtype=torch.bfloat16) for _ in range(3))
        k, v = (torch.randn(1, 1300, 2, d, dtype=torch.bfloat16) for _ in range(2))
        for causal in (False, True):
            before = set(map(id, _compiled(kernel, 0)))
            gluon_backward.gluon_attention_backward(dout, q, k, v, out, torch.randn(1, 4, 1100), causal,
                                                    one_pass="fixed", warp_specialize=True, keys_as_m="fa3",
                                                    dkdv_tiles=tiles, split_sms=0 if causal else multiprocessors)
            new = [c for c in _compiled(kernel, 0) if id(c) not in before]
            builds[f"fa3 d={d} rows={tiles[0]} causal={causal}"] = disassemble(new[-1].asm["cubin"]) or ""
    return builds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True, help="racecheck's log, or sanitize.sh's SANITIZE_PAIRS lines")
    parser.add_argument("--sass", nargs="*", default=[], help="nvdisasm text of the builds")
    parser.add_argument("--build", choices=["three16", "one_pass"],
                        help="build a sanitize.sh part's kernels here instead (one_pass: the backward's FA3 order)")
    args = parser.parse_args()
    with open(args.log) as f:
        reported = offsets_in(f.read())
    builds = {}
    for path in args.sass:
        with open(path) as f:
            builds[path] = f.read()
    if args.build == "three16":
        builds.update(build_three16())
    elif args.build == "one_pass":
        builds.update(build_one_pass())
    built_kernel = {"three16": "_gluon_attn_fwd", "one_pass": "_gluon_bwd_dkdv"}.get(args.build)
    for kernel, offsets in sorted(reported.items()):
        if built_kernel and kernel != built_kernel:
            continue
        print(f"== {kernel}: {len(offsets)} offsets")
        for name, sass in builds.items():
            table = instructions(sass)
            print(f"-- {name}")
            for offset in sorted(offsets):
                print(f"  0x{offset:05x}  {table.get(offset, '(no instruction at this offset in this build)')}")


if __name__ == "__main__":
    main()
