#!/bin/bash
# Second stage of a node of the VM cluster (`cargo xtask vm-cluster`), chrooted into the
# host's root as in the kernel matrix (guest.sh): this node's name and address, the shared
# directory, munged + slurmd (+ slurmctld on n1) from Debian's slurm-wlm, and the nantrace
# agent with the job directory on the shared filesystem. Then it runs what the host puts in
# /mnt/shared/cmd/<node>/<n>.sh, one after the other (output and rc beside it), until
# /mnt/shared/cmd/<node>/stop appears. vm.env: NODE, IP, NT (the nantrace binary), CTL_IP.
# /mnt/nantrace_fault.ko: the test-fault module (cargo xtask vm-cluster built it for this kernel).
set -u
O=/mnt
. $O/vm.env
export HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
S=$O/shared
log() { echo "$(cut -d' ' -f1 /proc/uptime) $*" >> $O/node.log; }
hostname "$NODE"
ip link set lo up
dev=$(ls /sys/class/net | grep -v '^lo$' | head -1)
ip addr add "$IP/24" dev "$dev" && ip link set "$dev" up || log "no network: $dev"
mkdir -p $S && mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 shared $S || log "FAILED to mount the shared directory"
R=/run/ntc
mkdir -p $R/slurm/state $R/slurm/spool $R/slurm/pid $R/munge $R/nt
# The cluster's names (the host's /etc/hosts is read-only here: bound over).
cp /etc/hosts $R/hosts && cat $S/hosts >> $R/hosts && mount --bind $R/hosts /etc/hosts
chmod 755 $R/munge
cp $S/munge.key $R/munge/munge.key && chmod 400 $R/munge/munge.key
munged --socket=$R/munge/munge.socket --key-file=$R/munge/munge.key --seed-file=$R/munge/seed \
  --log-file=$O/munged.log --pid-file=$R/munge/munged.pid --force
export SLURM_CONF=$S/slurm.conf
# slurmd's cgroup/v2 plugin (IgnoreSystemd=yes in cgroup.conf) puts its scope here.
mkdir -p /sys/fs/cgroup/system.slice
if [ "$NODE" = n1 ]; then slurmctld -f $SLURM_CONF; fi
slurmd -f $SLURM_CONF -N "$NODE"
log "slurm started"
# The scenarios' kernel faults (an Xid): printed by this kernel through the test module
# (scripts/vm/fault-module/; debugfs, root only), so /dev/kmsg records them with facility 0
# as a driver's own lines. Unsigned: it loads with a taint (no lockdown, no forced signatures).
if insmod $O/nantrace_fault.ko > $O/insmod.log 2>&1; then log "fault module loaded"; else log "FAILED to load the fault module: $(cat $O/insmod.log)"; fi
cat > $R/nt/agent.toml <<EOF
job_dir = "$S/jobs"
slurm_jobs = "all"
spool_dir = "$R/nt/spool"
socket = "$R/nt/agent.sock"
metrics_addr = ""
EOF
"$NT" agent --config $R/nt/agent.toml > $O/agent.log 2>&1 &
echo $! > $R/nt/agent.pid
for i in $(seq 1 300); do grep -q "probes attached" $O/agent.log 2>/dev/null && break; sleep 0.2; done
log "agent started"
touch $S/ready.$NODE
C=$S/cmd/$NODE
mkdir -p $C
n=1
while [ ! -e $C/stop ]; do
  if [ -f $C/$n.sh ]; then
    bash $C/$n.sh > $C/$n.out 2>&1
    echo $? > $C/.$n.rc && mv $C/.$n.rc $C/$n.rc
    n=$((n + 1))
    continue
  fi
  sleep 0.2
done
kill "$(cat $R/nt/agent.pid)" 2>/dev/null
for i in $(seq 1 100); do kill -0 "$(cat $R/nt/agent.pid)" 2>/dev/null || break; sleep 0.1; done
for d in slurmd slurmctld munged; do pkill -x $d; done
sleep 1
umount $S 2>/dev/null
echo ok > $O/done
