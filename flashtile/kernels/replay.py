"""Launch plans: one call's kernel launches recorded once, then replayed with new tensors.

A short attention call spends far longer on the host than its kernels run on the GPU: argument checks,
tile lookup, Triton's binding of 50-70 arguments per launch, descriptors, allocations. All of that is a
function of the call's shapes, strides, dtypes and options, none of it of the tensors' values. So the
first call of a given shape runs the ordinary path under ``record``, which notes every launch (compiled
kernel, grid, bound arguments) and every tensor made on the way; later calls with the same key replay
the launches with their own tensors in the same argument slots (``Plan.run``).

A call is recorded only where replaying it is provably the same work, and is otherwise left to the
ordinary path every time:

* every launch went through ``configs._DirectLaunch`` (already compiled and tuned) on the stream that
  was current when the call began (no side stream);
* the only PyTorch operations were allocations (``torch.empty`` and kin, seen by a dispatch mode), so
  nothing was computed outside the recorded kernels;
* every tensor argument is an input of the call, a tensor it allocated (allocated afresh in each
  replay: the outputs and scratch buffers), or one of the kernels' cached placeholders; every TMA
  descriptor is over an input or an allocation.

The caller keys plans by everything the ordinary path's decisions read: shapes, strides, dtypes, device,
options, the settings' environment variables, and 16-byte alignment of the inputs (Triton specializes
pointers on it; the callers replay only aligned inputs). A replay refuses (returns None) where Triton's
own path would behave differently: a launch hook registered (a profiler), or a changed debug knob.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.tools.tensor_descriptor import TensorDescriptor

from . import configs

_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default}


class _Recording(TorchDispatchMode):
    """Collects launches (from ``configs``) and allocations (as a dispatch mode) of one call."""

    def __init__(self):
        super().__init__()
        self.streams: set[tuple[int, int]] = set()  # (device, stream) of the launches
        self.launches: list[tuple] = []
        self.allocated: list[torch.Tensor] = []
        self.aliases: list[tuple[torch.Tensor, torch.Tensor]] = []  # (alias, allocation)
        self.refusal: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.append(result)
        elif func is torch.ops.aten.detach.default and any(args[0] is t for t in self.allocated):
            # PyTorch detaches what a factory made inside an autograd Function: the same memory.
            self.aliases.append((result, args[0]))
        elif self.refusal is None:
            self.refusal = f"PyTorch computes outside the kernels ({func})"
        return result


_new_descriptor = object.__new__
_local = threading.local()
_RECORDERS = threading.Lock()


def note_launch(fn, compiled, size: tuple, device: int, stream: int, args: tuple) -> None:
    """Called by ``configs._DirectLaunch`` after each launch: kept if this thread is recording."""
    recording = getattr(_local, "recording", None)
    if recording is not None:
        if fn.pre_run_hooks and not all(getattr(h, "replayable", False) for h in fn.pre_run_hooks):
            recording.refusal = recording.refusal or "a launch with pre-run hooks"
        recording.launches.append((compiled, size, args))
        recording.streams.add((device, stream))


def note_indirect(reason: str) -> None:
    """Called by ``configs`` when a launch takes Triton's own path (first call, tuning, hooks)."""
    recording = getattr(_local, "recording", None)
    if recording is not None and recording.refusal is None:
        recording.refusal = reason


def recording() -> bool:
    return getattr(_local, "recording", None) is not None


@dataclass(frozen=True)
class _Launch:
    run: object  # the compiled kernel's launcher
    function: int
    packed_metadata: object
    grid: tuple[int, int, int]
    template: tuple  # bound arguments, the slots' entries None
    slots: tuple  # (argument position, tensor index, descriptor fields or None)


@dataclass(frozen=True)
class Plan:
    """Launches of one recorded call. Tensor index i < len(inputs) is input i, then the allocations."""

    num_inputs: int
    allocations: tuple  # (shape, stride, dtype, contiguous)
    outputs: tuple  # tensor indices of the call's results
    launches: tuple
    device: torch.device  # where the allocations go
    driver_device: int  # the device current in Triton's driver when recorded (its compiled kernels)
    knobs: tuple  # configs.launch_knobs() when recorded

    def run(self, inputs: tuple) -> tuple | None:
        """The recorded call's results for new inputs (same key), or None where Triton's own path must
        run instead (a launch hook or debug knob set since)."""
        driver = configs.launch_driver()
        if (configs._DIRECT_BROKEN or not configs.plain_launches(self.knobs)
                or driver.get_current_device() != self.driver_device):
            return None
        device = self.device
        tensors = list(inputs)
        for shape, stride, dtype, contiguous in self.allocations:
            tensors.append(torch.empty(shape, dtype=dtype, device=device) if contiguous else
                           torch.empty_strided(shape, stride, dtype=dtype, device=device))
        stream = driver.get_current_stream(self.driver_device)
        for launch in self.launches:
            args = list(launch.template)
            for position, index, descriptor in launch.slots:
                if descriptor is None:
                    args[position] = tensors[index]
                else:  # the recorded descriptor over this call's tensor (its checks passed when recorded)
                    made = _new_descriptor(TensorDescriptor)
                    made.__dict__.update(descriptor)
                    made.base = tensors[index]
                    args[position] = made
            grid_x, grid_y, grid_z = launch.grid
            try:
                launch.run(grid_x, grid_y, grid_z, stream, launch.function, launch.packed_metadata, None, None,
                           None, *args)
            except Exception as exc:
                # As for a refused direct launch (configs._DirectLaunch): direct launches and plans stop for
                # the process, and the caller repeats the call on the ordinary path into fresh buffers.
                configs.stop_direct_launches(exc)
                return None
        return tuple(tensors[i] for i in self.outputs)


def record(call, inputs: tuple, placeholders: set[int]):
    """Run ``call()`` (which returns a tuple of tensors made from ``inputs``) and record its launches.

    ``placeholders``: ids of the cached tensors the kernels may take as arguments (kept by the plan).
    Returns (call's result, Plan or None, reason when None).
    """
    device = inputs[0].device
    if not configs.direct_launches_possible():
        return call(), None, "direct launches are off"
    mode = _Recording()
    with _RECORDERS:
        configs._RECORDING_ON += 1
    _local.recording = mode
    try:
        with mode:
            result = call()
    finally:
        _local.recording = None
        with _RECORDERS:
            configs._RECORDING_ON -= 1
    if mode.refusal is not None:
        return result, None, mode.refusal
    if not mode.launches:
        return result, None, "nothing launched"
    if len(mode.streams) != 1:
        return result, None, "launches on several devices or streams"
    (driver_device, stream), = mode.streams
    if stream != configs.launch_driver().get_current_stream(driver_device):
        return result, None, "launches on a stream other than the current one"
    index_of = {id(t): i for i, t in enumerate(inputs)}
    allocations = []
    for t in mode.allocated:
        if id(t) not in index_of:
            index_of[id(t)] = len(inputs) + len(allocations)
            allocations.append((tuple(t.shape), tuple(t.stride()), t.dtype, t.is_contiguous()))
    for alias, t in mode.aliases:
        index_of[id(alias)] = index_of[id(t)]
    # Each allocation and input must stay alive while the ids above are compared: mode.allocated and
    # inputs hold them.
    outputs = []
    for t in result:
        if id(t) not in index_of:
            return result, None, "a result that is neither an input nor an allocation"
        outputs.append(index_of[id(t)])
    launches = []
    for compiled, size, args in mode.launches:
        template, slots = list(args), []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                if id(arg) in index_of:
                    slots.append((position, index_of[id(arg)], None))
                    template[position] = None
                elif id(arg) not in placeholders:
                    return result, None, "a tensor argument made outside the recorded call"
            elif isinstance(arg, TensorDescriptor):
                if id(arg.base) not in index_of:
                    return result, None, "a descriptor over a tensor made outside the recorded call"
                fields = {"shape": list(arg.shape), "strides": list(arg.strides),
                          "block_shape": list(arg.block_shape), "padding": arg.padding}
                slots.append((position, index_of[id(arg.base)], fields))
                template[position] = None
        grid = (size[0], size[1] if len(size) > 1 else 1, size[2] if len(size) > 2 else 1)
        launches.append(_Launch(compiled.run, compiled.function, compiled.packed_metadata, grid, tuple(template),
                                tuple(slots)))
    return result, Plan(len(inputs), tuple(allocations), tuple(outputs), tuple(launches), device,
                        driver_device, configs.launch_knobs()), None
