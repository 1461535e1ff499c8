#!/usr/bin/env bash
# r5 (one device call, repository root): with the defaults of this session (evict_first on the pass's latent loads),
# the main example on CUDA, then issue 5's acceptance benchmark twice (int8/32 at rank 32, 64-slot unit-major pages,
# Mixtral's 32:8 heads, CUDA graphs; errors against the reference and the dense baseline in the same run).
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r5; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers, platform; print(torch.__version__, triton.__version__, transformers.__version__, platform.python_version(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
cat $R/gpu.txt
timeout 200 python3 examples/generate.py --device cuda --dtype bfloat16 > $R/generate_cuda.log 2>&1
echo generate rc=$?; tail -4 $R/generate_cuda.log
for i in 1 2; do
  timeout 150 python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
      --contexts 32768 131072 --formats int8/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
      --json $R/attention-run$i.json --out $R/attention-run$i.md > $R/bench$i.log 2>&1
  echo bench$i rc=$?; grep "^| int" $R/attention-run$i.md
done
