"""torchrun worker: scripts.base_train where rank 0's write of checkpoint step 4 fails (a full disk: ENOSPC on
state.pt). Rank 0 alone writes checkpoints, so the other ranks wait for it: they must stop with it, not crash on a
closed connection (gloo) or wait in a collective (NCCL)."""

import errno
import os
import sys

from nanochat import checkpoint as ckpt
from scripts import base_train

real_write = ckpt._write_file


def write_file(path, write_fn):
    if os.environ["RANK"] == "0" and path.name == "state.pt" and path.parent.name.endswith("step_000004"):
        path.write_bytes(b"\0" * 4096)  # the part written before the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return real_write(path, write_fn)


ckpt._write_file = write_file
sys.exit(base_train.main(sys.argv[1:]))
