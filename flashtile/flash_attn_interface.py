"""The public functions under flash-attn's module path, for code that imports them from there:
``from flash_attn.flash_attn_interface import flash_attn_varlen_func`` becomes
``from flashtile.flash_attn_interface import flash_attn_varlen_func``.

flash-attn's private ``_flash_attn_forward`` / ``_flash_attn_backward`` are not here: their arguments and
returns belong to its CUDA extension (``flashtile.flash_attn_forward`` returns ``(out, lse)``).
"""

from .inference import flash_attn_with_kvcache
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
