"""ptxas keeps the Hopper matrix instructions of the attention kernels pipelined.

When ptxas cannot pipeline a kernel's wgmma instructions it serializes every one of them (each waits
for the previous to finish) and says so in a "Performance Loss" warning. The causal dK/dV pass ran
that way while its masked and interior query tiles were three loops carrying the dK and dV
accumulators from one to the next; the non-causal pass did not. This compiles the forward, dK/dV and
dQ kernels for sm_90 without a GPU (Triton's real compiler under benchmarks/lab/stand_in_hopper.py, in a
subprocess) with the default tiles and TMA loads as on an H200, for the masks and variants that change
the loops, and reads each kernel's PTX through the bundled ptxas.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks", "lab"))
    import torch
    # The stand-in sm_90 driver, the Triton backend and TMA loads as on an H200 (kernel_resources.py).
    from kernel_resources import compiled_kernels, ptxas_report
    from flashtile import flash_attn_func, flash_attn_varlen_func
    os.environ["FLASHTILE_AUTOTUNE"] = "0"  # the default tiles (kernel_resources compiles every candidate)

    def run(headdim, **kwargs):
        q, k, v = (torch.randn(1, 1024, 2, headdim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = flash_attn_func(q, k, v, **kwargs)
        out.backward(torch.randn_like(out))

    run(128, causal=True)
    run(128, causal=False)
    run(64, causal=True)
    run(256, causal=True)  # d > 128: the tiles chosen so that the accumulators leave room for the pipeline
    run(128, causal=True, window_size=(256, 0))
    run(128, causal=False, softcap=30.0)
    cu = torch.tensor([0, 300, 1024], dtype=torch.int32)
    q, k, v = (torch.randn(1024, 2, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, 724, 724, causal=True)
    out.backward(torch.randn_like(out))

    names = ("HEAD_DIM", "LIMIT_LEFT", "LIMIT_RIGHT", "SOFTCAP", "IS_VARLEN")
    for kind, constants, compiled in compiled_kernels():
        if kind == "forward" and constants["HEAD_DIM"] == 64:
            continue  # d=64's default forward tile (128, 128, 4 warps) runs out of registers for it
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx, (kind, "compiled without wgmma")
        report = ptxas_report(ptx)
        assert not report.startswith("?"), (kind, "ptxas failed")
        print(kind, {n: constants.get(n) for n in names},
              "SERIALIZED: " + report.split("WGMMA SERIALIZED (")[1] if "SERIALIZED" in report else "pipelined")
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas is a Linux binary")
def test_wgmma_not_serialized():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("forward", "dK/dV", "dQ"))]
    assert len(lines) >= 10, run.stdout[-3000:]
    assert any(line.startswith("dK/dV") and "'LIMIT_RIGHT': True" in line for line in lines), run.stdout[-3000:]
    serialized = [line for line in lines if "SERIALIZED" in line]
    assert not serialized, "\n".join(serialized)
