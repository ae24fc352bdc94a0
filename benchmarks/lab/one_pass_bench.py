"""On an H200: the one-pass Gluon backward (``gluon_attention_backward(one_pass=...)``) against the two passes.

    python benchmarks/lab/one_pass_bench.py [--headdims 64,128] [--seqlens 4096,16384] [--tiles 128:32x128x2x8,...]

Batch x seqlen = 16k tokens, 16 heads, bf16, seqlen_q = seqlen_k, causal and not. Columns, backward TFLOP/s
(flash-attn formula): flashtile's backward (autograd through flash_attn_func: what the dispatch takes), SDPA's
cuDNN backward, the Gluon two passes, and the Gluon one pass with dQ added in float32 ("atomic",
nondeterministic) and in int32 fixed point ("fixed", deterministic), at each tile given for the head dim
(``--tiles d:BMxBNxSTAGESxWARPS``, default ``gluon_backward.ONE_PASS_TILES``, ``KEYS_AS_M_TILES`` for FA3's
order). Each one-pass call counts
its whole cost (the zeroed accumulator, the units, the conversion to dQ). ``--modes`` adds "atomic-ws" and
"fixed-ws": the same with a producer warp loading the (Q, dO) ring (``warp_specialize=True``); "atomic-ws-pipe",
"fixed-ws-pipe": that loop with the next pair's scores under the products (``pipelined=True``); "fixed-km",
"fixed-ws-km": the keys as M (``keys_as_m=True``); "fixed-ws-km3": in FA3's order (``keys_as_m="fa3"``);
"fixed-ws-km3dv": that order with dV's product before the wait for dPᵀ (``keys_as_m="fa3-early-dv"``). After the
timings: each Gluon result's max|diff| from flashtile's gradients, and whether two "fixed" runs gave the same
bits.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gluon_bench import _ms  # the same timing as the Gluon forward's and two passes' lab runs
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_func
from flashtile.bench import attention_flops
from flashtile.kernels import gluon_backward

_KEYS_AS_M = {"km": True, "km3": "fa3", "km3dv": "fa3-early-dv"}  # a mode's last part -> keys_as_m


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--tiles", default="", help="d:BMxBNxSTAGESxWARPS, comma-separated")
    parser.add_argument("--modes", default="atomic,fixed",
                        help="of atomic, fixed, atomic-ws, fixed-ws, atomic-ws-pipe, fixed-ws-pipe, fixed-km, "
                             "fixed-ws-km (-ws: the warp-specialized pass; -pipe: pipelined; -km: the keys as M)")
    args = parser.parse_args()
    tiles: dict[int, list] = {}
    for item in filter(None, args.tiles.split(",")):
        d, tile = item.split(":")
        tiles.setdefault(int(d), []).append(tuple(int(x) for x in tile.split("x")))
    modes = args.modes.split(",")
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                print(point(d, causal, s, tiles.get(d, [None]), modes), flush=True)
    return 0


def point(d: int, causal: bool, s: int, tile_list: list, modes: list[str]) -> str:
    batch, heads = max(1, 16384 // s), 16
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    want = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    args_ = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, causal)
    row = {"flashtile": _ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))}
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        sdpa_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    row["cudnn"] = _ms(lambda: torch.autograd.grad(sdpa_out, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True))
    row["gluon 2-pass"] = _ms(lambda: gluon_backward.gluon_attention_backward(*args_))
    notes = []
    for tile in tile_list:
        name_tile = "x".join(map(str, tile)) if tile else "default"
        for mode in modes:
            kwargs = dict(one_pass=mode.split("-")[0], dkdv_tiles=tile, warp_specialize="-ws" in mode,
                          pipelined=mode.endswith("-pipe"),
                          keys_as_m=_KEYS_AS_M.get(mode.rsplit("-", 1)[-1], False))
            got = gluon_backward.gluon_attention_backward(*args_, **kwargs)
            error = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            note = f"{mode} {name_tile}: {error:.2e}"
            if mode.startswith("fixed"):
                again = gluon_backward.gluon_attention_backward(*args_, **kwargs)
                note += " same bits" if all(torch.equal(a, b) for a, b in zip(got, again)) else " DIFFER"
            notes.append(note)
            row[f"{mode} {name_tile}"] = _ms(
                lambda kwargs=kwargs: gluon_backward.gluon_attention_backward(*args_, **kwargs))
    flops = attention_flops(batch, heads, s, s, d, causal, "bwd")
    cells = "  ".join(f"{name} {flops / ms / 1e9:.1f}" for name, ms in row.items())
    return f"d={d} causal={causal} s={s}: {cells} | {'; '.join(notes)}"


if __name__ == "__main__":
    raise SystemExit(main())
