"""The harness's CPU mode and the command line."""

import json

import pytest
import torch

from flashtile import bench, cli, demo


def test_flop_formula():
    assert bench.attention_flops(2, 16, 4096, 4096, 128, False) == 4 * 2 * 16 * 4096**2 * 128
    assert bench.attention_flops(2, 16, 4096, 4096, 128, True, "bwd") == 2.5 * 4 * 2 * 16 * 4096**2 * 128 / 2


def test_cpu_mode_runs(tmp_path, capsys):
    json_path = tmp_path / "rows.json"
    assert cli.main(["bench", "--cpu", "--seqlens", "64,256", "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    by = {(r["impl"], r["seqlen"]): r for r in rows}
    assert set(by) == {("flashtile", 64), ("naive", 64), ("flashtile", 256), ("naive", 256)}
    # The tiled path's peak grows slower than the naive one's.
    assert by[("naive", 256)]["extra"]["peak_extra_mib"] > by[("flashtile", 256)]["extra"]["peak_extra_mib"]
    out = capsys.readouterr().out
    # It says what it runs, and ends on a summary line.
    assert "batch 1, 4 heads, d=64, float32, causal, s=64,256" in out
    assert "cpu flashtile" in out and "summary at s=256" in out


def test_cpu_mode_honours_or_rejects_the_grid_flags(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_cpu", lambda **kw: calls.append(kw) or [
        bench.Row(impl, "fwd_bwd", "float64", 32, False, 48, 1, 4, ms=1.0, extra={"peak_extra_mib": 1.0})
        for impl in ("flashtile", "naive")])
    assert cli.main(["bench", "--cpu", "--dtypes", "float64", "--headdims", "32,48", "--causal", "false",
                     "--seqlens", "48", "--peers", "flashtile"]) == 0
    assert calls[0]["dtypes"] == ["float64"] and calls[0]["headdims"] == [32, 48]
    assert calls[0]["causals"] == [False] and calls[0]["seqlens"] == [48] and calls[0]["peers"] == ["flashtile"]
    for argv, message in ((["--decode"], "--decode needs a CUDA GPU"), (["--full"], "--full needs a CUDA GPU"),
                          (["--peers", "flashtile,flex"], "flashtile and naive only"),
                          (["--modes", "fwd"], "forward\\+backward only")):
        with pytest.raises(SystemExit, match=message):
            cli.main(["bench", "--cpu", *argv])
    assert len(calls) == 1


def test_plot_without_matplotlib_fails_before_any_work(monkeypatch):
    real_find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    monkeypatch.setattr(bench, "run_cpu", lambda **kw: pytest.fail("ran before checking for matplotlib"))
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        cli.main(["bench", "--cpu", "--plot", "out"])


def test_grid_axes_headline_full_and_flags():
    """The default run is the headline; --full the whole grid; a flag replaces its axis of either."""
    parse = lambda *argv: bench.build_parser().parse_args(list(argv))
    args = parse()
    bench._resolve_axes(args, "grid")
    assert (args.dtypes, args.headdims, args.seqlens) == ("bfloat16", "64,128", "1024,8192")
    assert args.peers == "flashtile,sdpa_flash,sdpa_cudnn"
    args = parse("--full", "--headdims", "256")
    bench._resolve_axes(args, "grid")
    assert args.headdims == "256" and args.dtypes == "bfloat16,float16"
    assert args.peers == "flashtile,sdpa_flash,sdpa_cudnn,flex,naive"  # fa4 only when named
    assert args.seqlens == "512,1024,2048,4096,8192,16384"
    with pytest.raises(SystemExit, match="unknown peer or mode fa5"):
        bench._resolve_axes(parse("--peers", "flashtile,fa5"), "grid")


def test_summary_line():
    rows = [bench.Row(impl, mode, "bfloat16", 64, False, s, 1, 1, ms=1.0, tflops=tflops)
            for impl, mode, s, tflops in (("flashtile", "fwd", 1024, 300.0), ("sdpa_flash", "fwd", 1024, 200.0),
                                          ("flashtile", "fwd", 8192, 400.0), ("sdpa_flash", "fwd", 8192, 200.0),
                                          ("flashtile", "bwd", 8192, 100.0))]
    rows.append(bench.Row("sdpa_cudnn", "fwd", "bfloat16", 64, False, 1024, 1, 1, note="n/a: no cuDNN"))
    line = bench.summary_line(rows, ["flashtile", "sdpa_flash", "sdpa_cudnn"])
    assert "vs sdpa_flash fwd 1.73x (1.50-2.00)" in line and "vs sdpa_cudnn not measured" in line
    assert "bwd" not in line  # no peer's backward to compare with


def test_every_option_has_help():
    for build in (bench.build_parser, demo.build_parser):
        for action in build()._actions:
            assert action.help, f"{build.__module__} {action.option_strings} has no help text"


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


def test_speed_rounds_rotate_the_peers_and_take_the_median(monkeypatch):
    """--rounds: each round starts one peer later (A B C, B C A, C A B), each row gets the median of its rounds."""
    timed = []

    def fake_time(fn):
        timed.append(fn())
        return float(len(timed))  # the n-th timing takes n ms

    monkeypatch.setattr(bench, "_time_ms", fake_time)
    monkeypatch.setattr(bench, "_mode_callable", lambda impl, mode, *args: (lambda: impl))
    ready = {"flashtile": ("A", 0.5, None), "sdpa_flash": ("B", 0.1, None), "sdpa_cudnn": ("C", 0.1, "no bwd")}
    by_peer = bench._time_point(ready, ["fwd", "bwd"], ("bfloat16", 64, False, 1024, 16, 32), None, None, None,
                                None, False, 3)
    rows = [row for peer in ready for row in by_peer[peer]]
    # A's two modes, B's two, C's forward (its backward failed at the first call), then rotated
    assert timed == ["A", "A", "B", "B", "C", "B", "B", "C", "A", "A", "C", "A", "A", "B", "B"]
    by = {(r.impl, r.mode): r for r in rows}
    assert [(r.impl, r.mode) for r in rows] == [(p, m) for p in ready for m in ("fwd", "bwd")]
    assert by["flashtile", "fwd"].extra["ms_rounds"] == [1.0, 9.0, 12.0] and by["flashtile", "fwd"].ms == 9.0
    assert by["sdpa_flash", "bwd"].extra["ms_rounds"] == [4.0, 7.0, 15.0] and by["sdpa_flash", "bwd"].ms == 7.0
    assert by["sdpa_cudnn", "fwd"].ms == 8.0 and by["sdpa_cudnn", "bwd"].note == "no bwd"
    assert by["sdpa_cudnn", "bwd"].ms is None and by["sdpa_flash", "fwd"].tflops > 0


def test_cpu_chart_is_one_panel(tmp_path):
    """The CPU run's chart: one panel of time per point, not a grid of empty ones (matplotlib only)."""
    pytest.importorskip("matplotlib")
    rows = [bench.Row(impl, "fwd_bwd", "float32", 64, True, s, 1, 4, ms=1.0, tflops=t, extra={"peak_extra_mib": m})
            for impl, t, m in (("flashtile", 0.02, 1.0), ("naive", 0.04, 4.0)) for s in (256, 512)]
    speed, memory = bench.plot(rows, str(tmp_path / "cpu"))
    import matplotlib.image

    height, width = matplotlib.image.imread(speed).shape[:2]
    assert width < 600 and height < 500 and memory.endswith("_memory.png")


def test_default_run_on_a_gpu_is_the_headline_with_a_summary(monkeypatch, capsys):
    """The GPU path of `flashtile bench` without flags (no GPU here: run_speed is a stand-in): the headline
    axes, the table and the summary line."""
    calls = []

    def fake_run_speed(dtypes, headdims, causals, seqlens, modes, peers, log, shard, rows, rounds=1):
        calls.append((dtypes, headdims, causals, seqlens, modes, peers))
        rows += [bench.Row(peer, mode, "bfloat16", 64, False, 1024, 16, 32, ms=1.0, tflops=tflops)
                 for peer, tflops in (("flashtile", 300.0), ("sdpa_flash", 200.0)) for mode in ("fwd", "bwd")]
        return rows

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "stand-in"})
    monkeypatch.setattr(bench, "run_speed", fake_run_speed)
    assert cli.main(["bench"]) == 0
    assert calls == [(["bfloat16"], [64, 128], [False, True], [1024, 8192], list(bench.MODES),
                      ["flashtile", "sdpa_flash", "sdpa_cudnn"])]
    out = capsys.readouterr().out
    assert "headline run (--full: the whole grid): bfloat16, d=64,128, not causal and causal, s=1024,8192" in out
    assert "vs sdpa_flash fwd 1.50x (1.50-1.50), bwd 1.50x (1.50-1.50); vs sdpa_cudnn not measured" in out
