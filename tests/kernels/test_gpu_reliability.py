"""GPU reliability (skipped without CUDA): > 2**31 elements, repeated-run determinism, CUDA graphs."""

import pytest
import torch

from flashtile import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tests.utils import make_qkv, projection_step, random_cu_seqlens

pytestmark = pytest.mark.gpu


def test_gpu_huge_tensor_sampled_rows():
    """q of 2,097,152 x 16 x 128 = 4.3e9 elements: 64-bit offsets; sampled rows against the oracle."""
    seqlen, nheads, headdim = 2_097_152, 16, 128
    q, k, v = make_qkv(1, seqlen, seqlen, nheads, nheads, headdim, torch.bfloat16, "cuda", requires_grad=False)
    out = flash_attn_func(q, k, v, causal=True)
    for row in (0, 5, 1_048_575, 1_048_577, seqlen - 1):  # rows past 2**31 / (16 * 128) use 64-bit offsets
        for head in (0, nheads - 1):
            scores = (k[0, : row + 1, head].float() @ q[0, row, head].float()) * headdim**-0.5
            want = torch.softmax(scores, 0) @ v[0, : row + 1, head].float()
            err = (out[0, row, head].float() - want).abs().max().item()
            assert err < 2e-2, f"row {row} head {head}: {err}"


def _grads(q, k, v, dout, **kw):
    out = flash_attn_func(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("backward", ["dispatch", "two-passes"])
def test_gpu_deterministic_50_runs(backward, monkeypatch):
    """50 forward+backward runs give the same bits: the backward the dispatch takes (on sm90 the Gluon one pass),
    and the Triton two passes, whose dQ pass this size forks onto the side stream."""
    from flashtile import _ops
    from flashtile.kernels import backward as triton_backward
    from flashtile.kernels import configs

    assert 2 * 16 * 2048 * 2048 * 128 > triton_backward.SIDE_STREAM_MIN_WORK
    if backward == "two-passes":
        monkeypatch.setitem(configs.GLUON_BACKWARD_MIN_SEQLEN, (128, True), 1 << 62)
        try:
            from flashtile.kernels import gluon_backward
        except ImportError:  # a Triton without Gluon: the two passes are the only backward
            pass
        else:
            monkeypatch.setattr(gluon_backward, "gluon_attention_backward", None)  # the one pass taken: TypeError
        # Launch plans of their own: plans recorded under the other dispatch (same key) would replay its launches
        monkeypatch.setattr(_ops, "_PLANS", {})
        monkeypatch.setattr(_ops, "_FAMILIES", {})
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 2048, 2048, 16, 4, 128, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    first = _grads(q, k, v, dout, causal=True)
    for _ in range(49):
        for a, b in zip(first, _grads(q, k, v, dout, causal=True)):
            assert torch.equal(a, b)


def test_gpu_stress_250_runs_odd_shapes():
    torch.manual_seed(1)
    shapes = [(3, 113, 203, 6, 2, 59), (1, 1023, 1024, 4, 1, 111), (2, 17, 1, 4, 4, 40), (1, 777, 333, 8, 8, 96)]
    cases = []
    for b, sq, sk, h, hk, d in shapes:
        q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.float16, "cuda")
        cases.append((q, k, v, torch.randn_like(q)))
    firsts = [_grads(q, k, v, dout, causal=True) for q, k, v, dout in cases]
    for run in range(250):
        q, k, v, dout = cases[run % len(cases)]
        for a, b in zip(firsts[run % len(cases)], _grads(q, k, v, dout, causal=True)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("batch, seqlen", [(2, 1024), (1, 8192)], ids=["two-pass", "one-pass"])
def test_gpu_cuda_graph_replay(batch, seqlen):
    """Forward+backward captured as a training step is (loss from out, then autograd.grad); the
    backward is the Triton two passes (1,024 tokens: too little work to fork the dQ pass onto the side stream,
    which test_replay's forked tests capture), or (8,192 causal tokens at d = 128 on sm90) the Gluon one pass,
    its zeroed accumulator and setup kernels included.

    The gradient flowing into the backward is made inside the capture: a tensor made before it, on
    another stream, would tie the legacy stream to the capturing one (cudaErrorStreamCaptureImplicit).
    """
    torch.manual_seed(2)
    q, k, v = make_qkv(batch, seqlen, seqlen, 8, 2, 128, torch.bfloat16, "cuda")
    weight = torch.randn_like(q, dtype=torch.float32)

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        return (out, *torch.autograd.grad((out.float() * weight).sum(), (q, k, v)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream: compiles and autotunes outside the capture
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


def test_gpu_varlen_cuda_graph_capture():
    """Varlen checks its cu_seqlens on eager calls and skips the host read while a graph is captured."""
    lengths = [100, 3, 250]
    cu = random_cu_seqlens(lengths, "cuda")
    q = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16)
    eager = flash_attn_varlen_func(q, q, q, cu, cu, 250, 250, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_varlen_func(q, q, q, cu, cu, 250, 250, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, captured)


def test_gpu_dropout_refused_during_cuda_graph_capture():
    """A captured call would replay one dropout mask (the seed is a host number): refused, before any launch."""
    q = torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16)
    flash_attn_func(q, q, q, dropout_p=0.1)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="dropout_p=0.1 during CUDA-graph capture"):
        with torch.cuda.graph(graph):
            flash_attn_func(q, q, q, dropout_p=0.1)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_gpu_dropout_under_torch_compile_stays_in_one_graph(fullgraph):
    """Compiled, a dropout call on CUDA tensors neither breaks the graph (the capture check and the seed's draw
    trace) nor repeats its mask; a compiled call captured into a CUDA graph is refused when the op runs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    q = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(q):
        return flash_attn_func(q * 2, q, q, dropout_p=0.3, causal=True)

    compiled = torch.compile(step, fullgraph=fullgraph, backend="aot_eager")
    first, second = compiled(q), compiled(q)
    assert not torch.equal(first, second)
    first.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert not counters["graph_break"], dict(counters["graph_break"])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="dropout_p=0.3 during CUDA-graph capture"):
        with torch.cuda.graph(graph):
            compiled(q)


def test_gpu_dropout_under_reduce_overhead_draws_a_mask_per_step():
    """torch.compile's CUDA graphs (mode="reduce-overhead") leave dropout calls out (their ops are tagged
    cudagraph_unsafe): each step draws a new mask, and the backward drops what its forward dropped (V the
    identity over the keys, so the output shows the kept probabilities)."""
    torch._dynamo.reset()
    p, seqlen = 0.3, 64
    q, k = (torch.randn(2, seqlen, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    eye = torch.eye(seqlen, device="cuda", dtype=torch.float16)
    v = eye.view(1, seqlen, 1, seqlen).repeat(2, 1, 2, 1).requires_grad_()
    weights = torch.randn(2, seqlen, 2, seqlen, device="cuda", dtype=torch.float16)

    @torch.compile(mode="reduce-overhead")
    def step(q, k, v):
        return flash_attn_func(q * 1.0, k, v, dropout_p=p)

    outs = []
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        out = step(q, k, v)
        grads = torch.autograd.grad((out.float() * weights).sum(), (q, k, v))
        keep = (out != 0).transpose(1, 2)
        qr, kr, vr = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
        probs = (qr @ kr.transpose(-1, -2) * 64**-0.5).softmax(-1)
        ref = (torch.where(keep, probs, 0.0) / (1 - p)) @ vr
        ref_grads = torch.autograd.grad((ref.transpose(1, 2) * weights.float()).sum(), (qr, kr, vr))
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.float(), want.transpose(1, 2), atol=3e-2, rtol=3e-2)
        outs.append(out.clone())
    assert all(not torch.equal(a, b) for a, b in zip(outs, outs[1:]))
    torch._dynamo.reset()


def test_gpu_dropout_seed_comes_from_the_cuda_generator():
    """As flash-attn's and SDPA's: torch.cuda.manual_seed and the CUDA RNG state govern the mask (activation
    checkpointing restores that state to recompute a forward), and torch's CPU generator is left alone."""
    q = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    cpu_state = torch.get_rng_state()
    torch.cuda.manual_seed(7)
    first, second = (flash_attn_func(q, q, q, dropout_p=0.3) for _ in range(2))
    assert not torch.equal(first, second)  # each call advances the generator
    torch.cuda.manual_seed(7)
    assert torch.equal(flash_attn_func(q, q, q, dropout_p=0.3), first)
    state = torch.cuda.get_rng_state()
    third = flash_attn_func(q, q, q, dropout_p=0.3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(flash_attn_func(q, q, q, dropout_p=0.3), third)
    assert torch.equal(torch.get_rng_state(), cpu_state)


@pytest.mark.parametrize("cu_k,max_k,words", [
    ([-1, 5, 12], 7, r"cu_seqlens_k\[0\] must be >= 0"),
    ([0, 8, 5, 12], 8, "non-decreasing"),
    ([0, 5, 13], 8, "must be at most the number of packed tokens"),
    ([0, 5, 12], 6, "max_seqlen_k"),
], ids=["first", "decreasing", "last", "max"])
def test_gpu_varlen_bad_values_raise_before_launch(cu_k, max_k, words, monkeypatch):
    """The cu_seqlens values are read without blocking and checked just before the kernel launch: bad
    values still raise, and no attention kernel starts; the next good call runs."""
    from flashtile.kernels import configs

    launched = []
    real_launch = configs.launch
    monkeypatch.setattr(configs, "launch", lambda *a, **kw: launched.append(a) or real_launch(*a, **kw))
    cu_k = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 4, 10] if cu_k.numel() == 3 else [0, 4, 6, 10], dtype=torch.int32, device="cuda")
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(12, 2, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda._sleep(10_000_000)  # the values' copy queues behind this: the check must wait for it
    with pytest.raises(ValueError, match=words):
        flash_attn_varlen_func(q, k, k, cu_q, cu_k, 6, max_k)
    assert not launched
    good_k = torch.tensor([0, 5, 12] if cu_k.numel() == 3 else [0, 5, 6, 12], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, k, cu_q, good_k, 6, 7)
    assert launched and not out.isnan().any()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (run without FLASHTILE_TEST_GPUS)")
def test_gpu_inputs_on_another_device():
    """q, k, v on cuda:1 while cuda:0 is current: launches go to cuda:1 (a device guard, as flash-attn's),
    forward, backward and varlen give the results they give with cuda:1 current."""
    q, k, v = make_qkv(2, 300, 300, 4, 2, 64, torch.bfloat16, "cuda:1")
    dout = torch.randn_like(q)
    cu = torch.tensor([0, 120, 300], dtype=torch.int32, device="cuda:1")
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, dtype=torch.bfloat16, device="cuda:1") for _ in range(2))
    cache_seqlens = torch.tensor([10, 40], dtype=torch.int32, device="cuda:1")

    def calls():
        step = flash_attn_with_kvcache(q[:, :1], k_cache.clone(), v_cache.clone(), k[:, :1], v[:, :1],
                                       cache_seqlens=cache_seqlens)
        return (*_grads(q, k, v, dout, causal=True),
                flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 180, 180, causal=True), step)

    with torch.cuda.device(1):
        wanted = calls()
    with torch.cuda.device(0):
        # the ordinary path, a recorded launch plan, then its replays: each under the guard
        for _ in range(3):
            got = calls()
            torch.cuda.synchronize(1)
            for a, b in zip(got, wanted):
                assert a.device == torch.device("cuda:1") and torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (run without FLASHTILE_TEST_GPUS)")
def test_gpu_dropout_refused_during_capture_on_another_device():
    """The capture check reads the inputs' device: cuda:1 capturing while cuda:0 is current still refuses."""
    q = torch.randn(2, 64, 4, 64, device="cuda:1", dtype=torch.bfloat16)
    flash_attn_func(q, q, q, dropout_p=0.1)  # compiled outside the capture
    with torch.cuda.device(1):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match="dropout_p=0.1 during CUDA-graph capture"):
            with torch.cuda.graph(graph):
                with torch.cuda.device(0):
                    flash_attn_func(q, q, q, dropout_p=0.1)


def test_gpu_compile_reduce_overhead_training_steps():
    """torch.compile(mode="reduce-overhead"): cudagraph trees warm up, record and replay a training step
    through flashtile's ops. Nothing flashtile keeps past a call may come from the graph's private pool
    (its cached placeholder tensors once did, and the trees refused the step); replays match eager."""
    torch._dynamo.reset()
    torch.manual_seed(4)
    x, weight, step = projection_step(2, 256, 4, 64)

    expected = torch.autograd.grad(step(x, weight), weight)[0]
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, recording, replays
        torch.compiler.cudagraph_mark_step_begin()
        grad = torch.autograd.grad(compiled(x, weight), weight)[0].clone()
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=1e-4)
