"""Multi-head attention with a fused QKV projection, GQA, rotary embeddings, windows and a KV cache.

Shapes use B (batch), T (new tokens), C (embedding), H (query heads), Hk (kv heads), D (head dim).
"""

from __future__ import annotations

import torch
from torch import nn

from ..inference import flash_attn_with_kvcache
from ..interface import flash_attn_func


class _NoGradientThroughCache(torch.autograd.Function):
    """Identity whose backward raises: a cache step's output carries no gradient to q, k, v (the cache is
    written in place, forward only), and a backward through it would otherwise train the output projection
    alone, silently."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)  # (q ties the output to the graph that would have carried its gradient)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError("MultiheadAttention: backward through a kv_cache step; the cache runs without autograd "
                           "(no gradient would reach the q, k, v projection): run it under torch.no_grad(), or train "
                           "without kv_cache")


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings (GPT-NeoX layout: the two halves of each head)."""

    def __init__(self, head_dim: int, max_positions: int = 4096, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """x: (B, T, heads, D) at positions start .. start + T - 1 -> x rotated, same shape and dtype."""
        end = start + x.shape[1]
        if end > self.cos.shape[0]:
            raise ValueError(f"positions up to {end - 1} exceed the rotary table ({self.cos.shape[0]} positions)")
        return apply_rotary(x, self.cos[start:end], self.sin[start:end])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) by the angles whose cos/sin are (T, D/2); in float32, or in
    float64 for float64 inputs."""
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, D/2)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class KVCache:
    """Keys and values of the tokens seen so far, for incremental decoding.

    k, v: (B, max_seqlen, Hk, D); ``length`` tokens are filled. ``attend`` writes new tokens in place
    (through ``flash_attn_with_kvcache``) and attends to everything cached. Inference only (no autograd).
    """

    def __init__(self, batch: int, max_seqlen: int, num_kv_heads: int, head_dim: int, dtype=torch.float32,
                 device=None):
        self.k = torch.zeros(batch, max_seqlen, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """Append (B, T, Hk, D) new keys/values in place and attend q (B, T, H, D) to the whole cache."""
        if q.shape[0] != self.k.shape[0] or k.shape[0] != self.k.shape[0]:
            raise ValueError(f"KVCache holds a batch of {self.k.shape[0]}, got q of batch {q.shape[0]} and k of "
                             f"batch {k.shape[0]}")
        if k.shape[2:] != self.k.shape[2:] or k.dtype != self.k.dtype:
            raise ValueError(f"KVCache holds {self.k.shape[2]} kv heads of {self.k.shape[3]} dims in {self.k.dtype}; "
                             f"the new keys have {k.shape[2]} of {k.shape[3]} in {k.dtype} (make the cache with the "
                             "module's num_kv_heads, head_dim and dtype)")
        end = self.length + k.shape[1]
        if end > self.k.shape[1]:
            raise ValueError(f"KV cache full: {end} tokens > max_seqlen {self.k.shape[1]}")
        out = flash_attn_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=self.length, **kwargs)
        self.length = end
        return out


class MultiheadAttention(nn.Module):
    """Causal (or not) self-attention on (B, T, C) inputs, batch first, BSHD inside.

    Args:
        embed_dim: C. num_heads: H. num_kv_heads: Hk (GQA/MQA when < H; default H).
        causal: causal mask. window_size: flash-attn's (left, right) sliding window.
        rotary: apply rotary embeddings to q and k (positions continue across KV-cache calls).
        dropout: dropout on the output projection. attn_dropout: dropout on the attention probabilities
            (in the kernel, training only; reproducible under ``torch.manual_seed``).
        max_positions: size of the rotary table.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, causal: bool = True,
                 window_size: tuple[int, int] = (-1, -1), rotary: bool = True, dropout: float = 0.0,
                 bias: bool = False, max_positions: int = 4096, attn_dropout: float = 0.0):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1:
            raise ValueError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must be positive")
        if embed_dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must divide by num_heads ({num_heads}) and num_heads by "
                             f"num_kv_heads ({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.window_size = causal, window_size
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias)  # fused
        self.out = nn.Linear(embed_dim, embed_dim, bias=bias)
        if not 0.0 <= attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must lie in [0, 1), got {attn_dropout}")
        self.dropout = nn.Dropout(dropout)
        self.attn_dropout = attn_dropout
        self.rotary = RotaryEmbedding(self.head_dim, max_positions) if rotary else None

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C); with kv_cache, T new tokens after those cached."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"MultiheadAttention: x must be (batch, tokens, embed_dim={self.embed_dim}), got shape "
                             f"{tuple(x.shape)}")
        B, T, C = x.shape
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hk * D, Hk * D], dim=-1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hk, D), v.view(B, T, Hk, D)
        start = kv_cache.length if kv_cache is not None else 0
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        if kv_cache is not None and self.training and torch.is_grad_enabled():
            raise RuntimeError("MultiheadAttention: decoding with a kv_cache runs without autograd (no gradient would "
                               "reach the q, k, v projection); call it in eval mode or under torch.no_grad(), or "
                               "train without kv_cache")
        if kv_cache is not None:
            # New queries against every cached key, the new keys written into the cache in place;
            # bottom-right causal alignment makes the new rows see the whole past and their own prefix.
            y = kv_cache.attend(q, k, v, causal=self.causal, window_size=self.window_size)
            if torch.is_grad_enabled() and q.requires_grad:  # (eval mode with autograd on)
                y = _NoGradientThroughCache.apply(y, q)
        else:
            y = flash_attn_func(q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, causal=self.causal,
                                window_size=self.window_size)  # (B, T, H, D)
        return self.dropout(self.out(y.reshape(B, T, C)))
