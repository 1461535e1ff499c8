#!/bin/bash
# r4 (one device call, repository root): the pass's own fold, its operand now read back through shared memory and its
# chunks' loads issued together (bf16 q and bases): check, then default vs fold interleaved twice at the four shapes.
set -x
export PYTHONPATH=.:tests/kernels
D=$OUT/r4; mkdir -p $D
nvidia-smi --query-gpu=name,driver_version --format=csv > $D/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $D/gpu.txt
MMA_CASES=24 MMA_LARGE=0 timeout 240 python3 benchmarks/mma_attention_gpu.py --check --out $D --formats int8/32,int4/32 \
  --variants vpair+pscan+fmerge+fold --check-variants vpair+pscan+fmerge+fold > $D/check.log 2>&1
echo "check rc=$?"; grep -c "^ok" $D/check.log; grep "^BAD" $D/check.log | head -3; tail -1 $D/check.log
timeout 300 python3 benchmarks/mma_attention_gpu.py --sweep --out $D --shapes 8:32768,8:131072,32:32768,32:131072 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 \
  --variants vpair+pscan+fmerge+fold,vpair+pscan+fmerge,vpair+pscan+fmerge+fold,vpair+pscan+fmerge > $D/sweep.log 2>&1
echo "sweep rc=$?"
grep -o '"b": [0-9]*\|"t": [0-9]*\|"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*' $D/sweep.log | paste - - - - -
