"""A small GPT written to be read: pre-norm blocks of RMSNorm, flashtile attention and an MLP.

Reads top to bottom: the parts, then the config, then the model (the layout of nanoGPT's model.py).
Shapes: B batch, T tokens, C embedding, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .attention import KVCache, MultiheadAttention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.n_embd)
        self.attn = MultiheadAttention(config.n_embd, config.n_head, config.n_kv_head, causal=True,
                                       window_size=config.window_size, dropout=config.dropout,
                                       max_positions=config.block_size)
        self.norm2 = RMSNorm(config.n_embd)
        self.mlp = MLP(config.n_embd, 4 * config.n_embd)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), kv_cache)
        return x + self.mlp(self.norm2(x))


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256  # longest sequence (rotary table, KV cache)
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # GQA when smaller than n_head
    n_embd: int = 128
    window_size: tuple[int, int] = (-1, -1)
    dropout: float = 0.0

    def __post_init__(self):
        # Checked here, in the config's own names (MultiheadAttention would name its arguments instead).
        for name in ("vocab_size", "block_size", "n_layer", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig: {name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must lie in [0, 1), got {self.dropout}")
        if not isinstance(self.window_size, (tuple, list)) or len(self.window_size) != 2:
            raise ValueError(f"GPTConfig: window_size must be a pair (left, right), got {self.window_size!r}")
        n_kv_head = self.n_kv_head or self.n_head
        if self.n_head < 1 or self.n_kv_head is not None and self.n_kv_head < 1:
            raise ValueError(f"GPTConfig: n_head ({self.n_head}) and n_kv_head ({self.n_kv_head}) must be positive")
        if self.n_embd % self.n_head or self.n_head % n_kv_head:
            raise ValueError(f"GPTConfig: n_embd ({self.n_embd}) must divide by n_head ({self.n_head}) and n_head "
                             f"by n_kv_head ({n_kv_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"GPTConfig: the head size n_embd / n_head ({self.n_embd} / {self.n_head}) must be "
                             "even for rotary embeddings")


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied input and output embeddings
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small normal weights (GPT-2's 0.02): unit-variance embeddings tied to the head give huge logits.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, kv_caches: list[KVCache] | None = None):
        """idx: (B, T) token ids -> logits (B, T, V), and the mean cross-entropy if targets are given."""
        if idx.dim() != 2:
            raise ValueError(f"GPT: idx must be (batch, tokens) token ids, got shape {tuple(idx.shape)}")
        if kv_caches is not None and len(kv_caches) != len(self.blocks):
            raise ValueError(f"GPT: kv_caches must hold one KVCache per layer ({len(self.blocks)}), got "
                             f"{len(kv_caches)}")
        start = kv_caches[0].length if kv_caches else 0
        if start + idx.shape[1] > self.config.block_size:
            cached = f" after {start} cached tokens" if start else ""
            raise ValueError(f"GPT: {idx.shape[1]} tokens{cached} exceed block_size ({self.config.block_size}); "
                             "crop idx to its last block_size tokens or raise GPTConfig.block_size")
        x = self.embed(idx)  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, kv_caches[i] if kv_caches is not None else None)
        logits = self.head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
                 use_cache: bool = True) -> torch.Tensor:
        """Append max_new_tokens sampled tokens to idx (B, T); with use_cache the KV cache is filled once
        by the prompt and then extended one token at a time."""
        config = self.config
        caches = None
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"GPT.generate: idx must be (batch, tokens) with at least one token, got shape "
                             f"{tuple(idx.shape)}")
        if max_new_tokens < 0 or temperature < 0:
            raise ValueError(f"GPT.generate: max_new_tokens ({max_new_tokens}) and temperature ({temperature}) must "
                             "not be negative")
        # (the last new token is not fed back: the cache holds the prompt and all new tokens but that one)
        if use_cache and idx.shape[1] + max_new_tokens - 1 > config.block_size:
            raise ValueError(f"prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds block_size "
                             f"({config.block_size}) + 1 with use_cache=True")
        if use_cache:
            attn = self.blocks[0].attn
            caches = [KVCache(idx.shape[0], config.block_size, attn.num_kv_heads, attn.head_dim,
                              dtype=self.embed.weight.dtype, device=idx.device) for _ in self.blocks]
        step_input = idx
        for _ in range(max_new_tokens):
            if use_cache:
                logits, _ = self(step_input, kv_caches=caches)
            else:
                logits, _ = self(idx[:, -config.block_size:])
            logits = logits[:, -1].float() / max(temperature, 1e-6)  # (float32: a small temperature overflows fp16)
            if greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                token = torch.multinomial(torch.softmax(logits, -1), 1)
            idx = torch.cat([idx, token], dim=1)
            step_input = token
        return idx
