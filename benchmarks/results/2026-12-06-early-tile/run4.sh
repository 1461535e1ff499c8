#!/usr/bin/env bash
# r4 (one device call, repository root): the pass's own query fold (fold, off by default) now that the first tile is
# prefetched before it (pre), against the fold launch, with and without programmatic dependent launch: a few
# random cases against the reference, then two interleaved repeats at batch 8, 32k and 128k.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r4; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
A=vpair+pscan+fmerge+evict
MMA_CASES=8 MMA_LARGE=0 timeout 100 python3 benchmarks/mma_attention_gpu.py --check --out $R --formats int8/32,int4/32 \
  --variants $A+fold+pre > $R/check.log 2>&1
echo "check rc=$?"; grep -c "^ok" $R/check.log; grep -c '"ok": false' $R/check.log
V=$A+pre,$A+fold+pre,$A+pdl+pre
timeout 200 python3 benchmarks/mma_attention_gpu.py --sweep --out $R --shapes 8:32768,8:131072 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 --variants $V,$V > $R/sweep.txt 2>&1
echo "sweep rc=$?"
grep -o '"b": [0-9]*\|"t": [0-9]*\|"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*' $R/sweep.txt | paste - - - - -
grep -o '"variant": "[^"]*"\|"kernel_us": [^}]*}' $R/sweep.txt | paste - - | head -14
