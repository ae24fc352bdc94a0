"""Tokens/s of a compiled GPT trained with attention dropout, flashtile against SDPA, under torch.compile's default
mode (not fullgraph: a graph break splits the step instead of failing). Prints the graph breaks Dynamo counted.

    python benchmarks/lab/compile_dropout.py --seqlen 2048 --batch 8 --attn-dropout 0.1 --rounds 2

Run it with another flashtile first on PYTHONPATH to compare two trees. ``--kernels``: one attention call's forward and
forward+backward instead (do_bench medians), flashtile against SDPA with the same dropout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import flashtile
import flashtile.nn.attention as attention_module
from flashtile.kernels import configs
from flashtile.nn import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train_compare import sdpa_attention  # noqa: E402  (benchmarks/: flash_attn_func's contract on SDPA)


def tokens_per_s(impl: str, args) -> tuple[float, int]:
    """(tokens/s over the timed steps, graph breaks counted while compiling)."""
    from torch._dynamo.utils import counters

    original = attention_module.flash_attn_func
    if impl == "sdpa":
        attention_module.flash_attn_func = sdpa_attention
    try:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=256, block_size=args.seqlen, n_layer=args.layers, n_head=args.heads,
                           n_embd=args.heads * args.headdim)
        model = GPT(config).cuda()
        for module in model.modules():
            if hasattr(module, "attn_dropout"):
                module.attn_dropout = args.attn_dropout
        step_fn = torch.compile(model) if args.compile else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rows = torch.randint(0, 256, (args.batch, args.seqlen + 1), device="cuda")
        start = None
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                torch.cuda.synchronize()
                start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = step_fn(rows[:, :-1], rows[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        return args.steps * args.batch * args.seqlen / elapsed, sum(counters["graph_break"].values())
    finally:
        attention_module.flash_attn_func = original


def attention_ms(impl: str, args) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of one attention call with dropout: the model's shape, causal, bf16."""
    from triton.testing import do_bench

    shape = (args.batch, args.seqlen, args.heads, args.headdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    attend = flashtile.flash_attn_func if impl == "flashtile" else sdpa_attention

    def forward():
        return attend(q, k, v, dropout_p=args.attn_dropout, causal=True)

    def forward_backward():
        torch.autograd.grad(forward(), (q, k, v), dout)
    forward_backward()  # (tiles tuned here, if tuning is on)
    if impl == "flashtile":  # the tiles each Triton kernel's last launch took (tuned, or its list's first)
        print("  tiles: " + "; ".join(f"{name} {tile}" for name, tile in configs.tiles_used().items()))
    # Medians: a mean takes in any outlier among the runs (a kernel compiled or loaded mid-timing).
    return do_bench(forward, return_mode="median"), do_bench(forward_backward, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--attn-dropout", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--impls", default="flashtile,sdpa")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager steps")
    parser.add_argument("--kernels", action="store_true", help="time one attention call instead of training")
    args = parser.parse_args()
    print(f"flashtile from {flashtile.__file__}; torch {torch.__version__}; {torch.cuda.get_device_name()}")
    impls = args.impls.split(",")
    if args.kernels:
        for impl in impls:
            fwd, fwd_bwd = attention_ms(impl, args)
            print(f"{impl}: forward {fwd * 1e3:.0f} us, forward+backward {fwd_bwd * 1e3:.0f} us "
                  f"(dropout {args.attn_dropout}, {args.batch}x{args.seqlen}, {args.heads} heads, d={args.headdim})")
        return
    for round_index in range(args.rounds):
        order = impls if round_index % 2 == 0 else impls[::-1]
        for impl in order:
            rate, breaks = tokens_per_s(impl, args)
            print(f"round {round_index + 1} {impl}: {rate:,.0f} tokens/s, {breaks} graph breaks")


if __name__ == "__main__":
    main()
