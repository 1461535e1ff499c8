#!/usr/bin/env bash
# One device call (repository root): the GPU side of the 2026-12-05 review fixes. The main example on CUDA (both
# rewrites, latent KV + expert GEMM), then the GPU test files (expert offload, the store's private pool, the grouped
# GEMM kernels), each with its own time limit; logs and versions under $OUT.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers, platform; print(torch.__version__, triton.__version__, transformers.__version__, platform.python_version(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
git rev-parse HEAD >> $R/gpu.txt 2>/dev/null
cat $R/gpu.txt
timeout ${GEN_S:-200} python3 examples/generate.py --device cuda --dtype bfloat16 > $R/generate_cuda.log 2>&1
echo generate rc=$?; tail -6 $R/generate_cuda.log
timeout ${TEST_S:-330} python3 -m pytest -q -p no:cacheprovider tests/runtime/test_offload_gpu.py \
    tests/runtime/test_store_pool_gpu.py tests/kernels/test_grouped_gemm_gpu.py tests/ops/test_moe_grouped_mm_gpu.py \
    --junitxml=$R/gpu_tests.xml > $R/gpu_tests.log 2>&1
echo tests rc=$?; tail -4 $R/gpu_tests.log
