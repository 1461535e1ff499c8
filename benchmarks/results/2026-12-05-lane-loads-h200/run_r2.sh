#!/usr/bin/env bash
# r2 (one device call, repository root): the unit-major MMA pass with lane-base loads (each tile's loads share one
# address per lane and tensor, constant column offsets as immediates: 619 SASS a 64-slot int8 tile instead of 765,
# 128 registers instead of 167): correctness, then the sweep in 64-slot unit-major pages (int8/32, int4/32).
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1 CKVP_MMA_LANE_LOADS=${CKVP_MMA_LANE_LOADS:-1}
R=$OUT/r2
mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
MMA_CASES=${MMA_CASES:-20} timeout ${CHECK_S:-200} python3 benchmarks/mma_attention_gpu.py --check --out $R \
    --formats int8/32,int4/32 > $R/check.log 2>&1
echo check rc=$?; tail -2 $R/check.log
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/r2/check.json"))
print("ok", d["ok"], "cases", len(d["small"]), "large", len(d["large"]))
for r in d["large"]:
    print("large", r["format"], r["b"], r["t"], r["layout"], r["rel_err_fp32_out"], r["rel_err_bf16_out"])
PY
timeout ${SWEEP_S:-150} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep --block-ns 64 \
    --layouts unit-major@64 --formats int8/32,int4/32 --programs ${PROGRAMS:-1536,2112} --stages 0 \
    > $R/sweep.log 2>&1
echo sweep rc=$?
python3 - $R/sweep/sweep.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    ku = r.get("kernel_us")
    ku = {k.split(":")[1][:12]: round(v, 1) for k, v in ku.items()} if isinstance(ku, dict) else ku
    print(r["b"], r["t"], r["format"], r["config"].replace("mma bn=64 ", "").replace(" split_d=None one_pass=None", ""),
          round(r["ms"], 4), round(100 * r["copy_share"], 1), round(r["speedup"], 2), r.get("regs"), ku)
PY
# the acceptance's benchmark (issue 5): whole calls in CUDA-graph replay against dense in the same run
timeout ${BENCH_S:-120} python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 int4/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
    --json $R/attention-unit-major-p64.json --out $R/attention-unit-major-p64.md > $R/bench.log 2>&1
echo bench rc=$?; grep "^| int" $R/attention-unit-major-p64.md
