"""``flash_attn.layers.rotary``: flashtile's own (``flashtile.rotary``)."""

from flashtile.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
    rotate_half,
)

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_", "apply_rotary_emb_torch", "rotate_half"]
