"""On an H200: where the one-pass backward's fixed-point dQ differs from the float32 one (a debugging aid)."""

import torch

from flashtile import flash_attn_func
from flashtile.kernels import gluon_backward as gb

for d, causal in ((64, False), (128, True)):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 203, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    a = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal, one_pass="atomic")[0].float()
    f = gb.gluon_attention_backward(dout, q, k, v, out, lse, causal, one_pass="fixed")[0].float()
    diff = (a - f).abs()
    idx = torch.nonzero(diff == diff.max())[0].tolist()
    ratio = (f / a)[a.abs() > 1e-3]
    print(f"d={d} causal={causal}: max diff {diff.max().item():.3e} at {idx}: atomic {a[tuple(idx)].item():.4e} "
          f"fixed {f[tuple(idx)].item():.4e}; ratio fixed/atomic quantiles "
          f"{torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99], device='cuda')).tolist()}")
    bad = (diff > 1e-2).float()
    print("  bad fraction", bad.mean().item(), "bad per row (first 12 rows, head 0):", bad[0, :12, 0].sum(-1).tolist(),
          "bad per column group:", bad.sum((0, 1, 2)).view(-1, 8).sum(-1).tolist())
    delta = (out.float() * dout.float()).sum(-1).transpose(1, 2).contiguous()
    unit = gb.fixed_point_units(dout, k, v, delta, 1)
    print("  unit row", idx[1], unit[idx[0], idx[2], idx[1]].item(), "units of atomic value",
          (a[tuple(idx)] / (unit[idx[0], idx[2], idx[1]] * d ** -0.5)).item())
