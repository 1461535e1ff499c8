#!/usr/bin/env bash
# r2 (one device call, repository root; any Hopper card, recorded in gpu.txt): the unit-major pass's 8-bit key
# product on the integer tensor cores (IMMA, CKVP_MMA_IMMA; latent_attention_mma.int8_keys) and its fields two slots
# a prmt (FPAIR, CKVP_MMA_FIELD_PAIRS) checked against the reference (random cases drawing them, and the
# unmapped-page variant cases), timed against the default at the acceptance shapes (two interleaved repeats), then
# issue 5's acceptance bench with all three on and off (VIMMA: the value product on the integer tensor cores too).
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/${RUN:-r2}; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, platform; print(torch.__version__, triton.__version__, platform.python_version(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
cat $R/gpu.txt
A=vpair+pscan+fmerge+evict+pdl+pre
MMA_CASES=${CASES:-30} MMA_LARGE=0 timeout ${CHECK_S:-120} python3 benchmarks/mma_attention_gpu.py --check --formats int8/32 \
  --variants $A+imma+fpair+vimma,$A+imma+fpair,$A+imma --check-variants $A+imma+fpair+vimma,$A+imma+fpair --out $R/check > $R/check.log 2>&1
echo "check rc=$?"; grep -c "^ok" $R/check.log; grep "^BAD\|rror\|Traceback" $R/check.log | head -5; tail -3 $R/check.log
timeout ${SWEEP_S:-150} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep --shapes ${SHAPES:-8:32768,32:32768,8:131072} \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 \
  --variants $A,$A+imma+fpair+vimma,$A+imma+fpair,$A,$A+imma+fpair+vimma > $R/sweep.log 2>&1
echo "sweep rc=$?"
grep '"b"' $R/sweep.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['b'], r['t'], r['variant'].replace('vpair+pscan+fmerge+evict+pdl+pre', 'A'), 'regs', r.get('regs'), round(r['ms']*1e3,1), 'us', round(r['speedup_over_byte_ratio'],3), r.get('kernel_us'))"
for v in ${BENCH_RUNS-1 0}; do
  CKVP_MMA_IMMA=$v CKVP_MMA_FIELD_PAIRS=$v CKVP_MMA_VIMMA=$v timeout ${BENCH_S:-80} python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
    --json $R/attention-imma$v.json --out $R/attention-imma$v.md > $R/bench$v.log 2>&1
  echo "bench imma=$v rc=$?"; grep "^| int8" $R/attention-imma$v.md
done
