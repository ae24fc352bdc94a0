"""README's Python snippets run (on CPU, at small sizes): the quick start and the GPT."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_quick_start_snippet_runs_on_cpu(backend):
    backend("torch")  # the PyTorch path on CPU, as on a machine without a GPU
    block = next(b for b in _blocks() if "flash_attn_func(q, k, v, causal=True)" in b)
    code = block.replace('"cuda"', '"cpu"').replace("torch.bfloat16", "torch.float32").replace("4096", "96")
    scope: dict = {}
    exec(compile(code, "README quick start", "exec"), scope)
    assert scope["out"].shape == (2, 96, 16, 128) and scope["lse"].shape == (2, 16, 96)
    assert scope["q"].grad is not None


def test_gpt_snippet_runs_on_cpu(backend):
    backend("torch")
    block = next(b for b in _blocks() if "GPTConfig(" in b)
    idx = torch.randint(0, 256, (2, 32))
    scope = {"idx": idx, "targets": idx}
    exec(compile(block, "README GPT", "exec"), scope)
    assert scope["logits"].shape == (2, 32, 256) and scope["tokens"].shape == (2, 8 + 64)
