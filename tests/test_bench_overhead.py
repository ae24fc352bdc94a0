"""The wall-clock mode's rows run and its table reads right (a CPU dry run: its timings mean nothing)."""

import torch

from flashtile import bench_overhead


def test_overhead_rows_and_table(backend):
    backend("torch")  # the PyTorch path on CPU (the kernels' interpreter takes no float32 here)
    lines = []
    rows = bench_overhead.run_overhead(shapes=((1, 16, 2, 16),), decode_steps=((2, 32),), dtype_name="float32",
                                       calls=2, repeats=1, log=lines.append, device="cpu")
    assert [row["mode"] for row in rows] == ["fwd", "fwd_bwd", "fwd", "fwd_bwd", "decode"]
    for row in rows:
        assert isinstance(row["us"]["flashtile"], float) and row["us"]["flashtile"] > 0
        assert isinstance(row["us"]["sdpa"], float)
        fastest, slowest = row["spread"]["flashtile"]
        assert fastest <= row["us"]["flashtile"] <= slowest
    table = bench_overhead.overhead_table(rows)
    assert table.count("\n") == len(rows) + 1 and "flashtile / fastest SDPA" in table
    assert "rows at or under 1.0x" in bench_overhead.summary(rows)
    assert len(lines) == len(rows)


def test_decode_row_appends_like_flashtile(backend):
    """Both sides of a decode row write the new token at the same cache position."""
    backend("torch")
    calls = bench_overhead._decode_calls(2, 8, torch.float32, torch.device("cpu"))
    out_ours = calls["flashtile"]()
    out_sdpa = calls["sdpa"]()
    torch.testing.assert_close(out_ours, out_sdpa, atol=1e-5, rtol=1e-5)
