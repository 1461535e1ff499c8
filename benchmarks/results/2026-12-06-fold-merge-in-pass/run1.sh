#!/bin/bash
# r1 (one device call, repository root): the unit-major pass with its own query fold and split merge
# (CKVP_MMA_FOLD / CKVP_MMA_MERGE) against the reference, then whole-call timings at batch 8, 32k.
set -x
export PYTHONPATH=.:tests/kernels
D=$OUT/r1; mkdir -p $D
nvidia-smi --query-gpu=name,driver_version --format=csv > $D/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $D/gpu.txt
MMA_CASES=48 MMA_LARGE=0 timeout 300 python3 benchmarks/mma_attention_gpu.py --check --out $D --formats int8/32,int4/32 \
  --variants vpair+pscan+fmerge+merge,vpair+pscan+fold+merge,vpair+pscan+fold+fmerge \
  --check-variants vpair+pscan+fmerge+merge,vpair+pscan+fold+merge,vpair+pscan+fold+fmerge > $D/check.log 2>&1
echo "check rc=$?"
tail -3 $D/check.log
timeout 240 python3 benchmarks/mma_attention_gpu.py --sweep --out $D --shapes 8:32768 --block-ns 64 --layouts unit-major@64 \
  --formats int8/32 --programs 2112 --stages 0 \
  --variants vpair+pscan+fmerge,vpair+pscan+merge,vpair+pscan+fold+fmerge,vpair+pscan+fold+merge > $D/sweep.log 2>&1
echo "sweep rc=$?"
grep -o '"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*\|"kernel_us": [^}]*}\|"regs": [0-9]*' $D/sweep.log | paste - - - - - 
