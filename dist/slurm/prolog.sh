#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/nantrace/slurm/prolog.sh, PrologFlags=Alloc), run as
# root on each node when a job is allocated. It tells the nantrace agent to look for the job's
# processes now (instead of at its next /proc scan) and to watch the job whatever its GPU use.
# It never fails: a non-zero prolog would drain the node. The agent must be running
# (systemctl status nantrace-agent); without it this prints a message and exits 0.
"${NANTRACE_BIN:-/usr/local/bin/nantrace}" ctl slurm-prolog ${NANTRACE_SOCKET:+--socket "$NANTRACE_SOCKET"} >/dev/null 2>&1
exit 0
