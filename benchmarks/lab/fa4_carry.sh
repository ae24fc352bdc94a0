#!/usr/bin/env bash
# flash-attn-4 (CuTe DSL) as a live peer on the GPU machine, which has no network: its wheels unpacked here
# come to 264 MB; one xz archive of them with a dictionary as large as the compiler library (191 MB, which shares
# much with the DSL's runtime library) is about 59 MB, under the 64 MiB one device call carries with the checkout.
#   here, once:  bash benchmarks/lab/fa4_carry.sh prepare        (pip download, then .fa4/site.tar.xz; ~5 minutes)
#   there:       bash benchmarks/lab/fa4_carry.sh unpack && export PYTHONPATH=$(bash benchmarks/lab/fa4_carry.sh path) \
#                  && python3 -m flashtile bench --peers flashtile,sdpa_cudnn,sdpa_flash,fa4 ...  (carry .fa4)
# (``path``: the unpacked folder and the CUTLASS DSL's own package folder, which its wheel's .pth file would
# add in a site-packages install, then the repo.)
# The archive's folder is ignored through .git/info/exclude (prepare adds it).
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${FA4_SITE:-/tmp/fa4site}
case "${1:-}" in
  prepare)
    grep -q "^/.fa4/" .git/info/exclude || printf "/.fa4/\n" >> .git/info/exclude
    wheels=$(mktemp -d) site=$(mktemp -d)
    # The GPU machine: Python 3.12, torch built for CUDA 13 (shared/anchors/README.md).
    python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$wheels" \
      flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi<0.2,>=0.1.11" \
      torch-c-dlpack-ext quack-kernels
    for w in "$wheels"/*.whl; do python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$site"; done
    # Every shared library's needs met inside the archive or by the system, torch or the driver: the GPU machine
    # would report a missing one only at FA4's import (readelf, from binutils)
    python3 - "$site" <<'PY'
import pathlib, subprocess, sys
site = pathlib.Path(sys.argv[1])
libraries = list(site.rglob("*.so*"))
present = {library.name for library in libraries}
outside = ("libc.", "libm.", "libdl.", "librt.", "libpthread.", "ld-linux", "libstdc++.", "libgcc_s.", "libtorch",
           "libc10", "libcuda.")
missing = set()
for library in libraries:
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    for line in dynamic.splitlines():
        if "(NEEDED)" in line:
            name = line.split("[", 1)[1].rstrip("]")
            if name not in present and not name.startswith(outside):
                missing.add(f"{name} (for {library.name})")
sys.exit(f"missing shared libraries: {', '.join(sorted(missing))}" if missing else 0)
PY
    mkdir -p .fa4
    # Every file (tvm-ffi's core loads even its test library at import).
    tar -C "$site" -cf - . | xz -9e --lzma2=dict=384MiB -T1 > .fa4/site.tar.xz
    rm -rf "$wheels" "$site"
    ls -la .fa4 ;;
  unpack) mkdir -p "$SITE" && xz -dc .fa4/site.tar.xz | tar -C "$SITE" -xf - ;;
  path) echo "$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD" ;;
  *) echo "usage: $0 prepare | unpack | path"; exit 2 ;;
esac
