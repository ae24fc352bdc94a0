"""flashtile: exact FlashAttention in Triton under the flash-attn 2 API.

    from flashtile import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)   # q: (batch, seqlen, nheads, headdim)
"""

import warnings

# torch's CPU builds warn "Failed to initialize NumPy" once, when torch is first imported without numpy
# installed; flashtile never needs numpy, so an import of torch made through flashtile stays quiet.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from . import fp8  # noqa: E402
from .inference import flash_attn_with_kvcache  # noqa: E402
from .interface import (  # noqa: E402
    flash_attn_backward,
    flash_attn_forward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    select_backend,
)
from .merge import merge_attention_states, merge_attention_states_many  # noqa: E402
from .options import SPARSE_BLOCK  # noqa: E402
from .sparse import block_sparse_attn_func, local_global_block_mask  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "SPARSE_BLOCK",
    "block_sparse_attn_func",
    "fp8",
    "local_global_block_mask",
    "flash_attn_backward",
    "flash_attn_forward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "merge_attention_states_many",
    "select_backend",
    "__version__",
]
