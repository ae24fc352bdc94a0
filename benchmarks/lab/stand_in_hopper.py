"""A stand-in for Triton's CUDA driver as an H200 (sm_90), for running Triton's launch path on a machine
without a GPU: ``flashtile.kernels.stand_in`` for sm90 (the same driver stands in for every target there).

``install()`` makes Triton believe it drives an H200: kernels are compiled for sm_90 by the bundled ptxas,
arguments are bound and specialized as on a GPU, and the final driver call is a no-op that counts launches
(and, with ``record=True``, keeps each launch's arguments in ``Launcher.records``). Process-wide and not
undone: use it in a script or a subprocess. Tensors stay on the CPU, so flashtile's TMA paths are not
taken. Used by ``host_overhead.py`` (host time per call), ``kernel_resources.py`` and by the test of
``configs._DirectLaunch`` (the same launches as Triton's own path).
"""

from __future__ import annotations

from flashtile.kernels import stand_in
from flashtile.kernels.stand_in import Launcher, current_device

__all__ = ["Launcher", "current_device", "install"]


def install(record: bool = False, raw: bool = False) -> None:
    stand_in.install("sm90", record=record, raw=raw)
