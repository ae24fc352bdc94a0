"""The public API: argument checks (clear errors before any launch), backends, empty inputs."""

import math
import os

import numpy as np
import pytest
import torch

import flashtile
from flashtile import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, select_backend


def _qkv(b=1, sq=8, sk=8, h=2, hk=2, d=16, dtype=torch.float32):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


BAD_CALLS = [
    # (description, call, exception, words the message must contain)
    ("q not a tensor", lambda q, k, v: flash_attn_func(q.tolist(), k, v), TypeError, "q"),
    ("q rank 3", lambda q, k, v: flash_attn_func(q[0], k, v), ValueError, "q must have 4 dimensions"),
    ("k rank 5", lambda q, k, v: flash_attn_func(q, k[None], v), ValueError, "k must have 4 dimensions"),
    ("batch mismatch", lambda q, k, v: flash_attn_func(q.expand(2, -1, -1, -1), k, v), ValueError, "batch"),
    ("k/v seqlen", lambda q, k, v: flash_attn_func(q, k, v[:, :5]), ValueError, "seqlen_k"),
    ("k/v heads", lambda q, k, v: flash_attn_func(q, k, v[:, :, :1]), ValueError, "nheads_k"),
    ("headdim mismatch", lambda q, k, v: flash_attn_func(q, k[..., :8], v), ValueError, "headdim"),
    ("heads not multiple", lambda q, k, v: flash_attn_func(torch.randn(1, 8, 3, 16), k, v), ValueError,
     "multiple of nheads_k"),
    ("headdim too big", lambda q, k, v: flash_attn_func(*_qkv(d=264)), ValueError, "headdim"),
    ("dtype mismatch", lambda q, k, v: flash_attn_func(q, k.double(), v), TypeError, "k has dtype"),
    ("int dtype", lambda q, k, v: flash_attn_func(q.int(), k.int(), v.int()), TypeError, "q has dtype"),
    ("non-contiguous last dim", lambda q, k, v: flash_attn_func(q.transpose(-1, -2).contiguous().transpose(-1, -2),
                                                                 k, v), ValueError, "contiguous last dimension"),
    ("negative scale", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("zero scale", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=0.0), ValueError, "softmax_scale"),
    ("nan scale", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=math.nan), ValueError, "softmax_scale"),
    ("string scale", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale="1"), TypeError, "softmax_scale"),
    # float32 would hold these as 0 or inf (the kernels take the scale as float32).
    ("scale below float32", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=1e-50), ValueError,
     "softmax_scale"),
    ("scale above float32", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=1e39), ValueError,
     "softmax_scale"),
    # (float32 holds it, but not times log2(e), which the kernels multiply it by)
    ("scale times log2(e) above float32", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=3e38), ValueError,
     "softmax_scale"),
    ("dropout out of range", lambda q, k, v: flash_attn_func(q, k, v, dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout bool", lambda q, k, v: flash_attn_func(q, k, v, dropout_p=True), ValueError, "dropout_p"),
    ("window of 3", lambda q, k, v: flash_attn_func(q, k, v, window_size=(1, 2, 3)), ValueError, "window_size"),
    ("window floats", lambda q, k, v: flash_attn_func(q, k, v, window_size=(1.0, 2)), ValueError, "window_size"),
    ("window bools", lambda q, k, v: flash_attn_func(q, k, v, window_size=(True, False)), ValueError, "window_size"),
    ("window float tensor", lambda q, k, v: flash_attn_func(q, k, v, window_size=torch.tensor([1.0, 2.0])),
     ValueError, "window_size"),
    ("window bool tensor", lambda q, k, v: flash_attn_func(q, k, v, window_size=torch.tensor([True, False])),
     ValueError, "window_size"),
    ("window tensor of 3", lambda q, k, v: flash_attn_func(q, k, v, window_size=torch.tensor([1, 2, 3])),
     ValueError, "window_size"),
    ("window 2-D tensor", lambda q, k, v: flash_attn_func(q, k, v, window_size=torch.tensor([[1, 2]])),
     ValueError, "window_size"),
    ("window string", lambda q, k, v: flash_attn_func(q, k, v, window_size="-1,-1"), ValueError, "window_size"),
    ("nan softcap", lambda q, k, v: flash_attn_func(q, k, v, softcap=math.nan), ValueError, "softcap"),
    ("softcap below float32", lambda q, k, v: flash_attn_func(q, k, v, softcap=1e-45), ValueError, "softcap"),
    ("softcap beyond float32 arithmetic", lambda q, k, v: flash_attn_func(q, k, v, softcap=3e38), ValueError,
     "too large for float32 arithmetic"),
    ("alibi float64", lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.float64)),
     TypeError, "alibi_slopes must be float32"),
    ("alibi shape", lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=torch.ones(3)), ValueError,
     "alibi_slopes must have shape"),
    ("alibi list", lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=[1.0, 1.0]), TypeError, "alibi_slopes"),
    ("causal not bool", lambda q, k, v: flash_attn_func(q, k, v, causal="yes"), TypeError, "causal"),
    ("causal int", lambda q, k, v: flash_attn_func(q, k, v, causal=1), TypeError, "causal"),
    ("scale numpy bool", lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=np.bool_(True)), TypeError,
     "softmax_scale"),
    ("softcap numpy bool", lambda q, k, v: flash_attn_func(q, k, v, softcap=np.bool_(True)), ValueError, "softcap"),
    ("dropout numpy above 1", lambda q, k, v: flash_attn_func(q, k, v, dropout_p=np.float32(1.5)), ValueError,
     "dropout_p"),
    ("qkv rank", lambda q, k, v: flash_attn_qkvpacked_func(q), ValueError, "qkv"),
    ("qkv not 3", lambda q, k, v: flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 2, 16)), ValueError, "qkv"),
    ("kv not 2", lambda q, k, v: flash_attn_kvpacked_func(q, torch.randn(1, 8, 3, 2, 16)), ValueError, "kv"),
    ("kv not tensor", lambda q, k, v: flash_attn_kvpacked_func(q, None), TypeError, "kv"),
    ("backward lse elsewhere", lambda q, k, v: flashtile.flash_attn_backward(
        q, q, k, v, q, torch.zeros(1, 2, 8, device="meta")), ValueError, "lse is on meta, expected cpu"),
    ("paged dropout not a number", lambda q, k, v: flashtile.flash_attn_varlen_func(
        q[0], k.view(2, 4, 2, 16), v.view(2, 4, 2, 16), torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([0, 8], dtype=torch.int32), 8, 8, dropout_p="x",
        block_table=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, "dropout_p must be a float"),
    ("merge to an int dtype", lambda q, k, v: flashtile.merge_attention_states(
        q, torch.zeros(1, 2, 8), q, torch.zeros(1, 2, 8), out_dtype=torch.int32), TypeError, "out_dtype"),
    ("merge to a string dtype", lambda q, k, v: flashtile.merge_attention_states(
        q, torch.zeros(1, 2, 8), q, torch.zeros(1, 2, 8), out_dtype="float16"), TypeError, "out_dtype"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_clear_error(call, exc, words, monkeypatch):
    launched = []
    monkeypatch.setattr(flashtile._ops, "run_forward", lambda *a, **kw: launched.append(a))
    q, k, v = _qkv()
    snapshot = [x.clone() for x in (q, k, v)]
    with pytest.raises(exc, match=words.replace("(", r"\(")):
        call(q, k, v)
    assert not launched, "no kernel may run for an invalid call"
    for before, after in zip(snapshot, (q, k, v)):
        assert torch.equal(before, after)


def test_fp32_rejected_by_triton_backend(backend):
    backend("triton")
    q, k, v = _qkv()
    if not (q.is_cuda or __import__("os").environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("Triton cannot run CPU tensors without the interpreter")
    with pytest.raises(TypeError, match="triton backend supports float16, bfloat16"):
        flash_attn_func(q, k, v)


def test_backend_selection(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("FLASHTILE_BACKEND", raising=False)
    assert select_backend(torch.device("cpu")) == "torch"
    assert select_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    assert select_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="FLASHTILE_BACKEND=triton"):
        select_backend(torch.device("cpu"))
    monkeypatch.setenv("FLASHTILE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FLASHTILE_BACKEND"):
        select_backend(torch.device("cpu"))


def test_defaults_and_return_values():
    q, k, v = _qkv(dtype=torch.float64)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True)
    assert torch.equal(out, out2) and probs is None and lse.dtype == torch.float32 and lse.shape == (1, 2, 8)
    scaled = flash_attn_func(q, k, v, softmax_scale=16**-0.5)
    torch.testing.assert_close(out, scaled)


def test_backward_gets_no_zero_tensor_for_lse():
    """lse is not differentiable: autograd must not make a zero gradient for it on every backward (an allocation
    and a fill kernel on a GPU), dense and packed, with lse returned or not; gradients unchanged."""
    from tests.utils import FillsMade

    q, k, v = (torch.randn(2, 37, 3, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 30, 74], dtype=torch.int32)
    packed = [x.detach().reshape(74, 3, 16).requires_grad_() for x in (q, k, v)]
    for call, inputs in ((lambda *t: flash_attn_func(*t, causal=True, return_attn_probs=True)[:2], (q, k, v)),
                         (lambda *t: (flash_attn_func(*t), None), (q, k, v)),
                         (lambda *t: flashtile.flash_attn_varlen_func(*t, cu, cu, 44, 44, return_attn_probs=True)[:2],
                          packed)):
        out, lse = call(*inputs)
        lse_shape = tuple(lse.shape) if lse is not None else (2, 3, 37)
        with FillsMade() as made:
            grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        assert lse_shape not in [shape for _, shape in made.fills], made.fills
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_backward_through_an_undefined_output_gradient():
    """A function after the attention that gives its input no gradient: the attention's backward gets None for out
    (nothing materialized) and gives q, k, v none; q's gradient from elsewhere still arrives."""
    class Cut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    q, k, v = (torch.randn(1, 9, 2, 8, requires_grad=True) for _ in range(3))
    (Cut.apply(flash_attn_func(q, k, v, causal=True)).sum() + 2 * q.sum()).backward()
    assert k.grad is None and v.grad is None and torch.equal(q.grad, torch.full_like(q, 2.0))


def test_empty_inputs():
    q, k, v = _qkv(b=0)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (0, 2, 8)
    q, k, v = (x.requires_grad_() for x in _qkv(sk=0))
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_rows_that_see_no_key():
    """seqlen_q > seqlen_k with causal: the first rows see nothing (out 0, lse -inf, zero gradient)."""
    q, k, v = (x.requires_grad_() for x in _qkv(sq=6, sk=2, dtype=torch.float64))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
    out.sum().backward()
    assert torch.equal(q.grad[:, :4], torch.zeros_like(q.grad[:, :4]))


@pytest.mark.parametrize("given", [torch.tensor(7), torch.tensor([7], dtype=torch.int32), np.int64(7)],
                         ids=["0-d tensor", "1-element int32 tensor", "numpy int"])
def test_max_seqlen_taken_as_flash_attn_takes_it(given):
    """flash-attn's int arguments take anything with ``__index__`` (its schema converts them): so do
    max_seqlen_q and max_seqlen_k here, with the result of the int."""
    from flashtile import flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func

    q = torch.randn(10, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    want = flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, causal=True)
    assert torch.equal(flash_attn_varlen_func(q, q, q, cu, cu, given, given, causal=True), want)
    qkv = torch.stack([q, q, q], dim=1)
    assert torch.equal(flash_attn_varlen_qkvpacked_func(qkv, cu, given, causal=True), want)


def test_cu_seqlens_values_checked_once_per_tensor(monkeypatch):
    """cu_seqlens values are read and checked on a tensor's first call, and again after an in-place
    write (its version changes); calls in between trust the record. A write that bypasses the version
    counter (.data, dist.broadcast) is caught one call late; FLASHTILE_VALUE_CHECKS=0 reads nothing."""
    from flashtile import flash_attn_varlen_func, interface

    checks, reads = [], []
    real_check, real_read = interface._check_cu_seqlens, interface._ValueRead

    def counting_check(name, cu, total, max_seqlen, max_name, device, values=None, read=True, **kw):
        if values is not None:
            checks.append(name)
        return real_check(name, cu, total, max_seqlen, max_name, device, values, read, **kw)

    def counting_read(tensors):
        reads.append(len(tensors))
        return real_read(tensors)

    monkeypatch.setattr(interface, "_REREAD_INTERVAL_S", 0.0)  # a re-read on every trusted call
    monkeypatch.setattr(interface, "_check_cu_seqlens", counting_check)
    monkeypatch.setattr(interface, "_ValueRead", counting_read)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q = torch.randn(10, 2, 16)
    flash_attn_varlen_func(q, q, q, cu, cu, 7, 7)
    assert checks == ["cu_seqlens_q"] and reads == [1]  # one tensor for q and k: one read, one check
    for _ in range(2):
        flash_attn_varlen_func(q, q, q, cu, cu, 7, 7)
    assert checks == ["cu_seqlens_q"] and len(reads) > 1  # trusted; re-reads started, not waited for
    other = cu.clone()
    flash_attn_varlen_func(q, q, q, cu, other, 7, 7)
    assert checks == ["cu_seqlens_q", "cu_seqlens_k"]  # a new tensor is checked
    checks.clear()
    flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    flash_attn_varlen_func(q, q, q, cu, cu, 7, 8)
    assert not checks  # any max_seqlen from the longest sequence (7) up passes the record
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 8)  # a smaller one is checked, and fails
    with pytest.raises(ValueError, match="max_seqlen_k must be >= 0, got -1"):
        flash_attn_varlen_func(q, q, q, cu, cu, 7, -1)
    with pytest.raises(TypeError, match="max_seqlen_q must be a Python int"):
        flash_attn_varlen_func(q, q, q, cu, cu, 7.0, 7)
    with pytest.raises(TypeError, match="max_seqlen_q must be a Python int"):
        flash_attn_varlen_func(q, q, q, cu, cu, torch.tensor(7.0), 7)
    with torch.inference_mode():  # inference tensors have no version counter: checked every call
        cu_inference = torch.tensor([0, 3, 10], dtype=torch.int32)
        checks.clear()
        for _ in range(2):
            flash_attn_varlen_func(q, q, q, cu_inference, cu_inference, 7, 7)
        assert checks == ["cu_seqlens_q"] * 2
        cu_inference[2] = 11
        with pytest.raises(ValueError, match="must be at most"):
            flash_attn_varlen_func(q, q, q, cu_inference, cu_inference, 7, 7)
    cu[2] = 11  # an in-place write bumps the version: checked again, before any computation
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must be at most"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    cu[2] = 10
    flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)  # trusted: starts a re-read
    cu.data[1] = 5  # bypasses the version counter, still valid: the re-read sees it, the record follows
    flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    assert interface._CHECKED_CU_SEQLENS[cu].values == [0, 5, 10]
    cu.data[1] = 11  # bypasses the version counter, invalid: caught one call late
    flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    with pytest.raises(ValueError, match="without PyTorch seeing it"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    with pytest.raises(ValueError, match="non-decreasing"):  # and from then on checked before use
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
    monkeypatch.setenv("FLASHTILE_VALUE_CHECKS", "0")
    cu.data[1] = 3
    checks.clear()
    reads.clear()
    flash_attn_varlen_func(q, q, q, cu, cu.clone(), 7, 7)
    assert not checks and not reads


@pytest.mark.parametrize("window", [[3, 0], (np.int64(3), np.int64(0)), np.array([3, 0]), torch.tensor([3, 0]),
                                    torch.tensor([3, 0], dtype=torch.int32), (np.int32(3), 0)],
                         ids=["list", "numpy ints", "numpy array", "int64 tensor", "int32 tensor", "mixed"])
def test_window_size_of_two_ints_in_any_form(window):
    """flash-attn converts window_size to two ints: its own suite draws it with torch.randint (a tensor)."""
    q, k, v = _qkv(sq=10, sk=12, dtype=torch.float64)
    assert torch.equal(flash_attn_func(q, k, v, window_size=window), flash_attn_func(q, k, v, window_size=(3, 0)))


def test_numpy_scalars_as_options():
    """numpy scalars where flash-attn takes Python numbers: the same result as the plain values."""
    q, k, v = (x.requires_grad_() for x in _qkv(dtype=torch.float64))
    plain = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, softcap=5.0, dropout_p=0.0)
    scalars = flash_attn_func(q, k, v, softmax_scale=np.float64(0.3), causal=np.bool_(True), softcap=np.float32(5.0),
                              dropout_p=np.float64(0.0))
    assert torch.equal(plain, scalars)
    assert torch.equal(flash_attn_func(q, k, v, causal=np.bool_(False)), flash_attn_func(q, k, v))
    dq, = torch.autograd.grad(scalars.sum(), q)
    assert torch.isfinite(dq).all()


def test_paged_varlen_runs_forward_when_inputs_require_grad():
    """flash-attn runs the paged forward for q, k, v that require grad (its suite does so); only a backward
    through the output is an error."""
    from flashtile import flash_attn_varlen_func

    q = torch.randn(6, 2, 16, dtype=torch.float64)
    pool = torch.randn(3, 4, 2, 16, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    want = flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 4, 7, causal=True, block_table=table)
    leaves = [x.clone().requires_grad_() for x in (q, pool)]
    out, lse, _ = flash_attn_varlen_func(leaves[0], leaves[1], leaves[1], cu_q, cu_k, 4, 7, causal=True,
                                         block_table=table, return_attn_probs=True)
    assert torch.equal(out, want) and out.requires_grad and not lse.requires_grad
    with pytest.raises(NotImplementedError, match="forward only"):
        out.sum().backward()
    with torch.no_grad():
        assert not flash_attn_varlen_func(leaves[0], leaves[1], leaves[1], cu_q, cu_k, 4, 7,
                                          block_table=table).requires_grad


def test_negative_window_bounds_and_softcap_are_off_as_in_flash_attn():
    """flash-attn takes any negative window bound as unbounded and a softcap <= 0 as off; so does flashtile."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 16) for _ in range(3))
    want = flash_attn_func(q, k, v, window_size=(-1, 0))
    for window in ((-2, 0), (-7, 0), np.array([-3, 0]), torch.tensor([-5, 0])):
        assert torch.equal(flash_attn_func(q, k, v, window_size=window), want)
    assert torch.equal(flash_attn_func(q, k, v, softcap=-1.0), flash_attn_func(q, k, v))


def test_flash_attn_interface_module_path_gives_the_public_functions():
    """``from flash_attn.flash_attn_interface import ...`` keeps working with the package name replaced."""
    from flashtile import flash_attn_interface

    for name in flash_attn_interface.__all__:
        assert getattr(flash_attn_interface, name) is getattr(flashtile, name), name


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_varlen_cu_seqlens_covering_part_of_the_rows(name, backend):
    """cu_seqlens may name only some of the packed rows (flash-attn reads only those: a preallocated key buffer,
    queries padded to a fixed count): the call equals the one on the rows covered; the other rows come out 0
    with lse -inf and get zero gradients."""
    if name == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
    backend(name)
    device = "cuda" if name == "triton" and torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if name == "triton" else torch.float64
    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, 2, 16, dtype=dtype, device=device, requires_grad=True) for rows in (9, 16, 16))
    dout = torch.randn(9, 2, 16, dtype=dtype, device=device)
    cu_q = torch.tensor([1, 3, 6], dtype=torch.int32, device=device)
    cu_k = torch.tensor([2, 5, 9], dtype=torch.int32, device=device)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    parts = [x.detach()[a:b].requires_grad_() for x, (a, b) in zip((q, k, v), ((1, 6), (2, 9), (2, 9)))]
    want, want_lse, _ = flashtile.flash_attn_varlen_func(*parts, cu_q - 1, cu_k - 2, 3, 4, causal=True,
                                                         return_attn_probs=True)
    want_grads = torch.autograd.grad(want, parts, dout[1:6])
    assert torch.equal(out[1:6], want) and torch.equal(lse[:, 1:6], want_lse)
    assert not out[0].any() and not out[6:].any() and (lse[:, [0, 6, 7, 8]] == -math.inf).all()
    for grad, part, (a, b) in zip(grads, want_grads, ((1, 6), (2, 9), (2, 9))):
        assert torch.equal(grad[a:b], part) and not grad[:a].any() and not grad[b:].any()


class _FakeCudaGenerator:
    def __init__(self, seed):
        self.seed, self.offset = seed, 0

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        assert offset % 4 == 0, "the CUDA generator takes multiples of 4"
        self.offset = offset


def test_dropout_seed_of_cuda_inputs_comes_from_the_cuda_generator(monkeypatch):
    """Eager CUDA calls take the seed from the device's CUDA generator (seed and offset; the offset advanced by
    one philox step), leaving the CPU generator alone; other devices draw from the CPU generator. A fake
    generator stands in for the GPU here (tests/kernels/test_gpu_reliability.py has the real one)."""
    from flashtile import interface

    generators = (_FakeCudaGenerator(7), _FakeCudaGenerator(7), _FakeCudaGenerator(8))
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    cpu_state = torch.get_rng_state()
    seeds = [interface._dropout_seed(torch.device("cuda", 0)) for _ in range(3)]
    assert generators[0].offset == 12 and torch.equal(torch.get_rng_state(), cpu_state)
    assert len(set(seeds)) == 3 and all(0 <= s < 2**62 for s in seeds)
    assert interface._dropout_seed(torch.device("cuda", 1)) == seeds[0]  # the same seed and offset
    assert interface._dropout_seed(torch.device("cuda", 2)) != seeds[0]
    interface._dropout_seed(torch.device("cpu"))
    assert not torch.equal(torch.get_rng_state(), cpu_state)


def test_paged_varlen_reads_only_the_differences_of_cu_seqlens_k():
    """flash-attn's paged kernel places keys by the block table and reads cu_seqlens_k's differences only, so a
    sub-batch's slice of it (not starting at 0) is a valid call, with the same result as the shifted one."""
    from flashtile import flash_attn_varlen_func

    torch.manual_seed(0)
    q = torch.randn(6, 2, 16, dtype=torch.float64)
    pool = torch.randn(3, 4, 2, 16, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    want = flash_attn_varlen_func(q, pool, pool, cu_q, torch.tensor([0, 5, 12], dtype=torch.int32), 4, 7,
                                  causal=True, block_table=table)
    got = flash_attn_varlen_func(q, pool, pool, cu_q, torch.tensor([100, 105, 112], dtype=torch.int32), 4, 7,
                                 causal=True, block_table=table)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        flash_attn_varlen_func(q, pool, pool, cu_q, torch.tensor([100, 105, 104], dtype=torch.int32), 4, 7,
                               block_table=table)


def test_forward_mode_transforms_raise_instead_of_dropping_the_tangent():
    """torch.func.jvp / jacfwd through the custom op would return zero tangents (the op has a backward only):
    flashtile raises, as eager forward-mode AD does; vmap still runs."""
    from flashtile import flash_attn_varlen_func

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda x: flash_attn_func(x, k, v), (q,), (torch.ones_like(q),))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jacfwd(lambda x: flash_attn_varlen_func(x, k[0], v[0], cu, cu, 5, 5))(q[0])
    batched = torch.func.vmap(lambda x: flash_attn_func(x, k, v))(q.unsqueeze(0).expand(3, -1, -1, -1, -1))
    assert torch.allclose(batched[1], flash_attn_func(q, k, v))


def test_varlen_max_seqlen_past_the_packed_rows_is_taken_as_the_rows():
    """A generous max_seqlen (flash-attn allows any bound at least the longest) gives the same result; the grid
    covers no more than the packed rows (2**36 was a "programs exceed one launch" error)."""
    from flashtile import flash_attn_varlen_func

    torch.manual_seed(0)
    q, k, v = (torch.randn(24, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    want = flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True)
    assert torch.equal(flash_attn_varlen_func(q, k, v, cu, cu, 2**36, 2**36, causal=True), want)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_nan_score_keeps_its_rows_lse_nan(kernels, backend):
    """A NaN key makes the rows that see it NaN, their lse too (it was -inf, "saw no key", which a backward then
    read as a row of zero probabilities, and a split decoding call combined away: a NaN output with a finite
    lse); rows that do not see it stay finite."""
    import os

    if kernels == "triton":
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and no interpreter")
        backend("triton")
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 1, 16, dtype=torch.float16, device=device) for _ in range(3))
    k[0, 2] = float("nan")
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.isfinite(lse[0, 0, :2]).all() and lse[0, 0, 2:].isnan().all()
    assert torch.isfinite(out[0, :2]).all() and out[0, 2:].isnan().all()
    from flashtile import flash_attn_with_kvcache

    q = torch.randn(1, 1, 2, 16, dtype=torch.float16, device=device)
    k_cache, v_cache = (torch.randn(1, 300, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
    k_cache[0, 5, 0] = float("nan")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=300, num_splits=3, return_softmax_lse=True)
    assert out[0, 0, 0].isnan().all() and lse[0, 0].isnan() and torch.isfinite(lse[0, 1])
