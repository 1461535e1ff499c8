#!/usr/bin/env bash
# r7 (one device call, repository root): the query fold launched as a programmatic dependent of the kernel before
# it (pdlfold, CKVP_PDL_FOLD) on top of the defaults at batch 8, 32k: variant checks (CUDA-graph replays), then two
# interleaved repeats.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r7; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
A=vpair+pscan+fmerge+evict+pre
MMA_CASES=4 MMA_LARGE=0 timeout 80 python3 benchmarks/mma_attention_gpu.py --check --out $R --formats int8/32 \
  --variants $A+pdl+pdlfold --check-variants $A+pdl+pdlfold > $R/check.log 2>&1
echo "check rc=$?"; grep -c "^ok" $R/check.log; grep -c '"ok": false' $R/check.log
V=$A+pdl,$A+pdl+pdlfold
timeout 90 python3 benchmarks/mma_attention_gpu.py --sweep --out $R --shapes 8:32768 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 --variants $V,$V,$V > $R/sweep.txt 2>&1
echo "sweep rc=$?"
grep -o '"variant": "[^"]*"\|"ms": [0-9.e-]*\|"kernel_us": [^}]*}' $R/sweep.txt | paste - - -
