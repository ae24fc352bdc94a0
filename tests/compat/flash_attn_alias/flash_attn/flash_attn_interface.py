"""``flash_attn.flash_attn_interface`` backed by flashtile: the public functions, and the module-level names
flash-attn's test suite imports from here."""

import torch

from flashtile import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# flash-attn's switch to its ROCm Triton backend; flashtile has a single implementation.
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-tile width flash-attn's suite uses to rebuild its private S_dmask encoding (probabilities
    relative to running maxima per key tile). flashtile's S_dmask holds the probabilities themselves, so
    any width reads them back unchanged; this one is the PyTorch path's key tile, narrowed as flash-attn
    narrows its own for large head dims."""
    if head_dim > 256:
        raise ValueError(f"head_dim must be at most 256, got {head_dim}")
    return 128 if head_dim <= 64 else 64


def maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """x with a contiguous last dimension (flash-attn's helper; flashtile asks the caller for one)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


__all__ = [
    "USE_TRITON_ROCM",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
