"""Modules built on flashtile's public API: attention with rotary embeddings and a KV cache, and a small GPT.

They call only ``flashtile.flash_attn_func`` (so they run on the GPU kernels and on the CPU's PyTorch
path alike) and never reach into the kernels.
"""

from .attention import KVCache, MultiheadAttention, RotaryEmbedding, apply_rotary
from .gpt import GPT, GPTConfig, RMSNorm

__all__ = ["GPT", "GPTConfig", "KVCache", "MultiheadAttention", "RMSNorm", "RotaryEmbedding", "apply_rotary"]
