"""Command line: ``flashtile info`` and ``flashtile bench``."""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _info() -> int:
    from . import __version__
    from .interface import select_backend

    print(f"flashtile {__version__}")
    print(f"torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}")
        cache = os.environ.get("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
        print(f"triton cache {cache}")
    except ImportError:
        print("triton not installed (the Triton backend is unavailable)")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"gpu {torch.cuda.get_device_name()} (compute capability {major}.{minor})")
        try:  # the tile lists and switches the kernels take on it (docs/gpu-support.md)
            from .kernels.configs import target_of

            target = target_of(torch.device("cuda"))
            forced = " (FLASHTILE_TARGET)" if os.environ.get("FLASHTILE_TARGET") else ""
            print(f"target {target.name}{forced}: tile lists of {target.gpus}, TMA {'on' if target.tma else 'off'}")
        except (ImportError, RuntimeError, ValueError) as exc:
            print(f"target none: {exc}")
        print(f"backend for CUDA tensors: {_backend_or_error(select_backend, 'cuda')}")
    else:
        print("gpu none")
    print(f"backend for CPU tensors: {_backend_or_error(select_backend, 'cpu')}")
    # The switches that change what runs, with their effective values (docs/settings.md).
    settings = {"FLASHTILE_BACKEND": "auto", "FLASHTILE_AUTOTUNE": "1", "FLASHTILE_AUTOTUNE_CACHE": "1",
                "FLASHTILE_TMA": "auto", "FLASHTILE_VALUE_CHECKS": "1", "FLASHTILE_L2_SECTION_MB": "8",
                "FLASHTILE_DIRECT_LAUNCH": "1", "FLASHTILE_BWD_OVERLAP": "by head dim",
                "FLASHTILE_COMPILE_THREADS": "up to 8", "FLASHTILE_FP8_BACKWARD": "0"}
    print("settings " + ", ".join(f"{name}={os.environ.get(name, default)}" for name, default in settings.items()))
    others = sorted(name for name in os.environ if name.startswith("FLASHTILE_") and name not in settings)
    if others:
        print("also set " + ", ".join(f"{name}={os.environ[name]}" for name in others))
    return 0


def _backend_or_error(select_backend, device: str) -> str:
    """The backend's name, or the error a call would raise (a bad FLASHTILE_BACKEND): info still prints the rest."""
    try:
        return select_backend(torch.device(device))
    except (ValueError, RuntimeError) as exc:
        return f"none ({exc})"


def main(argv: list[str] | None = None) -> int:
    from . import bench, demo

    parser = argparse.ArgumentParser(prog="flashtile", description="FlashAttention in Triton")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU and the backend that will run")
    bench.build_parser(sub.add_parser("bench", help="benchmark against SDPA, cuDNN, FlexAttention, naive"))
    demo.build_parser(sub.add_parser("demo", help="train a tiny character-level GPT on the Python stdlib"))
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    if args.command == "demo":
        return demo.main(args)
    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
