"""The harness's CPU mode and the command line."""

import json

import torch

from flashtile import bench, cli


def test_flop_formula():
    assert bench.attention_flops(2, 16, 4096, 4096, 128, False) == 4 * 2 * 16 * 4096**2 * 128
    assert bench.attention_flops(2, 16, 4096, 4096, 128, True, "bwd") == 2.5 * 4 * 2 * 16 * 4096**2 * 128 / 2


def test_cpu_mode_runs(tmp_path, monkeypatch, capsys):
    real_run_cpu = bench.run_cpu
    monkeypatch.setattr(bench, "run_cpu", lambda log=print: real_run_cpu(seqlens=(64, 256), log=log))
    json_path = tmp_path / "rows.json"
    assert cli.main(["bench", "--cpu", "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    by = {(r["impl"], r["seqlen"]): r for r in rows}
    assert set(by) == {("flashtile", 64), ("naive", 64), ("flashtile", 256), ("naive", 256)}
    # The tiled path's peak grows slower than the naive one's.
    assert by[("naive", 256)]["extra"]["peak_extra_mib"] > by[("flashtile", 256)]["extra"]["peak_extra_mib"]
    assert "cpu flashtile" in capsys.readouterr().out


def test_speed_table_marks_unavailable_peers():
    rows = [bench.Row("flashtile", "fwd", "bfloat16", 64, False, 1024, 16, 32, ms=1.0, tflops=100.0),
            bench.Row("flex", "fwd", "bfloat16", 64, False, 1024, 16, 32, note="n/a: ImportError: no")]
    table = bench.speed_table(rows, ["flashtile", "flex"])
    assert "n/a*" in table and "100" in table


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "backend for CPU tensors" in out
    assert torch.__version__ in out


def test_grid_spread_over_gpus_merges_in_grid_order(tmp_path, monkeypatch):
    """--gpus N: one process per GPU takes every N-th point; rows merge back in grid order (no GPU here:
    the processes are stand-ins that write what a shard would)."""
    launched = []

    class FakeProcess:
        def __init__(self, argv, env):
            shard = argv[argv.index("--shard") + 1]
            launched.append((env["CUDA_VISIBLE_DEVICES"], shard))
            index, count = (int(x) for x in shard.split("/"))
            self.status = 1 if index in failing else 0
            if self.status:
                return  # dies before its first row
            points = [(d, s) for d in (64, 128) for s in (512, 1024, 2048)][index::count]
            rows = [bench.Row(peer, "fwd", "bfloat16", d, False, s, 16384 // s, 2048 // d, ms=1.0, tflops=float(s))
                    for d, s in points for peer in ("flashtile", "sdpa_flash")]
            with open(argv[argv.index("--json") + 1], "w") as fh:
                json.dump({"environment": {}, "rows": [bench.asdict(r) for r in rows]}, fh)

        def wait(self):
            return self.status

        def poll(self):
            return self.status

    monkeypatch.setattr(bench.subprocess, "Popen", FakeProcess)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args = bench.build_parser().parse_args(["--dtypes", "bfloat16", "--headdims", "64,128", "--causal", "false",
                                            "--seqlens", "512,1024,2048", "--modes", "fwd",
                                            "--peers", "flashtile,sdpa_flash", "--json", str(tmp_path / "g.json"),
                                            "--gpus", "2"])
    failing = set()
    rows, status = bench.run_speed_on_gpus(args, 2, log=lambda line: None)
    assert status == 0 and launched == [("3", "0/2"), ("5", "1/2")]
    assert [(r.headdim, r.seqlen, r.impl) for r in rows] == [
        (d, s, peer) for d in (64, 128) for s in (512, 1024, 2048) for peer in ("flashtile", "sdpa_flash")]
    # A GPU's process that dies: the run fails, and the previous run's file of that GPU is not merged.
    failing.add(1)
    rows, status = bench.run_speed_on_gpus(args, 2, log=lambda line: None)
    assert status == 1
    assert [(r.headdim, r.seqlen) for r in rows][::2] == [(64, 512), (64, 2048), (128, 1024)]
