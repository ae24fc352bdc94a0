"""README.md as a new user reads it: its set-up commands, and its Python snippets run as written (the GPU
one on CPU, at a smaller size)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAIN_JOB = "pip install torch==2.13.0 triton==3.6.0 && pip install -e . && flashtile bench"
TESTS = 'pip install torch==2.13.0 triton==3.6.0 && pip install -e ".[test,hf]" && pytest -n 2 tests'


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _run(block: str, name: str) -> dict:
    scope: dict = {}
    exec(compile(block, f"README {name}", "exec"), scope)
    return scope


def test_setup_commands_and_ci():
    """The two set-up commands, each a block of its own, and .ci/run running the test command's pieces."""
    assert [b.strip() for b in _blocks("bash")][:2] == [MAIN_JOB, TESTS]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0 triton==3.6.0" in ci and '-e ".[test,hf]"' in ci and "pytest -n 2 tests" in ci


def test_gpu_quick_start_runs_on_cpu(backend):
    backend("torch")  # the PyTorch path on CPU, as on a machine without a GPU
    block = next(b for b in _blocks("python") if 'device="cuda"' in b)
    code = block.replace('device="cuda", ', "").replace("torch.bfloat16", "torch.float32").replace("4096", "96")
    scope = _run(code, "GPU quick start")
    assert scope["out"].shape == (2, 96, 16, 128) and scope["lse"].shape == (2, 16, 96)
    assert scope["q"].grad is not None


def test_cpu_quick_start_runs_as_written(backend):
    backend("torch")
    block = next(b for b in _blocks("python") if "scaled_dot_product_attention" in b)
    scope = _run(block, "CPU quick start")  # it asserts the result itself
    assert scope["out"].shape == (1, 4, 512, 64)


def test_gpt_snippet_runs_as_written(backend):
    backend("torch")
    block = next(b for b in _blocks("python") if "GPTConfig(" in b)
    scope = _run(block, "GPT")
    assert scope["logits"].shape == (2, 64, 256) and scope["tokens"].shape == (2, 8 + 64)
    assert scope["loss"].requires_grad
