#!/usr/bin/env bash
# The main job, one command on a fresh machine:  bash speedrun.sh
#
# * CUDA GPUs + internet: set up .venv, download FineWeb-Edu shards, train the 32768-token tokenizer, train the
#   paper's d12 MoME (A2/6, token index; configs/d12/mome_c1_m6.toml) at 3e18 FLOPs with torchrun, evaluate
#   (val bpb + CORE) and write runs/speedrun_d12_mome/report.md. Re-running resumes from the last checkpoint.
#   The process count and device batch are chosen so that 524,288 tokens/step split exactly (1, 2, 4 or 8
#   processes: 3 GPUs use 2, 5-7 use 4) and checked with a dry run before anything is downloaded.
# * No GPU: say so and run the CPU demo instead: embedded corpus -> 4096-token tokenizer -> tiny Base and tiny MoME
#   models (a few minutes each where the CPU has native bf16; in float32 on a CPU without it, where bf16 matmuls
#   take torch's slow path) -> val bpb + CORE -> runs/speedrun_cpu/report.md.
# * Re-running either one does only what is left: a run that completed with its final evaluation and the same flags
#   (its learning rates may have been changed by hand on a resume with --resume-override-lr, as a non-finite stop
#   advises: said, and named in its report) is not trained or evaluated again (one stopped in its final evaluation
#   runs it), shards already downloaded and a complete embedded corpus are kept, and a finished one just says where
#   its report is. One speedrun.sh per checkout (and on the GPU path per data root) at a time: a second one stops at
#   once and says what runs.
#   scripts/setup_env.sh reuses .venv when it is unchanged since its last successful install (a stamp in .venv;
#   SETUP_REINSTALL=1 installs anyway).
# * GPUs that torch cannot use (a CPU torch in .venv, a driver too old for the wheel) or no internet on a GPU
#   machine: stop with what to do; a GPU machine never runs the CPU demo unless asked (SPEEDRUN_MODE=cpu).
#
# Environment overrides: SPEEDRUN_MODE=gpu|cpu (skip detection), NANOCHAT_DATA_DIR (root of the prepared data,
# default ~/.cache/nanochat/data), SHARDS (GPU train shards, default 100),
# DEVICE_BATCH (largest GPU rows per micro-batch, default 32), DEMO_STEPS (CPU steps per model, default 300),
# DEMO_CORE_MAX (CORE examples per task on CPU, default 24), DEMO_DTYPE=bfloat16|float32 (CPU demo dtype, default:
# bfloat16 on a CPU with native bf16 matmuls, AVX512-BF16 or AMX, else float32), SETUP_REINSTALL=1 (install .venv
# even when unchanged).
set -euo pipefail
cd "$(dirname "$0")"
# overrides are checked before anything runs (a bad DEMO_STEPS used to fail only at base_train, after the data)
for name in SHARDS DEVICE_BATCH DEMO_STEPS; do
    [[ -z "${!name:-}" || "${!name}" =~ ^[1-9][0-9]*$ ]] || {
        echo "[speedrun] $name must be a positive integer (got '${!name}')" >&2; exit 2; }
done
[[ -z "${DEMO_CORE_MAX:-}" || "$DEMO_CORE_MAX" =~ ^(-1|[1-9][0-9]*)$ ]] || {
    echo "[speedrun] DEMO_CORE_MAX must be a positive integer or -1 for every example (got '$DEMO_CORE_MAX')" >&2
    exit 2; }
[[ -z "${DEMO_DTYPE:-}" || "$DEMO_DTYPE" =~ ^(bfloat16|float32)$ ]] || {
    echo "[speedrun] DEMO_DTYPE must be bfloat16 or float32 (got '$DEMO_DTYPE')" >&2; exit 2; }

# One speedrun.sh per checkout, taken before anything runs (setup_env.sh rebuilding .venv under a running one
# would collide too, and the mode is not known yet): a second one stops here, naming what the first one runs
# (runs/speedrun.lock holds that line). The GPU path also takes a lock in the data root (take_lock in gpu_run):
# two checkouts of one user share it, and would share the GPUs.
# shellcheck source=scripts/one_at_a_time.sh
. scripts/one_at_a_time.sh
take_lock() {  # take_lock FILE WHAT: hold FILE's lock until this script exits and write WHAT in it, or stop
    local fd rc=0 held
    exec {fd}>>"$1"  # open for writing: flock(2) on NFS needs it
    # refused at once, not waited for: a run of hours; a lock none can take here (one line says so) is no other run
    lock_now "$fd" -x speedrun "$1" "not checking for another speedrun.sh" || rc=$?
    if [ "$rc" = 75 ]; then
        held="$(head -n 1 "$1")"  # empty only in the instant between the holder's lock and its line
        echo "[speedrun] another speedrun.sh is running ${held:-(lock $1)}: wait for it to finish or stop it" >&2
        exit 2
    fi
    echo "$2" >"$1"  # the lock is the open file's, which this rewrite keeps
}
mkdir -p runs
take_lock runs/speedrun.lock "in $PWD (pid $$; setting up)"

# Each step runs as a child this shell waits for, and a SIGINT/SIGTERM sent to speedrun.sh alone (kill PID, a
# scheduler) or to its process group (Ctrl-C) is passed on to it: the step stops the way Ctrl-C stops it (base_train
# saves a checkpoint) and the script stops with exit 1 and says where (a signal between two steps stops it before the
# next one). Without this bash exits at once on SIGTERM, leaving the step running unseen (holding its run dir), and
# ignores a SIGINT sent to it alone until the step ends. The step stays in this script's process group, so a
# terminal's Ctrl-C reaches it twice (directly and from the trap; torchrun then shuts its workers down a second time,
# with SIGTERM, and a new grace period): in a group of its own, a hang-up, Ctrl-Z, Ctrl-\ or a `kill -9 -PGID`
# would no longer reach it, and a step left running holds its run's lock.
# A signal that lands after a step is forked but before `child=$!` records it has no step to go to yet: `early`
# keeps it for step() to send on (traps run between commands, so it is sent exactly once either way).
child="" stopped="" last="" early=""
pass_on() {  # pass_on SIG: the trap of each stop signal (the step gets it, or step() sends it once it starts)
    stopped="SIG$1"
    if [ -n "$child" ]; then kill -s "$1" "$child" 2>/dev/null || true; else early=1; fi
}
# Slurm's pre-emption notice (`sbatch --signal=USR1@90`) stops a run as SIGTERM does (base_train saves); bash and
# torchrun would otherwise die of it. Slurm signals every process of the step: a step gets it twice (directly and
# from this trap) and still saves, as with a scheduler's SIGTERM
trap 'pass_on INT' INT
trap 'pass_on TERM' TERM
trap 'pass_on USR1' USR1
step() {
    local name="$1" rc=0
    [ "$1" != python ] || name="$3"  # python -m MODULE
    [ "$1" != bash ] || name="$2"  # bash SCRIPT
    [ -z "$stopped" ] || stop_here "after $last"  # a signal between two steps (no step to pass it to)
    # an asynchronous child would ignore SIGINT: restore it; no copy of .venv's lock (one left running keeps none)
    ( trap - INT TERM USR1; exec "$@" 8<&- ) &
    child=$! last="$name"
    [ -z "$early" ] || kill -s "${stopped#SIG}" "$child" 2>/dev/null || true  # it came before $child was set
    early=""
    while wait "$child"; [ $? -gt 128 ] && kill -0 "$child" 2>/dev/null; do :; done  # a signal ends `wait` early
    wait "$child" || rc=$?  # the step's own exit status
    child=""
    # a step stopped by the signal exits non-zero (base_train saves and exits 0: the demo's finished() says where)
    [ "$rc" = 0 ] || [ -z "$stopped" ] || stop_here "during $name"
    # killed by a signal this script did not get: the OOM killer's SIGKILL, a kill of the step alone, or a second
    # Ctrl-C where this script started with SIGINT ignored (`bash speedrun.sh &` in a script), so no trap was set
    local sig
    if [ "$rc" -gt 128 ] && sig="$(kill -l "$rc" 2>/dev/null)"; then
        echo "[speedrun] ${demo:-speedrun} stopped: $name was killed by SIG$sig (exit $rc): run 'bash speedrun.sh'" \
             "again to continue" >&2
        exit "$rc"
    fi
    return "$rc"
}
stop_here() {
    echo "[speedrun] ${demo:-speedrun} stopped ($stopped) $1: run 'bash speedrun.sh' again to continue" >&2
    exit 1
}
# A run's state, as scripts.speedrun_preflight gives it: "done" (finished with these flags, final evaluation
# included), "train", or "train,FLAG=VALUE,...": a run continued by hand with other learning rates (a non-finite
# stop's advice: --resume N --resume-override-lr) and stopped again, whose --resume auto needs the LRs its checkpoint
# records (with speedrun's it is refused). resume_lrs STATE sets the array `lrs` to those flags (none for the others;
# expanded as ${lrs[@]+"${lrs[@]}"}: bash before 4.4 calls an empty array unbound under set -u)
resume_lrs() {
    lrs=()
    if [[ "$1" == train,* ]]; then IFS=, read -ra lrs <<<"${1#train,}"; fi
}
say_done() {
    echo "[speedrun] $1 already done (completed with its final evaluation): not trained again"
}

step bash scripts/setup_env.sh
hold_venv speedrun  # .venv's lock, shared: an install (test.sh's, a user's) waits for this run
# shellcheck disable=SC1091
. .venv/bin/activate
export PYTHONUNBUFFERED=1
# a stop's way on, as base_train says it (nanochat/run_control.how_to_continue): this command, not base_train's
# --resume, which speedrun.sh passes itself
export NANOCHAT_CONTINUE_COMMAND="bash speedrun.sh"

gpu_run() {
    local ngpu="$1" data="${NANOCHAT_DATA_DIR:-$HOME/.cache/nanochat/data}/fineweb-edu" run=runs/speedrun_d12_mome
    # the paper's d12 row: MoME A2/6 (token index) at 3e18 FLOPs, 524,288-token steps of 2048-token rows
    local train=(--config configs/d12/mome_c1_m6.toml --run-dir "$run" --run-name speedrun_d12_mome --save-every 500
                 --data-dir "$data" --tokenizer-dir tokenizer --resume auto)
    echo "the d12 MoME run in $run (pid $$)" >runs/speedrun.lock  # what a second speedrun.sh is told
    mkdir -p "$(dirname "$data")"
    take_lock "$(dirname "$data")/speedrun-gpu.lock" "the d12 MoME run of $PWD (pid $$) on this machine's GPUs"
    echo "[speedrun] $ngpu CUDA GPU(s) and internet: d12 MoME A2/6 at 3e18 FLOPs"
    # processes x device batch that split the batch exactly on these GPUs, and a dry run of every flag with that
    # layout: a bad combination stops here, before any download or tokenizer training
    local layout nproc device_batch
    layout="$(python -m scripts.speedrun_preflight layout --gpus "$ngpu" --max-device-batch "${DEVICE_BATCH:-32}" \
        -- "${train[@]}")"
    read -r nproc device_batch <<<"$layout"
    train+=(--device-batch-size "$device_batch")
    local state lrs
    if state="$(python -m scripts.speedrun_preflight "done" "$run" -- "${train[@]}")"; then
        say_done "$run"
        if [ -f "$run/comparison.md" ]; then
            echo "[speedrun] d12 MoME already done: report at $run/report.md and $run/comparison.md (delete $run" \
                 "to train it again)"
            return 0
        fi
    else
        # shards already in $data are kept (only the missing ones are downloaded; every shard's footer is checked)
        step python -m scripts.prepare_data --dataset fineweb-edu --num-shards "${SHARDS:-100}" --data-dir "$data"
        [ -f tokenizer/tokenizer.json ] || \
            step python -m scripts.tok_train --vocab-size 32768 --data-dir "$data" --output-dir tokenizer
        resume_lrs "$state"
        # torchrun's defaults plus SIGUSR1 (--signals-to-handle's environment form; a torch without it ignores it):
        # torchrun passes a SIGUSR1 on to the workers and waits for their save instead of dying of it
        export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
        step torchrun --standalone --nproc_per_node="$nproc" -m scripts.base_train "${train[@]}" ${lrs[@]+"${lrs[@]}"}
    fi
    # base_train wrote $run/report.md (provenance, throughput, metrics); add the table and curves beside it
    step python -m scripts.report "$run" --output "$run/comparison.md" --title "speedrun: d12 MoME (A2/6) at 3e18 FLOPs"
}

# The CPU demo's two models, all but their --dtype: chosen with the mode below, in the same Python start
root=runs/speedrun_cpu bundle=subset
[ -f ../shared/eval_bundle/core.yaml ] && bundle=../shared/eval_bundle
# a checkpoint every 50 steps (the last one kept): a crash or a second Ctrl-C loses at most 50 steps of a model
common=(--data-dir "$root/data" --tokenizer-dir "$root/tokenizer" --depth 4 --head-dim 64 --max-seq-len 256
        --device-batch-size 16 --total-batch-size 4096 --num-iterations "${DEMO_STEPS:-300}" --eval-every -1
        --eval-tokens 65536 --bundle "$bundle" --core-max-per-task "${DEMO_CORE_MAX:-24}" --log-every 10
        --save-every 50 --keep-last 1 --resume auto)
base=("${common[@]}" --memory base --run-name speedrun_cpu_base --run-dir "$root/base")
mome=("${common[@]}" --memory mome --mome-slots 6 --mome-topk 2 --run-name speedrun_cpu_mome --run-dir "$root/mome")

cpu_demo() {  # cpu_demo DTYPE BASE MOME: the dtype and each model's state (resume_lrs), as the mode check said them
    local dtype="$1" t0=$SECONDS lrs
    demo="CPU demo"
    echo "the CPU demo in $root (pid $$)" >runs/speedrun.lock  # what a second speedrun.sh is told
    resume_lrs "$2"
    base=(--dtype "$dtype" "${base[@]}" ${lrs[@]+"${lrs[@]}"})
    resume_lrs "$3"
    mome=(--dtype "$dtype" "${mome[@]}" ${lrs[@]+"${lrs[@]}"})
    # a run that completed with its final evaluation and these flags is not trained or evaluated again (one stopped
    # in its final evaluation is: base_train --resume runs it); when both are, neither is the data or the tokenizer
    local train_base=yes train_mome=yes
    if [ "$2" = done ]; then train_base=""; say_done "$root/base"; fi
    if [ "$3" = done ]; then train_mome=""; say_done "$root/mome"; fi
    if [ -z "$train_base$train_mome" ] && [ -f "$root/report.md" ]; then
        echo "[speedrun] CPU demo already done: report at $root/report.md (delete $root to run it again)"
        return 0
    fi
    if [ -n "$train_base$train_mome" ]; then
        # what is left and its length: the one measured time is the default demo's in bf16 (README)
        local what="tiny Base vs tiny MoME"
        [ -n "$train_base" ] || what="tiny MoME (tiny Base is done)"
        [ -n "$train_mome" ] || what="tiny Base (tiny MoME is done)"
        echo "[speedrun] CPU demo in $dtype: $what on the embedded corpus, ${DEMO_STEPS:-300} steps of 4,096 tokens" \
             "each, then each one's val/train bpb and CORE; the progress bars show each model's ETA (the default 300" \
             "steps took 10-16 min in all on 2 Xeon cores with native bf16)"
        step python -m scripts.prepare_data --dataset embedded --data-dir "$root/data"  # keeps a complete one
        [ -f "$root/tokenizer/tokenizer.json" ] || \
            step python -m scripts.tok_train --vocab-size 4096 --data-dir "$root/data" --output-dir "$root/tokenizer"
    fi
    # a model stopped early (Ctrl-C, SIGTERM) exits 0 after saving: stop here instead of reporting it as done;
    # running speedrun.sh again continues it from its checkpoint (--resume auto)
    finished() {
        python -m scripts.report --check-completed "$1" && return 0
        echo "[speedrun] CPU demo interrupted: run 'bash speedrun.sh' again to continue from the checkpoint" >&2
        exit 1
    }
    # base_train exits 2 for what it refuses before training; with a checkpoint in the run dir that is mostly the
    # --resume auto of a run started with other flags (another DEMO_STEPS or DEMO_DTYPE, other LRs), which
    # speedrun.sh cannot continue (one continued by hand with other LRs from its own is continued with them:
    # resume_lrs): the hint is conditional, base_train's error above names the difference and its own ways on
    train_demo() {  # train_demo RUN_DIR BASE_TRAIN_FLAGS...
        local run="$1" rc=0
        shift
        step python -m scripts.base_train "$@" || rc=$?
        if [ "$rc" = 2 ] && [ -d "$run/checkpoints" ]; then
            echo "[speedrun] if base_train refused to continue $run because DEMO_STEPS or DEMO_DTYPE differs from" \
                 "the run's (num_iterations or --dtype above), delete $root/base and" \
                 "$root/mome to change DEMO_STEPS or DEMO_DTYPE (the data and tokenizer in $root are kept), or run" \
                 "again with the run's DEMO_STEPS and no DEMO_DTYPE (the run's dtype)" >&2
        fi
        [ "$rc" = 0 ] || exit "$rc"
    }
    if [ -n "$train_base" ]; then
        train_demo "$root/base" "${base[@]}"
        finished "$root/base"
    fi
    if [ -n "$train_mome" ]; then
        train_demo "$root/mome" "${mome[@]}"
        finished "$root/mome"
    fi
    step python -m scripts.report "$root/base" "$root/mome" --output "$root/report.md" \
        --title "CPU demo: tiny Base vs tiny MoME (embedded corpus, $dtype, bundle: $bundle)"
    # the time of this invocation alone: a demo stopped and run again trained partly in earlier ones (the report's
    # "train min" is each model's over its sessions: the loop's clock is in its checkpoints)
    echo "[speedrun] CPU demo done: report at $root/report.md (this invocation: $(( (SECONDS - t0) / 60 ))m$((
        (SECONDS - t0) % 60 ))s; each model's training time over all its sessions: the report's train min)"
}

# "gpu N" or "cpu 0 DTYPE BASE MOME", in one Python start (each costs 2-3 s of torch import here): the demo's dtype
# is DEMO_DTYPE, else a model's checkpoint's, else bf16 only where this CPU multiplies bf16 natively (elsewhere a bf16
# matmul costs ~60x a float32 one), its choice and why on one line; BASE and MOME are each model's state (resume_lrs)
# with that dtype. Stops with advice (exit 2) when GPUs are there but torch cannot use them, or no internet
decision="$(python -m scripts.speedrun_preflight mode --demo-dir "$root" --asked "${DEMO_DTYPE:-}" -- "${base[@]}" \
    -- "${mome[@]}")"
read -r mode ngpu dtype base_state mome_state <<<"$decision"
case "$mode" in
    gpu) gpu_run "$ngpu" ;;
    cpu) cpu_demo "$dtype" "$base_state" "$mome_state" ;;
esac
