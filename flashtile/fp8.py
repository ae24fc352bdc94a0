"""FP8 attention inputs (FA3's convention): quantization helpers and the interim dequantize path.

``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` take ``torch.float8_e4m3fn``
q, k, v with float32 descale factors (``x ≈ x_fp8.float() * descale``), one per (sequence, kv head)::

    q_descale, k_descale, v_descale   float32 (batch, nheads_k); query head h uses its kv head's factor,
                                      q_descale[:, h // (nheads // nheads_k)], as FA3 does

On a CUDA GPU with FP8 tensor cores, ``flash_attn_func`` and ``flash_attn_varlen_func`` (without
``block_table``) run the forward kernel's FP8 variant: QK^T and PV on FP8 tensor cores with float32
accumulation, the descales folded into the softmax scale and the output, P rounded to float8_e4m3fn
before PV (as FA3 does), V copied keys-fastest first (the layout FP8 tensor-core products read).
``flash_attn_with_kvcache`` reads an FP8 cache in the kernel, in the queries' precision (out_dtype). Elsewhere
(the CPU, paged varlen calls, head dims up to 16, dropout) q, k, v are dequantized to ``out_dtype``
(bfloat16 by default, or float16) and the existing path runs in that precision: the result is what
the same call on the dequantized inputs returns. FP8 tensors have no backward; ``fp8_attn_func`` trains
with FP8 attention from bf16/fp16 inputs.

Shape legend: ``batch`` sequences, ``seqlen`` tokens each (``total`` packed tokens for varlen),
``nheads`` heads of ``headdim`` features; ``cu_seqlens`` int32 (batch + 1,).
"""

from __future__ import annotations

import numbers

import torch

from .interface import _check_cu_seqlens, _check_tensor, pages_in_use_invalid, values_readable
from .layout import keys_fastest_memory

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: the largest finite float8_e4m3fn value
OUT_DTYPES = (torch.bfloat16, torch.float16)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90), Blackwell


# ---------------------------------------------------------------------------------------------------
# Quantization helpers
# ---------------------------------------------------------------------------------------------------


def _scale_from_amax(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, descale) float32 mapping ``amax`` to FP8_MAX; 1 where amax is 0 (an all-zero row) or so small
    that FP8_MAX / amax would overflow float32 (a scale of inf would turn the row's zeros into NaN)."""
    amax = amax.float()
    usable = amax > FP8_MAX * torch.finfo(torch.float32).tiny
    scale = torch.where(usable, FP8_MAX / amax, torch.ones_like(amax))
    return scale, 1.0 / scale


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` rounded to float8_e4m3fn, saturated at ±FP8_MAX (explicitly: casts of values
    past the format's range are not saturating on every device)."""
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize(x: torch.Tensor, nheads_k: int | None = None,
             keys_fastest: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize BSHD ``x`` to float8_e4m3fn with one scale per (batch, head), or per (batch, kv head).

    Args:
        x (Tensor): (batch, seqlen, nheads, headdim), any float dtype.
        nheads_k (int, optional): for a query tensor of GQA/MQA, the kv heads: query heads h with the same
            ``h // (nheads // nheads_k)`` share one scale, as ``q_descale`` (batch, nheads_k) wants.
        keys_fastest (bool): for v: return it laid out (batch, nheads, headdim, seqlen) in memory, tokens
            fastest (seqlen padded to a multiple of 16), the layout FP8 tensor cores read V in.
            ``flash_attn_func`` takes such a v as it is; any other FP8 v it copies so on each call.

    Returns:
        x_fp8 (Tensor): float8_e4m3fn, the shape of x: ``x * scale`` rounded, where ``scale`` maps the
            largest ``|x|`` of each (batch, head), over seqlen and headdim (and the heads of a group),
            to 448. Contiguous, or with ``keys_fastest`` a view of strides (nheads * headdim * padded, 1,
            headdim * padded, padded).
        descale (Tensor): float32 (batch, nheads) or (batch, nheads_k), ``1 / scale`` (1 where all are
            zero), so that ``x ≈ dequantize(x_fp8, descale)``: the ``*_descale`` argument.

    On a CUDA tensor, outside torch.compile's tracing, two Triton kernels compute the same bits
    (``kernels/fp8_quantize.py``; keys_fastest: written in that layout); elsewhere PyTorch ops.
    """
    _check_tensor("x", x, 4, "(batch, seqlen, nheads, headdim)")
    _check_quantizable(x)
    if _fp8_kernels_take(x, nheads_k):  # the same bits in two launches (kernels/fp8_quantize.py)
        from .kernels.fp8_quantize import quantize_heads

        return quantize_heads(x.detach(), nheads_k, keys_fastest=keys_fastest)
    if x.shape[1] * x.shape[3] == 0:  # nothing to scale: descale 1 (amax over an empty dim is an error)
        amax = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float32, device=x.device)
    else:
        amax = x.detach().abs().amax(dim=(1, 3))
    amax = _group_amax(amax, nheads_k)
    scale, descale = _scale_from_amax(amax)
    per_head = _per_head(scale, x.shape[2])[:, None, :, None]
    if keys_fastest:
        return _to_fp8_keys_fastest(x.detach(), per_head), descale
    return _to_fp8(x.detach(), per_head), descale


def _fp8_kernels_take(x: torch.Tensor, nheads_k: int | None) -> bool:
    """Whether ``quantize``, ``quantize_varlen`` and ``_dequantize`` take their kernels (kernels/fp8_quantize.py)
    for BSHD ``x``: a plain CUDA tensor (NVIDIA's) with something in it, on the Triton backend, in plain eager
    code (under torch.compile the PyTorch ops stay, which Inductor fuses); nheads_k is checked here, as
    ``_group_amax`` checks it on the other path."""
    # (head dims past 256, which no attention kernel takes, keep the ops: a program holds a (64, headdim) tile)
    if not x.is_cuda or torch.version.hip or x.shape[1] * x.shape[3] == 0 or x.numel() == 0 or x.shape[3] > 256:
        return False
    from . import _ops
    from .interface import select_backend

    # (plain tensors, plain eager: not traced by torch.compile or make_fx, not under vmap or a mode)
    if not _ops._plain_eager(x) or select_backend(x.device) != "triton":
        return False
    from .kernels import configs

    # triton 3.6's rounded division (older ones flush its subnormal results to zero), on a GPU flashtile's kernels
    # run on (else the PyTorch ops, as before the kernels)
    if not configs.TRITON_36:
        return False
    try:
        configs.target_of(x.device)
    except RuntimeError:
        return False
    _check_nheads_k(x.shape[2], nheads_k)
    return True


def _to_fp8_keys_fastest(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``_to_fp8(x, scale)`` for BSHD x, laid out (batch, nheads, headdim, padded) in memory (seqlen padded to
    a multiple of 16), returned as its (batch, seqlen, nheads, headdim) view."""
    seqlen = x.shape[1]
    padded = -(-seqlen // 16) * 16
    if torch.compiler.is_compiling():
        # Traced: padded while still float32 (a padded FP8 buffer's fill is an FP8 constant, which Inductor's
        # Triton code cannot make on triton 3.6), then one transposing copy that Inductor writes.
        scaled = torch.nn.functional.pad((x.float() * scale).clamp(-FP8_MAX, FP8_MAX), (0, 0, 0, 0, 0, padded - seqlen))
        return scaled.to(FP8_DTYPE).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)[:, :seqlen]
    return _keys_fastest_copy(_to_fp8(x, scale))


def _keys_fastest_copy(x_fp8: torch.Tensor) -> torch.Tensor:
    """BSHD float8 ``x_fp8`` copied into (batch, nheads, headdim, padded) memory (seqlen padded to a multiple of
    16), returned as its (batch, seqlen, nheads, headdim) view."""
    if _fp8_tensor_cores(x_fp8.device):  # the FP8 forward's own copy: a Triton kernel transposes
        from .kernels.forward import keys_fastest

        return keys_fastest(x_fp8)[0]
    seqlen = x_fp8.shape[1]
    buffer = keys_fastest_memory(*x_fp8.shape, FP8_DTYPE, x_fp8.device)
    buffer[..., :seqlen].copy_(x_fp8.permute(0, 2, 3, 1))
    return buffer.permute(0, 3, 1, 2)[:, :seqlen]


def _fp8_tensor_cores(device: torch.device) -> bool:
    """A CUDA GPU (not ROCm) of compute capability 8.9 or newer."""
    if device.type != "cuda" or torch.version.hip:
        return False
    from .kernels import configs  # cached capability query

    return tuple(configs._capability(device.index if device.index is not None else torch.cuda.current_device())) \
        >= MIN_CAPABILITY


def _check_nheads_k(nheads: int, nheads_k: int | None) -> None:
    if nheads_k is not None and (isinstance(nheads_k, bool) or not isinstance(nheads_k, numbers.Integral)
                                 or nheads_k <= 0 or nheads % nheads_k):
        raise ValueError(f"nheads_k must be an int dividing nheads ({nheads}), got {nheads_k!r}")


def _group_amax(amax: torch.Tensor, nheads_k: int | None) -> torch.Tensor:
    """(rows, nheads) -> (rows, nheads_k): the largest of each group of nheads // nheads_k heads."""
    if nheads_k is None:
        return amax
    nheads = amax.shape[1]
    _check_nheads_k(nheads, nheads_k)
    nheads_k = int(nheads_k)
    return amax.view(amax.shape[0], nheads_k, nheads // nheads_k).amax(dim=2)


def _per_head(factor: torch.Tensor, nheads: int) -> torch.Tensor:
    """(rows, nheads_k) -> (rows, nheads): head h takes column h // (nheads // nheads_k)."""
    group = nheads // factor.shape[1]
    return factor.repeat_interleave(group, dim=1) if group > 1 else factor


def _sequence_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 (total,): the sequence of each packed token (no host read; empty sequences are skipped)."""
    batch = cu_seqlens.numel() - 1
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # Clamped so that bad cu_seqlens values (checked later, before any launch) never index out of range.
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True).clamp_(max=max(batch - 1, 0))


def quantize_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor,
                    nheads_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize packed ``x`` to float8_e4m3fn with one scale per (sequence, head) or (sequence, kv head).

    Args:
        x (Tensor): (total, nheads, headdim), any float dtype.
        cu_seqlens (Tensor): int32 (batch + 1,): sequence b is ``x[cu_seqlens[b]:cu_seqlens[b+1]]``.
        nheads_k (int, optional): as in :func:`quantize`.

    Returns:
        x_fp8 (Tensor): float8_e4m3fn (total, nheads, headdim).
        descale (Tensor): float32 (batch, nheads) or (batch, nheads_k), as in :func:`quantize` (1 for an
            empty sequence).

    On a CUDA tensor, outside torch.compile's tracing, two Triton kernels compute the same bits, as for
    :func:`quantize` (but for a NaN in x: its sequence's descale is always NaN there, where PyTorch's CUDA
    ``scatter_reduce`` keeps or drops it by the order its atomics land in).
    """
    _check_tensor("x", x, 3, "(total, nheads, headdim)")
    _check_quantizable(x)
    _check_cu_seqlens("cu_seqlens", cu_seqlens, x.shape[0], x.shape[0], "total", x.device)
    batch, nheads = cu_seqlens.numel() - 1, x.shape[1]
    seq = _sequence_index(cu_seqlens, x.shape[0])
    if batch > 0 and _fp8_kernels_take(x.unsqueeze(0), nheads_k):  # the same bits in two launches
        from .kernels.fp8_quantize import quantize_heads

        return quantize_heads(x.detach(), nheads_k, cu_seqlens, seq)
    token_amax = x.detach().abs().amax(dim=-1).float()  # (total, nheads)
    amax = torch.zeros(batch, nheads, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, seq[:, None].expand(-1, nheads), token_amax, "amax")  # amax >= 0: zeros start it
    scale, descale = _scale_from_amax(_group_amax(amax, nheads_k))
    return _to_fp8(x.detach(), _per_head(scale, nheads)[seq][:, :, None]), descale


def zeros_cache(batch_cache: int, seqlen_cache: int, nheads_k: int, headdim: int,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 KV cache for ``flash_attn_with_kvcache``, zero-filled, with V laid out for fast decoding.

    A decoding step's P V reduces over the cache's positions. In the usual (positions, heads, headdim) rows an
    FP8 V reaches the GPU's tensor cores one byte at a time (the transposing load they use for a 16-bit V has
    no 8-bit form); with the positions contiguous it is read in vectors. On an H200 a step over this cache ran
    1.15-1.17x faster than over the same FP8 cache in rows, 1.78-2.02x faster than over a bf16 cache
    (benchmarks/RESULTS.md, "FP8"). Every path takes either layout and gives the same result; new tokens are
    appended to either.

    Args:
        batch_cache, seqlen_cache, nheads_k, headdim: the cache's shape, as flash_attn_with_kvcache's
            ``k_cache`` and ``v_cache`` (a paged pool: num_pages, page_size, nheads_k, headdim).
        device: where to allocate.

    Returns:
        k_cache (Tensor): float8_e4m3fn (batch_cache, seqlen_cache, nheads_k, headdim), contiguous.
        v_cache (Tensor): float8_e4m3fn of the same shape, laid out (nheads_k, headdim, batch_cache,
            seqlen_cache) in memory: strides (seqlen_cache, 1, headdim * batch_cache * seqlen_cache,
            batch_cache * seqlen_cache). To move an FP8 cache ``v8`` in rows into it: ``v_cache.copy_(v8)``.
    """
    shape = (batch_cache, seqlen_cache, nheads_k, headdim)
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0 for n in shape):
        raise ValueError(f"batch_cache, seqlen_cache, nheads_k and headdim must be ints >= 0, got {shape}")
    shape = batch_cache, seqlen_cache, nheads_k, headdim = tuple(int(n) for n in shape)
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE, device=device)
    # Positions fastest, the batch next: (batch_cache * seqlen_cache) flattened rows of unit stride, so the
    # cache is still viewed as rows (batch_cache * seqlen_cache, nheads_k, headdim) as a contiguous one is.
    v_cache = torch.zeros((nheads_k, headdim, batch_cache, seqlen_cache), dtype=FP8_DTYPE,
                          device=device).permute(2, 3, 0, 1)
    return k_cache, v_cache


def _check_quantizable(x: torch.Tensor) -> None:
    if not x.is_floating_point() or x.element_size() < 2:  # (FP8 x: already quantized)
        raise TypeError(f"x must be a float16, bfloat16, float32 or float64 tensor to quantize, got {x.dtype}")


def dequantize(x_fp8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``x_fp8.float() * descale`` in ``dtype``, the inverse of :func:`quantize` / :func:`quantize_varlen`.

    Args:
        x_fp8 (Tensor): float8_e4m3fn (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with
            ``cu_seqlens``.
        descale (Tensor): float32 (batch, nheads_k) with nheads % nheads_k == 0: head h takes
            ``descale[:, h // (nheads // nheads_k)]`` (the query-head mapping of GQA).
        dtype: the result's dtype.
        cu_seqlens (Tensor, optional): int32 (batch + 1,) for packed ``x_fp8``.
    """
    packed = cu_seqlens is not None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype must be a 16-, 32- or 64-bit float dtype, got {dtype!r}")
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype != FP8_DTYPE or x_fp8.dim() != (3 if packed else 4):
        layout = "(total, nheads, headdim)" if packed else "(batch, seqlen, nheads, headdim)"
        raise ValueError(f"x_fp8 must be a float8_e4m3fn tensor {layout}, got "
                         f"{getattr(x_fp8, 'dtype', type(x_fp8))} {tuple(getattr(x_fp8, 'shape', ()))}")
    if packed:
        _check_cu_seqlens("cu_seqlens", cu_seqlens, x_fp8.shape[0], x_fp8.shape[0], "total", x_fp8.device)
    batch = cu_seqlens.numel() - 1 if packed else x_fp8.shape[0]
    if (not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32 or descale.dim() != 2
            or descale.shape[0] != batch or descale.shape[1] == 0 or x_fp8.shape[-2] % descale.shape[1]
            or descale.device != x_fp8.device):
        raise ValueError(f"descale must be float32 (batch={batch}, nheads_k) with nheads_k dividing x_fp8's "
                         f"{x_fp8.shape[-2]} heads, on {x_fp8.device}; got {getattr(descale, 'dtype', type(descale))} "
                         f"{tuple(getattr(descale, 'shape', ()))} on {getattr(descale, 'device', None)}")
    if not packed:
        return _dequantize(x_fp8, descale, dtype)
    return _dequantize_packed(x_fp8, descale, dtype, cu_seqlens)


def _dequantize_packed(x: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype,
                       cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``dequantize`` of packed x whose cu_seqlens the caller checks (varlen calls: with their values, later)."""
    return _dequantize(x, descale[_sequence_index(cu_seqlens, x.shape[0])], dtype)


def _dequantize(x: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.float() * descale`` in ``dtype``. descale: (rows, nheads_k) for x (rows, ..., nheads, headdim);
    head h takes column h // (nheads // nheads_k). A BSHD x on the GPU: one kernel, the same bits."""
    if (x.dim() == 4 and x.dtype == FP8_DTYPE and type(descale) is torch.Tensor and descale.dtype == torch.float32
            and descale.dim() == 2 and descale.shape[0] == x.shape[0] and descale.device == x.device
            and not (torch.is_grad_enabled() and (descale.requires_grad or x.requires_grad))  # (autograd: the ops)
            and _fp8_kernels_take(x, descale.shape[1])):
        from .kernels.fp8_quantize import dequantize_heads

        return dequantize_heads(x, descale, dtype)
    per_head = _per_head(descale, x.shape[-2])
    per_head = per_head.view(per_head.shape[0], *([1] * (x.dim() - 3)), per_head.shape[1], 1)
    # contiguous: a keys-fastest v (``quantize(keys_fastest=True)``) comes back in the usual layout
    return (x.float() * per_head).to(dtype).contiguous()


def _rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an FP8 ``x``, indexed as bytes: torch 2.9 cannot index float8 tensors on the CPU."""
    return x.view(torch.uint8)[index].view(x.dtype)


def quantize_with(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """Quantize new keys or values to float8_e4m3fn in a cache's scale: ``x / descale``, saturated at ±448.

    These are the values ``flash_attn_with_kvcache`` writes for 16-bit new tokens into an FP8 cache (on a GPU its
    append kernel quantizes them, to the same bits), for a caller that keeps float8 tokens of its own.

    Args:
        x (Tensor): (batch, seqlen_new, nheads_k, headdim), float16, bfloat16, float32 or float64.
        descale (Tensor): float32 (batch, nheads_k), the cache's ``k_descale`` or ``v_descale``.

    Returns:
        Tensor: float8_e4m3fn, the shape of x, the values ``flash_attn_with_kvcache`` would write.
    """
    _check_tensor("x", x, 4, "(batch, seqlen_new, nheads_k, headdim)")
    _check_quantizable(x)
    if (not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32 or descale.dim() != 2
            or tuple(descale.shape) != (x.shape[0], x.shape[2]) or descale.device != x.device):
        raise ValueError(f"descale must be float32 (batch, nheads_k) = ({x.shape[0]}, {x.shape[2]}) on {x.device}, "
                         f"got {getattr(descale, 'dtype', type(descale))} {tuple(getattr(descale, 'shape', ()))} "
                         f"on {getattr(descale, 'device', None)}")
    return _quantize_with(x.detach(), descale)


def _quantize_with(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``x / descale`` (saturated), x (batch, seqlen, nheads_k, headdim), descale (batch, nheads_k).
    On a GPU one kernel, the same bits (kernels/fp8_quantize.py); else the PyTorch ops."""
    if (type(descale) is torch.Tensor and descale.dtype == torch.float32 and descale.device == x.device
            and tuple(descale.shape) == (x.shape[0], x.shape[2]) and x.stride(-1) == 1
            and _fp8_kernels_take(x, None)):
        from .kernels.fp8_quantize import quantize_given

        return quantize_given(x.detach(), descale.detach())
    return (x.float() / descale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ---------------------------------------------------------------------------------------------------
# Argument checks of the FP8 calls: every one runs before anything is computed
# ---------------------------------------------------------------------------------------------------


def check_device(device: torch.device, name: str = "q") -> None:
    """FP8 inputs on a CUDA GPU need FP8 tensor cores (compute capability 8.9 or newer). ``name``: the float8
    input the message names."""
    if device.type != "cuda":
        return
    if torch.version.hip:
        # ROCm reports gfx numbers as capabilities (gfx90a as 9.0), and MI300's FP8 is e4m3fnuz, not e4m3fn.
        raise TypeError(f"{name} is float8_e4m3fn on {device}, an AMD GPU: flashtile's FP8 inputs are for NVIDIA "
                        "GPUs with FP8 tensor cores (compute capability 8.9 or newer); pass bfloat16 or float16 "
                        "q, k, v")
    from .kernels import configs  # cached capability query

    capability = configs._capability(device.index if device.index is not None else torch.cuda.current_device())
    if tuple(capability) < MIN_CAPABILITY:
        raise TypeError(f"{name} is float8_e4m3fn on {device}, a GPU of compute capability "
                        f"{capability[0]}.{capability[1]}: "
                        f"FP8 attention needs FP8 tensor cores (compute capability "
                        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: Ada, Hopper, Blackwell); "
                        "pass bfloat16 or float16 q, k, v instead")


def check_inputs(tensors: dict[str, torch.Tensor], descales: dict[str, object], out_dtype: object,
                 expected: tuple[int, int], device: torch.device, q_over_cache: bool = False) -> torch.dtype:
    """Check an FP8 call's tensors (float8_e4m3fn, not requiring grad), descales (float32 tensors of shape
    ``expected`` on ``device``, not requiring grad) and out_dtype; return the output dtype.

    ``tensors`` maps each name to a tensor whose shape is already checked. The first entry is q; all must
    be float8_e4m3fn. With a non-FP8 q, any descale or out_dtype given is the error, but with
    ``q_over_cache`` (an FP8 KV cache): there q may be bfloat16/float16 over the cache's float8 tensors,
    without q_descale, its output in q's dtype.
    """
    names = list(tensors)
    first = tensors[names[0]]
    if q_over_cache and first.dtype in OUT_DTYPES:
        cache_fp8 = [n for n in names[1:] if tensors[n].dtype == FP8_DTYPE]
        if cache_fp8 and len(cache_fp8) < len(names) - 1:  # one cache tensor float8, the other not
            other = next(n for n in names[1:] if n not in cache_fp8)
            raise TypeError(f"{other} has dtype {tensors[other].dtype}, expected float8_e4m3fn like {cache_fp8[0]}: "
                            f"an FP8 cache is {' and '.join(names[1:])} both in float8_e4m3fn")
        if not cache_fp8:
            given = [n for n, d in descales.items() if d is not None] + (["out_dtype"] if out_dtype is not None
                                                                         else [])
            raise TypeError(f"{(given or ['k_descale'])[0]} is given but {names[1]} has dtype "
                            f"{tensors[names[1]].dtype}: q_descale, k_descale, v_descale and out_dtype apply to a "
                            "float8_e4m3fn cache (and q) only")
        # A bf16/fp16 model's queries over an FP8 cache: the kernel reads the cache in q's precision.
        q_name, descale_name = names[0], f"{names[0]}_descale"
        if descales.get(descale_name) is not None:
            raise TypeError(f"{descale_name} is given but {q_name} has dtype {first.dtype}: over an FP8 cache a "
                            f"bfloat16 or float16 {q_name} is read as it is (q_descale belongs to a float8_e4m3fn q)")
        if out_dtype is not None and out_dtype != first.dtype:
            raise ValueError(f"out_dtype is {out_dtype!r} but {q_name} has dtype {first.dtype}: over an FP8 cache "
                             f"the output of a 16-bit {q_name} has its dtype (give out_dtype=None)")
        for name in names[1:]:
            if tensors[name].device != device:
                raise ValueError(f"{name} is on {tensors[name].device}, expected {device} (the device of {q_name})")
        check_inputs({n: tensors[n] for n in names[1:]}, {n: d for n, d in descales.items() if n != descale_name},
                     None, expected, device)
        return first.dtype
    if first.dtype != FP8_DTYPE:
        fp8 = [name for name, x in tensors.items() if x.dtype == FP8_DTYPE]
        if fp8:  # the descales fit the FP8 tensors; the 16-bit q is what is wrong
            raise TypeError(f"{names[0]} has dtype {first.dtype} but {fp8[0]} is float8_e4m3fn: FP8 attention takes "
                            f"{', '.join(names)} all in float8_e4m3fn (mixed FP8 and {first.dtype} inputs are not "
                            "supported; flashtile.fp8.quantize makes an FP8 q and its q_descale)")
        given = [name for name, d in descales.items() if d is not None] + (["out_dtype"] if out_dtype is not None
                                                                           else [])
        raise TypeError(f"{given[0]} is given but {names[0]} has dtype {first.dtype}: q_descale, k_descale, "
                        f"v_descale and out_dtype apply to float8_e4m3fn inputs only")
    for name, x in tensors.items():
        if x.dtype != FP8_DTYPE:
            raise TypeError(f"{name} has dtype {x.dtype}, expected float8_e4m3fn: FP8 attention takes q, k and v "
                            f"all in float8_e4m3fn (mixed FP8 and {x.dtype} inputs are not supported)")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, expected {device} (the device of {names[0]})")
        if x.requires_grad:
            raise NotImplementedError(f"{name} requires grad: FP8 tensors are forward only (detach it; "
                                      "flashtile.fp8.fp8_attn_func trains with FP8 attention from bf16/fp16 inputs)")
    if out_dtype is None:
        out_dtype = torch.bfloat16
    elif out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16 (or None: bfloat16), got {out_dtype!r}")
    for name, d in descales.items():
        if d is None:
            raise TypeError(f"{name} is required with float8_e4m3fn inputs: a float32 tensor of shape {expected} "
                            "(batch, nheads_k); flashtile.fp8.quantize returns it")
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {d.dtype}")
        if d.device != device:
            raise ValueError(f"{name} is on {d.device}, expected {device} (the device of q)")
        if tuple(d.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (batch, nheads_k), got {tuple(d.shape)}")
        if d.requires_grad:
            raise NotImplementedError(f"{name} requires grad: FP8 tensors are forward only (detach it; "
                                      "flashtile.fp8.fp8_attn_func trains with FP8 attention from bf16/fp16 inputs)")
    check_device(device, names[0])
    return out_dtype


# ---------------------------------------------------------------------------------------------------
# The interim path: dequantize, then the existing bfloat16/float16 path
# ---------------------------------------------------------------------------------------------------


def kernels_run(device: torch.device, headdim: int, dropout_p: object) -> bool:
    """Whether the FP8 kernels take a call: the Triton backend on a CUDA GPU (``check_device`` has refused
    GPUs without FP8 tensor cores), head dims over 16 (an FP8 tensor-core product reduces over at least 32
    elements), no dropout."""
    from .interface import select_backend

    return (device.type == "cuda" and select_backend(device) == "triton" and headdim > 16
            and isinstance(dropout_p, (int, float)) and dropout_p == 0)


def attention_func(q, k, v, q_descale, k_descale, v_descale, out_dtype, dropout_p, run, names=("q", "k", "v")):
    """flash_attn_func on FP8 inputs: ``run(q, k, v, fp8=(q_descale, k_descale, v_descale, out_dtype))`` on the
    FP8 tensors where the FP8 kernels take the call, else ``run(q, k, v)`` on q, k, v dequantized to
    out_dtype. ``names``: what the errors call q, k and v (a packed function's parts, e.g. ``qkv[:, :, 0]``)."""
    q_name, k_name, v_name = names
    _check_tensor(q_name, q, 4, "(batch, seqlen_q, nheads, headdim)")
    _check_tensor(k_name, k, 4, "(batch, seqlen_k, nheads_k, headdim)")
    _check_tensor(v_name, v, 4, "(batch, seqlen_k, nheads_k, headdim)", keys_fastest=True)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"batch sizes differ: {q_name} {q.shape[0]}, {k_name} {k.shape[0]}, {v_name} {v.shape[0]}")
    _check_heads(q, k, v, names)
    out_dtype = check_inputs({q_name: q, k_name: k, v_name: v}, {"q_descale": q_descale, "k_descale": k_descale,
                                                                "v_descale": v_descale}, out_dtype,
                             (q.shape[0], k.shape[2]), q.device)
    if kernels_run(q.device, q.shape[3], dropout_p):
        return run(q, k, v, fp8=(q_descale, k_descale, v_descale, out_dtype, False))
    return run(_dequantize(q, q_descale, out_dtype), _dequantize(k, k_descale, out_dtype),
               _dequantize(v, v_descale, out_dtype))


def _check_heads(q, k, v, names=("q", "k", "v")) -> None:
    """What a descale's shape relies on: nheads a multiple of k's (and v's) nheads_k."""
    q_name, k_name, v_name = names
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if v.shape[-2] != nheads_k:
        raise ValueError(f"{k_name} and {v_name} must have the same nheads_k, got {nheads_k} and {v.shape[-2]}")
    if nheads_k == 0 or nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}, from {q_name}) must be a multiple of nheads_k ({nheads_k}, from "
                         f"{k_name}) for GQA/MQA")


def varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, q_descale, k_descale, v_descale, out_dtype,
                dropout_p, run, names=("q", "k", "v")):
    """flash_attn_varlen_func on FP8 inputs: ``run(q, k, v, None, fp8=(descales..., out_dtype))`` on the FP8
    tensors where the FP8 kernels take the call (no block_table), else ``run(q, k, v, block_table)`` on
    dequantized inputs.

    Without block_table each token takes its sequence's factors (through cu_seqlens). With block_table, k
    and v are page pools that sequences may share: each sequence's pages are dequantized with its own
    factors into a pool of its own (batch * max_pages pages), read through an identity block table.
    ``names``: what the errors call q, k and v (a packed function's parts).
    """
    q_name, k_name, v_name = names
    _check_tensor(q_name, q, 3, "(total_q, nheads, headdim)")
    if block_table is None:
        _check_tensor(k_name, k, 3, "(total_k, nheads_k, headdim)")
        _check_tensor(v_name, v, 3, "(total_k, nheads_k, headdim)")
    else:
        for name, x in (("k", k), ("v", v)):
            _check_tensor(name, x, 4, "(num_pages, page_size, nheads_k, headdim) with block_table")
            if x.numel() and x.stride(0) != x.shape[1] * x.stride(1):
                raise ValueError(f"{name} must be contiguous over its first two dims (the pages): strides "
                                 f"{x.stride()}")
        if v.shape != k.shape:  # the pages are gathered from both pools by k's page count
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_cu_seqlens(name, cu, None, 0, "max_seqlen", q.device, read=False)  # values: checked by run
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    batch = cu_seqlens_q.numel() - 1
    _check_heads(q, k, v, names)
    out_dtype = check_inputs({q_name: q, k_name: k, v_name: v}, {"q_descale": q_descale, "k_descale": k_descale,
                                                                "v_descale": v_descale}, out_dtype,
                             (batch, k.shape[-2]), q.device)
    if block_table is None and kernels_run(q.device, q.shape[2], dropout_p):
        return run(q, k, v, None, fp8=(q_descale, k_descale, v_descale, out_dtype, False))
    q_deq = _dequantize_packed(q, q_descale, out_dtype, cu_seqlens_q)
    if block_table is None:
        return run(q_deq, _dequantize_packed(k, k_descale, out_dtype, cu_seqlens_k),
                   _dequantize_packed(v, v_descale, out_dtype, cu_seqlens_k), None)
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2 or (
            block_table.shape[0] != batch):
        raise TypeError(f"block_table must be an int32 tensor of shape ({batch}, max_pages)")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device}, expected {q.device} (the device of q)")
    if values_readable(q.device) and block_table.numel() and pages_in_use_invalid(
            block_table, cu_seqlens_k[1:] - cu_seqlens_k[:-1], k.shape[1], k.shape[0]).item():
        raise ValueError(f"block_table values of the pages in use must lie in [0, {k.shape[0]}) (the pages of k)")
    k_pool, v_pool, table = _own_pages(k, v, block_table, k_descale, v_descale, out_dtype)
    return run(q_deq, k_pool, v_pool, table)


def _own_pages(k_cache, v_cache, block_table, k_descale, v_descale, out_dtype):
    """Each batch entry's pages, dequantized with its factors, as a pool of batch * max_pages pages, and the
    identity block table (batch, max_pages) that reads it. Table entries outside the pool (padding) are
    clamped: those pages are never read."""
    batch, max_pages = block_table.shape
    pages = block_table.long().clamp(0, max(k_cache.shape[0] - 1, 0)).reshape(-1)
    table = torch.arange(batch * max_pages, dtype=torch.int32, device=block_table.device).view(batch, max_pages)
    if k_cache.shape[0] == 0:
        pages = pages[:0]
    k_pool = _dequantize(_rows_of(k_cache, pages), k_descale.repeat_interleave(max_pages, 0), out_dtype)
    v_pool = _dequantize(_rows_of(v_cache, pages), v_descale.repeat_interleave(max_pages, 0), out_dtype)
    return k_pool, v_pool, table


def kvcache_func(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, causal, window_size, rotary_interleaved, q_descale, k_descale, v_descale, out_dtype,
                 run):
    """flash_attn_with_kvcache on an FP8 cache. With the Triton backend: ``run(q, k_cache, v_cache, k_append,
    v_append, rotary_cos, rotary_sin, cache_seqlens, cache_leftpad, block_table, cache_batch_idx=..., fp8=...)``
    on the FP8 cache itself (the kernel reads it; the path behind ``run`` checks the indices and appends
    the new tokens first, its append kernel quantizing those that are not float8). Elsewhere ``run`` on
    dequantized copies, after which the new k, v are written into the FP8 cache.

    Descales are per batch entry of q, (batch, nheads_k), as in FA3: entry b reads its cache row (its
    ``cache_batch_idx`` row, or its pages) with ``k_descale[b]`` and ``v_descale[b]``. Off the kernel each
    entry's cache is dequantized into a copy of its own (rows, or pages through an identity block table). New k, v
    (bfloat16, float16, or float8_e4m3fn already in the cache's scale) are rotated here when rotary tables
    are given, quantized with the entry's descales, and the attention of this call sees the quantized
    values, as later calls will.
    """
    from .inference import (
        _append_rows,
        _check_appendable,
        _check_cache_indices,
        _check_cache_shapes,
        _check_rotary,
        _int32_vector,
        _require_contiguous_rows,
        _rotate_new_tokens,
    )
    from .interface import _is_bool, _window_pair, select_backend

    pitch = _check_cache_shapes(q, k_cache, v_cache, v_keys_fastest=isinstance(v_cache, torch.Tensor) and (
        v_cache.dtype == FP8_DTYPE))
    batch, seqlen_q, nheads, headdim = q.shape
    batch_cache, seqlen_cache, nheads_k, _ = k_cache.shape
    device = q.device
    out_dtype = check_inputs({"q": q, "k_cache": k_cache, "v_cache": v_cache},
                             {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}, out_dtype,
                             (batch, nheads_k), device, q_over_cache=True)
    _require_contiguous_rows(k_cache, v_cache, pitch)  # (after the dtypes: a 16-bit cache is refused for those)
    q_fp8 = q.dtype == FP8_DTYPE  # else a bf16/fp16 q, read as it is
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens) or both be None")
    seqlen_new = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            _check_tensor(name, x, 4, "(batch, seqlen_new, nheads_k, headdim)")
            if x.dtype not in (*OUT_DTYPES, FP8_DTYPE):
                raise TypeError(f"{name} has dtype {x.dtype}; new keys and values for an FP8 cache are bfloat16 or "
                                "float16 (quantized with the cache's descales), or float8_e4m3fn in its scale")
            if x.device != device:
                raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")
            if x.dtype == FP8_DTYPE and x.requires_grad:
                raise NotImplementedError(f"{name} requires grad: FP8 tensors are forward only (detach it)")
        expected = (batch, k.shape[1], nheads_k, headdim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"k and v must have shape {expected}, got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when new k, v are appended")

    paged = block_table is not None
    rotating = rotary_cos is not None or rotary_sin is not None
    # The kernel reads the FP8 cache (and FP8 q) itself; elsewhere each entry's cache is dequantized.
    kernel_reads = select_backend(device) == "triton"
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = _int32_vector("cache_seqlens", cache_seqlens, batch, device)
    elif rotating or not kernel_reads:  # a launch the kernel path does without
        integral = isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool)
        if cache_seqlens is not None and not (integral and 0 <= cache_seqlens < 2**31):
            # (the cache's own bound is checked with the tensor made here, as for a tensor given)
            raise (ValueError if integral else TypeError)(
                f"cache_seqlens must be an int in [0, 2**31) or an int32 tensor, got {cache_seqlens!r}")
        # cache_seqlens None: every row, or every page of the table, as the kernel path reads it.
        whole = block_table.shape[1] * seqlen_cache if paged and isinstance(block_table, torch.Tensor) and (
            block_table.dim() == 2) else seqlen_cache
        seqlens = torch.full((batch,), whole if cache_seqlens is None else int(cache_seqlens),
                             dtype=torch.int32, device=device)
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or (
                block_table.dim() != 2 or block_table.shape[0] != batch):
            raise TypeError(f"block_table must be an int32 tensor of shape ({batch}, max_pages)")
        if block_table.device != device:
            raise ValueError(f"block_table is on {block_table.device}, expected {device}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the table already maps rows)")
        if seqlen_new and block_table.shape[1] == 0:
            raise ValueError("block_table has no columns: there is no page to append k, v to")
        key_rows = block_table.shape[1] * seqlen_cache
    else:
        key_rows = seqlen_cache
    # The lengths first, by the 16-bit path's check: the rotary tables' length and the slots of the new tokens
    # below are computed from them (an overflowing length would be reported as one of those). Only where they are
    # read here (the kernel path checks them itself); one device read, whose largest length the rotary check reuses.
    longest_cached = None
    if batch and (rotating or not kernel_reads) and values_readable(device):
        _, longest_cached = _check_cache_indices(seqlens, seqlen_new, key_rows, None, batch_cache, None, 0, None)
    if seqlen_new and not kernel_reads:  # (the kernel path checks the cache itself; here it sees dequantized copies)
        _check_appendable(k_cache, v_cache, batch)

    q_in = q
    if q_fp8 and (rotating or not kernel_reads):
        q = _dequantize(q, q_descale, out_dtype)
    k_append = v_append = None
    if k is not None:
        # (float8 tokens that are not rotated go into the cache as they are: nothing to dequantize)
        k_new = _dequantize(k, k_descale, torch.float32) if k.dtype == FP8_DTYPE and rotating else k
        if rotating:
            # Rotated here, before quantization, at the positions flash_attn_with_kvcache uses: new key i at
            # cache_seqlens + i; the queries there too when causal or windowed, else all at cache_seqlens.
            _check_rotary(rotary_cos, rotary_sin, headdim, device)
            left, right = _window_pair(window_size)
            local = (_is_bool(causal) and bool(causal)) or 0 <= left < key_rows or 0 <= right < key_rows
            positions = rotary_cos.shape[0]
            if longest_cached is not None:
                needed = longest_cached + max(seqlen_new, seqlen_q if local else 1)
                if needed > positions:
                    raise ValueError(f"rotary_cos/rotary_sin have {positions} positions, but this call rotates up "
                                     f"to position {needed - 1}; give tables of at least {needed} rows")
            q, k_new = _rotate_new_tokens(q, k_new, rotary_cos, rotary_sin, seqlens, local, rotary_interleaved)
            rotary_cos = rotary_sin = None  # done: the path below must not rotate again
        if kernel_reads:
            # The append kernel quantizes 16-bit (or, rotated, float32) tokens with the entry's descales, bit for
            # bit as ``_quantize_with``: one launch, which a launch plan records (flashtile.kernels.kvcache).
            k_append, v_append = k_new, v
        else:
            k_append = k if k.dtype == FP8_DTYPE and not rotating else _quantize_with(k_new, k_descale)
            v_append = v if v.dtype == FP8_DTYPE else _quantize_with(v, v_descale)

    if kernel_reads:
        # q goes as it is unless it was rotated here (then in out_dtype); the existing path checks every index
        # and appends the new tokens (quantized by its append kernel, or already float8) before reading.
        fp8 = (None, k_descale, v_descale, out_dtype) if rotating or not q_fp8 else (q_descale, k_descale, v_descale,
                                                                                      out_dtype)
        return run(q if rotating else q_in, k_cache, v_cache, k_append, v_append, rotary_cos, rotary_sin, cache_seqlens,
                   cache_leftpad, block_table, cache_batch_idx=cache_batch_idx, fp8=fp8)

    # Elsewhere, sequence b's cache dequantized with its factors: a row (batch, seqlen_cache, ...) or its pages.
    if paged:
        if values_readable(device) and block_table.numel() and pages_in_use_invalid(
                block_table, (seqlens + seqlen_new).clamp(max=block_table.shape[1] * seqlen_cache), seqlen_cache,
                batch_cache).item():
            raise ValueError(f"block_table values of the pages in use must lie in [0, {batch_cache}) (the pages of "
                             "k_cache)")
        k_copy, v_copy, table = _own_pages(k_cache, v_cache, block_table, k_descale, v_descale, out_dtype)
        rows = None
    else:
        table = None
        if cache_batch_idx is not None:
            idx = _int32_vector("cache_batch_idx", cache_batch_idx, batch, device)
            if values_readable(device) and batch and (idx.min().item() < 0 or idx.max().item() >= batch_cache):
                raise ValueError(f"cache_batch_idx values must lie in [0, {batch_cache})")
            rows = idx.long().clamp(0, max(batch_cache - 1, 0))
        elif batch > batch_cache:
            raise ValueError(f"batch ({batch}) exceeds the cache's batch ({batch_cache}) and no cache_batch_idx is "
                             "given")
        else:
            rows = torch.arange(batch, device=device)
        k_copy = _dequantize(_rows_of(k_cache, rows), k_descale, out_dtype)
        v_copy = _dequantize(_rows_of(v_cache, rows), v_descale, out_dtype)
    if k is None:  # nothing to write: the existing path reads the copies (and rotates q)
        return run(q, k_copy, v_copy, None, None, rotary_cos, rotary_sin, cache_seqlens, cache_leftpad, table)

    if (paged or cache_batch_idx is not None) and batch * seqlen_new > 1 and values_readable(device):
        slots = _append_rows(seqlens, seqlen_new, rows, block_table, seqlen_cache if paged else 0, seqlen_cache,
                             clamp=True).reshape(-1).sort().values
        if (slots[1:] == slots[:-1]).any().item():
            raise ValueError("two new tokens would be appended into the same cache slot (a repeated cache_batch_idx, "
                             "or block_table rows sharing the pages being written): their writes would race")
    # The existing path checks cache_seqlens (+ seqlen_new within the cache), cache_leftpad and the rest,
    # and appends the quantized tokens, dequantized, to the copies before reading them.
    result = run(q, k_copy, v_copy, _dequantize(k_append, k_descale, out_dtype),
                 _dequantize(v_append, v_descale, out_dtype), None, None, cache_seqlens, cache_leftpad, table)
    with torch.no_grad():
        flat = _append_rows(seqlens, seqlen_new, rows, block_table, seqlen_cache if paged else 0, seqlen_cache)
        k_cache.view(batch_cache * seqlen_cache, nheads_k, headdim)[flat] = k_append
        v_cache.view(batch_cache * seqlen_cache, nheads_k, headdim)[flat] = v_append
    return result


# ---------------------------------------------------------------------------------------------------
# Training with FP8 attention
# ---------------------------------------------------------------------------------------------------


def fp8_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                  causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of bfloat16/float16 q, k, v computed with FP8 inputs, differentiable: for training.

    Each call quantizes q, k, v to float8_e4m3fn with one scale per (batch, kv head) (:func:`quantize`) and
    runs the FP8 forward (FP8 QKᵀ and PV on a CUDA GPU with FP8 tensor cores; elsewhere the same
    computation on the dequantized inputs). The backward recomputes from the FP8 inputs, dequantized, with
    the bfloat16/float16 backward kernels: the gradients are those of attention at the quantized inputs
    (the straight-through rule of quantized training), and all five backward products run in 16 bits
    (docs/fp8.md says why). It keeps the FP8 copies of q, k, v for the backward (half the bytes).

    Args:
        q (Tensor): (batch, seqlen_q, nheads, headdim), bfloat16 or float16.
        k, v (Tensor): (batch, seqlen_k, nheads_k, headdim), q's dtype; nheads % nheads_k == 0.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in ``flash_attn_func``.

    Returns:
        out (Tensor): (batch, seqlen_q, nheads, headdim), q's dtype.
    """
    from .interface import _check_options, _check_qkv

    backend = _check_qkv(q, k, v)
    if q.dtype not in OUT_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; fp8_attn_func takes bfloat16 or float16 q, k, v (it quantizes them)")
    opts = _check_options(0.0, softmax_scale, window_size, softcap, alibi_slopes, q.shape[-1], causal, q,
                          q.shape[0], None, seqlens=(q.shape[1], k.shape[1]))
    check_device(q.device)
    # (one tensor passed twice, self-attention's q = k = v: as views, which torch.compile traces; it refuses an
    # autograd.Function given a duplicate input)
    if k is q:
        k = k.view_as(k)
    if v is q or v is k:
        v = v.view_as(v)
    return _FP8Attention.apply(q, k, v, opts, backend)


class _FP8Attention(torch.autograd.Function):
    """Forward on FP8 inputs, backward in 16 bits on them dequantized (see ``fp8_attn_func``). Its
    quantize and dequantize steps are PyTorch operations and its attention calls go through the custom
    ops under torch.compile (``_ops.forward_no_grad``), so a compiled model traces it whole and fuses
    the scaling passes."""

    @staticmethod
    def forward(ctx, q, k, v, opts, backend):
        from . import _ops

        kernels = kernels_run(q.device, q.shape[3], 0.0)
        fp8_backward = (kernels and fp8_backward_enabled() and opts.alibi_slopes is None
                        and _ops._plain_eager(q, k, v))
        # V quantized straight into the layout the FP8 forward reads (no copy per call there), unless the FP8
        # backward reads it too, in the usual layout (the forward then copies it)
        (q8, qd), (k8, kd) = quantize(q, k.shape[2]), quantize(k)
        v8, vd = quantize(v, keys_fastest=kernels and not fp8_backward)
        if fp8_backward:  # the backward reads each float8 copy with the strides of its dequantized (contiguous) twin
            q8, k8, v8 = q8.contiguous(), k8.contiguous(), v8.contiguous()
        ctx.fp8_backward = fp8_backward
        if kernels:
            out, lse = _ops.forward_no_grad(q8, k8, v8, opts, backend, fp8=(qd, kd, vd, q.dtype))
        else:
            out, lse = _ops.forward_no_grad(_dequantize(q8, qd, q.dtype), _dequantize(k8, kd, q.dtype),
                                            _dequantize(v8, vd, q.dtype), opts, backend)
        ctx.save_for_backward(q8, k8, v8, qd, kd, vd, out, lse)
        ctx.opts, ctx.backend, ctx.dtype = opts, backend, q.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        from . import _ops

        q8, k8, v8, qd, kd, vd, out, lse = ctx.saved_tensors
        q, k, v = (_dequantize(x, d, ctx.dtype) for x, d in ((q8, qd), (k8, kd), (v8, vd)))
        if ctx.fp8_backward and _ops._plain_eager(dout, q, k, v, out, lse):  # QK^T, dO V^T on FP8 tensor cores
            dout = dout.contiguous()
            do8, dod = quantize(dout)
            nheads = q.shape[2]
            scales = torch.stack([_per_head(qd * kd, nheads), _per_head(vd, nheads) * dod], dim=-1).contiguous()
            dq, dk, dv = _ops.run_backward(dout, q, k, v, out, lse, ctx.opts, ctx.backend,
                                           fp8=(q8, k8, v8, do8, scales))
        else:
            dq, dk, dv = _ops.backward_no_grad(dout, q, k, v, out, lse, ctx.opts, ctx.backend)
        return dq, dk, dv, None, None


def fp8_backward_enabled() -> bool:
    """``FLASHTILE_FP8_BACKWARD=1``: ``fp8_attn_func``'s eager backward runs QK^T and dO V^T as FP8 products,
    without ALiBi (off by default: on an H200 it ran 0.63-1.04x the 16-bit backward; docs/fp8.md)."""
    import os

    return os.environ.get("FLASHTILE_FP8_BACKWARD", "0") == "1"
