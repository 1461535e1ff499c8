#!/usr/bin/env bash
# r2 (one device call, repository root): the first tile prefetched into L2 before the query (pre; in 64-slot pages
# each program bulk-prefetches its share of the page), and the register path's loop prefetching the tile 1 or 2
# past the one it loads (ahead1 / ahead2), with and without programmatic dependent launch (pdl): checked against
# the reference, then whole-call timings at the four acceptance shapes, two interleaved repeats.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r2; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
cat $R/gpu.txt
A=vpair+pscan+fmerge+evict
MMA_CASES=12 MMA_LARGE=0 timeout 200 python3 benchmarks/mma_attention_gpu.py --check --out $R --formats int8/32,int4/32 \
  --variants $A+pre+ahead1,$A+pre+ahead2,$A+pdl+pre+ahead1 \
  --check-variants $A+pre+ahead1,$A+pre+ahead2,$A+pdl+pre+ahead1 > $R/check.log 2>&1
echo "check rc=$?"; tail -3 $R/check.log
V=$A,$A+pre,$A+pre+ahead1,$A+pre+ahead2,$A+pdl+pre+ahead1
timeout 330 python3 benchmarks/mma_attention_gpu.py --sweep --out $R --shapes 8:32768,8:131072,32:32768,32:131072 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 --variants $V,$V > $R/sweep.log 2>&1
echo "sweep rc=$?"
grep -o '"b": [0-9]*\|"t": [0-9]*\|"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*\|"regs": [0-9]*' $R/sweep.log | paste - - - - - -
