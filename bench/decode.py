"""Tokens/s of cached greedy decoding (``nanochat.engine.generate``) for a small nanochat model.

    python bench/decode.py [--device cpu|cuda] [--autocast bf16|none] [--depth 4] [--width 256] [--head-dim 64]
        [--window-pattern SL] [--seq-len 256] [--prompt 64] [--tokens 448] [--batch 1] [--reps 5] [--threads 1]

S layers of --window-pattern see seq_len // 2 keys, so a decode longer than that exercises the sliding window.
Prints the median and the minimum over --reps of (prefill + decode) wall time and the decoded tokens/s
(batch x tokens / time) of both. On a shared CPU, load from other processes inflates single runs by up to 10x
(seen 2026-11-26): compare the minima of interleaved runs, with --threads 1.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python bench/decode.py` from anywhere
    sys.path.insert(0, str(REPO))

from nanochat.cli_types import device_name  # noqa: E402
from nanochat.common import autocast_context  # noqa: E402
from nanochat.engine import generate  # noqa: E402
from nanochat.gpt import GPTConfig, build_model  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", type=device_name, default="cpu")
    p.add_argument("--autocast", choices=["bf16", "none"], default="bf16")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window-pattern", default="SL")
    p.add_argument("--memory", default="base")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=448)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    n_head = args.width // args.head_dim
    cfg = GPTConfig(sequence_len=args.seq_len, vocab_size=512, n_layer=args.depth, n_head=n_head, n_kv_head=n_head,
                    n_embd=args.width, window_pattern=args.window_pattern, memory=args.memory)
    model = build_model(cfg, device=device, seed=0).eval()
    prompt = torch.randint(0, 512, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    amp = autocast_context(device.type, "bfloat16" if args.autocast == "bf16" else "float32")
    times = []
    with amp:
        generate(model, prompt, max_tokens=8, num_samples=args.batch, temperature=0.0)  # warm-up
        for _ in range(args.reps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            generate(model, prompt, max_tokens=args.tokens, num_samples=args.batch, temperature=0.0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    sec, best = statistics.median(times), min(times)
    n = args.batch * args.tokens
    out = {"seconds": sec, "tok_per_s": n / sec, "min_seconds": best, "min_tok_per_s": n / best,
           "windows": cfg.attention_windows}
    print(f"depth {args.depth} width {args.width} windows {cfg.attention_windows} autocast {args.autocast} "
          f"batch {args.batch} prompt {args.prompt} tokens {args.tokens} threads {torch.get_num_threads()}: "
          f"median {sec:.3f} s ({n / sec:.1f} tok/s), min {best:.3f} s ({n / best:.1f} tok/s) of {args.reps}",
          flush=True)
    return out


if __name__ == "__main__":
    main()
