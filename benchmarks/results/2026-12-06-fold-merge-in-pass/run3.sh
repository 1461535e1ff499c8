#!/bin/bash
# r3 (one device call on the machine of r2, repository root): default vs evict_first twice, interleaved, at the four
# shapes; then the acceptance bench with CKVP_MMA_HINT=1.
set -x
export PYTHONPATH=.:tests/kernels
D=$OUT/r3; mkdir -p $D
nvidia-smi --query-gpu=name,driver_version --format=csv > $D/gpu.txt 2>&1
timeout 300 python3 benchmarks/mma_attention_gpu.py --sweep --out $D --shapes 8:32768,8:131072,32:32768,32:131072 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 \
  --variants vpair+pscan+fmerge+evict,vpair+pscan+fmerge,vpair+pscan+fmerge+evict,vpair+pscan+fmerge > $D/sweep.log 2>&1
echo "sweep rc=$?"
grep -o '"b": [0-9]*\|"t": [0-9]*\|"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*' $D/sweep.log | paste - - - - -
CKVP_MMA_HINT=1 timeout 240 python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
  --contexts 32768 131072 --formats int8/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
  --json $D/attention-evict.json --out $D/attention-evict.md > $D/bench.log 2>&1
echo "bench rc=$?"
tail -12 $D/bench.log
