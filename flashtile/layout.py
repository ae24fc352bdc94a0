"""Memory layouts that the API and the kernels share, in PyTorch alone (importing it imports no Triton, which
CPU-only installs off Linux do not have)."""

from __future__ import annotations

import torch


def keys_fastest_memory(batch: int, seqlen: int, nheads: int, headdim: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """Empty (batch, nheads, headdim, padded) memory for a keys-fastest v of that BSHD shape, seqlen padded to a
    multiple of 16 (1-byte rows whose strides are 16-byte multiples, as the copy engine wants); its
    ``.permute(0, 3, 1, 2)[:, :seqlen]`` is the BSHD view. FP8 tensor-core products read V this way
    (``kernels.forward.keys_fastest``, ``flashtile.fp8.quantize(v, keys_fastest=True)``)."""
    return torch.empty((batch, nheads, headdim, -(-seqlen // 16) * 16), dtype=dtype, device=device)
