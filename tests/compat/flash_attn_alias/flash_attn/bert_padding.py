"""``flash_attn.bert_padding``: flashtile's own (``flashtile.bert_padding``)."""

from flashtile.bert_padding import index_first_axis, pad_input, unpad_input

__all__ = ["index_first_axis", "pad_input", "unpad_input"]
