"""A stand-in for Triton's GPU driver, for running Triton's launch path on a machine without a GPU.

``install("sm80")`` (any name of ``configs.TARGETS``; default ``"sm90"``, an H200) makes Triton believe it
drives that GPU: kernels are compiled for it by Triton's real compiler (the bundled ptxas for NVIDIA, the
LLVM AMDGPU backend and linker inside libtriton for AMD, no ROCm needed), arguments are bound and
specialized as on a GPU, and the final driver call is a no-op that counts launches (and, with
``record=True``, keeps each launch's arguments in ``Launcher.records``). Process-wide and not undone: use
it in a script or a subprocess, before the first launch. Tensors stay on the CPU, so flashtile takes the
target from this driver (``configs.target_of``) and leaves the TMA paths off unless told otherwise.

``install(raw=True)`` gives Triton's CUDA launcher instead, but for its compiled module (``CudaLauncher``),
so that launch plans replay through their raw launches as on a GPU.

Used by ``compile_check`` (every kernel for every target), by the benchmarks' ``stand_in_hopper.py``
(host time per call, registers of each tile) and by the tests of ``configs._DirectLaunch`` and of launch
plans (``kernels/replay.py``).
"""

from __future__ import annotations

import torch

current_device = [0]  # what the driver reports as the current device (tests switch it)


class Launcher:
    """Stands in for Triton's launcher of one compiled kernel."""

    launches = 0
    record = False
    records: list[tuple] = []

    def __init__(self, src, metadata):
        self.name = getattr(src, "name", "?")

    def __call__(self, *args):
        Launcher.launches += 1
        if Launcher.record:
            Launcher.records.append((self.name, args))


class CudaLauncher(Launcher):
    """Triton 3.6's CUDA launcher but for its compiled C module (``install(raw=True)``): the same fields
    from the kernel's metadata (scratch sizes, CTAs), the same ``launch`` (the module's, wrapped to expand
    TMA descriptors) and the same ``__call__`` (scratch from Triton's allocators, then ``launch``), so that
    launch plans replay through their raw launches as on a GPU. The module's launch counts and, with
    ``record=True``, keeps its arguments in ``CudaLauncher.module_records``: those of Triton's own path and
    those of a raw replay, alike."""

    module_records: list[tuple] = []

    def __init__(self, src, metadata):
        from triton.backends.nvidia.driver import CudaLauncher as Cuda
        from triton.backends.nvidia.driver import wrap_handle_tensordesc

        super().__init__(src, metadata)
        self.num_ctas = getattr(metadata, "num_ctas", 1)
        self.launch = wrap_handle_tensordesc(self._module_launch, dict(src.signature),
                                             getattr(metadata, "tensordesc_meta", None))
        for field in ("global_scratch_size", "global_scratch_align", "profile_scratch_size", "profile_scratch_align",
                      "launch_cooperative_grid", "launch_pdl"):
            setattr(self, field, getattr(metadata, field))
        self._call = Cuda.__call__

    def _module_launch(self, *args):
        Launcher.launches += 1
        if Launcher.record:
            CudaLauncher.module_records.append((self.name, args))

    def __call__(self, *args):
        self._call(self, *args)


def install(target: str = "sm90", record: bool = False, max_shared: int | None = None, raw: bool = False) -> None:
    """Make Triton's active driver a stand-in for a ``target`` GPU. ``max_shared``: the shared memory
    (bytes) Triton lets a compiled kernel load with (default the target's limit; a kernel over it raises
    Triton's OutOfResources at its first launch, as on the GPU). ``raw``: launchers that launch plans take
    for Triton's CUDA one (``CudaLauncher``). ``FLASHTILE_TARGET`` is dropped: the stand-in is the target."""
    import os

    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    from .configs import TARGETS

    spec = TARGETS[target]
    gpu_target = GPUTarget("hip" if spec.vendor == "amd" else "cuda", spec.arch, spec.warp_size)
    properties = {"max_shared_mem": max_shared or spec.smem_limit, "multiprocessor_count": 132,
                  "max_num_regs": 65536, "warpSize": spec.warp_size}

    class Utils:
        def get_device_properties(self, device):
            return properties

        def load_binary(self, name, kernel, shared, device):
            return object(), object(), 0, 0, 1024  # (module, function, registers, spills, max threads)

        def fill_tma_descriptor(self, address, *layout):
            return ("tma", address, *(tuple(x) if isinstance(x, list) else x for x in layout))

    class StandIn(DriverBase):
        utils, launcher_cls = Utils(), CudaLauncher if raw else Launcher

        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return gpu_target

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

    os.environ.pop("FLASHTILE_TARGET", None)
    Launcher.record = record
    driver.set_active(StandIn())
