#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck) over a small run of every kernel: forward, backward (preprocess,
# dK/dV, dQ) under every variant switch, varlen, block-sparse, kv-cache (append, rotary, paged) and the
# split-KV combine; on sm90 the Gluon forward (dense, varlen, FP8) and backward; the FP8 kernels (the Triton FP8
# forward; FP8-cache decoding in both V layouts, contiguous, paged and split, under float8 and 16-bit q, with the
# append kernel's quantization). Needs the GPU machine. Logs under $OUT (default ./out).
#   bash benchmarks/lab/sanitize.sh              (SANITIZE_PART=fp8: the FP8 kernels alone; =one_pass: the
#                                                 sm90 Gluon kernels alone (the backward's variants, the forward's
#                                                 ping-pong called directly); =gluon_fp8: the Gluon FP8
#                                                 forward with three consumers alone; =three16: the 16-bit one
#                                                 alone; =triton: the Triton kernels alone;
#                                                 SANITIZE_TOOLS=memcheck: one tool; SANITIZE_VARIANTS=4,5: those
#                                                 of gluon_backward_variants' list alone)
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FLASHTILE_AUTOTUNE=0 PYTORCH_NO_CUDA_MEMORY_CACHING=1
script=$(mktemp --suffix .py)
cat > "$script" <<'PY'
import os

import torch
from flashtile import (block_sparse_attn_func, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                       local_global_block_mask)
torch.manual_seed(0)
dev, bf16 = "cuda", torch.bfloat16
fp8_only = os.environ.get("SANITIZE_PART") == "fp8"


def qkv(*shape):
    return (torch.randn(*shape, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))


def fp8_kernels():
    """The Triton FP8 forward, and FP8-cache decoding: V in rows and positions-fastest, contiguous (split and not)
    and paged, float8 q with float8 tokens, 16-bit q with 16-bit tokens (quantized by the append kernel)."""
    from flashtile import fp8
    if torch.cuda.get_device_capability() < (8, 9):
        return
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(torch.randn(2, n, 4, 64, device=dev)) for n in (97, 131, 131))
    for causal in (False, True):
        flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    batch, length, hk, d = 2, 300, 2, 128
    kc, kd = fp8.quantize(torch.randn(batch, length, hk, d, device=dev))
    vc, vd = fp8.quantize(torch.randn(batch, length, hk, d, device=dev))
    q16 = torch.randn(batch, 1, 8, d, device=dev, dtype=bf16)
    q8, qd = fp8.quantize(q16.float(), hk)
    new16 = torch.randn(batch, 1, hk, d, device=dev, dtype=bf16)
    seqlens = torch.tensor([100, 298], dtype=torch.int32, device=dev)
    for v_layout in ("rows", "positions-fastest"):
        k_cache = kc.clone()
        v_cache = vc.clone() if v_layout == "rows" else fp8.zeros_cache(batch, length, hk, d, device=dev)[1].copy_(vc)
        for splits in (1, 3):
            flash_attn_with_kvcache(q16, k_cache, v_cache, new16, new16, cache_seqlens=seqlens, num_splits=splits,
                                    k_descale=kd, v_descale=vd)
            flash_attn_with_kvcache(q8, k_cache, v_cache, fp8.quantize_with(new16, kd), fp8.quantize_with(new16, vd),
                                    cache_seqlens=seqlens + 1, num_splits=splits, q_descale=qd, k_descale=kd,
                                    v_descale=vd)
        pool_k = fp8.quantize(torch.randn(40, 16, hk, d, device=dev))[0]
        pool_v = pool_k.clone() if v_layout == "rows" else fp8.zeros_cache(40, 16, hk, d, device=dev)[1].copy_(pool_k)
        table = torch.randperm(40, device=dev)[:38].view(2, 19).to(torch.int32)
        flash_attn_with_kvcache(q16, pool_k, pool_v, new16, new16, cache_seqlens=seqlens, block_table=table,
                                num_splits=2, k_descale=kd, v_descale=vd)


def gluon_backward_variants(dout, q, k, v, out, lse, causal):
    """The Gluon backward: the two passes and the one pass (fixed point and float32, warp-specialized or not,
    pipelined, the keys as M in FA3's order, its early-dV variant, at d = 64 with 128 query rows, and with its dQ
    recomputed where the sampled bounds fail)."""
    from flashtile.kernels.gluon_backward import gluon_attention_backward
    picked = os.environ.get("SANITIZE_VARIANTS")
    variants = ({}, dict(one_pass="fixed"), dict(one_pass="fixed", warp_specialize=True),
                dict(one_pass="atomic", warp_specialize=True), dict(one_pass="fixed", warp_specialize=True, pipelined=True),
                dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", dkdv_tiles=(64, 128, 2, 8)),
                dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3-early-dv"))
    if q.shape[-1] == 64:  # FA3's order with 128 query rows (one dQ buffer): d = 64 only
        variants += (dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", dkdv_tiles=(128, 128, 2, 8)),)
    # last (7 at d = 128, 8 at d = 64): FA3's order with bounds of 0, which every program's check fails, so that its
    # int32 counts wrap and the flagged Triton dQ pass recomputes dQ
    variants += (dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", sampled_bound=True, estimate_margin=0.0),)
    # and after it (8 at d = 128, 9 at d = 64): one KV head's V with an outlier at key 100, outside the sample, so that
    # the flagged pass recomputes that head's dQ and skips the others'
    variants += (dict(one_pass="fixed", warp_specialize=True, keys_as_m="fa3", sampled_bound=True, outlier=True),)
    for index, kwargs in enumerate(variants):
        if picked and str(index) not in picked.split(","):
            continue
        values = v
        if kwargs.pop("outlier", False):
            values = v.clone()
            values[0, 100, 0] *= 100.0
        gluon_attention_backward(dout, q, k, values, out, lse, causal, **kwargs)


def gluon_forward_pingpong():
    """The Gluon forward's ping-pong in FA3's order (pingpong-fa3, the dispatch's at d = 128 and 256; at d = 64 from
    4,096 tokens its three consumers, pingpong3-fa3) called directly: d = 128 with two and three K/V stages, d = 256,
    d = 64 with three consumers, causal or not, GQA, ragged lengths; packed sequences
    (mean lengths the dispatch would give it); the FP8 prototype."""
    from flashtile import fp8
    from flashtile.kernels.gluon_forward import (gluon_attention_forward, gluon_attention_forward_fp8,
                                                 gluon_attention_forward_varlen)
    for d, tiles, variant in ((128, (128, 128, 2, 8), "pingpong-fa3"), (128, (128, 128, 3, 8), "pingpong-fa3"),
                              (256, (128, 64, 2, 8), "pingpong-fa3"), (64, (192, 128, 2, 12), "pingpong3-fa3")):
        q = torch.randn(1, 700, 4, d, device=dev, dtype=bf16)
        k, v = (torch.randn(1, 900, 2, d, device=dev, dtype=bf16) for _ in range(2))
        for causal in (False, True):
            gluon_attention_forward(q, k, v, causal, tiles=tiles, variant=variant)
    cu = torch.tensor([0, 300, 1000, 1030], dtype=torch.int32, device=dev)
    packed = torch.randn(1030, 4, 128, device=dev, dtype=bf16)
    for causal in (False, True):
        gluon_attention_forward_varlen(packed, packed, packed, cu, cu, 700, causal, tiles=(128, 128, 3, 8),
                                       variant="pingpong-fa3")
    q8, k8, v8 = (fp8.quantize(torch.randn(1, 700, 4, 128, device=dev))[0] for _ in range(3))
    ones = torch.ones(1, 4, device=dev)
    for causal in (False, True):
        gluon_attention_forward_fp8(q8, k8, v8, ones, ones, ones, causal)
    gluon_fp8_three()


def gluon_fp8_three():
    """The Gluon FP8 forward with three consumers (pingpong3-fa3, the dispatch's from 2,048 tokens): d = 128 and
    64, causal or not, GQA, a short last block (consumers past seqlen_q), and causal rows that see no key or fewer
    tiles than their program (the idle turns)."""
    from flashtile import fp8
    from flashtile.kernels.gluon_forward import gluon_attention_forward_fp8
    for d, seqlen_q, seqlen_k in ((128, 700, 900), (128, 700, 300), (64, 500, 500)):
        q8 = fp8.quantize(torch.randn(1, seqlen_q, 4, d, device=dev))[0]
        k8, v8 = (fp8.quantize(torch.randn(1, seqlen_k, 2, d, device=dev))[0] for _ in range(2))
        ones = torch.ones(1, 2, device=dev)
        for causal in (False, True):
            gluon_attention_forward_fp8(q8, k8, v8, ones, ones, ones, causal, variant="pingpong3-fa3")


def gluon_three_16bit():
    """SANITIZE_PART=three16: the 16-bit forward with three consumers alone (pingpong3-fa3, the d = 64 dispatch's from
    4,096 tokens), causal or not, GQA, ragged lengths (consumers past seqlen_q)."""
    from flashtile.kernels.gluon_forward import gluon_attention_forward
    q = torch.randn(1, 700, 4, 64, device=dev, dtype=bf16)
    k, v = (torch.randn(1, 900, 2, 64, device=dev, dtype=bf16) for _ in range(2))
    for causal in (False, True):
        gluon_attention_forward(q, k, v, causal, tiles=(192, 128, 2, 12), variant="pingpong3-fa3")


def one_pass_only():
    """SANITIZE_PART=one_pass: the sm90 Gluon kernels alone: the backward variants (d = 64 and 128, GQA, ragged
    lengths, after flash_attn_func's forward of the same inputs) and the forward's ping-pong in FA3's order."""
    for d, causal in ((128, False), (128, True), (64, False), (64, True)):
        q, dout = (torch.randn(1, 1100, 4, d, device=dev, dtype=bf16) for _ in range(2))
        k, v = (torch.randn(1, 1300, 2, d, device=dev, dtype=bf16) for _ in range(2))
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        gluon_backward_variants(dout, q, k, v, out, lse, causal)
    gluon_forward_pingpong()


if os.environ.get("SANITIZE_PART") == "one_pass":
    one_pass_only()
elif os.environ.get("SANITIZE_PART") == "three16":
    gluon_three_16bit()
elif os.environ.get("SANITIZE_PART") == "gluon_fp8":
    gluon_fp8_three()
elif not fp8_only:
    # Dense forward + backward (preprocess, dK/dV, dQ) under each variant switch, even and odd head dims.
    variants = [dict(causal=False), dict(causal=True), dict(causal=True, window_size=(16, 0), softcap=5.0),
                dict(causal=True, alibi_slopes=torch.rand(4, device=dev)), dict(causal=False, dropout_p=0.2),
                dict(causal=True, sink=torch.randn(4, device=dev, requires_grad=True))]
    for kw in variants:
        for d in (64, 59):
            q, k, v = qkv(2, 97, 4, d)
            out = flash_attn_func(q, k, v, **kw)
            out.backward(torch.randn_like(out))
    # GQA and seqlen_q != seqlen_k
    q = torch.randn(2, 50, 4, 64, device=dev, dtype=bf16, requires_grad=True)
    k, v = (torch.randn(2, 131, 2, 64, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    flash_attn_func(q, k, v, causal=True).sum().backward()
    # Few query rows with GQA: the forward packs each KV head's query heads into one block (PACK_GQA), here
    # with the per-row ALiBi slope, window and sink.
    q = torch.randn(2, 5, 8, 64, device=dev, dtype=bf16, requires_grad=True)
    k, v = (torch.randn(2, 97, 2, 64, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    for kw in (dict(causal=True, window_size=(16, 0), alibi_slopes=torch.rand(8, device=dev)),
               dict(causal=False, sink=torch.randn(8, device=dev, requires_grad=True))):
        flash_attn_func(q, k, v, **kw).sum().backward()
    # Varlen with lengths 30, 1, 69 (and an empty sequence)
    cu = torch.tensor([0, 30, 31, 31, 100], dtype=torch.int32, device=dev)
    q = torch.randn(100, 4, 64, device=dev, dtype=bf16, requires_grad=True)
    out = flash_attn_varlen_func(q, q, q, cu, cu, 69, 69, causal=True)
    out.backward(torch.randn_like(out))
    # Block-sparse
    q, k, v = qkv(1, 300, 2, 64)
    mask = local_global_block_mask(300, 300, local_blocks=1, global_blocks=1, causal=True, device=dev)
    block_sparse_attn_func(q, k, v, mask, causal=True).sum().backward()
    # KV cache: contiguous with in-place append and rotary, paged (page 16), split-KV with the combine kernel
    k_cache = torch.randn(2, 300, 2, 64, device=dev, dtype=bf16)
    v_cache = torch.randn_like(k_cache)
    q, k_new, v_new = (torch.randn(2, 1, h, 64, device=dev, dtype=bf16) for h in (4, 2, 2))
    seqlens = torch.tensor([100, 257], dtype=torch.int32, device=dev)
    cos, sin = torch.randn(300, 16, device=dev, dtype=bf16), torch.randn(300, 16, device=dev, dtype=bf16)
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
                            causal=True)
    for splits in (1, 3):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
    pages = torch.randn(40, 16, 2, 64, device=dev, dtype=bf16)
    table = torch.randperm(40, device=dev)[:38].view(2, 19).to(torch.int32)
    flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=seqlens, block_table=table, num_splits=2)
    # sm90: the Gluon kernels. The forward flash_attn_func takes at these lengths (configs.gluon_forward_choice:
    # d = 128 without a mask pingpong-fa3, causal and d = 64 single-ffma; the packed calls here are too short for
    # the Gluon varlen forward), the backward variants, then the ping-pong forward called directly (three stages,
    # causal, d = 256, packed, FP8: gluon_forward_pingpong).
    if torch.cuda.get_device_capability() == (9, 0) and os.environ.get("SANITIZE_PART") != "triton":
        for d, causal in ((128, False), (128, True), (64, False)):
            q = torch.randn(1, 1100, 4, d, device=dev, dtype=bf16, requires_grad=True)
            k, v = (torch.randn(1, 1300, 2, d, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            dout = torch.randn_like(out)
            out.backward(dout)
            gluon_backward_variants(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, causal)
            cu = torch.tensor([0, 1030, 2200], dtype=torch.int32, device=dev)
            packed = torch.randn(2200, 4, d, device=dev, dtype=bf16)
            flash_attn_varlen_func(packed, packed, packed, cu, cu, 1170, 1170, causal=causal)
        gluon_forward_pingpong()
if os.environ.get("SANITIZE_PART") not in ("one_pass", "triton", "gluon_fp8", "three16"):
    fp8_kernels()
torch.cuda.synchronize()
print("sanitized run done")
PY
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
  compute-sanitizer --tool $tool --error-exitcode 9 python3 "$script" > "$OUT/sanitize_$tool.log" 2>&1 || status=1
  tail -3 "$OUT/sanitize_$tool.log"
  # each distinct reported hazard once with its count (kernel offsets and source lines), for mapping to the SASS:
  # racecheck prints a hazard's two accesses on two lines ("... between X access at ..." and "and Y access at ..."),
  # joined here into one
  grep -E "access at" "$OUT/sanitize_$tool.log" | sed -E 's/^=+ +//' \
    | awk '/between/ { first = $0; next } { print (first ? first " | " : "") $0; first = "" }' \
    | sort | uniq -c | sort -rn | head -${SANITIZE_PAIRS:-0}
done
exit $status
