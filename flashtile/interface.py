"""The public flash-attn 2 API: argument checks, backend choice and autograd.

Shape legend (flash-attn's BSHD layout)::

    batch      number of sequences
    seqlen_q   query tokens per sequence        seqlen_k   key/value tokens per sequence
    nheads     query heads                      nheads_k   key/value heads (nheads % nheads_k == 0)
    headdim    features per head, 1..256, the same for q, k and v

``causal=True`` aligns the mask to the bottom-right corner, as flash-attn 2 does. With seqlen_q = 2
and seqlen_k = 5 (1 = attended)::

    1 1 1 1 0
    1 1 1 1 1

and with seqlen_q = 5, seqlen_k = 2 the first three rows see no key (their output is 0)::

    0 0
    0 0
    0 0
    1 0
    1 1

Backends: CUDA tensors run the Triton kernels; CPU tensors run the tiled PyTorch path
(``flashtile.reference``), or the Triton kernels through the interpreter when ``TRITON_INTERPRET=1``.
``FLASHTILE_BACKEND=triton|torch`` overrides the choice.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from . import _ops, reference
from .options import AttentionOptions

_TRITON_DTYPES = (torch.float16, torch.bfloat16)
_TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADDIM = 256


# ---------------------------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------------------------


def select_backend(device: torch.device) -> str:
    """Name of the backend that runs tensors on ``device``: ``"triton"`` or ``"torch"``.

    Raises ValueError for an unknown ``FLASHTILE_BACKEND`` and RuntimeError when the requested
    backend cannot run on ``device``.
    """
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    requested = os.environ.get("FLASHTILE_BACKEND", "").strip().lower()
    if requested not in ("", "auto", "triton", "torch"):
        raise ValueError(f"FLASHTILE_BACKEND must be 'triton', 'torch', 'auto' or unset, got {requested!r}")
    if requested == "torch":
        return "torch"
    triton_runs_here = device.type == "cuda" or (device.type == "cpu" and interpret)
    if requested == "triton":
        if not triton_runs_here:
            raise RuntimeError(
                f"FLASHTILE_BACKEND=triton cannot run tensors on {device}: Triton needs CUDA tensors, "
                "or CPU tensors with TRITON_INTERPRET=1"
            )
        return "triton"
    return "triton" if triton_runs_here else "torch"


# ---------------------------------------------------------------------------------------------------
# Argument checks: every one runs before any kernel launch
# ---------------------------------------------------------------------------------------------------


def _check_tensor(name: str, x: object, ndim: int, layout: str, keys_fastest: bool = False) -> torch.Tensor:
    """Type, rank and a contiguous last dim; ``keys_fastest``: or a contiguous dim 1 (an FP8 v laid out
    for FP8 tensor cores, ``flashtile.fp8.quantize(v, keys_fastest=True)``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}")
    if x.numel() > 0 and x.stride(-1) != 1 and not (keys_fastest and x.stride(1) == 1):
        also = " or contiguous keys (dim 1, FP8 v only)" if keys_fastest else ""
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1){also}, got strides {tuple(x.stride())}; "
            "call .contiguous() first"
        )
    return x


def _check_dtype_device(named: dict[str, torch.Tensor], backend: str) -> None:
    names = list(named)
    first = named[names[0]]
    allowed = _TRITON_DTYPES if backend == "triton" else _TORCH_DTYPES
    if not first.is_floating_point() or first.dtype not in allowed:
        if first.dtype == torch.float8_e4m3fn:
            raise TypeError(f"{names[0]} is float8_e4m3fn: FP8 inputs need q_descale, k_descale and v_descale, "
                            "float32 (batch, nheads_k) (flashtile.fp8.quantize makes them; flash_attn_func, "
                            "flash_attn_varlen_func, their packed forms and flash_attn_with_kvcache take them)")
        raise TypeError(
            f"{names[0]} has dtype {first.dtype}; the {backend} backend supports "
            f"{', '.join(str(d).replace('torch.', '') for d in allowed)}"
        )
    for name in names[1:]:
        x = named[name]
        if x.dtype != first.dtype:
            hint = (": FP8 attention takes q, k and v all float8_e4m3fn, with q_descale, k_descale, v_descale "
                    "(an FP8 KV cache also takes a bfloat16/float16 q, with k_descale and v_descale)"
                    if x.dtype == torch.float8_e4m3fn else "")
            raise TypeError(f"{name} has dtype {x.dtype}, expected {first.dtype} (the dtype of {names[0]}){hint}")
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device}, expected {first.device} (the device of {names[0]})")


def _is_bool(x: object) -> bool:
    """True or False, as a Python bool or numpy's bool scalar (flash-attn takes both)."""
    return isinstance(x, bool) or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"))


def _as_index(x: object) -> object:
    """An int from what flash-attn's int arguments also take (their schema converts anything with ``__index__``): a
    numpy integer, or an integer tensor of one element, read on the host as flash-attn reads it (a CUDA tensor
    waits for the GPU). Anything else, and any tensor while tracing, is returned as it is for the checks to
    refuse."""
    if type(x) is int or isinstance(x, bool):
        return x
    if isinstance(x, torch.Tensor):
        if (torch.compiler.is_compiling() or x.numel() != 1 or x.is_floating_point() or x.is_complex()
                or x.dtype == torch.bool or x.device.type == "meta" or is_fake(x) or torch.jit.is_tracing()
                or tracing_or_capturing(x.device)):
            return x
        return int(x.item())
    return int(x) if isinstance(x, numbers.Integral) else x


def _real_number(x: object) -> float | None:
    """``float(x)`` for a real number that is not a bool (int, float, numpy scalars), else None."""
    if isinstance(x, numbers.Real) and not _is_bool(x):
        return float(x)
    return None


def _window_pair(window_size: object) -> tuple[int, int]:
    """(left, right) from anything that holds two ints, as flash-attn converts it: a tuple or list of ints
    or numpy ints, a numpy array, or a 2-element integer tensor on any device (read on the host)."""
    expected = "window_size must be two ints (a negative one = unbounded): a tuple, list, array or integer tensor"
    values = window_size
    if isinstance(window_size, torch.Tensor) and torch.compiler.is_compiling():
        # (its values would choose the kernel's masking: a graph cannot depend on them)
        raise TypeError("window_size must be two Python ints under torch.compile, got a tensor")
    if isinstance(window_size, torch.Tensor) or type(window_size).__module__ == "numpy":
        kind = getattr(window_size, "dtype", None)
        integer = (not kind.is_floating_point and not kind.is_complex and kind != torch.bool
                   if isinstance(kind, torch.dtype) else getattr(kind, "kind", "") in ("i", "u"))
        if not integer or getattr(window_size, "ndim", 1) != 1:
            raise ValueError(f"{expected}, got {window_size!r}")
        values = window_size.tolist()  # a CUDA tensor waits for the GPU here, as flash-attn's int() does
    if not isinstance(values, (tuple, list)) or len(values) != 2:
        raise ValueError(f"{expected}, got {window_size!r}")
    pair = []
    for w in values:
        if _is_bool(w) or not isinstance(w, numbers.Integral):
            raise ValueError(f"{expected}, got {window_size!r}")
        pair.append(max(int(w), -1))  # any negative bound is unbounded, as in flash-attn
    return pair[0], pair[1]


def _check_options(
    dropout_p: float,
    softmax_scale: float | None,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    headdim: int,
    causal: bool = False,
    q: torch.Tensor | None = None,
    batch: int | None = None,
    sink: torch.Tensor | None = None,
    seqlens: tuple[int, int] | None = None,
) -> AttentionOptions:
    """Validate the shared keyword arguments and bundle them (``q`` gives nheads/device for ALiBi).

    ``seqlens``: (rows_q, rows_k), bounds on any one sequence's query and key counts. A window bound that
    reaches past them (``window_left >= rows_k``, ``window_right >= rows_q``) hides no key, so it
    becomes -1 (unbounded): huge bounds (2**31 - 1, ``sys.maxsize``) then never enter the kernels'
    int32 arithmetic or the PyTorch path's int64 index sums.
    """
    if not 1 <= headdim <= MAX_HEADDIM:  # (for every caller; flash_attn_with_kvcache's shapes come later)
        raise ValueError(f"headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    dropout = _real_number(dropout_p)
    if dropout is None or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout > 0 and q is not None and not torch.compiler.is_compiling() and capturing(q.device):
        # The seed is a host number (below): a captured graph would drop the same entries on every replay.
        # (Traced by torch.compile, the capture query would break the graph: the op checks when it runs.)
        raise ValueError(_ops.DROPOUT_CAPTURED.format(dropout_p=dropout_p))
    if not _is_bool(causal):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    causal = bool(causal)
    left, right = _window_pair(window_size)
    if seqlens is not None:
        rows_q, rows_k = seqlens
        left = -1 if left >= rows_k else left
        right = -1 if right >= rows_q else right
    cap = _real_number(softcap)
    if cap is None or not -math.inf < cap < math.inf:
        raise ValueError(f"softcap must be a finite float (<= 0: off), got {softcap!r}")
    cap = max(cap, 0.0)  # flash-attn: a softcap <= 0 is off
    if alibi_slopes is not None:
        nheads = q.shape[-2]
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, expected {q.device} (the device of q)")
        if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                             f"got {tuple(alibi_slopes.shape)}")
    if sink is not None:
        if not isinstance(sink, torch.Tensor):
            raise TypeError(f"sink must be a torch.Tensor or None, got {type(sink).__name__}")
        if sink.dtype != torch.float32:
            raise TypeError(f"sink must be float32, got {sink.dtype}")
        if sink.device != q.device:
            raise ValueError(f"sink is on {sink.device}, expected {q.device} (the device of q)")
        if tuple(sink.shape) != (q.shape[-2],):
            raise ValueError(f"sink must have shape ({q.shape[-2]},) (one logit per query head), "
                             f"got {tuple(sink.shape)}")
    if softmax_scale is None:
        scale = headdim**-0.5
    else:
        scale = _real_number(softmax_scale)
        if scale is None:
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not 0 < scale < math.inf:
            raise ValueError(f"softmax_scale must be a finite float > 0, got {softmax_scale!r}")
    seed = _dropout_seed(q.device if q is not None else None) if dropout > 0 else 0
    return AttentionOptions(scale, causal, left, right, cap, alibi_slopes, sink, None, dropout, seed)


_SEED_MASK = (1 << 62) - 1
_SEED_LOCK = threading.Lock()  # one offset per call when threads share a GPU


def capturing(device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (torch's check reads the current
    device's, so a capture on another GPU than the current one would pass it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _dropout_seed(device: torch.device | None) -> int | torch.Tensor:
    """A dropout call's seed in [0, 2**62), drawn on the host (no sync).

    CUDA inputs in eager mode take it from the device's CUDA generator, as flash-attn and SDPA do: its seed and
    philox offset, the offset then advanced by one step (4, the generator's unit). ``torch.cuda.manual_seed``
    and the CUDA RNG state (``torch.cuda.get_rng_state``/``set_rng_state``, activation checkpointing's replay)
    govern the mask, and torch's CPU generator, which a data pipeline may draw from, is left alone. Elsewhere,
    and while torch.compile traces (the generator's methods do not trace), the CPU generator gives it; traced,
    as a one-element int64 host tensor that the custom op reads (``.item()`` would break the graph). But under
    an ``activation_memory_budget`` below 1 AOTAutograd's partitioner may recompute the graph's random ops for
    the backward (PyTorch's own dropout's too), which would give the backward another seed, so another mask,
    than the forward's: there the seed is drawn outside the graph (a graph break; with ``fullgraph=True`` an error
    that says so: a captured ``.item()`` would be recomputed too).
    """
    if device is not None and device.type == "cuda" and not torch.compiler.is_compiling():
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        with _SEED_LOCK:
            offset = generator.get_offset()
            generator.set_offset(offset + 4)
        # SplitMix64's finalizer of (seed, offset): nearby offsets give unrelated seeds.
        z = (generator.initial_seed() * 0x9E3779B97F4A7C15 + offset + 1) & ((1 << 64) - 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        return (z ^ (z >> 31)) & _SEED_MASK
    if torch.compiler.is_compiling():
        if torch._functorch.config.activation_memory_budget >= 1:
            return torch.randint(0, 2**62, (1,), device="cpu")
        # The partitioner may recompute a seed drawn inside the graph for the backward (a captured .item() too):
        # drawn after a graph break instead, which fullgraph=True refuses with this message.
        torch._dynamo.graph_break(
            msg="flashtile: a dropout call under torch._functorch.config.activation_memory_budget < 1 draws its seed "
                "outside the graph (inside it, the backward may recompute another seed, so another mask); compile "
                "without fullgraph=True, or with the budget at 1")
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=("q", "k", "v"), fp8: bool = False) -> str:
    """Check shapes, dtypes and devices of BSHD q, k, v; return the backend that will run them. ``fp8``:
    FP8 inputs whose dtypes and devices ``flashtile.fp8.check_inputs`` has checked."""
    qn, kn, vn = names
    _check_tensor(qn, q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_tensor(kn, k, 4, "(batch, seqlen_k, nheads_k, headdim)")
    _check_tensor(vn, v, 4, "(batch, seqlen_k, nheads_k, headdim)", keys_fastest=fp8)
    batch, _, nheads, headdim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: {qn} {q.shape[0]}, {kn} {k.shape[0]}, {vn} {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{kn} and {vn} must have the same seqlen_k, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{kn} and {vn} must have the same nheads_k, got {k.shape[2]} and {v.shape[2]}")
    if k.shape[3] != headdim or v.shape[3] != headdim:
        raise ValueError(
            f"headdim must match: {qn} {headdim}, {kn} {k.shape[3]}, {vn} {v.shape[3]}"
        )
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    nheads_k = k.shape[2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(
            f"nheads ({nheads}, from {qn}) must be a multiple of nheads_k ({nheads_k}, from {kn}) for GQA/MQA"
        )
    backend = select_backend(q.device)
    if not fp8:
        _check_dtype_device({qn: q, kn: k, vn: v}, backend)
    return backend


# ---------------------------------------------------------------------------------------------------
# Autograd: one Function for every public entry point and both backends
# ---------------------------------------------------------------------------------------------------


def flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only, outside autograd: the building block of split and distributed attention.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q.
        lse: (batch, nheads, seqlen_q), natural log, float32 (float64 for float64 inputs on the PyTorch
            path); ``-inf`` where a row sees no key.
    """
    backend = _check_qkv(q, k, v)
    opts = _check_options(0.0, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q, q.shape[0],
                          seqlens=(q.shape[1], k.shape[1]))
    with torch.no_grad():
        return _ops.run_forward(q, k, v, opts, backend)


def flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward only, outside autograd, from a given ``out`` and ``lse``.

    ``out`` and ``lse`` need not come from these q, k, v: context parallelism passes the final output
    and logsumexp of the whole sequence, so that each block's gradients are its exact share.

    Args:
        dout, out: (batch, seqlen_q, nheads, headdim), dtype of q.
        lse: (batch, nheads, seqlen_q) float32 (or float64 on the PyTorch path).

    Returns:
        dq (shape of q), dk, dv (shape of k, v).
    """
    backend = _check_qkv(q, k, v)
    opts = _check_options(0.0, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q, q.shape[0],
                          seqlens=(q.shape[1], k.shape[1]))
    for name, x in (("dout", dout), ("out", out)):
        _check_tensor(name, x, 4, "(batch, seqlen_q, nheads, headdim)")
        if x.shape != q.shape or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must match q: shape {tuple(q.shape)}, {q.dtype} on {q.device}; "
                             f"got {tuple(x.shape)}, {x.dtype} on {x.device}")
    expected = (q.shape[0], q.shape[2], q.shape[1])
    if not isinstance(lse, torch.Tensor) or lse.dtype not in (torch.float32, torch.float64):
        # (a 16-bit lse would be taken as it is and give gradients off by its rounding, about 1e-2)
        raise TypeError(f"lse must be a float32 tensor (float64 on the PyTorch path), as flash_attn_forward returns "
                        f"it; got {lse.dtype if isinstance(lse, torch.Tensor) else type(lse).__name__}")
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape {expected} (batch, nheads, seqlen_q), got {tuple(lse.shape)}")
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device}, expected {q.device} (the device of q)")
    lse = lse.contiguous() if backend == "torch" else lse.float().contiguous()
    with torch.no_grad():
        return _ops.run_backward(dout, q, k, v, out, lse, opts, backend)


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               return_attn_probs, sink=None, names=("q", "k", "v"), fp8=None, plan_key=None):
    backend = _check_qkv(q, k, v, names, fp8=fp8 is not None)
    opts = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q,
                          q.shape[0], sink, seqlens=(q.shape[1], k.shape[1]))
    if fp8 is not None:  # FP8 kernels (flashtile.fp8): forward only
        with torch.no_grad():
            if opts.sink is None:  # the custom op's options: traced by torch.compile
                out, lse = _ops.forward_no_grad(q, k, v, opts, backend, fp8=fp8[:4])
            else:
                out, lse = _ops.run_forward(q, k, v, opts, backend, fp8=fp8)
        return (out, lse, None) if return_attn_probs else out
    if plan_key is not None:  # dense, no tensor options: the call's launches may be recorded
        out, lse = _ops.recorded_attention(plan_key, q, k, v, opts, backend)
    else:
        out, lse = _ops.attention(q, k, v, opts, backend, None)
    if return_attn_probs:
        return out, lse, _dropped_probs(q, k, opts, backend) if opts.dropout_p > 0 else None
    return out


def _dropped_probs(q, k, opts: AttentionOptions, backend: str) -> torch.Tensor:
    """flash-attn's S_dmask, a testing aid for small shapes: the attention probabilities
    (batch, nheads, seqlen_q, seqlen_k), negated where dropout removed them."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    # (Traced by torch.compile, a tensor read here: a graph break, or under fullgraph=True a captured scalar.)
    seed = int(opts.dropout_seed)
    with torch.no_grad():
        mask_of = _ops._triton_backend().dropout_mask if backend == "triton" else reference.dropout_mask
        keep = mask_of(batch, nheads, seqlen_q, seqlen_k, opts.dropout_p, seed, q.device)
        _, _, probs = reference.attention_ref(q.detach(), k.detach(), k.detach(), opts.softmax_scale, opts.causal,
                                              torch.float32, (opts.window_left, opts.window_right), opts.softcap,
                                              opts.alibi_slopes, opts.sink, return_probs=True)
    return torch.where(keep, probs, -probs)


# ---------------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------------

_TAIL_DOC = """
        dropout_p (float): dropout probability on the attention matrix, in [0, 1).
        softmax_scale (float, optional): multiplier of ``q @ k^T``; default ``headdim ** -0.5``.
        causal (bool): causal mask aligned to the bottom-right corner (see the module docstring).
        window_size (tuple[int, int]): ``(left, right)``: query i sees keys in
            ``[i + sk - sq - left, i + sk - sq + right]``; -1 (any negative) is unbounded; causal sets right
            to 0.
        softcap (float): if > 0, scores become ``softcap * tanh(score / softcap)``; 0.0 (or below) is off.
        alibi_slopes (Tensor, optional): float32 (nheads,) or (batch, nheads); adds
            ``-slope * |i + sk - sq - j|`` to the score.
        deterministic (bool): accepted for compatibility; flashtile's backward is always deterministic.
        return_attn_probs (bool): also return ``softmax_lse`` and ``S_dmask`` (with dropout, the dense
            functions' float32 (batch, nheads, seqlen_q, seqlen_k) probabilities, negated where dropped;
            else None).
        sink (Tensor, optional): float32 (nheads,) learnable attention-sink logits (beyond flash-attn
            2): each row's softmax denominator gains ``exp(sink_h)``; gradients flow to it.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), dtype of q. With ``return_attn_probs=True``:
        ``(out, softmax_lse, S_dmask)`` where ``softmax_lse`` is float32 (batch, nheads, seqlen_q), the
        natural-log logsumexp of the scaled scores, ``-inf`` for rows that see no key (flash-attn 2
        writes ``+inf`` there; docs/compatibility.md).
"""
_FP8_DOC = """        q_descale, k_descale, v_descale (Tensor, optional): float32 (batch, nheads_k) descale factors of
            float8_e4m3fn q, k, v, one per (sequence, kv head), FA3's convention: the inputs are
            ``x.float() * descale``; query head h takes ``q_descale[:, h // (nheads // nheads_k)]``
            (``flashtile.fp8.quantize`` and ``quantize_varlen`` make them). Required with FP8 inputs, an
            error without. Finite and >= 0 (not checked: docs/fp8.md). On a CUDA GPU with FP8 tensor
            cores the FP8 forward kernel runs (FP8 QKᵀ and PV, float32 accumulation); elsewhere (CPU,
            paged varlen, dropout, head dims up to 16) the inputs are dequantized to ``out_dtype`` and the
            bfloat16/float16 path runs. Forward only: FP8 inputs or descales that require grad are an
            error (``flashtile.fp8.fp8_attn_func`` trains). See docs/fp8.md.
        out_dtype (torch.dtype, optional): output dtype for FP8 inputs, torch.bfloat16 (default) or
            torch.float16.
"""
_FP8_OUT = "dtype of q (out_dtype for FP8\n        inputs). With"
_FP8_TAIL_DOC = _TAIL_DOC.replace("\n    Returns:", _FP8_DOC + "\n    Returns:").replace("dtype of q. With", _FP8_OUT)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sink: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    return _dense_any(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      return_attn_probs, sink, (q_descale, k_descale, v_descale), out_dtype)


def _dense_any(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
               sink, descales: tuple, out_dtype, names=("q", "k", "v")):
    """flash_attn_func and the packed functions past their own checks: FP8 inputs (``_fp8_dense``) where descales
    or out_dtype are given; FP8 inputs without them fail the dtype check of the 16-bit path (``_dense``)."""
    if descales[0] is not None or descales[1] is not None or descales[2] is not None or out_dtype is not None:
        return _fp8_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          return_attn_probs, sink, descales, out_dtype, names)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                  sink, names=names)


def _fp8_dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
               sink, descales: tuple, out_dtype, names=("q", "k", "v")):
    """flash_attn_func on FP8 inputs (``flashtile.fp8.attention_func``). A dense call seen before with these
    layouts and options replays its recorded launches (``_ops.fp8_plan_key``: its checks passed under the same
    key), as 16-bit calls do: the ordinary path's checks, dispatch and Triton's binding of the FP8 kernels cost
    about ten times a replay's host time."""
    from . import fp8

    def ordinary(probs: bool = return_attn_probs):
        return fp8.attention_func(q, k, v, *descales, out_dtype, dropout_p, lambda q, k, v, fp8=None: _attention(
            q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, probs, sink, names=names,
            fp8=fp8), names)

    if (not torch.compiler.is_compiling() and alibi_slopes is None and sink is None
            and dropout_p.__class__ in (float, int) and dropout_p == 0
            and _ops.environ_get("FLASHTILE_LAUNCH_PLANS") != "0"):  # (is_compiling first: Dynamo's guards)
        key = _ops.fp8_plan_key(q, k, v, descales, softmax_scale, causal, window_size, softcap, out_dtype)
        if key is not None:
            out, lse = _ops.fp8_planned(key, (q, k, v, *descales), lambda: ordinary(True)[:2])
            return (out, lse, None) if return_attn_probs else out
    return ordinary()


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, sink,
           names=("q", "k", "v")):
    """flash_attn_func and the packed functions past their own checks (16-bit inputs)."""
    key = None
    if (not torch.compiler.is_compiling() and alibi_slopes is None and sink is None
            and dropout_p.__class__ in (float, int) and dropout_p == 0):
        # A dense call seen before with these shapes, strides and options replays its recorded launches,
        # its arguments already checked under this key (_ops.plan_key).
        key = _ops.plan_key(q, k, v, softmax_scale, causal, window_size, softcap)
        if key is not None:
            result = _ops.planned_attention(key, q, k, v)
            if result is not None:
                return (*result, None) if return_attn_probs else result[0]
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      return_attn_probs, sink, names=names, plan_key=key)


flash_attn_func.__doc__ = """Exact attention ``softmax(q @ k^T * softmax_scale) @ v``, FlashAttention-style.

    Args:
        q (Tensor): (batch, seqlen_q, nheads, headdim), float16 or bfloat16 on CUDA (also float32 and
            float64 on the PyTorch path); last dim contiguous.
        k (Tensor): (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads % nheads_k == 0.
        v (Tensor): (batch, seqlen_k, nheads_k, headdim).""" + _FP8_TAIL_DOC


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sink: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=2)  # views: the kernels read the packed tensor in place
    _ops.offer_packed(qkv)  # (autograd then takes qkv itself, and the backward writes one packed gradient)
    try:
        return _dense_any(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          return_attn_probs, sink, (q_descale, k_descale, v_descale), out_dtype,
                          names=("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"))
    finally:
        _ops.offer_packed(None)


flash_attn_qkvpacked_func.__doc__ = """Attention on a packed (batch, seqlen, 3, nheads, headdim) tensor.

    Same as ``flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...)``: 16-bit qkv is read in place
    and its gradient comes back packed in the same layout; a float8_e4m3fn qkv gives that call's results
    (forward only, v copied keys-fastest for the FP8 products as there).

    Args:
        qkv (Tensor): (batch, seqlen, 3, nheads, headdim), float16 or bfloat16 on CUDA, or float8_e4m3fn with
            descales (nheads_k = nheads).""" + _FP8_TAIL_DOC


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sink: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=2)
    return _dense_any(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      return_attn_probs, sink, (q_descale, k_descale, v_descale), out_dtype,
                      names=("q", "kv[:, :, 0]", "kv[:, :, 1]"))


flash_attn_kvpacked_func.__doc__ = """Attention with keys and values packed as (batch, seqlen_k, 2, nheads_k, headdim).

    Args:
        q (Tensor): (batch, seqlen_q, nheads, headdim), float16 or bfloat16 on CUDA.
        kv (Tensor): (batch, seqlen_k, 2, nheads_k, headdim); nheads % nheads_k == 0. float8_e4m3fn q and kv
            with descales are the FP8 forward.""" + _FP8_TAIL_DOC


# ---------------------------------------------------------------------------------------------------
# Variable length (packed sequences)
# ---------------------------------------------------------------------------------------------------


def value_checks_enabled() -> bool:
    """Whether index *values* on the device (cu_seqlens, cache_seqlens, block tables) are read back and
    checked before a launch: on by default; ``FLASHTILE_VALUE_CHECKS=0`` turns it off.

    A check is a device-to-host read, which waits for the GPU and so exposes the Python time of the
    launch that follows (a model calls varlen attention once per layer): cu_seqlens are read once per
    tensor (``_already_checked``), the KV cache's indices once per unwritten tensor where the kernels clamp
    them (``inference._recorded_check``), else on every call. Off, bad values are undefined
    behaviour, as in flash-attn; shapes, dtypes and devices are still checked.
    """
    return _ops.environ_get("FLASHTILE_VALUE_CHECKS") != "0"  # (read on every decoding step: a dict lookup)


def tracing_or_capturing(device) -> bool:
    """torch.compile is tracing, or a CUDA graph is being captured on ``device``: no host read possible,
    and tensors made now hold their values only when the graph runs."""
    return torch.compiler.is_compiling() or capturing(device)


def made_outside_graph_pool(make, device):
    """``make()``, with its CUDA allocations from the ordinary memory pool and its kernels finished, for tensors
    kept across calls. While torch.compile's CUDA graphs (mode="reduce-overhead") warm up, every allocation of
    the calling thread comes from the graph's private pool, where a tensor kept past the call is an untracked
    allocation that cudagraph trees reject; a thread of its own allocates from the ordinary pool."""
    device = torch.device(device)
    if device.type != "cuda":
        return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    made, failed = [], []

    def run():
        try:
            with torch.cuda.device(index):
                made.append(make())
                torch.cuda.current_stream(index).synchronize()  # ready before any stream reads it
        except BaseException as exc:  # raised in the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


def values_readable(device) -> bool:
    """Index values on ``device`` are read back and checked now: value checks on, and possible (not meta tensors,
    not under a fake tensor mode: shapes only there, as torch.compile's fake pass and shape probes run)."""
    if not value_checks_enabled() or tracing_or_capturing(device):  # (first: Dynamo cannot trace the mode query)
        return False
    return getattr(device, "type", device) != "meta" and torch._C._get_dispatch_mode(_FAKE_MODE) is None


_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


def pages_in_use_invalid(block_table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                         num_pages: int) -> torch.Tensor:
    """Bool scalar tensor: a page that holds one of the first ``lengths[b]`` positions of sequence b points
    outside [0, num_pages). Entries after a sequence's last page are padding (flash-attn allows any
    value there, -1 often) and are never read."""
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size < lengths[:, None]
    return (used & ((block_table < 0) | (block_table >= num_pages))).any()


class PartialCoverage(Exception):
    """cu_seqlens whose sequences cover only some of the packed rows (the first > 0, or the last < the rows):
    raised by ``_check_cu_seqlens(..., partial_ok=True)`` for the varlen call to run on the rows covered.
    ``bounds``: {name: (first, last)} of the tensors found so (the values the check read)."""

    def __init__(self, bounds: dict[str, tuple[int, int]]):
        super().__init__(bounds)
        self.bounds = bounds


def _check_cu_seqlens(name: str, cu: object, total: int | None, max_seqlen: object, max_name: str,
                      device, values: list[int] | None = None, read: bool = True,
                      partial_ok: bool = False) -> int | None:
    """cu_seqlens: int32 (batch + 1,) on ``device``, 0 first, non-decreasing, last = ``total`` (unless None),
    no sequence longer than ``max_seqlen``. Returns the longest length, or None when values were not read.
    ``values``: the tensor's values when the caller already read them (one read for several tensors);
    ``read=False``: the checks that need no values only. ``partial_ok``: sequences within the rows but not
    covering them all (flash-attn reads only the rows they name) raise ``PartialCoverage`` instead."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D of length batch + 1 >= 2, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, expected {device} (the device of q)")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{max_name} must be a Python int >= 0, got {max_seqlen!r}")
    if max_seqlen < 0:
        raise ValueError(f"{max_name} must be >= 0, got {max_seqlen}")
    if not read or not values_readable(cu.device):
        # Tracing or capturing (checked on eager calls), or FLASHTILE_VALUE_CHECKS=0 (the caller vouches
        # for the values, as flash-attn assumes).
        return None
    if values is None:
        values = cu.tolist()  # one small device-to-host copy
    within = partial_ok and values[0] >= 0 and (total is None or values[-1] <= total)
    if values[0] != 0 and not within:
        raise ValueError(f"{name}[0] must be {'>= ' if partial_ok else ''}0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if total is not None and values[-1] != total and not within:
        raise ValueError(f"{name}[-1] must {'be at most' if partial_ok else 'equal'} the number of packed tokens "
                         f"({total}), got {values[-1]}")
    if max(lengths) > max_seqlen:
        raise ValueError(f"{max_name} ({max_seqlen}) is smaller than the longest sequence ({max(lengths)})")
    if values[0] != 0 or (total is not None and values[-1] != total):
        raise PartialCoverage({name: (values[0], values[-1])})
    return max(lengths)



def _check_cu_seqlens_without_values(cu_q: object, cu_k: object, total_q: int | None, total_k: int | None,
                                     max_seqlen_q: object, max_seqlen_k: object, device) -> None:
    """What ``_check_cu_seqlens`` checks of both tensors without reading their values, and that they
    have the same length."""
    _check_cu_seqlens("cu_seqlens_q", cu_q, total_q, max_seqlen_q, "max_seqlen_q", device, read=False)
    _check_cu_seqlens("cu_seqlens_k", cu_k, total_k, max_seqlen_k, "max_seqlen_k", device, read=False)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_q.numel()} and {cu_k.numel()}")


def _check_cu_seqlens_pair(cu_q: object, cu_k: object, total_q: int | None, total_k: int | None, max_seqlen_q: object,
                           max_seqlen_k: object, device, k_lengths_only: bool = False) -> tuple[int | None, int | None]:
    """Both cu_seqlens (see ``_check_cu_seqlens``) with one device-to-host read: each read waits for the
    GPU, and a model calls this once per layer. Returns the longest lengths (None when not read).
    ``k_lengths_only``: only cu_k's differences count (paged keys, which the block table places), so it may
    start anywhere, as flash-attn's paged kernel reads it."""
    _check_cu_seqlens_without_values(cu_q, cu_k, total_q, total_k, max_seqlen_q, max_seqlen_k, device)
    if not values_readable(device):
        return None, None
    both = (cu_q if cu_k is cu_q else torch.cat([cu_q, cu_k])).tolist()
    values_q, values_k = both[:cu_q.numel()], both[-cu_k.numel():]
    if k_lengths_only:
        values_k = [value - values_k[0] for value in values_k]
    return (_check_cu_seqlens("cu_seqlens_q", cu_q, total_q, max_seqlen_q, "max_seqlen_q", device, values_q),
            _check_cu_seqlens("cu_seqlens_k", cu_k, total_k, max_seqlen_k, "max_seqlen_k", device, values_k))


class _ValueRead:
    """The values of int32 vectors of one length, read without waiting on a CUDA device (a copy into
    pinned memory and an event), at once elsewhere."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.count = tensors[0].numel()
        if tensors[0].is_cuda:
            self.host = torch.empty(len(tensors) * self.count, dtype=torch.int32, pin_memory=True)
            for i, t in enumerate(tensors):
                self.host[i * self.count:(i + 1) * self.count].copy_(t, non_blocking=True)
            self.copied: torch.cuda.Event | None = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(tensors[0].device))  # the stream the copies ran on
        else:
            self.host, self.copied = torch.cat([t.reshape(-1) for t in tensors]), None

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()

    def values(self, i: int = 0) -> list[int]:
        """The i-th tensor's values (waits for the copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host[i * self.count:(i + 1) * self.count].tolist()


def tensor_state(t: torch.Tensor | None) -> tuple | None:
    """What shows that ``t``'s values cannot have changed through PyTorch since: the tensor itself (held
    weakly), its data pointer and its version counter (bumped by every in-place write PyTorch makes). None
    for None. Inference tensors have no version counter: callers leave them out."""
    return None if t is None else (weakref.ref(t), t.data_ptr(), t._version)


def unchanged_since(state: tuple | None, t: torch.Tensor | None) -> bool:
    """Whether ``t`` is the tensor ``state`` (``tensor_state``) was taken of, unwritten since."""
    if state is None or t is None:
        return state is None and t is None
    ref, data_ptr, version = state
    return ref() is t and t.data_ptr() == data_ptr and t._version == version


@dataclasses.dataclass
class _CheckedValues:
    """A cu_seqlens tensor's values that passed the checks, and what they were checked against."""

    state: tuple  # tensor_state when its values were read
    total: int
    longest: int  # the longest sequence: any max_seqlen from here up passes
    values: list[int]
    later_read: _ValueRead | None = None  # the values read again by a later call, not waited for
    later_read_at: float = 0.0  # when (time.perf_counter) the last one started


# A trusted cu_seqlens tensor's values are read again at most this often (a read costs a pinned buffer,
# a copy and an event: tens of microseconds of host time on a slow host, next to a call of ~200).
_REREAD_INTERVAL_S = 1e-3

# cu_seqlens tensors (by identity, held weakly) whose values were read and checked. A model passes the
# same cu_seqlens to every layer of a step: read once, the check costs one device-to-host wait per step,
# not one per layer (each wait drains the GPU and exposes the host time of what follows).
_CHECKED_CU_SEQLENS = WeakIdKeyDictionary()


def _already_checked(name: str, cu: torch.Tensor, total: int, max_seqlen: int, max_name: str) -> bool:
    """Whether ``cu``'s values were checked against ``total`` (and a ``max_seqlen`` at least its longest
    sequence) and cannot have changed since.

    In-place writes through PyTorch bump the tensor's version, which sends it back to a full check.
    Writes that bypass it (``dist.broadcast``, ``.data``, DLPack) are caught a call or more late: a call
    that trusts the record starts a read of the values that it does not wait for (once the previous one
    has arrived, and at most every ``_REREAD_INTERVAL_S``), and the first call that finds it arrived
    compares it with the record. In between, the kernels clamp every sequence to the packed rows, so a
    bad value reads or writes nothing outside the tensors (those calls' outputs and gradients are wrong;
    this raises). Inference tensors have no version counter: they are checked on every call.
    """
    if cu.is_inference():
        return False
    entry = _CHECKED_CU_SEQLENS.get(cu)
    if entry is None or not unchanged_since(entry.state, cu) or entry.total != total or max_seqlen < entry.longest:
        return False
    later = entry.later_read  # read once: another thread may take it meanwhile
    if later is not None and later.ready():
        entry.later_read = None
        seen = later.values()
        if seen != entry.values:
            _CHECKED_CU_SEQLENS.pop(cu, None)
            try:
                longest = _check_cu_seqlens(name, cu, total, max_seqlen, max_name, cu.device, seen)
            except ValueError as exc:
                raise ValueError(f"{exc} ({name} was written without PyTorch seeing it, e.g. by dist.broadcast "
                                 "or through .data, after its values were checked: attention calls since then "
                                 "already ran with these values)") from None
            entry.values, entry.longest = seen, longest
            _CHECKED_CU_SEQLENS[cu] = entry
    now = time.perf_counter()
    if entry.later_read is None and now - entry.later_read_at >= _REREAD_INTERVAL_S:
        entry.later_read, entry.later_read_at = _ValueRead([cu]), now
    return True


def _start_cu_seqlens_check(cu_q: object, cu_k: object, total_q: int, total_k: int, max_seqlen_q: object,
                            max_seqlen_k: object, device, partial_ok: bool = False) -> Callable[[], None] | None:
    """``_check_cu_seqlens_pair`` with each tensor's values read once (``_already_checked``) and, on a
    CUDA device, checked just before the forward's kernel launch.

    The values' device-to-host copy starts now (into pinned memory) and the returned callable waits for
    it and checks them; the forward calls it just before its launch. A read waits for all the GPU work
    queued before it, so reading at the top of the call would leave the GPU idle for all of the call's
    host time; waiting at the launch leaves it idle for the launch alone. Everything that needs no
    values is checked now, and off a CUDA device the values too. Returns None where nothing is left to
    check. ``partial_ok``: see ``_check_cu_seqlens`` (its ``PartialCoverage`` comes now, or at the launch).
    """
    _check_cu_seqlens_without_values(cu_q, cu_k, total_q, total_k, max_seqlen_q, max_seqlen_k, device)
    if not values_readable(device):
        return None
    to_read = []
    for name, cu, total, max_seqlen, max_name in (("cu_seqlens_q", cu_q, total_q, max_seqlen_q, "max_seqlen_q"),
                                                  ("cu_seqlens_k", cu_k, total_k, max_seqlen_k, "max_seqlen_k")):
        if name == "cu_seqlens_k" and cu_k is cu_q and (total_k, max_seqlen_k) == (total_q, max_seqlen_q):
            break  # one tensor for both (self-attention): read and checked once
        if not _already_checked(name, cu, total, max_seqlen, max_name):
            to_read.append((name, cu, total, max_seqlen, max_name))
    if not to_read:
        return None
    read = _ValueRead([cu for _, cu, *_rest in to_read])
    states = [None if cu.is_inference() else tensor_state(cu) for _, cu, *_rest in to_read]

    def finish() -> None:
        partial = {}
        for i, (name, cu, total, max_seqlen, max_name) in enumerate(to_read):
            values = read.values(i)
            try:
                longest = _check_cu_seqlens(name, cu, total, max_seqlen, max_name, device, values,
                                            partial_ok=partial_ok)
            except PartialCoverage as found:  # (the other tensor is still checked: its errors come first)
                partial.update(found.bounds)
                continue
            if states[i] is not None:  # an inference tensor cannot be trusted later: no version counter
                _CHECKED_CU_SEQLENS[cu] = _CheckedValues(states[i], total, longest, values)
        if partial:
            raise PartialCoverage(partial)

    if device.type != "cuda":
        finish()  # a read off the GPU costs no wait: checked before anything else happens
        return None
    return finish


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    return _varlen_any(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, sink,
                       (q_descale, k_descale, v_descale), out_dtype)


def _varlen_any(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, return_attn_probs, block_table, sink, descales: tuple, out_dtype,
                names=("q", "k", "v")):
    """flash_attn_varlen_func and its packed forms (``names``: what errors call the parts, e.g. ``qkv[:, 0]``)."""
    max_seqlen_q, max_seqlen_k = _as_index(max_seqlen_q), _as_index(max_seqlen_k)
    # FP8 inputs come with descales; without them they fail the dtype check of the path below.
    if descales[0] is not None or descales[1] is not None or descales[2] is not None or out_dtype is not None:
        from . import fp8

        def run(q, k, v, table, fp8=None):
            return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                                     table, sink, fp8, names)

        return fp8.varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, *descales, out_dtype, dropout_p, run,
                               names)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, sink,
                             names=names)


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, sink, fp8=None,
                      names=("q", "k", "v")):
    """flash_attn_varlen_func past its FP8 branch; ``fp8``: FP8 inputs for the FP8 kernels (no block_table);
    ``names``: what errors call q, k and v."""
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                             block_table, sink)
    for name, x, layout in zip(names, (q, k, v), ("(total_q, nheads, headdim)", "(total_k, nheads_k, headdim)",
                                                   "(total_k, nheads_k, headdim)")):
        _check_tensor(name, x, 3, layout)
    backend = _check_qkv(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), names, fp8=fp8 is not None)
    try:
        return _varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, sink, fp8,
                               backend)
    except PartialCoverage as found:  # (raised by the values' check, before any launch)
        bounds = found.bounds
    # Sequences that cover only some of the packed rows (a preallocated buffer, say): the call runs on the rows
    # covered, and the others come out 0, lse -inf, with zero gradients (flash-attn leaves them unwritten). The
    # bounds are the values the check read; a tensor not among them covers its rows (or is cu_seqlens_q itself).
    first_q, last_q = bounds.get("cu_seqlens_q", (0, q.shape[0]))
    first_k, last_k = bounds.get("cu_seqlens_k", (first_q, last_q) if cu_seqlens_k is cu_seqlens_q else (0, k.shape[0]))
    cu_q = cu_seqlens_q - first_q
    cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k - first_k
    out, lse, _ = _varlen_checked(q[first_q:last_q], k[first_k:last_k], v[first_k:last_k], cu_q, cu_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  True, sink, fp8, backend)
    rows = (first_q, q.shape[0] - last_q)
    out = torch.nn.functional.pad(out, (0, 0, 0, 0, *rows))
    lse = torch.nn.functional.pad(lse, rows, value=-math.inf)
    return (out, lse, None) if return_attn_probs else out


def _varlen_checked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                    window_size, softcap, alibi_slopes, return_attn_probs, sink, fp8, backend):
    """``_varlen_attention`` past its tensor checks; raises ``PartialCoverage`` (before any launch) for
    cu_seqlens that cover only some rows (not with FP8 inputs: they must cover all)."""
    check_values = _start_cu_seqlens_check(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                           max_seqlen_k, q.device, partial_ok=fp8 is None)
    batch = cu_seqlens_q.numel() - 1
    opts = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q, batch,
                          sink, seqlens=(q.shape[0], k.shape[0]))  # no sequence is longer than the packed rows
    if not torch.compiler.is_compiling() and type(max_seqlen_q) is int and type(max_seqlen_k) is int:
        # (the kernels' grids cover max_seqlen_q: a generous bound would launch programs with no rows)
        max_seqlen_q, max_seqlen_k = min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0])
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    key = None
    if (not torch.compiler.is_compiling() and check_values is None and alibi_slopes is None and sink is None
            and opts.dropout_p == 0 and type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and type(cu_seqlens_q) is torch.Tensor and type(cu_seqlens_k) is torch.Tensor):
        # cu_seqlens whose values were checked and are unwritten since: the launches may come from a plan
        # (the checks above still run; _ops.recorded_attention, and _ops.fp8_planned for FP8 inputs).
        if fp8 is None:
            key = _ops.plan_key(q, k, v, softmax_scale, causal, window_size, softcap)
        elif _ops.environ_get("FLASHTILE_LAUNCH_PLANS") != "0":
            key = _ops.fp8_plan_key(q, k, v, fp8[:3], softmax_scale, causal, window_size, softcap, fp8[3])
        if key is not None:
            key = (key, cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_q.dtype, cu_seqlens_q.device,
                   cu_seqlens_k.shape, cu_seqlens_k.stride(), cu_seqlens_k.dtype, cu_seqlens_k.device,
                   cu_seqlens_q is cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if fp8 is not None:  # FP8 kernels (flashtile.fp8): forward only
        def call():
            with torch.no_grad():
                return _ops.run_forward(q, k, v, opts, backend, varlen, before_launch=check_values, fp8=fp8)

        if key is not None:
            cu = (cu_seqlens_q,) if cu_seqlens_k is cu_seqlens_q else (cu_seqlens_q, cu_seqlens_k)
            out, lse = _ops.fp8_planned(key, (q, k, v, *fp8[:3], *cu), call)
        else:
            out, lse = call()
    elif key is not None:
        out, lse = _ops.recorded_attention(key, q, k, v, opts, backend, varlen)
    else:
        out, lse = _ops.attention(q, k, v, opts, backend, varlen, before_launch=check_values)
    return (out, lse, None) if return_attn_probs else out


flash_attn_varlen_func.__doc__ = """Attention over packed variable-length sequences.

    Sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` against ``k, v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]``;
    causal and window masks apply within each sequence (bottom-right aligned per sequence). Sequences of
    length 0 are allowed.

    Args:
        q (Tensor): (total_q, nheads, headdim), float16 or bfloat16 on CUDA.
        k, v (Tensor): (total_k, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k (Tensor): int32 (batch + 1,), non-decreasing, within the packed rows:
            usually 0 first and last = total; rows outside every sequence come out 0 (lse -inf) and get zero
            gradients on eager calls (undefined under torch.compile or CUDA-graph capture, as in flash-attn).
        max_seqlen_q, max_seqlen_k (int): the longest sequence lengths.
        block_table (Tensor, optional): int32 (batch, max_pages): paged keys and values, forward only. k, v
            are then page pools (num_pages, page_size, nheads_k, headdim), any page size; sequence b's
            keys are the first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` positions of its pages
            ``block_table[b]`` (cu_seqlens_k then gives lengths only, not offsets into k). The forward
            runs when q, k, v require grad; a backward through its output raises
            NotImplementedError. With FP8 inputs, batch = len(cu_seqlens_q) - 1 in the descales' shape;
            with block_table, sequence b's pages are read with its factors.""" + _TAIL_DOC.replace(
    "(batch, seqlen_q, nheads, headdim)", "(total_q, nheads, headdim)").replace(
    "float32 (batch, nheads, seqlen_q)", "float32 (nheads, total_q)").replace(
    "\n    Returns:", _FP8_DOC + "\n    Returns:").replace("dtype of q. With", _FP8_OUT)


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_attn_probs, block_table, sink):
    """flash_attn_varlen_func with ``block_table``: keys and values from page pools. Forward only."""
    _check_tensor("q", q, 3, "(total_q, nheads, headdim)")
    for name, x in (("k", k), ("v", v)):
        _check_tensor(name, x, 4, "(num_pages, page_size, nheads_k, headdim) with block_table")
        if x.numel() and x.stride(0) != x.shape[1] * x.stride(1):
            raise ValueError(f"{name} must be contiguous over its first two dims (the pages): strides {x.stride()}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError("block_table must be an int32 tensor of shape (batch, max_pages), got "
                        f"{getattr(block_table, 'dtype', type(block_table).__name__)} "
                        f"{tuple(getattr(block_table, 'shape', ()))}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device}, expected {q.device} (the device of q)")
    dropout = _real_number(dropout_p)
    if dropout is None or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout:
        raise NotImplementedError("dropout_p > 0 with block_table (paged attention is for inference)")
    num_pages, page_size, nheads_k, headdim = k.shape
    k_pool, v_pool = k.reshape(num_pages * page_size, nheads_k, headdim), v.reshape(num_pages * page_size, nheads_k,
                                                                                     headdim)
    backend = _check_qkv(q.unsqueeze(0), k_pool.unsqueeze(0), v_pool.unsqueeze(0))
    batch, max_pages = block_table.shape
    capacity = max_pages * page_size
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if isinstance(cu, torch.Tensor) and cu.numel() != batch + 1:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have batch + 1 = {batch + 1} entries (block_table "
                             f"has {batch} rows), got {name} with {cu.numel()}")
    _, longest = _check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, q.shape[0], None, max_seqlen_q, max_seqlen_k,
                                         q.device, k_lengths_only=True)
    if longest is not None and longest > capacity:
        raise ValueError(f"cu_seqlens_k: a sequence of {longest} keys exceeds what block_table holds "
                         f"({max_pages} pages of {page_size})")
    opts = _check_options(dropout_p, softmax_scale, window_size, softcap, alibi_slopes, headdim, causal, q, batch,
                          sink, seqlens=(q.shape[0], capacity))
    bounds_k = _paged_key_bounds(block_table, cu_seqlens_k, page_size, num_pages, q.device, backend == "triton")

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return _ops.run_forward(q, k_pool, v_pool, opts, backend,
                                    (cu_seqlens_q, bounds_k, max_seqlen_q, max_seqlen_k),
                                    (block_table.contiguous(), page_size))  # the kernel walks a row with stride 1

    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = _ForwardOnly.apply(run, q, k, v)  # the forward runs, as in flash-attn; a backward raises
    else:
        out, lse = run()
    return (out, lse.float(), None) if return_attn_probs else out


# block_table id -> (its state, cu_seqlens_k's state, (page_size, num_pages)) of a pair whose pages in use were
# checked (``_paged_key_bounds``); cleared past _MAX_CHECKED_TABLES entries.
_CHECKED_TABLES: dict[int, tuple] = {}
_MAX_CHECKED_TABLES = 1024


def _paged_key_bounds(block_table: torch.Tensor, cu_seqlens_k: torch.Tensor, page_size: int, num_pages: int,
                      device, kernels: bool) -> torch.Tensor:
    """int32 (batch, 2) [0, length] bounds of each sequence's keys (logical positions in its pages), built from
    cu_seqlens_k on every call (so they follow its values as the kernels read them), after a check that the pages
    in use lie in the pool: a device read, made once per (block_table, cu_seqlens_k) pair while both stay
    unwritten, as a model's layers pass them (the kernel clamps page numbers into the pool, so values written
    behind PyTorch's back stay inside it: ``kernels``, the Triton backend); on every call on the PyTorch path
    (its indexing does not clamp) or for inference tensors; never where values are not readable (capture,
    compile, FLASHTILE_VALUE_CHECKS=0)."""
    readable = values_readable(device)
    cacheable = kernels and readable and not (block_table.is_inference() or cu_seqlens_k.is_inference())
    sizes = (page_size, num_pages)
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    bounds = torch.stack([torch.zeros_like(lengths), lengths], dim=1).contiguous()  # logical start 0
    if cacheable:
        entry = _CHECKED_TABLES.get(id(block_table))
        if (entry is not None and entry[2] == sizes and unchanged_since(entry[0], block_table)
                and unchanged_since(entry[1], cu_seqlens_k)):
            return bounds
    if block_table.numel() and readable and pages_in_use_invalid(block_table, lengths, page_size, num_pages).item():
        raise ValueError(f"block_table values of the pages in use must lie in [0, {num_pages}) (the pages of k)")
    if cacheable:
        if len(_CHECKED_TABLES) >= _MAX_CHECKED_TABLES:
            _CHECKED_TABLES.clear()
        _CHECKED_TABLES[id(block_table)] = (tensor_state(block_table), tensor_state(cu_seqlens_k), sizes)
    return bounds


class _ForwardOnly(torch.autograd.Function):
    """Paged attention's output joined to the graph of q, k, v: the forward runs whether or not they
    require grad (flash-attn's does), and a backward through it raises instead of returning gradients
    that are not computed."""

    @staticmethod
    def forward(ctx, run, q, k, v):
        out, lse = run()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError("flash_attn_varlen_func with block_table is forward only (paged attention for "
                                  "inference): it has no backward; detach its output or leave the paged call "
                                  "out of the loss")


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_varlen_func` on qkv packed as (total, 3, nheads, headdim); float8_e4m3fn qkv with
    per-sequence descales (batch, nheads) is the FP8 forward, as there."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be a tensor of shape (total, 3, nheads, headdim), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    q, k, v = qkv.unbind(dim=1)
    return _varlen_any(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, return_attn_probs, None, None,
                       (q_descale, k_descale, v_descale), out_dtype, names=("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"))


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
):
    """:func:`flash_attn_varlen_func` with kv packed as (total_k, 2, nheads_k, headdim); float8_e4m3fn q and kv
    with per-sequence descales (batch, nheads_k) is the FP8 forward, as there."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must be a tensor of shape (total_k, 2, nheads_k, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    k, v = kv.unbind(dim=1)
    return _varlen_any(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, return_attn_probs, None, None,
                       (q_descale, k_descale, v_descale), out_dtype, names=("q", "kv[:, 0]", "kv[:, 1]"))
