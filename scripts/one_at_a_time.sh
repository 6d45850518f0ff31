# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/setup_env.sh: `one_at_a_time FD SCRIPT TAG` waits until no other run of
# SCRIPT in this checkout holds its lock, then holds it on descriptor FD until the caller exits. The lock is the
# script's own file: no lock file to ignore or clean up. flock's exit 75 (-E) alone means another run holds it; any
# other failure (NFS, where flock(2) needs a file open for writing; a file system without locks) is no other run,
# so the caller goes on unlocked and says so. Without the flock command (macOS) likewise.
one_at_a_time() {
    local fd=$1 script=$2 tag=$3 rc=0
    if ! command -v flock >/dev/null 2>&1; then
        echo "[$tag] no flock command: not waiting for another $script in this checkout"
        return 0
    fi
    eval "exec $fd<\"\$script\""
    flock -n -E 75 "$fd" || rc=$?
    if [ "$rc" = 75 ]; then
        echo "[$tag] another $script is running in $PWD: waiting for it to finish"
        rc=0
        flock "$fd" || rc=$?
    fi
    if [ "$rc" != 0 ]; then
        echo "[$tag] cannot lock $script (flock exit $rc): not waiting for another one in this checkout"
    fi
}
