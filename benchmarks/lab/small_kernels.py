"""The one pass's small kernels (``fixed_point``): ``_kv_maxima`` and ``_dq_from_counts`` timed alone at their shipped
tiles and at others, the setup (``_kv_maxima`` and ``_row_units``) and the conversion as the backward calls them, with
the bytes each moves over its time beside a device-to-device copy's.

    python benchmarks/lab/small_kernels.py [--headdims 64,128] [--seqlens 4096,16384]

bf16, batch · seqlen = 16,384 tokens, heads · d = 2048 (the harness's cells). Each kernel is timed by
``triton.testing.do_bench`` (median, L2 flushed between runs). Every tile's results are checked against the shipped
tile's: the K/V maxima reduce to the same values (a max does not depend on its order) and dQ from the counts has the
same bits (an elementwise product), so a faster tile could ship without changing any gradient. ``_row_units`` is
timed only inside the setup, at its shipped tile: its delta sums must keep the preprocess's order (its tile) to give
the same bits.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.testing

from flashtile.kernels import configs, fixed_point

MAXIMA_TILES = [(parts, block_n, warps) for parts in (16, 32, 64, 128) for block_n in (32, 64, 128)
                for warps in (4, 8)]
COUNT_TILES = [(block_r, warps) for block_r in (16, 32, 64, 128) for warps in (2, 4, 8)]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _maxima(k, v, parts, block_n, warps):
    batch, seqlen_k, nheads_k, d = k.shape
    partial = torch.empty(batch * nheads_k, parts, 2, dtype=torch.float32, device=k.device)
    flag = torch.empty(1, dtype=torch.int32, device=k.device)

    def run():
        fixed_point._kv_maxima[(parts, batch * nheads_k)](
            k, v, partial, flag, *k.stride()[:3], *v.stride()[:3], nheads_k, seqlen_k, HEAD_DIM=d,
            BLOCK_D=triton.next_power_of_2(d), BLOCK_N=block_n, PARTS=parts, num_warps=warps)
    return run, partial


def _counts(acc, unit, dq, block_r, warps):
    batch, seqlen_q, nheads, d = acc.shape
    rows = batch * seqlen_q * nheads

    def run():
        fixed_point._dq_from_counts[(triton.cdiv(rows, block_r),)](
            acc, unit, dq, 0.125, nheads, seqlen_q, rows, *dq.stride()[:3], HEAD_DIM=d,
            BLOCK_D=triton.next_power_of_2(d), BLOCK_R=block_r, FIXED=True, num_warps=warps)
    return run


def measure(d: int, seqlen: int) -> list[str]:
    batch, nheads = 16384 // seqlen, 2048 // d
    gen = torch.Generator(device="cuda").manual_seed(d * 7 + seqlen)
    shape = (batch, seqlen, nheads, d)
    q, k, v, out, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(5))
    lse = torch.randn(batch, nheads, seqlen, device="cuda", generator=gen)
    acc = torch.empty(shape, dtype=torch.int32, device="cuda")
    lines = [f"== d={d} s={seqlen} batch={batch} heads={nheads}"]
    elem = k.numel()
    copy_src = torch.empty(2 * elem, dtype=torch.bfloat16, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = _ms(lambda: copy_dst.copy_(copy_src))
    lines.append(f"copy of K+V's bytes: {copy_ms * 1e3:.1f} us, {2 * copy_src.nbytes / copy_ms / 1e6:.0f} GB/s "
                 "(read + written)")
    # The shipped calls, as the backward makes them
    setup_ms = _ms(lambda: fixed_point.setup_units(out, dout, lse, k, v, 1, acc))
    unit = fixed_point.setup_units(out, dout, lse, k, v, 1, acc)[2]  # each row's unit, for the conversion
    acc.copy_(torch.randint(-2**20, 2**20, shape, device="cuda", generator=gen, dtype=torch.int32))
    dq = torch.empty_like(q)
    convert_ms = _ms(lambda: fixed_point.dq_from_accumulator(acc, unit, dq, 0.125))
    lines.append(f"setup_units (maxima + row units): {setup_ms * 1e3:.1f} us; dq_from_accumulator: "
                 f"{convert_ms * 1e3:.1f} us")
    # _kv_maxima's tiles: reads K and V
    shipped = (fixed_point._MAXIMA_PARTS, 64, 4)
    ref_run, ref_partial = _maxima(k, v, *shipped)
    ref_run()
    ref = ref_partial.amax(dim=1)
    for tile in [shipped] + [t for t in MAXIMA_TILES if t != shipped]:
        run, partial = _maxima(k, v, *tile)
        run()
        same = torch.equal(partial.amax(dim=1), ref)
        ms = _ms(run)
        lines.append(f"_kv_maxima parts={tile[0]:3d} block_n={tile[1]:3d} warps={tile[2]}: {ms * 1e3:7.1f} us "
                     f"{2 * k.nbytes / ms / 1e6:6.0f} GB/s{'' if same else '  DIFFERENT MAXIMA'}"
                     f"{'  (shipped)' if tile == shipped else ''}")
    # _dq_from_counts's tiles: reads the int32 counts, writes dQ
    shipped_counts = (32, 4)
    ref_dq = torch.empty_like(q)
    _counts(acc, unit, ref_dq, *shipped_counts)()
    for tile in [shipped_counts] + [t for t in COUNT_TILES if t != shipped_counts]:
        out_dq = torch.full_like(q, float("nan"))
        run = _counts(acc, unit, out_dq, *tile)
        run()
        same = torch.equal(out_dq.view(torch.int16), ref_dq.view(torch.int16))
        ms = _ms(run)
        lines.append(f"_dq_from_counts block_r={tile[0]:3d} warps={tile[1]}: {ms * 1e3:7.1f} us "
                     f"{(acc.nbytes + dq.nbytes) / ms / 1e6:6.0f} GB/s{'' if same else '  DIFFERENT BITS'}"
                     f"{'  (shipped)' if tile == shipped_counts else ''}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--seqlens", default="4096,16384")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "PDL" if configs.pdl_options(torch.device("cuda")) else "no PDL")
    for d in (int(x) for x in args.headdims.split(",")):
        for seqlen in (int(x) for x in args.seqlens.split(",")):
            for line in measure(d, seqlen):
                print(line, flush=True)


if __name__ == "__main__":
    main()
