"""The command line: info and a short demo run."""

from flashtile import cli


def test_demo_short_run(tmp_path, capsys, backend):
    backend("torch")
    png = tmp_path / "loss.png"
    assert cli.main(["demo", "--steps", "12", "--chars", "30000", "--block", "32", "--batch", "4",
                     "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "unigram baseline loss" in out and "final training loss" in out and "sample:" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no loss-curve PNG" in out
    else:
        assert png.exists()


def test_info(capsys, monkeypatch):
    monkeypatch.setenv("FLASHTILE_VALUE_CHECKS", "0")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for line in ("flashtile ", "torch ", "triton ", "triton cache ", "gpu ", "backend for CPU tensors: "):
        assert line in out, line
    assert "FLASHTILE_VALUE_CHECKS=0" in out
