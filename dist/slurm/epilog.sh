#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/nantrace/slurm/epilog.sh), run as root on each node
# when a job ends. It tells the agent the job is over (the job's bundle, if its end was an
# incident, is written within the post-window) and logs the incidents it had to syslog.
# It never fails: a non-zero epilog would drain the node.
out=$("${NANTRACE_BIN:-/usr/local/bin/nantrace}" ctl slurm-epilog ${NANTRACE_SOCKET:+--socket "$NANTRACE_SOCKET"} 2>&1)
command -v logger >/dev/null 2>&1 && logger -t nantrace "slurm job ${SLURM_JOB_ID:-?}: $out"
exit 0
