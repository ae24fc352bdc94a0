"""Test setup: without a GPU the Triton kernels run in the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any Triton kernel module is imported; flashtile imports its kernels
lazily, so setting it here (conftest is imported first) is enough.
"""

import os

# Under pytest-xdist on a host of several GPUs, FLASHTILE_TEST_GPUS=N places worker i on GPU i % N (set
# before torch first looks for devices), so a many-GPU machine runs the kernel suite N times as wide.
if os.environ.get("FLASHTILE_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _worker = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    os.environ["CUDA_VISIBLE_DEVICES"] = str(_worker % int(os.environ["FLASHTILE_TEST_GPUS"]))

# pytest-xdist workers share the machine's cores: each takes its share of CPU threads (children such as the
# distributed tests' processes inherit it). With two workers of two threads each on the two-core CI
# machine (another process busy too), a small training step took 6 s; with one thread each, 0.4 s.
_threads = None
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis draws the same examples on every run ("derandomize": seeded from each test's name, no example
# database replaying earlier failures), so the suite passes or fails the same way on every machine and
# every run. FLASHTILE_HYPOTHESIS_PROFILE=explore draws fresh random examples (and keeps failing ones).
settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("FLASHTILE_HYPOTHESIS_PROFILE", "deterministic"))

# tests/compat holds the flash_attn alias and the runner of flash-attn's own test file: tools, not tests here
# (tests/test_compat_alias.py tests them).
collect_ignore = ["compat"]

if _threads is not None:
    torch.set_num_threads(_threads)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One tile configuration per kernel (the default) keeps the suites' compile time down; the autotuned
# path has its own test in tests/kernels/test_gpu.py.
os.environ.setdefault("FLASHTILE_AUTOTUNE", "0")
# Tests that autotune do so with many workers on one GPU: their timings say nothing, so their choices are
# not stored where a later benchmark on the same machine would find them.
os.environ.setdefault("FLASHTILE_AUTOTUNE_CACHE", "0")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="without a GPU, also run the long sweeps marked slow (a GPU run always has them)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
    # The long sweeps: every combination of their axes. Without a GPU they run in Triton's interpreter or
    # at the PyTorch path's speed, so a plain run keeps the cases that cover each axis (tests.utils.covering)
    # and --slow adds the rest.
    if not config.getoption("--slow"):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.fixture(autouse=True)
def _no_launch_plans_from_earlier_tests():
    """Each test starts without launch plans: a plan that an earlier test in the same worker recorded for the
    same key would replay past a test's patch of a kernel entry point (one did, on the GPU)."""
    from flashtile import _ops, inference

    for plans in (_ops._PLANS, _ops._FAMILIES, _ops._OP_PLANS, inference._DECODE_PLANS):
        plans.clear()


@pytest.fixture
def poison(monkeypatch):
    """Make torch.empty / empty_like return NaN-filled floats and integers of -1 (0x5A unsigned), so an unwritten
    output element, or an accumulator a kernel was meant to zero, shows."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def _fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif not t.is_complex() and t.dtype != torch.bool:
            t.fill_(-1 if t.is_signed() else 0x5A)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: _fill(real_empty_like(*a, **kw)))
    yield


@pytest.fixture
def backend(monkeypatch):
    """Select a backend by name for one test through FLASHTILE_BACKEND."""

    def use(name: str):
        monkeypatch.setenv("FLASHTILE_BACKEND", name)

    return use
