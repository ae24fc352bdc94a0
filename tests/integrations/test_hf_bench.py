"""benchmarks/hf_bench.py runs end to end at --small sizes on CPU: both parts, every row, and the packed
training step's loss equal to the padded batch's (the same real tokens)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_hf_bench_small_runs_and_packed_loss_matches_padded(tmp_path):
    out = tmp_path / "hf_bench.json"
    env = os.environ | {"PYTHONPATH": str(ROOT), "FLASHTILE_BACKEND": "torch"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_bench.py"), "--small", "--dtype", "float32",
                             "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| flashtile | packed |" in result.stdout and "| sdpa | padded |" in result.stdout
    report = json.loads(out.read_text())
    assert report["environment"]["flashtile"].startswith(str(ROOT))  # this tree's flashtile ran
    assert [r["impl"] for r in report["generate"]] == ["flashtile", "sdpa"]
    assert report["generate"][0]["same_tokens_as_sdpa"] == 1.0  # float32: the same greedy tokens
    losses = {(r["impl"], r["layout"]): r["loss"] for r in report["train"]}
    assert len(losses) == 4
    for loss in losses.values():
        assert loss == pytest.approx(losses[("sdpa", "padded")], rel=1e-5)
