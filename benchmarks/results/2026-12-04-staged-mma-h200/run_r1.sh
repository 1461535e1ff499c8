#!/usr/bin/env bash
# r1 (one device call, repository root): the unit-major MMA pass with its tiles staged through shared memory by
# cp.async (DecodeConfig.stages_m 2 / 4) against the register path (0): correctness, then a sweep in 64-slot
# unit-major pages (int8 and int4) and in a static unit-major cache (int8), then Nsight Compute on stages 2.
# PARTS (default all): a comma list of check, int8, int4, ncu, so that one device call (600 s at most) runs a part.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
PARTS=${PARTS:-check,int8,int4,ncu}
R=$OUT/r1
mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
if [[ ,$PARTS, == *,check,* ]]; then
MMA_CASES=36 timeout 260 python3 benchmarks/mma_attention_gpu.py --check --out $R --formats int8/32,int4/32 \
    > $R/check.log 2>&1
echo check rc=$?; tail -2 $R/check.log
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r1/check.json"))
rows = d["small"]
print("ok", d["ok"], "cases", len(rows), "large", len(d["large"]),
      "stages", sorted({(r.get("kfmt"), r.get("layout"), r.get("stages")) for r in rows}, key=str))
for r in d["large"]:
    print("large", r["format"], r["b"], r["t"], r["layout"], r["stages"], r["rel_err_fp32_out"], r["rel_err_bf16_out"])
for r in d["stages_identity"]:
    print("identity", r)
PY
fi
for F in int8/32 int4/32; do
  N=$(echo $F | tr -d /)
  [[ ,$PARTS, == *,${N%32},* ]] || continue
  L=unit-major@64; [ $F = int8/32 ] && L=unit-major@64,unit-major
  timeout 200 python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep-$N --block-ns 64 --layouts $L \
      --formats $F --programs 1536,3072 --stages 0,2,4 > $R/sweep-$N.log 2>&1
  echo sweep $F rc=$?
  python3 - $R/sweep-$N/sweep.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    ku = r.get("kernel_us")
    ku = {k.split(":")[1][:12]: round(v, 1) for k, v in ku.items()} if isinstance(ku, dict) else ku
    print(r["b"], r["t"], r["config"].replace("mma bn=64 ", "").replace(" split_d=None one_pass=None", ""),
          round(r["ms"], 4), round(100 * r["copy_share"], 1), round(r["speedup"], 2), r.get("regs"), ku)
PY
done
[[ ,$PARTS, == *,ncu,* ]] || exit 0
timeout 150 ncu --clock-control none --target-processes all -k regex:_mma_unit_kernel --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats -o $R/um8_p64_s2 \
    python3 benchmarks/mma_attention_gpu.py --profile 32:32768 --layouts unit-major@64 --formats int8/32 --stages 2 \
    > $R/ncu.log 2>&1
echo ncu rc=$?
ncu -i $R/um8_p64_s2.ncu-rep --print-details all > $R/um8_p64_s2.txt 2>&1
grep -E "DRAM Throughput|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Block Limit|Warp Cycles Per Issued" $R/um8_p64_s2.txt | head -30
