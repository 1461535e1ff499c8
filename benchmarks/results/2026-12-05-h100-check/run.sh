#!/usr/bin/env bash
# One device call (repository root): what a user checks on a new card. The main example on CUDA, then issue 5's
# acceptance benchmark (int8/32 and int4/32 latents at rank 32, 64-slot unit-major pages, Mixtral's 32:8 heads,
# CUDA graphs) with its errors against the reference and its dense baseline in the same run.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT  # the files in benchmarks/results/2026-12-05-h100-check
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers, platform; print(torch.__version__, triton.__version__, transformers.__version__, platform.python_version(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
cat $R/gpu.txt
timeout ${GEN_S:-200} python3 examples/generate.py --device cuda --dtype bfloat16 > $R/generate_cuda.log 2>&1
echo generate rc=$?; tail -5 $R/generate_cuda.log
timeout ${BENCH_S:-200} python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 int4/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
    --json $R/attention-unit-major-p64.json --out $R/attention-unit-major-p64.md > $R/bench.log 2>&1
echo bench rc=$?; grep "^| int\|^| dense\|copy" $R/attention-unit-major-p64.md | head -20
