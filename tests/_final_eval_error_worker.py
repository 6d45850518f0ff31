"""torchrun worker: scripts.base_train whose final evaluation raises an error (e.g. a broken eval bundle, an OOM)
on the ranks named by ``--fail-ranks R[,R...]``, while SIGTERM reaches the ranks named by ``--sigterm-ranks`` (""
names none) just before, inside the evaluation (latched for the next vote, which never comes). A rank that does not
fail runs the real val bpb, so it waits in that evaluation's collectives for the ranks that failed.

Each rank prints the branch its final evaluation took ("rank R final evaluation: raised E", E being FinalEvalError
where the error stops the run, or "...: returned REASON"). With BRANCH_BARRIER=1 in the environment no rank goes on
before every rank has printed its own (torchrun stops the ranks left once one has failed, which would otherwise race
with the slower rank's line); only for runs where every rank gets there by itself. AGREEMENT_WAIT_S replaces
nanochat.final_eval's wait for the other ranks' word after a failure."""

import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from nanochat import final_eval
from scripts import base_train

rank = int(os.environ["RANK"])
real_split_bpb, real_evaluate = final_eval.run_split_bpb, base_train.evaluate_at_the_end


def ranks(value: str) -> set[int]:
    return {int(r) for r in value.split(",") if r}


def run_split_bpb(*args, **kwargs):
    if rank in signalled:
        os.kill(os.getpid(), signal.SIGTERM)
    if rank in failing:
        raise RuntimeError(f"the eval bundle is broken (rank {rank})")
    return real_split_bpb(*args, **kwargs)


def report(branch: str) -> None:
    # one write of the whole line, ended by ';': print writes the text and its newline apart, so two ranks' lines
    # could run together ("raised RuntimeErrorrank 0 ...") and a word-pattern would read past the branch
    sys.stdout.write(f"rank {rank} final evaluation: {branch};\n")
    sys.stdout.flush()
    if os.environ.get("BRANCH_BARRIER"):
        store = dist.distributed_c10d._get_default_store()
        store.set(f"test_branch/{rank}", branch)
        store.wait([f"test_branch/{r}" for r in range(dist.get_world_size())], timedelta(seconds=60))


def evaluate_at_the_end(*args, **kwargs):
    try:
        reason = real_evaluate(*args, **kwargs)
    except Exception as e:
        report(f"raised {type(e).__name__}")
        raise
    report(f"returned {reason}")
    return reason


assert sys.argv[1] == "--fail-ranks" and sys.argv[3] == "--sigterm-ranks", sys.argv
failing, signalled = ranks(sys.argv[2]), ranks(sys.argv[4])
final_eval.run_split_bpb = run_split_bpb
base_train.evaluate_at_the_end = evaluate_at_the_end
if os.environ.get("AGREEMENT_WAIT_S"):
    final_eval.AGREEMENT_WAIT_S = float(os.environ["AGREEMENT_WAIT_S"])
sys.exit(base_train.main(sys.argv[5:]))
