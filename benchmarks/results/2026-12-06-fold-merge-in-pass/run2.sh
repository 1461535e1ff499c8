#!/bin/bash
# r2 (one device call, repository root): cache hints on the unit-major pass's latent loads (CKVP_MMA_HINT:
# evict_first, .cg) at the four acceptance shapes, whole calls in CUDA-graph replay, the default in the same run.
set -x
export PYTHONPATH=.:tests/kernels
D=$OUT/r2; mkdir -p $D
nvidia-smi --query-gpu=name,driver_version --format=csv > $D/gpu.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $D/gpu.txt
timeout 480 python3 benchmarks/mma_attention_gpu.py --sweep --out $D --shapes 8:32768,8:131072,32:32768,32:131072 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 \
  --variants vpair+pscan+fmerge,vpair+pscan+fmerge+evict,vpair+pscan+fmerge+cg > $D/sweep.log 2>&1
echo "sweep rc=$?"
grep -o '"b": [0-9]*\|"t": [0-9]*\|"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*\|"copy_share": [0-9.]*' $D/sweep.log | paste - - - - - -
