# shellcheck shell=bash
# The checkout's locks, one rule (sourced by scripts/test.sh, scripts/setup_env.sh and speedrun.sh). A lock is
# flock(1) on an open descriptor, held until the caller exits or reopens it. flock's exit 75 (-E) alone means another
# process holds it; any other failure (NFS, where flock(2) needs a file open for writing; a file system without locks;
# a flock older than -E) is no other run, so the caller goes on unlocked and says so in one line, as it does without
# the flock command (macOS).
#
# flock locks an inode, so a lock is a file nothing replaces: untracked and git-ignored, at the checkout's root.
# `git pull` or `git checkout` writes a changed tracked file anew; a run holding a lock on the old one would no
# longer exclude a run that opens the new one (setup_env.sh reinstalling .venv under running tests, as it did when
# the locks were the scripts' own files). Opened for appending: created if missing, never truncated, and writable,
# which flock(2) on NFS needs.
VENV_LOCK=.venv.lock  # .venv's (not inside it: `rm -rf .venv` must not take a held lock with it)
# shellcheck disable=SC2034  # read by scripts/test.sh
TEST_LOCK=.test.lock  # scripts/test.sh's

# What a finished scripts/setup_env.sh install leaves in .venv (written last, removed before an install changes
# .venv): setup_env.sh reuses .venv when it matches, hold_venv stops the caller when it is missing.
VENV_STAMP=.venv/.setup_env.stamp

# lock_now FD MODE TAG FILE NOTE: lock descriptor FD (open on FILE) without waiting, MODE -x (exclusive) or -s
# (shared). Returns 75 when another process holds a lock that excludes it; otherwise 0, locked or (one line, ending
# in NOTE: what going on unlocked means) unlockable here.
lock_now() {
    local fd=$1 mode=$2 tag=$3 file=$4 note=$5 rc=0 err
    if ! command -v flock >/dev/null 2>&1; then
        echo "[$tag] no flock command: $note"
        return 0
    fi
    # flock's own complaint joins this one line (an old flock prints its whole usage)
    err="$(flock -n -E 75 "$mode" "$fd" 2>&1)" || rc=$?
    case "$rc" in
        0) return 0 ;;
        75) return 75 ;;
    esac
    case "$(flock --help 2>&1)" in
        *--conflict-exit-code*) echo "[$tag] cannot lock $file (flock exit $rc${err:+: ${err%%$'\n'*}}): $note" ;;
        *) echo "[$tag] cannot lock $file: this flock has no -E (util-linux before 2.22, busybox): $note" ;;
    esac
}

# one_at_a_time FD FILE TAG WAITING [-s]: open FILE on descriptor FD and lock it, exclusively or (-s) shared; when
# another process holds a lock that excludes this one, print "[TAG] WAITING" and wait for it.
one_at_a_time() {
    local fd=$1 file=$2 tag=$3 waiting=$4 mode=${5:--x} rc=0 err note="not waiting for another run in this checkout"
    if ! eval "exec $fd>>\"\$file\"" 2>/dev/null; then  # a checkout this user cannot write: no lock to take
        err="$( (: >>"$file") 2>&1)" || true  # why, from a second try (the exec's own message names this script)
        echo "[$tag] cannot open $file to lock it${err:+ (${err##*: })}: $note"
        return 0
    fi
    lock_now "$fd" "$mode" "$tag" "$file" "$note" || rc=$?
    [ "$rc" = 75 ] || return 0
    echo "[$tag] $waiting"
    flock "$mode" "$fd" || echo "[$tag] cannot lock $file (flock exit $?): $note"
}

# hold_venv TAG: after scripts/setup_env.sh, hold .venv's lock ($VENV_LOCK, fd 8) shared until the caller
# exits, so that an install (which holds it exclusively) waits for this run instead of replacing packages under it;
# a check of .venv does not wait. Not held across setup_env.sh: its install would wait for this very lock. An install
# that fails or stops in between leaves no stamp (setup_env.sh writes it last), which stops the caller.
hold_venv() {
    one_at_a_time 8 "$VENV_LOCK" "$1" \
        "scripts/setup_env.sh is installing .venv in $PWD: waiting for it to finish" -s
    [ ! -f "$VENV_STAMP" ] || return 0
    echo "[$1] .venv has no stamp of a finished install: another scripts/setup_env.sh changed it and did not finish;" \
         "run this again" >&2
    exit 1
}
