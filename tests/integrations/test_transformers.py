"""attn_implementation="flashtile" in tiny randomly initialised models (no download): Llama, and Mistral
(sliding window), Qwen2, Gemma2 (softcap, alternating sliding-window layers)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashtile.integrations.transformers import register  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


def _models():
    register()
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM._from_config(config, attn_implementation="flashtile").eval()
    sdpa = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def test_logits_match_sdpa_with_and_without_padding():
    ours, sdpa = _models()
    ids = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, sdpa(ids).logits, atol=1e-4, rtol=1e-4)
        mask = torch.ones(3, 20, dtype=torch.long)
        mask[0, :5] = 0  # left padding
        mask[2, :11] = 0
        got = ours(ids, attention_mask=mask).logits
        want = sdpa(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


def test_generate_same_greedy_tokens():
    ours, sdpa = _models()
    ids = torch.randint(0, 97, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


def _family(name):
    """A tiny config of one model family and its causal-LM class."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if name == "mistral":
        return transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=6)
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    # Gemma2: attention logit softcap, query_pre_attn_scalar scaling, sliding window on alternate layers.
    return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**common, head_dim=16, sliding_window=5,
                                                                     attn_logit_softcapping=3.0,
                                                                     query_pre_attn_scalar=20)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_other_families_match_sdpa(family):
    register()
    cls, config = _family(family)
    torch.manual_seed(1)
    ours = cls._from_config(config, attn_implementation="flashtile").eval()
    reference = cls._from_config(config, attn_implementation="eager").eval()  # eager: softcap and window exact
    reference.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 97, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
        got, want = ours(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
