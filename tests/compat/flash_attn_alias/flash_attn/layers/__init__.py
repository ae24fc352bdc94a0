"""``flash_attn.layers`` of flashtile's compatibility alias: only ``rotary`` is provided."""
