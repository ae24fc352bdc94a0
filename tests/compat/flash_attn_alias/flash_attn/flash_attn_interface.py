"""``flash_attn.flash_attn_interface`` backed by flashtile: the public functions, and the module-level names
flash-attn's test suite imports from here."""

from flashtile.flash_attn_interface import *  # noqa: F403 (the public functions)
from flashtile.flash_attn_interface import __all__ as _PUBLIC

# flash-attn's switch to its ROCm Triton backend; flashtile has a single implementation.
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-tile width flash-attn's suite uses to decode its private S_dmask layout (probabilities
    relative to running maxima per key tile). flashtile's S_dmask holds the probabilities themselves, which
    that decoding does not give back (those cases are deselected, docs/compatibility.md); the width here is
    a plausible one: the PyTorch path's key tile, narrowed for large head dims as flash-attn narrows its."""
    if head_dim > 256:
        raise ValueError(f"head_dim must be at most 256, got {head_dim}")
    return 128 if head_dim <= 64 else 64


__all__ = ["USE_TRITON_ROCM", *_PUBLIC]
