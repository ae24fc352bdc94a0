"""pytest plugin for running flash-attn's test file against flashtile (load with ``-p flashtile_sample``).

- Deselects the groups of cases that test flash-attn internals rather than its API (``DESELECTED``; the
  reasons are printed and listed in docs/compatibility.md); ``--keep-groups`` runs them anyway.
- ``--sample N --sample-seed S``: of the remaining cases, keep a seeded random N (the same N cases for the
  same seed and collection); ``--shard I/K`` then keeps the I-th of K interleaved parts of those, so a run
  can be split over several commands.
- Prints passed / failed / skipped counts per test function at the end.
- ``--cpu-as-cuda`` (collection and reference checks on a machine without a GPU): tensors asked for on
  "cuda" are made on the CPU, and the device queries the file makes at import answer as an H200 would.
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter

import pytest

# group name -> (test functions, condition on the case's parameters, reason)
DESELECTED = {
    "dropout_s_dmask": (
        {"test_flash_attn_qkvpacked", "test_flash_attn_varlen_qkvpacked", "test_flash_attn_output",
         "test_flash_attn_varlen_output"},
        lambda params: params.get("dropout_p", 0.0) > 0.0,
        "dropout_p > 0 cases decode S_dmask in flash-attn's private layout (probabilities scaled by running "
        "maxima per CUDA key tile); flashtile returns the probabilities themselves, and no S_dmask for varlen",
    ),
    "private_entry_points": (
        {"test_flash_attn_varlen_paged_kv_num_splits", "test_flash_attn_generator_arg_must_be_none"},
        lambda params: True,
        "call flash-attn's compiled extension or its private _flash_attn_varlen_forward(seqused_k=...)",
    ),
    "runtime_error_type": (
        {"test_flash_attn_kvcache_paged_block_table_bounds"},
        lambda params: True,
        "expects RuntimeError (flash-attn's TORCH_CHECK) mentioning block_table; flashtile refuses the same "
        "call before any launch with a ValueError naming cache_seqlens and the capacity",
    ),
}


def pytest_addoption(parser):
    group = parser.getgroup("flashtile_sample", "flash-attn's suite against flashtile")
    group.addoption("--sample", type=int, default=0, help="keep a seeded random sample of N cases (0: all)")
    group.addoption("--sample-seed", type=int, default=0, help="seed of --sample")
    group.addoption("--shard", default="1/1", help="I/K: keep the I-th (1-based) of K interleaved parts")
    group.addoption("--keep-groups", action="store_true", help="run the DESELECTED groups too")
    group.addoption("--cpu-as-cuda", action="store_true", help="make 'cuda' tensors on the CPU (no GPU here)")


def _group_of(item) -> str | None:
    name = getattr(item, "originalname", item.name)
    params = item.callspec.params if hasattr(item, "callspec") else {}
    for group, (functions, condition, _reason) in DESELECTED.items():
        if name in functions and condition(params):
            return group
    return None


def pytest_configure(config):
    config._flashtile_groups = Counter()
    if config.getoption("--cpu-as-cuda"):
        _pretend_cuda()


@pytest.hookimpl(trylast=True)  # after -k / -m / --deselect: the sample is drawn from what they leave
def pytest_collection_modifyitems(session, config, items):
    deselected = []
    kept = []
    for item in items:
        group = None if config.getoption("--keep-groups") else _group_of(item)
        if group is None:
            kept.append(item)
        else:
            config._flashtile_groups[group] += 1
            deselected.append(item)
    config._flashtile_collected = len(items)
    count = config.getoption("--sample")
    if 0 < count < len(kept):
        chosen = set(random.Random(config.getoption("--sample-seed")).sample(range(len(kept)), count))
        deselected += [item for i, item in enumerate(kept) if i not in chosen]
        kept = [item for i, item in enumerate(kept) if i in chosen]
    index, parts = (int(x) for x in config.getoption("--shard").split("/"))
    if not 1 <= index <= parts:
        raise pytest.UsageError(f"--shard must be I/K with 1 <= I <= K, got {index}/{parts}")
    if parts > 1:
        deselected += [item for i, item in enumerate(kept) if i % parts != index - 1]
        kept = [item for i, item in enumerate(kept) if i % parts == index - 1]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    write = terminalreporter.write_line
    write("")
    write(f"flashtile: {getattr(config, '_flashtile_collected', 0)} cases selected (after -k, -m, --deselect)")
    for group, count in sorted(config._flashtile_groups.items()):
        write(f"  deselected {count:6d}  {group}: {DESELECTED[group][2]}")
    per_test: dict[str, Counter] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") not in ("call", "setup") and outcome != "error":
                continue
            name = report.nodeid.split("::")[-1].split("[")[0]
            per_test.setdefault(name, Counter())[outcome] += 1
    totals = Counter()
    for name in sorted(per_test):
        counts = per_test[name]
        totals.update(counts)
        write(f"  {name:45s} passed {counts['passed']:5d}  failed {counts['failed']:5d}  "
              f"skipped {counts['skipped']:5d}  error {counts['error']:3d}")
    write(f"flashtile: passed {totals['passed']}, failed {totals['failed']}, skipped {totals['skipped']}, "
          f"errors {totals['error']}")


# --------------------------------------------------------------------------------------------------
# --cpu-as-cuda: collection and reference checks without a GPU
# --------------------------------------------------------------------------------------------------


def _pretend_cuda():
    import torch
    from torch.overrides import TorchFunctionMode

    class _H200Properties:
        name = "NVIDIA H200 (pretended on CPU)"
        total_memory = 141 * 2**30
        major, minor = 9, 0
        multi_processor_count = 132

    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: _H200Properties()
    os.environ.setdefault("FLASHTILE_BACKEND", "torch")

    def on_cpu(device):
        return "cpu" if device is not None and torch.device(device).type == "cuda" else device

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = on_cpu(kwargs["device"])
            if func in (torch.Tensor.to, torch.Tensor.cuda) and len(args) > 1 and isinstance(args[1], (str,
                                                                                                        torch.device)):
                args = (args[0], on_cpu(args[1]), *args[2:])
            if func is torch.Tensor.cuda:
                return args[0]
            return func(*args, **kwargs)

    global _CUDA_ON_CPU
    _CUDA_ON_CPU = CudaOnCpu()


_CUDA_ON_CPU = None  # the TorchFunctionMode of --cpu-as-cuda, entered around each test


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # Several pytest-xdist workers share one GPU: each hands its cached blocks back after every case, or
    # the allocators' caches together starve the next large case (the file has caches of 131,072 tokens).
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if _CUDA_ON_CPU is None:
        return (yield)
    with _CUDA_ON_CPU:
        return (yield)
