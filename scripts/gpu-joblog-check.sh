#!/bin/bash
# Usage (on a GPU node, as root): OUT=/tmp/out NANTRACE_BIN=gpu-check/nantrace scripts/gpu-joblog-check.sh
# Real GPU faults, caused by small torch jobs, recorded by `nantrace run` with its probes and NVML:
# an illegal memory access (a kernel that dereferences a bad pointer: the driver logs an Xid),
# a device-side assert, and a CUDA out-of-memory. What the job printed, what the kernel logged
# and what the report concluded are kept in $OUT. Not part of CI (no GPU there).
set -u
B=${NANTRACE_BIN:-./gpu-check/nantrace}
chmod +x "$B"
PY=python3
for p in /opt/torch/.venv/bin/python3 python3; do "$p" -c 'import torch' 2>/dev/null && PY=$p && break; done
{
  echo "== uname"; uname -a; id; echo "python: $PY"; $PY -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())' 2>&1
  echo "== nvidia-smi -L"; nvidia-smi -L 2>&1 | head
  echo "== doctor"; timeout 60 "$B" doctor 2>&1
} > "$OUT/doctor.txt" 2>&1
timeout 60 "$B" snapshot --out "$OUT/snapshot.json" > "$OUT/snapshot.log" 2>&1
mkdir -p "$OUT/jobs"
cat > "$OUT/jobs/illegal.py" <<'PY'
import torch, sys
for i in range(1, 4):
    print(f"step {i} | loss 2.{i}", flush=True)
x = torch.ones(1 << 20, device="cuda")
code = "template <typename T> T bad(T x) { return *((T*)(0x10 + 4096 * (size_t)x)) + x; }"
f = torch.cuda.jiterator._create_jit_fn(code)
y = f(x)
torch.cuda.synchronize()
print("not reached", flush=True)
PY
cat > "$OUT/jobs/assert.py" <<'PY'
import torch
print("step 1 | loss 2.1", flush=True)
x = torch.zeros(4, device="cuda")
i = torch.tensor([10], device="cuda")
y = x[i]
torch.cuda.synchronize()
print(y)
PY
cat > "$OUT/jobs/oom.py" <<'PY'
import torch
print("step 1 | loss 2.1", flush=True)
x = torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
PY
for j in illegal assert oom; do
  mkdir -p "$OUT/b-$j"
  ( time timeout 120 "$B" run --post 3 --out "$OUT/b-$j" -- "$PY" "$OUT/jobs/$j.py" ) > "$OUT/run-$j.log" 2>&1
  echo "rc=$?" >> "$OUT/run-$j.log"
  for d in "$OUT/b-$j"/nantrace-*; do
    [ -d "$d" ] || continue
    cp "$d/report.md" "$OUT/report-$j.md"
    cp "$d/kernel.log" "$OUT/kernel-$j.log"
    cp "$d/app.log" "$OUT/app-$j.log"
    grep -E '"fault":|"class":"xid"|"source":"nvml_xid"|"source":"gpu_change"' "$d/timeline.json" | head -50 > "$OUT/evidence-$j.jsonl"
    rm -rf "$d"
  done
done
# Does nantrace (probes + 1 Hz NVML sampling) slow a CUDA workload? A matmul loop's step time,
# alone and under `nantrace run`.
cat > "$OUT/jobs/matmul.py" <<'PY'
import torch, time, statistics
x = torch.randn(8192, 8192, device="cuda")
for _ in range(5): x @ x
torch.cuda.synchronize()
t0 = time.time(); st = []
while time.time() - t0 < 12:
    a = time.perf_counter(); y = x @ x; torch.cuda.synchronize(); st.append(time.perf_counter() - a)
print(f"steps={len(st)} median_ms={statistics.median(st)*1e3:.3f} p99_ms={sorted(st)[int(len(st)*0.99)]*1e3:.3f}")
PY
"$PY" "$OUT/jobs/matmul.py" > "$OUT/matmul-alone.txt" 2>&1
mkdir -p "$OUT/b-matmul"
timeout 60 "$B" run --sample 1 --no-trigger exit --out "$OUT/b-matmul" -- "$PY" "$OUT/jobs/matmul.py" > "$OUT/matmul-nantrace.txt" 2>&1
"$PY" "$OUT/jobs/matmul.py" > "$OUT/matmul-alone2.txt" 2>&1
rm -rf "$OUT/b-matmul"
dmesg 2>/dev/null | grep -E "NVRM|Xid" | tail -20 > "$OUT/dmesg-nvrm.txt"
ls -la "$OUT"
