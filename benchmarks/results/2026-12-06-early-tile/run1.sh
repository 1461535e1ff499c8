#!/usr/bin/env bash
# r1 (one device call, repository root): the unit-major pass's first tile before its wait for the query fold
# (CKVP_MMA_EARLY: pre = L2 prefetches, early = register loads), with and without programmatic dependent launch
# (CKVP_PDL), against the reference, then whole-call timings at the four acceptance shapes.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r1; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
cat $R/gpu.txt
A=vpair+pscan+fmerge+evict
MMA_CASES=12 MMA_LARGE=0 timeout 200 python3 benchmarks/mma_attention_gpu.py --check --out $R --formats int8/32,int4/32 \
  --variants $A+pdl+pre,$A+pdl+early,$A+pre,$A+early \
  --check-variants $A+pdl+pre,$A+pdl+early,$A+pre > $R/check.log 2>&1
echo "check rc=$?"; tail -3 $R/check.log
timeout 330 python3 benchmarks/mma_attention_gpu.py --sweep --out $R --shapes 8:32768,8:131072,32:32768,32:131072 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 \
  --variants $A,$A+pdl,$A+pdl+pre,$A+pdl+early,$A+pre > $R/sweep.log 2>&1
echo "sweep rc=$?"
grep -o '"b": [0-9]*\|"t": [0-9]*\|"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*\|"regs": [0-9]*' $R/sweep.log | paste - - - - - -
grep -o '"variant": "[^"]*"\|"kernel_us": [^}]*}' $R/sweep.log | paste - - | head -24
