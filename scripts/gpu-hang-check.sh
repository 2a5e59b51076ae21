#!/bin/bash
# Usage (on a GPU node, as root): OUT=/tmp/out NANTRACE_BIN=gpu-check/nantrace scripts/gpu-hang-check.sh
# Issue 34's GPU run, prepared for the day a GPU machine is lent (docs/hangs.md): a torch job on
# NCCL whose rank holds its GPU stream (torch.cuda._sleep) past a 10 s collective timeout, so
# that torch's real watchdog lines, its Flight Recorder dump (NCCL's, with completion states)
# and NCCL RAS's answer are recorded, under `nantrace run` (probes, NVML, the stall and
# job-error triggers, the stacks, the Flight Recorder read and the RAS query at the trigger).
# Two shapes: one rank (always possible on one GPU) and two ranks on the one GPU (NCCL
# refuses two ranks on one device, "Duplicate GPU detected": what it says is kept). The stall
# trigger fires at ~6 s of silence, the watchdog at 10 s: --post 30 keeps the bundle open
# until torch has written its dump (the post window ends early when the job exits). Everything lands in $OUT: the job's
# lines, the dumps, the bundle's report, timeline and snapshot sections, the job report.
# Not part of CI (no GPU there). The binary: `cargo build --release` here (probes embedded),
# copied to gpu-check/nantrace and carried.
set -u
B=${NANTRACE_BIN:-./gpu-check/nantrace}
chmod +x "$B"
PY=python3
for p in ${NANTRACE_PY:-} /opt/torch/.venv/bin/python3 python3; do "$p" -c 'import torch' 2>/dev/null && PY=$p && break; done
{
  echo "== uname"; uname -a; id; echo "python: $PY"
  $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available(), "nccl", torch.cuda.nccl.version())' 2>&1
  echo "== nvidia-smi -L"; nvidia-smi -L 2>&1 | head
  echo "== doctor"; timeout 60 "$B" doctor 2>&1
} > "$OUT/doctor.txt" 2>&1
mkdir -p "$OUT/jobs"
cat > "$OUT/jobs/hang.py" <<'PY'
import datetime, os, time
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=10))
# A gloo group first, then an NCCL one: the NCCL group's local id (a watchdog line's PG ID,
# an entry's pg_id) is 1 and its GUID (pg_name) 2, so the dump tells the two apart.
side = dist.new_group(list(range(world)), backend="gloo")
sub = dist.new_group(list(range(world)))
x = torch.ones(1 << 20, device="cuda")
for step in range(1, 9):
    dist.all_reduce(x)
    dist.all_reduce(x, group=sub)
    torch.cuda.synchronize()
    print(f"[rank{rank}]: step {step} | loss {2.0 / step:.4f}", flush=True)
    time.sleep(0.5)
# The held rank: its stream sleeps about a minute (H200: ~1.98 GHz), so its next all_reduce
# cannot start; the watchdog times the collective out after 10 s.
if rank == world - 1:
    torch.cuda._sleep(int(60 * 1.98e9))
dist.all_reduce(x, group=sub)
torch.cuda.synchronize()
print(f"[rank{rank}]: not reached", flush=True)
PY
cat > "$OUT/jobs/launch.sh" <<'SH'
#!/bin/bash
# $1 ranks, each a process on GPU 0; the job's Flight Recorder and RAS settings.
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29400 + $1)) WORLD_SIZE=$1
export TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1
export TORCH_FR_DUMP_TEMP_FILE=$FR/nccl_trace_rank_ TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$FR/nccl_trace_rank_
export TORCH_NCCL_DESYNC_DEBUG=1 NCCL_RAS_ENABLE=1 NCCL_DEBUG=WARN
# "started" states in the dump (else NCCL's entries go from scheduled to completed only).
export TORCH_NCCL_ENABLE_TIMING=1
# The watchdog's SIGABRT of a CUDA process writes no core of gigabytes.
ulimit -c 0
pids=()
for r in $(seq 0 $(($1 - 1))); do RANK=$r "$PY" "$JOBS/hang.py" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
SH
chmod +x "$OUT/jobs/launch.sh"
for n in 1 2; do
  d="$OUT/world$n"
  mkdir -p "$d/b" "$d/fr"
  chmod 777 "$d/fr"
  ( time FR="$d/fr" PY="$PY" JOBS="$OUT/jobs" timeout 150 "$B" run --as-root --post 30 --hang-after 6 \
      --out "$d/b" -- "$OUT/jobs/launch.sh" "$n" ) > "$d/run.log" 2>&1
  echo "rc=$?" >> "$d/run.log"
  for b in "$d/b"/nantrace-*; do
    [ -d "$b" ] || continue
    n2=$(basename "$b")
    cp "$b/report.md" "$d/report-$n2.md" 2>/dev/null
    cp "$b/app.log" "$d/app-$n2.log" 2>/dev/null
    "$PY" - "$b" > "$d/sections-$n2.json" 2>&1 <<'P'
import json, sys
b = sys.argv[1]
s = json.load(open(f"{b}/snapshot.json"))
t = json.load(open(f"{b}/timeline.json"))
print(json.dumps({"trigger": t.get("trigger"), "triggers": t.get("triggers"),
                  "nccl_ras": s.get("nccl_ras"), "flight_recorder": s.get("flight_recorder"),
                  "stacks": s.get("stacks")}, indent=1))
P
    timeout 60 "$B" report "$b" > "$d/nantrace-report-$n2.txt" 2>&1
  done
  ls "$d/b"/nantrace-* -d > "$d/bundles.txt" 2>&1
  # The job report over the bundles (one node here: its ranks' lanes and the hang's reading).
  timeout 120 "$B" report --write "$d/b" > "$d/job-report.txt" 2>&1
  cp "$d/b/job-report.md" "$d/b/job-report.html" "$d/" 2>/dev/null
  ls -la "$d/fr" >> "$d/run.log" 2>&1
done
dmesg 2>/dev/null | grep -E "NVRM|Xid" | tail -20 > "$OUT/dmesg-nvrm.txt"
# The bundles themselves are large: the sections above are what a later session reads.
rm -rf "$OUT"/world*/b
ls -laR "$OUT" | head -80
