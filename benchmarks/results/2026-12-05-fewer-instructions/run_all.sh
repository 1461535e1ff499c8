#!/usr/bin/env bash
# One device call (repository root, <= 600 s): a shorter `run.sh check`, a shorter `run.sh sweep`, then issue 5's
# acceptance benchmark with every switch on through the environment (the flags stay False until this passes):
#   pscan (latent_attention_mma.PAGE_SCAN_GPU_CHECKED), vpair (VPAIR_GPU_CHECKED), pdl
#   (latent_attention_triton.PDL_GPU_CHECKED), fmerge (FMA_MERGE_GPU_CHECKED).
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r1
mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt
MMA_CASES=${MMA_CASES:-16} MMA_LARGE=${MMA_LARGE:-0} timeout ${CHECK_S:-250} python3 benchmarks/mma_attention_gpu.py --check --out $R \
    --formats int8/32,int4/32 --variants base,pscan+fmerge,vpair+pscan+fmerge,vpair+pscan+pdl+fmerge \
    --check-variants pscan+fmerge,vpair+pscan+pdl+fmerge > $R/check.log 2>&1
echo check rc=$?; grep -c "^ok" $R/check.log; grep "^BAD" $R/check.log | cut -c1-300 | head -5; tail -1 $R/check.log | cut -c1-200
V=${VARIANTS:-base,pscan,pscan+fmerge,vpair+pscan+fmerge,vpair+pscan+pdl+fmerge}
timeout ${SWEEP_S:-190} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep --block-ns 64 \
    --layouts unit-major@64 --formats int8/32 --programs ${PROGRAMS:-1536,2112} --stages 0 --variants $V \
    --shapes 8:32768,8:131072,32:32768 > $R/sweep.log 2>&1
echo sweep rc=$?
python3 $(dirname $0)/sweep_rows.py $R/sweep.log
# the switches no BAD case of the check had on (a switch of a failing set stays off)
ENV=$(python3 - $R/check.log <<'PY'
import json, re, sys
env = {"pscan": "CKVP_MMA_PAGE_SCAN", "vpair": "CKVP_MMA_VPAIR", "pdl": "CKVP_PDL", "fmerge": "CKVP_FMA_MERGE"}
bad = set()
for line in open(sys.argv[1]):
    if line.startswith("BAD"):
        m = re.search(r'"variant": "([^"]+)"', line)
        bad |= set(m.group(1).split("+")) if m else set(env)
print(" ".join(f"{v}={0 if k in bad else 1}" for k, v in env.items()))
PY
)
echo bench env: $ENV | tee $R/bench_env.txt
env $ENV timeout ${BENCH_S:-120} \
    python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 int4/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
    --json $R/attention-unit-major-p64.json --out $R/attention-unit-major-p64.md > $R/bench.log 2>&1
echo bench rc=$?; grep "^| int" $R/attention-unit-major-p64.md
