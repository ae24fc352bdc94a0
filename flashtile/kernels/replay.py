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
  was current when the call began, or on its ``configs.side_stream`` in one run forked from it and
  joined back (the large backward's dQ pass: replayed with the same fork and join, from that stream);
* the only PyTorch operations were allocations (``torch.empty`` and kin, seen by a dispatch mode), so
  nothing was computed outside the recorded kernels;
* every tensor argument is an input of the call, a tensor it allocated (allocated afresh in each
  replay: the outputs and scratch buffers; where every launch is raw, the buffers that no caller sees
  and the launches' global scratch are slices of one allocation, the plan's arena), or one of the
  kernels' cached placeholders; every TMA descriptor is over an input or an allocation.

The caller keys plans by everything the ordinary path's decisions read: shapes, strides, dtypes, device,
options, the settings' environment variables, and 16-byte alignment of the inputs (Triton specializes
pointers on it; the callers replay only aligned inputs). A replay refuses (returns None) where Triton's
own path would behave differently: a launch hook registered (a profiler), or a changed debug knob.
"""

from __future__ import annotations

import dataclasses
import math
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

    flashtile_recording = True  # the recorded call is plain eager all the same (_ops._plain_eager)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch wraps a mode's __torch_dispatch__ in torch._disable_dynamo, whose first call imports
        # torch._dynamo (892 modules with torch 2.13; 1.8-2.9 s on the H200 machine), paid by a process's first
        # recorded call, the second call of a shape. Recording happens in eager calls only, never under
        # torch.compile, so there is nothing for Dynamo to skip.
        return False

    def __init__(self):
        super().__init__()
        self.streams: set[tuple[int, int]] = set()  # (device, stream) of the launches
        self.launches: list[tuple] = []
        self.allocated: list[torch.Tensor] = []
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (view, the tensor it was made from)
        self.refusal: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.append(result)
        elif (func.is_view and isinstance(result, torch.Tensor) and isinstance(args[0], torch.Tensor)
              and result.dtype == args[0].dtype
              and result.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()):
            # A view (view, reshape without a copy, unsqueeze, permute, detach, ...): the same memory in
            # another layout, remade from its root in each replay. An op that may alias but here copied
            # (contiguous, reshape or to of a strided tensor, seen whole below autograd, as inside a custom
            # op) is a computation: refused below.
            self.views.append((result, args[0]))
        elif self.refusal is None:
            self.refusal = f"PyTorch computes outside the kernels ({func})"
        return result


_new_descriptor = object.__new__
_GLUON_DESCRIPTOR: list = []


def _gluon_descriptor() -> type | None:
    """Gluon's host descriptor class (another class than ``TensorDescriptor``, with a shared-memory layout),
    None where this Triton has no Gluon."""
    if not _GLUON_DESCRIPTOR:
        try:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as gluon_descriptor
        except ImportError:
            gluon_descriptor = None
        _GLUON_DESCRIPTOR.append(gluon_descriptor)
    return _GLUON_DESCRIPTOR[0]
_local = threading.local()
_RECORDERS = threading.Lock()


def note_launch(fn, compiled, size: tuple, device: int, stream: int, args: tuple) -> None:
    """Called by ``configs._DirectLaunch`` after each launch: kept if this thread is recording."""
    recording = getattr(_local, "recording", None)
    if recording is not None:
        if fn.pre_run_hooks and not all(getattr(h, "replayable", False) for h in fn.pre_run_hooks):
            recording.refusal = recording.refusal or "a launch with pre-run hooks"
        recording.launches.append((compiled, size, args, stream))
        recording.streams.add((device, stream))


def note_indirect(reason: str) -> None:
    """Called by ``configs`` when a launch takes Triton's own path (first call, tuning, hooks)."""
    recording = getattr(_local, "recording", None)
    if recording is not None and recording.refusal is None:
        recording.refusal = reason


@dataclass(frozen=True)
class _Launch:
    """One recorded launch, through the compiled kernel's launcher as ``configs._DirectLaunch`` makes it."""

    run: object  # the compiled kernel's launcher
    function: int
    packed_metadata: object
    grid: tuple[int, int, int]
    template: tuple  # bound arguments, the slots' entries None
    slots: tuple  # (argument position, tensor index, descriptor fields or None)
    compiled: object  # the compiled kernel

    def __call__(self, tensors: list, stream: int, arena: int | None = None) -> None:
        args = list(self.template)
        for position, index, descriptor in self.slots:
            if descriptor is None:
                args[position] = tensors[index]
            else:  # the recorded descriptor over this call's tensor (its checks passed when recorded)
                made = _new_descriptor(TensorDescriptor if "layout" not in descriptor else _gluon_descriptor())
                made.__dict__.update(descriptor)
                made.base = tensors[index]
                args[position] = made
        grid_x, grid_y, grid_z = self.grid
        self.run(grid_x, grid_y, grid_z, stream, self.function, self.packed_metadata, None, None, None, *args)


@dataclass(frozen=True)
class _RawLaunch:
    """One recorded launch straight into Triton 3.6's C launcher, its arguments laid out as the launcher's
    Python side lays them out (``CudaLauncher.__call__`` and ``wrap_handle_tensordesc``): pointers as
    integers (the C side then neither calls ``data_ptr`` nor asks the driver about each pointer, checks
    the recording's launch passed), placeholders' addresses fixed, descriptors' shapes and strides
    expanded once; per call only the pointers and the TMA descriptors of this call's tensors are filled in.
    """

    launch: object  # the compiled module's launch function
    template: tuple  # its whole argument tuple, per-call entries None
    pointers: tuple  # (position, root tensor index, byte offset)
    descriptors: tuple  # (position, root tensor index, byte offset, fill arguments after the address)
    scratch: tuple | None  # (bytes, alignment) of the global scratch, None without
    scratch_offset: int | None = None  # where the scratch lies in the plan's arena, None: allocated apart
    # Per descriptor slot: the descriptors filled so far, by address. A descriptor is a function of its address and
    # the slot's fixed fill arguments alone, and the launcher copies it into the kernel's parameters, so a launch
    # over an address seen before (a fixed cache that dense calls attend; the buffers that the caching allocator
    # hands a model's layers again step after step) passes the one filled then instead of encoding it again.
    filled: list = dataclasses.field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.filled.extend({} for _ in self.descriptors)

    def __call__(self, tensors: list, stream: int, arena: int | None = None) -> None:
        """``arena``: the address of the plan's arena (``Plan.arena_bytes``), None where it has none."""
        args = list(self.template)
        args[3] = stream
        for position, index, offset in self.pointers:
            args[position] = tensors[index].data_ptr() + offset
        for (position, index, offset, fill), by_address in zip(self.descriptors, self.filled):
            address = tensors[index].data_ptr() + offset
            descriptor = by_address.get(address)
            args[position] = descriptor if descriptor is not None else _describe(by_address, address, fill)
        if self.scratch is not None:
            args[7] = (arena + self.scratch_offset if self.scratch_offset is not None and arena is not None
                       else configs._tma_allocator(*self.scratch, stream))
        self.launch(*args)


def _describe(by_address: dict, address: int, fill: tuple):
    """A new TMA descriptor over ``address``, kept in its slot's ``by_address`` unless that is full (then the
    ones kept stay, and this one is not kept)."""
    descriptor = _fill_tma_descriptor(address, *fill)
    if len(by_address) < _DESCRIPTORS_KEPT:
        by_address[address] = descriptor
    return descriptor


class _Address(int):
    """A buffer inside a plan's arena, as far as a raw launch reads it (``data_ptr``)."""

    __slots__ = ()

    def data_ptr(self) -> int:
        return int(self)


_ARENA_ALIGNMENT = 512  # as PyTorch's caching allocator aligns blocks (Triton specializes pointers on 16 B)


def _arena_layout(launches: list, allocated: list, first_index: int, kept_apart: set[int],
                  unused: set[int] = frozenset()) -> tuple:
    """(arena bytes, each allocation's byte offset in the arena or None, the launches with their scratch
    placed there) for a plan of raw launches only: its buffers that the caller never sees (neither a
    result nor the root of a view remade as a tensor; nor ``unused``, never made) and the launches' global
    scratch become slices of one allocation. An allocation costs 3-6 µs of host time on the H200
    machines, a slice nothing. Plans with fewer than two such buffers keep their allocations: (0, all
    None, the launches)."""
    nothing = 0, (None,) * len(allocated), launches
    if not all(isinstance(launch, _RawLaunch) for launch in launches) or any(
            launch.scratch is not None and launch.scratch[1] > _ARENA_ALIGNMENT for launch in launches):
        return nothing  # (the arena's own address is only as aligned as the allocator's blocks)
    offsets, placed, size = [], [], 0

    def place(nbytes: int) -> int:
        nonlocal size
        start = -(-size // _ARENA_ALIGNMENT) * _ARENA_ALIGNMENT
        size = start + nbytes
        return start

    for position, t in enumerate(allocated):
        apart = first_index + position in kept_apart or first_index + position in unused
        offsets.append(None if apart else place(t.untyped_storage().nbytes()))
    for launch in launches:
        if launch.scratch is not None:
            launch = dataclasses.replace(launch, scratch_offset=place(launch.scratch[0]))
        placed.append(launch)
    if sum(o is not None for o in offsets) + sum(launch.scratch is not None for launch in launches) < 2:
        return nothing
    return size, tuple(offsets), placed


_fill_tma_descriptor = None  # Triton's (the CUDA driver's) descriptor encoder, once a raw launch is made
_DESCRIPTORS_KEPT = 256  # filled descriptors kept per launch slot (a few hundred bytes each)
_PLAIN_ARGUMENTS = frozenset((int, float, bool, type(None), str))  # launch arguments that hold no tensor


_LAUNCHERS: dict = {}  # launcher -> _launcher_parts(launcher): each looked into once (kept: one per compiled kernel)


def _launcher_parts(launcher) -> tuple | None:
    """(the compiled module's launch function, the argument positions of TMA descriptors, their metadata,
    Triton's element-type map) of one of Triton 3.6's CUDA launchers, or None where its launches cannot be
    raw (a profiling scratch, clusters, or another Triton's launcher)."""
    try:
        from triton.backends.nvidia import driver as nvidia

        launch = launcher.launch
        indices, metas = set(), []
        if getattr(launch, "__name__", "") == "inner":  # wrap_handle_tensordesc's wrapper around the module's
            cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__)))
            launch, indices, metas = cells["launcher"], cells["tensordesc_indices"], list(cells["tensordesc_meta"])
        if launcher.profile_scratch_size > 0 or launcher.num_ctas != 1:
            return None
        return launch, indices, tuple(metas), nvidia.TMA_DTYPE_DEVICE_TO_HOST
    except (ImportError, AttributeError, KeyError, TypeError):
        return None


def _raw_launch(compiled, grid: tuple, template: list, slots: list, root_of: dict | None = None) -> _RawLaunch | None:
    """The raw form of a launch (``_Launch``'s fields), where the launcher is Triton 3.6's own CUDA one.
    ``root_of``: tensor index of a view -> (root tensor index, byte offset)."""
    global _fill_tma_descriptor
    launcher = compiled.run
    if type(launcher).__name__ != "CudaLauncher":  # (record checked that direct launches are possible)
        return None
    if launcher not in _LAUNCHERS:  # (launchers hash by identity)
        _LAUNCHERS[launcher] = _launcher_parts(launcher)
    parts = _LAUNCHERS[launcher]
    if parts is None:
        return None
    launch, indices, metas, device_dtype = parts
    try:  # the active driver's, as each replay's descriptors must be filled by it
        _fill_tma_descriptor = configs.launch_driver().utils.fill_tma_descriptor
    except AttributeError:
        return None
    root_of = root_of or {}
    by_position = {position: (index, descriptor) for position, index, descriptor in slots}
    grid_size = grid[0] * grid[1] * grid[2]
    scratch = ((grid_size * launcher.global_scratch_size, launcher.global_scratch_align)
               if launcher.global_scratch_size > 0 else None)
    args = [grid[0], grid[1], grid[2], None, compiled.function, launcher.launch_cooperative_grid,
            launcher.launch_pdl, None, None, compiled.packed_metadata, None, None, None]
    pointers, descriptors = [], []
    meta_of = iter(metas)
    for position, arg in enumerate(template):
        slot = by_position.get(position)
        if position in indices:
            if slot is None or slot[1] is None:
                return None  # (a descriptor is always a slot)
            index, fields = slot
            index, offset = root_of.get(index, (index, 0))
            meta = next(meta_of)
            shape, strides = list(fields["shape"]), list(fields["strides"])
            if meta is None:  # lowered to a pointer with shape and strides, given twice
                pointers.append((len(args), index, offset))
                args += [None, *shape, *strides, fields["padding"] == "nan", *shape, *strides]
                continue
            if meta["fp4_padded"]:
                shape[-1] *= 2
            fill = (meta["swizzle"], meta["elem_size"], device_dtype[meta["elem_type"]], meta["block_size"], shape,
                    strides, 1 if fields["padding"] == "nan" else 0)
            descriptors.append((len(args), index, offset, fill))
            args += [None, *shape, *strides]
        elif slot is not None:
            if slot[1] is not None:
                return None
            pointers.append((len(args), *root_of.get(slot[0], (slot[0], 0))))
            args.append(None)
        elif isinstance(arg, torch.Tensor):  # a placeholder, kept for good
            args.append(arg.data_ptr())
        else:
            args.append(arg)
    return _RawLaunch(launch, tuple(args), tuple(pointers), tuple(descriptors), scratch)


@dataclass(frozen=True)
class Plan:
    """Launches of one recorded call. Tensor index i < len(inputs) is input i, then the allocations."""

    num_inputs: int
    allocations: tuple  # (shape, stride, dtype, contiguous)
    views: tuple  # (root tensor index, shape, stride, storage offset from the root's), tensor indices after
    remade: tuple  # the views made as tensors in each replay (by their position in ``views``)
    outputs: tuple  # tensor indices of the call's results
    launches: tuple  # _Launch or _RawLaunch
    device: torch.device  # where the allocations go
    driver_device: int  # the device current in Triton's driver when recorded (its compiled kernels)
    knobs: tuple  # configs.launch_knobs() when recorded
    kept: tuple  # cached tensors the launches read (placeholders): alive as long as the plan
    arena_bytes: int = 0  # one allocation holding the buffers and scratch that only the launches see
    in_arena: tuple = ()  # per allocation: its byte offset in the arena, or None (allocated apart); one each
    # A call that forked launches onto configs.side_stream (the backward's dQ pass): the recording's current
    # stream and that side stream (torch.cuda.Stream), and which launches went to the side; else None, ().
    main: object = None
    side: object = None
    on_side: tuple = ()
    # Per allocation: True where the replay makes none for it (nothing reads it, or a view of it is allocated
    # directly in its place: ``direct``); one each
    unused: tuple = ()
    # Per remade view (as ``remade``): True where the view is allocated itself, in its own strides, and stands in
    # for its root (``_direct_views``); () where none is. An allocation and a view cost two calls, this one.
    direct: tuple = ()

    # Per allocation, then the arena: an empty tensor of its dtype on the device, whose ``new_empty_strided`` makes
    # the allocation (0.6 µs of host time less than ``torch.empty(shape, dtype=, device=)``, which parses its keywords)
    templates: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)
    # ``tensors`` and the raw launches written out as one function (``_written_out``), None where not all
    # launches are raw: (inputs, stream) -> the results, or None where a launch raised
    written_out: object = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        # ``direct`` pairs with ``remade`` by position: a plan copied with another ``remade`` must not keep it
        if self.direct and len(self.direct) != len(self.remade):
            raise ValueError(f"Plan.direct has {len(self.direct)} entries for {len(self.remade)} remade views")
        dtypes = [dtype for _, _, dtype, _ in self.allocations] + [torch.uint8]
        templates = tuple(torch.empty(0, dtype=dtype, device=self.device) for dtype in dtypes)
        object.__setattr__(self, "templates", templates)
        object.__setattr__(self, "written_out", _written_out(self))

    def tensors(self, inputs: tuple, remade: tuple | None = None) -> list:
        """The call's tensors by index: the inputs, fresh allocations, then the views (those in ``remade``,
        default the plan's own, made as tensors; the others None). With the plan's own ``remade`` and an
        arena, the allocations inside it are ``_Address``es and the arena tensor comes last; unused
        allocations are None; a view allocated directly (``direct``) is its root's tensor too (``remade``
        given: every allocation is made, every view as a view)."""
        tensors = list(inputs)
        arena = None
        if self.arena_bytes and remade is None:
            arena = self.templates[-1].new_empty((self.arena_bytes,))
            base = arena.data_ptr()
        for (shape, stride, _, _), offset, unused, template in zip(self.allocations, self.in_arena, self.unused,
                                                                   self.templates):
            if offset is not None and arena is not None:
                tensors.append(_Address(base + offset))
            elif unused and remade is None:
                tensors.append(None)  # never made, or (direct) made with its view below
            else:
                tensors.append(template.new_empty_strided(shape, stride))
        if self.views:
            first = len(tensors)
            tensors += [None] * len(self.views)
            direct = self.direct if remade is None else ()
            for i, j in enumerate(self.remade if remade is None else remade):
                root, shape, stride, offset = self.views[j]
                if direct and direct[i]:
                    template = self.templates[root - self.num_inputs]
                    tensors[first + j] = tensors[root] = template.new_empty_strided(shape, stride)
                else:
                    base = tensors[root]
                    tensors[first + j] = base.as_strided(shape, stride, base.storage_offset() + offset)
        if arena is not None:
            tensors.append(arena)  # alive until the launches are enqueued (then freed in stream order)
        return tensors

    def run(self, inputs: tuple) -> tuple | None:
        """The recorded call's results for new inputs (same key), or None where Triton's own path must
        run instead (a launch hook or debug knob set since)."""
        driver = configs.launch_driver()
        if (configs._DIRECT_BROKEN or not configs.plain_launches(self.knobs)
                or driver.get_current_device() != self.driver_device):
            return None
        stream = driver.get_current_stream(self.driver_device)
        if self.side is not None and (stream != self.main.cuda_stream or torch.cuda.is_current_stream_capturing()):
            return None  # a forked call replays only from the stream it was recorded on, and not into a graph
        if self.written_out is not None:
            return self.written_out(inputs, stream)
        tensors = self.tensors(inputs)
        arena = tensors[-1].data_ptr() if self.arena_bytes else None
        try:
            if self.side is None:
                for launch in self.launches:
                    launch(tensors, stream, arena)
            else:
                self._run_forked(tensors, stream, arena)
        except Exception as exc:
            # As for a refused direct launch (configs._DirectLaunch): direct launches and plans stop for
            # the process, and the caller repeats the call on the ordinary path into fresh buffers.
            configs.stop_direct_launches(exc)
            return None
        return tuple(tensors[i] for i in self.outputs)

    def _run_forked(self, tensors: list, stream: int, arena: int | None) -> None:
        """The launches in their recorded order, the side stream's after it waits for all that the current
        stream has queued before the first of them, and the current stream waiting for the side stream at
        the end (even if a launch raises: the buffers must not return to the allocator while the side
        stream may still use them), as the ordinary path forks and joins."""
        side, forked = self.side, False
        try:
            for launch, on_side in zip(self.launches, self.on_side):
                if on_side and not forked:
                    side.wait_stream(self.main)
                    forked = True
                launch(tensors, side.cuda_stream if on_side else stream, arena)
        finally:
            if forked:
                self.main.wait_stream(side)


def _written_out(plan: Plan):
    """``plan.run``'s work past its checks (``tensors`` with the plan's own views, then each raw launch, forked
    as ``_run_forked`` forks) written out as one function of (inputs, stream), or None for a plan with a
    launch through Triton's own path (``_Launch``), or whose launches or results read a buffer that
    ``tensors`` leaves unmade.

    The loops over a plan's slots (its allocations, 8-10 pointers a launch, descriptors) cost Python more
    than the steps they take: written out, a replayed forward+backward took 64.8 µs of host time against
    72.9 on the CI machine (the forward 16.4 against 18.5), each tensor's address read once. Most of it is
    saved in the backward, which runs on autograd's device thread, whose core finds little of the
    interpreter's state in its caches.
    """
    if not plan.launches or not all(isinstance(launch, _RawLaunch) for launch in plan.launches) or (
            plan.side is not None and len(plan.on_side) != len(plan.launches)) or plan.num_inputs < 1:
        return None
    n = plan.num_inputs
    consts: dict = {"_describe": _describe, "_configs": configs}
    lines = ["def replay(inputs, stream):", f"    {''.join(f't{i}, ' for i in range(n))}= inputs"]
    made = set(range(n))  # tensor indices held as tensors
    addressed: dict[int, str] = {}  # tensor index -> the expression of its address, where it is one alone
    arena = plan.arena_bytes > 0
    if arena:
        consts["arena_template"] = plan.templates[-1]
        lines += [f"    arena = arena_template.new_empty(({plan.arena_bytes},))", "    base = arena.data_ptr()"]
    unused = plan.unused or (False,) * len(plan.allocations)
    for a, ((shape, stride, _, _), offset, never) in enumerate(zip(plan.allocations, plan.in_arena, unused)):
        i = n + a
        if offset is not None and arena:
            addressed[i] = f"base + {offset}" if offset else "base"
        elif not never:
            consts[f"template{a}"], consts[f"shape{i}"], consts[f"stride{i}"] = plan.templates[a], shape, stride
            lines.append(f"    t{i} = template{a}.new_empty_strided(shape{i}, stride{i})")
            made.add(i)
    first_view = n + len(plan.allocations)
    for position, j in enumerate(plan.remade):
        root, shape, stride, offset = plan.views[j]
        i = first_view + j
        consts[f"shape{i}"], consts[f"stride{i}"] = shape, stride
        if plan.direct and plan.direct[position]:
            if root < n:
                return None
            consts[f"template{root - n}"] = plan.templates[root - n]
            lines.append(f"    t{i} = t{root} = template{root - n}.new_empty_strided(shape{i}, stride{i})")
            made.add(root)
        elif root in made:
            lines.append(f"    t{i} = t{root}.as_strided(shape{i}, stride{i}, t{root}.storage_offset() + {offset})")
        else:
            return None
        made.add(i)
    if not set(plan.outputs) <= made:
        return None
    read = {index for launch in plan.launches for _, index, *_ in (*launch.pointers, *launch.descriptors)}
    body = []  # inside the try, as the loop reads the addresses in its launches
    for i in sorted(read):
        if i in made:
            body.append(f"p{i} = t{i}.data_ptr()")
            addressed[i] = f"p{i}"
        elif i not in addressed:
            return None
    on_side = plan.on_side if plan.side is not None else (False,) * len(plan.launches)
    fork = on_side.index(True) if any(on_side) else None
    for number, (launch, side) in enumerate(zip(plan.launches, on_side)):
        if number == fork:
            consts["main"], consts["side"] = plan.main, plan.side
            body += ["side.wait_stream(main)", "side_stream = side.cuda_stream", "try:"]
        pad = "    " if fork is not None and number >= fork else ""
        consts[f"args{number}"], consts[f"launch{number}"] = launch.template, launch.launch
        on = "side_stream" if side else "stream"
        body += [f"{pad}args = list(args{number})", f"{pad}args[3] = {on}"]
        for position, index, offset in launch.pointers:
            body.append(f"{pad}args[{position}] = {addressed[index]}" + (f" + {offset}" if offset else ""))
        for slot, ((position, index, offset, fill), by_address) in enumerate(zip(launch.descriptors, launch.filled)):
            consts[f"filled{number}_{slot}"], consts[f"fill{number}_{slot}"] = by_address, fill
            body += [f"{pad}address = {addressed[index]}" + (f" + {offset}" if offset else ""),
                     f"{pad}descriptor = filled{number}_{slot}.get(address)",
                     f"{pad}args[{position}] = (descriptor if descriptor is not None",
                     f"{pad}                else _describe(filled{number}_{slot}, address, fill{number}_{slot}))"]
        if launch.scratch is not None:
            if launch.scratch_offset is not None and arena:
                body.append(f"{pad}args[7] = base + {launch.scratch_offset}")
            else:
                consts[f"scratch{number}"] = launch.scratch
                body.append(f"{pad}args[7] = _configs._tma_allocator(*scratch{number}, {on})")
        body.append(f"{pad}launch{number}(*args)")
    if fork is not None:
        body += ["finally:", "    main.wait_stream(side)"]
    # As ``run``: a launch that raises stops direct launches for the process, and the caller takes the ordinary path.
    lines += ["    try:", *(f"        {line}" for line in body), "    except Exception as exc:",
              "        _configs.stop_direct_launches(exc)", "        return None",
              f"    return ({''.join(f't{i}, ' for i in plan.outputs)})"]
    # (the source is built above from the plan's integers and generated names; tracebacks name it)
    exec(compile("\n".join(lines), "<flashtile launch plan, replay._written_out>", "exec"), consts)
    return consts["replay"]


def record(call, inputs: tuple, placeholders: set[int]):
    """Run ``call()`` (which returns a tuple of tensors made from ``inputs``) and record its launches.

    ``placeholders``: ids of the cached tensors the kernels may take as arguments (kept by the plan).
    Returns (call's result, Plan or None, reason when None).
    """
    device = inputs[0].device
    if not configs.direct_launches_possible():
        return call(), None, "direct launches are off"
    if len({id(t) for t in inputs}) != len(inputs):
        # One tensor in two roles (q is k, dout is out): its slots could not tell the roles apart.
        return call(), None, "a tensor given as two inputs"
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
    if len({d for d, _ in mode.streams}) != 1:
        return result, None, "launches on several devices"
    driver_device = next(iter(mode.streams))[0]
    current = configs.launch_driver().get_current_stream(driver_device)
    streams = {s for _, s in mode.streams}
    main = side = None
    if streams != {current}:
        # The one fork flashtile makes: launches on configs.side_stream of the current stream (the backward's
        # dQ pass beside dK/dV), joined back before the call returned.
        side = configs._SIDE_STREAMS.get((driver_device, current))
        if side is None or streams != {current, side.cuda_stream}:
            return result, None, "launches on a stream other than the current one and its side stream"
        main = torch.cuda.current_stream(driver_device)
    # Tensor indices: the inputs, the allocations (the roots), then the views, each a root's memory at a
    # byte offset in a layout of its own.
    index_of = {id(t): i for i, t in enumerate(inputs)}
    roots = list(inputs)
    allocations = []
    for t in mode.allocated:
        if id(t) not in index_of:
            index_of[id(t)] = len(roots)
            roots.append(t)
            allocations.append((tuple(t.shape), tuple(t.stride()), t.dtype, t.is_contiguous()))
    views, root_of = [], {}  # root_of: tensor index -> (root index, byte offset)
    for view, base in mode.views:
        if id(base) not in index_of or id(view) in index_of:
            continue  # a view of something else: refused below if a launch or the result uses it
        base_index = index_of[id(base)]
        if base_index < len(roots) and (view.shape, view.stride(), view.data_ptr()) == (
                base.shape, base.stride(), base.data_ptr()):
            index_of[id(view)] = base_index  # the root itself (a detach): no view to remake
            continue
        root = root_of[base_index][0] if base_index in root_of else base_index
        index_of[id(view)] = len(roots) + len(views)
        root_of[index_of[id(view)]] = (root, view.data_ptr() - roots[root].data_ptr())
        views.append((root, tuple(view.shape), tuple(view.stride()),
                      (view.data_ptr() - roots[root].data_ptr()) // view.element_size()))
    # Each tensor must stay alive while the ids above are compared: inputs, mode.allocated and
    # mode.views hold them.
    outputs = []
    for t in result:
        if id(t) not in index_of:
            return result, None, "a result that is neither an input nor an allocation"
        outputs.append(index_of[id(t)])
    launches, kept = [], []
    gluon_descriptor = _gluon_descriptor()
    for compiled, size, args, _ in mode.launches:
        template, slots = list(args), []
        for position, arg in enumerate(args):
            if arg.__class__ in _PLAIN_ARGUMENTS:  # most of a launch's 50-70 arguments: nothing to look at
                continue
            if isinstance(arg, torch.Tensor):
                if id(arg) in index_of:
                    slots.append((position, index_of[id(arg)], None))
                    template[position] = None
                elif id(arg) in placeholders:
                    kept.append(arg)
                else:
                    return result, None, "a tensor argument made outside the recorded call"
            elif isinstance(arg, TensorDescriptor) or type(arg) is gluon_descriptor:
                if id(arg.base) not in index_of:
                    return result, None, "a descriptor over a tensor made outside the recorded call"
                fields = {"shape": list(arg.shape), "strides": list(arg.strides),
                          "block_shape": list(arg.block_shape), "padding": arg.padding}
                if not isinstance(arg, TensorDescriptor):
                    fields["layout"] = arg.layout  # a Gluon descriptor: remade as one (_Launch)
                slots.append((position, index_of[id(arg.base)], fields))
                template[position] = None
            elif isinstance(getattr(arg, "base", None), torch.Tensor):
                # Another kind of descriptor over a tensor: kept as a constant it would be replayed over the
                # recorded call's tensor.
                return result, None, f"an argument of type {type(arg).__name__} over a tensor"
        grid = (size[0], size[1] if len(size) > 1 else 1, size[2] if len(size) > 2 else 1)
        raw = _raw_launch(compiled, grid, template, slots, root_of)
        launches.append(raw or _Launch(compiled.run, compiled.function, compiled.packed_metadata, grid,
                                       tuple(template), tuple(slots), compiled))
    # Views remade in each replay: those a launch through Triton's launcher or the result takes (a raw
    # launch takes their root's address plus the offset).
    needed = set(outputs) | {index for launch in launches if isinstance(launch, _Launch)
                             for _, index, _ in launch.slots}
    remade = tuple(j for j in range(len(views)) if len(roots) + j in needed)
    kept_apart = set(outputs) | {views[j][0] for j in remade}

    def root(index: int) -> int:
        return root_of[index][0] if index in root_of else index

    # Allocations that no launch, result or remade view reads: the scratch Triton's launcher allocated for
    # the recorded launch (a replay's launch places its own), buffers a call made and dropped.
    read = kept_apart | {root(index) for launch in launches for index in (
        [index for _, index, _ in launch.slots] if isinstance(launch, _Launch)
        else [index for _, index, _ in launch.pointers] + [index for _, index, _, _ in launch.descriptors])}
    unused = {i for i in range(len(inputs), len(roots)) if i not in read}
    arena_bytes, in_arena, launches = _arena_layout(launches, roots[len(inputs):], len(inputs), kept_apart, unused)
    on_side = ()
    if side is not None:
        on_side = tuple(stream != current for *_, stream in mode.launches)
        first = on_side.index(True)
        last = len(on_side) - 1 - on_side[::-1].index(True)
        if not all(on_side[first:last + 1]):
            return result, None, "launches forked to the side stream more than once"
        if any(on_side[i] and (not isinstance(launch, _RawLaunch) or (launch.scratch is not None
                                                                       and launch.scratch_offset is None))
               for i, launch in enumerate(launches)):
            # Its scratch would come from the current stream's pool, free again while the side stream runs.
            return result, None, "a side-stream launch with scratch outside the arena"
        if torch.cuda.is_current_stream_capturing():
            return result, None, "a fork recorded while a CUDA graph captures"
    direct = _direct_views(views, remade, allocations, len(inputs), outputs, launches)
    unused |= {views[j][0] for j, made in zip(remade, direct) if made}
    return result, Plan(len(inputs), tuple(allocations), tuple(views), remade, tuple(outputs), tuple(launches),
                        device, driver_device, configs.launch_knobs(), tuple(kept), arena_bytes, in_arena, main, side,
                        on_side, tuple(i in unused for i in range(len(inputs), len(roots))),
                        direct if any(direct) else ()), None


def _direct_views(views: tuple, remade: tuple, allocations: list, first_index: int, outputs: list,
                  launches: list) -> tuple:
    """Per remade view (as ``remade``): whether a replay may allocate the view itself, in its own strides (and its
    root's dtype), and use it as its root too. So where the view starts at its root's start and its extent
    (``empty_strided``'s storage) equals the contiguous root allocation's, the root is no result and no other
    remade view's, and every launch is raw (reading the root only through ``data_ptr``): a decoding step's output,
    allocated flat and returned as a (batch, 1, heads, headdim) view. (Recorded views keep their root's dtype.)
    The replayed result is then a tensor of its own, not a view: under an autograd Function an in-place change
    of a view made in it raises, of a tensor it does not; the plans replayed under one return allocations."""
    if not all(isinstance(launch, _RawLaunch) for launch in launches):
        return (False,) * len(remade)
    roots = [views[j][0] for j in remade]
    direct = []
    for j, root in zip(remade, roots):
        _, shape, stride, offset = views[j]
        ok = root >= first_index and offset == 0 and root not in outputs and roots.count(root) == 1
        if ok:
            alloc_shape, _, _, contiguous = allocations[root - first_index]
            numel = math.prod(alloc_shape)
            ok = (contiguous and numel > 0 and all(size > 0 for size in shape)
                  and 1 + sum((size - 1) * st for size, st in zip(shape, stride)) == numel)
        direct.append(ok)
    return tuple(direct)
