"""The first call's cost: long sequences tune on a capped proxy, candidates compile side by side.

No GPU needed: the proxy test records the launchers' calls instead of launching; the compile test runs
Triton's real compilation for sm_90 under benchmarks/lab/stand_in_hopper.py in a subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashtile.options import AttentionOptions

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def recorded_launches(monkeypatch):
    """Replace the autotuned launches by a recorder of (kernel name, SEQ_BUCKET_Q, SEQ_BUCKET_K, seqlen_q
    argument) and pretend tuning is on, so the launchers' host logic runs without kernels."""
    from flashtile.kernels import configs

    calls = []

    def record(kernel, grid, *args, **kwargs):
        names = kernel.fn.arg_names if hasattr(kernel, "fn") else kernel.arg_names
        named = dict(zip(names, args))
        calls.append((kernel.fn.__name__, named["SEQ_BUCKET_Q"], named["SEQ_BUCKET_K"], named["seqlen_q"]))

    monkeypatch.setattr(configs, "launch", record)
    monkeypatch.setattr(configs, "launch_plain", lambda *args, **kwargs: None)
    monkeypatch.setattr(configs, "autotune_enabled", lambda: True)
    monkeypatch.setattr(configs, "_PROXY_TUNED", set())
    return calls


def test_seqlen_bucket_is_capped():
    from flashtile.kernels import configs

    assert configs.seqlen_bucket(1) == 1
    assert configs.seqlen_bucket(3000) == 4096
    assert configs.seqlen_bucket(configs.TUNE_SEQLEN_CAP) == configs.TUNE_SEQLEN_CAP
    assert configs.seqlen_bucket(configs.TUNE_SEQLEN_CAP + 1) == configs.TUNE_SEQLEN_CAP
    assert configs.seqlen_bucket(2**20) == configs.TUNE_SEQLEN_CAP


@pytest.mark.parametrize("causal", [False, True])
def test_long_first_call_tunes_on_a_capped_proxy(recorded_launches, causal):
    from flashtile.kernels import backward, configs, forward

    cap = configs.TUNE_SEQLEN_CAP
    seqlen = cap + 100
    q, k, v = (torch.randn(1, seqlen, 2, 16, dtype=torch.float16) for _ in range(3))
    opts = AttentionOptions(0.25, causal)
    forward.attention_forward(q, k, v, opts)
    # The proxy's launch (cap queries) comes first, under the same capped key as the long launch.
    assert recorded_launches == [("_attn_fwd", cap, cap, cap), ("_attn_fwd", cap, cap, seqlen)]
    recorded_launches.clear()
    forward.attention_forward(q, k, v, opts)  # once per process and variant
    assert recorded_launches == [("_attn_fwd", cap, cap, seqlen)]

    recorded_launches.clear()
    out, lse = torch.randn_like(q), torch.randn(1, 2, seqlen)
    backward.attention_backward(torch.randn_like(q), q, k, v, out, lse, opts)
    lengths = [(name, seqlen_arg) for name, *_, seqlen_arg in recorded_launches]
    passes = {"_attn_bwd_dq", "_attn_bwd_dkdv"}  # in either order (the dQ pass is on a side stream on a GPU)
    assert {name for name, seqlen_arg in lengths[:2] if seqlen_arg == cap} == passes
    assert {name for name, seqlen_arg in lengths[2:] if seqlen_arg == seqlen} == passes
    assert all(bucket_q == bucket_k == cap for _, bucket_q, bucket_k, _ in recorded_launches)


def test_no_proxy_for_short_or_untuned_calls(recorded_launches, monkeypatch):
    from flashtile.kernels import configs, forward

    q = torch.randn(1, 512, 2, 16, dtype=torch.float16)
    forward.attention_forward(q, q, q, AttentionOptions(0.25))
    assert len(recorded_launches) == 1
    monkeypatch.setattr(configs, "autotune_enabled", lambda: False)
    recorded_launches.clear()
    long = torch.randn(1, configs.TUNE_SEQLEN_CAP + 1, 2, 16, dtype=torch.float16)
    forward.attention_forward(long, long, long, AttentionOptions(0.25))
    assert len(recorded_launches) == 1


COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FLASHTILE_AUTOTUNE"] = "compile"
    os.environ["FLASHTILE_COMPILE_THREADS"] = "2"
    sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks", "lab"))
    import torch
    import stand_in_hopper
    stand_in_hopper.install()
    import flashtile.interface as interface
    from flashtile import flash_attn_func
    from flashtile.kernels import configs

    interface.select_backend = lambda device: "triton"
    compiled_together = []
    real_compile_all = configs._compile_all

    def spy(kernel, args, meta):
        cache = kernel.fn.device_caches[0][0]
        before = len(cache)
        candidates = len(kernel.prune_configs(meta))
        real_compile_all(kernel, args, meta)
        compiled_together.append((candidates, len(cache) - before))

    configs._compile_all = spy
    q = torch.randn(1, 64, 2, 16, dtype=torch.float16)
    flash_attn_func(q, q, q)
    print("RESULT", json.dumps(compiled_together))
    """
)


def test_candidates_compile_together_before_timing(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, str(REPO)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    [[candidates, compiled]] = json.loads(line.split(" ", 1)[1])
    # One tuning: every candidate was compiled by the parallel step, before the first was timed.
    assert candidates > 1 and compiled == candidates


def test_compile_together_holds_launches_then_makes_them_in_order(monkeypatch):
    """``configs.compile_together``: on a key's first run the block's ``launch_plain`` launches are held, compiled
    (``warmup=True``) as one batch, then made in their order; a second run, a nested block and a block that raises
    (its held launches dropped, nothing left held) behave as plain launches. Fake kernels record the calls."""
    from flashtile.kernels import configs

    events = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def run(self, *args, grid, warmup, **kwargs):
            events.append((self.name, "warmup" if warmup else "launch", args))

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "compile_threads", lambda: 2)
    monkeypatch.setattr(configs, "_direct_launch_possible", lambda kernel: False)
    monkeypatch.setattr(configs, "_compile_on_threads", lambda warmups: events.append(("batch", len(warmups))) or [
        warmup() for warmup in warmups])
    monkeypatch.setattr(configs, "_COMPILED_TOGETHER", set())
    a, b = Kernel("a"), Kernel("b")
    with configs.compile_together("key"):
        configs.launch_plain(a, (1,), 1)
        events.append("body")
        with configs.compile_together("inner"):  # nested: the outer block holds it
            configs.launch_plain(b, (1,), 2)
    assert events == ["body", ("batch", 2), ("a", "warmup", (1,)), ("b", "warmup", (2,)), ("a", "launch", (1,)),
                      ("b", "launch", (2,))]
    events.clear()
    with configs.compile_together("key"):  # seen: launches as it goes
        configs.launch_plain(a, (1,), 3)
        events.append("body")
    assert events == [("a", "launch", (3,)), "body"]
    events.clear()
    with pytest.raises(ValueError), configs.compile_together("other"):
        configs.launch_plain(a, (1,), 4)
        raise ValueError("bad input")
    assert events == [] and configs._HELD_LAUNCHES.get() is None and "other" not in configs._COMPILED_TOGETHER
    configs.launch_plain(b, (1,), 5)
    assert events == [("b", "launch", (5,))]


ONE_PASS_FIRST_CALL_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["FLASHTILE_COMPILE_THREADS"] = sys.argv[2]
    import torch
    from flashtile.kernels import stand_in
    stand_in.install("sm90")
    stand_in.Launcher.record = True
    from flashtile.kernels import configs
    from flashtile.kernels import gluon_backward as gb

    import threading
    import triton.runtime.jit as jit
    submitted, compiled = [], []
    real_compile = configs._compile_on_threads
    configs._compile_on_threads = lambda warmups: submitted.append(len(warmups)) or real_compile(warmups)
    real_do_compile = jit.JITFunction._do_compile

    def counted(self, *args, **kwargs):  # every compile of a kernel: its name and whether it ran on the calling thread
        kernel = real_do_compile(self, *args, **kwargs)
        compiled.append((self.__name__, type(kernel).__name__ == "FutureKernel"))
        return kernel

    jit.JITFunction._do_compile = counted
    launchers = []  # each launcher made: its kernel and whether on the calling thread
    real_launcher_init = stand_in.Launcher.__init__

    def made(self, src, metadata):
        real_launcher_init(self, src, metadata)
        launchers.append((self.name, threading.current_thread() is threading.main_thread()))

    stand_in.Launcher.__init__ = made
    torch.manual_seed(0)
    q = torch.randn(1, 300, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 333, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    calls = []
    for _ in range(2):
        start = len(stand_in.Launcher.records)
        gb.gluon_attention_backward(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(1, 4, 300), True,
                                    one_pass="fixed", warp_specialize=True, keys_as_m="fa3")
        calls.append([name for name, _ in stand_in.Launcher.records[start:]])
    print("RESULT", json.dumps({"calls": calls, "submitted": submitted, "compiled": compiled,
                                "launchers": launchers}))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's compilers here are Linux binaries")
def test_one_pass_first_call_compiles_its_kernels_together(tmp_path):
    """The one-pass backward's first call (``configs.compile_together``): its five kernels compiled side by side on
    two threads (each once, handed to the threads as Triton's futures), their launchers built there too
    (``configs._build_launcher``), then launched in the order one thread launches them; the second call launches as
    it goes, compiling nothing."""
    runs = {}
    for threads in ("2", "1"):
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / threads), "PYTHONPATH": str(REPO)}
        env.pop("TRITON_INTERPRET", None)
        done = subprocess.run([sys.executable, "-c", ONE_PASS_FIRST_CALL_SCRIPT, str(REPO), threads],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
        runs[threads] = json.loads(line.split(" ", 1)[1])
    together, alone = runs["2"], runs["1"]
    assert together["submitted"] == [5] and alone["submitted"] == []
    kernels = ["_kv_maxima", "_row_units", "_gluon_bwd_dkdv", "_dq_from_counts", "_dq_where_flagged"]
    assert sorted(together["compiled"]) == sorted([name, True] for name in kernels)  # each once, on the threads
    assert sorted(alone["compiled"]) == sorted([name, False] for name in kernels)
    assert together["calls"][0] == together["calls"][1] == alone["calls"][0] == alone["calls"][1]
    assert together["calls"][0] == kernels
    first_launcher = {}
    for name, on_caller in together["launchers"]:
        first_launcher.setdefault(name, on_caller)
    assert first_launcher == {name: False for name in kernels}  # each kernel's first launcher: on a compile thread
    assert {name for name, _ in alone["launchers"]} == set(kernels) and all(on for _, on in alone["launchers"])


def test_a_proxy_tuning_run_is_not_recorded_into_a_launch_plan(monkeypatch):
    """A call that first tunes on its first tokens (``configs.proxy_tuning_needed``) while a launch plan records
    refuses the recording: the plan would repeat the one-time proxy run on every replay."""
    from types import SimpleNamespace

    from flashtile.kernels import configs, replay

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    monkeypatch.setattr(configs, "_PROXY_TUNED", set())
    long = torch.empty(1, configs.TUNE_SEQLEN_CAP + 1, 2, 64, dtype=torch.float16)
    opts = AttentionOptions(softmax_scale=0.125, causal=True)
    recording = SimpleNamespace(refusal=None)
    monkeypatch.setattr(replay._local, "recording", recording, raising=False)
    monkeypatch.setattr(configs, "_RECORDING_ON", 1)
    assert configs.proxy_tuning_needed("fwd", long, long, opts, long.shape[1], long.shape[1]) is not None
    assert recording.refusal is not None
    recording.refusal = None
    short = long[:, :configs.TUNE_SEQLEN_CAP]
    assert configs.proxy_tuning_needed("fwd", short, short, opts, short.shape[1], short.shape[1]) is None
    assert recording.refusal is None
