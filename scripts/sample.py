"""Print completions of a prompt from a trained checkpoint.

    python -m scripts.sample --run runs/X --prompt "The capital of France is" [--step S] [--num-samples 3]
        [--max-tokens 64] [--temperature 0.8] [--top-k 50] [--seed 0]

Each sample is printed as soon as it is done: one that ends early (at the BOS token) before those still decoding,
the rest in order, so Ctrl-C keeps every finished one.

Decoding runs in fp32 with a KV cache, so attention is always PyTorch SDPA (the --attention kernels serve forwards
without a cache only), whatever the run trained with.
"""

import argparse
import math
import sys

import torch

from nanochat.checkpoint import load_model
from nanochat.cli_types import checkpoint_step, device_name, seed_int
from nanochat.common import autodetect_device
from nanochat.engine import iter_samples
from nanochat.lost_output import point_at_devnull
from nanochat.terminal import replace_unencodable_output


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory holding checkpoints/")
    p.add_argument("--step", type=checkpoint_step, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed, 0 to 2**32-1")
    p.add_argument("--tokenizer-dir", default=None, help="default: the one recorded in the checkpoint")
    p.add_argument("--device-type", type=device_name, default=None, help="cuda|mps|cpu (default: autodetect)")
    args = p.parse_args(argv)
    if args.num_samples < 1 or args.max_tokens < 1:
        p.error("--num-samples and --max-tokens must be >= 1")
    if args.top_k < 0:
        p.error(f"--top-k must be >= 0 (0 = no top-k filtering), got {args.top_k}")
    if not args.temperature >= 0 or math.isinf(args.temperature):  # nan fails >= (torch's error is a traceback)
        p.error(f"--temperature must be >= 0 and finite (0 = greedy), got {args.temperature}")
    return args


class StdoutError(Exception):
    """Printing the samples failed (e.g. a full disk under a redirect); not an OSError of reading the run."""


def show(text: str) -> None:
    try:
        print(text, flush=True)  # each sample as it comes: Ctrl-C keeps those shown
    except OSError as e:
        raise StdoutError(e.strerror or str(e)) from e


def sample(args) -> None:
    from nanochat.tokenizer import check_vocab_matches, get_tokenizer

    device = args.device_type or autodetect_device()
    model, meta = load_model(args.run, args.step, device=device)
    tokenizer = get_tokenizer(args.tokenizer_dir or meta.get("tokenizer_dir"))
    check_vocab_matches(tokenizer, model.config.vocab_size, f"checkpoint {args.run}", meta)
    for prompt in args.prompt:
        ids = [tokenizer.bos_token_id] + tokenizer.encode(prompt)
        samples = iter_samples(model, ids, args.max_tokens, num_samples=args.num_samples, temperature=args.temperature,
                               top_k=args.top_k or None, seed=args.seed, stop_ids={tokenizer.bos_token_id})
        for i, out in samples:
            show(f"--- sample {i} (step {meta['step']}) ---")
            if out and out[-1] == tokenizer.bos_token_id:
                out = out[:-1]  # the stop token ends the sample; it is not text
            show(prompt + tokenizer.decode(out))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        with torch.inference_mode():
            sample(args)
    except (OSError, ValueError) as e:  # bad run dir / checkpoint / tokenizer / prompt, an unreadable file
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except StdoutError as e:  # later writes to stdout (the exit's flush) would fail again
        point_at_devnull(sys.stdout)
        print(f"error: could not write the samples to stdout: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
