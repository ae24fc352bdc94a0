"""Triton kernels (the CUDA path; CPU tensors under ``TRITON_INTERPRET=1``).

Importing this package imports Triton; ``flashtile.interface`` does so lazily, on the first call that
selects the Triton backend, so that ``TRITON_INTERPRET`` set after ``import flashtile`` still counts.
"""

from .backward import attention_backward
from .configs import target_of
from .dropout import dropout_mask
from .forward import attention_forward, placeholder_ids
from .kvcache import append_conflicts, append_kv, rotate
from .replay import record

__all__ = ["attention_forward", "attention_backward", "append_conflicts", "append_kv", "dropout_mask",
           "placeholder_ids", "record", "rotate", "target_of"]
