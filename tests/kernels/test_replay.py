"""Launch plans (kernels/replay.py): a replayed call hands the driver what the ordinary path hands it.

Runs in a subprocess under benchmarks/lab/stand_in_hopper.py (Triton's real binding, specialization and
sm_90 compilation; the driver call is recorded instead of made), so it needs no GPU. For dense calls of
several variants (GQA, windows, softcap, odd head dims, a model's strided q/k/v views, host-made TMA
descriptors), the forward's and the backward's launches of a replayed call match those of the same call
with FLASHTILE_LAUNCH_PLANS=0: grids, compiled kernels, every argument, and each tensor argument is the
call's own input or a buffer of the call's shape; the same for packed (varlen) calls, the packed
functions and decoding steps, and the raw launches (straight into the compiled module, their hidden buffers
in one arena) hand the module what Triton's own path hands it. Replays stand aside for a registered launch
hook, a changed setting, unaligned inputs, another current device and a launcher that refuses them. The
GPU tests check replayed results against the float64 oracle and bitwise against the ordinary path
(decoding, varlen, the forked backward), and inside CUDA graphs.
"""

import contextlib
import textwrap

import pytest

from tests.utils import REPO, needs_triton_36, run_stand_in_script, skip_unless_gluon_dispatch

REPLAY_PREAMBLE = textwrap.dedent(
    """
    import triton
    from flashtile.kernels import replay
    runs = [0]  # Plan.run calls
    plan_run = replay.Plan.run
    def counted(self, tensors):
        runs[0] += 1
        return plan_run(self, tensors)
    replay.Plan.run = counted

    # Host-made TMA descriptors as on a Hopper GPU with aligned tensors (CPU tensors leave them off).
    configs.use_tma = lambda *tensors, rows: rows >= configs.TMA_MIN_ROWS and all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)
    # Scratch for in-kernel descriptors: Triton's allocator (the launcher's path) and flashtile's own (the
    # raw path) both give CPU buffers here.
    def scratch_allocator(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)
    triton.set_allocator(scratch_allocator)
    configs._tma_allocator = scratch_allocator
    """
)

# The role of each launch argument, to compare two calls' launches: ``normal(args, {name: tensor})``.
ROLES = textwrap.dedent(
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    def role(x, tensors):
        # A tensor argument is one of the call's own tensors (by memory), a view into one (its offset and
        # layout), or a buffer described by its layout.
        for name, t in tensors.items():
            if x.data_ptr() == t.data_ptr() and x.shape == t.shape and x.stride() == t.stride():
                return name
        for name, t in tensors.items():
            if x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                return ("view", name, x.data_ptr() - t.data_ptr(), tuple(x.shape), x.stride())
        return ("buffer", tuple(x.shape), x.stride(), x.dtype)

    def normal(args, tensors):
        out = []
        for x in args:
            if isinstance(x, torch.Tensor):
                out.append(role(x, tensors))
            elif isinstance(x, TensorDescriptor):
                out.append(("descriptor", role(x.base, tensors), list(x.shape), list(x.strides),
                            list(x.block_shape), x.padding))
            else:
                out.append(x)
        return out
    """
)

SCRIPT = ROLES + textwrap.dedent(
    """
    from flashtile import _ops, flash_attn_func
    from flashtile.kernels import replay

    def one_call(q, k, v, dout, kwargs):
        Launcher.records.clear()
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
        base = _ops.packed_base(q, k, v)
        if base is None:
            grads = torch.autograd.grad(out, (q, k, v), dout)
        else:  # slices of a projection's output: autograd holds the projection's, one packed gradient
            grads = torch.autograd.grad(out, base, dout)[0].view(*q.shape[:2], 3, *q.shape[2:]).unbind(2)
        tensors = dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
        # (kernel name, grid and function, normalised arguments) of each launch
        return [(name, args[:2] + (id(args[4]),), normal(args[9:], tensors)) for name, args in Launcher.records]

    def inputs(case):
        batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, strided = case
        torch.manual_seed(seqlen_q * 7 + headdim)
        if strided:  # views of one projection's output, as a model makes them
            proj = torch.randn(batch, seqlen_q, 3 * nheads * headdim, dtype=torch.float16, requires_grad=True)
            q, k, v = proj.view(batch, seqlen_q, 3, nheads, headdim).unbind(2)
        else:
            q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=torch.float16, requires_grad=True)
            k, v = (torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=torch.float16, requires_grad=True)
                    for _ in range(2))
        return q, k, v, torch.randn(q.shape, dtype=q.dtype)

    cases = [
        ((2, 64, 64, 4, 4, 64, False), dict(causal=True)),
        ((2, 48, 80, 4, 2, 40, False), dict(causal=False)),                 # GQA, seqlen_q != seqlen_k, d=40
        ((1, 72, 72, 6, 2, 59, False), dict(causal=True, softcap=5.0)),    # odd head dim, MQA-like groups
        ((2, 64, 96, 4, 1, 128, False), dict(window_size=(16, 8), softmax_scale=0.3)),
        ((2, 64, 64, 4, 4, 64, True), dict(causal=True)),                  # strided views of a projection
    ]
    for case, kwargs in cases:
        q, k, v, dout = inputs(case)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        for _ in range(3):
            ordinary = one_call(q, k, v, dout, kwargs)
        assert not _ops._PLANS[_ops.plan_key(q, k, v, kwargs.get("softmax_scale"), kwargs.get("causal", False),
                                             kwargs.get("window_size", (-1, -1)), kwargs.get("softcap", 0.0))
                               ].forward
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        for _ in range(4):  # compile, make the direct launch, record
            one_call(q, k, v, dout, kwargs)
        key = _ops.plan_key(q, k, v, kwargs.get("softmax_scale"), kwargs.get("causal", False),
                            kwargs.get("window_size", (-1, -1)), kwargs.get("softcap", 0.0))
        entry = _ops._PLANS[key]
        assert entry.forward is not None and len(entry.backward) == 1, (case, entry.tries, entry.backward)
        q2, k2, v2, dout2 = inputs(case)  # new tensors: the plan's slots take them
        runs_before = runs[0]
        planned = one_call(q2, k2, v2, dout2, kwargs)
        assert all(launched_directly(Launcher.records)) and runs[0] == runs_before + 2, case
        # the forward, the dQ and dK/dV passes (dK and dV apart at d > 128); a small backward has no preprocess
        assert len(planned) == len(ordinary) == (3 if case[5] <= 128 else 4), (case, len(planned))
        for a, b in zip(ordinary, planned):
            assert a == b, (case, a[0], [i for i, (x, y) in enumerate(zip(a[2], b[2])) if x != y])
        if case[-1] is False and case[5] == 64:
            assert all(any(isinstance(x, tuple) and x[0] == "descriptor" for x in launch[2])
                       for launch in planned), "no descriptor"

    # Packed variable-length calls whose cu_seqlens were checked and are unwritten since: the launches come
    # from a plan (the argument and value checks still run), forward and backward, self-attention (one
    # cu_seqlens for both) and separate ones; a written cu_seqlens is read and checked again first.
    from flashtile import flash_attn_varlen_func

    def varlen_call(q, k, v, dout, cu_q, cu_k, max_q, max_k, kwargs):
        Launcher.records.clear()
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, **kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        tensors = dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2],
                       cu_q=cu_q, cu_k=cu_k)
        return [(name, args[:2] + (id(args[4]),), normal(args[9:], tensors)) for name, args in Launcher.records]

    for shared, kwargs in ((True, dict(causal=True)), (False, dict(window_size=(24, 8), softcap=4.0))):
        torch.manual_seed(11)
        cu_q = torch.tensor([0, 40, 41, 112], dtype=torch.int32)
        cu_k = cu_q if shared else torch.tensor([0, 17, 80, 96], dtype=torch.int32)
        q = torch.randn(112, 6, 64, dtype=torch.float16, requires_grad=True)
        k, v = (torch.randn(int(cu_k[-1]), 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        max_q, max_k = 71, int((cu_k[1:] - cu_k[:-1]).max())
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        for _ in range(3):
            want = varlen_call(q, k, v, dout, cu_q, cu_k, max_q, max_k, kwargs)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        runs_before = runs[0]
        for _ in range(5):
            got = varlen_call(q, k, v, dout, cu_q, cu_k, max_q, max_k, kwargs)
        assert runs[0] >= runs_before + 4, ("varlen not replayed", shared)
        assert got == want, (shared, [(g[0], [i for i, (x, y) in enumerate(zip(g[2], w[2])) if x != y])
                                      for g, w in zip(got, want)])
        good = int(cu_q[1])
        cu_q[1] = 200  # a write PyTorch sees: its values are read and checked again before any launch
        try:
            varlen_call(q, k, v, dout, cu_q, cu_k, max_q, max_k, kwargs)
        except ValueError as exc:
            assert "cu_seqlens" in str(exc), exc
        else:
            raise AssertionError("a written cu_seqlens was replayed unchecked")
        cu_q[1] = good

    # The packed functions take the same plans (their q, k, v are views of the packed tensor).
    from flashtile import flash_attn_kvpacked_func, flash_attn_qkvpacked_func
    qkv = torch.randn(2, 64, 3, 4, 64, dtype=torch.float16, requires_grad=True)
    kv = torch.randn(2, 64, 2, 4, 64, dtype=torch.float16, requires_grad=True)
    for name, call in (("qkv", lambda: flash_attn_qkvpacked_func(qkv, causal=True)),
                       ("kv", lambda: flash_attn_kvpacked_func(qkv[:, :, 0], kv, causal=True))):
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        Launcher.records.clear()
        call().backward(torch.ones(2, 64, 4, 64, dtype=torch.float16))
        want = [(n, a[:2] + (id(a[4]),), normal(a[9:], dict(qkv=qkv, kv=kv))) for n, a in Launcher.records]
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        runs_before = runs[0]
        for _ in range(5):
            Launcher.records.clear()
            out = call()
            out.backward(torch.ones_like(out))
        got = [(n, a[:2] + (id(a[4]),), normal(a[9:], dict(qkv=qkv, kv=kv))) for n, a in Launcher.records]
        assert runs[0] >= runs_before + 2, name
        assert got == want, (name, [(g[0], [i for i, (x, y) in enumerate(zip(g[2], w[2])) if x != y])
                                    for g, w in zip(got, want)])

    # An expanded dout (out.sum().backward(): every stride 0) is made contiguous first and replays too.
    q, k, v, _ = inputs((2, 64, 64, 4, 4, 64, False))
    for _ in range(5):
        flash_attn_func(q, k, v, causal=True).sum().backward()
    runs_before = runs[0]
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert runs[0] == runs_before + 2, ("expanded dout not replayed", runs[0] - runs_before)
    # ... and autograd makes no zero tensor for lse's gradient (lse is not differentiable; set_materialize_grads).
    from tests.utils import FillsMade

    out = flash_attn_func(q, k, v, causal=True)
    with FillsMade() as made:
        out.sum().backward()
    assert not made.fills, made.fills

    # One tensor passed twice is a key of its own: a plan recorded for flash_attn_func(x, x, x) never serves
    # distinct q, k, v of the same shapes (nor the reverse).
    fresh_key = (1, 80, 80, 2, 2, 64, False)  # a shape no call above used
    x = inputs(fresh_key)[0]
    for _ in range(5):
        flash_attn_func(x, x, x, causal=True)
    q, k, v, dout = inputs(fresh_key)
    for _ in range(5):
        planned = one_call(q, k, v, dout, dict(causal=True))
    assert planned[0][2][:3] == ["q", "k", "v"], planned[0][2][:3]
    for _ in range(2):
        flash_attn_func(x, x, x, causal=True)

    # Keys that differ only in k and v's lengths, call after call (a decoding loop over a cache grown by
    # concatenation, each length called by every layer): from the third length on, a length's first call
    # records its plan, so the step's other layers replay; the replays' launches are the ordinary path's.
    q_step = torch.randn(2, 1, 4, 64, dtype=torch.float16)
    k_all, v_all = (torch.randn(2, 90, 2, 64, dtype=torch.float16) for _ in range(2))
    for length in range(70, 76):
        runs_before = runs[0]
        for layer in range(3):
            Launcher.records.clear()
            flash_attn_func(q_step, k_all[:, :length], v_all[:, :length])
        got = [(n, a[:2] + (id(a[4]),), normal(a[9:], dict(q=q_step))) for n, a in Launcher.records]
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        Launcher.records.clear()
        flash_attn_func(q_step, k_all[:, :length], v_all[:, :length])
        want = [(n, a[:2] + (id(a[4]),), normal(a[9:], dict(q=q_step))) for n, a in Launcher.records]
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        # (the first length compiles and finds its kernels, its last call recorded: the next length's first
        # call records)
        assert runs[0] - runs_before == (0 if length == 70 else 2), (length, runs[0] - runs_before)
        assert [g[:2] for g in got] == [w[:2] for w in want], length
    # Lengths that each come once (cross-attention to sources of every length): noted, never recorded.
    recordings = []
    record_plan = _ops._triton_backend().record
    _ops._triton_backend().record = lambda *a: recordings.append(1) or record_plan(*a)
    q_cross = torch.randn(2, 3, 4, 64, dtype=torch.float16)  # a family of its own
    for length in range(60, 66):
        flash_attn_func(q_cross, k_all[:, :length], v_all[:, :length])
    assert not recordings, len(recordings)
    # ... also after one key of their family was called again (a warm-up): the first one-off length
    # records on its first call, the ones after it (never called again) do not.
    for _ in range(5):
        flash_attn_func(q_cross, k_all[:, :50], v_all[:, :50])
    recordings.clear()
    for length in range(80, 86):
        flash_attn_func(q_cross, k_all[:, :length], v_all[:, :length])
    assert len(recordings) == 1, len(recordings)
    _ops._triton_backend().record = record_plan
    # Packed calls have families of their own, their max lengths left out too: a decoding loop over
    # packed keys (Hugging Face's padded generation), each step's cu_seqlens_k a new tensor. On the CPU its
    # values are checked at once, so the step's first call has its key: from the second length on that call
    # records and the other two replay (without families: noted, recorded, one replay). (On a GPU the
    # first call of a new cu_seqlens tensor takes the ordinary path, reading its values.)
    q_packed = torch.randn(2, 4, 64, dtype=torch.float16)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    for length in range(40, 47):  # (odd totals and no max length of 48: Triton's integer specializations stay)
        runs_before = runs[0]
        cu_k = torch.tensor([0, length - 9, 2 * length - 9], dtype=torch.int32)
        for layer in range(3):
            flash_attn_varlen_func(q_packed, k_all[0, :2 * length - 9], v_all[0, :2 * length - 9], cu_q, cu_k, 1,
                                   length)
        assert runs[0] - runs_before == (0 if length == 40 else 2), (length, runs[0] - runs_before)
    # A full plan cache forgets the families with the keys.
    saved = dict(_ops._PLANS), dict(_ops._FAMILIES)
    limit, _ops._MAX_PLANS = _ops._MAX_PLANS, len(_ops._PLANS)
    flash_attn_func(q_cross, k_all[:, :87], v_all[:, :87])
    assert len(_ops._PLANS) == 1 and list(_ops._FAMILIES.values()) == list(_ops._PLANS)
    _ops._MAX_PLANS = limit
    for kept, now in zip(saved, (_ops._PLANS, _ops._FAMILIES)):  # the plans the checks below use
        now.clear()
        now.update(kept)

    # Arguments that the checks reject stay rejected once a plan of an equal-comparing key exists.
    for _ in range(5):
        flash_attn_func(q, k, v, window_size=(1, -1))
    for bad in ((True, -1), (1.0, -1), ([1], -1)):
        try:
            flash_attn_func(q, k, v, window_size=bad)
        except (TypeError, ValueError) as exc:
            assert "window_size" in str(exc), exc
        else:
            raise AssertionError(f"window_size={bad!r} was accepted")

    # The raw form of a launch (straight into Triton's C launcher, as on a GPU) passes the launcher's module
    # exactly what Triton's CudaLauncher and its descriptor wrapper pass it, for each recorded launch of a
    # call with host-made descriptors (a stand-in module launch and descriptor encoder record both).
    import dataclasses
    import triton

    from flashtile.kernels.stand_in import CudaLauncher
    reached = CudaLauncher.module_records  # (kernel name, module launch arguments)

    def module_launcher(compiled, scratch=None):
        # Triton's CUDA launcher of compiled but for its module, whose launches land in ``reached``.
        launcher = CudaLauncher(compiled.src, compiled.metadata)
        if scratch is not None:
            launcher.global_scratch_size, launcher.global_scratch_align = scratch, 128
        return launcher

    q, k, v, dout = inputs(cases[0][0])
    one_call(q, k, v, dout, cases[0][1])
    entry = _ops._PLANS[_ops.plan_key(q, k, v, None, True, (-1, -1), 0.0)]
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    def raw_matches(plan, plan_inputs):
        # Each launch of the plan, raw and through Triton's CudaLauncher, reaches the module alike; returns
        # how many of them carried a TMA descriptor.
        tensors = plan.tensors(plan_inputs, remade=tuple(range(len(plan.views))))  # every view made
        first_view = len(plan_inputs) + len(plan.allocations)
        root_of = {first_view + j: (root, offset * tensors[root].element_size())
                   for j, (root, _, _, offset) in enumerate(plan.views)}
        with_descriptors = 0
        for launch in plan.launches:
            for scratch in (0, 96):  # bytes of global scratch per program (in-kernel descriptors)
                fake = module_launcher(launch.compiled, scratch)
                through_triton = dataclasses.replace(launch, run=fake)
                raw = replay._raw_launch(dataclasses.replace(launch, run=fake), launch.grid,
                                         list(launch.template), list(launch.slots), root_of)
                assert raw is not None
                reached.clear()
                through_triton(tensors, 7)
                raw(tensors, 7)
                # The scratch buffers are two allocations: compared by their sizes.
                a, b = ([x.numel() if i == 7 and isinstance(x, torch.Tensor) else x for i, x in enumerate(r)]
                        for _, r in reached)
                a = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in a)
                assert a == tuple(b), [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y][:4]
                assert (a[7] is None) == (scratch == 0) and (scratch == 0 or a[7] == scratch * grid_programs(launch))
                with_descriptors += scratch == 0 and any(isinstance(x, tuple) and x[:1] == ("tma",) for x in b)
        return with_descriptors

    def grid_programs(launch):
        return launch.grid[0] * launch.grid[1] * launch.grid[2]

    def arena_matches(plan, plan_inputs):
        # Raw launches with the buffers no caller sees (and 96 bytes of scratch per program) as slices of one
        # arena reach the module as with each buffer allocated apart, but for those buffers' addresses; the
        # slices do not overlap; the results stay tensors of their own. Returns how many buffers moved.
        tensors = plan.tensors(plan_inputs, remade=tuple(range(len(plan.views))))
        first_view = len(plan_inputs) + len(plan.allocations)
        root_of = {first_view + j: (root, offset * tensors[root].element_size())
                   for j, (root, _, _, offset) in enumerate(plan.views)}
        raws = []
        for launch in plan.launches:
            fake = module_launcher(launch.compiled, 96)
            raws.append(replay._raw_launch(dataclasses.replace(launch, run=fake), launch.grid,
                                           list(launch.template), list(launch.slots), root_of))
        # With raw launches only, the views remade are the results' (the stand-in's launches take them all).
        remade = tuple(j for j in range(len(plan.views)) if first_view + j in plan.outputs)
        apart = set(plan.outputs) | {plan.views[j][0] for j in remade}
        size, offsets, placed = replay._arena_layout(raws, tensors[len(plan_inputs):first_view], len(plan_inputs),
                                                     apart)
        assert len(offsets) == len(plan.allocations)
        if size == 0:  # fewer than two buffers and scratches to share one: the plan stays as it is
            assert offsets == (None,) * len(offsets) and placed is raws
            return 0
        reached.clear()
        for raw in raws:
            raw(tensors, 7)
        separate = [args for _, args in reached]
        arena_plan = dataclasses.replace(plan, launches=tuple(placed), arena_bytes=size, in_arena=offsets,
                                         remade=remade)
        arena_tensors = arena_plan.tensors(plan_inputs)
        base = arena_tensors[-1].data_ptr()
        assert arena_tensors[-1].numel() == size
        reached.clear()
        for raw in placed:
            raw(arena_tensors, 7, base)
        spans = []  # (start, end) in the arena: every buffer and scratch placed there
        moved = {}  # a buffer's address in the first run -> in the arena's (where apart: its new allocation)
        for i, offset in enumerate(offsets):
            t, now = tensors[len(plan_inputs) + i], arena_tensors[len(plan_inputs) + i]
            if offset is None:
                assert isinstance(now, torch.Tensor)
            else:
                assert len(plan_inputs) + i not in apart and offset % 512 == 0 and now.data_ptr() == base + offset
                spans.append((offset, offset + t.untyped_storage().nbytes()))
            for byte in range(0, t.untyped_storage().nbytes() + 1, 2):
                moved[t.data_ptr() + byte] = now.data_ptr() + byte
        for launch in placed:
            if launch.scratch is not None:
                spans.append((launch.scratch_offset, launch.scratch_offset + launch.scratch[0]))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= size, spans
        def translated(x):
            if isinstance(x, tuple) and x[:1] == ("tma",):
                return ("tma", moved.get(x[1], x[1]), *x[2:])
            return moved.get(x, x) if isinstance(x, int) and not isinstance(x, bool) else x
        for a, (_, b), launch in zip(separate, reached, placed):
            assert isinstance(a[7], torch.Tensor) and a[7].numel() == launch.scratch[0]
            assert b[7] == base + launch.scratch_offset
            a = tuple(translated(x) for i, x in enumerate(a) if i != 7)
            b = tuple(x for i, x in enumerate(b) if i != 7)
            assert a == b, [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y][:4]
        for index in plan.outputs:
            assert isinstance(arena_plan.tensors(plan_inputs)[index], torch.Tensor)
        return sum(o is not None for o in offsets)

    backward_plan = next(iter(entry.backward.values()))
    checked = raw_matches(entry.forward, (q, k, v)) + raw_matches(backward_plan, (dout, q, k, v, out, lse))
    assert checked >= 2, checked  # the forward's and a backward pass's descriptors were among them
    # The backward's one unseen buffer (delta) and its passes' scratch share an arena; the forward's two
    # buffers are both results and its one scratch has nothing to share with.
    assert arena_matches(backward_plan, (dout, q, k, v, out, lse)) >= 1
    assert arena_matches(entry.forward, (q, k, v)) == 0

    # Decoding steps (flash_attn_with_kvcache on a contiguous cache, cache_seqlens a tensor): the replayed
    # step's launches (append, attention, the splits' merge) match the ordinary path's, views of the caches
    # included, raw launches too; the caches' version counters move alike.
    from flashtile import flash_attn_with_kvcache
    from flashtile import inference

    def decode_call(q, k_cache, v_cache, k_new, v_new, lengths, kwargs):
        Launcher.records.clear()
        versions = k_cache._version, v_cache._version
        result = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        assert out.shape == q.shape
        moved = (k_cache._version - versions[0], v_cache._version - versions[1])
        tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths, out=out)
        tensors.update((name, x) for name, x in kwargs.items() if isinstance(x, torch.Tensor))  # FP8 descales
        if k_new is not None:
            tensors.update(k_new=k_new, v_new=v_new)
        if isinstance(result, tuple):
            tensors["lse"] = result[1]
        launches = [(name, args[:2] + (id(args[4]),), normal(args[9:], tensors))
                    for name, args in Launcher.records]
        return launches, moved, tuple(t.shape for t in (result if isinstance(result, tuple) else (result,)))

    def decode_inputs(batch, cache_len, nheads, nheads_k, headdim, new, heads_first=False):
        torch.manual_seed(cache_len + new)
        k_cache, v_cache = (torch.randn(batch, cache_len, nheads_k, headdim, dtype=torch.float16)
                            for _ in range(2))
        if heads_first:  # a (batch, nheads_k, cache_len, headdim) cache, transposed (another batch stride)
            k_cache, v_cache = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k_cache, v_cache))
        q = torch.randn(batch, max(new, 1), nheads, headdim, dtype=torch.float16)
        k_new, v_new = ((torch.randn(batch, new, nheads_k, headdim, dtype=torch.float16) for _ in range(2))
                        if new else (None, None))
        lengths = torch.arange(batch, dtype=torch.int32) * 7 + 20
        return q, k_cache, v_cache, k_new, v_new, lengths

    def ordinary_then_planned(inputs_, kwargs):
        # Three calls on the ordinary path, then five with plans: (the last ordinary call's launches, the last
        # planned call's, how many of the five replayed).
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        for _ in range(3):
            ordinary = decode_call(*inputs_, kwargs)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        runs_before = runs[0]
        for _ in range(5):
            planned = decode_call(*inputs_, kwargs)
        return ordinary, planned, runs[0] - runs_before

    decode_cases = [
        ((2, 128, 8, 2, 64, 1), dict()),
        ((3, 96, 4, 4, 128, 1), dict(causal=True, num_splits=3)),      # split-KV: partials and their merge
        ((2, 128, 8, 1, 64, 0), dict(return_softmax_lse=True)),       # no new tokens: read only
        ((1, 160, 6, 2, 40, 2), dict(causal=True, window_size=(32, 0), softcap=3.0)),
        ((2, 128, 8, 2, 64, 1, True), dict(num_splits=2)),
    ]
    for case, kwargs in decode_cases:
        inputs_ = decode_inputs(*case)
        ordinary, planned, replays = ordinary_then_planned(inputs_, kwargs)
        assert replays >= 2, (case, "not replayed")
        assert planned[1:] == ordinary[1:], (case, planned[1:], ordinary[1:])
        assert len(planned[0]) == len(ordinary[0]), case
        for a, b in zip(ordinary[0], planned[0]):
            assert a == b, (case, a[0], [(i, x, y) for i, (x, y) in enumerate(zip(a[2], b[2])) if x != y][:3])
        key = inference._decode_plan_key(*inputs_, kwargs.get("softmax_scale"), kwargs.get("causal", False),
                                         kwargs.get("window_size", (-1, -1)), kwargs.get("softcap", 0.0),
                                         kwargs.get("num_splits", 0), kwargs.get("return_softmax_lse", False))
        plans = [p for p in inference._DECODE_PLANS[key].plans.values() if not isinstance(p, int)]
        assert len(plans) == 1 and plans[0].views, case
        raw_matches(plans[0], tuple(t for t in inputs_ if t is not None))
        if kwargs.get("num_splits"):  # the partials and the appended lengths: in the arena
            # the appended lengths (none with the append fused: not for a heads-first cache), the lse, the
            # partial outputs and their lse
            fused = inference.FUSED_APPEND and len(case) < 7
            assert arena_matches(plans[0], tuple(t for t in inputs_ if t is not None)) == (3 if fused else 4), case
        # New caches, queries, tokens and lengths under the same key (another layer): replayed into them.
        fresh = decode_inputs(*case)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        want = decode_call(*fresh, kwargs)  # (its value check is remembered for the lengths tensor)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        runs_before = runs[0]
        got = decode_call(*fresh, kwargs)
        assert runs[0] == runs_before + 1 and got == want, (case, "fresh tensors")
    # Paged pools (pages of 16 and 48 positions, a block table in shuffled order): replayed, the launches the
    # ordinary path's, fresh tensors under the same key too.
    def paged_inputs(batch, pages, page_size, nheads, nheads_k, headdim, new):
        q, _, _, k_new, v_new, lengths = decode_inputs(batch, pages * page_size, nheads, nheads_k, headdim, new)
        k_pool, v_pool = (torch.randn(batch * pages + 1, page_size, nheads_k, headdim, dtype=torch.float16)
                          for _ in range(2))
        table = torch.randperm(batch * pages + 1)[:batch * pages].to(torch.int32).view(batch, pages)
        return (q, k_pool, v_pool, k_new, v_new, lengths), table

    for case, kwargs in (((2, 4, 16, 8, 2, 64, 1), dict()), ((3, 3, 48, 4, 4, 128, 1), dict(causal=True, num_splits=3)),
                         ((2, 4, 16, 8, 1, 64, 0), dict(return_softmax_lse=True))):
        inputs_, table = paged_inputs(*case)
        kwargs = {**kwargs, "block_table": table}
        ordinary, planned, replays = ordinary_then_planned(inputs_, kwargs)
        assert replays >= 2, (case, "paged step not replayed")
        assert planned[1:] == ordinary[1:] and planned[0] == ordinary[0], (case, "paged")
        fresh, fresh_table = paged_inputs(*case)
        fresh_kwargs = {**kwargs, "block_table": fresh_table}
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        decode_call(*fresh, fresh_kwargs)  # (checks the new index tensors: with an append, a conflict kernel too)
        want = decode_call(*fresh, fresh_kwargs)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        runs_before = runs[0]
        got = decode_call(*fresh, fresh_kwargs)
        assert runs[0] == runs_before + 1 and got == want, (case, "paged, fresh tensors")
    # FP8 caches (float8 q, new tokens already float8, descales per (batch, kv head); or a 16-bit q and
    # tokens), V in rows and positions-fastest: replayed, their launches the ordinary path's.
    from flashtile import fp8 as fp8_api

    def fp8_inputs(case, positions_fastest, sixteen_bit):
        q, k_cache, v_cache, k_new, v_new, lengths = decode_inputs(*case)
        (k8, kd), (v8, vd) = fp8_api.quantize(k_cache), fp8_api.quantize(v_cache)
        if positions_fastest:
            v8 = fp8_api.zeros_cache(*v8.shape)[1].copy_(v8)
        if sixteen_bit:  # a 16-bit model's q and new tokens (quantized by the append kernel)
            return (q, k8, v8, k_new, v_new, lengths), dict(k_descale=kd, v_descale=vd)
        q8, qd = fp8_api.quantize(q, k_cache.shape[2])
        new = [None, None] if k_new is None else [fp8_api.quantize_with(x, d) for x, d in ((k_new, kd), (v_new, vd))]
        return (q8, k8, v8, *new, lengths), dict(q_descale=qd, k_descale=kd, v_descale=vd)

    for case, options in (((2, 128, 8, 2, 64, 1), dict()), ((3, 96, 4, 4, 128, 1), dict(causal=True, num_splits=3)),
                          ((2, 128, 8, 1, 64, 0), dict(return_softmax_lse=True))):
        for positions_fastest, sixteen_bit in ((False, False), (True, False), (True, True), (False, True)):
            inputs_, scales = fp8_inputs(case, positions_fastest, sixteen_bit)
            kwargs = {**options, **scales}
            ordinary, planned, replays = ordinary_then_planned(inputs_, kwargs)
            assert replays >= 2, (case, positions_fastest, "FP8 step not replayed")
            assert planned[1:] == ordinary[1:] and planned[0] == ordinary[0], (case, positions_fastest)
            # The same descale for k and v (one tensor in two roles): the ordinary path, every call.
            runs_before = runs[0]
            for _ in range(3):
                decode_call(*inputs_, {**kwargs, "v_descale": kwargs["k_descale"]})
            assert runs[0] == runs_before, (case, "a shared descale was replayed")
            # A descale that requires grad: refused as on the ordinary path (FP8 inputs have no backward),
            # not replayed.
            try:
                decode_call(*inputs_, {**kwargs, "v_descale": kwargs["v_descale"].clone().requires_grad_()})
                raise AssertionError((case, "a descale requiring grad was accepted"))
            except NotImplementedError:
                pass
            assert runs[0] == runs_before, (case, "a descale requiring grad was replayed")
    # Rows picked by cache_batch_idx (a cache of more entries than sequences): replayed, fresh tensors too.
    for case, kwargs in (((3, 96, 8, 2, 64, 1), dict()), ((2, 128, 4, 4, 128, 2), dict(causal=True, num_splits=3))):
        q_, k_cache_, v_cache_, *rest = decode_inputs(*case)
        caches_ = [torch.cat([c, c.flip(0)]) for c in (k_cache_, v_cache_)]  # twice the entries
        picked = torch.randperm(2 * case[0])[:case[0]].to(torch.int32)
        inputs_, kwargs = (q_, *caches_, *rest), {**kwargs, "cache_batch_idx": picked}
        ordinary, planned, replays = ordinary_then_planned(inputs_, kwargs)
        assert replays >= 2 and planned == ordinary, (case, "cache_batch_idx step")
        fresh_kwargs = {**kwargs, "cache_batch_idx": picked.clone()}
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        decode_call(*inputs_, fresh_kwargs)  # (checks the new index tensor)
        want = decode_call(*inputs_, fresh_kwargs)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        runs_before = runs[0]
        got = decode_call(*inputs_, fresh_kwargs)
        assert runs[0] == runs_before + 1 and got == want, (case, "cache_batch_idx, a fresh index")
    # Rotary tables (the rotation one kernel per tensor): replayed, interleaved or in halves, local or not.
    for case, kwargs in (((2, 128, 8, 2, 64, 1), dict(causal=True, rotary_interleaved=True)),
                         ((2, 96, 4, 4, 40, 2), dict(rotary_interleaved=False, num_splits=2)),
                         ((2, 128, 8, 2, 64, 0), dict(window_size=(16, 0), return_softmax_lse=True))):
        inputs_ = decode_inputs(*case)
        angles = torch.rand(case[1] + 8, case[4] // 4) * 6  # rotary_dim = headdim / 2
        kwargs = {**kwargs, "rotary_cos": angles.cos().half(), "rotary_sin": angles.sin().half()}
        ordinary, planned, replays = ordinary_then_planned(inputs_, kwargs)
        assert replays >= 2 and planned == ordinary, (case, "rotary step")
    # An FP8 pool in pages of 16 positions (V in rows), float8 or 16-bit new tokens: replayed as well.
    for sixteen_bit in (False, True):
        (q_, k8, v8, *rest), scales = fp8_inputs((2, 128, 8, 2, 64, 1), False, sixteen_bit)
        pools = [x.view(-1, 16, *x.shape[2:]) for x in (k8, v8)]
        table = torch.randperm(16).to(torch.int32).view(2, 8)
        kwargs = {**scales, "block_table": table}
        ordinary, planned, replays = ordinary_then_planned((q_, *pools, *rest), kwargs)
        assert replays >= 2 and planned == ordinary, (sixteen_bit, "FP8 paged step")

    # q and the new tokens as views of one projection (offsets into it), the caches halves of one buffer.
    proj = torch.randn(2, 1, (8 + 2 * 2) * 64, dtype=torch.float16)
    q_p, k_p, v_p = (t.view(2, 1, -1, 64) for t in proj.split((8 * 64, 2 * 64, 2 * 64), dim=-1))
    kv_cache = torch.randn(2, 128, 2, 2, 64, dtype=torch.float16)
    packed = (q_p, kv_cache[:, :, 0], kv_cache[:, :, 1], k_p, v_p, torch.tensor([30, 90], dtype=torch.int32))
    os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
    want = decode_call(*packed, dict(num_splits=2, return_softmax_lse=True))
    os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
    runs_before = runs[0]
    for _ in range(5):
        got = decode_call(*packed, dict(num_splits=2, return_softmax_lse=True))
    assert runs[0] >= runs_before + 2 and got == want, "views of a projection and of one cache buffer"

    # Meta tensors still go through the custom op's fake implementation.
    meta = [t.to("meta") for t in decode_inputs(*decode_cases[0][0])]
    for _ in range(3):
        assert flash_attn_with_kvcache(*meta[:5], cache_seqlens=meta[5]).device.type == "meta"

    # A written cache_seqlens (its version moves) is read and checked again on the ordinary path first.
    inputs_ = decode_inputs(*decode_cases[0][0])
    for _ in range(5):
        decode_call(*inputs_, {})
    runs_before = runs[0]
    inputs_[5].add_(1)
    decode_call(*inputs_, {})
    assert runs[0] == runs_before, "a written cache_seqlens was replayed unchecked"
    decode_call(*inputs_, {})
    assert runs[0] == runs_before + 1

    # A replayed call's outputs are fresh buffers every call.
    q, k, v, dout = inputs(cases[0][0])
    out_a = flash_attn_func(q, k, v, causal=True)
    out_b = flash_attn_func(q, k, v, causal=True)
    assert out_a.data_ptr() != out_b.data_ptr()

    # A registered launch hook, a debug knob: Triton's own path, not the plan.
    from triton import knobs
    hook = lambda metadata: None
    knobs.runtime.launch_enter_hook.add(hook)
    one_call(q, k, v, dout, dict(causal=True))
    assert not any(launched_directly(Launcher.records))
    knobs.runtime.launch_enter_hook.remove(hook)
    knobs.runtime.debug = True
    one_call(q, k, v, dout, dict(causal=True))
    assert not any(launched_directly(Launcher.records))
    knobs.runtime.debug = False

    # A changed setting is another key (recorded anew), the old key untouched.
    before = len(_ops._PLANS)
    os.environ["FLASHTILE_TMA"] = "0"
    one_call(q, k, v, dout, dict(causal=True))
    assert len(_ops._PLANS) == before + 1
    del os.environ["FLASHTILE_TMA"]

    # Unaligned inputs (Triton specializes pointers on 16-byte alignment): the ordinary path.
    base = torch.randn(2 * 64 * 4 * 64 + 1, dtype=torch.float16)
    q_odd = base[1:].view(2, 64, 4, 64)
    runs_before = runs[0]
    flash_attn_func(q_odd, k, v, causal=True)
    flash_attn_func(q, k, v, causal=True)
    assert runs[0] == runs_before + 1

    # Another current device: its own compiled kernels, never the plan's.
    ids0 = {id(a[4]) for _, a in Launcher.records}
    stand_in_hopper.current_device[0] = 1
    one_call(q, k, v, dout, dict(causal=True))
    assert not ids0 & {id(a[4]) for _, a in Launcher.records}
    stand_in_hopper.current_device[0] = 0

    # A launcher that refuses a replay: the call is repeated on the ordinary path, plans and direct
    # launches stop for the process, and the result is the ordinary path's.
    refuse_direct_launches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = one_call(q, k, v, dout, dict(causal=True))
    assert configs._DIRECT_BROKEN and len(result) == 3 and not any(launched_directly(Launcher.records))
    assert any("turned off" in str(w.message) for w in caught)
    print("ok")
    """
)


RAW_PREFIX = textwrap.dedent(
    """
    # Launchers that are Triton's CUDA one but for the compiled module: Triton's own path and a plan's raw
    # replay both end in the module's launch, whose arguments are kept (CudaLauncher.module_records).
    stand_in_hopper.install(record=True, raw=True)
    import triton
    from flashtile import _ops, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flashtile.kernels import replay
    from flashtile.kernels.stand_in import CudaLauncher

    def module_args(call, plans):
        # The module launches of call() (FLASHTILE_LAUNCH_PLANS=plans), each address named by the call's
        # tensor it points into (name, byte offset) or else "address", the global scratch as "scratch".
        os.environ["FLASHTILE_LAUNCH_PLANS"] = plans
        CudaLauncher.module_records.clear()
        tensors = call()
        spans = [(name, t.data_ptr(), t.untyped_storage().nbytes()) for name, t in tensors.items()]
        def named(x):
            if isinstance(x, torch.Tensor):
                x = x.data_ptr()
            if isinstance(x, tuple) and x[:1] == ("tma",):
                return ("tma", named(x[1]), *x[2:])
            # Addresses by size: this script's integers (sizes, strides) stay under 2**22, and a host's
            # heap can lie under 2**32 (it does on the GPU machines).
            if isinstance(x, int) and not isinstance(x, bool) and x > 2 ** 22:
                for name, start, size in spans:
                    if start <= x < start + size:
                        return (name, x - start)
                return "address"
            return x
        return [(name, [("scratch" if i == 7 and x is not None else named(x)) for i, x in enumerate(args)])
                for name, args in CudaLauncher.module_records]

    def same(call, what):
        # The ordinary path's module launches, then a replayed call's, on the same tensors: equal.
        for _ in range(5):
            planned = module_args(call, "1")
        ordinary = module_args(call, "0")
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        assert len(planned) == len(ordinary), (what, len(planned), len(ordinary))
        for (name, a), (_, b) in zip(ordinary, planned):
            assert a == b, (what, name, [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y][:4])
    """
)

RAW_SCRIPT = RAW_PREFIX + textwrap.dedent(
    """
    for causal, d in ((True, 64), (False, 128)):  # host-made descriptors: the forward and both backward passes
        q, k, v = (torch.randn(2, 128, 4, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        def dense():
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
            return dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        before = runs[0]
        same(dense, ("dense", causal, d))
        assert runs[0] > before
        entry = _ops._PLANS[_ops.plan_key(q, k, v, None, causal, (-1, -1), 0.0)]
        backward_plan, = [p for p in entry.backward.values() if not isinstance(p, int)]
        assert all(isinstance(launch, replay._RawLaunch) for launch in entry.forward.launches + backward_plan.launches)
        assert any(launch.descriptors for launch in entry.forward.launches + backward_plan.launches)
        assert backward_plan.arena_bytes > 0  # delta and lse2

    def dense_no_grad():  # inference replays the forward's plan without an autograd Function
        with torch.no_grad():
            out = flash_attn_func(q, k, v, causal=True)
        return dict(q=q, k=k, v=v, out=out)
    before = runs[0]
    same(dense_no_grad, "dense, no grad")
    assert runs[0] > before

    # Split keys (forced: the stand-in's tensors are on the CPU, where split_count says 1), keys laid out as
    # a Hugging Face dynamic cache's; the attention and the merge of the splits, the partials in the arena.
    from flashtile.kernels import configs
    split_count = configs.split_count
    configs.split_count = lambda *args: 3
    qd = torch.randn(2, 1, 8, 64, dtype=torch.float16, requires_grad=True)
    kd, vd = (torch.randn(2, 2, 300, 64, dtype=torch.float16).transpose(1, 2).requires_grad_() for _ in range(2))
    dd = torch.randn_like(qd)
    def dense_split():
        out, lse, _ = flash_attn_func(qd, kd, vd, causal=True, return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), dd)
        return dict(q=qd, k=kd, v=vd, dout=dd, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    def dense_split_no_grad():
        with torch.no_grad():
            out = flash_attn_func(qd, kd, vd, causal=True)
        assert not out.requires_grad
        return dict(q=qd, k=kd, v=vd, out=out)
    for call, what in ((dense_split, "dense split"), (dense_split_no_grad, "dense split, no grad")):
        before = runs[0]
        same(call, what)
        assert runs[0] > before
    entry = _ops._PLANS[_ops.plan_key(qd, kd, vd, None, True, (-1, -1), 0.0)]
    assert len(entry.forward.launches) == 2 and entry.forward.arena_bytes > 0
    configs.split_count = split_count
    # Forward-mode AD: dual tensors do not require grad, yet a planned call must not drop their tangents
    # (the autograd Function, which has no jvp, refuses them as on the ordinary path).
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(qd.detach(), torch.ones_like(qd))
        try:
            flash_attn_func(dual, kd.detach(), vd.detach(), causal=True)
        except (NotImplementedError, RuntimeError):
            pass
        else:
            raise AssertionError("a planned call dropped forward-mode AD's tangent")

    # Packed sequences: the kernels make their descriptors in place (global scratch, in the arena).
    qp, kp, vp = (torch.randn(200, 4, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 70, 200], dtype=torch.int32)
    dp = torch.randn_like(qp)
    def packed():
        out, lse, _ = flash_attn_varlen_func(qp, kp, vp, cu, cu, 130, 130, causal=True, return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad(out, (qp, kp, vp), dp)
        return dict(q=qp, k=kp, v=vp, dout=dp, cu=cu, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    before = runs[0]
    same(packed, "varlen")
    assert runs[0] > before
    def packed_no_grad():  # replayed (and recorded) without the autograd Function
        with torch.no_grad():
            out = flash_attn_varlen_func(qp, kp, vp, cu, cu, 130, 130, causal=False)
        assert not out.requires_grad
        return dict(q=qp, k=kp, v=vp, cu=cu, out=out)
    before = runs[0]
    planned_apply, applied = _ops._planned_apply, []
    _ops._planned_apply = lambda *args: applied.append(1) or planned_apply(*args)
    same(packed_no_grad, "varlen, no grad")
    _ops._planned_apply = planned_apply
    assert runs[0] > before and not applied
    varlen_plans = [p for e in _ops._PLANS.values() if e.varlen is not None for p in e.plans.values()
                    if not isinstance(p, int)]
    # Both ways of placing scratch ran: the forward's alone (allocated apart), the backward's passes' in its arena.
    scratches = [(plan.arena_bytes > 0, launch.scratch_offset is not None) for plan in varlen_plans
                 for launch in plan.launches if launch.scratch is not None]
    assert (False, False) in scratches and (True, True) in scratches, scratches

    # A split decoding step: the appended lengths, lse and partials in the arena.
    k_cache, v_cache = (torch.randn(3, 96, 2, 64, dtype=torch.float16) for _ in range(2))
    q1 = torch.randn(3, 1, 8, 64, dtype=torch.float16)
    k1, v1 = (torch.randn(3, 1, 2, 64, dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([3, 40, 90], dtype=torch.int32)
    def decode():
        out = flash_attn_with_kvcache(q1, k_cache, v_cache, k1, v1, cache_seqlens=lengths, num_splits=3)
        return dict(q=q1, k_cache=k_cache, v_cache=v_cache, k=k1, v=v1, lengths=lengths, out=out)
    before = runs[0]
    same(decode, "decode")
    assert runs[0] > before
    plans = [p for e in inference._DECODE_PLANS.values() for p in e.plans.values() if not isinstance(p, int)]
    assert len(plans) == 1 and plans[0].arena_bytes > 0
    # record's own decisions: the appended lengths (none with the append fused), lse and partials in the arena, the
    # result apart.
    plan = plans[0]
    assert all(isinstance(launch, replay._RawLaunch) for launch in plan.launches)
    placed = [i for i, offset in enumerate(plan.in_arena) if offset is not None]
    assert len(placed) == (3 if inference.FUSED_APPEND else 4), (plan.in_arena, plan.allocations)
    results = {plan.views[o - plan.num_inputs - len(plan.allocations)][0] if o >= plan.num_inputs
               + len(plan.allocations) else o for o in plan.outputs}
    assert not results & {plan.num_inputs + i for i in placed}
    # The result, on the ordinary path a (batch, 1, heads, headdim) view of a flat allocation, is allocated in its
    # own strides by a replay: one allocation and no view to make.
    assert list(plan.direct) == [True], plan.direct
    os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
    ordinary_out = decode()["out"]
    os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
    runs_before = runs[0]
    planned_out = decode()["out"]
    assert runs[0] > runs_before and planned_out._base is None and ordinary_out._base is not None
    assert (planned_out.shape, planned_out.stride(), planned_out.dtype) == (
        ordinary_out.shape, ordinary_out.stride(), ordinary_out.dtype)
    print("ok")
    """
)


GROWING_SCRIPT = textwrap.dedent(
    """
    # A key cache that grows by one token a step, each layer of a step making the same no-grad call over it
    # (Hugging Face's dynamic cache): each new length's first call is recorded (its family's key before it was
    # called again and has a plan), and the step's later calls replay it, handing the module what the ordinary
    # path hands it at that length, address for address. Split keys and not, the partials in the arena,
    # host-made descriptors (their shapes and strides change with the length).
    import flashtile.kernels as kernels_package
    from flashtile.kernels import configs
    made = {"record": 0}
    record_plan = kernels_package.record
    def counted(*args, **kwargs):
        result = record_plan(*args, **kwargs)
        made["record"] += result[1] is not None
        return result
    kernels_package.record = counted
    split_count = configs.split_count
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    for splits in (3, 1):
        configs.split_count = lambda *args, splits=splits: splits
        # (batch, heads_k, keys, d); lengths clear of multiples of 16, each a specialization compiled anew
        cache = torch.randn(2, 2, 322 if splits > 1 else 305, 64, dtype=torch.float16)
        def layer():
            with torch.no_grad():
                out = flash_attn_func(q, k, v, causal=True)
            return dict(q=q, k=k, v=v, out=out)
        k, v = cache.transpose(1, 2), (cache + 1).transpose(1, 2)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"  # (a setting of the key: the same for the whole family)
        for _ in range(5):  # compiled, launched directly, recorded: the family's first plan
            layer()
        made.update(record=0)
        for step in range(6):
            cache = torch.cat([cache, torch.randn(2, 2, 1, 64, dtype=torch.float16)], 2)
            k, v = cache.transpose(1, 2), (cache + 1).transpose(1, 2)
            os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
            layer()  # the length's first call: recorded
            before = runs[0]
            planned = module_args(layer, "1")
            assert runs[0] == before + 1, (splits, step)
            ordinary = module_args(layer, "0")
            assert len(planned) == len(ordinary) == (2 if splits > 1 else 1), (splits, step, len(planned))
            for (name, a), (_, b) in zip(ordinary, planned):
                assert a == b, (splits, step, name, [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y][:4])
        assert made == {"record": 6}, (splits, made)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        entry = _ops._PLANS[_ops.plan_key(q, k, v, None, True, (-1, -1), 0.0)]
        assert any(launch.descriptors for launch in entry.forward.launches)
    configs.split_count = split_count

    # A new length whose ordinary path computes outside the kernels is not planned: a copy of k handed to the
    # kernel, or a result changed in place after the kernels (the recording's dispatch mode refuses both).
    attention_forward = kernels_package.attention_forward
    def copied_k(q, k, v, *args, **kwargs):
        return attention_forward(q, k.contiguous(), v, *args, **kwargs)
    def scaled_after(*args, **kwargs):
        out, lse = attention_forward(*args, **kwargs)
        out.mul_(1)
        return out, lse
    for changed in (None, copied_k, None, scaled_after):
        cache = torch.cat([cache, torch.randn(2, 2, 1, 64, dtype=torch.float16)], 2)
        k, v = cache.transpose(1, 2), (cache + 1).transpose(1, 2)
        kernels_package.attention_forward = changed or attention_forward
        made.update(record=0)
        with torch.no_grad():
            for _ in range(3 if changed is None else 1):  # (unchanged: the family gets a plan again)
                flash_attn_func(q, k, v, causal=True)
        entry = _ops._PLANS[_ops.plan_key(q, k, v, None, True, (-1, -1), 0.0)]
        assert changed is None or (made["record"] == 0 and entry.plans["forward"] == 1), (made, entry.plans)
    kernels_package.attention_forward = attention_forward
    print("ok")
    """
)


FP8_SCRIPT = ROLES + textwrap.dedent(
    """
    from flashtile import _ops, flash_attn_func, fp8
    from flashtile.kernels import forward, replay

    # The FP8 kernels on the stand-in's CPU tensors (the dispatch takes them on CUDA devices only), and V copied
    # keys-fastest by its Triton kernel as on a GPU (off it torch copies: a computation, which no plan records).
    fp8.kernels_run = lambda device, headdim, dropout_p: headdim > 16 and dropout_p == 0
    forward._torch_transposes = lambda device: False

    def fp8_call(t, kwargs):
        Launcher.records.clear()
        out, lse, _ = flash_attn_func(t["q"], t["k"], t["v"], q_descale=t["qd"], k_descale=t["kd"], v_descale=t["vd"],
                                      return_attn_probs=True, **kwargs)
        named = dict(t, out=out, lse=lse)
        return [(name, args[:2] + (id(args[4]),), normal(args[9:], named)) for name, args in Launcher.records]

    def inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, keys_fastest):
        q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=torch.float16)
        k, v = (torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=torch.float16) for _ in range(2))
        (q8, qd), (k8, kd) = fp8.quantize(q, nheads_k=nheads_k), fp8.quantize(k)
        v8, vd = fp8.quantize(v, keys_fastest=keys_fastest)
        return dict(q=q8, k=k8, v=v8, qd=qd, kd=kd, vd=vd)

    def key_of(t, kwargs):
        return _ops.fp8_plan_key(t["q"], t["k"], t["v"], (t["qd"], t["kd"], t["vd"]), kwargs.get("softmax_scale"),
                                 kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)), 0.0,
                                 kwargs.get("out_dtype"))

    cases = [
        ((2, 64, 64, 4, 4, 64, False), dict(causal=True)),                      # v in rows: copied keys-fastest
        ((2, 48, 80, 4, 2, 128, True), dict(softmax_scale=0.3)),                # GQA, v already keys-fastest
        ((1, 72, 72, 6, 2, 64, False), dict(window_size=(16, 8), out_dtype=torch.float16)),
    ]
    for case, kwargs in cases:
        torch.manual_seed(case[1] + case[5])
        t = inputs(*case)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        for _ in range(3):
            want = fp8_call(t, kwargs)
        assert key_of(t, kwargs) not in _ops._FP8_PLANS  # (plans off: no key is made)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        for _ in range(4):  # note the key, compile and make the direct launches, record
            fp8_call(t, kwargs)
        assert isinstance(_ops._FP8_PLANS[key_of(t, kwargs)]["forward"], replay.Plan), case
        runs_before = runs[0]
        got = fp8_call(inputs(*case), kwargs)  # new tensors: the plan's slots take them
        assert runs[0] == runs_before + 1 and all(launched_directly(Launcher.records)), case
        assert len(got) == len(want) == (1 if case[-1] else 2), (case, len(got))  # (the copy of v, the forward)
        assert got[-1][0] == want[-1][0] == "_attn_fwd", (got[-1][0], want[-1][0])
        for a, b in zip(got, want):
            assert a == b, (case, a[0], [i for i, (x, y) in enumerate(zip(a[2], b[2])) if x != y])

    # Once a plan exists, calls the ordinary path refuses are still refused: a descale that requires grad, one of
    # another shape; one descale given for k and v is no key (the ordinary path serves it, no replay).
    t = inputs(*cases[0][0])
    bad = [dict(t, kd=t["kd"].clone().requires_grad_()), dict(t, kd=t["kd"][:1])]
    for call in bad:
        try:
            fp8_call(call, cases[0][1])
        except (TypeError, ValueError, NotImplementedError) as exc:
            assert "k_descale" in str(exc), exc
        else:
            raise AssertionError("a bad k_descale was accepted after a plan was made")
    runs_before = runs[0]
    for _ in range(3):
        fp8_call(dict(t, vd=t["kd"]), cases[0][1])
    assert runs[0] == runs_before, "a descale given twice was replayed"

    # Packed FP8 calls (descales per sequence) whose cu_seqlens were checked and are unwritten since replay as
    # 16-bit packed calls do; a written cu_seqlens is read and checked again first.
    from flashtile import flash_attn_varlen_func

    cu_q = torch.tensor([0, 40, 41, 112], dtype=torch.int32)
    for shared in (True, False):
        cu_k = cu_q if shared else torch.tensor([0, 17, 80, 96], dtype=torch.int32)
        max_k = int((cu_k[1:] - cu_k[:-1]).max())

        def varlen_inputs():
            q = torch.randn(112, 4, 64, dtype=torch.float16)
            k, v = (torch.randn(int(cu_k[-1]), 2, 64, dtype=torch.float16) for _ in range(2))
            (q8, qd), (k8, kd) = fp8.quantize_varlen(q, cu_q, nheads_k=2), fp8.quantize_varlen(k, cu_k)
            v8, vd = fp8.quantize_varlen(v, cu_k)
            return dict(q=q8, k=k8, v=v8, qd=qd, kd=kd, vd=vd, cu_q=cu_q, cu_k=cu_k)

        def varlen_call(t):
            Launcher.records.clear()
            out, lse, _ = flash_attn_varlen_func(t["q"], t["k"], t["v"], cu_q, cu_k, 71, max_k, causal=True,
                                                 return_attn_probs=True, q_descale=t["qd"], k_descale=t["kd"],
                                                 v_descale=t["vd"])
            named = dict(t, out=out, lse=lse)
            return [(name, args[:2] + (id(args[4]),), normal(args[9:], named)) for name, args in Launcher.records]

        t = varlen_inputs()
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        for _ in range(3):
            want = varlen_call(t)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        for _ in range(4):
            varlen_call(t)
        runs_before = runs[0]
        got = varlen_call(varlen_inputs())
        assert runs[0] == runs_before + 1 and all(launched_directly(Launcher.records)), ("varlen not replayed", shared)
        assert got == want, (shared, [(g[0], [i for i, (x, y) in enumerate(zip(g[2], w[2])) if x != y])
                                      for g, w in zip(got, want)])
        good = int(cu_q[1])
        cu_q[1] = 200  # a write PyTorch sees: its values are read and checked again before any launch
        try:
            varlen_call(t)
        except ValueError as exc:
            assert "cu_seqlens" in str(exc), exc
        else:
            raise AssertionError("a written cu_seqlens was replayed unchecked")
        cu_q[1] = good

    # The FP8 custom op, as torch.compile's generated code calls it (fp8_attn_func, or flash_attn_func on FP8
    # inputs in a compiled model): its own plans, the same launches as with plans off.
    def op_call(t, causal, scale):
        Launcher.records.clear()
        out, lse = _ops.fp8_attention_forward_op(t["q"], t["k"], t["v"], t["qd"], t["kd"], t["vd"], torch.bfloat16,
                                                 scale, causal, -1, 0 if causal else -1, 0.0, None, "triton")
        named = dict(t, out=out, lse=lse)
        return [(name, args[:2] + (id(args[4]),), normal(args[9:], named)) for name, args in Launcher.records]

    for case, causal in ((cases[0][0], True), (cases[1][0], False)):
        t = inputs(*case)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        for _ in range(3):
            want = op_call(t, causal, 0.125)
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        for _ in range(4):  # note the key, record
            op_call(t, causal, 0.125)
        runs_before = runs[0]
        got = op_call(inputs(*case), causal, 0.125)
        assert runs[0] == runs_before + 1 and all(launched_directly(Launcher.records)), ("op not replayed", case)
        assert got == want, (case, [(g[0], [i for i, (x, y) in enumerate(zip(g[2], w[2])) if x != y])
                                    for g, w in zip(got, want)])
    print("ok")
    """
)


@needs_triton_36  # launch plans replay Triton 3.6's launcher (configs.direct_launches_possible)
def test_fp8_replays_match_the_ordinary_path():
    """Dense calls on FP8 q, k, v (``flash_attn_func`` with descales, and the FP8 custom op that compiled code
    calls) replay their plans: the launches (V's keys-fastest copy where v comes in rows, the FP8 forward) match the
    ordinary path's argument for argument with new tensors, and arguments the ordinary path refuses stay refused."""
    run_stand_in_script(REPLAY_PREAMBLE + FP8_SCRIPT, timeout=900, unset=("FLASHTILE_LAUNCH_PLANS",))


@needs_triton_36  # launch plans replay Triton 3.6's launcher (configs.direct_launches_possible)
def test_growing_cache_plans_on_the_stand_in():
    """Each new length of a growing cache is recorded on its first call; the replays match the ordinary path's
    launches address for address; a length whose path computes outside the kernels is not planned."""
    run_stand_in_script(REPLAY_PREAMBLE + RAW_PREFIX + GROWING_SCRIPT, timeout=900, unset=("FLASHTILE_LAUNCH_PLANS",))


@needs_triton_36  # launch plans replay Triton 3.6's launcher (configs.direct_launches_possible)
def test_raw_replays_run_end_to_end_on_the_stand_in():
    """With Triton's CUDA launcher but for its compiled module, a replayed call's raw launches hand the module
    what Triton's own path hands it, address for address (host-made descriptors, in-kernel descriptors'
    scratch, arenas): dense forward+backward, packed sequences, a split decoding step."""
    run_stand_in_script(REPLAY_PREAMBLE + RAW_SCRIPT, timeout=900, unset=("FLASHTILE_LAUNCH_PLANS",))


@needs_triton_36  # launch plans replay Triton 3.6's launcher (configs.direct_launches_possible)
def test_replayed_launches_match_the_ordinary_path():
    run_stand_in_script(REPLAY_PREAMBLE + SCRIPT, timeout=900, unset=("FLASHTILE_LAUNCH_PLANS",))


OPS_SCRIPT = textwrap.dedent(
    """
    from flashtile import _ops
    from flashtile.kernels import replay
    from triton.tools.tensor_descriptor import TensorDescriptor

    def role(x, tensors):
        for name, t in tensors.items():
            if x.data_ptr() == t.data_ptr() and x.shape == t.shape and x.stride() == t.stride():
                return name
        return ("buffer", tuple(x.shape), x.stride(), x.dtype)

    def normal(args, tensors):
        return [role(x, tensors) if isinstance(x, torch.Tensor) else
                ("descriptor", role(x.base, tensors), list(x.shape), list(x.strides)) if isinstance(x, TensorDescriptor)
                else x for x in args]

    def op_call(q, k, v, dout, causal, scale):
        # The two custom ops as torch.compile's generated code calls them: plain tensors, no autograd.
        Launcher.records.clear()
        out, lse = _ops.attention_forward_op(q, k, v, None, None, 0, 0, scale, causal, -1, -1, 0.0, None, None,
                                             None, 0.0, None, "triton")
        dq, dk, dv = _ops.attention_backward_op(dout, q, k, v, out, lse, None, None, 0, 0, scale, causal, -1, -1,
                                                0.0, None, None, None, 0.0, None, "triton")
        tensors = dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        return [(name, args[:2] + (id(args[4]),), normal(args[9:], tensors)) for name, args in Launcher.records]

    def inputs(batch, seqlen, nheads, nheads_k, headdim, strided):
        if strided:  # views of one projection's output, as a model makes them
            proj = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=torch.float16)
            q, k, v = proj.view(batch, seqlen, 3, nheads, headdim).unbind(2)
        else:
            q = torch.randn(batch, seqlen, nheads, headdim, dtype=torch.float16)
            k, v = (torch.randn(batch, seqlen, nheads_k, headdim, dtype=torch.float16) for _ in range(2))
        return q, k, v, torch.randn(q.shape, dtype=q.dtype)

    for batch, seqlen, nheads, nheads_k, headdim, causal, strided in ((2, 64, 4, 4, 64, True, True),
                                                                     (2, 48, 4, 2, 40, False, False)):
        shape = (batch, seqlen, nheads, nheads_k, headdim, strided)
        q, k, v, dout = inputs(*shape)
        scale = headdim ** -0.5
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
        for _ in range(3):
            want = op_call(q, k, v, dout, causal, scale)
        assert not _ops._OP_PLANS
        os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
        for _ in range(4):  # compile, make the direct launch, record
            op_call(q, k, v, dout, causal, scale)
        runs_before = runs[0]
        got = op_call(*inputs(*shape), causal, scale)  # new tensors: the plan's slots take them
        assert runs[0] == runs_before + 2, ("not replayed", headdim, runs[0] - runs_before)
        assert all(launched_directly(Launcher.records)), headdim
        assert len(got) == len(want) and all(a == b for a, b in zip(got, want)), [
            (g[0], [i for i, (x, y) in enumerate(zip(g[2], w[2])) if x != y]) for g, w in zip(got, want)]
        _ops._OP_PLANS.clear()
    # A key's first call records nothing (shapes that change every call pay for no recording).
    recordings = []
    record_plan = _ops._triton_backend().record
    _ops._triton_backend().record = lambda *a: recordings.append(1) or record_plan(*a)
    q1, k1, v1, dout1 = inputs(1, 40, 2, 2, 64, False)
    out1, lse1 = _ops.attention_forward_op(q1, k1, v1, None, None, 0, 0, 0.125, True, -1, -1, 0.0, None, None, None,
                                           0.0, None, "triton")
    _ops.attention_backward_op(dout1, q1, k1, v1, out1, lse1, None, None, 0, 0, 0.125, True, -1, -1, 0.0, None, None,
                               None, 0.0, None, "triton")
    assert not recordings, len(recordings)
    # An lse that is not the forward's own layout (strided) takes the ordinary path, call after call.
    lse_strided = lse1.transpose(1, 2).contiguous().transpose(1, 2)
    for _ in range(5):
        _ops.attention_backward_op(dout1, q1, k1, v1, out1, lse_strided, None, None, 0, 0, 0.125, True, -1, -1, 0.0,
                                   None, None, None, 0.0, None, "triton")
    assert not recordings, len(recordings)
    _ops._triton_backend().record = record_plan
    # Below autograd (inside a custom op) PyTorch's ops that may alias are seen whole; one that copied
    # (contiguous of a strided tensor) is a computation, not a view to remake at an offset.
    reasons = []

    @torch.library.custom_op("flashtile_test::record_copy", mutates_args=())
    def record_copy(x: torch.Tensor) -> torch.Tensor:
        result, _, reason = replay.record(lambda: (x.contiguous(),), (x,), set())
        reasons.append(reason)
        return result[0]
    record_copy(torch.zeros(4, 6)[:, :3])
    assert "computes" in reasons[0], reasons

    # The decoding op (flash_attn_with_kvcache under torch.compile) replays decoding plans: a step appending one
    # token per sequence to a contiguous cache, each call of a layer loop with one cache_seqlens tensor.
    from flashtile import inference
    q_step = torch.randn(2, 1, 8, 64, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 128, 2, 64, dtype=torch.float16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 64, dtype=torch.float16) for _ in range(2))
    cache_seqlens = torch.tensor([100, 120], dtype=torch.int32)

    def decode_op():
        Launcher.records.clear()
        out, lse = torch.ops.flashtile.kvcache_attention(q_step, k_cache, v_cache, k_new, v_new, None, None,
                                                         cache_seqlens, None, None, None, None, None, True, -1, -1,
                                                         0.0, False, None, 0, None, None, None, None)
        tensors = dict(q=q_step, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, out=out, lse=lse)
        return [(name, args[:2] + (id(args[4]),), normal(args[9:], tensors)) for name, args in Launcher.records]

    os.environ["FLASHTILE_LAUNCH_PLANS"] = "0"
    for _ in range(3):
        want = decode_op()
    assert not inference._DECODE_PLANS or not any(
        not isinstance(p, int) for e in inference._DECODE_PLANS.values() for p in e.plans.values())
    os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
    inference._DECODE_PLANS.clear()
    for _ in range(4):
        decode_op()
    runs_before = runs[0]
    got = decode_op()
    assert runs[0] == runs_before + 1, ("the decoding op was not replayed", runs[0] - runs_before)
    assert all(launched_directly(Launcher.records))
    assert len(got) == len(want) and all(a[:2] == b[:2] for a, b in zip(got, want)), (got, want)

    # Calls a plan may not serve take the ordinary path: dropout, a tensor option (ALiBi).
    _ops._OP_PLANS.clear()
    runs_before = runs[0]
    for _ in range(5):
        _ops.attention_forward_op(q, k, v, None, None, 0, 0, scale, False, -1, -1, 0.0, None, None, None, 0.1,
                                  torch.tensor([7]), "triton")
        _ops.attention_forward_op(q, k, v, None, None, 0, 0, scale, False, -1, -1, 0.0,
                                  torch.full((nheads,), 0.5), None, None, 0.0, None, "triton")
    assert runs[0] == runs_before and not _ops._OP_PLANS
    print("ok")
    """
)


@needs_triton_36  # launch plans replay Triton 3.6's launcher (configs.direct_launches_possible)
def test_custom_ops_replay_launch_plans():
    """The custom ops that torch.compile's generated code calls replay launch plans too, handing the driver
    what the ordinary path hands it (forward and backward, a model's strided views, GQA with an odd head
    dim), recording from a key's second call; dropout, tensor options and an lse of another layout than the
    forward's stay on the ordinary path; a copy PyTorch makes inside an op is not taken for a view."""
    run_stand_in_script(REPLAY_PREAMBLE + OPS_SCRIPT, timeout=900, unset=("FLASHTILE_LAUNCH_PLANS",))


def test_forked_replay_forks_before_the_first_side_launch_and_always_joins():
    """A forked plan's launches run in their recorded order; the side stream waits for the current one just
    before its first launch, and the current stream waits for the side one at the end, a raising launch
    included (the ordinary path's fork and join)."""
    import torch

    pytest.importorskip("triton")
    from flashtile.kernels import replay

    log = []

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

        def wait_stream(self, other):
            log.append(f"{self.cuda_stream} waits {other.cuda_stream}")

    class Launch:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def __call__(self, tensors, stream, arena):
            log.append(f"{self.name} on {stream}")
            if self.fails:
                raise RuntimeError("launch failed")

    main, side = Stream(1), Stream(2)
    for fails, want in ((False, ["pre on 1", "2 waits 1", "dq on 2", "dkdv on 1", "1 waits 2"]),
                        (True, ["pre on 1", "2 waits 1", "dq on 2", "dkdv on 1", "1 waits 2"])):
        log.clear()
        plan = replay.Plan(0, (), (), (), (), (Launch("pre"), Launch("dq"), Launch("dkdv", fails)),
                           torch.device("cpu"), 0, (), (), main=main, side=side, on_side=(False, True, False))
        try:
            plan._run_forked([], 1, None)
        except RuntimeError:
            assert fails
        assert log == want, log


def test_written_out_forked_replay_matches_the_loop(monkeypatch):
    """A plan of raw launches runs as one written-out function (``Plan.written_out``): its launches get the
    arguments ``_RawLaunch.__call__`` gives them (pointers into the inputs, fresh buffers and the arena, the side
    stream's handle on the side), fork before the first side launch and always join; a raising launch stops
    direct launches and the replay returns None, as the loop's does."""
    import torch

    pytest.importorskip("triton")
    from flashtile.kernels import configs, replay

    log, stopped = [], []

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

        def wait_stream(self, other):
            log.append(f"{self.cuda_stream} waits {other.cuda_stream}")

    def launcher(name, fails=False):
        def launch(*args):
            log.append((name, args[3], args[13:]))
            if fails:
                raise RuntimeError("launch failed")
        return launch

    monkeypatch.setattr(configs, "stop_direct_launches", stopped.append)
    head = (1, 1, 1, None, "function", False, False, None, None, "meta", None, None, None)
    main, side = Stream(1), Stream(2)
    # tensors: 0, 1 inputs; 2 a result; 3 and 4 buffers in the arena
    allocations = tuple(((64,), (1,), torch.float32, True) for _ in range(3))
    for fails in (False, True):
        launches = (replay._RawLaunch(launcher("pre"), (*head, None, None), ((13, 0, 0), (14, 3, 0)), (), None),
                    replay._RawLaunch(launcher("dq"), (*head, None, None, 5), ((13, 1, 8), (14, 4, 0)), (), None),
                    replay._RawLaunch(launcher("dkdv", fails), (*head, None), ((13, 2, 0),), (), None))
        plan = replay.Plan(2, allocations, (), (), (2,), launches, torch.device("cpu"), 0, (), (),
                           arena_bytes=1024, in_arena=(None, 0, 512), main=main, side=side,
                           on_side=(False, True, False), unused=(False, False, False))
        inputs = (torch.zeros(64), torch.zeros(64))
        log.clear()
        out = plan.written_out(inputs, 1)
        assert (out is None) == fails and (fails or out[0].shape == (64,))
        written = log[:]
        log.clear()
        tensors = plan.tensors(inputs)
        with contextlib.suppress(RuntimeError):
            plan._run_forked(tensors, 1, tensors[-1].data_ptr())
        looped = log[:]

        def order(entries):
            return [e if isinstance(e, str) else e[:2] for e in entries]

        assert order(written) == order(looped) == [("pre", 1), "2 waits 1", ("dq", 2), ("dkdv", 1), "1 waits 2"]
        # the same argument layout: the input's address (+ offset) and the arena's buffers at their offsets
        pre, dq = written[0][2], written[2][2]
        assert pre[0] == inputs[0].data_ptr() and dq[0] == inputs[1].data_ptr() + 8 and dq[2] == 5
        assert dq[1] - pre[1] == 512 and looped[2][2][1] - looped[0][2][1] == 512
        assert len(stopped) == fails
        stopped.clear()


def test_raw_launch_fills_a_descriptor_once_per_address(monkeypatch):
    """A raw launch encodes a TMA descriptor once per address and slot: a later launch over an address seen before
    (a fixed cache, a buffer the allocator hands out again) passes the descriptor filled then, one over a new
    address a new one; a slot keeps at most ``_DESCRIPTORS_KEPT`` (those it kept first), and a copy of the launch
    (``dataclasses.replace``) starts with none."""
    import dataclasses

    import torch

    pytest.importorskip("triton")
    from flashtile.kernels import replay

    fills, launched = [], []

    def fill(address, *layout):
        fills.append((address, layout))
        return ("descriptor", address, layout)

    monkeypatch.setattr(replay, "_fill_tma_descriptor", fill)
    # template: the launcher's 13 leading entries, then slot 13 (a pointer), 14 and 15 (descriptors)
    template = (1, 1, 1, None, "function", False, False, None, None, "meta", None, None, None, None, None, None)
    launch = replay._RawLaunch(lambda *args: launched.append(args), template, ((13, 0, 0),),
                               ((14, 1, 0, ("k box",)), (15, 1, 256, ("v box",))), None)
    a, b = torch.empty(1024, dtype=torch.uint8), torch.empty(1024, dtype=torch.uint8)
    for tensors, new_fills in (([a, a], 2), ([b, a], 0), ([a, b], 2), ([a, b], 0), ([b, a], 0)):
        before = len(fills)
        launch(tensors, stream=7)
        assert len(fills) - before == new_fills
        args = launched[-1]
        assert args[3] == 7 and args[13] == tensors[0].data_ptr()
        assert args[14] == ("descriptor", tensors[1].data_ptr(), ("k box",))
        assert args[15] == ("descriptor", tensors[1].data_ptr() + 256, ("v box",))
    copy = dataclasses.replace(launch, scratch_offset=0)
    before = len(fills)
    copy([b, a], stream=7)
    assert len(fills) - before == 2 and launch.filled is not copy.filled
    kept, fresh = replay._DESCRIPTORS_KEPT, dataclasses.replace(launch, scratch_offset=None)
    buffer = torch.empty(512 * (kept + 2), dtype=torch.uint8)
    for cycle in range(2):  # more addresses than a slot keeps, twice over: the kept ones are reused, no others
        before = len(fills)
        for i in range(kept + 2):
            fresh([a, buffer[512 * i:]], stream=7)
            assert all(len(by_address) <= kept for by_address in fresh.filled)
            assert launched[-1][14] == ("descriptor", buffer.data_ptr() + 512 * i, ("k box",))
        assert len(fills) - before == 2 * (kept + 2 if cycle == 0 else 2), (cycle, len(fills) - before)


def test_plan_settings_cover_the_settings_the_launch_path_reads():
    """Every FLASHTILE_ environment variable that the API, the ops or the kernels read is part of a plan's
    key, or is known not to change a dense call's launches."""
    import re

    from flashtile import _ops

    unrelated = {"FLASHTILE_VALUE_CHECKS",  # value checks of varlen and KV-cache indices
                 "FLASHTILE_FP8_BACKWARD",  # fp8_attn_func's backward only
                 "FLASHTILE_COMPILE_THREADS", "FLASHTILE_AUTOTUNE_CACHE",  # first calls only
                 "FLASHTILE_GLUON_DROPOUT",  # dropout calls' backward only (dropout calls are never recorded)
                 # A/B switches read once, at import
                 "FLASHTILE_BWD_MASK_EDGES_ONLY", "FLASHTILE_BWD_DQ_WAIT_AT_DS", "FLASHTILE_BWD_NAMED_RELEASE",
                 "FLASHTILE_BWD_DQ_SEND_LATE", "FLASHTILE_FWD_NAMED_SYNC", "FLASHTILE_FWD_TREE_MAX",
                 "FLASHTILE_FP8_P_REGISTERS", "FLASHTILE_FWD_RESCALE_SKIP", "FLASHTILE_FWD_LANE_SUM",
                 "FLASHTILE_FP8_P_WORDS", "FLASHTILE_FWD_P_PAIRS", "FLASHTILE_FP8_EXP2_POLY",
                 "FLASHTILE_FP8_Q_REGISTERS", "FLASHTILE_BWD_TAIL_SPLIT", "FLASHTILE_BWD_DV_AT",
                 "FLASHTILE_BWD_DELTA_AHEAD",
                 "FLASHTILE_PACKED_GRADS"}
    read = set()
    for path in [REPO / "flashtile" / "interface.py", REPO / "flashtile" / "_ops.py", REPO / "flashtile" / "fp8.py",
                 *(REPO / "flashtile" / "kernels").glob("*.py")]:
        read |= set(re.findall(r'os\.environ\.get\("(FLASHTILE_\w+|TRITON_\w+)"', path.read_text()))
    assert read, "no setting found: the pattern is stale"
    assert read - unrelated <= set(_ops.PLAN_SETTINGS), read - unrelated - set(_ops.PLAN_SETTINGS)


def test_recording_imports_no_dynamo():
    """A recording (a dispatch mode) does not import torch._dynamo, which PyTorch's default for a mode's
    ``__torch_dispatch__`` does on its first call: 1.8-2.9 s that a process's second call of a shape paid."""
    import subprocess
    import sys

    script = textwrap.dedent(
        """
        import sys, torch
        from flashtile.kernels.replay import _Recording
        with _Recording() as mode:
            x = torch.empty(6)
            y = x.view(2, 3)
        assert len(mode.allocated) == 1 and mode.views and mode.refusal is None, (mode.views, mode.refusal)
        assert "torch._dynamo" not in sys.modules
        """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


_GPU_CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, strided, options)
    (4, 256, 256, 8, 8, 64, "bfloat16", True, dict(causal=True)),
    (2, 113, 203, 6, 2, 59, "float16", False, dict(causal=True)),
    (2, 512, 512, 4, 1, 128, "bfloat16", False, dict(causal=False, softcap=10.0)),
    (1, 300, 300, 4, 4, 256, "float16", False, dict(window_size=(64, 0))),
    (3, 1, 77, 8, 2, 128, "bfloat16", False, dict(causal=True)),
    # few queries over many keys: split-KV (configs.split_count) and its combine kernel in the plan
    (2, 1, 3000, 8, 2, 128, "bfloat16", False, dict(causal=True)),
    (1, 2, 2500, 4, 4, 64, "float16", False, dict(causal=False)),
    # long enough for the sm90 Gluon forward (configs.gluon_forward_choice): its launch and descriptors in the plan
    (2, 1024, 1024, 4, 4, 128, "bfloat16", True, dict(causal=True)),
    (1, 1100, 1300, 8, 2, 64, "float16", False, dict(causal=False)),
]



def _count_replays(monkeypatch, runs: list) -> list:
    """``runs`` gains each plan that ``Plan.run`` replays from here on (a refused replay returns None and the call
    takes the ordinary path, with the same results: it is not counted, so "was replayed" means it was)."""
    from flashtile.kernels import replay

    def counted(self, tensors, run=replay.Plan.run):
        result = run(self, tensors)
        if result is not None:
            runs.append(self)
        return result

    monkeypatch.setattr(replay.Plan, "run", counted)
    return runs

@pytest.mark.gpu
@pytest.mark.parametrize("case", _GPU_CASES, ids=lambda c: f"b{c[0]}-sq{c[1]}-sk{c[2]}-h{c[3]}/{c[4]}-d{c[5]}")
def test_gpu_replayed_calls_meet_the_error_rule(case, monkeypatch):
    """Fresh random inputs on every call of one key: the fifth (replayed) call's out, lse and gradients
    against the float64 oracle by flash-attn's rule, into poisoned memory (the allocator's cached blocks
    are filled with NaN between calls), and inside a CUDA graph."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import _ops, flash_attn_func
    from tests.utils import check_against_oracle

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype_name, strided, options = case
    dtype = getattr(torch, dtype_name)
    runs = []
    _count_replays(monkeypatch, runs)

    def fresh():
        if strided:  # views of one projection's output, as a model makes them
            proj = torch.randn(batch, seqlen_q, 3 * nheads * headdim, dtype=dtype, device="cuda")
            return [x.detach().requires_grad_() for x in proj.view(batch, seqlen_q, 3, nheads, headdim).unbind(2)]
        return [torch.randn(batch, s, h, headdim, dtype=dtype, device="cuda", requires_grad=True)
                for s, h in ((seqlen_q, nheads), (seqlen_k, nheads_k), (seqlen_k, nheads_k))]

    def attend(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **options)
        return out, lse

    for _ in range(5):
        q, k, v = fresh()
        # Memory the allocator hands out next is NaN: an element the replayed kernels leave unwritten shows.
        torch.full((64 << 20,), float("nan"), dtype=torch.float32, device="cuda")
        check_against_oracle(attend, q, k, v, options.get("causal", False), **{
            name: value for name, value in options.items() if name in ("window_size", "softcap")})
    key = _ops.plan_key(q, k, v, None, options.get("causal", False), options.get("window_size", (-1, -1)),
                        options.get("softcap", 0.0))
    assert key in _ops._PLANS and _ops._PLANS[key].forward is not None and runs, "the calls were not replayed"

    # A training step captured in a CUDA graph (as test_gpu_cuda_graph_replay): the replays' launches and
    # buffers are the graph's.
    q, k, v = fresh()
    weight = torch.randn_like(q, dtype=torch.float32)

    def step():
        out = attend(q, k, v)[0]
        return (out, *torch.autograd.grad((out.float() * weight).sum(), (q, k, v)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    runs.clear()
    with torch.cuda.graph(graph):
        captured = step()
    assert runs, "the captured calls were not replayed"
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


def _plans_match_the_ordinary_path(fresh, grads, steps: int, monkeypatch, poison_memory: bool = False):
    """``steps`` times, on fresh inputs ``fresh()`` and a fresh dout: ``grads(q, k, v, dout)`` with launch plans off,
    then on (``poison_memory``: after filling memory the allocator hands out next with NaN), bitwise equal. Returns
    the last step's q, k, v."""
    import torch

    for step in range(steps):
        q, k, v = fresh()
        dout = torch.randn_like(q)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
        want = grads(q, k, v, dout)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "1")
        if poison_memory:
            torch.full((64 << 20,), float("nan"), dtype=torch.float32, device="cuda")
        got = grads(q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
    return q, k, v


@pytest.mark.gpu
def test_gpu_replayed_forked_backward_matches_the_ordinary_path(monkeypatch):
    """A backward large enough to fork its dQ pass onto the side stream (backward.SIDE_STREAM_MIN_WORK) is
    recorded with the fork and replayed with it: with fresh inputs each step, bitwise the ordinary path's
    gradients, read at once on the current stream (the replay joined the side stream back). Captured in a
    CUDA graph (on the recording's stream or another) the plan stands aside; the ordinary path's fork is
    captured and gives the same."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import _ops, flash_attn_func
    from flashtile.kernels import backward, configs

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    runs = []
    _count_replays(monkeypatch, runs)
    batch, seqlen, nheads, headdim = 4, 2048, 8, 128
    assert batch * nheads * seqlen * seqlen * headdim > backward.SIDE_STREAM_MIN_WORK
    # The Triton two passes at any length: on sm90 the Gluon one pass (which forks nothing) takes this shape. Plans
    # of their own: ones recorded under the default dispatch (same key) would replay the one pass.
    monkeypatch.setitem(configs.GLUON_BACKWARD_MIN_SEQLEN, (headdim, True), 1 << 62)
    monkeypatch.setattr(_ops, "_PLANS", {})
    monkeypatch.setattr(_ops, "_FAMILIES", {})

    def fresh():
        return [torch.randn(batch, seqlen, nheads, headdim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                for _ in range(3)]

    def grads(q, k, v, dout):
        out = flash_attn_func(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    q, k, v = _plans_match_the_ordinary_path(fresh, grads, 6, monkeypatch)
    forked = [plan for plan in runs if plan.side is not None]
    assert forked and any(forked[0].on_side) and not all(forked[0].on_side), "the forked backward was not replayed"
    entry = _ops._PLANS[_ops.plan_key(q, k, v, None, True, (-1, -1), 0.0)]
    assert any(plan.side is not None for plan in entry.backward.values() if not isinstance(plan, int))

    # Another key, recorded on a stream of the test's own (a graph cannot capture the default stream).
    batch += 1
    q, k, v = fresh()
    dout = torch.randn_like(q)
    recording = torch.cuda.Stream()
    recording.wait_stream(torch.cuda.current_stream())
    runs.clear()
    with torch.cuda.stream(recording):
        for _ in range(5):
            eager = grads(q, k, v, dout)
    torch.cuda.current_stream().wait_stream(recording)
    assert any(plan.side is not None and plan.main == recording for plan in runs)
    for stream in (None, recording):  # the graph's own capture stream, the recording's
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = grads(q, k, v, dout)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, captured)), stream


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_one_pass_backward_replays(causal, monkeypatch):
    """The sm90 one-pass backward (``configs.gluon_backward_choice``) is launches and allocations only (its units'
    kernel zeroes the dQ accumulator), so it is recorded and replayed: with fresh inputs each step (views of one
    projection's output, as a model makes them) and poisoned memory, the gradients bitwise the ordinary path's
    (plans off) on the same inputs, and the key's backward slot a plan."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import _ops, flash_attn_func
    from flashtile.kernels import configs, gluon_backward

    skip_unless_gluon_dispatch()
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    runs, calls = [], []
    _count_replays(monkeypatch, runs)
    one_pass = gluon_backward.gluon_attention_backward
    monkeypatch.setattr(gluon_backward, "gluon_attention_backward",
                        lambda *args, **kwargs: calls.append(kwargs) or one_pass(*args, **kwargs))
    batch, nheads, headdim = 1, 4, 128
    seqlen = configs.GLUON_BACKWARD_MIN_SEQLEN[headdim, causal]

    def fresh():
        proj = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=torch.bfloat16, device="cuda")
        return [x.detach().requires_grad_() for x in proj.view(batch, seqlen, 3, nheads, headdim).unbind(2)]

    def grads(q, k, v, dout):
        out = flash_attn_func(q, k, v, causal=causal)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    q, k, v = _plans_match_the_ordinary_path(fresh, grads, 5, monkeypatch, poison_memory=True)
    assert calls, "the backward did not take the one pass"
    entry = _ops._PLANS[_ops.plan_key(q, k, v, None, causal, (-1, -1), 0.0)]
    plans = [plan for plan in entry.backward.values() if not isinstance(plan, int)]
    assert plans and {id(plan) for plan in plans} & {id(plan) for plan in runs}, "the one pass was not replayed"


@pytest.mark.gpu
@pytest.mark.parametrize("index", [None, "paged", "batch_idx", "rotary"])
@pytest.mark.parametrize("splits", [0, 3])
def test_gpu_replayed_decoding_steps_match_the_ordinary_path(splits, index, monkeypatch):
    """Decoding steps with fresh queries and tokens each step, replayed from their plan, give bitwise the
    ordinary path's output, lse and caches (both run the same kernels on the same inputs); a paged pool's
    too (pages of 256 positions in shuffled order), entries picked by cache_batch_idx, and rotary tables."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import flash_attn_with_kvcache

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    runs = []
    _count_replays(monkeypatch, runs)
    batch, cache_len, nheads, nheads_k, headdim = 4, 1024, 16, 4, 128
    caches = [torch.randn(batch, cache_len, nheads_k, headdim, dtype=torch.bfloat16, device="cuda")
              for _ in range(2)]
    extra = {}
    if index == "paged":
        caches = [c.view(batch * cache_len // 256, 256, nheads_k, headdim) for c in caches]
        extra["block_table"] = torch.randperm(batch * cache_len // 256, device="cuda").to(torch.int32).view(batch, -1)
    if index == "batch_idx":
        extra["cache_batch_idx"] = torch.tensor([2, 0, 3, 1], dtype=torch.int32, device="cuda")
    if index == "rotary":
        angles = torch.rand(cache_len + 1, headdim // 2, device="cuda") * 6
        extra.update(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=False)
    twins = [c.clone() for c in caches]
    lengths = torch.tensor([5, 300, 700, 1000], dtype=torch.int32, device="cuda")
    for step in range(6):
        q = torch.randn(batch, 1, nheads, headdim, dtype=torch.bfloat16, device="cuda")
        k_new, v_new = (torch.randn(batch, 1, nheads_k, headdim, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
        want = flash_attn_with_kvcache(q, *twins, k_new, v_new, cache_seqlens=lengths, causal=True,
                                       num_splits=splits, return_softmax_lse=True, **extra)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "1")
        got = flash_attn_with_kvcache(q, *caches, k_new, v_new, cache_seqlens=lengths, causal=True,
                                      num_splits=splits, return_softmax_lse=True, **extra)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        assert all(torch.equal(a, b) for a, b in zip(caches, twins)), step
    assert runs, "no step was replayed"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2), (32, 8)], ids=["split", "gqa4"])
def test_gpu_plans_of_a_growing_cache_match_the_ordinary_path(heads, monkeypatch):
    """A cache that grows by one token a step (a Hugging Face dynamic cache: BHSD tensors read as BSHD views),
    four layers a step: each new length is recorded on its first call (the family rule) and replayed by the
    other layers, bitwise the ordinary path's output and lse at every length, lengths that are multiples of
    16 included."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import flash_attn_func

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "1")
    runs = []
    _count_replays(monkeypatch, runs)
    nheads, nheads_k = heads
    batch, headdim = 3, 128
    q = torch.randn(batch, 1, nheads, headdim, dtype=torch.bfloat16, device="cuda")
    caches = [torch.randn(batch, nheads_k, 2040, headdim, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for step in range(24):  # 2041 ... 2064: 2048 and 2064 are multiples of 16
        caches = [torch.cat([c, torch.randn(batch, nheads_k, 1, headdim, dtype=c.dtype, device="cuda")], 2)
                  for c in caches]
        k, v = (c.transpose(1, 2) for c in caches)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
        want = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "1")
        for layer in range(4):
            with torch.no_grad():
                got = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (step, layer)
    assert len(runs) >= 24 * 2, len(runs)  # at least two replays per length


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False], ids=["self", "cross"])
def test_gpu_replayed_varlen_calls_match_the_ordinary_path(shared, monkeypatch):
    """Packed calls with fresh inputs each step, replayed from their plan (their cu_seqlens checked
    once), give bitwise the ordinary path's output, lse and gradients."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import flash_attn_varlen_func

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    runs = []
    _count_replays(monkeypatch, runs)
    cu_q = torch.tensor([0, 300, 301, 777], dtype=torch.int32, device="cuda")
    cu_k = cu_q if shared else torch.tensor([0, 100, 600, 640], dtype=torch.int32, device="cuda")
    max_q, max_k = 476, int((cu_k[1:] - cu_k[:-1]).max())
    for step in range(6):
        q = torch.randn(777, 8, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        k, v = (torch.randn(int(cu_k[-1]), 2, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
                for _ in range(2))
        dout = torch.randn_like(q)
        results = []
        for setting in ("0", "1"):
            monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", setting)
            out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                 return_attn_probs=True)
            results.append((out, lse, *torch.autograd.grad(out, (q, k, v), dout)))
        assert all(torch.equal(a, b) for a, b in zip(*results)), step
    assert runs, "no call was replayed"


def _fp8_gpu_replays(monkeypatch) -> list:
    """Skip without a CUDA GPU with FP8 tensor cores; else default tiles, and a list that grows by one per plan
    replayed (``Plan.run``)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import fp8

    if not fp8._fp8_tensor_cores(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores")
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    return _count_replays(monkeypatch, [])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 300, 4, 2, 64, False), (2, 2048, 8, 8, 128, False), (1, 4096, 8, 2, 128, True),
                                   (1, 2048, 4, 4, 256, True)],
                         ids=["triton", "gluon", "gluon-gqa-causal", "gluon-d256-causal"])
@pytest.mark.parametrize("keys_fastest", [False, True], ids=["v-rows", "v-keys-fastest"])
def test_gpu_replayed_fp8_calls_match_the_ordinary_path(shape, keys_fastest, monkeypatch):
    """Dense FP8 calls with fresh inputs each step, replayed from their plan (the Triton FP8 forward at 300 tokens,
    the Gluon FP8 forward from 2,048; V copied keys-fastest or given so), give bitwise the ordinary path's output and
    lse."""
    import torch

    from flashtile import flash_attn_func, fp8

    runs = _fp8_gpu_replays(monkeypatch)
    batch, seqlen, nheads, nheads_k, headdim, causal = shape
    for step in range(6):
        q = torch.randn(batch, seqlen, nheads, headdim, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(batch, seqlen, nheads_k, headdim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        (q8, qd), (k8, kd) = fp8.quantize(q, nheads_k=nheads_k), fp8.quantize(k)
        v8, vd = fp8.quantize(v, keys_fastest=keys_fastest)
        results = []
        for setting in ("0", "1"):
            monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", setting)
            out, lse, _ = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                          return_attn_probs=True)
            results.append((out, lse))
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(*results)), step
    assert len(runs) >= 2, len(runs)  # (the key's first call notes it, the next ones record, then replays)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False], ids=["self", "cross"])
def test_gpu_replayed_fp8_varlen_calls_match_the_ordinary_path(shared, monkeypatch):
    """Packed FP8 calls with fresh inputs each step, replayed from their plan (their cu_seqlens checked once), give
    bitwise the ordinary path's output and lse."""
    import torch

    from flashtile import flash_attn_varlen_func, fp8

    runs = _fp8_gpu_replays(monkeypatch)
    cu_q = torch.tensor([0, 300, 301, 777], dtype=torch.int32, device="cuda")
    cu_k = cu_q if shared else torch.tensor([0, 100, 600, 640], dtype=torch.int32, device="cuda")
    max_q, max_k = 476, int((cu_k[1:] - cu_k[:-1]).max())
    for step in range(6):
        q = torch.randn(777, 8, 128, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(int(cu_k[-1]), 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        (q8, qd), (k8, kd) = fp8.quantize_varlen(q, cu_q, nheads_k=2), fp8.quantize_varlen(k, cu_k)
        v8, vd = fp8.quantize_varlen(v, cu_k)
        results = []
        for setting in ("0", "1"):
            monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", setting)
            out, lse, _ = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max_q, max_k, causal=True,
                                                 return_attn_probs=True, q_descale=qd, k_descale=kd, v_descale=vd)
            results.append((out, lse))
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(*results)), step
    assert runs, "no call was replayed"


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [300, 2048], ids=["triton", "gluon"])
def test_gpu_compiled_fp8_calls_replay_plans(seqlen, monkeypatch):
    """An FP8 flash_attn_func call under torch.compile(fullgraph=True) goes through the FP8 custom op, which replays
    its plans: fresh inputs every step, the output bitwise the eager call's with plans off."""
    import torch

    from flashtile import flash_attn_func, fp8

    runs = _fp8_gpu_replays(monkeypatch)

    def call(q, k, v, qd, kd, vd):
        return flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    compiled = torch.compile(call, fullgraph=True)
    for step in range(6):
        q, k, v = (torch.randn(2, seqlen, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "1")
        got = compiled(q8, k8, v8, qd, kd, vd)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
        want = call(q8, k8, v8, qd, kd, vd)
        torch.cuda.synchronize()
        assert torch.equal(got, want), step
    assert runs, "no call was replayed"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("shape", [(2, 256, 4, 64), (4, 2048, 8, 128)], ids=["small", "forked"])
def test_gpu_compiled_steps_replay_plans(mode, shape, monkeypatch):
    """torch.compile(fullgraph=True)'s generated code calls flashtile's custom ops, which replay launch plans
    (the forked backward's too): the step's gradient bitwise that of the same compiled step with plans off,
    fresh inputs every step. Under CUDA graphs (reduce-overhead) the ops run only while the trees warm up
    and capture (the key's first calls: no plan yet), then the graph replays: the same gradients."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flashtile import _ops
    from flashtile.kernels import configs
    from tests.utils import projection_step

    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    # The forked case is the Triton two passes' (on sm90 the Gluon one pass, which forks nothing, takes its length);
    # the compiled ops' plans of its own
    monkeypatch.setitem(configs.GLUON_BACKWARD_MIN_SEQLEN, (shape[3], True), 1 << 62)
    monkeypatch.setattr(_ops, "_OP_PLANS", {})
    runs = []
    _count_replays(monkeypatch, runs)
    torch._dynamo.reset()
    _ops._OP_PLANS.clear()
    torch.manual_seed(sum(shape))
    _, weight, step = projection_step(*shape)
    compiled = torch.compile(step, fullgraph=True, mode=None if mode == "default" else mode)

    def grad(x):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return torch.autograd.grad(compiled(x, weight), weight)[0].clone()

    for i in range(6):
        x = torch.randn(shape[0], shape[1], 192, device="cuda", dtype=torch.bfloat16)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "0")
        want = grad(x)
        monkeypatch.setenv("FLASHTILE_LAUNCH_PLANS", "1")
        got = grad(x)
        assert torch.equal(got, want), i
    if mode == "reduce-overhead":
        return
    assert runs, "the compiled steps' ops replayed no plan"
    if shape[1] == 2048:
        assert any(plan.side is not None for plan in runs), "the forked backward was not replayed"
