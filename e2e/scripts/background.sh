#!/usr/bin/env bash
# A build step run beside the ones after it, so its minutes hide behind theirs.
#   background.sh start <dir> <name> <command…>   runs the command (nice 19, idle I/O class: what
#                                                  it shares the machine with goes first) with its output in
#                                                  <dir>/<name>.log and returns at once
#   background.sh wait <dir> <name>                waits for it, shows its output, exits with its
#                                                  status
# Why: on a cold machine make test builds Go tools that only its later steps need, while the
# workspace's tests, which mostly wait on their apiservers, leave the cores idle.
set -euo pipefail
op=$1 dir=$2 name=$3
shift 3
mkdir -p "$dir"
log="$dir/$name.log" rc="$dir/$name.rc"
case $op in
  start)
    rm -f "$rc"
    : >"$log"
    # setsid: the step is no child of make's shell, which returns now. A new session is a new
    # scheduler autogroup, and with autogroups on (Debian's default) the kernel shares CPU between
    # groups before nice counts within one: nice 19 alone left the step half the cores (the cold
    # run of 2026-12-02 built the Rust binaries in 30 min beside it instead of 9). So the group
    # itself is made nice 19 too.
    setsid bash -c '{ echo 19 >/proc/self/autogroup; } 2>/dev/null || true
      "$@" >"$0" 2>&1; echo $? >"$0.rc.tmp"; mv "$0.rc.tmp" "${0%.log}.rc"' \
      "$log" nice -n 19 ionice -c 3 "$@" </dev/null >/dev/null 2>&1 &
    echo "background: $name started ($*)"
    ;;
  wait)
    [ -e "$log" ] || { echo "background: $name was never started" >&2; exit 1; }
    t0=$(date +%s)
    while [ ! -e "$rc" ]; do sleep 2; done
    cat "$log"
    echo "background: $name done (waited $(( $(date +%s) - t0 ))s)"
    exit "$(cat "$rc")"
    ;;
  *)
    echo "usage: $0 start|wait <dir> <name> [command…]" >&2
    exit 2
    ;;
esac
