#!/bin/bash
# Usage (on a GPU node, as root): OUT=/tmp/out NANTRACE_BIN=gpu-check/nantrace scripts/gpu-perf.sh
# Issue 12's GPU part: what NVML sampling costs per GPU, and whether 1 Hz sampling slows a
# running CUDA job. About 2 minutes. Writes JSON to $OUT; not part of CI.
#   nvml-cost.json          the sampler's per-tick NVML work, back to back for 10 s
#   steps-alone-{1,2}.json  a compute-bound CUDA loop (FMA chains, ~ms per step), 20 s each
#   steps-run-{1,2}.json    the same loop as the job of `nantrace run --sample 1` (all probes,
#                           1 Hz GPU sampling), interleaved with the runs alone
set -u
B=${NANTRACE_BIN:-./gpu-check/nantrace}
chmod +x "$B"
nvidia-smi -L > "$OUT/smi.txt" 2>&1
timeout 60 "$B" bench-internal nvml-cost --seconds 10 > "$OUT/nvml-cost.json" 2> "$OUT/nvml-cost.err"
for i in 1 2; do
  timeout 60 "$B" bench-internal cuda-steps --seconds 20 --n 200000 > "$OUT/steps-alone-$i.json" 2> "$OUT/steps-alone-$i.err"
  mkdir -p "$OUT/bundles-$i"
  timeout 90 "$B" run --sample 1 --post 0 --out "$OUT/bundles-$i" -- "$B" bench-internal cuda-steps --seconds 20 --n 200000 > "$OUT/steps-run-$i.json" 2> "$OUT/steps-run-$i.err"
  rm -rf "$OUT/bundles-$i"
done
python3 - "$OUT" <<'PY' > "$OUT/summary.txt" 2>&1
import json, sys, glob, os
out = sys.argv[1]
def load(n):
    try:
        return json.loads(open(os.path.join(out, n)).read().strip().splitlines()[-1])
    except Exception as e:
        return {"error": str(e)}
print("nvml-cost", json.dumps(load("nvml-cost.json")))
for n in sorted(glob.glob(os.path.join(out, "steps-*.json"))):
    v = load(os.path.basename(n))
    print(os.path.basename(n), v.get("steps"), json.dumps(v.get("step_ms", v)))
PY
cat "$OUT/summary.txt"
