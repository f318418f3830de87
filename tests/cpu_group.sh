#!/usr/bin/env bash
# tests/cpu_group.sh NAME SHARES CMD...: run CMD in the cgroup-v1 cpu group NAME (cpu.shares SHARES; 1024 is the
# kernel's default weight), created when missing. `make test` runs its serial pass in one group and the rest in
# another of a small weight, so that the serial tests get the CPU whenever they want it. A group, not `nice`:
# with the kernel's autogroups (sched_autogroup_enabled) every session -- and every test job starts one -- is
# weighed as one task, whatever its niceness; tasks in a cgroup other than the root are weighed by the group.
# tests/cpu_group.sh --check: exit 0 when such groups can be made here (root, cgroup v1 cpu controller mounted).
set -euo pipefail
root=/sys/fs/cgroup/cpu
if [ "${1:-}" = --check ]; then
    probe="$root/fsdp-tests-probe-$$"
    mkdir "$probe" 2>/dev/null && echo 2 > "$probe/cpu.shares" 2>/dev/null && rmdir "$probe" && exit 0
    rmdir "$probe" 2>/dev/null || true
    exit 1
fi
name=$1 shares=$2
shift 2
mkdir -p "$root/$name"
echo "$shares" > "$root/$name/cpu.shares"
echo $$ > "$root/$name/cgroup.procs"
# a command started with `&` by a non-interactive shell (make's) inherits SIGINT and SIGQUIT ignored, and a Python
# started that way never raises KeyboardInterrupt: Ctrl-C would not stop it, and a test that interrupts a child
# Python would wait forever. The command gets them as a foreground command has them (bash cannot reset a signal
# ignored at its own start; python can, before it execs the command).
exec python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGQUIT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
