"""torch.compile and torch.library: flashtile traces as custom ops with fake twins and autograd."""

import math

import pytest
import torch

import flashtile._ops as ops
from flashtile import flash_attn_func, flash_attn_varlen_func
from tests.utils import random_cu_seqlens


@pytest.fixture(autouse=True)
def _torch_backend(backend):
    backend("torch")


def _forward_args(q, k, v, causal=True, sink=None, backend="torch"):
    return (q, k, v, None, None, 0, 0, q.shape[-1] ** -0.5, causal, -1, -1, 0.0, None, sink, None, 0.0, None, backend)


def test_opcheck_forward_op():
    q, k, v = (torch.randn(2, 9, 2, 16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(ops.attention_forward_op, _forward_args(q, k, v))
    sink = torch.randn(2, requires_grad=True)
    torch.library.opcheck(ops.attention_forward_op, _forward_args(q, k, v, sink=sink))
    dropout = _forward_args(q, k, v)[:15] + (0.2, torch.tensor([12345]), "torch")
    torch.library.opcheck(ops.dropout_forward_op, dropout)


def test_opcheck_backward_op():
    q, k, v, dout = (torch.randn(1, 7, 2, 8) for _ in range(4))
    out, lse = ops.attention_forward_op(*_forward_args(q, k, v))
    args = (dout, q, k, v, out, lse, None, None, 0, 0, 8**-0.5, True, -1, -1, 0.0, None, None, None, 0.0, None, "torch")
    torch.library.opcheck(ops.attention_backward_op, args)


class TinyAttention(torch.nn.Module):
    """Dense then packed attention, as a model would call them."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, cu_seqlens, max_seqlen):
        batch, seqlen, _ = x.shape
        h = self.proj(x).view(batch, seqlen, 2, 8)
        dense = flash_attn_func(h, h, h, causal=True)
        packed = h.reshape(batch * seqlen, 2, 8)
        varlen = flash_attn_varlen_func(packed, packed, packed, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                        causal=True)
        return dense.sum() + varlen.sum()


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    model = TinyAttention()
    x = torch.randn(2, 12, 16)
    cu = random_cu_seqlens([5, 7, 12])
    eager_loss = model(x, cu, 12)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(x, cu, 12)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


def test_compile_dynamic_seqlen_does_not_recompile():
    torch._dynamo.reset()

    def step(q):
        return flash_attn_func(q, q, q, causal=True).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    compiled(torch.randn(1, 33, 2, 8))
    with torch.compiler.set_stance("fail_on_recompile"):
        for seqlen in (40, 57, 128):
            compiled(torch.randn(1, seqlen, 2, 8))


def test_compile_through_triton_kernels(backend):
    """The same custom op with the Triton backend (interpreter on CPU), forward and backward."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and no interpreter")
    backend("triton")
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 40, 2, 16, dtype=torch.float16, device=device, requires_grad=True)

    def step(q):
        return flash_attn_func(q, q, q, causal=True).float().square().sum()

    eager = torch.autograd.grad(step(q), q)[0]
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(q), q)[0]
    torch.testing.assert_close(compiled, eager)


def test_eager_calls_skip_the_custom_op_and_match_it(monkeypatch):
    """Plain eager calls run the ops' forward and backward without their dispatch (host time); under a
    torch-function mode the ops run. Outputs and gradients (sink included) are the same bits."""
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    op_calls = []
    original = ops.attention_forward_op
    monkeypatch.setattr(ops, "attention_forward_op", lambda *a: op_calls.append(1) or original(*a))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 37, 4, 32, requires_grad=True) for _ in range(3))
    sink = torch.randn(4, requires_grad=True)
    dout = torch.randn(2, 37, 4, 32)

    def run():
        out = flash_attn_func(q, k, v, causal=True, sink=sink)
        return (out, *torch.autograd.grad(out, (q, k, v, sink), dout))

    eager = run()
    assert op_calls == []
    with Passthrough():
        through_op = run()
    assert op_calls == [1]
    for a, b in zip(eager, through_op):
        assert torch.equal(a, b)


def test_eager_path_guards_like_the_ops():
    """No silent double backward, in-place changes of saved index tensors caught, jit.trace works."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 17, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True).sum(), (q,), create_graph=True)

    cu = torch.tensor([0, 7, 17], dtype=torch.int32)
    packed = [x.detach()[0].requires_grad_(True) for x in (q, k, v)]
    out = flash_attn_varlen_func(*packed, cu, cu, 10, 10, causal=True)
    cu[1] = 5  # e.g. a buffer reused for the next micro-batch before this one's backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()

    traced = torch.jit.trace(lambda a, b, c: flash_attn_func(a, b, c, causal=True), (q, k, v), check_trace=False)
    torch.testing.assert_close(traced(q, k, v), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_compile_kvcache_decoding_step(kernels, backend):
    """flash_attn_with_kvcache traces as one custom op that appends in place: a compiled decoding step writes
    the caches and returns the eager step's bits (tensor and int cache_seqlens, the lse)."""
    import os

    from flashtile import flash_attn_with_kvcache

    if kernels == "triton":
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no GPU and no interpreter")
        backend("triton")
    torch._dynamo.reset()
    dtype = torch.float16 if kernels == "triton" else torch.float32
    # (the kernels on the GPU where there is one; the interpreter's CPU tensors otherwise)
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 1, 4, 16, dtype=dtype, device=device)
    new_k, new_v = (torch.randn(2, 1, 2, 16, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device=device)

    def step(q, k_cache, v_cache, new_k, new_v, seqlens):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=seqlens, causal=True,
                                           return_softmax_lse=True)
        return out, lse, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10)

    caches = [torch.randn(2, 12, 2, 16, dtype=dtype, device=device) for _ in range(2)]
    eager_caches = [c.clone() for c in caches]
    want = step(q, *eager_caches, new_k, new_v, seqlens)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches, new_k, new_v, seqlens)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(caches, eager_caches):
        assert torch.equal(a, b) and torch.equal(a[1, 9], (new_k if a is caches[0] else new_v)[1, 0])


def test_opcheck_kvcache_op():
    from flashtile.inference import _kvcache_op

    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    new = torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    args = (q, k_cache, v_cache, new, new, None, None, seqlens, None, None, None, None, None, True, -1, 0, 0.0, True,
            None, 0, None, None, None, None)
    torch.library.opcheck(_kvcache_op, args)


def test_kvcache_op_bumps_the_caches_versions_without_binding_every_argument(monkeypatch):
    """The decoding op's own ADInplaceOrView kernel (inference._fast_version_bump): a call bumps k_cache's and
    v_cache's version counters as custom_op's kernel would, without torch._library.utils.fill_defaults (which
    costs ~200 µs per call of the op's 24 arguments), positional or by keyword."""
    import torch._library.utils as library_utils

    bindings = []
    fill_defaults = library_utils.fill_defaults
    monkeypatch.setattr(library_utils, "fill_defaults", lambda *a: bindings.append(1) or fill_defaults(*a))
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    new = torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    rest = (None, None, seqlens, None, None, None, None, None, True, -1, 0, 0.0, True, None, 0, None, None, None, None)
    versions = k_cache._version, v_cache._version
    torch.ops.flashtile.kvcache_attention(q, k_cache, v_cache, new, new, *rest)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    versions = k_cache._version, v_cache._version
    torch.ops.flashtile.kvcache_attention(q, k=new, v=new, k_cache=k_cache, v_cache=v_cache, rotary_cos=None,
                                          rotary_sin=None, cache_seqlens=seqlens, cache_seqlens_int=None,
                                          cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                          softmax_scale=None, causal=True, window_left=-1, window_right=0,
                                          softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                          q_descale=None, k_descale=None, v_descale=None, out_dtype=None)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    assert not bindings


def test_kvcache_op_path_checks_arguments_as_eager():
    """A call that takes the custom op (here under a torch-function mode) refuses what the eager call refuses,
    with its messages, instead of coercing it."""
    from flashtile import flash_attn_with_kvcache

    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    for kwargs, exc, words in (({"causal": 1}, TypeError, "causal must be a bool"),
                               ({"window_size": (2.7, 0)}, ValueError, "window_size"),
                               ({"softcap": math.nan}, ValueError, "softcap")):
        with pytest.raises(exc, match=words):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, **kwargs)
        with torch.device("cpu"), pytest.raises(exc, match=words):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, **kwargs)


def test_varlen_compiles_with_dynamic_shapes_and_runs_on_meta_and_fake_tensors():
    """flash_attn_varlen_func in one graph under dynamic=True (its launch-plan key, which Dynamo cannot guard
    on, is not built while compiling), and on meta or fake tensors (shapes only: cu_seqlens' values are not
    read there), as flash_attn_func."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = (torch.randn(24, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)

    def call(q, k, v, cu):
        return flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=True)
    torch.testing.assert_close(compiled(q, k, v, cu), call(q, k, v, cu))
    meta = torch.empty(9, 4, 16, dtype=torch.bfloat16, device="meta")
    out = flash_attn_varlen_func(meta, meta, meta, torch.empty(3, dtype=torch.int32, device="meta"),
                                 torch.empty(3, dtype=torch.int32, device="meta"), 5, 5)
    assert out.shape == (9, 4, 16) and out.is_meta
    with FakeTensorMode():
        fake = torch.empty(9, 4, 16, dtype=torch.bfloat16)
        bounds = torch.tensor([0, 4, 9], dtype=torch.int32)
        assert flash_attn_varlen_func(fake, fake, fake, bounds, bounds, 5, 5).shape == (9, 4, 16)


def test_tensor_window_size_under_compile_is_refused_by_name():
    """A tensor window_size works eagerly (read on the host, as flash-attn reads it) but cannot choose a compiled
    graph's masking: under torch.compile the error names it (was a guard error on a data-dependent value)."""
    torch._dynamo.reset()
    q = torch.randn(2, 9, 2, 8)
    window = torch.tensor([3, 1])
    assert flash_attn_func(q, q, q, window_size=window).shape == q.shape
    compiled = torch.compile(lambda q, w: flash_attn_func(q, q, q, window_size=w), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="window_size must be two Python ints under torch.compile"):
        compiled(q, window)


def _dropout_grad_errors(compiled_step, q, k, v, weights, p, calls=2):
    """Max |compiled grads - grads of the mask read off the output| per call (V the identity over the keys)."""
    errors = []
    for _ in range(calls):
        out = compiled_step(q, k, v)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        keep = (out != 0).transpose(1, 2)
        qr, kr, vr = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        probs = (qr @ kr.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
        ref = (torch.where(keep, probs, 0.0) / (1 - p)) @ vr
        ref_grads = torch.autograd.grad((ref.transpose(1, 2) * weights).sum(), (qr, kr, vr))
        errors.append(max((a - b.transpose(1, 2)).abs().max().item() for a, b in zip(grads, ref_grads)))
    return errors


@pytest.mark.parametrize("budget", [0.5, 0.0])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_dropout_under_a_memory_budget_keeps_the_forwards_mask(fullgraph, budget):
    """With ``activation_memory_budget`` below 1 the partitioner may recompute the graph's random ops for the
    backward: the seed is then drawn outside the graph (a graph break), so the backward still drops what the
    forward dropped; fullgraph=True, which cannot break the graph, is refused by name."""
    import torch._functorch.config

    torch._dynamo.reset()
    p, seqlen = 0.3, 16
    q, k = (torch.randn(2, seqlen, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.eye(seqlen, dtype=torch.float64).view(1, seqlen, 1, seqlen).repeat(2, 1, 2, 1).requires_grad_()
    weights = torch.randn(2, seqlen, 2, seqlen, dtype=torch.float64)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, dropout_p=p), fullgraph=fullgraph,
                             backend="aot_eager")
    with torch._functorch.config.patch(activation_memory_budget=budget):
        if fullgraph:
            with pytest.raises(Exception, match="activation_memory_budget"):
                compiled(q, k, v)
        else:
            assert max(_dropout_grad_errors(compiled, q, k, v, weights, p)) < 1e-12
    torch._dynamo.reset()


def test_dropout_calls_take_the_ops_cuda_graphs_leave_out():
    """A dropout call's seed is a host number a CUDA graph would replay: compiled, it takes the ops tagged
    cudagraph_unsafe (Inductor runs them between its CUDA graphs); calls without dropout keep the plain ops."""
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    if unsafe is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    assert unsafe in torch.ops.flashtile.attention_forward_dropout.default.tags
    assert unsafe in torch.ops.flashtile.attention_backward_dropout.default.tags
    assert unsafe not in torch.ops.flashtile.attention_forward.default.tags
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    q = torch.randn(1, 8, 2, 16)
    for dropout_p in (0.0, 0.2):
        torch.compile(lambda q, p=dropout_p: flash_attn_func(q, q, q, dropout_p=p), backend=backend)(q)
    assert "flashtile.attention_forward.default" in seen and "flashtile.attention_forward_dropout.default" in seen
    torch._dynamo.reset()


def test_dropout_compiles_without_graph_breaks_and_the_backward_drops_what_the_forward_dropped():
    """Dropout under torch.compile (its default, not fullgraph): the seed is drawn in the graph as a host tensor
    that the op reads (``.item()`` broke the graph at every call), each call draws a new mask, and the backward
    rebuilds the forward's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    batch, seqlen, nheads, p = 2, 16, 2, 0.3
    q, k = (torch.randn(batch, seqlen, nheads, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    # V the identity over the keys: the output is P itself, dropped entries zero, so the mask can be read off it.
    v = torch.eye(seqlen, dtype=torch.float64).view(1, seqlen, 1, seqlen).repeat(batch, 1, nheads, 1)
    v.requires_grad_()
    weights = torch.randn(batch, seqlen, nheads, seqlen, dtype=torch.float64)

    def step(q, k, v):
        out = flash_attn_func(q, k, v, dropout_p=p, causal=True)
        return out, (out * weights).sum()

    compiled = torch.compile(step, backend="aot_eager")
    outs = []
    for _ in range(2):
        out, loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
        keep = (out != 0).transpose(1, 2)  # (batch, nheads, seqlen_q, seqlen_k)
        qr, kr, vr = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        scores = qr @ kr.transpose(-1, -2) / 4.0
        scores = scores.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), -math.inf)
        ref = (torch.where(keep, scores.softmax(-1), 0.0) / (1 - p)) @ vr
        ref_grads = torch.autograd.grad((ref.transpose(1, 2) * weights).sum(), (qr, kr, vr))
        torch.testing.assert_close(out, ref.transpose(1, 2).detach())
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want.transpose(1, 2))
        assert 0.1 < 1 - keep[scores.isfinite()].float().mean() < 0.5  # about p of the entries dropped
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])
    assert not counters["graph_break"], dict(counters["graph_break"])
