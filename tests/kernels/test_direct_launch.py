"""configs._DirectLaunch hands the driver exactly what Triton's own launch path hands it.

Runs in a subprocess under benchmarks/lab/stand_in_hopper.py (Triton's real binding, specialization and
sm_90 compilation; only the driver call is recorded instead of made), so it needs no GPU: for the
forward, the three backward kernels, the split-KV decode and its combine, on shapes whose integer arguments
specialize differently within one autotuning bucket, every launch's grid, compiled function, metadata
and kernel arguments match between FLASHTILE_DIRECT_LAUNCH=0 and the direct path (also the forward's
host-made TMA descriptors, whose boxes a pre-run hook sets); a launcher that
refuses a direct call makes flashtile repeat the launch through Triton's path and stop direct launches.
"""

import textwrap

from tests.utils import needs_triton_36, run_stand_in_script

pytestmark = needs_triton_36  # direct launches call Triton 3.6's launcher (configs.direct_launches_possible)

SCRIPT = textwrap.dedent(
    """
    from flashtile import flash_attn_func, flash_attn_with_kvcache

    def calls(seqlen):
        torch.manual_seed(seqlen)
        q = torch.randn(2, seqlen, 4, 40, dtype=torch.float16, requires_grad=True)
        k, v = (torch.randn(2, seqlen, 2, 40, dtype=torch.float16, requires_grad=True) for _ in range(2))
        out = flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        cache = torch.randn(2, 64, 2, 40, dtype=torch.float16)
        lengths = torch.tensor([seqlen, 64], dtype=torch.int32)
        flash_attn_with_kvcache(q[:, :1].detach(), cache, cache, cache_seqlens=lengths, num_splits=3)

    def launches(seqlen, direct):
        os.environ["FLASHTILE_DIRECT_LAUNCH"] = "1" if direct else "0"
        if not direct or seqlen == 32:
            # Direct launches made at length 32 stay for 17 and 31: a specialization they have not seen
            # goes through Triton's path once, then through them.
            configs._DIRECT.clear()
        calls(seqlen)
        calls(seqlen)  # the first call of a key goes through the autotuner, the second makes the direct launch
        Launcher.records.clear()
        calls(seqlen)
        took = launched_directly(Launcher.records)
        assert all(took) if direct else not any(took), took
        return [(name, args[:6], args[9:]) for name, args in Launcher.records], len(configs._DIRECT)

    from triton.tools.tensor_descriptor import TensorDescriptor

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        if isinstance(a, TensorDescriptor):
            return (isinstance(b, TensorDescriptor) and same(a.base, b.base)
                    and (a.shape, a.strides, a.block_shape) == (b.shape, b.strides, b.block_shape))
        return a is b or a == b

    for seqlen in (32, 17, 31):  # one bucket (32), three specializations of the length arguments
        triton_path, made = launches(seqlen, direct=False)
        direct_path, made_direct = launches(seqlen, direct=True)
        # forward, dQ and dK/dV passes (a small backward: no preprocess kernel), split decoding and its combine
        assert made == 0 and made_direct == 5, (made, made_direct)
        assert len(triton_path) == len(direct_path) == 5, (len(triton_path), len(direct_path))
        for (name_a, head_a, args_a), (name_b, head_b, args_b) in zip(triton_path, direct_path):
            assert name_a == name_b, (name_a, name_b)
            assert len(args_a) == len(args_b), name_a
            assert all(same(x, y) for x, y in zip(head_a, head_b)), (name_a, head_a, head_b)
            bad = [i for i, (x, y) in enumerate(zip(args_a, args_b)) if not same(x, y)]
            assert not bad, (name_a, bad)

    from triton import knobs

    # A knob that changes the compiled kernel (debug), a hook set directly or registered: Triton's path.
    print_none = lambda metadata: None
    knobs.runtime.debug = True
    Launcher.records.clear(); calls(31)
    assert not any(launched_directly(Launcher.records)), "debug knob changed: Triton's path expected"
    knobs.runtime.debug = False
    enter = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = None  # allowed by Triton (a hook or None instead of a chain)
    Launcher.records.clear(); calls(31)
    knobs.runtime.launch_enter_hook = enter
    enter.add(print_none)
    Launcher.records.clear(); calls(31)
    assert not any(launched_directly(Launcher.records)), "a registered launch hook: Triton's path expected"
    enter.remove(print_none)
    Launcher.records.clear(); calls(31)
    assert all(launched_directly(Launcher.records))

    # Another device: its own compiled kernels, never device 0's.
    device0 = {id(a[4]) for _, a in Launcher.records}
    stand_in_hopper.current_device[0] = 1
    calls(31); calls(31)
    Launcher.records.clear(); calls(31)
    assert all(launched_directly(Launcher.records)) and not device0 & {id(a[4]) for _, a in Launcher.records}
    stand_in_hopper.current_device[0] = 0

    # The forward's host-made TMA descriptors (as on a Hopper GPU with aligned tensors): their boxes get the
    # tile's rows from the pre-run hook on both paths.
    use_tma = configs.use_tma
    configs.use_tma = lambda *tensors, rows: rows >= configs.TMA_MIN_ROWS

    def forward_launches(direct):
        os.environ["FLASHTILE_DIRECT_LAUNCH"] = "1" if direct else "0"
        configs._DIRECT.clear()
        q = torch.randn(2, 48, 4, 40, dtype=torch.float16)
        k, v = (torch.randn(2, 48, 2, 40, dtype=torch.float16) for _ in range(2))
        flash_attn_func(q, k, v, causal=True); flash_attn_func(q, k, v, causal=True)
        Launcher.records.clear(); flash_attn_func(q, k, v, causal=True)
        assert len(Launcher.records) == 1 and launched_directly(Launcher.records) == [direct]
        return Launcher.records[0][1]

    args_a, args_b = forward_launches(False), forward_launches(True)
    descriptors = [x for x in args_a if isinstance(x, TensorDescriptor)]
    assert len(descriptors) == 2 and all(d.block_shape[1] > 1 and d.block_shape[3] == 64 for d in descriptors)
    assert len(args_a) == len(args_b) and all(same(x, y) for x, y in zip(args_a[9:], args_b[9:]))
    configs.use_tma = use_tma
    configs._DIRECT.clear(); calls(32); calls(32)  # direct launches of length 32 again, for the next part

    # A launcher that refuses the direct call: the launch is repeated through Triton's path and direct
    # launches stop for the process.
    refuse_direct_launches()
    Launcher.records.clear()
    calls(32)
    assert configs._DIRECT_BROKEN and not configs._DIRECT
    assert len(Launcher.records) == 5 and not any(launched_directly(Launcher.records))
    print("ok")
    """
)


def test_direct_launch_matches_triton_launch():
    run_stand_in_script(SCRIPT, timeout=600)
