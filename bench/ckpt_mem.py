"""Host memory of a checkpoint's optimizer state per rank, old vs new, around a save and a load.

    torchrun --standalone --nproc_per_node=2 bench/ckpt_mem.py --mode old
    torchrun --standalone --nproc_per_node=2 bench/ckpt_mem.py --mode new
    (gloo on the CPU; --device cuda for nccl)

One AdamW table of --rows x --dim fp32 (default 204,800 x 128 = 105 MB, so its Adam moments are 210 MB: the
optimizer state dominates) in a MuonAdamW, row-sharded over the ranks (ZeRO-2), after one step.

* save, old: ``state_dict()`` (the full state gathered onto every rank), rank 0 writes it with torch.save.
  new: ``state_dict_on_rank0()`` (gathered onto rank 0 only, None elsewhere), rank 0 writes it.
* load, old: every rank ``torch.load``s the whole file, then ``load_state_dict`` keeps its shard.
  new: ``torch.load(mmap=True)`` (as ``nanochat.checkpoint.load_state``), then ``load_state_dict``.

Per rank and phase: the resident set before the phase and its peak during it (VmRSS / VmHWM of /proc/self/status,
the peak reset just before the phase via /proc/self/clear_refs, so the save's peak does not hide the load's);
"rise" = peak - before. Linux only. Rank 0 prints one JSON line per rank.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.proc_mem import resident_mib  # noqa: E402
from nanochat.common import compute_cleanup, compute_init  # noqa: E402
from nanochat.optim import MuonAdamW, OptimConfig, adamw_group  # noqa: E402


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5", encoding="utf-8")  # resets VmHWM to the current RSS (Linux >= 4.0)


def phase(name: str, fn, out: dict) -> None:
    dist.barrier()
    reset_peak()
    before = resident_mib()["VmRSS"]
    fn()
    peak = resident_mib()["VmHWM"]
    dist.barrier()
    out[name] = {"before_mb": round(before, 1), "peak_mb": round(peak, 1), "rise_mb": round(peak - before, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["old", "new"], required=True)
    ap.add_argument("--rows", type=int, default=204_800)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="where the checkpoint file goes (default: a temporary directory)")
    args = ap.parse_args()
    info, device = compute_init(args.device)
    rank, world = info.rank, info.world_size

    table = torch.nn.Parameter(torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(0),
                                           ).to(device))
    group = adamw_group("table", [table], 0.01, OptimConfig())
    group["initial_lr"] = group["lr"]
    opt = MuonAdamW([group])
    table.grad = torch.randn_like(table)
    opt.step()

    tmp = tempfile.TemporaryDirectory() if args.dir is None else None
    path_box = [Path(args.dir or tmp.name) / "state.pt"]
    dist.broadcast_object_list(path_box, src=0)  # rank 0's directory (every rank reads the one file)
    path = path_box[0]
    out = {}

    def save():
        sd = opt.state_dict() if args.mode == "old" else opt.state_dict_on_rank0()
        if rank == 0:
            torch.save({"optimizer": sd}, path)

    def load():
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=args.mode == "new")
        opt.load_state_dict(state["optimizer"])

    phase("save", save, out)
    phase("load", load, out)
    shard_mb = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()) / 2**20
    res = {"mode": args.mode, "rank": rank, "world": world, "table_mb": round(table.numel() * 4 / 2**20, 1),
           "state_shard_mb": round(shard_mb, 1), **out}
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        for r in gathered:
            print(json.dumps(r), flush=True)
    dist.barrier()
    if tmp is not None and rank == 0:
        tmp.cleanup()
    compute_cleanup()


if __name__ == "__main__":
    main()
