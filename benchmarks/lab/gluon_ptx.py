"""The Gluon forward's PTX per variant, compiled for sm_90 without a GPU, normalised for comparison.

    python benchmarks/lab/gluon_ptx.py dump DIR [--variants pingpong-fa3,single-ffma,single,ws]
    python benchmarks/lab/gluon_ptx.py diff DIR_BEFORE DIR_AFTER

``dump`` compiles ``gluon_forward.gluon_attention_forward`` (dense bf16, d = 128 and 64, causal and not) for
each variant through the stand-in driver (``flashtile.kernels.stand_in``) into a fresh Triton cache and
writes each kernel's PTX, normalised: register numbers, parameter numbers, labels, ``.loc`` lines and
comments dropped, so that two builds of the same code compare equal line for line. ``diff`` prints, per
kernel, the instruction counts and the changed lines. Use it around a change that must leave a path's code
alone (a new constexpr switch): run ``dump`` before and after, then ``diff``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import tempfile
from pathlib import Path


def normalise(ptx: str) -> list[str]:
    lines = []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if not line or line.startswith((".loc", ".file", ".param", "$L__", ".section", ".b8", ".b32", ".b64")):
            continue
        line = re.sub(r"%[a-z]+\d+", "%R", line)
        line = re.sub(r"_param_\d+", "_param", line)
        line = re.sub(r"\$L__\w+", "$L", line)
        lines.append(line)
    return lines


def dump(directory: Path, variants: list[str]) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    import torch

    from flashtile.kernels import stand_in

    stand_in.install("sm90")
    from flashtile.kernels import gluon_forward

    directory.mkdir(parents=True, exist_ok=True)
    for d in (128, 64):
        for variant in variants:
            for causal in (False, True):
                q, k, v = (torch.randn(2, n, 4, d, dtype=torch.bfloat16) for n in (300, 333, 333))
                gluon_forward.gluon_attention_forward(q, k, v, causal, variant=variant)
                compiled = list(gluon_forward._gluon_attn_fwd.device_caches[0][0].values())[-1]
                name = f"d{d}_{variant}_{'causal' if causal else 'full'}.ptx"
                (directory / name).write_text("\n".join(normalise(compiled.asm["ptx"])) + "\n")
                print(name, flush=True)


def diff(before: Path, after: Path) -> int:
    changed = 0
    for path in sorted(before.glob("*.ptx")):
        other = after / path.name
        if not other.exists():
            print(f"{path.name}: missing in {after}")
            changed += 1
            continue
        a, b = path.read_text().splitlines(), other.read_text().splitlines()
        lines = [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
                 if not line.startswith(("---", "+++", "@@"))]
        print(f"{path.name}: {len(a)} -> {len(b)} lines, {len(lines)} changed")
        for line in lines[:20]:
            print("   ", line)
        changed += bool(lines)
    return 1 if changed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dumping = sub.add_parser("dump")
    dumping.add_argument("directory", type=Path)
    dumping.add_argument("--variants", default="pingpong-fa3,single-ffma,single,ws")
    diffing = sub.add_parser("diff")
    diffing.add_argument("before", type=Path)
    diffing.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        dump(args.directory, args.variants.split(","))
        return 0
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
