"""flashtile under flash-attn's package name, so that flash-attn's own test suite (and code written for
flash-attn) runs against flashtile unchanged: put ``tests/compat/flash_attn_alias`` first on PYTHONPATH.

A testing aid, not an installable package: ``tests/compat/run_flash_attn_suite.sh`` uses it, and
``docs/compatibility.md`` lists what differs.
"""

from flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "2.8.3+flashtile"  # the flash-attn 2 API flashtile follows

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
