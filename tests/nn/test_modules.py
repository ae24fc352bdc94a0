"""flashtile.nn on the CPU: attention against plain PyTorch, the KV cache, the GPT."""

import pytest
import torch
from torch.nn import functional as F

from flashtile.nn import GPT, GPTConfig, KVCache, MultiheadAttention, apply_rotary


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


def _plain_attention(module: MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """The same module computed with SDPA (GQA heads expanded, same rotary)."""
    B, T, C = x.shape
    H, Hk, D = module.num_heads, module.num_kv_heads, module.head_dim
    q, k, v = module.qkv(x).split([H * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(B, T, H, D), k.view(B, T, Hk, D), v.view(B, T, Hk, D)
    cos, sin = module.rotary.cos[:T], module.rotary.sin[:T]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(H // Hk, 2), v.repeat_interleave(H // Hk, 2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return module.out(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_multihead_attention_matches_sdpa(kv_heads):
    torch.manual_seed(kv_heads)
    module = MultiheadAttention(64, 4, kv_heads).double()
    x = torch.randn(2, 37, 64, dtype=torch.float64, requires_grad=True)
    ours, plain = module(x), _plain_attention(module, x)
    torch.testing.assert_close(ours, plain)
    g1 = torch.autograd.grad(ours.sum(), x)[0]
    g2 = torch.autograd.grad(plain.sum(), x)[0]
    torch.testing.assert_close(g1, g2)


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    module = MultiheadAttention(32, 4, 2).double().eval()
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    full = module(x)
    cache = KVCache(2, 32, 2, 8, dtype=torch.float64)
    pieces = [module(x[:, :7], cache), module(x[:, 7:8], cache), module(x[:, 8:], cache)]
    torch.testing.assert_close(torch.cat(pieces, 1), full)
    with pytest.raises(ValueError, match="KV cache full"):
        module(torch.randn(2, 13, 32, dtype=torch.float64), cache)


def test_kv_cache_refuses_training_and_other_batches():
    """Decoding through a KV cache has no backward: in training mode with autograd on it raises instead of
    returning an output whose q, k, v projection would get no gradient; a cache of another batch is refused."""
    module = MultiheadAttention(32, 4, 2)
    x = torch.randn(2, 5, 32)
    with pytest.raises(RuntimeError, match="without autograd"):
        module(x, KVCache(2, 16, 2, 8))
    module.eval()
    with pytest.raises(ValueError, match="batch of 3"):
        module(x, KVCache(3, 16, 2, 8))
    module.train()
    with torch.no_grad():
        module(x, KVCache(2, 16, 2, 8))
    # Eval mode with autograd on runs (inference that forgot no_grad); a backward through it raises.
    out = module.eval()(x, KVCache(2, 16, 2, 8))
    with pytest.raises(RuntimeError, match="backward through a kv_cache step"):
        out.sum().backward()


def test_gpt_trains_and_generates_same_tokens_with_and_without_cache():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    idx = torch.randint(0, 40, (3, 16))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    prompt = idx[:, :5]
    with_cache = model.generate(prompt, 30, greedy=True, use_cache=True)
    without = model.generate(prompt, 30, greedy=True, use_cache=False)
    assert torch.equal(with_cache, without)
    with pytest.raises(ValueError, match="block_size"):
        model.generate(prompt, 60, use_cache=True)


def test_sliding_window_module():
    torch.manual_seed(1)
    module = MultiheadAttention(32, 4, window_size=(4, 0)).double()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    y = module(x)
    # Changing a token only moves outputs within the next 4 positions.
    x2 = x.clone()
    x2[0, 2] += 1.0
    changed = (module(x2) - y).abs().amax(-1)[0] > 1e-12
    assert changed.tolist() == [2 <= i <= 6 for i in range(12)]


def test_attention_dropout_training_only():
    """attn_dropout drops attention probabilities while training (reproducibly), never in eval."""
    module = MultiheadAttention(64, 4, 2, attn_dropout=0.3).double()
    x = torch.randn(2, 24, 64, dtype=torch.float64)
    module.eval()
    torch.testing.assert_close(module(x), _plain_attention(module, x))
    module.train()
    torch.manual_seed(5)
    first = module(x)
    torch.manual_seed(5)
    assert torch.equal(first, module(x))
    assert not torch.allclose(first, _plain_attention(module, x))


def test_errors_name_the_callers_own_arguments():
    """Errors speak the names the user wrote: GPTConfig's fields, block_size, MultiheadAttention's input."""
    with pytest.raises(ValueError, match=r"n_embd \(128\) must divide by n_head \(4\) and n_head by n_kv_head \(3\)"):
        GPTConfig(n_head=4, n_kv_head=3)
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match=r"9 tokens exceed block_size \(8\)"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"idx must be \(batch, tokens\)"):
        model(torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"x must be \(batch, tokens, embed_dim=64\), got shape \(5, 64\)"):
        MultiheadAttention(64, 4)(torch.randn(5, 64))


def test_generate_fills_the_cache_to_block_size():
    """The last new token is not fed back, so a prompt of block_size tokens may ask for one more with the cache
    (it was refused); the tokens are those of the uncached loop."""
    torch.manual_seed(2)
    model = GPT(GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_kv_head=1, n_embd=16)).eval()
    prompt = torch.randint(0, 40, (2, 9))
    assert torch.equal(model.generate(prompt, 4, greedy=True), model.generate(prompt, 4, greedy=True, use_cache=False))
    with pytest.raises(ValueError, match="block_size"):
        model.generate(prompt, 5, greedy=True)


@pytest.mark.parametrize("make, words", [
    (lambda: GPTConfig(block_size=0), "block_size must be positive"),
    (lambda: GPTConfig(dropout=2.0), r"dropout must lie in \[0, 1\)"),
    (lambda: GPTConfig(window_size=(3,)), "window_size must be a pair"),
    (lambda: MultiheadAttention(32, 4, 0), r"num_kv_heads \(0\) must be positive"),
    (lambda: MultiheadAttention(32, 0), r"num_heads \(0\) and num_kv_heads \(0\) must be positive"),
    (lambda: MultiheadAttention(32, 4, 2).eval()(torch.randn(2, 3, 32), KVCache(2, 8, 4, 8)), "4 kv heads"),
    (lambda: GPT(GPTConfig(n_layer=2))(torch.zeros(1, 3, dtype=torch.long), kv_caches=[]), "one KVCache per layer"),
    (lambda: GPT(GPTConfig()).generate(torch.zeros(1, 0, dtype=torch.long), 2), "at least one token"),
    (lambda: GPT(GPTConfig()).generate(torch.zeros(1, 2, dtype=torch.long), -1), "must not be negative"),
])
def test_bad_module_arguments_are_named(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_generate_at_temperature_zero_in_half_precision():
    """logits / 1e-6 overflowed fp16 (inf, then NaN probabilities); sampling now divides in float32."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=16)).half().eval()
    tokens = model.generate(torch.randint(0, 40, (1, 3)), 4, temperature=0.0)
    assert tokens.shape == (1, 7)
