"""Hugging Face transformers: ``attn_implementation="flashtile"`` after ``register()``.

Models that go through transformers' attention interface (Llama, Qwen2, Mistral, ...) call
:func:`flashtile_attention_forward` with BHSD tensors. Padded batches arrive with the 2-D padding mask
that transformers builds for flash-attention-style kernels; they are packed and run through
``flash_attn_varlen_func``, so padding costs nothing and never leaks into the softmax.

transformers (5.x) treats every implementation name containing "flash" as a flash-attention kernel and
imports one at model construction; ``register()`` therefore also hands it flashtile's drop-in
``flash_attn_func`` / ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` under that name.
"""

from __future__ import annotations

import torch

from ..inference import flash_attn_with_kvcache
from ..interface import flash_attn_func, flash_attn_varlen_func

NAME = "flashtile"


def _cu_seqlens(valid: torch.Tensor) -> tuple[torch.Tensor, int]:
    lengths = valid.sum(-1, dtype=torch.int32)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=valid.device)
    cu[1:] = lengths.cumsum(0)
    return cu, int(lengths.max())


def flashtile_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                scaling: float | None = None, sliding_window: int | None = None,
                                softcap: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract: query (B, H, Tq, D), key/value (B, Hk, Tk, D), and a
    2-D bool padding mask (B, Tk) or None. Returns ((B, Tq, H, D), None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # BSHD views
    options = dict(
        dropout_p=dropout if module.training else 0.0,
        softmax_scale=scaling,
        causal=bool(causal),
        window_size=(sliding_window - 1, 0 if causal else sliding_window - 1) if sliding_window else (-1, -1),
        softcap=softcap or 0.0,
    )
    if attention_mask is None:
        return flash_attn_func(q, k, v, **options), None
    # Padding: the mask covers the keys; the queries are the last Tq positions of each row.
    key_valid = attention_mask.bool()
    query_valid = key_valid[:, -q.shape[1]:]
    cu_q, max_q = _cu_seqlens(query_valid)
    cu_k, max_k = _cu_seqlens(key_valid)
    packed = flash_attn_varlen_func(q[query_valid], k[key_valid], v[key_valid], cu_q, cu_k, max_q, max_k, **options)
    out = torch.zeros_like(q)
    out[query_valid] = packed
    return out, None


def register() -> None:
    """Make ``attn_implementation="flashtile"`` available to transformers models."""
    from transformers import AttentionInterface
    from transformers import modeling_flash_attention_utils as fa_utils
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, flashtile_attention_forward)
    # The same 2-D padding mask transformers builds for flash-attention kernels.
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    # Satisfy transformers' flash-kernel import for a name containing "flash" with flashtile's own
    # flash-attn-compatible functions (private hooks of transformers 5.x; absent ones are skipped).
    try:
        fa_utils._flash_fn, fa_utils._flash_varlen_fn = flash_attn_func, flash_attn_varlen_func
        fa_utils._flash_with_kvcache_fn = flash_attn_with_kvcache
        fa_utils._pad_fn, fa_utils._unpad_fn = fa_utils._pad_input, fa_utils._unpad_input
        fa_utils._process_flash_kwargs_fn = fa_utils._lazy_define_process_function(flash_attn_varlen_func)
        fa_utils._process_with_kvcache_kwargs_fn = fa_utils._lazy_define_process_function(flash_attn_with_kvcache)
        fa_utils._loaded_implementation = NAME
    except AttributeError:
        pass
