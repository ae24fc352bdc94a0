"""On an H200: the forward's dispatch candidates timed through ``flash_attn_func`` itself, GPU time only.

    python benchmarks/lab/dispatch_choice.py [--headdims 64,128] [--causal true] [--seqlens 512,1024,4096]
                                             [--choices triton,single-ffma@128x128x2x8,pingpong-fa3@128x128x2x8]
                                             [--varlen] [--backward --choices one-pass,two-passes --rounds 2]

Each choice is put into ``configs.GLUON_FORWARD`` as the point's (head dim, causal) only tier, from any length
("triton": ``FLASHTILE_GLUON=0``), the launch plans recorded under the previous choice are dropped, and the
call is timed with ``triton.testing.do_bench_cudagraph`` (the calls captured in a CUDA graph and replayed), so
the number is the kernels' time: ``gluon_bench.py`` calls the Gluon launcher directly, whose host path (a
descriptor set and Gluon's own dispatch per call) outlasts a short causal kernel, so its short points time the
host. Beside them SDPA's cuDNN backend (forced) on the same inputs. Batch × seqlen = 16k tokens (``--tokens``),
16 heads, bf16 (``--views``: q, k, v views of one projection's output, as ``flashtile bench --overhead`` makes
them); forward TFLOP/s by the flash-attn formula, and each choice's max difference from the first choice's output.

``--varlen``: ``flash_attn_varlen_func`` over 16k tokens packed in sequences of 0.25-1.75x a mean length (the
``--seqlens``, as ``gluon_bench.py --varlen`` packs them), each Gluon choice admitted from any mean length
(``configs.GLUON_VARLEN_MIN_MEAN``), three consumers too (``configs.THREE_CONSUMERS``, which the dispatch keeps
from packed calls); TFLOP/s by the sequences' own lengths; no SDPA column.

``--backward``: the backward's dispatch instead, choices ``one-pass`` (the Gluon one pass from any length, in the loop
``configs.GLUON_BACKWARD_KEYS_AS_M`` gives the point; ``one-pass-fa3`` and ``one-pass-pipelined`` force the keys as M
in FA3's order or the pipelined loop) and ``two-passes`` (the Triton backward at any length; its tiles tuned on first
use unless ``FLASHTILE_AUTOTUNE=0``),
through autograd as ``flashtile bench --modes bwd`` and ``env_ab.py`` time it (``triton.testing.do_bench``),
against SDPA's cuDNN backward; batch x seqlen = 16k tokens, heads x d = 2048 (the speed grid's shape); backward
TFLOP/s and each choice's max|dq, dk, dv - the first choice's|. ``--rounds`` repeats the choices in turn.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn.functional as F
import triton.testing
from gluon_bench import packed_lengths
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import _ops, flash_attn_func, flash_attn_varlen_func
from flashtile.bench import _implementation, _mode_callable, attention_flops
from flashtile.kernels import configs

_TABLES = (configs.GLUON_FORWARD, configs.GLUON_VARLEN_MIN_MEAN, configs.GLUON_BACKWARD_MIN_SEQLEN)
DEVICE = "cuda"
# GLUON_BACKWARD_MIN_SEQLEN's entry for the point
_BACKWARD_CHOICES = {"one-pass": 1, "one-pass-fa3": 1, "one-pass-pipelined": 1, "two-passes": 1 << 62}
_KEYS_AS_M = set(configs.GLUON_BACKWARD_KEYS_AS_M)
_THREE_CONSUMERS = configs.THREE_CONSUMERS  # (packed calls skip them in the dispatch; a choice here admits them)


def _choose(choice: str, headdim: int, causal: bool) -> None:
    _ops._PLANS.clear()
    _ops._FAMILIES.clear()
    if choice in _BACKWARD_CHOICES:
        configs.GLUON_BACKWARD_MIN_SEQLEN[(headdim, causal)] = _BACKWARD_CHOICES[choice]
        if choice == "one-pass-fa3":
            configs.GLUON_BACKWARD_KEYS_AS_M.add((headdim, causal))
        elif choice == "one-pass-pipelined":
            configs.GLUON_BACKWARD_KEYS_AS_M.discard((headdim, causal))
        return
    if choice == "triton":
        os.environ["FLASHTILE_GLUON"] = "0"
        return
    os.environ.pop("FLASHTILE_GLUON", None)
    variant, tile = choice.split("@")
    if variant in _THREE_CONSUMERS and not configs.FWD_NAMED_SYNC:
        raise SystemExit(f"{choice}: three consumers take turns by named barriers only (FLASHTILE_FWD_NAMED_SYNC=1)")
    configs.GLUON_FORWARD[(headdim, causal)] = ((1, variant, tuple(int(x) for x in tile.split("x"))),)
    configs.GLUON_VARLEN_MIN_MEAN[(headdim, causal)] = 1
    configs.THREE_CONSUMERS = ()


def _restore(saved: list) -> None:
    for table, copy in zip(_TABLES, saved):
        table.clear()
        table.update(copy)
    configs.GLUON_BACKWARD_KEYS_AS_M.clear()
    configs.GLUON_BACKWARD_KEYS_AS_M.update(_KEYS_AS_M)
    configs.THREE_CONSUMERS = _THREE_CONSUMERS


def _packed(mean: int, headdim: int, causal: bool, tokens: int = 16384) -> tuple:
    """(q, k, v, cu_seqlens, lengths) of ``tokens`` packed in sequences of 0.25-1.75x ``mean``."""
    lengths = packed_lengths(mean, headdim, causal, tokens)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    q, k, v = (torch.randn(tokens, 16, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, cu, lengths


def _ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _backward_point(headdim: int, causal: bool, seqlen: int, choices: list, rounds: int) -> str:
    """One row of ``--backward``: each choice's backward TFLOP/s (rounds joined by '/'), cuDNN's, and the
    largest gradient difference from the first choice."""
    batch, heads = max(1, 16384 // seqlen), 2048 // headdim
    q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    flops = attention_flops(batch, heads, seqlen, seqlen, headdim, causal, "bwd")
    saved = [dict(table) for table in _TABLES]
    rates: dict = {choice: [] for choice in choices}
    grads: dict = {}
    for _ in range(rounds):
        for choice in choices:
            _choose(choice, headdim, causal)
            try:
                # A new forward per choice: the autograd node keeps the launch plans of its own call.
                backward = _mode_callable(_implementation("flashtile", seqlen, seqlen, causal), "bwd", q, k, v,
                                          dout, causal)
                grads.setdefault(choice, backward())
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(backward, warmup=50, rep=300, return_mode="median")
                rates[choice].append(f"{flops / ms / 1e9:.1f}")
            except Exception as exc:  # noqa: BLE001 - a refused choice is a result of the run
                rates[choice].append(type(exc).__name__)
            finally:
                _restore(saved)
    cudnn = _mode_callable(_implementation("sdpa_cudnn", seqlen, seqlen, causal), "bwd", q, k, v, dout, causal)
    cudnn_rate = flops / triton.testing.do_bench(cudnn, warmup=50, rep=300, return_mode="median") / 1e9
    first = grads.get(choices[0])
    diffs = ["-" if first is None or choice not in grads else
             f"{max((a.float() - b.float()).abs().max().item() for a, b in zip(grads[choice], first)):.2e}"
             for choice in choices]
    return (f"{headdim:>4} {str(causal).lower():>6} {seqlen:>6} | " + " ".join(f"{'/'.join(rates[c]):>26}"
                                                                               for c in choices)
            + f" {cudnn_rate:26.1f}  " + " / ".join(diffs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--causal", default="true")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--choices", default="triton,single-ffma@128x128x2x8,pingpong-fa3@128x128x2x8")
    parser.add_argument("--varlen", action="store_true", help="flash_attn_varlen_func on packed sequences")
    parser.add_argument("--backward", action="store_true",
                        help="the backward's dispatch: one-pass (-fa3, -pipelined), two-passes")
    parser.add_argument("--rounds", type=int, default=1, help="--backward: the choices timed in turn this often")
    parser.add_argument("--tokens", type=int, default=16384,
                        help="batch x seqlen of the dense forward's points (8192: the wall-time rows' b=4 at 2,048)")
    parser.add_argument("--views", action="store_true",
                        help="dense q, k, v as views of one (batch, seqlen, 3 * heads * d) projection, as a model's")
    args = parser.parse_args()
    if args.backward:
        choices = [c for c in args.choices.split(",") if c in _BACKWARD_CHOICES] or list(_BACKWARD_CHOICES)
        print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | " + " ".join(f"{c:>26}" for c in [*choices, "cudnn"])
              + "  (backward TFLOP/s)  max|grads - first's|", flush=True)
        for headdim in map(int, args.headdims.split(",")):
            for causal in (c.strip().lower() == "true" for c in args.causal.split(",")):
                for seqlen in map(int, args.seqlens.split(",")):
                    print(_backward_point(headdim, causal, seqlen, choices, args.rounds), flush=True)
        return
    choices = args.choices.split(",")
    heads = 16
    last = "sequences" if args.varlen else "cudnn"
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} | " + " ".join(f"{c:>26}" for c in [*choices, last])
          + "  (TFLOP/s)  max|choice - first|", flush=True)
    for headdim in map(int, args.headdims.split(",")):
        for causal in (c.strip().lower() == "true" for c in args.causal.split(",")):
            saved = [dict(table) for table in _TABLES]
            for seqlen in map(int, args.seqlens.split(",")):
                if args.varlen:
                    q, k, v, cu, lengths = _packed(seqlen, headdim, causal)
                    longest = max(lengths)
                    call = functools.partial(flash_attn_varlen_func, q, k, v, cu, cu, longest, longest, causal=causal)
                    flops = sum(attention_flops(1, heads, n, n, headdim, causal, "fwd") for n in lengths)
                else:
                    batch = max(1, args.tokens // seqlen)
                    if args.views:
                        projection = torch.randn(batch, seqlen, 3 * heads * headdim, device="cuda",
                                                 dtype=torch.bfloat16)
                        q, k, v = projection.view(batch, seqlen, 3, heads, headdim).unbind(2)
                    else:
                        q, k, v = (torch.randn(batch, seqlen, heads, headdim, device="cuda", dtype=torch.bfloat16)
                                   for _ in range(3))
                    call = functools.partial(flash_attn_func, q, k, v, causal=causal)
                    flops = attention_flops(batch, heads, seqlen, seqlen, headdim, causal, "fwd")
                rates, diffs, first = [], [], None
                for choice in choices:
                    _choose(choice, headdim, causal)
                    try:
                        out = call()
                        rates.append(f"{flops / _ms(call) / 1e9:26.1f}")
                        first = out if first is None else first
                        diffs.append(f"{(out.float() - first.float()).abs().max().item():.2e}")
                    except Exception as exc:  # noqa: BLE001 - a refused tile is a result of the run
                        rates.append(f"{type(exc).__name__:>26}")
                        diffs.append("-")
                    finally:
                        _restore(saved)
                os.environ.pop("FLASHTILE_GLUON", None)
                if args.varlen:
                    sdpa = f"{len(lengths)} seqs".rjust(26)
                else:
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    sdpa_call = functools.partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=causal)
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # (captured under the forced backend)
                        sdpa = f"{flops / _ms(sdpa_call) / 1e9:26.1f}"
                print(f"{headdim:>4} {str(causal).lower():>6} {seqlen:>6} | " + " ".join(rates) + f" {sdpa}  "
                      + " / ".join(diffs), flush=True)


if __name__ == "__main__":
    main()
