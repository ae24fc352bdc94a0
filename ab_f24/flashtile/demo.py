"""``flashtile demo``: train a tiny character-level GPT that uses flashtile attention.

The text is Python's own standard-library source (present on every machine, nothing to download). Runs
on the GPU when there is one, else on the CPU through the tiled PyTorch path; prints the unigram
baseline (the loss of predicting each character by its frequency alone), the loss as it falls, a
generated sample, and writes a loss-curve PNG when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from .nn import GPT, GPTConfig


def load_corpus(max_chars: int) -> str:
    """Concatenated .py files of the standard library, sorted for reproducibility, up to max_chars."""
    root = Path(os.__file__).parent
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def unigram_loss(data: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats) of predicting every character by its corpus frequency."""
    counts = torch.bincount(data, minlength=vocab_size).double()
    probs = counts / counts.sum()
    nonzero = probs[probs > 0]
    return float(-(nonzero * nonzero.log()).sum())


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="flashtile demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200, help="training steps (default 1200)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--block", type=int, default=128, help="training sequence length in characters (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--embd", type=int, default=128, help="embedding width (default 128)")
    parser.add_argument("--heads", type=int, default=4,
                        help="query heads (default 4); key/value heads are half as many (GQA)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default 3e-3)")
    parser.add_argument("--chars", type=int, default=1_000_000, help="characters of corpus (default 1,000,000)")
    parser.add_argument("--plot", default="flashtile_demo_loss.png",
                        help="loss-curve PNG, written when matplotlib is installed ('' to skip)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and batches (default 0)")
    return parser


def main(args: argparse.Namespace | None = None) -> int:
    args = args or build_parser().parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    text = load_corpus(args.chars)
    chars = sorted(set(text))
    to_id = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([to_id[c] for c in text], dtype=torch.long)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    baseline = unigram_loss(train, len(chars))
    print(f"corpus: {len(text):,} characters of the Python standard library, {len(chars)} distinct; "
          f"device {device}")
    print(f"unigram baseline loss: {baseline:.3f} nats/char")

    config = GPTConfig(vocab_size=len(chars), block_size=args.block, n_layer=args.layers, n_head=args.heads,
                       n_kv_head=max(1, args.heads // 2), n_embd=args.embd)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def batch(source: torch.Tensor):
        starts = torch.randint(0, len(source) - args.block - 1, (args.batch,))
        x = torch.stack([source[s:s + args.block] for s in starts])
        y = torch.stack([source[s + 1:s + args.block + 1] for s in starts])
        return x.to(device), y.to(device)

    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batch(train)
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % max(1, args.steps // 40) == 0 or step == args.steps:
            done = step / args.steps
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            recent = sum(losses[-10:]) / len(losses[-10:])
            line_start = "\r" if sys.stdout.isatty() else "\n"  # a live bar on terminals, lines in logs
            sys.stdout.write(f"{line_start}[{bar}] step {step}/{args.steps} loss {recent:.3f} "
                             f"({time.perf_counter() - start:.0f} s)")
            sys.stdout.flush()
    print()
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        val_loss = sum(model(*batch(val))[1].item() for _ in range(10)) / 10
    final = sum(losses[-20:]) / len(losses[-20:])
    print(f"final training loss {final:.3f}, validation loss {val_loss:.3f}, unigram baseline {baseline:.3f} "
          f"nats/char ({'below' if val_loss < baseline else 'NOT below'} the baseline by {baseline - val_loss:.3f})")
    prompt = torch.tensor([[to_id[c] for c in "def "]], device=device)
    with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        sample = model.generate(prompt, args.block - prompt.shape[1], temperature=0.8)[0].tolist()
    print("sample:\n" + "".join(chars[i] for i in sample))
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no loss-curve PNG (pip install 'flashtile[plot]')")
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot(range(1, len(losses) + 1), losses, label="training loss")
            ax.axhline(baseline, color="gray", linestyle="--", label="unigram baseline")
            ax.set_xlabel("step")
            ax.set_ylabel("cross-entropy (nats/char)")
            ax.set_title("flashtile demo: character-level GPT on the Python stdlib")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=110)
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
