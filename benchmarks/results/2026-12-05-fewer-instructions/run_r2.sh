#!/usr/bin/env bash
# r2 (one device call, repository root): the new defaults (page scan, value pairs, fma merge on; 2112 programs for
# 8-bit codes; PDL still off): issue 5's acceptance benchmark, then batch 8, 32k with PDL (the pass now triggers
# after its tile loops) and with a register cap (more programs an SM), and batch 8, 128k with PDL.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r2
mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt
timeout ${BENCH_S:-150} python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 int4/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
    --json $R/attention-unit-major-p64.json --out $R/attention-unit-major-p64.md > $R/bench.log 2>&1
echo bench rc=$?; grep "^| int" $R/attention-unit-major-p64.md
timeout ${SWEEP_S:-100} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep --block-ns 64 \
    --layouts unit-major@64 --formats int8/32 --programs 2112,2376 --maxnregs 0,112 --stages 0 \
    --variants vpair+pscan+fmerge,vpair+pscan+pdl+fmerge --shapes 8:32768 > $R/sweep.log 2>&1
# PDL with the pass's trigger after its tile loops (r1 triggered at its start): batch 8, 128k at 1536 and 2112
timeout ${SWEEP2_S:-60} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep2 --block-ns 64 \
    --layouts unit-major@64 --formats int8/32 --programs 1536,2112 --stages 0 \
    --variants vpair+pscan+fmerge,vpair+pscan+pdl+fmerge --shapes 8:131072 >> $R/sweep.log 2>&1
echo sweep rc=$?
python3 $(dirname $0)/sweep_rows.py $R/sweep.log
