"""Build a MoME slot map (the paper's offline kNN token grouping, Sec. 3.4) from a trained checkpoint.

    python -m scripts.build_slot_map --checkpoint RUN_DIR --group-size 2 [--source wte|ve] [--step N]
           [--tokenizer-dir DIR] --output slot_map_c2.json

Takes the token embedding (``wte``, default) or the last (deepest) VE table (``ve``, needs a --memory ve run) of
the checkpoint, groups the vocabulary into V/c rows of exactly c mutually near tokens by cosine similarity and
writes a versioned JSON file (format in nanochat/memory/slot_map.py). The tokenizer (--tokenizer-dir, default the
checkpoint's run's) gives the special tokens, kept in rows of their own, and its fingerprint and BOS id, recorded
so that a run on another tokenizer refuses the map.

Not the authors' builder (not public): theirs also counted token frequencies over 20M tokens and orders slots by
frequency (slot 0 = {" the", " The"}); this one seeds the tightest neighbourhoods first and records no counts.
Their own maps (``nanochat_slot_map_v1``) load directly with --mome-slot-map.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanochat.cli_types import checkpoint_step, positive_int  # noqa: E402
from nanochat.jsonfile import written_path  # noqa: E402
from nanochat.memory.slot_map import build_groups, load_slot_map, write_slot_map  # noqa: E402
from nanochat.terminal import replace_unencodable_output  # noqa: E402


def run_tokenizer(directory, meta: dict):
    """--tokenizer-dir, else the tokenizer the checkpoint's run trained with; refused when neither is there (the
    specials would be grouped with ordinary tokens and the map could not be checked against a run's tokenizer)."""
    from nanochat.tokenizer import HEADER_FILE, get_tokenizer

    directory = directory or meta.get("tokenizer_dir")
    if not directory or not (Path(directory) / HEADER_FILE).is_file():
        raise ValueError(f"no tokenizer at {directory!r} (the checkpoint's run records "
                         f"{meta.get('tokenizer_dir')!r}): pass --tokenizer-dir DIR, the run's tokenizer")
    return get_tokenizer(directory)


def source_embedding(model, source: str) -> torch.Tensor:
    V = model.config.vocab_size
    if source == "wte":
        return model.wte.weight.detach()[:V]
    if source == "ve":
        if model.config.memory != "ve":
            raise ValueError(f"--source ve needs a --memory ve checkpoint (this one is --memory {model.config.memory})")
        return model.memory.tables[-1].weight.detach()[:V]  # the last (deepest) VE layer's table
    raise ValueError(f"--source {source!r} is unknown; allowed: wte, ve")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="run directory holding checkpoints/")
    ap.add_argument("--step", type=checkpoint_step, default=None, help="checkpoint step (default: the last one)")
    ap.add_argument("--group-size", type=positive_int, required=True, help="c_grp: tokens per row")
    ap.add_argument("--source", default="wte", choices=("wte", "ve"))
    ap.add_argument("--tokenizer-dir", default=None,
                    help="tokenizer of the run (specials, fingerprint, BOS; default: the checkpoint run's)")
    ap.add_argument("--knn", type=positive_int, default=64, help="neighbour-list length of the greedy pass")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    out = Path(args.output)
    # checked before the (long) build; the write renames a temp file over it, which would replace a device
    # such as /dev/full with a regular file (as root) or fail on a directory after all the work
    if out.exists() and not out.is_file():
        ap.error(f"--output {out} exists and is not a regular file; give the path of a .json file")
    if not out.parent.is_dir():
        ap.error(f"--output {out}: directory {out.parent} does not exist")
    return args


def build(args) -> None:
    from nanochat.checkpoint import load_model
    from nanochat.tokenizer import check_vocab_matches

    model, meta = load_model(args.checkpoint, args.step)
    V = model.config.vocab_size
    if V % args.group_size:
        raise ValueError(f"--group-size {args.group_size} must divide the vocab size {V}")
    tokenizer = run_tokenizer(args.tokenizer_dir, meta)
    # the one the checkpoint was trained with (its recorded fingerprint): the map is stamped with this tokenizer's
    # fingerprint and keeps its special ids apart, so another one would make a map for the wrong runs
    check_vocab_matches(tokenizer, V, f"--checkpoint {args.checkpoint}", meta)
    specials = sorted(int(i) for i in tokenizer.special_tokens.values())
    if any(not 0 <= i < V for i in specials):
        raise ValueError(f"--tokenizer-dir: special ids {specials} do not fit the model vocab {V}")
    emb = source_embedding(model, args.source)
    rows = build_groups(emb, args.group_size, special_ids=specials, k=args.knn)
    source_ckpt = f"{Path(args.checkpoint).resolve()}@step{meta['step']}"
    digest = write_slot_map(args.output, rows, V, args.group_size, source_checkpoint=source_ckpt, source=args.source,
                            tokenizer_fingerprint=tokenizer.fingerprint(), bos_token_id=tokenizer.bos_token_id,
                            special_token_ids=specials)
    load_slot_map(args.output, V, args.group_size, digest)  # round-trip check of what was just written
    print(f"wrote {args.output}: {len(rows)} rows of {args.group_size} tokens (vocab {V}, source {args.source}, "
          f"sha256 {digest[:12]})")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        build(args)
    except (FileNotFoundError, ValueError) as e:  # bad run dir / checkpoint / tokenizer / group size
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk: write_slot_map kept the old --output (if any), removed its temp file
        # --output itself, or write_slot_map's temp file for it
        writing = e.filename is not None and written_path(e.filename) == Path(args.output)
        print(f"error: could not write --output {args.output}: {e.strerror}" if writing else f"error: {e}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # write_slot_map removed its temp file, if it was writing
        print(f"interrupted; --output {args.output} was not written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
