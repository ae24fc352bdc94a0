"""Hugging Face transformers: attn_implementation="flashtile" against "sdpa" on one ~1B Llama-shaped model.

Random weights (Llama 3.2 1B's shape: 16 layers, hidden 2048, 32 query / 8 key-value heads of 64, vocab
128256, about 1.24B parameters), bf16, nothing downloaded. One model; each row switches its attention with
``model.set_attn_implementation``, so every row runs the same weights.

- generate: greedy generation from 8 prompts of 4096 random tokens, 256 new tokens each (a dynamic
  cache): prefill tokens/s (the prompt's forward pass, timed alone), decode tokens/s (the other 255 steps)
  and end-to-end new tokens/s. Each generate run's prompt is 256 tokens shorter than the next run's (the
  last run's has all 4096), so that no run decodes at cache lengths an earlier run saw. ``--cache static``:
  transformers' static cache instead (preallocated, of one size for every run; transformers compiles its steps on
  a GPU).
- train: one training step (forward, loss, backward; no optimizer) over 16,384 tokens of sequences of random
  lengths: flashtile padding-free (one row from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
  against sdpa on the same sequences right-padded to the longest, plus flashtile on the padded batch and
  sdpa on the packed row (transformers then builds a 4-D block-diagonal mask). tokens/s counts real tokens.

    PYTHONPATH=. python benchmarks/hf_bench.py --json $OUT/hf_bench.json   # on the GPU, from the repository root
    PYTHONPATH=. python benchmarks/hf_bench.py --small                     # seconds on a CPU: a smoke test

Prints markdown tables. Each number is the median of ``--repeats`` timed runs after one untimed run (which
also lets flashtile autotune its tiles for these shapes).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import transformers

import flashtile
from flashtile.bench import environment
from flashtile.integrations.transformers import register

IMPLEMENTATIONS = ("flashtile", "sdpa")


def llama_config(small: bool) -> transformers.LlamaConfig:
    if small:
        return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=1024)
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                    max_position_embeddings=8192, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls of fn after one untimed call, and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _use(model, impl: str) -> None:
    model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:
        raise RuntimeError(f"asked for attn_implementation={impl!r}, the model runs "
                           f"{model.config._attn_implementation!r}")


def bench_generate(model, args, device) -> list[dict]:
    # Token 0 is the pad token below: generate() would read a prompt holding it as padded there (a mask
    # with holes), so the prompts draw from the other tokens, and their mask says every token is real.
    prompt = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt_len), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    # min_new_tokens: random weights may emit the end-of-sequence token; every row makes all its tokens.
    settings = dict(do_sample=False, pad_token_id=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    if args.cache == "static":  # preallocated, longer than the tokens so far: a mask with every key real each step
        # One size for every run, as a server fixes its ceiling: a static cache of a new size is a new compile
        # (transformers sizes it to the longest call so far), which would land in the timed run.
        settings.update(cache_implementation="static", max_cache_len=args.prompt_len + args.new_tokens)
    rows, outputs = [], {}
    for impl in IMPLEMENTATIONS:
        _use(model, impl)
        runs = iter(range(args.repeats + 1))

        def generate(runs=runs):
            # Each run's prompt is new_tokens shorter than the next run's (the last run's is the whole prompt):
            # no run decodes at cache lengths an earlier run saw, as with a user's new prompts (flashtile
            # records a launch plan per new length; lengths seen before would only replay).
            cut = min(args.new_tokens * (args.repeats - next(runs)), args.prompt_len - 1)
            return model.generate(prompt[:, cut:], attention_mask=torch.ones_like(prompt[:, cut:]), **settings)

        with torch.no_grad():
            prefill_s, _ = _timed(lambda: model(prompt, logits_to_keep=1), device, args.repeats)
            total_s, outputs[impl] = _timed(generate, device, args.repeats)
        decode_s = max(total_s - prefill_s, 1e-9)
        rows.append({"impl": impl, "prefill_s": prefill_s, "generate_s": total_s,
                     "prefill_tok_s": args.batch * args.prompt_len / prefill_s,
                     "decode_tok_s": args.batch * (args.new_tokens - 1) / decode_s,
                     "new_tok_s": args.batch * args.new_tokens / total_s})
    ours, theirs = (outputs[impl][:, args.prompt_len:] for impl in IMPLEMENTATIONS)
    # bf16 rounding differs between the kernels, and greedy tokens of random weights diverge after a near tie.
    rows[0]["same_tokens_as_sdpa"] = float((ours == theirs).float().mean())
    return rows


def packed_lengths(total: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """Random sequence lengths in [shortest, longest] summing to ``total`` (the last one cut to fit)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(shortest, longest), total - sum(lengths)))
    return lengths


def training_batches(lengths: list[int], vocab: int, device) -> tuple[dict, dict]:
    """The same sequences as one padding-free row (with the flash keywords) and right-padded."""
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    packed = collator([{"input_ids": s.tolist()} for s in sequences])
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, :len(s)], mask[row, :len(s)] = s, 1
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    move = lambda batch: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # noqa: E731
    return move(packed), move(padded)


def bench_train(model, args, device) -> list[dict]:
    lengths = packed_lengths(args.train_tokens, args.shortest, args.longest)
    packed, padded = training_batches(lengths, model.config.vocab_size, device)
    sdpa_packed = {k: packed[k] for k in ("input_ids", "labels", "position_ids")}  # SDPA has no varlen keywords
    cases = [("flashtile", "packed", packed), ("sdpa", "padded", padded), ("flashtile", "padded", padded),
             ("sdpa", "packed (4-D mask)", sdpa_packed)]
    model.train()
    rows = []
    for impl, layout, batch in cases:
        _use(model, impl)

        def step(batch=batch):
            model.zero_grad(set_to_none=True)
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            return loss.detach()

        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            seconds, loss = _timed(step, device, args.repeats)
        except torch.OutOfMemoryError:
            rows.append({"impl": impl, "layout": layout, "error": "out of memory"})
            continue
        finally:
            model.zero_grad(set_to_none=True)
        rows.append({"impl": impl, "layout": layout, "tokens": int(batch["input_ids"].numel()), "step_s": seconds,
                     "tok_s": sum(lengths) / seconds, "loss": float(loss),
                     "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None})
    model.eval()
    return rows, lengths


def _markdown(generate_rows: list[dict], train_rows: list[dict], lengths: list[int], args) -> str:
    lines = [f"Generation: {args.batch} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each "
             f"(greedy, {args.cache} cache)", "",
             "| attention | prefill tok/s | decode tok/s | new tok/s end to end | prefill s | generate s |",
             "|---|---|---|---|---|---|"]
    for r in generate_rows:
        lines.append(f"| {r['impl']} | {r['prefill_tok_s']:,.0f} | {r['decode_tok_s']:,.0f} | {r['new_tok_s']:,.0f} "
                     f"| {r['prefill_s']:.3f} | {r['generate_s']:.3f} |")
    lines += ["", f"flashtile's new tokens equal to sdpa's: {generate_rows[0]['same_tokens_as_sdpa']:.1%}", "",
              f"Training step (forward + backward): {sum(lengths):,} real tokens in {len(lengths)} sequences of "
              f"{min(lengths)}-{max(lengths)} tokens", "",
              "| attention | batch | tokens computed | real tok/s | step s | loss | peak GiB |",
              "|---|---|---|---|---|---|---|"]
    for r in train_rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['layout']} | | {r['error']} | | | |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
        lines.append(f"| {r['impl']} | {r['layout']} | {r['tokens']:,} | {r['tok_s']:,.0f} | {r['step_s']:.3f} "
                     f"| {r['loss']:.4f} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny model and sizes: a CPU smoke run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch", type=int, default=None, help="prompts (default 8; --small 2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 4096; --small 32")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256; --small 6")
    parser.add_argument("--train-tokens", type=int, default=None, help="default 16384; --small 200")
    parser.add_argument("--shortest", type=int, default=None, help="shortest packed sequence (default 256; --small 8)")
    parser.add_argument("--longest", type=int, default=None, help="longest packed sequence (default 4096; --small 64)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per number (default 3; --small 1)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: generate, train")
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "static"],
                        help="generate's KV cache (transformers' cache_implementation)")
    parser.add_argument("--json", default=None, help="write every row and the environment here")
    args = parser.parse_args()
    defaults = dict(batch=(8, 2), prompt_len=(4096, 32), new_tokens=(256, 6), train_tokens=(16384, 200),
                    shortest=(256, 8), longest=(4096, 64), repeats=(3, 1))
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the decode rate needs a step after the prefill)")

    register()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = llama_config(args.small)
    with device:  # initialised where it runs (1.24B normal draws are slow on a CPU)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                           dtype=getattr(torch, args.dtype))
    model = model.to(device).eval()
    # flashtile's path: run from the repository root with PYTHONPATH=. so that this tree's flashtile is the one
    # imported (a script's own folder, benchmarks/, comes first on sys.path, not the current directory).
    env = environment() | {"flashtile": flashtile.__file__, "transformers": transformers.__version__,
                           "device": str(device), "dtype": args.dtype,
                           "parameters": sum(p.numel() for p in model.parameters())}
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    skip = set(filter(None, args.skip.split(",")))
    generate_rows = bench_generate(model, args, device) if "generate" not in skip else []
    train_rows, lengths = bench_train(model, args, device) if "train" not in skip else ([], [])
    print(_markdown(generate_rows, train_rows, lengths, args) if generate_rows and train_rows else
          json.dumps({"generate": generate_rows, "train": train_rows}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "generate": generate_rows, "train": train_rows,
                       "lengths": lengths}, f, indent=1)


if __name__ == "__main__":
    main()
