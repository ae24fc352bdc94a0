"""Which target's tile lists and switches run on which GPU (configs.TARGETS, configs.target_of), without one.

The GPU is faked at torch's device queries; the compiled kernels of each target are checked in
test_compile_targets.py.
"""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from flashtile.kernels import configs


@pytest.fixture
def gpu(monkeypatch):
    """Fake one CUDA device for configs.target_of: gpu(name, capability) or gpu(name, gfx=arch) for ROCm."""

    def fake(name: str, capability=(0, 0), gfx: str | None = None):
        configs._device_target.cache_clear()
        configs._capability.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index=None: types.SimpleNamespace(gcnArchName=f"{gfx}:sramecc+:xnack-"))
        monkeypatch.setattr(torch.version, "hip", "6.4" if gfx else None)
        return torch.device("cuda", 0)

    yield fake
    configs._device_target.cache_clear()
    configs._capability.cache_clear()


@pytest.mark.parametrize(("capability", "expected"), [((8, 0), "sm80"), ((8, 6), "sm89"), ((8, 7), "sm80"),
                                                      ((8, 9), "sm89"), ((9, 0), "sm90"), ((10, 0), "sm100"),
                                                      ((10, 3), "sm100"), ((12, 0), "sm120"), ((12, 1), "sm120")])
def test_nvidia_gpus_get_their_target(gpu, capability, expected, monkeypatch):
    monkeypatch.delenv("FLASHTILE_TARGET", raising=False)
    assert configs.target_of(gpu("some GPU", capability)).name == expected


@pytest.mark.parametrize(("arch", "expected"), [("gfx942", "gfx942"), ("gfx950", "gfx950")])
def test_amd_gpus_get_their_target(gpu, arch, expected, monkeypatch):
    monkeypatch.delenv("FLASHTILE_TARGET", raising=False)
    target = configs.target_of(gpu("AMD Instinct", gfx=arch))
    assert (target.name, target.warp_size, target.tma) == (expected, 64, False)


@pytest.mark.parametrize(("name", "capability", "gfx", "says"), [
    ("Tesla T4", (7, 5), None, r"8.0 \(Ampere\) or newer; Tesla T4 \(compute capability 7.5\)"),
    ("Tesla V100-SXM2-16GB", (7, 0), None, r"Tesla V100-SXM2-16GB \(compute capability 7.0\)"),
    ("NVIDIA Thor", (11, 0), None, r"no tile lists for NVIDIA Thor \(compute capability 11.0\).*FLASHTILE_TARGET"),
    ("AMD Instinct MI250X", (9, 0), "gfx90a", r"no tile lists for AMD Instinct MI250X \(gfx90a\)"),
    ("AMD Radeon RX 7900 XTX", (11, 0), "gfx1100", r"AMD Radeon RX 7900 XTX \(gfx1100\)"),
])
def test_gpus_without_a_target_are_named_in_the_error(gpu, name, capability, gfx, says, monkeypatch):
    monkeypatch.delenv("FLASHTILE_TARGET", raising=False)
    with pytest.raises(RuntimeError, match=says):
        configs.target_of(gpu(name, capability, gfx))


def test_an_unsupported_gpu_fails_before_any_launch(gpu, monkeypatch):
    """The launchers ask for the target first: a T4 gets its error, not a compile error or a bad launch."""
    from flashtile.kernels import forward
    from flashtile.options import AttentionOptions

    monkeypatch.delenv("FLASHTILE_TARGET", raising=False)
    device = gpu("Tesla T4", (7, 5))
    q = types.SimpleNamespace(device=device)
    launched = []
    monkeypatch.setattr(configs, "launch", lambda *args, **kwargs: launched.append(args))
    with pytest.raises(RuntimeError, match="Tesla T4"):
        forward.attention_forward(q, q, q, AttentionOptions(softmax_scale=1.0))
    assert not launched


def test_forcing_a_target(gpu, monkeypatch):
    h200 = gpu("NVIDIA H200", (9, 0))
    monkeypatch.setenv("FLASHTILE_TARGET", "sm80")  # the Ampere path on a Hopper GPU: TMA off, sm80 lists
    target = configs.target_of(h200)
    assert (target.name, target.tma) == ("sm80", False)
    assert target.fwd is configs.TARGETS["sm80"].fwd
    monkeypatch.setenv("FLASHTILE_TARGET", "sm89")
    assert configs.target_of(h200).name == "sm89"
    monkeypatch.setenv("FLASHTILE_TARGET", "sm3")
    with pytest.raises(ValueError, match="FLASHTILE_TARGET must be one of sm80, sm89, sm90"):
        configs.target_of(h200)


@pytest.mark.parametrize(("forced", "name", "capability", "gfx", "says"), [
    ("sm90", "NVIDIA A100-SXM4-80GB", (8, 0), None, r"sm90 loads through TMA, which NVIDIA A100-SXM4-80GB .* not"),
    ("sm80", "NVIDIA GeForce RTX 4090", (8, 9), None, r"163 KiB .* NVIDIA GeForce RTX 4090 \(compute capability "
                                                      r"8.9\) has 99 KiB"),
    ("gfx942", "NVIDIA H200", (9, 0), None, r"gfx942 is a target for amd GPUs; NVIDIA H200 .* is nvidia"),
    ("sm80", "AMD Instinct MI300X", (9, 4), "gfx942", r"sm80 is a target for nvidia GPUs"),
    ("gfx950", "AMD Instinct MI300X", (9, 4), "gfx942", r"160 KiB .* MI300X \(gfx942\) has 64 KiB"),
], ids=["sm90-on-A100", "sm80-on-RTX4090", "gfx942-on-H200", "sm80-on-MI300X", "gfx950-on-MI300X"])
def test_forcing_a_target_the_gpu_cannot_run_is_an_error(gpu, forced, name, capability, gfx, says, monkeypatch):
    monkeypatch.setenv("FLASHTILE_TARGET", forced)
    with pytest.raises(RuntimeError, match=says):
        configs.target_of(gpu(name, capability, gfx))


def test_forcing_a_target_on_a_gpu_without_one(gpu, monkeypatch):
    """A GPU of a known vendor that no target covers runs a forced target's lists, at the user's risk."""
    monkeypatch.setenv("FLASHTILE_TARGET", "gfx942")
    assert configs.target_of(gpu("AMD Instinct MI250X", (9, 0), "gfx90a")).name == "gfx942"
    monkeypatch.setenv("FLASHTILE_TARGET", "sm120")
    assert configs.target_of(gpu("NVIDIA Thor", (11, 0))).name == "sm120"
    # Too old stays too old.
    with pytest.raises(RuntimeError, match="Tesla T4"):
        configs.target_of(gpu("Tesla T4", (7, 5)))


def test_hopper_keeps_its_lists_and_switches(monkeypatch):
    """sm90 runs the candidate lists, shared-memory budget and TMA it had before there were targets."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the autotuners' lists on a GPU
    hopper = configs.TARGETS["sm90"]
    assert hopper.fwd is configs._FWD_CANDIDATES
    assert hopper.bwd_kv is configs._BWD_KV_CANDIDATES
    assert hopper.bwd_q is configs._BWD_Q_CANDIDATES
    assert (hopper.smem_budget, hopper.tma, hopper.arch) == (configs.SMEM_BUDGET_BYTES, True, 90)
    # Every candidate of every target is in the autotuners' config lists; sm90's come first, in order.
    names = {"fwd": configs._FWD_NAMES, "bwd_kv": configs._BWD_KV_NAMES, "bwd_q": configs._BWD_Q_NAMES}
    for table, kernel_names in names.items():
        full = configs._all_configs(table, kernel_names)
        hopper_entries = list(dict.fromkeys(e for entries in getattr(hopper, table).values() for e in entries))
        assert [configs._matches(c, e, kernel_names) for c, e in zip(full, hopper_entries)] == [True] * len(
            hopper_entries)
        for target in configs.TARGETS.values():
            for entries in getattr(target, table).values():
                for entry in entries:
                    assert any(configs._matches(c, entry, kernel_names) for c in full), (target.name, entry)


@pytest.mark.parametrize("target", list(configs.TARGETS.values()), ids=lambda t: t.name)
def test_target_lists(target):
    """Each list has candidates within the target's stage cap and thread limit, and one that fits the
    target's shared-memory budget at the class's largest head dim (else the prune keeps the smallest)."""
    largest = {"small_d": 64, "mid_d": 128, "large_d": 256, "few_rows": 256}
    largest.update({f"{kind}_{name}": d for kind in ("fp8", "dropout") for name, d in list(largest.items())})
    # (FP8 lists: one byte per element; dropout lists: the calls with dropout, 16-bit)
    for table, smem in (("fwd", configs._fwd_smem), ("bwd_kv", configs._bwd_smem), ("bwd_q", configs._bwd_smem)):
        lists = getattr(target, table)
        assert set(lists) >= {"small_d", "mid_d", "large_d"}
        for dim_class, entries in lists.items():
            assert entries, (table, dim_class)
            for _, _, warps, stages, *maxnreg in entries:
                assert warps * target.warp_size <= 1024, (table, dim_class)
                assert 1 <= stages <= target.max_stages, (table, dim_class)
                assert not (maxnreg and target.vendor == "amd"), "maxnreg is a PTX setting"
            elem = 1 if dim_class.startswith("fp8_") else 2
            fits = [e for e in entries if smem(e[0], e[1], largest[dim_class], e[3]) * elem <= target.smem_budget]
            assert fits, (table, dim_class)
        # The estimate's budget stays below the hardware (on AMD, whose estimate counts about twice the LDS
        # the backend uses, below twice the LDS); compile_check holds the compiled kernels to the limit.
        assert target.smem_budget <= target.smem_limit * (2 if target.vendor == "amd" else 1)


def test_use_tma_follows_the_target(gpu, monkeypatch):
    """TMA is asked for only where the target has it (the tensors' CUDA-ness is faked for the check)."""
    monkeypatch.delenv("FLASHTILE_TMA", raising=False)
    monkeypatch.delenv("FLASHTILE_TARGET", raising=False)
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs.triton, "set_allocator", lambda allocator: None)
    for name, capability, expected in (("NVIDIA H200", (9, 0), True), ("NVIDIA B200", (10, 0), True),
                                       ("NVIDIA A100", (8, 0), False), ("NVIDIA GeForce RTX 5090", (12, 0), False)):
        device = gpu(name, capability)
        tensor = types.SimpleNamespace(is_cuda=True, device=device, element_size=lambda: 2, data_ptr=lambda: 0,
                                       stride=lambda: (4096, 128, 1))
        assert configs.use_tma(tensor, rows=1024) is expected, name


@pytest.mark.parametrize("version", ["3.4.0", "3.2.0+git1a2b3c"])
def test_an_older_triton_is_refused_by_name_and_the_pytorch_path_still_runs(version):
    """The kernels are checked with triton >= 3.5 (compile_check); an older one stops at the kernels' import
    with the versions to install, and CPU tensors keep the PyTorch path (a subprocess: the kernels are
    already imported here)."""
    script = f"""
import torch, triton
triton.__version__ = {version!r}
import flashtile
q = torch.randn(1, 9, 2, 16)
print(float(flashtile.flash_attn_func(q, q, q, causal=True).abs().sum()) > 0)
try:
    import flashtile.kernels
except RuntimeError as exc:
    print(exc)
"""
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "FLASHTILE_BACKEND")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    ran, refused = done.stdout.splitlines()
    assert ran == "True"
    assert f"need triton >= 3.5 (torch >= 2.9 brings it); this is triton {version}" in refused
    assert "FLASHTILE_BACKEND=torch" in refused


def test_an_unknown_forced_target_is_refused_under_the_interpreter_too(monkeypatch):
    """Under TRITON_INTERPRET=1 an unset FLASHTILE_TARGET means sm90; a name that is no target is the GPU's
    ValueError, not a silent sm90."""
    from flashtile.kernels import configs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FLASHTILE_TARGET", raising=False)
    assert configs.target_of(torch.device("cpu")) is configs.TARGETS["sm90"]
    monkeypatch.setenv("FLASHTILE_TARGET", "sm80")
    assert configs.target_of(torch.device("cpu")) is configs.TARGETS["sm80"]
    monkeypatch.setenv("FLASHTILE_TARGET", "sm999")
    with pytest.raises(ValueError, match="FLASHTILE_TARGET must be one of"):
        configs.target_of(torch.device("cpu"))


def test_dropout_calls_start_from_their_own_lists_on_hopper(gpu, monkeypatch):
    """sm90's dK/dV pass with dropout at d = 128 starts from the dropout list's first tile (64 keys, 32 rows, 4 warps,
    3 stages: measured fastest with dropout), without dropout from mid_d's; a target without a dropout list keeps
    its own."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")  # the prune keeps the first survivor only
    monkeypatch.delenv("FLASHTILE_TARGET", raising=False)
    full = configs._all_configs("bwd_kv", configs._BWD_KV_NAMES)
    for name, capability in (("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0))):
        q = types.SimpleNamespace(device=gpu(name, capability), element_size=lambda: 2)
        lists = configs.target_of(q.device).bwd_kv
        for dropout in (True, False):
            kept = configs.bwd_kv_prune(full, {"Q": q, "BLOCK_D": 128}, DROPOUT=dropout)
            expected = lists["dropout_mid_d" if dropout and "dropout_mid_d" in lists else "mid_d"][0]
            assert len(kept) == 1 and configs._matches(kept[0], expected, configs._BWD_KV_NAMES), (name, dropout)
    assert configs.TARGETS["sm90"].bwd_kv["dropout_mid_d"][0] == (64, 32, 4, 3)
    # The forward at d = 128 has its own dropout list too (64 rows, 64 keys, 4 warps, 3 stages first); d = 256's
    # dK/dV (its two launches) and the dQ pass keep their own lists with dropout.
    hopper_q = types.SimpleNamespace(device=gpu("NVIDIA H100 80GB HBM3", (9, 0)), element_size=lambda: 2)
    assert configs.TARGETS["sm90"].fwd["dropout_mid_d"][0] == (64, 64, 4, 3)
    for prune, table, names, block_d, dim_class in (
            (configs.bwd_kv_prune, "bwd_kv", configs._BWD_KV_NAMES, 256, "large_d"),
            (configs.bwd_q_prune, "bwd_q", configs._BWD_Q_NAMES, 128, "mid_d"),
            (configs.fwd_prune, "fwd", configs._FWD_NAMES, 128, "dropout_mid_d")):
        kept = prune(configs._all_configs(table, names), {"Q": hopper_q, "BLOCK_D": block_d}, DROPOUT=True)
        expected = getattr(configs.TARGETS["sm90"], table)[dim_class][0]
        assert len(kept) == 1 and configs._matches(kept[0], expected, names), (table, block_d)
    # With tuning on, the whole dropout list, in its order.
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    kept = configs.bwd_kv_prune(full, {"Q": hopper_q, "BLOCK_D": 128}, DROPOUT=True)
    listed = configs._BWD_KV_CANDIDATES["dropout_mid_d"]
    assert len(kept) == len(listed)
    assert all(configs._matches(c, e, configs._BWD_KV_NAMES) for c, e in zip(kept, listed))


# The A/B switches read once at import (docs/settings.md): the module that reads each, and the values it takes.
_IMPORT_SWITCHES = {"FLASHTILE_FWD_NAMED_SYNC": ("configs", "0, 1"), "FLASHTILE_FWD_TREE_MAX": ("configs", "fp8, 1, 0"),
                    "FLASHTILE_FP8_P_REGISTERS": ("configs", "wait, carry, 0"),
                    "FLASHTILE_FWD_RESCALE_SKIP": ("configs", "0, exact, 1"),
                    "FLASHTILE_FWD_LANE_SUM": ("configs", "0, 1"),
                    "FLASHTILE_FP8_P_WORDS": ("configs", "0, 1"), "FLASHTILE_FWD_P_PAIRS": ("configs", "0, 1"),
                    "FLASHTILE_FP8_EXP2_POLY": ("configs", "0, 1, 2"), "FLASHTILE_FP8_Q_REGISTERS": ("configs", "0, 1"),
                    "FLASHTILE_BWD_MASK_EDGES_ONLY": ("gluon_backward", "0, 1"),
                    "FLASHTILE_BWD_DQ_WAIT_AT_DS": ("gluon_backward", "0, 1"),
                    "FLASHTILE_BWD_NAMED_RELEASE": ("gluon_backward", "0, 1"),
                    "FLASHTILE_BWD_DQ_SEND_LATE": ("gluon_backward", "0, 1"),
                    "FLASHTILE_BWD_TAIL_SPLIT": ("gluon_backward", "0, 1"),
                    "FLASHTILE_BWD_DV_AT": ("gluon_backward", "ds, wait, early"),
                    "FLASHTILE_BWD_DELTA_AHEAD": ("gluon_backward", "0, 1")}


def test_an_import_time_switch_with_a_value_it_does_not_take_is_an_error_naming_it():
    """A typo in an A/B switch (``FLASHTILE_BWD_DQ_SEND_LATE=on``) stops the import with the switch's name and its
    values, instead of reading as off (one subprocess: each switch's module reloaded under the bad value, then again
    without it)."""
    script = f"""
import importlib, os
from flashtile.kernels import configs, gluon_backward
for name, (module, _) in {_IMPORT_SWITCHES!r}.items():
    os.environ[name] = "on"
    try:
        importlib.reload(configs if module == "configs" else gluon_backward)
    except ValueError as exc:
        print(exc)
    else:
        print(name, "took 'on'")
    del os.environ[name]
    importlib.reload(configs if module == "configs" else gluon_backward)
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("FLASHTILE_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(_IMPORT_SWITCHES)
    for (name, (_, choices)), line in zip(_IMPORT_SWITCHES.items(), lines):
        assert line == f"{name} must be one of {choices}, got 'on'", line


def test_kernel_code_reads_switches_through_constexpr_globals():
    """Triton's compile cache keys a kernel by its source and the constexpr globals it and its callees name, not by
    a module attribute a jit or constexpr function reads (``configs.X``): such a read once let the on-disk cache serve
    an A/B switch's kernel of one setting to a process of the other. Decorator arguments
    (the autotuner's configs, on the host) are not kernel code."""
    import ast

    kernels = Path(__file__).resolve().parents[2] / "flashtile" / "kernels"
    reads = []
    for path in sorted(kernels.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not any(
                    word in ast.unparse(d) for d in node.decorator_list for word in ("jit", "constexpr_function")):
                continue
            body = ast.Module(body=node.body, type_ignores=[])
            reads += [f"{path.name}:{sub.lineno} {node.name}: {ast.unparse(sub)}" for sub in ast.walk(body)
                      if isinstance(sub, ast.Attribute) and getattr(sub.value, "id", None) == "configs"]
    assert not reads, reads
