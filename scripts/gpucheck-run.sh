#!/bin/bash
# Usage (on a GPU node, as root): OUT=/tmp/out NANTRACE_BIN=gpu-check/nantrace scripts/gpucheck-run.sh
# `nantrace gpucheck` for real: a clean run, then the test-only corrupted run that must name the GPU.
set -u
B=${NANTRACE_BIN:-./gpu-check/nantrace}
chmod +x "$B"
nvidia-smi -L > "$OUT/smi.txt" 2>&1
( time timeout 240 "$B" gpucheck --reps 10 --iters 200000 --out "$OUT/gpucheck.json" ) > "$OUT/clean.txt" 2>&1; echo "rc=$?" >> "$OUT/clean.txt"
( time timeout 120 "$B" gpucheck --reps 4 --iters 200000 --mem-fraction 0.05 --corrupt-test 0 --out "$OUT/gpucheck-corrupt.json" ) > "$OUT/corrupt.txt" 2>&1; echo "rc=$?" >> "$OUT/corrupt.txt"
( time timeout 120 "$B" gpucheck --reps 3 --iters 2000000 --mem-fraction 0.05 --out "$OUT/gpucheck-long.json" ) > "$OUT/long.txt" 2>&1; echo "rc=$?" >> "$OUT/long.txt"
for f in gpucheck.json gpucheck-corrupt.json gpucheck-long.json; do
  python3 -c "import json,sys; v=json.load(open('$OUT/$f')); [g.pop(k,None) for g in v.get('gpus',[]) for k in ()]; v.pop('nvml_before',None); v.pop('nvml_after',None); print(json.dumps(v, indent=1))" > "$OUT/$f.short.txt" 2>&1
done
ls -la "$OUT"
