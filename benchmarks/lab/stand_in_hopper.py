"""A stand-in for Triton's CUDA driver, for running Triton's launch path on a machine without a GPU.

``install()`` makes Triton believe it drives an H200 (sm_90): kernels are compiled for sm_90 by the
bundled ptxas, arguments are bound and specialized as on a GPU, and the final driver call is a no-op
that counts launches (and, with ``record=True``, keeps each launch's arguments in ``Launcher.records``).
Process-wide and not undone: use it in a script or a subprocess. Tensors stay on the CPU, so flashtile's
TMA paths are not taken. Used by ``host_overhead.py`` (host time per call) and by the test of
``configs._DirectLaunch`` (the same launches as Triton's own path).
"""

from __future__ import annotations

import torch


class _Utils:
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def load_binary(self, name, kernel, shared, device):
        return object(), object(), 0, 0, 1024  # (module, function, registers, spills, max threads)


current_device = [0]  # what the driver reports as the current device (tests switch it)


class Launcher:
    """Stands in for Triton's CUDA launcher of one compiled kernel."""

    launches = 0
    record = False
    records: list[tuple] = []

    def __init__(self, src, metadata):
        self.name = getattr(src, "name", "?")

    def __call__(self, *args):
        Launcher.launches += 1
        if Launcher.record:
            Launcher.records.append((self.name, args))


def install(record: bool = False) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class StandInHopper(DriverBase):
        utils, launcher_cls = _Utils(), Launcher

        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return current_device[0]

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_empty_cache_for_benchmark(self):
            raise NotImplementedError

        def clear_cache(self, cache):
            pass

        def map_python_to_cpp_type(self, ty):
            return ty

    Launcher.record = record
    driver.set_active(StandInHopper())
