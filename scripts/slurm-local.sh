#!/bin/bash
# One-node local Slurm cluster (Debian slurm-wlm 22.05 + munge) for nantrace agent
# integration tests. Run as root. Not for production nodes.
#
#   scripts/slurm-local.sh install  # only install slurm-wlm and munge, start nothing (the VM cluster)
#   scripts/slurm-local.sh up       # install if needed, start munged+slurmctld+slurmd, wait until srun works
#   scripts/slurm-local.sh status   # sinfo + squeue
#   scripts/slurm-local.sh down     # cancel jobs, stop exactly the daemons `up` started, remove the state dir
#
# `up` prints one line on stdout, `export SLURM_CONF=<dir>/slurm.conf` (also written to <dir>/env),
# so a test can do:  eval "$(scripts/slurm-local.sh up)"
# Everything else goes to stderr.
#
# Environment:
#   NANTRACE_SLURM_DIR        state dir (default /run/nantrace-slurm): conf, munge key+socket, state, spool, logs, pids
#   NANTRACE_SLURM_TIMEOUT    seconds `up` waits for the node to be idle and `srun true` to work (default 60)
#   NANTRACE_SLURMCTLD_PORT   default 6817;  NANTRACE_SLURMD_PORT  default 6818
#   NANTRACE_SLURM_KEEP=1     `down` keeps the state dir (logs) instead of removing it
#   NANTRACE_SLURM_PROLOG / NANTRACE_SLURM_EPILOG   Prolog=/Epilog= scripts (nantrace's dist/slurm/)
#
# munged is private to this instance (own key, own socket under the state dir; slurm.conf
# points at it with AuthInfo=socket=...), so a system munged, if any, is neither used nor touched.
set -euo pipefail

DIR=${NANTRACE_SLURM_DIR:-/run/nantrace-slurm}
TIMEOUT=${NANTRACE_SLURM_TIMEOUT:-60}
CTLD_PORT=${NANTRACE_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${NANTRACE_SLURMD_PORT:-6818}
CONF=$DIR/slurm.conf
MSOCK=$DIR/munge/munge.socket
HOST=$(hostname -s)
DAEMONS=(munged slurmctld slurmd)   # start order; stop in reverse

log() { echo "slurm-local: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root"

# ---------------------------------------------------------------- install
# Pids of daemons that apt might start (Debian's init scripts run from postinst via invoke-rc.d).
pids_of() { local n; for n in "$@"; do pgrep -x "$n" || true; done | sort -n; }

install_pkgs() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} (apt-get)"
  local before own_policy=0
  before=$(pids_of munged slurmctld slurmd slurmdbd)
  # No systemd here, so postinst's invoke-rc.d would run /etc/init.d/* start. A policy-rc.d
  # that exits 101 forbids that. Docker-style images already have one; only add ours if absent.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; }
  if [ $own_policy = 1 ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
  # Belt and braces: stop any daemon that appeared during the install.
  local after pid
  after=$(pids_of munged slurmctld slurmd slurmdbd)
  for pid in $(comm -13 <(echo "$before") <(echo "$after")); do
    log "stopping $(cat /proc/$pid/comm 2>/dev/null) pid $pid started by the package install"
    kill "$pid" 2>/dev/null || true
  done
}

# ---------------------------------------------------------------- pid helpers
pidfile() { echo "$DIR/pid/$1.pid"; }
# Prints the pid if the pid file names a live process whose executable is the daemon.
alive() {
  # comm, not /proc/PID/exe: Debian's slurmd/slurmctld are alternatives for slurmd-wlm/slurmctld-wlm.
  local f pid comm; f=$(pidfile "$1")
  [ -s "$f" ] || return 1
  pid=$(tr -dc 0-9 < "$f"); [ -n "$pid" ] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [ "$comm" = "$1" ] || return 1
  echo "$pid"
}

# SIGTERM to all given daemons at once, then wait (each takes 1-2 s to exit); SIGKILL after 10 s.
stop_daemons() {
  local n pid pids=() i
  for n in "$@"; do
    if pid=$(alive "$n"); then log "stopping $n (pid $pid)"; kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); fi
  done
  for i in $(seq 1 100); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && break; sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then log "pid $pid still alive after 10 s, SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
  done
  for n in "$@"; do rm -f "$(pidfile "$n")"; done
}

# slurmstepd processes of this instance: they keep our slurmd.log open (their environ is
# clobbered by setproctitle, so it is no use for this).
our_stepds() {
  local pid
  for pid in $(pgrep -x slurmstepd || true); do
    if ls -l "/proc/$pid/fd" 2>/dev/null | grep -q -- "-> $DIR/"; then echo "$pid"; fi
  done
}

tails() {
  local f
  for f in "$DIR"/log/*.log; do
    [ -e "$f" ] || continue
    echo "----- tail $f" >&2; tail -n 30 "$f" >&2
  done
}

# ---------------------------------------------------------------- config
write_conf() {
  local cpus mem_mb
  cpus=$(nproc)
  # slurmd refuses a node whose configured RealMemory exceeds what it measures; stay 10% under.
  mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
  cat > "$CONF.new" <<EOF
# Written by scripts/slurm-local.sh; one-node test cluster, everything as root.
ClusterName=nantrace
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MSOCK
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$(pidfile slurmctld)
SlurmdPidFile=$(pidfile slurmd)
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=300
MessageTimeout=10
MailProg=/bin/true
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
${NANTRACE_SLURM_PROLOG:+Prolog=$NANTRACE_SLURM_PROLOG}
${NANTRACE_SLURM_EPILOG:+Epilog=$NANTRACE_SLURM_EPILOG}
${NANTRACE_SLURM_PROLOG:+PrologFlags=Alloc}
EOF
  if [ -e "$CONF" ] && cmp -s "$CONF" "$CONF.new"; then rm -f "$CONF.new"; return 1; fi
  mv "$CONF.new" "$CONF"; return 0
}

# ---------------------------------------------------------------- up
start_munged() {
  alive munged >/dev/null && return 0
  if [ ! -s "$DIR/munge/munge.key" ]; then
    log "creating munge key $DIR/munge/munge.key"
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  fi
  chmod 400 "$DIR/munge/munge.key"
  rm -f "$MSOCK" "$MSOCK.lock"
  log "starting munged"
  munged --socket="$MSOCK" --key-file="$DIR/munge/munge.key" --seed-file="$DIR/munge/munged.seed" \
         --log-file="$DIR/log/munged.log" --pid-file="$(pidfile munged)" --force 9>&-
  local i
  for i in $(seq 1 50); do
    munge -n -S "$MSOCK" 2>/dev/null | unmunge -S "$MSOCK" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged does not answer on $MSOCK"
}

cmd_up() {
  local t0; t0=$(date +%s.%N)
  install_pkgs slurm-wlm munge
  mkdir -p "$DIR"/{state,spool,log,pid,munge}
  chmod 755 "$DIR" "$DIR/munge"   # munged wants o+x on the socket dir so non-root clients work
  if write_conf; then
    # Config changed (or first run): daemons running with an older one get restarted.
    if alive slurmctld >/dev/null || alive slurmd >/dev/null; then  # e.g. nproc/memory changed
      log "slurm.conf changed; restarting slurm daemons"
      stop_daemons slurmd slurmctld
    fi
  fi
  echo "export SLURM_CONF=$CONF" > "$DIR/env"
  export SLURM_CONF=$CONF

  start_munged
  if ! alive slurmctld >/dev/null; then log "starting slurmctld"; slurmctld -f "$CONF" 9>&-; fi
  if ! alive slurmd >/dev/null; then log "starting slurmd"; slurmd -f "$CONF" 9>&-; fi

  local deadline state
  deadline=$(( $(date +%s) + TIMEOUT ))
  while :; do
    state=$(sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null | head -1 || true)
    case "$state" in
      idle|mixed|allocated) break ;;
      *drain*|down*) scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    if [ "$(date +%s)" -ge "$deadline" ]; then
      log "node $HOST not idle after ${TIMEOUT}s (state: '${state:-no answer}')"
      for n in "${DAEMONS[@]}"; do alive "$n" >/dev/null || log "$n is not running"; done
      tails; exit 1
    fi
    sleep 0.5
  done
  local left=$(( deadline - $(date +%s) )); [ $left -ge 5 ] || left=5
  if ! timeout "$left" srun -N1 -t 1 -J nantrace-up-check true >&2; then
    log "srun -N1 true failed"; tails; exit 1
  fi
  log "up in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s; node $HOST $state"
  echo "export SLURM_CONF=$CONF"
}

cmd_down() {
  export SLURM_CONF=$CONF
  if alive slurmctld >/dev/null && [ -e "$CONF" ]; then
    local ids; ids=$(squeue -h -o '%i' 2>/dev/null || true)
    if [ -n "$ids" ]; then
      log "cancelling jobs: $(echo $ids)"
      # shellcheck disable=SC2086
      scancel $ids 2>/dev/null || true
      local i; for i in $(seq 1 50); do [ -z "$(our_stepds)" ] && break; sleep 0.1; done
    fi
  fi
  local pid
  stop_daemons slurmd slurmctld munged
  for pid in $(our_stepds); do log "killing leftover slurmstepd $pid"; kill -KILL "$pid" 2>/dev/null || true; done
  if [ "${NANTRACE_SLURM_KEEP:-0}" = 1 ]; then
    log "down; state kept in $DIR"
  elif [ -d "$DIR" ]; then
    rm -rf "$DIR" "$DIR.lock"; log "down; removed $DIR"
  else
    rm -f "$DIR.lock"; log "down (nothing was running)"
  fi
}

cmd_status() {
  local n pid
  for n in "${DAEMONS[@]}"; do
    if pid=$(alive "$n"); then echo "$n: running (pid $pid)"; else echo "$n: not running"; fi
  done
  [ -e "$CONF" ] || { echo "no $CONF"; return 0; }
  export SLURM_CONF=$CONF
  echo "SLURM_CONF=$CONF"
  sinfo -N -l || true
  squeue || true
}

if [ "${1:-}" = up ] || [ "${1:-}" = down ]; then
  mkdir -p "$(dirname "$DIR")"
  # Daemons are started with 9>&- so they do not inherit (and hold) this lock.
  exec 9>"$DIR.lock"
  flock -w 120 9 || die "another slurm-local.sh holds $DIR.lock"
fi

case "${1:-}" in
  install) install_pkgs slurm-wlm munge ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 install|up|down|status" >&2; exit 2 ;;
esac
