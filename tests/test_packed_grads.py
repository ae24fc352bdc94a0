"""q, k, v that are the slices of one packed tensor (``proj(x).view(b, s, 3, h, d).unbind(2)``, a fused QKV
projection): autograd sees the packed tensor, and the backward writes dq, dk and dv into one packed gradient
(``_ops.packed_base``). The gradients must be the bits of the same call on separate q, k, v; anything else that
asks for the slices' own gradients keeps the ordinary path."""

import pytest
import torch

from flashtile import _ops, flash_attn_func
from tests.utils import stable_seed


def _fused(batch, seqlen, nheads, headdim, dtype, device):
    projection = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=dtype, device=device, requires_grad=True)
    return projection, projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)


def _packed_against_separate(batch, seqlen, nheads, headdim, causal, dtype, device, calls=1):
    torch.manual_seed(stable_seed(batch, seqlen, nheads, headdim, causal, str(dtype)))
    projection, (q, k, v) = _fused(batch, seqlen, nheads, headdim, dtype, device)
    dout = torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, device=device)
    separate = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    for _ in range(calls):  # (later calls replay launch plans on a GPU)
        projection.grad = None
        q, k, v = projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)
        out = flash_attn_func(q, k, v, causal=causal)
        assert type(out.grad_fn).__name__.endswith("PackedAttentionBackward")
        out.backward(dout)
        for t in separate:
            t.grad = None
        out_separate = flash_attn_func(*separate, causal=causal)
        out_separate.backward(dout)
        assert torch.equal(out, out_separate)
        expected = torch.stack([t.grad for t in separate], 2).reshape(projection.shape)
        assert torch.equal(projection.grad, expected)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 70, 3, 40), (1, 33, 2, 64)])
def test_packed_gradient_is_the_separate_calls(shape, causal):
    _packed_against_separate(*shape, causal, torch.float16, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(4, 2048, 16, 128), (8, 1024, 16, 64), (2, 512, 12, 64), (1, 256, 32, 128),
                                   (2, 300, 4, 80)])
def test_packed_gradient_on_the_gpu(shape, causal, dtype):
    """The Triton passes and the Gluon one pass (d = 64 and 128 from their lengths) writing into the packed
    gradient's slices, replayed launch plans included: the bits of separate q, k, v."""
    _packed_against_separate(*shape, causal, dtype, "cuda", calls=3)


def test_other_views_keep_the_ordinary_path():
    batch, seqlen, nheads, headdim = 2, 16, 2, 8
    projection, (q, k, v) = _fused(batch, seqlen, nheads, headdim, torch.float16, "cpu")
    assert _ops.packed_base(q, k, v) is not None
    for order in ((q, k, q), (q, q, v), (k, q, v), (q, v, k), (v, k, q)):  # one slice twice, or out of order
        assert _ops.packed_base(*order) is None
    q.retain_grad()  # its own gradient asked for
    assert _ops.packed_base(q, k, v) is None
    q2, k2, v2 = projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)
    k2.register_hook(lambda grad: grad)
    assert _ops.packed_base(q2, k2, v2) is None
    # split along the last dim (nanoGPT's form): the same layout, packed; a wider base (another part of the
    # projection used elsewhere); a transposed base; separate leaves; no grad
    split = [t.view(batch, seqlen, nheads, headdim) for t in projection.split(nheads * headdim, dim=2)]
    assert _ops.packed_base(*split) is projection
    gqa = torch.randn(batch, seqlen, 4 * headdim, requires_grad=True).split([2 * headdim, headdim, headdim], dim=2)
    assert _ops.packed_base(*(t.view(batch, seqlen, -1, headdim) for t in gqa)) is None
    wider = torch.randn(batch, seqlen, 4 * nheads * headdim, requires_grad=True)
    assert _ops.packed_base(*wider[..., :3 * nheads * headdim].reshape(batch, seqlen, 3, nheads, headdim)
                            .unbind(2)) is None
    transposed = torch.randn(seqlen, batch, 3, nheads, headdim, requires_grad=True).transpose(0, 1)
    assert _ops.packed_base(*transposed.unbind(2)) is None
    # k and v narrower or shorter than q in the same strides (GQA-shaped, seqlen_k < seqlen_q)
    five = projection.view(batch, seqlen, 3, nheads, headdim)
    assert _ops.packed_base(five[:, :, 0], five[:, :, 1, :1], five[:, :, 2, :1]) is None
    assert _ops.packed_base(five[:, :, 0], five[:, :8, 1], five[:, :8, 2]) is None
    # the base's storage swapped (`.data =`) after the slices were made: they hold other elements
    swapped = torch.randn(batch, seqlen, 3, nheads, headdim, requires_grad=True)
    old = swapped.unbind(2)
    swapped.data = torch.randn_like(swapped)
    assert _ops.packed_base(*old) is None
    # a leaf base that stopped requiring grad after the slices were made (they still do)
    frozen = torch.randn(batch, seqlen, 3, nheads, headdim, requires_grad=True)
    frozen_slices = frozen.unbind(2)
    frozen.requires_grad_(False)
    assert _ops.packed_base(*frozen_slices) is None
    # forward-mode AD: a dual tensor is a view of its primal, whose tangent it does not carry
    import torch.autograd.forward_ad as forward_ad
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(projection.detach().requires_grad_(), torch.randn_like(projection))
        assert _ops.packed_base(*dual.view(batch, seqlen, 3, nheads, headdim).unbind(2)) is None
    leaves = [torch.randn(batch, seqlen, nheads, headdim, requires_grad=True) for _ in range(3)]
    assert _ops.packed_base(*leaves) is None
    with torch.no_grad():
        assert _ops.packed_base(*projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)) is None


def test_retained_slice_gradients_are_the_packed_ones():
    """With q.retain_grad() the call keeps the three slices in the graph: their gradients are the packed
    gradient's slices."""
    batch, seqlen, nheads, headdim = 1, 20, 2, 16
    projection, (q, k, v) = _fused(batch, seqlen, nheads, headdim, torch.float16, "cpu")
    q.retain_grad()
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert q.grad is not None
    assert torch.equal(q.grad, projection.grad.view(batch, seqlen, 3, nheads, headdim)[:, :, 0])


class _ScaledView(torch.autograd.Function):
    """A view of its input whose backward scales the gradient (autograd keeps the view's base)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 10


class _TwoOutputs(torch.autograd.Function):
    """Two outputs, the second a view of the first, the second's gradient scaled in the backward."""

    @staticmethod
    def forward(ctx, x):
        first = x.clone()
        return first, first.view_as(first)

    @staticmethod
    def backward(ctx, grad_first, grad_second):
        return (0 if grad_first is None else grad_first) + (0 if grad_second is None else 3 * grad_second)


def test_a_backward_between_the_base_and_the_slices_runs():
    """q, k, v whose base is the projection but whose path to it runs another backward (a Function returning a view of
    its input): the ordinary path, so that backward runs; a linear layer's output (not a leaf) and a packed leaf
    take the packed path."""
    batch, seqlen, nheads, headdim = 1, 16, 2, 8
    projection = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=torch.float16, requires_grad=True)
    q, k, v = _ScaledView.apply(projection.view(batch, seqlen, 3, nheads, headdim)).unbind(2)
    assert q._base is projection and _ops.packed_base(q, k, v) is None
    flash_attn_func(q, k, v).sum().backward()
    separate = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*separate).sum().backward()
    expected = torch.stack([t.grad for t in separate], 2).reshape(projection.shape) * 10
    assert torch.equal(projection.grad, expected)

    # a view of the base that is another output of the node that made the base (its base's output_nr is 0, its own 1)
    _, second = _TwoOutputs.apply(projection)
    assert second._base is not None and _ops.packed_base(*second.view(batch, seqlen, 3, nheads, headdim).unbind(2)) \
        is None

    layer = torch.nn.Linear(8, 3 * nheads * headdim, dtype=torch.float16)
    x = torch.randn(batch, seqlen, 8, dtype=torch.float16)
    slices = layer(x).view(batch, seqlen, 3, nheads, headdim).unbind(2)
    assert _ops.packed_base(*slices) is not None
    qkv = torch.randn(batch, seqlen, 3, nheads, headdim, dtype=torch.float16, requires_grad=True)
    assert _ops.packed_base(*qkv.unbind(2)) is qkv


def _unbound(projection, batch, seqlen, nheads, headdim):
    return projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)


def _split(projection, batch, seqlen, nheads, headdim):  # nanoGPT's form, with flash-attn's BSHD layout
    return [t.view(batch, seqlen, nheads, headdim) for t in projection.split(nheads * headdim, dim=2)]


def _round_trip(projection, batch, seqlen, nheads, headdim):
    """Hugging Face's GPT-2 with flash-attention: split, heads to BHSD, and back to BSHD for the call."""
    return [t.view(batch, seqlen, nheads, headdim).transpose(1, 2).transpose(1, 2)
            for t in projection.chunk(3, dim=-1)]


@pytest.mark.parametrize("form", [_unbound, _split, _round_trip])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_linear_layers_gradients_are_those_of_the_ordinary_path(device, bias, form, monkeypatch):
    """A fused QKV linear layer (with a bias its 3-d output is a view of its 2-d product, without one a tensor of its
    own), sliced as models slice it: the layer's and the input's gradients are the bits of the ordinary path's
    (``FLASHTILE_PACKED_GRADS=0``)."""
    batch, seqlen, nheads, headdim = 2, 48, 2, 32
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 3 * nheads * headdim, bias=bias, dtype=torch.float16, device=device)
    x = torch.randn(batch, seqlen, 64, dtype=torch.float16, device=device, requires_grad=True)
    results = []
    for packed in (True, False):
        monkeypatch.setattr(_ops, "_PACKED_GRADS", packed)
        layer.zero_grad()
        x.grad = None
        q, k, v = form(layer(x), batch, seqlen, nheads, headdim)
        assert (_ops.packed_base(q, k, v) is not None) == packed
        out = flash_attn_func(q, k, v, causal=True)
        assert type(out.grad_fn).__name__.endswith("PackedAttentionBackward") == packed
        out.float().square().sum().backward()
        results.append((out, x.grad, layer.weight.grad, *((layer.bias.grad,) if bias else ())))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_slice_used_elsewhere_adds_its_gradient():
    """A split's output that also feeds something else: its other gradient reaches the projection through the split,
    added to the packed one."""
    batch, seqlen, nheads, headdim = 1, 20, 2, 16
    torch.manual_seed(1)
    projection = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=torch.float16, requires_grad=True)
    parts = projection.split(nheads * headdim, dim=2)
    q, k, v = (t.view(batch, seqlen, nheads, headdim) for t in parts)
    assert _ops.packed_base(q, k, v) is projection
    (flash_attn_func(q, k, v).float().sum() + parts[2].float().square().sum()).backward()
    separate = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*separate).float().sum().backward()
    expected = torch.cat([t.grad.reshape(batch, seqlen, -1) for t in separate], 2)
    expected[..., 2 * nheads * headdim:] += 2 * parts[2].detach()
    assert torch.equal(projection.grad, expected)


def test_a_packed_argument_stays_in_the_graph():
    """flash_attn_qkvpacked_func's qkv is the Function's input itself: its retain_grad, hooks and autograd.grad on it
    work (a view of a projection, and a leaf view of a tensor that needs no gradient), with the packed gradient."""
    from flashtile import flash_attn_qkvpacked_func

    batch, seqlen, nheads, headdim = 2, 24, 2, 16
    projection = torch.randn(batch, seqlen, 3 * nheads * headdim, dtype=torch.float16, requires_grad=True)
    dout = torch.randn(batch, seqlen, nheads, headdim, dtype=torch.float16)
    separate = [t.detach().clone().requires_grad_()
                for t in projection.detach().view(batch, seqlen, 3, nheads, headdim).unbind(2)]
    flash_attn_func(*separate, causal=True).backward(dout)
    expected = torch.stack([t.grad for t in separate], 2)

    qkv = projection.view(batch, seqlen, 3, nheads, headdim)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    assert type(out.grad_fn).__name__.endswith("PackedAttentionBackward")
    (grad,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(grad, expected)
    qkv = projection.view(batch, seqlen, 3, nheads, headdim)
    qkv.retain_grad()
    seen = []
    qkv.register_hook(seen.append)
    flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    assert torch.equal(qkv.grad, expected) and len(seen) == 1
    assert torch.equal(projection.grad, expected.reshape(projection.shape))

    leaf_view = torch.randn(batch * seqlen, 3 * nheads * headdim, dtype=torch.float16).view(
        batch, seqlen, 3, nheads, headdim).requires_grad_()
    out = flash_attn_qkvpacked_func(leaf_view, causal=True)
    assert out.requires_grad
    out.backward(dout)
    assert leaf_view.grad is not None

    with torch.no_grad():
        made_without_grad = projection.view(batch, seqlen, 3, nheads, headdim)
    made_without_grad.requires_grad_()  # (a leaf now: its gradient lands on it, not on the projection)
    projection.grad = None
    flash_attn_func(*made_without_grad.unbind(2), causal=True).backward(dout)
    assert made_without_grad.grad is not None and projection.grad is None


def test_the_backward_keeps_no_slice_alive():
    """What the call keeps for its backward is saved tensors only (freed with the graph, seen by checkpointing's
    and offloading's hooks): after the backward nothing holds the projection."""
    import weakref

    batch, seqlen, nheads, headdim = 1, 16, 2, 16
    weight = torch.randn(8, 3 * nheads * headdim, dtype=torch.float16, requires_grad=True)
    projection = torch.randn(batch, seqlen, 8, dtype=torch.float16) @ weight
    held = weakref.ref(projection)
    q, k, v = projection.view(batch, seqlen, 3, nheads, headdim).unbind(2)
    assert _ops.packed_base(q, k, v) is projection
    loss = flash_attn_func(q, k, v).float().sum()
    del q, k, v, projection
    loss.backward()
    assert held() is None and weight.grad is not None


def test_the_packed_function_under_torch_compile():
    """flash_attn_qkvpacked_func names its qkv for the eager path only: traced whole (fullgraph) it takes the ops, with
    the eager call's gradient."""
    from flashtile import flash_attn_qkvpacked_func

    qkv = torch.randn(1, 32, 3, 2, 16, dtype=torch.float16, requires_grad=True)
    flash_attn_qkvpacked_func(qkv, causal=True).float().sum().backward()
    eager = qkv.grad.clone()
    qkv.grad = None
    compiled = torch.compile(lambda x: flash_attn_qkvpacked_func(x, causal=True), fullgraph=True)
    compiled(qkv).float().sum().backward()
    assert torch.allclose(qkv.grad.float(), eager.float(), atol=2e-3)
