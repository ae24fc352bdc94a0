"""``flash_attn.layers.rotary``: flashtile's own (``flashtile.rotary``)."""

from flashtile.rotary import apply_rotary_emb, apply_rotary_emb_func

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func"]
