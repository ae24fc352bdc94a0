#!/usr/bin/env bash
# flash-attn-4 (CuTe DSL) as a live peer on the GPU machine, which has no network: its wheels unpacked here
# come to 96 MB, over the 64 MiB one device call carries, so they travel in two archives over two calls
# to one warm machine (/tmp/fa4site there keeps what the first unpacked: an ignored folder inside the
# checkout did not outlast the call).
#   here, once:        bash benchmarks/lab/fa4_carry.sh prepare        (pip download, then .fa4a/ and .fa4b/)
#   first call there:  bash benchmarks/lab/fa4_carry.sh unpack-a       (carry .fa4a)
#   second call there: bash benchmarks/lab/fa4_carry.sh unpack-b && export PYTHONPATH=$(bash benchmarks/lab/fa4_carry.sh path) \
#                        && python3 -m flashtile bench --peers flashtile,sdpa_cudnn,sdpa_flash,fa4 ...  (carry .fa4b)
# (``path``: the unpacked folder and the CUTLASS DSL's own package folder, which its wheel's .pth file would
# add in a site-packages install, then the repo.)
# The two archive folders are ignored through .git/info/exclude (prepare adds them).
set -euo pipefail
cd "$(dirname "$0")/../.."
IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs
SITE=${FA4_SITE:-/tmp/fa4site}
case "${1:-}" in
  prepare)
    grep -q "^/.fa4a/" .git/info/exclude || printf "/.fa4a/\n/.fa4b/\n" >> .git/info/exclude
    wheels=$(mktemp -d) site=$(mktemp -d)
    # The GPU machine: Python 3.12, torch built for CUDA 13 (shared/anchors/README.md).
    python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$wheels" \
      flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "apache-tvm-ffi<0.2,>=0.1.11" \
      torch-c-dlpack-ext quack-kernels
    for w in "$wheels"/*.whl; do python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$site"; done
    mkdir -p .fa4a .fa4b
    # The compiler library alone is 191 MB: a dictionary as large as it compresses it to about 49 MB.
    tar -C "$site" -cf - "$IR" | xz -9e --lzma2=dict=256MiB -T1 > .fa4a/ir.tar.xz
    tar -C "$site" --exclude="./$IR" -cf - . | xz -9e -T2 > .fa4b/rest.tar.xz
    rm -rf "$wheels" "$site"
    ls -la .fa4a .fa4b ;;
  unpack-a) mkdir -p "$SITE" && xz -dc .fa4a/ir.tar.xz | tar -C "$SITE" -xf - ;;
  unpack-b) mkdir -p "$SITE" && xz -dc .fa4b/rest.tar.xz | tar -C "$SITE" -xf -
            test -d "$SITE/$IR" || { echo "unpack-a first (the compiler library is missing)"; exit 1; } ;;
  path) echo "$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD" ;;
  *) echo "usage: $0 prepare | unpack-a | unpack-b | path"; exit 2 ;;
esac
