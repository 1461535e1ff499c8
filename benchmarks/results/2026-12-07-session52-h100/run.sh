#!/usr/bin/env bash
# One device call (repository root; session 52, as session 51's script): IMMA + FPAIR + VIMMA now on by default (checked in r4 as the explicit variant
# vpair+pscan+fmerge+evict+pdl+pre+imma+fpair+vimma). Issue 5's acceptance bench twice with the defaults (no
# CKVP_MMA_* variables); CHECK=1 also runs the MMA check of that variant, EX=1 the main example on CUDA, and
# PAIRS="programs:maxnreg ..." a sweep of the default kernel at batch 8, 32k over grid sizes and register caps.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/${RUN:-r1}; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, platform; print(torch.__version__, triton.__version__, platform.python_version(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" >> $R/gpu.txt
python3 -c "import ckvp_compile.kernels.latent_attention_mma as m; print('defaults imma', m.int8_keys(), 'fpair', m.field_pairs(), 'vimma', m.int8_values())" >> $R/gpu.txt
cat $R/gpu.txt
if [ "${CHECK:-0}" = 1 ]; then
  V=vpair+pscan+fmerge+evict+pdl+pre+imma+fpair+vimma
  MMA_CASES=${CASES:-12} MMA_LARGE=0 timeout ${CHECK_S:-150} python3 benchmarks/mma_attention_gpu.py --check --formats int8/32 \
    --variants $V --check-variants $V --out $R/check > $R/check.log 2>&1
  echo "check rc=$?"; grep -c "^ok" $R/check.log; grep "^BAD\|rror\|Traceback\|PASSED\|FAILED" $R/check.log | head -5
fi
for rep in ${REPS:-1 2}; do
  timeout ${BENCH_S:-80} python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
    --json $R/attention-default-$rep.json --out $R/attention-default-$rep.md > $R/bench-$rep.log 2>&1
  echo "bench $rep rc=$?"; grep "^| int8" $R/attention-default-$rep.md
done
for pm in ${PAIRS:-}; do
  pr=${pm%:*}; mr=${pm#*:}
  timeout ${SWEEP_S:-60} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep-$pr --shapes ${SHAPES:-8:32768} \
    --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs $pr --maxnregs $mr --stages 0 \
    --variants vpair+pscan+fmerge+evict+pdl+pre+imma+fpair+vimma >> $R/sweep.log 2>&1
  echo "sweep $pm rc=$?"
done
[ -n "${PAIRS:-}" ] && grep '"b"' $R/sweep.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['b'], r['t'], ' '.join(r['config'].split()[2:4]), 'regs', r.get('regs'), round(r['ms']*1e3,1), 'us', round(r['speedup_over_byte_ratio'],4), r.get('kernel_us'))"
if [ "${EX:-0}" = 1 ]; then
  timeout ${EX_S:-100} python3 examples/generate.py --device cuda --dtype bfloat16 > $R/generate.log 2>&1
  echo "generate rc=$?"; tail -12 $R/generate.log
fi
