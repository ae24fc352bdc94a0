"""Context parallelism on gloo: 2 and 4 CPU processes against single-process attention.

Every process builds the same full inputs from one seed, runs the distributed function on its shard,
and the gathered out, lse, dq, dk, dv must match single-process flashtile (the tiled PyTorch path).
"""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtile import flash_attn_func, flash_attn_varlen_func
from flashtile.distributed import (
    gather_sequence,
    gather_varlen,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    shard_sequence,
    shard_varlen,
    ulysses_attn_func,
    ulysses_attn_varlen_func,
    unshard_sequence,
    unshard_varlen,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}

CASES = [
    # (function, causal, layout, nheads, nheads_k, dtype)
    ("ring", False, "zigzag", 4, 4, torch.float64),
    ("ring", True, "zigzag", 4, 4, torch.float64),
    ("ring", True, "contiguous", 4, 2, torch.float64),
    ("ring", True, "zigzag", 4, 1, torch.float32),
    ("ring", False, "contiguous", 4, 2, torch.float32),
    ("ring_qkvpacked", True, "zigzag", 4, 4, torch.float64),
    ("ulysses", True, "zigzag", 4, 4, torch.float64),
    ("ulysses", False, "contiguous", 8, 2, torch.float64),
    ("ulysses", True, "contiguous", 4, 1, torch.float32),
]


def _check_case(rank, world, name, causal, layout, nheads, nheads_k, dtype, device="cpu", seqlen_per_rank=12):
    torch.manual_seed(1234)
    seqlen, headdim = seqlen_per_rank * world, 16 if device == "cpu" else 128
    q = torch.randn(2, seqlen, nheads, headdim, dtype=dtype, device=device)
    k = torch.randn(2, seqlen, nheads_k, headdim, dtype=dtype, device=device)
    v = torch.randn(2, seqlen, nheads_k, headdim, dtype=dtype, device=device)
    dout = torch.randn(2, seqlen, nheads, headdim, dtype=dtype, device=device)
    if name == "ring_qkvpacked":
        k, v = k.repeat_interleave(nheads // nheads_k, 2), v.repeat_interleave(nheads // nheads_k, 2)

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref, _ = flash_attn_func(*full, causal=causal, return_attn_probs=True)
    grads_ref = torch.autograd.grad(out_ref, full, dout)

    local = [shard_sequence(x, rank, world, layout=layout).detach().requires_grad_() for x in (q, k, v)]
    dout_local = shard_sequence(dout, rank, world, layout=layout)
    lse = None
    if name == "ring":
        out, lse, _ = ring_flash_attn_func(*local, causal=causal, layout=layout, return_attn_probs=True)
        grads = torch.autograd.grad(out, local, dout_local)
    elif name == "ring_qkvpacked":
        qkv = torch.stack([x.detach() for x in local], dim=2).requires_grad_()
        out = ring_flash_attn_qkvpacked_func(qkv, causal=causal, layout=layout)
        grads = torch.autograd.grad(out, qkv, dout_local)[0].unbind(2)
    else:
        out = ulysses_attn_func(*local, causal=causal, layout=layout)
        grads = torch.autograd.grad(out, local, dout_local)

    checks = [("out", out, out_ref, 1)] + [(n, g, r, 1) for n, g, r in zip(("dq", "dk", "dv"), grads, grads_ref)]
    if lse is not None:
        checks.append(("lse", lse, lse_ref, 2))
    if dtype in TOLERANCE:
        # fp32/fp64: the ring's sums run in another order than single-process attention; nothing else.
        for what, got, want, dim in checks:
            gathered = gather_sequence(got.detach().contiguous(), dim=dim, layout=layout)
            err = (gathered.double() - want.double()).abs().max().item()
            label = f"{name} causal={causal} {layout} H={nheads}/{nheads_k} {dtype}"
            assert err <= TOLERANCE[dtype], f"{label}: {what} err {err:.2e}"
        return
    # bf16/fp16 on GPUs: the 2x / 3x rule against the float64 oracle, with single-GPU flashtile as the
    # baseline error (it is itself held to the rule against plain PyTorch in tests/kernels).
    from flashtile.reference import attention_ref

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    oracle_out, oracle_lse = attention_ref(*leaves, causal=causal)
    oracle = [oracle_out] + list(torch.autograd.grad(oracle_out, leaves, dout.double())) + [oracle_lse]
    for (what, got, want, dim), truth in zip(checks, oracle):
        gathered = gather_sequence(got.detach().contiguous(), dim=dim, layout=layout).double()
        factor = 2.0 if what in ("out", "lse") else 3.0
        err, base = (gathered - truth).abs().max().item(), (want.double() - truth).abs().max().item()
        assert err <= factor * base + 1e-3, f"{name} {layout} causal={causal}: {what} err {err:.2e} base {base:.2e}"


def _packed_inputs(seed, lengths, nheads, nheads_k, headdim):
    """cu_seqlens, total tokens and float64 packed q, k, v, dout for sequences of ``lengths``."""
    torch.manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, nheads, headdim, dtype=torch.float64)
    k, v = (torch.randn(total, nheads_k, headdim, dtype=torch.float64) for _ in range(2))
    return cu, total, q, k, v, torch.randn_like(q)


def _check_ulysses_varlen(rank, world, causal, window=(-1, -1)):
    """Packed sequences of 5, 13, 1, 21 and 8 tokens (48, sliced evenly so sequences cross ranks)."""
    lengths = [5, 13, 1, 21, 8]
    cu, total, q, k, v, dout = _packed_inputs(99, lengths, 8, 2, 16)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = flash_attn_varlen_func(*full, cu, cu, max(lengths), max(lengths), causal=causal, window_size=window)
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    piece = total // world
    mine = slice(rank * piece, (rank + 1) * piece)
    local = [x[mine].clone().requires_grad_() for x in (q, k, v)]
    out = ulysses_attn_varlen_func(*local, cu, cu, max(lengths), max(lengths), causal=causal, window_size=window)
    grads = torch.autograd.grad(out, local, dout[mine])
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
        err = (got - want[mine]).abs().max().item()
        assert err <= TOLERANCE[torch.float64], f"ulysses varlen causal={causal} window={window}: {what} err {err:.2e}"


def _check_ring_varlen_all_empty(rank, world):
    """Every sequence empty: no rows on any rank, empty out and lse, and empty gradients (not an error)."""
    q, k, v = (torch.randn(0, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.zeros(3, dtype=torch.int32)
    out, lse, _ = ring_flash_attn_varlen_func(q, k, v, cu, 0, causal=True, return_attn_probs=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


def _check_ring_varlen(rank, world, causal, layout):
    """Packed sequences of 16, 48, 0 and 32 tokens, each sharded on its own; GQA."""
    lengths = [16, 48, 0, 32]
    cu, total, q, k, v, dout = _packed_inputs(7, lengths, 4, 2, 16)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref, _ = flash_attn_varlen_func(*full, cu, cu, max(lengths), max(lengths), causal=causal,
                                                 return_attn_probs=True)
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    local = [shard_varlen(x, cu, rank, world, layout=layout).requires_grad_() for x in (q, k, v)]
    out, lse, _ = ring_flash_attn_varlen_func(*local, cu, max(lengths), causal=causal, layout=layout,
                                              return_attn_probs=True)
    grads = torch.autograd.grad(out, local, shard_varlen(dout, cu, rank, world, layout=layout))
    checks = [("out", out, out_ref, 0), ("lse", lse, lse_ref, 1)]
    checks += [(n, g, r, 0) for n, g, r in zip(("dq", "dk", "dv"), grads, grads_ref)]
    for what, got, want, dim in checks:
        gathered = gather_varlen(got.detach().contiguous(), cu, dim=dim, layout=layout)
        err = (gathered - want.double()).abs().max().item()
        assert err <= TOLERANCE[torch.float64], f"ring varlen causal={causal} {layout}: {what} err {err:.2e}"


def _check_ring_softcap(rank, world, causal):
    torch.manual_seed(3)
    q, k, v, dout = (torch.randn(1, 8 * world, 2, 16, dtype=torch.float64) for _ in range(4))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = flash_attn_func(*full, causal=causal, softcap=2.0)
    grads_ref = torch.autograd.grad(out_ref, full, dout)
    local = [shard_sequence(x, rank, world).requires_grad_() for x in (q, k, v)]
    out = ring_flash_attn_func(*local, causal=causal, softcap=2.0)
    grads = torch.autograd.grad(out, local, shard_sequence(dout, rank, world))
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
        err = (gather_sequence(got.detach().contiguous()) - want).abs().max().item()
        assert err <= TOLERANCE[torch.float64], f"ring softcap causal={causal}: {what} err {err:.2e}"


def _check_errors(rank, world):
    q = torch.randn(1, 7, 2, 16, dtype=torch.float64)  # odd local length
    try:
        ring_flash_attn_func(q, q, q, causal=True, layout="zigzag")
    except ValueError as exc:
        assert "even local sequence length" in str(exc)
    else:
        raise AssertionError("an odd zigzag shard must be rejected")
    q = torch.randn(1, 8, 3, 16, dtype=torch.float64)
    if world > 1 and 3 % world:
        try:
            ulysses_attn_func(q, q, q)
        except ValueError as exc:
            assert "multiple of the world size" in str(exc)
        else:
            raise AssertionError("heads that do not divide by the world size must be rejected")
    # A bad argument on one rank only: every rank raises (naming that rank), none is left waiting.
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    try:
        ring_flash_attn_func(q.float() if rank == 0 else q, q, q)
    except (ValueError, TypeError) as exc:
        assert rank == 0 or "rank 0" in str(exc), exc  # rank 0 raises its own error, the others name it
    else:
        raise AssertionError("a bad argument on rank 0 must stop every rank")
    # Options that differ between ranks would silently compute something else: caught.
    try:
        ring_flash_attn_func(q, q, q, softcap=2.0 if rank == 0 else 0.0)
    except ValueError as exc:
        assert "every rank must pass the same" in str(exc), exc
    else:
        raise AssertionError("a softcap that differs between ranks must be rejected")
    # cu_seqlens that differ between ranks (ring and Ulysses varlen).
    cu = torch.tensor([0, 16] if rank == 0 else [0, 8, 16], dtype=torch.int32)
    x = torch.randn(16 // world, 8, 16, dtype=torch.float64)
    for fn, args in ((ring_flash_attn_varlen_func, (cu, 16)), (ulysses_attn_varlen_func, (cu, cu, 16, 16))):
        try:
            fn(x, x, x, *args)
        except ValueError as exc:
            assert "cu_seqlens" in str(exc), exc
        else:
            raise AssertionError(f"{fn.__name__}: cu_seqlens differing between ranks must be rejected")
    # Unequal shards across ranks are caught before any attention runs.
    q = torch.randn(1, 4 + 2 * rank, 2, 16, dtype=torch.float64)
    try:
        ring_flash_attn_func(q, q, q)
    except ValueError as exc:
        assert "same local sequence length" in str(exc)
    else:
        raise AssertionError("unequal shards must be rejected")
    # A packed tensor of the wrong shape on one rank: it is checked before it is unbound, and still every rank
    # raises (the others once waited in the exchange for that rank).
    q = torch.randn(1, 8, 2, 16, dtype=torch.float64)
    kv = torch.randn(1, 8, 2, 2, 16, dtype=torch.float64)
    try:
        ring_flash_attn_kvpacked_func(q, kv[:, :, :1] if rank == 0 else kv)
    except ValueError as exc:
        assert "kv must be a tensor of shape" in str(exc) and (rank == 0 or "rank 0" in str(exc)), exc
    else:
        raise AssertionError("a bad packed kv on rank 0 must stop every rank")
    # Ulysses names its own options (it has no softcap).
    q = torch.randn(1, 8, 2 * world, 16, dtype=torch.float64)
    try:
        ulysses_attn_func(q, q, q, softmax_scale=0.5 if rank else 0.25)
    except ValueError as exc:
        assert "options (softmax_scale, causal);" in str(exc), exc
    else:
        raise AssertionError("a softmax_scale that differs between ranks must be rejected")
    # A rank calling with a group it is not in is told so (the group's ranks are not waiting for it).
    outside = dist.new_group([0])  # (every rank makes the group; rank 0 alone is in it)
    if rank != 0:
        try:
            ring_flash_attn_func(q, q, q, group=outside)
        except ValueError as exc:
            assert "not in the process group" in str(exc), exc
        else:
            raise AssertionError("a call from outside its group must be refused")


def _worker(rank, world, init_file, error_file, backend="gloo"):
    if backend == "gloo":
        os.environ["FLASHTILE_BACKEND"] = "torch"
        torch.set_num_threads(1)
    else:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on shared machines
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if backend == "gloo":
            for case in CASES:
                if case[0] == "ulysses" and case[3] % world:
                    continue  # Ulysses needs the heads to divide by the world size (checked in _check_errors)
                _check_case(rank, world, *case)
            for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (True, (4, 0))):
                _check_ulysses_varlen(rank, world, causal, window)
            for causal, layout in ((True, "zigzag"), (False, "contiguous"), (True, "contiguous")):
                _check_ring_varlen(rank, world, causal, layout)
            _check_ring_varlen_all_empty(rank, world)
            for causal in (False, True):
                _check_ring_softcap(rank, world, causal)
            if world > 1:  # (disagreement between ranks needs two of them)
                _check_errors(rank, world)
            if world == 2:
                _check_compiled(rank, world)
        else:
            for name, causal, layout, nheads, nheads_k, _ in CASES:
                if name == "ulysses" and nheads % world:
                    continue
                _check_case(rank, world, name, causal, layout, nheads, nheads_k, torch.bfloat16,
                            device=f"cuda:{rank}", seqlen_per_rank=512)
    except Exception:
        with open(f"{error_file}.{rank}", "w") as fh:
            fh.write(traceback.format_exc())
        raise
    # Every rank done with its sends before any tears the group down.
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's threads have been seen to abort the process at exit
    # ("terminate called without an active exception", about one run in ten) after every check passed.
    # The checks' outcome is already decided here; see the session note for the open investigation.
    os._exit(0)


def _check_compiled(rank, world):
    """Under torch.compile the ranks' agreement exchange (an object all-gather, which a graph cannot hold) is
    skipped, each rank checking its own arguments: the compiled calls trace and give the eager results."""
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 8 * world, 4, 16, dtype=torch.float64) for _ in range(3))
    local = [shard_sequence(x, rank, world) for x in (q, k, v)]
    for function in (ring_flash_attn_func, ulysses_attn_func):
        compiled = torch.compile(function, backend="eager")
        torch.testing.assert_close(compiled(*local, causal=True), function(*local, causal=True), rtol=0, atol=0)


# world 1: a context-parallel group of one rank (degree 1 inside data parallelism); its ring backward once sent
# the gradients to itself, which gloo refuses.
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_context_parallel_matches_single_process(world, tmp_path):
    init_file = tmp_path / "init"
    error_file = tmp_path / "error"
    try:
        mp.spawn(_worker, args=(world, str(init_file), str(error_file)), nprocs=world, join=True)
    except Exception as exc:
        messages = [p.read_text() for p in tmp_path.glob("error.*")]
        pytest.fail("\n".join(messages) or f"a worker failed: {exc!r}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_context_parallel_nccl_bf16(tmp_path):
    world = torch.cuda.device_count()
    try:
        mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path / "error"), "nccl"), nprocs=world)
    except Exception:
        pytest.fail("\n".join(p.read_text() for p in tmp_path.glob("error.*")) or "a worker failed")


def test_shard_unshard_round_trip():
    x = torch.arange(2 * 24).reshape(2, 24)  # e.g. position ids (batch, seqlen)
    for layout in ("zigzag", "contiguous"):
        shards = [shard_sequence(x, r, 3, dim=1, layout=layout) for r in range(3)]
        assert torch.equal(unshard_sequence(shards, dim=1, layout=layout), x)
    assert shard_sequence(x, 0, 3)[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    with pytest.raises(ValueError, match="multiple of 6"):
        shard_sequence(torch.zeros(1, 10), 0, 3)
    with pytest.raises(ValueError, match="layout"):
        shard_sequence(x, 0, 3, layout="striped")


def test_shard_unshard_varlen_round_trip():
    cu = torch.tensor([0, 8, 8, 24], dtype=torch.int32)  # lengths 8, 0, 16
    x = torch.arange(24 * 2).reshape(24, 2)
    for layout in ("zigzag", "contiguous"):
        shards = [shard_varlen(x, cu, r, 2, layout=layout) for r in range(2)]
        assert all(s.shape[0] == 12 for s in shards)
        assert torch.equal(unshard_varlen(shards, cu, layout=layout), x)
    # zigzag over 2 ranks: rank 0 holds chunks 0 and 3 of each sequence (of 8: tokens 0-1, 6-7; of 16: 8-11, 20-23)
    assert shard_varlen(x, cu, 0, 2)[:, 0].tolist() == [0, 2, 12, 14, 16, 18, 20, 22, 40, 42, 44, 46]
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_varlen(x, torch.tensor([0, 4, 24], dtype=torch.int32), 0, 4)
    with pytest.raises(ValueError, match="start at 0 and be non-decreasing"):
        shard_varlen(x, torch.tensor([0, 16, 8, 24], dtype=torch.int32), 0, 2)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        shard_varlen(x, torch.tensor([0, 8, 16], dtype=torch.int32), 0, 2)


def test_agreement_skipped_without_value_checks(monkeypatch):
    """FLASHTILE_VALUE_CHECKS=0: only the local checks run (no collective, so no process group needed
    beyond being initialised)."""
    from flashtile.distributed import agreement

    monkeypatch.setattr(agreement, "require_initialized", lambda: None)
    monkeypatch.setenv("FLASHTILE_VALUE_CHECKS", "0")
    assert agreement.agreed(None, lambda: (1, 2), "facts") == (1, 2)
    with pytest.raises(ValueError, match="local"):
        agreement.agreed(None, lambda: (_ for _ in ()).throw(ValueError("local")), "facts")
