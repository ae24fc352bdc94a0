"""Floors of host time per call on a GPU machine: what any Python attention pays before its own work.

    python benchmarks/lab/host_floors.py

An allocation, one PyTorch kernel, an autograd Function with empty forward and backward (with autograd's
device thread and without), Triton launches of kernels with 5 and 40 arguments, a host TMA descriptor,
stream waits, and SDPA flash's forward+backward at two short shapes: median µs per call of 5 loops.
"""

import time

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor


def loop_us(fn, calls: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(samples)[len(samples) // 2]


class Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, grad):
        (a,) = ctx.saved_tensors
        return torch.empty_like(a)


@triton.jit
def copy5(A, B, n, s1, s2, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(B + i, tl.load(A + i, mask=i < n), mask=i < n)


@triton.jit
def copy40(A, B, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9,
           c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, d0, d1, d2, d3, d4, d5, d6, d7, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(B + i, tl.load(A + i, mask=i < n), mask=i < n)


def sdpa_rows(shape) -> None:
    batch, seqlen, nheads, headdim = shape
    q, k, v = (torch.randn(batch, nheads, seqlen, headdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(batch, nheads, seqlen, headdim, device="cuda", dtype=torch.bfloat16)
    attend = torch.nn.functional.scaled_dot_product_attention

    def fwd_bwd():
        attend(q, k, v, is_causal=True).backward(dout)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        print(f"{shape} sdpa flash fwd+bwd: {loop_us(fwd_bwd, 50):.1f} us")
        with torch.autograd.set_multithreading_enabled(False):
            print(f"{shape} sdpa flash fwd+bwd, no device thread: {loop_us(fwd_bwd, 50):.1f} us")
        with torch.no_grad():
            print(f"{shape} sdpa flash fwd, no grad: {loop_us(lambda: attend(q, k, v, is_causal=True), 50):.1f} us")


def main() -> None:
    x = torch.randn(1024, device="cuda", requires_grad=True)
    grad = torch.randn(1024, device="cuda")
    print(f"torch.empty: {loop_us(lambda: torch.empty(1024, device='cuda')):.1f} us")
    print(f"one elementwise kernel: {loop_us(lambda: x.detach().add(1)):.1f} us")
    print(f"empty autograd Function, forward: {loop_us(lambda: Empty.apply(x)):.1f} us")
    print(f"empty autograd Function, forward+backward: {loop_us(lambda: Empty.apply(x).backward(grad)):.1f} us")
    with torch.autograd.set_multithreading_enabled(False):
        print(f"  the same without the device thread: {loop_us(lambda: Empty.apply(x).backward(grad)):.1f} us")
    a = torch.randn(4096, device="cuda")
    b = torch.empty_like(a)
    ints = list(range(3, 41))
    print(f"Triton launch, 5 arguments: {loop_us(lambda: copy5[(4,)](a, b, 4096, 3, 5, BLOCK=1024)):.1f} us")
    print(f"Triton launch, 40 arguments: {loop_us(lambda: copy40[(4,)](a, b, *ints, 4096, BLOCK=1024)):.1f} us")
    q = torch.randn(4, 512, 16, 64, device="cuda", dtype=torch.bfloat16)
    make = lambda: TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 64, 1, 64])
    print(f"one host TensorDescriptor: {loop_us(make):.1f} us")
    side = torch.cuda.Stream()

    def fork_join():
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda.current_stream().wait_stream(side)

    print(f"two wait_stream calls: {loop_us(fork_join):.1f} us")
    for shape in ((1, 256, 32, 128), (32, 512, 12, 64)):
        sdpa_rows(shape)


if __name__ == "__main__":
    main()
