"""The flash_attn alias (tests/compat) that runs flash-attn's own test file against flashtile: its helpers
agree with plain PyTorch, the einops stand-in with hand-written reshapes, the sampling plugin is seeded."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

COMPAT = Path(__file__).parent / "compat"


@pytest.fixture
def alias(monkeypatch):
    """Import the alias as `flash_attn` for one test, then forget it (a real flash-attn may be installed)."""
    saved = {name: module for name, module in sys.modules.items() if name == "flash_attn" or
             name.startswith("flash_attn.") or name in ("einops", "flashtile_sample")}
    for name in saved:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(COMPAT / "einops_fallback"))
    monkeypatch.syspath_prepend(str(COMPAT / "flash_attn_alias"))
    yield importlib.import_module("flash_attn")
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.") or n in (
            "einops", "flashtile_sample")]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_alias_exports_flashtile(alias):
    import flashtile

    assert alias.__file__.startswith(str(COMPAT))
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        assert getattr(alias, name) is getattr(flashtile, name)
    interface = importlib.import_module("flash_attn.flash_attn_interface")
    assert interface.USE_TRITON_ROCM is False and interface._get_block_size_n("cpu", 128, True, False) == 64


def test_bert_padding_is_flashtiles(alias):
    import flashtile.bert_padding

    padding = importlib.import_module("flash_attn.bert_padding")
    for name in ("index_first_axis", "pad_input", "unpad_input"):
        assert getattr(padding, name) is getattr(flashtile.bert_padding, name)


def test_rotary_is_flashtiles(alias):
    import flashtile.rotary

    rotary = importlib.import_module("flash_attn.layers.rotary")
    assert rotary.apply_rotary_emb is flashtile.rotary.apply_rotary_emb
    assert rotary.apply_rotary_emb_func is flashtile.rotary.apply_rotary_emb
    for name in ("RotaryEmbedding", "apply_rotary_emb_qkv_", "apply_rotary_emb_kv_", "apply_rotary_emb_torch",
                 "rotate_half"):
        assert getattr(rotary, name) is getattr(flashtile.rotary, name)


def test_einops_fallback(alias):
    einops = importlib.import_module("einops")
    assert einops.__file__.startswith(str(COMPAT / "einops_fallback")) or "site-packages" in einops.__file__
    x = torch.randn(2, 5, 3, 4)
    assert torch.equal(einops.rearrange(x, "b s h d -> (b s) h d"), x.reshape(10, 3, 4))
    assert torch.equal(einops.rearrange(x, "b s ... -> s b ..."), x.transpose(0, 1))
    assert torch.equal(einops.rearrange(x, "b s h d -> b 1 (s h) d"), x.reshape(2, 1, 15, 4))
    assert torch.equal(einops.repeat(x, "b s h d -> b s (h g) d", g=2), x.repeat_interleave(2, dim=2))
    mask = torch.rand(2, 3) < 0.5
    assert torch.equal(einops.repeat(mask, "a b -> (a 4) (b 2)"),
                       mask.repeat_interleave(4, 0).repeat_interleave(2, 1))
    assert torch.equal(einops.rearrange(torch.arange(6), "(b n) -> b n", b=2), torch.arange(6).view(2, 3))
    with pytest.raises(ValueError):
        einops.rearrange(x, "b s h -> b s h")


def test_suite_sampling_is_seeded(alias):
    plugin = importlib.import_module("flashtile_sample")

    class Item:
        def __init__(self, i, dropout):
            self.name = self.originalname = "test_flash_attn_output" if i % 2 else "test_flash_attn_kvcache"
            self.callspec = type("Spec", (), {"params": {"dropout_p": dropout}})()
            self.nodeid = f"case{i}"

    class Config:
        def __init__(self, **options):
            self.options = {"--sample": 0, "--sample-seed": 0, "--shard": "1/1", "--keep-groups": False, **options}
            self._flashtile_groups = __import__("collections").Counter()
            self.hook = type("Hook", (), {"pytest_deselected": staticmethod(lambda items: None)})()

        def getoption(self, name):
            return self.options[name]

    def run(**options):
        items = [Item(i, 0.17 if i % 4 == 1 else 0.0) for i in range(200)]
        config = Config(**options)
        plugin.pytest_collection_modifyitems(None, config, items)
        return [item.nodeid for item in items], config

    everything, config = run()
    assert len(everything) == 150 and config._flashtile_groups["dropout_s_dmask"] == 50
    first, _ = run(**{"--sample": 40, "--sample-seed": 3})
    assert first == run(**{"--sample": 40, "--sample-seed": 3})[0] and len(first) == 40
    assert first != run(**{"--sample": 40, "--sample-seed": 4})[0]
    parts = [run(**{"--sample": 40, "--sample-seed": 3, "--shard": f"{i}/3"})[0] for i in (1, 2, 3)]
    assert sorted(sum(parts, [])) == sorted(first)
