"""Hugging Face transformers: ``attn_implementation="flashtile"`` after :func:`register`.

Models on transformers' attention interface (Llama, Qwen2/3, Mistral, Gemma2/3, gpt-oss, ...) call
:func:`flashtile_attention_forward` once per layer with BHSD tensors. It takes what transformers' own
``flash_attention_2`` path takes and runs it through flashtile:

- a 2-D padding mask (left padding): the real tokens are packed and run through ``flash_attn_varlen_func``;
  a mask without padding (a static cache longer than the tokens seen) reads the cache's first keys in place;
  a compiled step with cached keys stays in one graph: the real keys are sorted to the front on the device and
  read through ``flash_attn_with_kvcache``. A static cache's mask has one code per cache slot
  (:func:`flashtile_mask`), so its compiled steps all have one shape;
- padding-free packed batches (several sequences in one row): ``cu_seq_lens_q/k`` and ``max_length_q/k``
  keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or ``position_ids``
  that restart at each sequence; each sequence then attends only to itself, through the varlen path;
- otherwise one dense ``flash_attn_func`` call;
- sliding windows, logit softcapping, GQA, and learnable attention sinks (``s_aux``, gpt-oss) as
  flashtile's ``sink``, with gradients.

Keyword arguments that would change what attention computes and that flashtile cannot honour (4-D masks,
paged caches, attention weights as output) raise instead of being dropped.

transformers 5.x treats every implementation name containing "flash" as a flash-attention kernel: at model
construction it may replace it by a hub kernel (gpt-oss lists its own) and imports a kernel package for
it. :func:`register` therefore also makes the model's attention check accept ``"flashtile"`` as it is.
Elsewhere the name's "flash" is what flashtile wants: transformers builds the 2-D padding masks and the
packed-sequence keyword arguments it gives flash-attention kernels.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..inference import cache_layout, cache_rows, flash_attn_with_kvcache
from ..interface import flash_attn_func, flash_attn_varlen_func

NAME = "flashtile"

# Keyword arguments of transformers' paged attention (continuous batching): the keys live in a paged cache
# that this function would not read.
_PAGED_KWARGS = ("block_table", "k_cache", "v_cache")

# Index tensors derived from a mask or position_ids tensor, keyed by that tensor (held weakly): every layer of
# a forward pass receives the same one, so the indices (and their device-to-host read) are made once per step.
_DERIVED_INDICES = WeakIdKeyDictionary()


def _derived_once(source: torch.Tensor, key: tuple, make):
    """``make()``, made once per ``source`` tensor (by identity, unless written in place since or given other
    storage) and ``key``. A write through ``.data[...]`` bumps no version and is not seen.

    Traced or inference tensors are not cached: torch.compile cannot trace the lookup, and inference
    tensors have no version counter to tell an in-place write.
    """
    if torch.compiler.is_compiling() or source.is_inference():
        return make()
    entry = _DERIVED_INDICES.get(source)
    # The address too: ``mask.data = other`` swaps the storage without a version bump.
    stamp = (source._version, source.data_ptr(), key)
    if entry is not None and entry[0] == stamp:
        return entry[1]
    made = make()
    _DERIVED_INDICES[source] = (stamp, made)
    return made


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """int32 cumulative lengths (n + 1,) from lengths (n,)."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    return cu


def _padding_indices(valid: torch.Tensor, query_valid: torch.Tensor, written: torch.Tensor | None = None):
    """From a (B, Tk) bool mask of real key tokens and the (B, Tq) real queries (the last Tq columns of the
    tokens written): the number of columns written (``written``, a device scalar, read with the rest; else Tk),
    then the (batch, position) indices of the real keys and of the real queries, their cu_seqlens and longest
    lengths, or None when every written key is real (nothing to pack). The query indices are None when every
    query is real (a decoding step's new tokens): the queries are then taken whole. One host read."""
    batch, query_len = query_valid.shape
    key_lengths, query_lengths = valid.sum(-1, dtype=torch.int32), query_valid.sum(-1, dtype=torch.int32)
    # Made before the host read below, which under torch.compile breaks the graph: made after it, with dynamic
    # shapes, inductor's code lost query_len's symbol (a NameError at run time).
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=valid.device) * query_len
    end = torch.full((), valid.shape[1], device=valid.device) if written is None else written
    min_k, max_k, min_q, max_q, end = (
        torch.stack([*torch.aminmax(key_lengths), *torch.aminmax(query_lengths), end.to(key_lengths.dtype)]).tolist()
        if batch else (0, 0, query_len, 0, valid.shape[1]))  # one read
    if min_k == end:
        return end, None
    key_rows, key_cols = valid.nonzero(as_tuple=True)
    if min_q == query_len:
        return end, ((key_rows, key_cols), None, (cu_q, _cu_seqlens(key_lengths)), (query_len, max_k))
    queries = query_valid.nonzero(as_tuple=True)
    return end, ((key_rows, key_cols), queries, (_cu_seqlens(query_lengths), _cu_seqlens(key_lengths)), (max_q, max_k))


def _packed_sequences(position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, int] | None:
    """cu_seqlens over the flattened (B * T) tokens and the longest sequence, when ``position_ids`` (B or 1, T)
    restart somewhere (several sequences packed in a row); None for one sequence per row.

    A sequence starts at each row's first token and wherever a position is not its predecessor's plus one:
    the rule transformers' eager and SDPA masks apply to packed rows (``find_packed_sequence_indices``).
    """
    positions = position_ids.expand(batch, -1)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if starts.sum() == batch:  # one host read: a row each, nothing packed
        return None
    first = starts.flatten().nonzero().flatten()
    total = torch.full((1,), positions.numel(), dtype=first.dtype, device=first.device)
    cu = torch.cat([first, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


# Under torch.compile the positions are read outside the graph (a graph break), not traced.
_packed_sequences_outside_graph = torch.compiler.disable(_packed_sequences)


def _cu_seqlens_for(name: str, cu: object, device: torch.device) -> torch.Tensor:
    """A collator's cumulative lengths as flashtile takes them: int32 on the queries' device (a batch left on
    the CPU, or int64, is converted once per step)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of cumulative sequence lengths, got {type(cu).__name__}")
    if cu.dtype == torch.int32 and cu.device == device:
        return cu
    return _derived_once(cu, ("cu_seqlens", device), lambda: cu.to(device=device, dtype=torch.int32))


def _max_length(name: str, value: object) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (the longest packed sequence), got {type(value).__name__}")
    return value


def _half_precision_target(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype | None:
    """The dtype flash-attention kernels get when float32 activations reach them, as in transformers'
    flash_attention_2: autocast's dtype, else the model's linear layers' (layer norms kept in float32,
    as PEFT does, make float32 queries in a half-precision model). None: keep float32."""
    if query.dtype != torch.float32:
        return None
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is not None and linear.weight.dtype in (torch.float16, torch.bfloat16):
        return linear.weight.dtype
    return None


def flashtile_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, run by flashtile.

    Args:
        module: the attention layer (its ``is_causal`` is the default of ``is_causal``).
        query: (B, H, Tq, D); key: (B, Hk, Tk, D); value: (B, Hk, Tk, Dv) with Dv <= D (a smaller value head
            dim is zero-padded for the kernels and cropped from the output).
        attention_mask: None, or the 2-D bool padding mask (B, L) that transformers builds for flash kernels,
            True on real tokens, L <= Tk (a static cache longer than the tokens seen: keys past L are unused);
            or a static cache's (B, Tk) int8 slot codes from :func:`flashtile_mask`.
        dropout: attention-probability dropout. scaling: the softmax scale (None: D ** -0.5).
        sliding_window: a query sees this many keys back, itself included (None: all).
        softcap: scores become ``softcap * tanh(score / softcap)`` (None or 0: off).
        s_aux: (H,) learnable attention-sink logits (gpt-oss), flashtile's ``sink``; gradients flow to it.
        cu_seq_lens_q, cu_seq_lens_k: (n + 1,) cumulative lengths of the sequences packed along the
            flattened B * T tokens, with max_length_q, max_length_k their longest lengths (padding-free
            batches); all four or none.
        position_ids: (B or 1, Tq) token positions; without a mask or cu_seq_lens, restarts (a position that
            is not its predecessor's plus one) split a row into packed sequences.

    Returns:
        ((B, Tq, H, Dv) attention output, None): flashtile never forms the attention weights.
    """
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='flashtile' does not form attention weights, so output_attentions=True "
                         "cannot be honoured; use attn_implementation='eager' to get them")
    paged = [name for name in _PAGED_KWARGS if kwargs.get(name) is not None] if kwargs else None
    if paged:
        raise NotImplementedError(f"attn_implementation='flashtile' got {', '.join(paged)}: transformers' paged "
                                  "cache (continuous batching) is not supported; use generate() with a dynamic or "
                                  "static cache")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        raise ValueError("attn_implementation='flashtile' takes a 2-D padding mask (batch, keys) or None, got "
                         f"attention_mask of shape {tuple(getattr(attention_mask, 'shape', ()))}; a custom 4-D mask "
                         "can only run with 'eager' or 'sdpa'")
    given = ()
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None or max_length_q is not None or max_length_k is not None:
        varlen_kwargs = {"cu_seq_lens_q": cu_seq_lens_q, "cu_seq_lens_k": cu_seq_lens_k,
                         "max_length_q": max_length_q, "max_length_k": max_length_k}
        given = [name for name, x in varlen_kwargs.items() if x is not None]
    if given and len(given) != len(varlen_kwargs):
        missing = [name for name in varlen_kwargs if name not in given]
        raise ValueError(f"packed sequences need cu_seq_lens_q, cu_seq_lens_k, max_length_q and max_length_k "
                         f"together; got {', '.join(given)} without {', '.join(missing)}")
    if is_causal is None:
        if not hasattr(module, "is_causal"):
            raise ValueError(f"{type(module).__name__} has no is_causal attribute and none was passed: flashtile "
                             "cannot tell causal from bidirectional attention")
        is_causal = module.is_causal
    causal = bool(is_causal)

    batch, nheads, query_len, headdim = query.shape
    value_headdim = value.shape[-1]
    if value_headdim > headdim:
        raise ValueError(f"value head dim ({value_headdim}) larger than the query/key head dim ({headdim}) is not "
                         "supported")
    if value_headdim < headdim:  # e.g. multi-head latent attention: pad, crop the output below
        value = torch.nn.functional.pad(value, [0, headdim - value_headdim])
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # BSHD views: (B, T, heads, D)
    target = _half_precision_target(q, module)
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)

    if sliding_window:
        window_size = (sliding_window - 1, 0 if causal else sliding_window - 1)
    else:
        window_size = (-1, -1)
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window_size,
                   softcap=softcap or 0.0, sink=s_aux.float() if s_aux is not None else None)

    if attention_mask is not None:
        # Cross-attention (an encoder-decoder's decoder attending to the encoder): the mask is the encoder's, of
        # the keys only, and every query is real. Told by the layer (Bart's kin carry is_decoder, GPT-2
        # is_cross_attention, BERT's a class of that name; none is causal) or by more queries than masked keys.
        every_query_real = (not causal and attention_mask.dtype != torch.int8
                            and (getattr(module, "is_decoder", False) is True
                                 or getattr(module, "is_cross_attention", False) is True
                                 or "CrossAttention" in type(module).__name__ or query_len > attention_mask.shape[1]))
        out = _padded(q, k, v, attention_mask, options, every_query_real)
    elif given:
        cu_q = _cu_seqlens_for("cu_seq_lens_q", cu_seq_lens_q, q.device)
        cu_k = _cu_seqlens_for("cu_seq_lens_k", cu_seq_lens_k, q.device)
        out = _packed(q, k, v, cu_q, cu_k, _max_length("max_length_q", max_length_q),
                      _max_length("max_length_k", max_length_k), options)
    else:
        packed = None
        if (position_ids is not None and 1 < query_len == k.shape[1] and position_ids.dim() in (1, 2)
                and position_ids.shape[-1] == query_len and (batch == 1 or kwargs.get("use_cache") is False)
                and not (torch.compiler.is_compiling() and batch > 1 and position_ids.numel() == query_len)):
            # Packed rows are looked for where transformers looks for them: its eager and SDPA masks without a
            # cache (``use_cache`` makes one), its flash-attention path in a batch of one row (a padding-free
            # batch) either way; so a generation's batched prefill with a gap in its positions stays one
            # sequence a row. Several rows are split only where the layer was told ``use_cache=False``: Gemma 2
            # and 3 pass no ``use_cache`` to their layers, with a cache or without. Under torch.compile the
            # positions' values cannot be read in the graph: a batch sharing one row of positions (the model's
            # own arange(T)) is taken as one sequence per row; other positions are read outside the graph (a
            # graph break; cu_seq_lens from the collator keep the graph whole).
            ids = position_ids.view(-1, query_len)
            find = _packed_sequences_outside_graph if torch.compiler.is_compiling() else _packed_sequences
            packed = _derived_once(position_ids, ("positions", batch), lambda: find(ids, batch))
        if packed is None:
            out = flash_attn_func(q, k, v, **options)
        else:
            cu, longest = packed
            out = _packed(q, k, v, cu, cu, longest, longest, options)
    if value_headdim < headdim:
        out = out[..., :value_headdim]
    return out, None


def _padded(q, k, v, attention_mask, options, every_query_real=False):
    """Real tokens only, through the varlen path; padded query rows of the output are 0. Where every key of
    the mask is real, the keys it covers (views) through ``flash_attn_func``. ``attention_mask`` int8: the slot
    codes of :func:`flashtile_mask` (a static cache). ``every_query_real``: the mask is of the keys alone (cross-
    attention); else the real queries are its last columns (transformers' own flash path reads it so)."""
    batch, query_len = q.shape[:2]
    slot_codes = attention_mask.dtype == torch.int8
    mask_len = attention_mask.shape[1]
    if slot_codes and mask_len != k.shape[1]:
        raise ValueError(f"attention_mask holds slot codes (int8) for {mask_len} cache slots; expected the layer's "
                         f"{k.shape[1]} keys")
    if not (0 if every_query_real else query_len) <= mask_len <= k.shape[1]:
        raise ValueError(f"attention_mask covers {mask_len} keys; expected between the {query_len} queries and the "
                         f"{k.shape[1]} keys of the layer")

    def real_queries(real):
        if every_query_real:
            return torch.ones(batch, query_len, dtype=torch.bool, device=real.device)
        return real[:, mask_len - query_len:]

    in_graph = os.environ.get("FLASHTILE_HF_STEP_IN_GRAPH", "paged")
    if (torch.compiler.is_compiling() and query_len < mask_len and not options["dropout_p"]
            and in_graph in ("1", "paged")
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        # (flash_attn_with_kvcache is forward only: a step that trains keeps the path below)
        if slot_codes:
            real, query_real, _ = _slots_of(attention_mask, query_len)
        else:
            real = attention_mask.bool()
            query_real = real_queries(real)
        return _cached_step_in_graph(q, k, v, real, query_real, options, paged=in_graph == "paged")
    if slot_codes:  # the slots written so far: transformers' own flash mask, read with the padding
        def make():
            return _padding_indices(*_slots_of(attention_mask, query_len))
    else:
        def make():
            valid = attention_mask.bool()
            return _padding_indices(valid, real_queries(valid))
    written, indices = _derived_once(attention_mask, ("padding", query_len, every_query_real), make)
    # A static cache is longer than the tokens seen so far: its slots past them are unused.
    k, v = k[:, :written], v[:, :written]
    if indices is None:  # no padding: the cache's first keys, read in place (no packed copies)
        return flash_attn_func(q, k, v, **options)
    (key_rows, key_cols), queries, (cu_q, cu_k), (max_q, max_k) = indices
    k, v = k[key_rows, key_cols], v[key_rows, key_cols]
    if queries is None:  # every query real: no gather, no scatter (a view for one token per sequence)
        return flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k, v, cu_q, cu_k, max_q, max_k,
                                      **options).view(q.shape)
    packed = flash_attn_varlen_func(q[queries], k, v, cu_q, cu_k, max_q, max_k, **options)
    out = q.new_zeros(q.shape)
    out[queries] = packed
    return out


# Slot codes of a static cache layer's mask (flashtile_mask): one int8 per cache slot.
_SLOT_PADDING, _SLOT_REAL, _SLOT_UNUSED, _SLOT_REAL_QUERY = 0, 1, 2, 3


def flashtile_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
                   kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask function for ``"flashtile"``: flash-attention's 2-D padding mask (``flash_attention_mask``),
    except for a static cache's steps after the first, whose query offset is a tensor on the device (the only
    sign of a static cache a mask function gets: its prefill's offset is the int 0, as is that of an encoder's
    or a cross-attention's mask, whose keys are also longer than the queries), and for calls without a mask
    whose offset is an int but whose keys outnumber the past and the queries (a dynamic cache has exactly as
    many) under a causal mask (an encoder's and a cross-attention's are bidirectional): a static cache's
    prefill, or a static sliding-window layer not yet full.

    There transformers' own mask is the tokens seen so far, one column longer every step: under torch.compile
    (transformers compiles a static cache's steps) every step would be a new shape, a new graph and a new CUDA
    graph; and without a mask (all tokens real) nothing would say which slots hold tokens. flashtile's is
    (B, kv_length) int8, one code per cache slot, the same shape every step: 0 padding (or a padding query),
    1 a real key, 3 a real query (the step's new tokens), 2 a slot not yet written. Nonzero codes are what
    transformers turns into True when it gives the mask back to this function inside the model.
    """
    if (isinstance(q_offset, torch.Tensor) and not kv_offset
            and (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                            and attention_mask.shape[1] <= kv_length))):
        device = attention_mask.device if attention_mask is not None else kwargs.get("device")
        return _slot_codes(attention_mask, batch_size, q_length, kv_length, q_offset, device)
    full_length = (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                   and attention_mask.shape[1] == kv_length)
    if ((attention_mask is None or full_length) and type(q_offset) is int and not kv_offset
            and kv_length > q_offset + q_length and _masks_later_keys(mask_function)):
        # A causal call with more keys than the past and the queries (a dynamic cache has exactly as many): a
        # static cache's prefill called without a mask, or a static sliding-window layer not yet full (its
        # offset stays an int); the slots past the queries are not yet written. Also with a mask of every slot:
        # an encoder-decoder's first static step, whose decoder gets back the codes of its generate's call as a
        # boolean mask (the unwritten slots True, which transformers' flash mask would drop as "all real").
        device = attention_mask.device if attention_mask is not None else kwargs.get("device")
        return _slot_codes(attention_mask, batch_size, q_length, kv_length, torch.tensor(q_offset, device=device),
                           device)
    from transformers.masking_utils import flash_attention_mask

    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                                **kwargs)


# Under torch.compile the answer is taken at trace time: the mask function is built from the model's config,
# and asking it on traced tensors would break the graph (a compiled loop over a static sliding-window cache
# called without masks made 14 graphs of a 2-layer Mistral's 10 steps, 4 with this). From torch 2.13: 2.9's
# dynamo raised an internal error turning transformers' mask closures into constants (versions between untried).
# (as versions, not strings: "2.9.1" >= "2.13" is True; ".dev0" so that 2.13's pre-releases and NGC builds count)
_ANSWER_AT_TRACE_TIME = torch.torch_version.TorchVersion(torch.__version__) >= "2.13.0.dev0"


def _masks_later_keys(mask_function) -> bool:
    """Whether transformers' mask function hides key 1 from query 0 (causal, windowed or chunked; not an
    encoder's or a cross-attention's bidirectional mask). False when it cannot be asked with plain indices."""
    try:  # (0-d tensors: transformers' combined masks call tensor methods on the indices)
        zero, one = torch.tensor(0), torch.tensor(1)
        return mask_function is not None and not bool(mask_function(zero, zero, zero, one))
    except Exception:
        return False


if _ANSWER_AT_TRACE_TIME:
    _masks_later_keys = torch._dynamo.assume_constant_result(_masks_later_keys)


def _slot_codes(mask: torch.Tensor | None, batch: int, q_length: int, kv_length: int, q_offset: torch.Tensor,
                device: torch.device | None) -> torch.Tensor:
    """(B, kv_length) int8 slot codes (see :func:`flashtile_mask`) from a (B, L <= kv_length) mask whose column i
    is cache slot i (None: every token real), the queries at slots [q_offset, q_offset + q_length). Device ops
    only: no host read."""
    slots = torch.arange(kv_length, device=device)
    end = q_offset.to(device) + q_length  # the first slot not yet written
    seen = slots < end
    if mask is None:
        real = seen.expand(batch, -1)
    else:
        real = torch.nn.functional.pad(mask.bool(), (0, kv_length - mask.shape[1])) & seen
    query = slots >= end - q_length
    return real.to(torch.int8) + 2 * ((query & real) | ~seen).to(torch.int8)


def _slots_of(codes: torch.Tensor, query_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From slot codes, on the device: (B, slots) bool real keys, (B, query_len) bool real queries, and the
    number of slots written (a scalar tensor)."""
    unused = codes == _SLOT_UNUSED
    end = torch.where(unused.any(1), unused.to(torch.int32).argmax(1), codes.shape[1])  # first slot not written
    query_slots = end[:, None] - query_len + torch.arange(query_len, device=codes.device)
    return (codes & 1).bool(), torch.gather(codes, 1, query_slots) == _SLOT_REAL_QUERY, end.max()


def _cached_step_in_graph(q, k, v, real, query_real, options, paged=False):
    """A generation step under torch.compile (queries after cached keys; transformers compiles a static cache's
    steps) without reading the mask on the host, which would break the graph in every layer. Each row's real
    keys are moved to its front, in order (a stable sort of the mask on the device, then a gather: the copies
    the eager path's packing makes too), and ``flash_attn_with_kvcache`` reads them with ``cache_seqlens`` the
    count of real keys. The real queries, the last of those keys, are moved to the end of their rows, so the
    bottom-right alignment puts each on its own key; padding query rows come out 0, as on the eager path.
    The eager path's result for any padding pattern (for a sliding window, counted over real tokens, as there).

    A sink (``options["sink"]``, gpt-oss) rescales each row of the output by its share of the softmax, from the
    keys' lse.

    ``paged`` (``FLASHTILE_HF_STEP_IN_GRAPH=paged``, the default): no gather; the cache is read in place as a pool
    of one-row pages, the block table listing each row's real keys (the kernel then loads key rows by index): 1.13x
    the gather's decoding tokens/s in transformers' compiled generation on an H200 (benchmarks/RESULTS.md). Caches
    that cannot be read so are gathered (``_pool_pitch``).

    real: (B, L) bool, the real keys among the layer's first L; query_real: (B, Tq) bool, the real queries."""
    batch, mask_len = real.shape
    query_len = q.shape[1]
    count = real.sum(-1, dtype=torch.int32)
    positions = torch.arange(mask_len, device=real.device)
    order = torch.argsort(torch.where(real, positions, positions + mask_len), dim=1)  # real keys first, in order
    order = order.to(k.device)
    block_table = None
    pitch = _pool_pitch(k, v, batch, mask_len) if paged else None
    if pitch is not None:
        # Row b * pitch + t of the cache's flat rows (cache_rows, flash_attn_with_kvcache's own view of a cache) is
        # position t of row b: pages of one row, each row's real keys listed in order.
        k, v = cache_rows(k)[:, None], cache_rows(v)[:, None]
        block_table = (torch.arange(batch, device=order.device)[:, None] * pitch + order).to(torch.int32)
    else:
        gather = order[:, :, None, None]
        k = torch.gather(k[:, :mask_len], 1, gather.expand(-1, -1, *k.shape[2:]))
        v = torch.gather(v[:, :mask_len], 1, gather.expand(-1, -1, *v.shape[2:]))
    query_real = query_real.to(q.device)
    query_positions = torch.arange(query_len, device=q.device)
    # padding queries first, then the real ones in order
    query_order = torch.argsort(torch.where(query_real, query_positions + query_len, query_positions), dim=1)
    query_gather = query_order[:, :, None, None].expand(-1, -1, *q.shape[2:])
    sink = options["sink"]
    out = flash_attn_with_kvcache(torch.gather(q, 1, query_gather), k, v, cache_seqlens=count.to(q.device),
                                  block_table=block_table, softmax_scale=options["softmax_scale"],
                                  causal=options["causal"], window_size=options["window_size"],
                                  softcap=options["softcap"], return_softmax_lse=sink is not None)
    if sink is not None:
        # A sink is one more logit in each head's softmax with no value: the keys' probabilities shrink by
        # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), lse that of the keys alone.
        out, lse = out
        keep = torch.sigmoid(lse - sink.to(lse.device).view(1, -1, 1)).transpose(1, 2)[..., None]
        out = (out * keep).to(out.dtype)
    out = torch.empty_like(out).scatter_(1, query_gather, out)  # back in the queries' order
    return torch.where(query_real[:, :, None, None], out, 0)


def _pool_pitch(k, v, batch: int, mask_len: int) -> int | None:
    """The position pitch that keys and values share when both can be read in place as pools of one-row pages
    (``cache_layout``; a block table of int32 rows), else None: the gather serves them (a head dim that is not
    contiguous, a batch stride that is not a whole number of position strides, two pitches, rows past 2**31)."""
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    try:
        pitch = cache_layout("key", k)[0]
        if cache_layout("value", v)[0] != pitch:
            return None
    except ValueError:
        return None
    return pitch if (batch - 1) * pitch + mask_len < 2**31 else None


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, options):
    """Sequences packed along the flattened (B * T) tokens, each attending only to itself. With one row (the
    collators' layout) the flattening is a view of the BHSD projections, not a copy."""
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                                 cu_q, cu_k, max_q, max_k, **options)
    return out.view(q.shape)


def _check_model_runs_flashtile(model) -> str:
    """The attention check of a model asked for ``"flashtile"``: only models whose attention code works with
    flash-attention kernels (2-D padding masks, packed-sequence keyword arguments) can run it."""
    if not (getattr(model, "_supports_flash_attn", False) or getattr(model, "_supports_flash_attn_2", False)):
        raise ValueError(f"{type(model).__name__} does not support flash-attention kernels (its _supports_flash_attn "
                         "is False), so attn_implementation='flashtile' would not compute its attention correctly; use "
                         "'sdpa' or 'eager'")
    return NAME


def _accept_flashtile_name(model_class) -> None:
    """Make ``model_class``'s attention check return ``"flashtile"`` as it is.

    transformers' check (``_check_and_adjust_attn_implementation``, 5.x) treats a name containing "flash" as
    a flash-attention kernel: a model that lists compatible flash kernels (gpt-oss) has it replaced by the first
    of them (a hub kernel), and every other model has it preloaded through ``lazy_import_flash_attention``,
    which looks for a hub kernel of that name. flashtile needs neither.
    """
    original = model_class._check_and_adjust_attn_implementation
    if getattr(original, "_accepts_flashtile", False):
        return

    @functools.wraps(original)
    def check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation == NAME:
            return _check_model_runs_flashtile(self)
        if isinstance(attn_implementation, str) and attn_implementation.split("|")[-1] == NAME:
            raise ValueError(f"attn_implementation={attn_implementation!r}: transformers' paged attention (continuous "
                             f"batching) is not supported by flashtile; use attn_implementation='{NAME}'")
        return original(self, attn_implementation, *args, **kwargs)

    check_and_adjust_attn_implementation._accepts_flashtile = True
    model_class._check_and_adjust_attn_implementation = check_and_adjust_attn_implementation


def register() -> None:
    """Make ``attn_implementation="flashtile"`` available to transformers models (idempotent).

    Registers :func:`flashtile_attention_forward` in transformers' ``AttentionInterface``, :func:`flashtile_mask`
    (the 2-D padding mask of flash-attention kernels; slot codes for a static cache) in its
    ``AttentionMaskInterface``, and makes ``PreTrainedModel``'s attention
    check accept the name (see :func:`_accept_flashtile_name`). Other implementations are left as they were.
    """
    import transformers
    from transformers import AttentionInterface, PreTrainedModel

    tested = "flashtile's integration is tested with transformers 5.17 and 5.24"
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"transformers {transformers.__version__} has no masking_utils.flash_attention_mask; "
                          f"{tested}") from exc
    if not hasattr(PreTrainedModel, "_check_and_adjust_attn_implementation"):
        raise ImportError(f"transformers {transformers.__version__} has no "
                          f"PreTrainedModel._check_and_adjust_attn_implementation to accept 'flashtile'; {tested}")

    AttentionInterface.register(NAME, flashtile_attention_forward)
    AttentionMaskInterface.register(NAME, flashtile_mask)
    _accept_flashtile_name(PreTrainedModel)
