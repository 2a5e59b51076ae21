#!/bin/bash
# Usage (on a GPU node, as root): OUT=/tmp/out NANTRACE_BIN=target/release/nantrace scripts/gpu-check.sh
# One-shot NVML check of nantrace on a real GPU (not part of CI). Writes everything to $OUT.
set -u
B=${NANTRACE_BIN:-./gpu-check/nantrace}
chmod +x $B
{
  echo "== uname"; uname -a; cat /etc/os-release 2>/dev/null | head -2; id
  echo "== nvidia-smi -L"; nvidia-smi -L 2>&1 | head
  echo "== doctor"; timeout 60 $B doctor 2>&1
} > $OUT/doctor.txt 2>&1
nvidia-smi -q -d ECC,POWER,TEMPERATURE,UTILIZATION > $OUT/nvidia-smi-q.txt 2>&1
nvidia-smi --query-gpu=pci.bus_id,retired_pages.single_bit,retired_pages.double_bit,temperature.gpu,power.draw,clocks.sm,utilization.gpu --format=csv > $OUT/nvidia-smi-query.csv 2>&1
timeout 60 $B snapshot --out $OUT/snapshot.json > $OUT/snapshot.log 2>&1
# A GPU load, if torch is there, so utilization/power samples move.
LOAD='import torch,time
x=torch.randn(8192,8192,device="cuda")
t=time.time()
while time.time()-t<8: y=x@x; torch.cuda.synchronize()
torch.cuda.synchronize(); print("load done")'
cat > $OUT/job.sh <<JOB
for i in \$(seq 1 6); do echo "step \$i | loss 2.\$i"; sleep 1; done
python3 -c '$LOAD' 2>&1 | tail -1 &
for i in \$(seq 7 12); do echo "step \$i | loss 1.\$i"; sleep 1; done
echo "step 13 | loss nan"
wait
JOB
mkdir -p $OUT/bundles
timeout 120 $B run --sample 1 --post 3 --out $OUT/bundles -- bash $OUT/job.sh > $OUT/run.log 2>&1
echo "run rc=$?" >> $OUT/run.log
# Keep the bundle small: the evidence files, and the GPU events of the timeline.
for d in $OUT/bundles/nantrace-*; do
  [ -d "$d" ] || continue
  python3 - "$d" > $OUT/gpu-events.jsonl 2>/dev/null <<'PY' || grep -E '"source":"(gpu|gpu_change|nvml_xid)"' "$d/timeline.json" | head -200 > $OUT/gpu-events.jsonl
import json,sys
t=json.load(open(sys.argv[1]+"/timeline.json"))
for e in t["events"]:
    if e["source"] in ("gpu","gpu_change","nvml_xid"): print(json.dumps(e))
print(json.dumps({"accounting": t["accounting"]}))
PY
  cp "$d/report.md" $OUT/report.md 2>/dev/null
  cp "$d/snapshot.json" $OUT/bundle-snapshot.json 2>/dev/null
  rm -f "$d/timeline.json" "$d/trace.json" "$d/report.html"
done
ls -la $OUT
