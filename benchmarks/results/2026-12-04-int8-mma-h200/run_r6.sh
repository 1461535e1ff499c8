#!/usr/bin/env bash
# r6 (one device call, repository root): two unmasked tiles loaded ahead (DecodeConfig.ahead_m = 2) in the
# unit-major MMA pass: numerics (random cases draw ahead 1 / 2, both formats), then the sweep in 64-slot pages.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r6
mkdir -p $R/int8 $R/int4
MMA_CASES=24 timeout 260 python3 benchmarks/mma_attention_gpu.py --check --formats int8/32,int4/32 --out $R \
    > $R/check.log 2>&1
echo check rc=$?; tail -2 $R/check.log; grep -c "^ok" $R/check.log; grep "^BAD" $R/check.log | head -3
for f in int8 int4; do
  timeout 150 python3 benchmarks/mma_attention_gpu.py --sweep --out $R/$f --block-ns 64 --layouts unit-major@64 \
      --formats $f/32 --programs $([ $f = int8 ] && echo 1536 || echo 3072) --aheads 1,2 > $R/$f/sweep.log 2>&1
  echo $f sweep rc=$?
  python3 - $f <<'PY'
import json, os, sys
d = json.load(open(os.environ["OUT"] + f"/r6/{sys.argv[1]}/sweep.json"))
for r in d["rows"]:
    if "default" in r["config"]:
        continue
    ku = r.get("kernel_us")
    ku = {k: round(v, 1) for k, v in ku.items()} if isinstance(ku, dict) else ku
    print(sys.argv[1], r["b"], r["t"], r["config"][-22:], round(r["ms"], 4), round(100 * r["copy_share"], 1),
          round(r["speedup"], 2), r.get("regs"), ku)
PY
done
