"""Set compute-sanitizer racecheck's reported kernel offsets beside the SASS instructions at them.

    python benchmarks/lab/racecheck_map.py --log racecheck.txt [--sass build.sass ...] [--build three16]

racecheck names each access of a hazard as ``<kernel>+0x<offset>`` (``sanitize.sh`` keeps the log, or prints each
hazard on one line with ``SANITIZE_PAIRS``). The SASS comes from ``--sass`` files (nvdisasm's text, each instruction
preceded by ``/*<offset>*/``) or from ``--build``, which builds on this machine, as a stand-in sm_90 driver, the
kernels of a ``sanitize.sh`` part with the same arguments, so that the offsets match the GPU's build: ``three16``, the
16-bit forward with three consumers (causal and not). Each distinct offset is printed once per build with its
instruction, so that shared-memory loads and stores (LDS, STS, and the barrier and mbarrier operations around them)
can be told from the tables triton's ``warp_specialize`` keeps (docs: RELIABILITY.md, "sanitizer errors").
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", required=True, help="racecheck's log, or sanitize.sh's SANITIZE_PAIRS lines")
    parser.add_argument("--sass", nargs="*", default=[], help="nvdisasm text of the builds")
    parser.add_argument("--build", choices=["three16"], help="build a sanitize.sh part's kernels here instead")
    args = parser.parse_args()
    with open(args.log) as f:
        reported = offsets_in(f.read())
    builds = {}
    for path in args.sass:
        with open(path) as f:
            builds[path] = f.read()
    if args.build == "three16":
        builds.update(build_three16())
    for kernel, offsets in sorted(reported.items()):
        print(f"== {kernel}: {len(offsets)} offsets")
        for name, sass in builds.items():
            table = instructions(sass)
            print(f"-- {name}")
            for offset in sorted(offsets):
                print(f"  0x{offset:05x}  {table.get(offset, '(no instruction at this offset in this build)')}")


if __name__ == "__main__":
    main()
