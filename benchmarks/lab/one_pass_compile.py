"""Seconds of the sm90 one-pass backward's first call on a machine without a GPU: its kernels compiled for sm_90a
through the stand-in driver (Triton's real compiler and ptxas; the launches are no-ops), each point in a new process
with an empty Triton cache, with its kernels compiled side by side (``configs.compile_together``) and one by one
(``FLASHTILE_COMPILE_THREADS=1``).

    python benchmarks/lab/one_pass_compile.py [--points 128:0,128:1,64:0] [--threads 8] [--launchers]

A point is d:causal; one sequence of 4,096 tokens, 4 heads, bf16, FA3's order as the dispatch takes it.
``--launchers``: each kernel's launcher is built as Triton 3.6 builds it on a GPU machine (its C module, by the system
compiler, linked against a stub ``libcuda.so.1`` made for the run), not the stand-in's no-op.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import os, sys, time
import torch
from flashtile.kernels import stand_in
stand_in.install("sm90")
if os.environ.get("STUB_LIBCUDA"):  # --launchers
    from triton.backends.nvidia.driver import CudaLauncher
    from triton.runtime.driver import driver

    class BuiltLauncher(stand_in.Launcher):  # Triton's launcher built (its C module), the stand-in's no-op launch
        def __init__(self, src, metadata):
            super().__init__(src, metadata)
            CudaLauncher(src, metadata)

    type(driver.active).launcher_cls = BuiltLauncher
from flashtile.kernels import gluon_backward as gb
d, causal = int(sys.argv[1]), sys.argv[2] == "1"
q, k, v = (torch.randn(1, 4096, 4, d, dtype=torch.bfloat16) for _ in range(3))
start = time.perf_counter()
gb.gluon_attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(1, 4, 4096), causal,
                            one_pass="fixed", warp_specialize=True, keys_as_m="fa3", split_sms=132)
print(f"SECONDS {time.perf_counter() - start:.2f}")
"""


# The CUDA driver functions Triton 3.6's launcher module links against (--launchers: stubs that are never called)
_CUDA_FUNCTIONS = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                   "cuFuncSetAttribute", "cuGetErrorString", "cuPointerGetAttribute")


def stub_libcuda(folder: str) -> str:
    """A ``libcuda.so.1`` in ``folder`` whose functions do nothing, so that launcher modules link and load."""
    source = Path(folder) / "stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in _CUDA_FUNCTIONS))
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(Path(folder) / "libcuda.so.1"), str(source)], check=True)
    (Path(folder) / "libcuda.so").symlink_to("libcuda.so.1")
    return folder


def first_call(d: int, causal: bool, threads: str, stub: str | None = None) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "FLASHTILE_COMPILE_THREADS": threads,
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if stub:
            env.update(STUB_LIBCUDA="1", TRITON_LIBCUDA_PATH=stub,
                       LD_LIBRARY_PATH=stub + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
        env.pop("TRITON_INTERPRET", None)
        done = subprocess.run([sys.executable, "-c", CHILD, str(d), "1" if causal else "0"], capture_output=True,
                              text=True, env=env, cwd=REPO, timeout=900)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        return float(next(line for line in done.stdout.splitlines() if line.startswith("SECONDS")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", default="128:0,128:1,64:0,64:1")
    parser.add_argument("--threads", default=str(min(8, os.cpu_count() or 1)))
    parser.add_argument("--launchers", action="store_true",
                        help="build each kernel's launcher module as on a GPU machine (stub libcuda)")
    args = parser.parse_args()
    stub_folder = tempfile.TemporaryDirectory() if args.launchers else None
    stub = stub_libcuda(stub_folder.name) if stub_folder else None
    print(f"| d | causal | {args.threads} threads (s) | one by one (s) | ratio |\n|---|---|---|---|---|")
    for point in args.points.split(","):
        d, causal = int(point.split(":")[0]), point.split(":")[1] == "1"
        together, alone = first_call(d, causal, args.threads, stub), first_call(d, causal, "1", stub)
        print(f"| {d} | {'yes' if causal else 'no'} | {together:.1f} | {alone:.1f} | {alone / together:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
