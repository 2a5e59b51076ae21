#!/bin/bash
# Second stage in the guest (chrooted into the host's root, read-only; /tmp, /run and /root
# are the guest's tmpfs; /mnt is the run's output directory). vm.env (written by xtask) gives
# NT (the nantrace binary), REPO, TESTS ("path:name:suite_binary ...") and TEST_TIMEOUT;
# args.NAME, when present, holds extra arguments for that test binary (--skip NAME ...).
set -u
O=/mnt
. $O/vm.env
export CI=true HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
uname -r > $O/uname
ip link set lo up
"$NT" doctor > $O/doctor.txt 2>&1; echo $? > $O/doctor.rc
"$NT" doctor --json > $O/doctor.json 2> $O/doctor.err
cd "$REPO/nantrace"
for t in $TESTS; do
  path=${t%%:*}; rest=${t#*:}; name=${rest%%:*}; bin=${rest#*:}
  start=$(cut -d' ' -f1 /proc/uptime)
  if [ "$path" = tracefs ]; then export NANTRACE_PROBE_PATH=tracefs; else unset NANTRACE_PROBE_PATH; fi
  args=()
  [ -f "$O/args.$name" ] && read -r -a args < "$O/args.$name"
  # Shortly before the timeout: what every process waits on and the kernel stacks of all
  # but the kernel's threads, so a hang leaves its evidence.
  ( sleep $((TEST_TIMEOUT - 15)); { ps -eo pid,ppid,stat,wchan:32,etime,args | grep -v ' \[.*\]$'; for p in $(ps -eo pid=,ppid= | awk '$2 != 2 && $1 != 2 {print $1}'); do echo "== $p $(cat /proc/$p/comm 2>/dev/null)"; cat /proc/$p/stack 2>/dev/null; done; dmesg | tail -60; } > "$O/test.$path.$name.hang" 2>&1 ) &
  snap=$!
  timeout -k 10 "$TEST_TIMEOUT" "$bin" --test-threads=1 "${args[@]}" > "$O/test.$path.$name.log" 2>&1
  rc=$?
  kill $snap 2>/dev/null; wait $snap 2>/dev/null
  [ $rc = 124 ] || [ $rc = 137 ] || rm -f "$O/test.$path.$name.hang"
  echo $rc > "$O/test.$path.$name.rc"
  # A test that failed (not a hang) runs once more alone: under TCG a guest's timing varies
  # tenfold, and xtask reports a test that passes the second time as FLAKY, with its first
  # failure, not as passed. One that fails again is a failure.
  if [ $rc != 0 ] && [ $rc != 124 ] && [ $rc != 137 ]; then
    for f in $(awk '/^failures:$/ {n++; next} n >= 2 && /^    [A-Za-z0-9_:]+$/ {print $1} n >= 2 && /^test result:/ {exit}' "$O/test.$path.$name.log" | head -5); do
      timeout -k 10 180 "$bin" --test-threads=1 --exact "$f" > "$O/rerun.$path.$name.$f.log" 2>&1
      echo $? > "$O/rerun.$path.$name.$f.rc"
    done
  fi
  end=$(cut -d' ' -f1 /proc/uptime)
  echo "$start $end" > "$O/test.$path.$name.time"
done
dmesg > $O/dmesg.txt 2>&1
echo ok > $O/done
