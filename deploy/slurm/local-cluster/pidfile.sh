# shellcheck shell=bash
# Daemons of the local cluster are known by their pid files, never matched by name.
# Sourced by up.sh and down.sh, which define say().

# pid file -> running?
running() {
    local pidfile=$1 pid
    [[ -r $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null
}

# SIGTERM the daemon of a pid file and wait up to 30 s; returns 1 if it is still there.
stop_pidfile() {
    local pidfile=$1 name=$2 pid
    running "$pidfile" || return 0
    pid=$(<"$pidfile")
    say "stopping $name (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 150); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    say "$name (pid $pid) did not stop within 30s" >&2
    return 1
}
