"""Where a Hugging Face decoding step's time goes: flashtile (launch plans on and off) against sdpa.

hf_bench.py's model and prompts (Llama 3.2 1B's shape, random bf16 weights, a dynamic cache), a short
greedy generate per implementation, then for flashtile: its recordings and replays per step, its host time by
function (cProfile) and each implementation's GPU time per kernel (torch.profiler).

    PYTHONPATH=. python benchmarks/lab/hf_profile.py [--new-tokens 64]   # on the GPU, from the repository root
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_bench  # noqa: E402

from flashtile import kernels  # noqa: E402
from flashtile.integrations.transformers import register  # noqa: E402
from flashtile.kernels import replay  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--order", default="flashtile,sdpa,flashtile_unplanned", help="rows, in this order")
    parser.add_argument("--same-lengths", action="store_true",
                        help="every run from the same prompt (later runs replay the plans recorded by the first)")
    parser.add_argument("--prefill-first", action="store_true",
                        help="time three prefill passes before each generate, as hf_bench.py does")
    args = parser.parse_args()
    register()
    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM._from_config(hf_bench.llama_config(False), attn_implementation="sdpa",
                                                           dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), device=device)
    settings = dict(do_sample=False, pad_token_id=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)

    def generate(cut: int = 0):
        with torch.no_grad():
            model.generate(prompt[:, cut:], **settings)
        torch.cuda.synchronize()

    counts = {"record": 0, "run": 0}
    record, run = kernels.record, replay.Plan.run

    def counted_record(*a, **k):
        counts["record"] += 1
        return record(*a, **k)

    def counted_run(self, inputs):
        counts["run"] += 1
        return run(self, inputs)

    # flashtile's calls reach record through the kernels package (flashtile.kernels.record)
    kernels.record, replay.Plan.run = counted_record, counted_run
    plans = "FLASHTILE_LAUNCH_PLANS"
    rows = {"sdpa": ("sdpa", {}), "flashtile": ("flashtile", {plans: "1"}),
            "flashtile_unplanned": ("flashtile", {plans: "0"})}
    for row in args.order.split(","):
        impl, env = rows[row]
        os.environ.update(env)
        hf_bench._use(model, impl)
        if args.prefill_first:
            for _ in range(3):
                with torch.no_grad():
                    model(prompt, logits_to_keep=1)
        # Runs at cache lengths no run saw before (prompts new_tokens apart, the last the whole prompt), as
        # with a user's new prompts, unless --same-lengths.
        cuts = [0] * 4 if args.same_lengths else [args.new_tokens * i for i in (3, 2, 1, 0)]
        generate(cuts[0])
        times = []
        for cut in cuts[1:]:
            counts.update(record=0, run=0)
            start = time.perf_counter()
            generate(cut)
            times.append(time.perf_counter() - start)
        steps = args.new_tokens
        print(f"{row}: generate {', '.join(f'{t * 1e3:.0f}' for t in times)} ms, "
              f"{min(times) / steps * 1e3:.2f} ms per token; recordings {counts['record'] / steps:.1f} and plan runs "
              f"{counts['run'] / steps:.1f} per token (last run)")
    os.environ["FLASHTILE_LAUNCH_PLANS"] = "1"
    hf_bench._use(model, "flashtile")
    profile = cProfile.Profile()
    profile.enable()
    generate()
    profile.disable()
    for sort in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(sort).print_stats(35)
        print(f"--- flashtile generate, cProfile by {sort}\n{text.getvalue()[-9000:]}")
    for impl in ("sdpa", "flashtile"):
        hf_bench._use(model, impl)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            generate()
        print(f"--- {impl}: GPU time per kernel\n"
              + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
