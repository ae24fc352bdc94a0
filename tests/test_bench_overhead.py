"""The wall-clock mode's rows run and its table reads right (a CPU dry run: its timings mean nothing)."""

import pytest
import torch

from flashtile import bench_overhead


def test_overhead_rows_and_table(backend):
    backend("torch")  # the PyTorch path on CPU (the kernels' interpreter takes no float32 here)
    lines = []
    rows = bench_overhead.run_overhead(shapes=((1, 16, 2, 16),), decode_steps=((2, 32),), dtype_name="float32",
                                       calls=2, repeats=1, log=lines.append, device="cpu",
                                       decode_variants=(("paged", 2, 32),))
    assert [row["mode"] for row in rows] == ["fwd", "fwd_bwd", "fwd", "fwd_bwd", "decode", "decode"]
    assert rows[-1]["variant"] == "paged" and "decode paged" in lines[-1]
    for row in rows:
        assert isinstance(row["us"]["flashtile"], float) and row["us"]["flashtile"] > 0
        assert isinstance(row["us"]["sdpa"], float)
        fastest, slowest = row["spread"]["flashtile"]
        assert fastest <= row["us"]["flashtile"] <= slowest
    table = bench_overhead.overhead_table(rows)
    assert table.count("\n") == len(rows) + 1 and "flashtile / fastest SDPA" in table
    assert "of 5 rows at or under 1.0x" in bench_overhead.summary(rows)  # the paged row is not counted
    assert len(lines) == len(rows)


def test_fp8_overhead_rows_and_table(backend):
    """``--overhead --fp8``: FP8 inference forwards beside the 16-bit ones, compared by flashtile_fp8; the FP8 call
    attends the quantized inputs (on CPU the PyTorch path dequantizes them), close to the 16-bit call."""
    backend("torch")
    rows = bench_overhead.run_fp8_overhead(shapes=((1, 16, 2, 32),), calls=2, repeats=1, log=lambda line: None,
                                           device="cpu")
    assert [(row["kind"], row["mode"], row["causal"]) for row in rows] == [("fp8", "fwd", False), ("fp8", "fwd", True)]
    for row in rows:
        assert all(isinstance(row["us"][name], float) for name in ("flashtile_fp8", "flashtile", "sdpa"))
    table = bench_overhead.overhead_table(rows)
    assert "flashtile_fp8 / fastest SDPA" in table and "of 2 rows at or under 1.0x" in bench_overhead.summary(rows)
    torch.manual_seed(0)
    calls = bench_overhead._fp8_forward_calls((1, 16, 2, 32), True, torch.float32, torch.device("cpu"))
    fp8_out, out = calls["flashtile_fp8"]().float(), calls["flashtile"]()
    # (FP8's rounding of q, k and v moves single values by up to about 0.2 here: the mean says they attend alike)
    assert (fp8_out - out).abs().mean() < 0.05 < (fp8_out - out.flip(1)).abs().mean()


@pytest.mark.parametrize("variant", ["contiguous", "paged", "batch_idx", "rotary"])
def test_decode_row_appends_like_flashtile(backend, variant):
    """Both sides of a decode row write the new token at the same cache position and attend the same keys
    (the paged pool and the shuffled batch read as SDPA's contiguous cache; both rotate alike)."""
    backend("torch")
    calls = bench_overhead._decode_calls(2, 16, torch.float32, torch.device("cpu"), variant)
    out_ours = calls["flashtile"]()
    out_sdpa = calls["sdpa"]()
    torch.testing.assert_close(out_ours, out_sdpa, atol=1e-5, rtol=1e-5)
