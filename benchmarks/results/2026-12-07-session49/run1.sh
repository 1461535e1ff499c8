#!/usr/bin/env bash
# r1 (one device call, repository root; any Hopper card, recorded in gpu.txt): where the whole call's time goes as
# the context grows (query fold / pass / merge device times from torch.profiler, the default unit-major int8/32
# pass, 2112 programs), then issue 5's acceptance bench once with the acceptance format and two others.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/${RUN:-r1}; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers, platform; print(torch.__version__, triton.__version__, transformers.__version__, platform.python_version(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
cat $R/gpu.txt
A=vpair+pscan+fmerge+evict
timeout ${SWEEP_S:-200} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep \
  --shapes ${SHAPES:-8:8192,8:16384,8:32768,8:65536,8:131072,32:8192,32:16384,32:32768} \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 --variants $A+pdl+pre > $R/sweep.log 2>&1
echo "sweep rc=$?"
grep '"b"' $R/sweep.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['b'], r['t'], r['variant'], round(r['ms']*1e3,1), 'us', round(r['speedup_over_byte_ratio'],3), r.get('kernel_us'))"
timeout ${BENCH_S:-200} python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
  --contexts 32768 131072 --formats ${FORMATS:-int8/32:32 int8/32:64 int4/32:32} --cuda-graphs --latent-layout unit-major \
  --page-size 64 --json $R/attention.json --out $R/attention.md > $R/bench.log 2>&1
echo "bench rc=$?"; tail -3 $R/bench.log; grep "^| int" $R/attention.md
