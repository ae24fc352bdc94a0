"""On an H200: the forward's dispatch candidates timed through ``flash_attn_func`` itself, GPU time only.

    python benchmarks/lab/dispatch_choice.py [--headdims 64,128] [--causal true] [--seqlens 512,1024,4096]
                                             [--choices triton,single-ffma@128x128x2x8,pingpong-fa3@128x128x2x8]
                                             [--varlen]

Each choice is put into ``configs.GLUON_FORWARD`` as the point's (head dim, causal) only tier, from any length
("triton": ``FLASHTILE_GLUON=0``), the launch plans recorded under the previous choice are dropped, and the
call is timed with ``triton.testing.do_bench_cudagraph`` (the calls captured in a CUDA graph and replayed), so
the number is the kernels' time: ``gluon_bench.py`` calls the Gluon launcher directly, whose host path (a
descriptor set and Gluon's own dispatch per call) outlasts a short causal kernel, so its short points time the
host. Beside them SDPA's default backend (cuDNN) on the same inputs. Batch × seqlen = 16k tokens, 16 heads,
bf16; forward TFLOP/s by the flash-attn formula, and each choice's max difference from the first choice's
output.

``--varlen``: ``flash_attn_varlen_func`` over 16k tokens packed in sequences of 0.25-1.75x a mean length (the
``--seqlens``, as ``gluon_bench.py --varlen`` packs them), each Gluon choice admitted from any mean length
(``configs.GLUON_VARLEN_MIN_MEAN``); TFLOP/s by the sequences' own lengths; no SDPA column.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn.functional as F
import triton.testing
from gluon_bench import packed_lengths

from flashtile import _ops, flash_attn_func, flash_attn_varlen_func
from flashtile.bench import attention_flops
from flashtile.kernels import configs

_TABLES = (configs.GLUON_FORWARD, configs.GLUON_VARLEN_MIN_MEAN)


def _choose(choice: str, headdim: int, causal: bool) -> None:
    _ops._PLANS.clear()
    _ops._FAMILIES.clear()
    if choice == "triton":
        os.environ["FLASHTILE_GLUON"] = "0"
        return
    os.environ.pop("FLASHTILE_GLUON", None)
    variant, tile = choice.split("@")
    configs.GLUON_FORWARD[(headdim, causal)] = ((1, variant, tuple(int(x) for x in tile.split("x"))),)
    configs.GLUON_VARLEN_MIN_MEAN[(headdim, causal)] = 1


def _restore(saved: list) -> None:
    for table, copy in zip(_TABLES, saved):
        table.clear()
        table.update(copy)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--causal", default="true")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--choices", default="triton,single-ffma@128x128x2x8,pingpong-fa3@128x128x2x8")
    parser.add_argument("--varlen", action="store_true", help="flash_attn_varlen_func on packed sequences")
    args = parser.parse_args()
    choices = args.choices.split(",")
    heads = 16
    last = "sequences" if args.varlen else "sdpa"
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
                    batch = max(1, 16384 // seqlen)
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
                    sdpa = f"{flops / _ms(sdpa_call) / 1e9:26.1f}"
                print(f"{headdim:>4} {str(causal).lower():>6} {seqlen:>6} | " + " ".join(rates) + f" {sdpa}  "
                      + " / ".join(diffs), flush=True)


if __name__ == "__main__":
    main()
