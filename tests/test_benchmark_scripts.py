"""The scripts under benchmarks/ that turn a GPU run's JSON into RESULTS.md tables, on made-up rows."""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _row(impl, mode, tflops, headdim=64, seqlen=2048, dtype="bfloat16"):
    return {"impl": impl, "mode": mode, "dtype": dtype, "headdim": headdim, "causal": False, "seqlen": seqlen,
            "tflops": tflops}


def test_grid_table_marks_and_lists_a_missed_target_cell(tmp_path):
    rows = [
        _row("flashtile", "fwd", 400.0), _row("sdpa_flash", "fwd", 290.0),  # 1.38x: holds
        _row("flashtile", "bwd", 370.0), _row("sdpa_flash", "bwd", 280.0),  # 1.32x: misses 1.35x
        _row("flashtile", "fwd", 300.0, headdim=256), _row("sdpa_flash", "fwd", 260.0, headdim=256),  # 1.15x >= 1.1x
        _row("flashtile", "bwd", 290.0, headdim=256),  # no peer row: a miss, "not measured"
        _row("flashtile", "fwd", 100.0, seqlen=512), _row("sdpa_flash", "fwd", 200.0, seqlen=512),  # no target
        _row("naive", "fwd", float("nan")),
    ]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"environment": {}, "rows": rows}))
    out = subprocess.run([sys.executable, str(BENCHMARKS / "grid_table.py"), str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert "| bf16 | 64 | no | 2048 | 400 / 370 / – | 290 / 280 / – |" in out
    assert "1.38 / **1.32** / nan" in out
    assert "2 of 4 target cells hold." in out
    assert "- bf16 d=64 non-causal s=2048 bwd: 1.321x (370 against 280 TFLOP/s)" in out
    assert "- bf16 d=256 non-causal s=2048 bwd: nanx (not measured)" in out


def test_every_script_has_its_line_in_the_benchmarks_readme():
    """benchmarks/README.md tells the user scripts from the lab tools, one line of purpose each."""
    readme = (BENCHMARKS / "README.md").read_text()
    scripts = [p for p in BENCHMARKS.rglob("*") if p.suffix in (".py", ".sh") and not p.is_symlink()]
    assert scripts
    for path in scripts:
        assert f"`{path.name}" in readme, f"{path.relative_to(BENCHMARKS)} is not listed there"
