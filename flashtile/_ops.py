"""The backends behind ``torch.library`` custom ops, so ``torch.compile`` traces flashtile whole.

Two ops, each with a shape-only fake implementation (for tracing) and the forward registered with
autograd (its backward calls the backward op):

* ``flashtile::attention_forward(q, k, v, ...) -> (out, lse)``
* ``flashtile::attention_backward(dout, q, k, v, out, lse, ...) -> (dq, dk, dv)``

(dropout calls take their twins ``attention_forward_dropout`` and ``attention_backward_dropout``, tagged
``cudagraph_unsafe``), and ``flashtile::fp8_attention_forward`` (FP8 inputs, no autograd:
``flashtile.fp8.fp8_attn_func`` differentiates around it).

Their arguments are the flattened ``AttentionOptions`` (custom ops take tensors and scalars only), the
varlen ``cu_seqlens`` (or None) and the backend name; the dropout seed as a one-element int64 host tensor
(None without dropout), so that torch.compile draws it in the graph instead of breaking it at ``.item()``.
``run_forward``/``run_backward`` are the plain dispatch to the Triton kernels or the PyTorch path that the ops
wrap. Plain eager calls reach the same two functions through ``_EagerAttention`` instead, without the ops'
dispatch cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import reference
from .options import AttentionOptions, as_bounds

_KERNELS: list[ModuleType] = []  # the kernels package once imported (an import statement per call costs µs)


def _triton_backend() -> ModuleType:
    if _KERNELS:
        return _KERNELS[0]
    try:
        from . import kernels
    except ImportError as exc:  # no triton on this platform, or a module it needs (the interpreter's numpy)
        missing = getattr(exc, "name", None)
        needs = "the 'triton' package" if missing in (None, "triton") or missing.startswith("triton.") else (
            f"the '{missing}' package (triton imports it{', for the interpreter' if missing == 'numpy' else ''})")
        raise RuntimeError(f"flashtile: the Triton backend needs {needs} ({exc})") from exc
    _KERNELS.append(kernels)
    return kernels


_NO_GUARD = contextlib.nullcontext()  # (reusable: entering it does nothing)


def _on_device(tensor: Tensor):
    """Make the device of ``tensor`` the current CUDA device while the kernels launch (Triton launches on the
    current device's current stream), as flash-attn's device guard does; nothing to do when it already is.
    It reads the tensor, not a ``torch.device`` object's fields: inside autograd's backward those cost
    microseconds on the hot path of a replayed call."""
    if not tensor.is_cuda or tensor.get_device() == torch._C._cuda_getDevice():
        return _NO_GUARD
    return torch.cuda.device(tensor.get_device())


# Dropout during CUDA-graph capture: refused by the interface, and by the forward op where torch.compile traced the
# call (the capture query does not trace).
DROPOUT_CAPTURED = ("dropout_p={dropout_p!r} during CUDA-graph capture: the dropout seed is drawn on the host, so "
                    "every replay would repeat one mask; capture with dropout_p=0")


def _lse_dtype(q: Tensor) -> torch.dtype:
    # float64 inputs (PyTorch path only) keep a float64 lse for the backward; the user sees float32.
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lse_shape(q: Tensor, varlen: bool) -> tuple[int, ...]:
    # packed: (nheads, total_q); dense: (batch, nheads, seqlen_q)
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def run_forward(q, k, v, opts: AttentionOptions, backend: str, varlen=None, paged=None, num_splits: int = 1,
                before_launch: Callable[[], None] | None = None, fp8=None, append=None):
    """(out, lse) from the chosen backend; empty problems return without a launch.

    ``paged`` = (block_table, page_size) with ``varlen`` bounds whose key starts are logical positions
    and k, v the flattened page pool (``flash_attn_with_kvcache`` only). ``num_splits > 1`` asks the
    kernels for split-KV (the PyTorch path computes the same result unsplit). ``before_launch``: checks
    that must pass before any attention kernel starts (the varlen values' deferred read); the Triton
    backend calls it just before its launch, the others first. ``fp8``: FP8 inputs' (q_descale, k_descale,
    v_descale, out_dtype, cache) for the Triton backend's FP8 kernels (``flashtile.fp8``; see
    ``kernels.forward.attention_forward``), forward only. ``append``: a decoding step's new (k, v), which the
    Triton forward appends to the cache itself (``kernels.forward.attention_forward``; non-empty q and k).
    """
    if fp8 is not None and backend != "triton":
        raise RuntimeError("FP8 kernels run on the Triton backend only (flashtile.fp8 dequantizes elsewhere)")
    if append is not None and (backend != "triton" or q.numel() == 0 or k.numel() == 0):
        raise ValueError("append: the Triton backend's, with non-empty q and k")
    if before_launch is not None and (backend != "triton" or q.numel() == 0 or k.numel() == 0):
        before_launch()
        before_launch = None
    if q.numel() == 0 or k.numel() == 0:
        # Nothing to launch: empty queries, or queries that see no key (out 0, lse -inf, or the sink).
        out = torch.zeros(q.shape, dtype=q.dtype if fp8 is None or fp8[0] is None else fp8[3], device=q.device)
        lse = torch.full(_lse_shape(q, varlen is not None), -math.inf, dtype=_lse_dtype(q), device=q.device)
        if opts.sink is not None and q.numel():
            lse.copy_(opts.sink.to(lse.dtype).view(-1, 1).expand_as(lse) if varlen else
                      opts.sink.to(lse.dtype).view(1, -1, 1).expand_as(lse))
        return out, lse
    if backend == "triton":
        with _on_device(q):
            return _triton_backend().attention_forward(q, k, v, opts, varlen, paged, num_splits, before_launch, fp8,
                                                       append)
    if paged is not None:
        k, v, varlen = _gather_pages(k, v, varlen, *paged)
    if varlen is not None:
        return reference.varlen_attention_forward(q, k, v, *varlen, opts)
    return reference.attention_forward(q, k, v, opts)


def _gather_pages(k, v, varlen, block_table, page_size):
    """The PyTorch path's view of a paged cache: each sequence's pages copied into one row, up to the last
    position any sequence reads (not the block table's whole capacity: a long cache's unused pages)."""
    batch, max_pages = block_table.shape
    bounds_q, bounds_k, max_q, _ = varlen
    bounds_k = as_bounds(bounds_k)
    length = max_pages * page_size
    if k.device.type == "cpu":  # (a host read: not on a GPU, where the PyTorch backend may run under capture)
        length = min(int((bounds_k[:, 0] + bounds_k[:, 1]).max()), length)
    positions = torch.arange(length, device=k.device)
    # Entries after a sequence's last page are padding (any value, -1 often): clamped, never read.
    pages = block_table.long().clamp(0, k.shape[0] // page_size - 1)
    rows = pages[:, positions // page_size] * page_size + positions % page_size  # (B, L)
    k_rows, v_rows = k[rows.flatten()], v[rows.flatten()]  # (B * L, Hk, D)
    starts = bounds_k[:, 0] + torch.arange(batch, device=k.device, dtype=torch.int32) * length
    return k_rows, v_rows, (bounds_q, torch.stack([starts, bounds_k[:, 1]], 1), max_q, length)


def run_backward(dout, q, k, v, out, lse, opts: AttentionOptions, backend: str, varlen=None, fp8=None, grads=None):
    """(dq, dk, dv) from the chosen backend. ``fp8``: the Triton backend's FP8 products (see
    ``kernels.backward.attention_backward``). ``grads``: (dq, dk, dv) of dense inputs to write them into (any
    strides, last dim contiguous), returned."""
    if grads is not None and (backend != "triton" or q.numel() == 0 or k.numel() == 0):
        # (the PyTorch path and empty inputs make their own gradients: copied in)
        for grad, value in zip(grads, run_backward(dout, q, k, v, out, lse, opts, backend, varlen)):
            grad.copy_(value)
        return grads
    if q.numel() == 0 or k.numel() == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if fp8 is not None and backend != "triton":
        raise RuntimeError("FP8 backward products run on the Triton backend only")
    if backend == "triton":
        with _on_device(q):
            return _triton_backend().attention_backward(dout, q, k, v, out, lse.float().contiguous(), opts, varlen,
                                                        fp8=fp8, grads=grads)
    if varlen is not None:
        return reference.varlen_attention_backward(dout, q, k, v, out, lse, *varlen, opts)
    return reference.attention_backward(dout, q, k, v, out, lse, opts)


def _unpack(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
            window_right, softcap, alibi_slopes, sink, block_mask, dropout_p, dropout_seed):
    seed = 0 if dropout_seed is None else int(dropout_seed)  # (a host tensor: no sync)
    opts = AttentionOptions(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, sink, block_mask,
                            dropout_p, seed)
    varlen = None if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return opts, varlen


_OP_PLANS: dict[tuple, dict] = {}  # the custom ops' launch plans: plan_key -> {slot: Plan or failed tries}


def _op_plans(q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, backend: str, varlen) -> dict | None:
    """The launch plans (``replayed_or_recorded``'s slots) of a custom op call, or None where none may serve.

    torch.compile's generated code calls the ops on plain tensors, once per attention call of every step,
    and without a plan each call would take the ordinary path's hundreds of microseconds of host time
    (the GPU idles through them at the start of a step's forward and backward). Dense calls without
    tensor options or dropout, on the Triton backend, aligned, keyed as eager calls are (``plan_key``).
    """
    if (backend != "triton" or varlen is not None or opts.alibi_slopes is not None or opts.sink is not None
            or opts.block_mask is not None or opts.dropout_p != 0.0 or not _aligned(q, k, v)
            or os.environ.get("FLASHTILE_LAUNCH_PLANS", "1") == "0"):
        return None
    key = plan_key(q, k, v, opts.softmax_scale, opts.causal, (opts.window_left, opts.window_right), opts.softcap)
    return None if key is None else _op_slots(key)


def _op_slots(key: tuple) -> dict:
    """``_OP_PLANS``' slots of ``key``, made empty on its first call (the table emptied when full)."""
    plans = _OP_PLANS.get(key)
    if plans is None:
        if len(_OP_PLANS) >= _MAX_PLANS:
            _OP_PLANS.clear()
        plans = _OP_PLANS[key] = {}
    return plans


def _op_replay(plans: dict, slot, inputs: tuple, call: Callable[[], tuple]) -> tuple:
    """``replayed_or_recorded``'s result for an op call, recording from a slot's second call on, as eager
    keys do: shapes that change every call (``dynamic=True`` over new lengths) pay for no recording."""
    if slot not in plans:
        plans[slot] = 0  # seen once: the next call records
        return call()
    return replayed_or_recorded(plans, slot, inputs, call)[0]


# Dropout calls take twins of the two ops tagged ``cudagraph_unsafe``: their seed is a host number that a captured
# graph would replay (the same mask every step), so Inductor's CUDA graphs (``mode="reduce-overhead"``) leave
# them out and run them between the graphs. Calls without dropout stay inside.
_UNSAFE_IN_GRAPHS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _attention_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
    window_right: int, softcap: float, alibi_slopes: Tensor | None, sink: Tensor | None,
    block_mask: Tensor | None, dropout_p: float, dropout_seed: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor]:
    opts, varlen = _unpack(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                           window_left, window_right, softcap, alibi_slopes, sink, block_mask, dropout_p, dropout_seed)
    if dropout_p > 0 and q.is_cuda:
        with _on_device(q):
            if torch.cuda.is_current_stream_capturing():  # (the interface leaves this to the op while traced)
                raise ValueError(DROPOUT_CAPTURED.format(dropout_p=dropout_p))
    plans = _op_plans(q, k, v, opts, backend, varlen)
    if plans is None:
        return run_forward(q, k, v, opts, backend, varlen)
    with _on_device(q):
        return _op_replay(plans, "forward", (q, k, v), lambda: run_forward(q, k, v, opts, backend))


def _attention_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=_lse_dtype(q))
    return out, lse


def _attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
    window_left: int, window_right: int, softcap: float, alibi_slopes: Tensor | None, sink: Tensor | None,
    block_mask: Tensor | None, dropout_p: float, dropout_seed: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    opts, varlen = _unpack(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                           window_left, window_right, softcap, alibi_slopes, sink, block_mask, dropout_p, dropout_seed)
    plans = _op_plans(q, k, v, opts, backend, varlen)
    if (plans is None or dout.stride(-1) != 1 or lse.dtype != torch.float32 or not lse.is_contiguous()
            or not _aligned(dout, out, lse)):
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, opts, backend, varlen)
    else:
        # out and lse come from the forward op (lse as it made it), dout from the graph: their layouts pick
        # the plan.
        slot = (dout.stride(), dout.dtype, out.stride(), out.dtype)
        with _on_device(q):
            dq, dk, dv = _op_replay(plans, slot, (dout, q, k, v, out, lse),
                                    lambda: run_backward(dout, q, k, v, out, lse, opts, backend))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _attention_backward_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


attention_forward_op = torch.library.custom_op("flashtile::attention_forward", mutates_args=())(_attention_forward)
attention_backward_op = torch.library.custom_op("flashtile::attention_backward", mutates_args=())(_attention_backward)
dropout_forward_op = torch.library.custom_op("flashtile::attention_forward_dropout", mutates_args=(),
                                             tags=_UNSAFE_IN_GRAPHS)(_attention_forward)
dropout_backward_op = torch.library.custom_op("flashtile::attention_backward_dropout", mutates_args=(),
                                              tags=_UNSAFE_IN_GRAPHS)(_attention_backward)
for _op in (attention_forward_op, dropout_forward_op):
    _op.register_fake(_attention_forward_fake)
for _op in (attention_backward_op, dropout_backward_op):
    _op.register_fake(_attention_backward_fake)


@torch.library.custom_op("flashtile::fp8_attention_forward", mutates_args=())
def fp8_attention_forward_op(
    q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor, out_dtype: torch.dtype,
    softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor]:
    """The FP8 kernels' forward (``flashtile.fp8``): float8_e4m3fn dense q, k, v (v possibly keys-fastest)
    with their float32 (batch, nheads_k) descales; out in out_dtype, lse float32. No autograd of its own:
    ``fp8.fp8_attn_func`` differentiates around it."""
    opts = AttentionOptions(softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)
    descales = (q_descale, k_descale, v_descale)

    def call():
        return run_forward(q, k, v, opts, backend, fp8=(*descales, out_dtype, False))

    # Launch plans as for the 16-bit op (``_op_plans``), keyed as eager FP8 calls are (``fp8_plan_key``).
    if backend == "triton" and alibi_slopes is None and environ_get("FLASHTILE_LAUNCH_PLANS") != "0":
        key = fp8_plan_key(q, k, v, descales, softmax_scale, causal, (window_left, window_right), softcap, out_dtype)
        if key is not None and _aligned(q, k, v, *descales):
            with _on_device(q):
                return _op_replay(_op_slots(key), "forward", (q, k, v, *descales), call)
    return call()


@fp8_attention_forward_op.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, out_dtype, *args):
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(_lse_shape(q, False), dtype=torch.float32)


def forward_no_grad(q, k, v, opts: AttentionOptions, backend: str, fp8=None) -> tuple[Tensor, Tensor]:
    """(out, lse) of dense q, k, v without autograd, for code that differentiates around it (an
    autograd.Function): ``run_forward`` on plain eager calls, else the custom op (torch.compile traces
    it). ``fp8``: the FP8 kernels' (q_descale, k_descale, v_descale, out_dtype). Dense options only: no
    sink, block mask or dropout."""
    if _plain_eager(q, k, v, opts.alibi_slopes):
        return run_forward(q, k, v, opts, backend, fp8=None if fp8 is None else (*fp8, False))
    scalars = (opts.softmax_scale, opts.causal, opts.window_left, opts.window_right, opts.softcap, opts.alibi_slopes)
    if fp8 is not None:
        return fp8_attention_forward_op(q, k, v, *fp8, *scalars, backend)
    return attention_forward_op(q, k, v, None, None, 0, 0, *scalars, None, None, 0.0, None, backend)


def backward_no_grad(dout, q, k, v, out, lse, opts: AttentionOptions, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of dense attention: ``run_backward``, or the backward op while torch.compile traces."""
    if _plain_eager(dout, q, k, v, out, lse, opts.alibi_slopes):
        return run_backward(dout, q, k, v, out, lse, opts, backend)
    return attention_backward_op(dout, q, k, v, out, lse, None, None, 0, 0, opts.softmax_scale, opts.causal,
                                 opts.window_left, opts.window_right, opts.softcap, opts.alibi_slopes, None, None,
                                 0.0, None, backend)


def _sink_grad(dout, out, lse, sink, varlen: bool) -> Tensor:
    """d loss / d sink_h = -sum over rows of P(sink) * delta, with P(sink) = exp(sink_h - lse)."""
    acc = torch.float64 if lse.dtype == torch.float64 else torch.float32
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (batch, seqlen, nheads) or (total, nheads)
    delta = delta.transpose(-1, -2)  # like lse: (batch, nheads, seqlen) or (nheads, total)
    grad = -(torch.exp(sink.to(acc).view(-1, 1) - lse.to(acc)) * delta)
    return (grad.sum(dim=(0, 2)) if grad.dim() == 3 else grad.sum(dim=1)).to(sink.dtype)


_SINK_INDEX = 13  # position of `sink` among the forward op's inputs


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *scalars_and_extras = inputs
    out, lse = output
    alibi_slopes, sink, block_mask = inputs[12], inputs[_SINK_INDEX], inputs[14]
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sink, block_mask, inputs[16])
    ctx.scalars = (inputs[5], inputs[6], inputs[7], inputs[8], inputs[9], inputs[10], inputs[11])
    ctx.dropout_p = inputs[15]
    ctx.backend = inputs[17]


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sink, block_mask, dropout_seed = ctx.saved_tensors
    max_q, max_k, scale, causal, left, right, softcap = ctx.scalars
    backward_op = attention_backward_op if dropout_seed is None else dropout_backward_op
    dq, dk, dv = backward_op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap,
                             alibi_slopes, sink, block_mask, ctx.dropout_p, dropout_seed, ctx.backend)
    dsink = None
    if sink is not None and ctx.needs_input_grad[_SINK_INDEX]:
        dsink = _sink_grad(dout, out, lse, sink, cu_q is not None)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, dsink, None, None, None, None


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)
dropout_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward() -> None:
    if torch.is_grad_enabled():  # create_graph=True: gradients of gradients are asked for
        raise RuntimeError("flashtile: double backward (create_graph=True through attention) is not supported")


class _EagerAttention(torch.autograd.Function):
    """The custom ops' forward and backward for plain eager calls, without the ops' dispatch.

    A custom op call costs tens of microseconds of Python (schema defaults, redispatch through the
    autograd and backend keys), more than a short sequence's kernel takes on a GPU. Eager calls on plain
    tensors take this path; torch.compile, tracing, tensor subclasses and modes take the ops. Every
    tensor goes through ``save_for_backward`` as in the ops (in-place changes before the backward are
    caught), and a double backward raises (the ops have none either).
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, alibi_slopes, sink, block_mask, opts, backend, max_seqlens, before_launch):
        varlen = None if cu_q is None else (cu_q, cu_k, *max_seqlens)
        out, lse = run_forward(q, k, v, opts, backend, varlen, before_launch=before_launch)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sink, block_mask)
        ctx.opts, ctx.backend, ctx.max_seqlens = opts, backend, max_seqlens
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (why: _PlannedAttention.forward)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        _no_double_backward()
        if dout is None:  # out's gradient undefined (not materialized): no gradient flows through
            return (None,) * len(ctx.needs_input_grad)
        q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sink, block_mask = ctx.saved_tensors
        opts = dataclasses.replace(ctx.opts, alibi_slopes=alibi_slopes, sink=sink, block_mask=block_mask)
        varlen = None if cu_q is None else (cu_q, cu_k, *ctx.max_seqlens)
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, opts, ctx.backend, varlen)
        dsink = None
        if sink is not None and ctx.needs_input_grad[6]:
            dsink = _sink_grad(dout, out, lse, sink, varlen is not None)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), None, None, None, dsink, None, None, None, None, None


def _plain_eager(*tensors) -> bool:
    """No compiler, no torch-function or dispatch mode, no functorch transform, only plain tensors."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._is_torch_function_mode_enabled():
        return False
    mode = _get_current_dispatch_mode()
    if (mode is not None and not getattr(mode, "flashtile_recording", False)) or \
            torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for t in tensors:
        if t is not None and ((type(t) is not Tensor and type(t) is not torch.nn.Parameter) or t.is_meta):
            return False
    return True


def _refuse_forward_mode() -> None:
    """Raise under a forward-mode transform (``torch.func.jvp``, ``jacfwd``, ``hessian``): the ops have a
    backward only, and PyTorch would carry no tangent through them, returning zeros instead of an error (eager
    forward-mode AD raises on its own: autograd.Function has no jvp here)."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return  # (Dynamo cannot trace the interpreter stack's walk)
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    if any(level.key() == torch._C._functorch.TransformType.Jvp for level in retrieve_all_functorch_interpreters()):
        raise NotImplementedError("flashtile's attention has no forward-mode derivative (torch.func.jvp, jacfwd, "
                                  "hessian), as flash-attn's has none: use .backward() or torch.autograd.grad")


def attention(q, k, v, opts: AttentionOptions, backend: str, varlen=None,
              before_launch: Callable[[], None] | None = None) -> tuple[Tensor, Tensor]:
    """Differentiable (out, lse) through the custom op (or its eager twin); lse is float32 for the user
    (flash-attn's contract). ``before_launch``: see ``run_forward`` (the op path calls it first)."""
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None, None, 0, 0)
    if _plain_eager(q, k, v, cu_q, cu_k, opts.alibi_slopes, opts.sink, opts.block_mask):
        # (tensor options stay on the three-input Function, which saves them for the backward's version checks)
        packed = (packed_base(q, k, v) if varlen is None and opts.sink is None and opts.alibi_slopes is None
                  and opts.block_mask is None and torch.is_grad_enabled() else None)
        if packed is not None:
            out, lse = _PackedAttention.apply(packed, (q, k, v), None, opts, backend, before_launch)
            return out, lse.float()
        out, lse = _EagerAttention.apply(q, k, v, cu_q, cu_k, opts.alibi_slopes, opts.sink, opts.block_mask, opts,
                                         backend, (max_q, max_k), before_launch)
        return out, lse.float()
    _refuse_forward_mode()
    if before_launch is not None:
        before_launch()
    seed = opts.dropout_seed
    if opts.dropout_p == 0:
        seed = None
    elif not isinstance(seed, Tensor):
        seed = torch.tensor([seed], device="cpu")  # (a host tensor, whatever the default device)
    forward_op = attention_forward_op if seed is None else dropout_forward_op
    out, lse = forward_op(q, k, v, cu_q, cu_k, max_q, max_k, opts.softmax_scale, opts.causal, opts.window_left,
                          opts.window_right, opts.softcap, opts.alibi_slopes, opts.sink, opts.block_mask,
                          opts.dropout_p, seed, backend)
    return out, lse.detach().float()


# ---------------------------------------------------------------------------------------------------
# Launch plans: dense calls whose launches are recorded once per key and replayed (kernels.replay)
# ---------------------------------------------------------------------------------------------------

# Environment variables that any decision of a dense call reads (backend, target, tiles, descriptors,
# launch path): part of every plan's key, so that a changed setting takes the ordinary path and is
# recorded anew. tests/kernels/test_replay.py checks that the kernels read no other FLASHTILE_ setting.
PLAN_SETTINGS = ("FLASHTILE_LAUNCH_PLANS", "FLASHTILE_BACKEND", "TRITON_INTERPRET", "FLASHTILE_TARGET",
                 "FLASHTILE_TMA", "FLASHTILE_AUTOTUNE", "FLASHTILE_DIRECT_LAUNCH", "FLASHTILE_L2_SECTION_MB",
                 "FLASHTILE_BWD_OVERLAP", "FLASHTILE_GLUON", "FLASHTILE_PDL")
_ENVIRON = getattr(os.environ, "_data", None)  # CPython's own dict behind os.environ: a lookup costs ~40 ns
_SETTING_KEYS = tuple(os.environ.encodekey(name) for name in PLAN_SETTINGS) if _ENVIRON is not None else ()
_TRIES = 4  # recordings tried per key before it stays on the ordinary path (the first two calls of a
# shape launch through Triton's own path: compiling, then finding the compiled kernel)


def environ_get(name: str) -> str | None:
    """``os.environ.get(name)`` at the cost of a dict lookup (a call's hot path reads settings)."""
    if _ENVIRON is None:
        return os.environ.get(name)
    value = _ENVIRON.get(os.environ.encodekey(name))  # os.environ's own store: bytes on POSIX
    return None if value is None else os.environ.decodevalue(value)


def settings() -> tuple:
    """The values of ``PLAN_SETTINGS`` now (None where unset)."""
    if _ENVIRON is None:
        return tuple(os.environ.get(name) for name in PLAN_SETTINGS)
    return tuple(map(_ENVIRON.get, _SETTING_KEYS))


class _PlanEntry:
    """A call's key: its recorded forward, and its backward's plans by dout's strides. ``varlen``: the
    (max_seqlen_q, max_seqlen_k) of a packed call, None for a dense one."""

    __slots__ = ("plans", "opts", "backend", "varlen", "reused")

    def __init__(self, opts: AttentionOptions, backend: str, varlen: tuple | None = None):
        # "forward", and the backward's by dout.stride(): a Plan, or the count of failed recordings
        self.plans: dict = {}
        self.opts, self.backend, self.varlen = opts, backend, varlen
        self.reused = False  # the key was called again after its first call

    @property
    def forward(self):
        """The forward's Plan, or None."""
        plan = self.plans.get("forward")
        return None if isinstance(plan, int) else plan

    @property
    def backward(self) -> dict:
        """The backward's plans (or failed-recording counts) by dout's strides."""
        return {slot: plan for slot, plan in self.plans.items() if slot != "forward"}

    @property
    def tries(self) -> int:
        """Failed recordings of the forward."""
        plan = self.plans.get("forward", 0)
        return plan if isinstance(plan, int) else 0


def replayed_or_recorded(plans: dict, slot, inputs: tuple, call: Callable[[], tuple], kept: set[int] | None = None):
    """(result, replayed) of a call that may have a launch plan: ``plans[slot]``'s replay on ``inputs``, or
    ``call()`` (the ordinary path) recorded into ``plans[slot]`` while fewer than ``_TRIES`` recordings
    failed there, or ``call()`` alone. ``kept``: ids of cached tensors the launches may read (default the
    kernels' placeholders). A replay refused (a launch hook, another device) runs ``call()``."""
    plan = plans.get(slot, 0)
    if not isinstance(plan, int):
        result = plan.run(inputs)
        return (result, True) if result is not None else (call(), False)
    if plan >= _TRIES:
        return call(), False
    result, recorded, _ = _triton_backend().record(call, inputs, _placeholders() if kept is None else kept)
    plans[slot] = recorded if recorded is not None else plan + 1
    return result, False


_PLANS: dict[tuple, _PlanEntry] = {}
_MAX_PLANS = 4096  # keys kept; past it all are forgotten and recorded anew
_FAMILIES: dict[tuple, tuple] = {}  # a key without k and v's layouts (packed: nor max lengths) -> its last key


def _aligned(*tensors: Tensor) -> bool:
    # Triton specializes pointer arguments on 16-byte alignment; descriptors need it too.
    ptr = 0
    for t in tensors:
        ptr |= t.data_ptr()
    return ptr % 16 == 0


def plan_key(q, k, v, softmax_scale, causal, window_size, softcap, also: tuple = ()) -> tuple | None:
    """The key of a dense call's launch plan, or None where no plan may serve it: arguments of other
    types than plain tensors, floats and bools (a tensor-valued scale could change between calls under
    one key), or not plain eager (compile, modes, functorch; ``also``: the call's other tensors, None
    allowed, checked with q, k, v)."""
    if (type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or type(causal) is not bool
            or type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int
            or type(window_size[1]) is not int or softmax_scale.__class__ not in (float, int, type(None))
            or softcap.__class__ not in (float, int) or not _plain_eager(q, k, v, *also)):
        return None
    if _wrapped(q) or _wrapped(k) or _wrapped(v) or (also and any(t is not None and _wrapped(t) for t in also)):
        return None  # a functorch tensor that outlived its transform: the ordinary path unwraps it
    # (q is k, k is v): a call that passes one tensor twice is another key (its plan reads it twice).
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, softmax_scale, causal, window_size, softcap, q is k, k is v, q is v, settings())


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_ALIASES = slice(-4, -1)  # plan_key's (q is k, k is v, q is v)


def aliased(key: tuple) -> bool:
    """Whether a ``plan_key`` was made from a call that passed one tensor as two of q, k and v."""
    return any(key[_ALIASES])


def _family(key: tuple, packed: bool = False) -> tuple:
    """A dense ``plan_key`` without k and v's shapes and strides (its entries 2 to 5); a packed call's key
    (the dense key of its packed tensors, cu_seqlens' layouts, max_seqlen_q, max_seqlen_k) also without
    its max lengths."""
    if packed:
        return (_family(key[0]), *key[1:-2])
    return (key[0], key[1], *key[6:])


def planned_attention(key: tuple, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor] | None:
    """(out, lse) by the launch plan of ``key``, or None where the ordinary path must run (no plan yet,
    unaligned inputs, another current device)."""
    entry = _PLANS.get(key)
    if entry is None or entry.forward is None or not _aligned(q, k, v):
        return None
    entry.reused = True
    return _planned(q, k, v, entry)


def _planned(q: Tensor, k: Tensor, v: Tensor, entry: _PlanEntry, *cu: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) by ``entry``'s forward plan (replayed, or recorded where it has none yet), through the
    autograd Function where the call records autograd history; else (inference, a decoding step) the plan
    alone, without the Function's context and saved tensors. Forward-mode AD's dual tensors do not
    require grad: inside a dual level the Function takes the call, and refuses them (it has no jvp)."""
    if (_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) or _forward_ad._current_level >= 0:
        packed = None if cu else packed_base(q, k, v)
        if packed is not None:
            return _packed_apply(packed, (q, k, v), entry, None, None, None)
        return _planned_apply(q, k, v, entry, *cu)
    return _planned_forward(q, k, v, entry, cu)


def _planned_forward(q: Tensor, k: Tensor, v: Tensor, entry: _PlanEntry, cu: tuple) -> tuple[Tensor, Tensor]:
    result, _ = replayed_or_recorded(entry.plans, "forward", (q, k, v, *cu),
                                     lambda: run_forward(q, k, v, entry.opts, entry.backend, _varlen_of(entry, cu)))
    return result


_grad_enabled = torch.is_grad_enabled
_forward_ad = torch.autograd.forward_ad


def recorded_attention(key: tuple, q: Tensor, k: Tensor, v: Tensor, opts: AttentionOptions, backend: str,
                       varlen=None) -> tuple[Tensor, Tensor]:
    """(out, lse) of a checked call without tensor options, recording its launch plan under ``key`` when it
    is one that may be replayed (the Triton backend, launched directly, aligned inputs). ``varlen``: a
    packed call's (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), its values already checked."""
    cu = () if varlen is None else (varlen[0],) if varlen[1] is varlen[0] else (varlen[0], varlen[1])
    entry = _PLANS.get(key)
    if entry is None:
        # A key's first call only notes the key: recording starts with its second (a key seen once, such as
        # a length that grows every call, costs no recording and keeps no plan). But where the key before it
        # differed only in k and v's layouts (and, packed, the max lengths) was called again and has a plan
        # (a decoding loop over a cache that grows by concatenation, as Hugging Face's dynamic cache does,
        # every layer of a step making the same call; packed batches of new lengths step after step), the
        # new key is recorded on its first call: the step's other layers replay.
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
            _FAMILIES.clear()
        entry = _PLANS[key] = _PlanEntry(opts, backend, None if varlen is None else tuple(varlen[2:]))
        if backend != "triton" or os.environ.get("FLASHTILE_LAUNCH_PLANS", "1") == "0":
            entry.plans["forward"] = _TRIES
            return attention(q, k, v, opts, backend, varlen)
        family = _family(key, varlen is not None)
        before = _PLANS.get(_FAMILIES.get(family))
        _FAMILIES[family] = key
        if before is None or not before.reused or before.forward is None:
            return attention(q, k, v, opts, backend, varlen)
    else:
        entry.reused = True
    if entry.tries >= _TRIES or not _aligned(q, k, v, *cu):
        return attention(q, k, v, opts, backend, varlen)
    return _planned(q, k, v, entry, *cu)


def fp8_plan_key(q, k, v, descales: tuple, softmax_scale, causal, window_size, softcap, out_dtype) -> tuple | None:
    """The launch-plan key of a dense call on FP8 q, k, v (``flash_attn_func`` with ``descales`` = (q_descale,
    k_descale, v_descale)), or None where no plan may serve it: ``plan_key``'s, with the descales' layouts and
    out_dtype. The six tensors must be distinct (one in two roles, say one descale for k and v, is left to the
    ordinary path), and none may require grad: FP8 inputs have no backward, the ordinary path raises, so a replay
    must not run."""
    if any(type(d) is not Tensor for d in descales) or not (out_dtype is None or isinstance(out_dtype, torch.dtype)):
        return None
    key = plan_key(q, k, v, softmax_scale, causal, window_size, softcap, descales)
    if key is None or aliased(key) or len({id(t) for t in (q, k, v, *descales)}) < 3 + len(descales):
        return None
    if q.requires_grad or k.requires_grad or v.requires_grad or any(d.requires_grad for d in descales):
        return None
    return ("fp8", key, out_dtype, *((d.shape, d.stride(), d.dtype, d.device) for d in descales))


_FP8_PLANS: dict[tuple, dict] = {}  # an fp8_plan_key -> {"forward": a Plan, or the count of failed recordings}


def fp8_planned(key: tuple, inputs: tuple, call: Callable[[], tuple]) -> tuple:
    """(out, lse) of a dense FP8 call (``fp8_plan_key``; ``inputs``: q, k, v and the descales, ``call``: the
    ordinary path, returning (out, lse)): its key's recorded launches, or ``call()``, recorded from the key's
    second call on (the first only notes the key, as ``recorded_attention`` does) while fewer than ``_TRIES``
    recordings failed. Forward only, without autograd: FP8 inputs take no gradient."""
    plans = _FP8_PLANS.get(key)
    if plans is None:
        result = call()  # (its checks raise first: the backend below is then one that runs the call)
        from .interface import select_backend

        if len(_FP8_PLANS) >= _MAX_PLANS:
            _FP8_PLANS.clear()
        _FP8_PLANS[key] = {} if (environ_get("FLASHTILE_LAUNCH_PLANS") != "0"
                                 and select_backend(inputs[0].device) == "triton") else {"forward": _TRIES}
        return result
    if not _aligned(*inputs):
        return call()
    with _on_device(inputs[0]):  # (a plan replays on its device only: q on another GPU than the current one)
        return replayed_or_recorded(plans, "forward", inputs, call)[0]


def _varlen_of(entry: _PlanEntry, cu: tuple):
    # cu: (cu_seqlens_q,) when it serves for the keys too, else (cu_seqlens_q, cu_seqlens_k)
    return None if entry.varlen is None else (cu[0], cu[-1], *entry.varlen)


def _placeholders() -> set[int]:
    return _triton_backend().placeholder_ids()


class _PlannedAttention(torch.autograd.Function):
    """``_EagerAttention`` for dense calls with a plan entry: the forward and backward replay their
    recorded launches, or record them (``kernels.replay``) on a call that may; anything else takes
    ``run_forward``/``run_backward``."""

    @staticmethod
    def forward(ctx, q, k, v, entry: _PlanEntry, *cu):
        out, lse = _planned_forward(q, k, v, entry, cu)
        ctx.save_for_backward(q, k, v, out, lse, *cu)
        ctx.entry = entry
        ctx.mark_non_differentiable(lse)
        # Without this, autograd hands the backward a zero tensor for lse's gradient (it never has one), made on
        # every backward: an allocation and a fill kernel on the GPU.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        _no_double_backward()
        if dout is None:  # out's gradient undefined (not materialized): no gradient flows through
            return (None,) * len(ctx.needs_input_grad)
        q, k, v, out, lse, *cu = ctx.saved_tensors
        entry = ctx.entry
        strides = dout.stride()
        if strides[-1] != 1:
            # As the ordinary path would (run_backward), once here so that the copy's layout replays: an
            # expanded dout (``out.sum().backward()``: every stride 0) otherwise took the ordinary path each call.
            dout = dout.contiguous()
            strides = dout.stride()

        def ordinary():
            return run_backward(dout, q, k, v, out, lse, entry.opts, entry.backend, _varlen_of(entry, cu))

        if not _aligned(dout):
            result = ordinary()
        else:
            with _on_device(q):
                result, _ = replayed_or_recorded(entry.plans, strides, (dout, q, k, v, out, lse, *cu), ordinary)
        # (lines on this path cost more than they measure alone: autograd's engine runs between them)
        return (*result, None, *(None,) * len(cu))


class _PackedAttention(torch.autograd.Function):
    """The attention of q, k, v that are the slices of one packed tensor (``packed_base``), which autograd sees in
    their place: the backward's kernels write dq, dk and dv into one gradient of the packed tensor's shape, where
    autograd would stack three gradients into it (a copy of all their bytes). With a plan ``entry`` the forward and
    backward replay or record launch plans (``_PlannedAttention``), without one they take the ordinary path
    (``_EagerAttention``; ``opts``, ``backend`` and ``before_launch`` then given)."""

    @staticmethod
    def forward(ctx, packed, views: tuple, entry, opts, backend, before_launch):
        if entry is not None:
            out, lse = _planned_forward(*views, entry, ())
            opts, backend = entry.opts, entry.backend
        else:
            out, lse = run_forward(*views, opts, backend, before_launch=before_launch)
        ctx.save_for_backward(packed, out, lse)
        # (q's shape, not q, k, v: the backward remakes them from the saved tensor, which autograd frees with the
        # graph and which checkpointing and offloading hooks see)
        ctx.shape, ctx.entry, ctx.opts, ctx.backend = views[0].shape, entry, opts, backend
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (why: _PlannedAttention.forward)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        _no_double_backward()
        if dout is None:
            return None, None, None, None, None, None
        packed, out, lse = ctx.saved_tensors
        shape, entry = ctx.shape, ctx.entry
        if dout.stride(-1) != 1:
            dout = dout.contiguous()

        def ordinary():
            grad = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
            run_backward(dout, *_slices(packed, shape), out, lse, ctx.opts, ctx.backend, grads=_slices(grad, shape))
            return (grad,)

        if entry is None or not _aligned(dout):
            result = ordinary()
        else:
            with _on_device(packed):
                # (the base's shape in the slot: bases of other shapes, (batch, seqlen, 3 * nheads * headdim) and
                # (batch, seqlen, 3, nheads, headdim), give q, k, v of one plan key)
                result, _ = replayed_or_recorded(entry.plans, ("packed", packed.shape, dout.stride()),
                                                 (dout, packed, out, lse), ordinary)
        return result[0], None, None, None, None, None


_PACKED_GRADS = os.environ.get("FLASHTILE_PACKED_GRADS", "1") == "1"  # read once, at import (docs/settings.md)


class _Offered(threading.local):
    """.qkv: flash_attn_qkvpacked_func's argument during its call on this thread (``offer_packed``), else None (a
    class attribute: read without getattr's default on every call)."""

    qkv: Tensor | None = None


_OFFERED = _Offered()


def offer_packed(qkv: Tensor | None) -> None:
    """Name the packed tensor that the current thread's next q, k, v are ``unbind(2)``'s slices of (None: none),
    for ``packed_base`` to hand autograd that tensor itself."""
    _OFFERED.qkv = qkv


def _view_node_types() -> frozenset:
    """The classes of autograd's nodes for view ops (the backward of each places its output's gradient at the
    view's elements of its input's, nothing else), as a fused projection reaches q, k, v through them: ``view``,
    ``split``/``chunk``, ``unbind``, ``transpose``/``permute`` (Hugging Face's BHSD round trip), ``reshape`` of a
    view, ``select``/``narrow``/slicing, ``unflatten``, ``unsqueeze``/``squeeze``, ``alias``."""
    x = torch.zeros(2, 2, 2, requires_grad=True) * 1
    views = (x.view(8), x.split(1, 2)[0], x.split([1, 1], 2)[0], x.unbind(2)[0], x.transpose(0, 1),
             x.permute(2, 0, 1), x[:, :1].reshape(2, 2), x.select(2, 0), x[:, :1], x.unsqueeze(0),
             x[:, :1].squeeze(1), x.unsqueeze(0).squeeze(), x[0].t(), torch.ops.aten.alias(x))
    return frozenset(type(view.grad_fn) for view in views)


_VIEW_NODES = _view_node_types()
_UNBIND_NODE = type(torch.zeros(1, 2, requires_grad=True).unbind(1)[0].grad_fn)
_ACCUMULATE_NODE = type(torch.zeros(2, requires_grad=True).view(1, 2).grad_fn.next_functions[0][0])
_MAX_VIEW_STEPS = 8  # view nodes on a slice's path to its base (Hugging Face's GPT-2 round trip takes six)


def packed_base(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """The tensor of which q, k, v are three (batch, seqlen, nheads, headdim) views laid out as
    ``(batch, seqlen, 3, nheads, headdim)``, as a fused QKV projection's output gives them
    (``proj(x).view(batch, seqlen, 3, nheads, headdim).unbind(2)``, or nanoGPT's ``proj(x).split(nheads * headdim,
    dim=-1)`` then ``.view(batch, seqlen, nheads, headdim)``): their common base, a contiguous tensor of exactly their
    elements, reached from each of them through view ops alone, which autograd then sees in their place. None for
    any other q, k, v, where a gradient of q, k or v themselves is asked for (``retain_grad``, a hook), and under
    forward-mode AD (a dual tensor's tangent is not its base's). On every forward with grad, so ordered cheapest and
    most telling first (each tensor attribute read costs host time).

    Tensors between the base and the slices (a linear layer's 3-d output when it has a bias, a view of it) leave
    the graph with the slices: autograd runs none of their hooks, and PyTorch gives no way to see whether they have
    any (docs/compatibility.md)."""
    base = q._base
    if base is None or k._base is not base or v._base is not base or not _PACKED_GRADS or not base.requires_grad:
        return None  # (a leaf base may have stopped requiring grad after the slices were made)
    if q.retains_grad or k.retains_grad or v.retains_grad or q._backward_hooks or k._backward_hooks or \
            v._backward_hooks or _forward_ad._current_level >= 0:
        return None
    shape = q.shape
    _, seqlen, nheads, headdim = shape
    row = nheads * headdim
    start = base.data_ptr()  # (addresses, not offsets: a base whose storage `.data` swapped holds other elements)
    step = row * base.element_size()
    if (q.data_ptr() != start or k.data_ptr() != start + step or v.data_ptr() != start + 2 * step
            or k.shape != shape or v.shape != shape
            or not (3 * seqlen * row, 3 * row, headdim, 1) == q.stride() == k.stride() == v.stride()
            or base.numel() != 3 * q.numel() or not base.is_contiguous()):
        return None
    fn = q.grad_fn
    offered = _OFFERED.qkv
    if offered is not None:
        # flash_attn_qkvpacked_func's own qkv, which q, k, v were unbound from: the Function takes it, so it stays in
        # the graph (its hooks, retain_grad and autograd.grad on it work as with three inputs).
        if type(fn) is not _UNBIND_NODE or k.grad_fn is not fn or v.grad_fn is not fn:
            return None
        node, output = fn.next_functions[0]
        return offered if offered.is_contiguous() and ((node is offered.grad_fn and output == offered.output_nr) or (
            type(node) is _ACCUMULATE_NODE and node.variable is offered)) else None
    # Autograd's path from each slice to the base: view ops only, ending at the base's own node (its grad_fn, at the
    # base's output of it, or a leaf's AccumulateGrad). The layout above then says which of the base's elements each
    # slice is, and a view op's backward places the gradient there and nowhere else, so one packed gradient is what
    # autograd would sum. Anything else on a path (a Function of your own returning a view, with a backward of its
    # own) must run: the ordinary path. k's and v's paths end where they join q's (at once for unbind's slices).
    path = _view_path(fn, base, ())
    if path is None or _view_path(k.grad_fn, base, path) is None or _view_path(v.grad_fn, base, path) is None:
        return None
    return base


def _view_path(node, base: Tensor, joins: Sequence) -> list | None:
    """The nodes from ``node`` (a slice's grad_fn) through view ops to ``base``'s own node (its grad_fn, arrived at
    its output of it, or a leaf's AccumulateGrad), or to one of the nodes ``joins`` (nodes compare by identity);
    None where another node lies on the way (a Function of your own, another output of the node that made the base)
    or the path is longer than ``_MAX_VIEW_STEPS``. The nodes are held in the list: a node's Python object lives
    only while referenced, and ``is`` compares those."""
    made_by = base.grad_fn
    path = [node]
    for _ in range(_MAX_VIEW_STEPS):
        if node in joins:
            return path
        if type(node) not in _VIEW_NODES:
            return None
        node, output = node.next_functions[0]
        if made_by is not None and node is made_by:
            return path if output == base.output_nr else None
        if made_by is None and type(node) is _ACCUMULATE_NODE and node.variable is base:
            return path
        path.append(node)
    return None


def _slices(packed: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor, Tensor]:
    """The three (batch, seqlen, nheads, headdim) = ``shape`` slices of a contiguous tensor of their elements, q's,
    k's and v's places in their base (``packed_base``). (select, not unbind: a launch plan remakes single views, and
    unbind returns a tuple.)"""
    rows = packed.view(shape[0], shape[1], 3, shape[2], shape[3])
    return rows.select(2, 0), rows.select(2, 1), rows.select(2, 2)


_function_apply = super(torch.autograd.Function, _PlannedAttention).apply  # the C++ apply, bound to the class
_packed_apply = super(torch.autograd.Function, _PackedAttention).apply


def _planned_apply(q: Tensor, k: Tensor, v: Tensor, entry: _PlanEntry, *cu: Tensor) -> tuple[Tensor, Tensor]:
    """``_PlannedAttention.apply`` without its Python wrapper's generic steps (binding default arguments of a
    ``setup_context``, which it has none of; asking whether functorch transforms are active and unwrapping
    tensors that outlived one, which ``plan_key`` has ruled out): 1-2 µs of host time per call."""
    return _function_apply(q, k, v, entry, *cu)

