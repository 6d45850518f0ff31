"""Export a run of ours in the authors' checkpoint format (for people who use their code).

    python -m scripts.export_reference --run runs/X --out DIR [--step S] [--model-tag d12] [--tokenizer-dir DIR]

Writes their base-dir layout, so that their tools find it with ``NANOCHAT_BASE_DIR=DIR``:

    DIR/base_checkpoints/<tag>/model_<step:06d>.pt   their parameter names, fp32 tensors
    DIR/base_checkpoints/<tag>/meta_<step:06d>.json  step, val_bpb, model_type, model_config (their GPTConfig kwargs)
    DIR/tokenizer/tokenizer.pkl, token_bytes.pt      a pickled tiktoken Encoding; their token_bytes convention
    DIR/base_checkpoints/<tag>/<name>.json           grouped index only: the slot map in their nanochat_slot_map_v1
                                                     format, named by the meta's moe_ve_slot_map_path (absolute)

Weights stay fp32 (their loader keeps the dtype it is given), so ``import_reference`` of the result gives back
the same run bit for bit. Designs their format lacks (--model-type mobilellm/qwen3, --mlp moe, the appendix
memories, a conv1d router, token-only / fixed-random routing, bias or trust-region balancing) are refused by name.
The grouped index is their ``table`` slot mapping (nanochat.reference_slot_map). The meta's val_bpb is the one
the run measured at the exported step (its metrics.jsonl; null where none was).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from nanochat.cli_types import checkpoint_step
from nanochat.jsonfile import remove_stale_temps, write_atomic, written_path
from nanochat.terminal import replace_unencodable_output


class ExportWriteError(Exception):
    """Writing under --out failed (e.g. a full disk); what this export had added there was removed (but a kept
    shared file, which the message names)."""


class ExportInterrupted(KeyboardInterrupt):
    """Ctrl-C during the writes: what this export had added was removed; the argument says what of it is left."""


class ExportAdditions:
    """The paths this export created under --out, so that a failed or interrupted export removes exactly those:
    --out may be a base dir shared with earlier exports, or with another export writing at the same time. A file
    goes only if it was not there before this export and still is the very file (device, inode) it wrote (another
    export's rename over it keeps it); a directory only if this export made it and it is empty. A shared file (the
    tokenizer, a slot map) stays while another checkpoint is beside it: that export may have found it and use it."""

    def __init__(self, dirs):
        self.before = {Path(d): set(Path(d).iterdir()) if Path(d).is_dir() else set() for d in dirs}
        self.files, self.shared, self.dirs = {}, set(), []

    def make_dirs(self, path: Path) -> None:
        missing = []
        while not path.exists():
            missing.append(path)
            path = path.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:  # another export made it meanwhile: its, not this one's
                continue
            self.dirs.append(d)

    def note(self, path: Path, written=None, shared: bool = False) -> None:
        """``path`` was written by this export, through the file ``written`` (its temp name) or in place."""
        if path not in self.before.get(path.parent, ()):
            st = os.stat(written or path)
            self.files[path] = (st.st_dev, st.st_ino)
            if shared:
                self.shared.add(path)

    def write(self, path: Path, write) -> None:
        """``write_atomic(path, write)``, noted before its rename: a Ctrl-C just after the rename still finds it."""
        write_atomic(path, lambda tmp: (write(tmp), self.note(path, tmp)))

    def remove(self) -> str:
        """Remove what this export added; returns what of it is left, for the error line."""
        tokenizer, kept = {p for p in self.shared if p.parent.name == "tokenizer"}, {}
        # the checkpoint's own files, then a slot map, then the tokenizer: each shared file is judged once what
        # this export wrote beside it is gone (its slot map would keep the tokenizer, as another checkpoint does)
        for paths in (set(self.files) - self.shared, self.shared - tokenizer, tokenizer):
            for path in sorted(paths):
                folder = path.parent.parent / "base_checkpoints" if path in tokenizer else path.parent
                if path not in self.shared or not (folder.is_dir() and any(p != path for p in folder.iterdir())):
                    self._unlink_own(path)
                elif self._is_own(path):
                    kept.setdefault(folder, []).append(path)
            self._remove_empty_dirs()
        if not kept:
            return "nothing of this export was left"
        return "removed what this export added except " + "; ".join(
            f"{', '.join(map(str, paths))} (another checkpoint in {folder} may use {'them' if paths[1:] else 'it'})"
            for folder, paths in kept.items())

    def _is_own(self, path: Path) -> bool:
        """``path`` is still the very file this export wrote (not another export's rename over it, nor gone)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.files[path]

    def _unlink_own(self, path: Path) -> None:
        if self._is_own(path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _remove_empty_dirs(self) -> None:
        for d in reversed(self.dirs):
            try:
                d.rmdir()
            except OSError:  # not empty (another export's files, or a shared file kept) or gone
                pass


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", "--run-dir", dest="run", required=True, help="our run directory")
    ap.add_argument("--out", required=True, help="output base directory (their NANOCHAT_BASE_DIR layout)")
    ap.add_argument("--step", type=checkpoint_step, default=None, help="checkpoint step (default: the last one)")
    ap.add_argument("--model-tag", default=None, help="checkpoint sub-directory (default: d<n_layer>, as theirs)")
    ap.add_argument("--tokenizer-dir", default=None, help="override meta['tokenizer_dir']")
    args = ap.parse_args(argv)
    if args.model_tag is not None and (args.model_tag in ("", ".", "..") or any(c in args.model_tag for c in "/\\")):
        ap.error(f"--model-tag {args.model_tag!r}: must be a plain directory name (their base_checkpoints/<tag>)")
    return args


def val_bpb_of(meta: dict, run) -> float | None:
    """The validation bpb of the checkpoint's step, as their meta pairs it with the step: the run's metrics.jsonl
    record of that step (the final evaluation's at the last step; None where no val bpb was measured at it), the
    one an import carried, or, for a run without metrics.jsonl, the checkpoint's loop.val_bpb. Not loop.val_bpb
    where metrics.jsonl exists: that is the last PERIODIC eval's, an earlier step's at the final checkpoint."""
    from nanochat.report import read_metrics

    imported = ((meta.get("imported_from") or {}).get("reference_meta") or {}).get("val_bpb")
    try:
        records = read_metrics(run)
    except FileNotFoundError:
        loop_val = (meta.get("loop") or {}).get("val_bpb")
        return imported if loop_val is None else loop_val
    at_step = [r["val_bpb"] for r in records if r.get("kind") in ("eval", "final") and r.get("step") == meta["step"]
               and r.get("val_bpb") is not None]
    return at_step[-1] if at_step else imported


def export_reference(args) -> Path:
    from nanochat.analysis import run_tokenizer_dir
    from nanochat.checkpoint import load_model
    from nanochat import reference_slot_map
    from nanochat.reference_format import reference_from_config, state_to_reference
    from nanochat.reference_tokenizer import REFERENCE_TOKENIZER_FILES, write_reference_tokenizer
    from nanochat.tokenizer import check_vocab_matches, get_tokenizer

    model, meta = load_model(args.run, args.step)
    config, step = model.config, meta["step"]
    model_type, model_config = reference_from_config(config)
    tok = get_tokenizer(run_tokenizer_dir(args.tokenizer_dir, meta)[0])
    check_vocab_matches(tok, config.vocab_size, f"--run {args.run}", meta)
    state = state_to_reference(model.state_dict(), config)

    out = Path(args.out)
    ckpt_dir = out / "base_checkpoints" / (args.model_tag or f"d{config.n_layer}")
    model_path, meta_path = ckpt_dir / f"model_{step:06d}.pt", ckpt_dir / f"meta_{step:06d}.json"
    for path in (model_path, meta_path):
        if path.exists():
            raise FileExistsError(f"--out {out}: {path} already exists; choose a new directory or --model-tag")
    their_meta = {"step": step, "val_bpb": val_bpb_of(meta, args.run), "model_type": model_type,
                  "model_config": model_config, "user_config": {}, "max_seq_len": config.sequence_len,
                  "exported_from": {"run": str(Path(args.run).resolve()), "step": step,
                                    "model_config": config.to_dict()}}
    added = ExportAdditions([out / "tokenizer", ckpt_dir])
    try:
        # the checkpoint folder first: an export that fails meanwhile keeps a tokenizer this one found there
        added.make_dirs(ckpt_dir)
        added.make_dirs(out / "tokenizer")
        if write_reference_tokenizer(tok, out / "tokenizer"):
            for name in REFERENCE_TOKENIZER_FILES:
                added.note(out / "tokenizer" / name, shared=True)
        if model_config["moe_ve_slot_mapping"] == "table":  # their loader reads this path as given
            slot_map = reference_slot_map.export(model, tok, ckpt_dir, args.run)
            added.note(slot_map, shared=True)
            model_config["moe_ve_slot_map_path"] = str(slot_map.resolve())
        # temp files + rename, meta last: even a kill (no clean-up) never leaves a loadable half checkpoint; each
        # export has temp files of its own, so two exports of one step at once both finish whole
        added.write(model_path, lambda tmp: torch.save(state, tmp))
        added.write(meta_path, lambda tmp: tmp.write_text(json.dumps(their_meta, indent=2) + "\n", encoding="utf-8"))
    except BaseException as e:  # a full disk, Ctrl-C, a refusal midway: what this export added goes
        left = added.remove()
        if isinstance(e, OSError) and e.errno is not None:  # not one of the refusals above (they carry no errno)
            failed = written_path(e.filename, out)  # the file, not its temp name
            raise ExportWriteError(f"--out {out}: could not write {failed}: {e.strerror or e}; {left}") from None
        if isinstance(e, KeyboardInterrupt):
            raise ExportInterrupted(f"{left} in --out {out}") from None
        raise
    remove_stale_temps(ckpt_dir, ("model_*.pt", "*.json"))  # of exports killed midway (a model's is large)
    remove_stale_temps(out / "tokenizer", REFERENCE_TOKENIZER_FILES)
    print(f"wrote {ckpt_dir} (step {step}, model_type {model_type}) and {out / 'tokenizer'}")
    return ckpt_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        export_reference(args)
    except (FileNotFoundError, FileExistsError, ValueError, ExportWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # before the writes began (load_model, checks): nothing was written
        left = e.args[0] if isinstance(e, ExportInterrupted) else f"nothing of this export was left in --out {args.out}"
        print(f"interrupted; {left}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    replace_unencodable_output()
    sys.exit(main())
