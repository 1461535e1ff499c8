#!/usr/bin/env bash
# r6 (one device call, repository root; meant for the H200): the first-tile prefetch and PDL at batch 8, 32k (two
# interleaved repeats), then issue 5's acceptance benchmark twice with this commit's defaults.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/${RUN:-r6}; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers, platform; print(torch.__version__, triton.__version__, transformers.__version__, platform.python_version(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
cat $R/gpu.txt
A=vpair+pscan+fmerge+evict
V=${VARIANTS:-$A,$A+pre,$A+pdl+pre}
timeout ${SWEEP_S:-100} python3 benchmarks/mma_attention_gpu.py --sweep --out $R --shapes 8:32768 \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 --variants $V,$V > $R/sweep.txt 2>&1
echo "sweep rc=$?"
grep -o '"b": [0-9]*\|"t": [0-9]*\|"variant": "[^"]*"\|"ms": [0-9.e-]*\|"speedup_over_byte_ratio": [0-9.]*' $R/sweep.txt | paste - - - - -
for i in ${BENCH_RUNS:-1 2}; do
  timeout 120 python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
      --contexts 32768 131072 --formats int8/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
      --json $R/attention-run$i.json --out $R/attention-run$i.md > /tmp/bench$i.log 2>&1
  echo bench$i rc=$?; tail -2 /tmp/bench$i.log; grep "^| int" $R/attention-run$i.md
done
