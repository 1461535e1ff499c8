#!/usr/bin/env bash
# r5 (one device call, repository root): the official bench in 64-slot unit-major pages after the op_rel_err fix
# (the op now runs on the timed pool), the int8 pass's register cap (occupancy) sweep, and Nsight Compute on it.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r5
mkdir -p $R
timeout 200 python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 int4/32:32 --cuda-graphs --latent-layout unit-major \
    --page-size 64 --json $R/attention-unit-major-p64.json --out $R/attention-unit-major-p64.md > $R/bench.log 2>&1
echo bench rc=$?
grep "^| int" $R/attention-unit-major-p64.md
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r5/attention-unit-major-p64.json"))
for r in d["rows"]:
    print(r["format"], r["batch"], r["context"], "rel", r.get("rel_err"), "op", r.get("op_rel_err"),
          "mma", r.get("mma_pass"), "peak GiB", round(r.get("mem_peak_bytes", 0) / 2**30, 2))
PY
timeout 200 python3 benchmarks/mma_attention_gpu.py --sweep --out $R --block-ns 64 --layouts unit-major@64 \
    --formats int8/32 --programs 1536 --maxnregs 0,128,144 > $R/sweep.log 2>&1
echo sweep rc=$?
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r5/sweep.json"))
for r in d["rows"]:
    if "default" in r["config"]:
        continue
    ku = r.get("kernel_us")
    ku = {k: round(v, 1) for k, v in ku.items()} if isinstance(ku, dict) else ku
    print(r["b"], r["t"], r["config"][:40], round(r["ms"], 4), round(100 * r["copy_share"], 1),
          round(r["speedup"], 2), r.get("regs"), ku)
PY
timeout 150 ncu --clock-control none --target-processes all -k regex:_mma_unit_kernel --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats -o $R/um8_p64 \
    python3 benchmarks/mma_attention_gpu.py --profile 32:32768 --layouts unit-major@64 --formats int8/32 \
    > $R/ncu.log 2>&1
echo ncu rc=$?
ncu -i $R/um8_p64.ncu-rep --print-details all > $R/um8_p64.txt 2>&1
grep -E "DRAM Throughput|Memory Throughput|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|L2 Hit|Mem Busy|Max Bandwidth|Warp Cycles Per Issued" $R/um8_p64.txt | head -30
