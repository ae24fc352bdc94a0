"""The accuracy rule of the incumbent's suite, and input builders."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashtile.reference import attention_ref

# Absolute floors for the rule, per dtype: where out_torch is itself near-exact (tiny shapes, fp32/fp64)
# the 2x bound would otherwise demand bit-exactness from a different but equally exact summation order.
FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3, torch.float32: 1e-5, torch.float64: 1e-12}

try:
    import triton
except ImportError:  # (no Triton off Linux: the PyTorch path only)
    triton = None
# The Gluon kernels and the direct launches are written against triton 3.6's API and internals; with other
# versions flashtile runs the Triton kernels on Triton's own launch path.
needs_triton_36 = pytest.mark.skipif(triton is None or not triton.__version__.startswith("3.6."),
                                     reason="written against triton 3.6 (Gluon, Triton's launch internals)")


def stable_seed(*parts) -> int:
    """A seed from the test's parameters that is the same in every process: Python's hash() of a string
    changes from run to run (PYTHONHASHSEED), which made the inputs, and so the margins, differ per run."""
    return zlib.crc32(repr(parts).encode())


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, device="cpu", requires_grad=True):
    """Fresh random q, k, v in BSHD layout."""
    q = torch.randn(batch, seqlen_q, nheads, headdim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def skip_unless_gluon_dispatch() -> None:
    """Skip a GPU test of the dispatch's Gluon kernels where the dispatch would not take them: another target than
    sm90 (``FLASHTILE_TARGET`` included), no triton 3.6 Gluon, or ``FLASHTILE_GLUON=0`` / ``FLASHTILE_TMA=0``."""
    from flashtile.kernels import configs

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not configs.gluon_available(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("the dispatch takes the Gluon kernels on sm90 with triton 3.6, FLASHTILE_GLUON and TMA on")


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_rule(name: str, got: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor, factor: float):
    """max|got - ref| <= factor * max|torch_out - ref| + floor; NaN never passes."""
    assert not torch.isnan(got).any(), f"{name}: NaN in result"
    err, base = max_err(got, ref), max_err(torch_out, ref)
    bound = factor * base + FLOOR[got.dtype]
    assert err <= bound, f"{name}: max error {err:.3e} > {factor} x {base:.3e} + floor"


def assert_lse_close(lse: torch.Tensor, lse_ref: torch.Tensor, floor: float = 1e-3):
    """lse is -inf exactly where lse_ref is, and elsewhere within ``floor`` plus a few float32 ulp of |lse_ref|.

    The kernels keep lse in float32, so a logsumexp of 1e4 (scores of 1e4) is only held to ~1e-3: a flat
    1e-3 tolerance failed on some CPUs by rounding alone (1.043e-3 in test_large_logits_stay_finite).
    """
    empty_ref = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty_ref), "lse: -inf exactly on rows that see no key"
    if not (~empty_ref).any():
        return
    got, want = lse[~empty_ref].double(), lse_ref[~empty_ref].double()
    bound = floor + 8 * torch.finfo(torch.float32).eps * want.abs()
    excess = ((got - want).abs() - bound).max().item()
    assert excess <= 0, f"lse: max error {(got - want).abs().max().item():.3e} beyond {floor} + 8 ulp of |lse|"


def check_against_oracle(fn, q, k, v, causal, softmax_scale=None, grads=True, oracle_dtype=torch.float64,
                         **variant):
    """Run fn(q, k, v) -> (out, lse) and check out, lse and gradients with the 2x / 3x rule.

    The oracle runs in ``oracle_dtype`` from the same inputs; ``out_torch`` is the same naive attention
    in the input dtype. ``variant`` (window_size, softcap, alibi_slopes) goes to the oracle.
    """
    out, lse = fn(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32

    leaves = [x.detach().to(oracle_dtype).requires_grad_(grads) for x in (q, k, v)]
    out_ref, lse_ref = attention_ref(*leaves, softmax_scale=softmax_scale, causal=causal, **variant)
    plain = [x.detach().clone().requires_grad_(grads) for x in (q, k, v)]
    out_pt, _ = attention_ref(*plain, softmax_scale=softmax_scale, causal=causal, **variant)

    assert_rule("out", out, out_ref, out_pt, 2.0)
    assert_lse_close(lse, lse_ref)

    if not grads:
        return
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(out_ref, leaves, dout.to(oracle_dtype))
    base = torch.autograd.grad(out_pt, plain, dout)
    for name, g, r, b in zip(("dq", "dk", "dv"), got, want, base):
        assert g.shape == r.shape
        assert_rule(name, g, r, b, 3.0)


def attention_grads_by_rows(q, k, v, dout, causal, dtype, rows=1024):
    """Naive attention and its gradients computed ``rows`` query rows at a time, in ``dtype``: for lengths whose
    full score matrix does not fit (a test oracle for long sequences; one (rows, seqlen_k) matrix per head at a
    time). out and dq of each block of rows are exactly the naive attention's (rows are independent); dk and dv
    sum the blocks' shares in float64, so in 16-bit ``dtype`` they round once per block, where the full matrix
    product rounds once. Causal is bottom-right aligned. Returns out, dq, dk, dv in ``dtype``."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    keys, values = (x.detach().to(dtype).requires_grad_() for x in (k, v))
    outs, dqs = [], []
    dk, dv = (torch.zeros_like(x, dtype=torch.float64) for x in (k, v))
    for start in range(0, seqlen_q, rows):
        stop = min(start + rows, seqlen_q)
        block = q[:, start:stop].detach().to(dtype).requires_grad_()
        mask = None
        if causal:
            # key j is visible to query row i when j <= i + seqlen_k - seqlen_q
            rows_at = torch.arange(start, stop, device=q.device)[:, None] + seqlen_k - seqlen_q
            mask = torch.arange(seqlen_k, device=q.device)[None, :] <= rows_at
        out = _masked_attention(block, keys, values, mask)
        grads = torch.autograd.grad(out, (block, keys, values), dout[:, start:stop].to(dtype))
        outs.append(out.detach())
        dqs.append(grads[0])
        dk += grads[1].double()
        dv += grads[2].double()
    return torch.cat(outs, 1), torch.cat(dqs, 1), dk.to(dtype), dv.to(dtype)


def _masked_attention(q, k, v, mask):
    """attention_ref's arithmetic for one block of query rows; mask (rows, seqlen_k) bool of visible keys."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v)


def varlen_oracle(q, k, v, cu_q, cu_k, dtype=torch.float64, **kwargs):
    """Per-sequence naive attention over packed tensors: out (total_q, h, d), lse (h, total_q)."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    alibi = kwargs.pop("alibi_slopes", None)
    for b in range(len(bq) - 1):
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        o, lse = attention_ref(q[None, bq[b]:bq[b + 1]], k[None, bk[b]:bk[b + 1]], v[None, bk[b]:bk[b + 1]],
                               compute_dtype=dtype, alibi_slopes=slopes, **kwargs)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def random_cu_seqlens(lengths, device="cpu"):
    """int32 cumulative lengths (batch + 1,) from a list of per-sequence lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def covering(cycled, *axes, ids=None) -> list:
    """Every combination of ``cycled`` and ``axes`` as pytest params, values in that order. For each
    combination of ``axes`` one case runs in every run, with the value of ``cycled`` taken in turn, so that
    each value of ``cycled`` meets every value of the first axis and every combination of the other axes
    (once each when ``cycled`` has as many values as the other axes have combinations); the other cases
    are marked ``slow``: a GPU run has them all, a run without one with ``--slow``."""
    rest = list(itertools.product(*axes[1:]))
    params = []
    for i, first in enumerate(axes[0]):
        for j, others in enumerate(rest):
            for c, value in enumerate(cycled):
                values = (value, first, *others)
                marks = () if c == (i + j) % len(cycled) else (pytest.mark.slow,)
                params.append(pytest.param(*values, marks=marks, id=ids(*values) if ids else None))
    return params


REPO = Path(__file__).resolve().parents[1]

# The start of a script run under the stand-in H200 driver (benchmarks/lab/stand_in_hopper.py: Triton's
# real binding and sm_90 compilation, each launch recorded in ``Launcher.records`` instead of made), with
# CPU tensors sent to the Triton backend and fixed tiles.
STAND_IN_PREAMBLE = textwrap.dedent(
    """
    import os, sys, warnings
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FLASHTILE_AUTOTUNE"] = "0"
    sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks", "lab"))
    import torch
    import stand_in_hopper
    stand_in_hopper.install(record=True)
    import flashtile.inference as inference
    import flashtile.interface as interface
    from flashtile.kernels import configs

    interface.select_backend = lambda device: "triton"
    inference.select_backend = lambda device: "triton"
    Launcher = stand_in_hopper.Launcher

    def launched_directly(records):
        # Direct launches and replays pass no launch-hook chain; Triton's own path passes objects (even empty).
        return [all(x is None for x in args[6:9]) for _, args in records]

    def refuse_direct_launches():
        # From now on the launcher raises on a direct launch (or a replay), as one that refuses them would.
        record = Launcher.__call__
        def refuse(self, *args):
            if launched_directly([(None, args)])[0]:
                raise RuntimeError("refused")
            record(self, *args)
        Launcher.__call__ = refuse
    """
)


def run_stand_in_script(body: str, timeout: int, unset: tuple[str, ...] = ()) -> None:
    """Run ``STAND_IN_PREAMBLE`` + ``body`` in a subprocess (the stand-in driver is process-wide) with this
    checkout first on the path and ``TRITON_INTERPRET`` and ``unset`` removed; it must print "ok" last."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and k not in unset}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", STAND_IN_PREAMBLE + textwrap.dedent(body), str(REPO)], env=env,
                            capture_output=True, text=True, timeout=timeout)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), output


def run_without_triton(body: str, timeout: int = 300) -> str:
    """Run ``body`` in a subprocess where ``import triton`` fails, as on an install without it (flashtile does
    not require it; CPU calls must not import it); it must exit 0. Returns its stdout."""
    code = "import sys; sys.modules['triton'] = None\n" + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# Compile-only runs of the Gluon sm90 kernels without a GPU: the preamble skips (a {"skip": reason} report)
# where this machine's toolchain or Triton cannot build them, installs the stand-in sm90 driver, and defines
# ``kernel_record(kernel, ptx_counts=None, **fields)``: the latest compiled kernel's ptxas resources and wgmma facts
# (and, for each ``{field: text}`` of ptx_counts, the text's count in its PTX).
GLUON_SM90_PREAMBLE = """
import json, sys
from flashtile.kernels.compile_check import toolchain_problem
problem = toolchain_problem("sm90")
try:
    import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
except ImportError as exc:
    problem = problem or f"no Gluon Hopper module in this Triton: {exc}"
if problem:
    print(json.dumps({"skip": problem}))
    sys.exit(0)
import torch
from flashtile.kernels import stand_in
from flashtile.kernels.compile_check import keep_ptxas_logs, resources
stand_in.install("sm90")
keep_ptxas_logs()


def kernel_record(kernel, ptx_counts=None, **fields):
    # ptx_counts: {field: text}, each text's count in the PTX as that field
    compiled = list(kernel.device_caches[0][0].values())[-1]
    res = resources(compiled)
    counts = {name: compiled.asm["ptx"].count(text) for name, text in (ptx_counts or {}).items()}
    return {**fields, **counts, "registers": res.registers, "spills": res.spill_bytes, "shared": res.shared_bytes,
            "ptx": compiled.asm["ptx"].count("wgmma.mma_async"),
            "serialized": "wgmma.mma_async instructions are serialized" in (compiled.metadata.ptxas_log or ""),
            "target": compiled.metadata.target.arch}
"""


def gluon_sm90_report(body: str, cache_dir: Path, timeout: int = 300) -> dict:
    """``GLUON_SM90_PREAMBLE`` + ``body`` (which prints one JSON report last) in a subprocess with this checkout
    first on the path and a Triton cache of its own (a kernel compiled earlier without keep_ptxas_logs' hook
    would come back without its ptxas log); the report, or a skip where the toolchain cannot build sm90."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", GLUON_SM90_PREAMBLE + textwrap.dedent(body)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    return report



def projection_step(batch: int, seqlen: int, nheads: int, headdim: int, device: str = "cuda"):
    """(x, weight, step) of a model's attention step: q, k, v views of one bf16 projection ``x @ weight`` of
    width 3 * nheads * headdim, causal flash_attn_func, a scalar loss; ``step(x, weight)``. Inputs drawn
    from the current seed; weight requires grad."""
    from flashtile import flash_attn_func

    x = torch.randn(batch, seqlen, 192, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(192, 3 * nheads * headdim, device=device, dtype=torch.bfloat16) * 0.05).requires_grad_()

    def step(x, weight):
        q, k, v = (x @ weight).view(batch, seqlen, 3, nheads, headdim).unbind(2)
        return flash_attn_func(q, k, v, causal=True).float().square().mean()

    return x, weight, step


class FillsMade(TorchDispatchMode):
    """Under it, ``fills`` lists (op, result shape) of every op run that zeroes or fills a tensor (``zeros``,
    ``zero_``, ``fill_``...): what autograd makes for a gradient it materializes."""

    def __init__(self):
        super().__init__()
        self.fills = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if "zero" in str(func) or "fill" in str(func):
            self.fills.append((str(func), tuple(result.shape) if isinstance(result, torch.Tensor) else None))
        return result
