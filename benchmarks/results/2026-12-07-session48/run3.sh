#!/usr/bin/env bash
# One device call (repository root), as run2.sh after the fields moved into the TMA stages too (r4: six copies a tile; r5: four, the fields by 3-d boxes): the TMA path (CKVP_MMA_TMA; latent_attention_mma.tma_stages)
# checked against the reference, timed against the default register path at the acceptance shapes, then issue 5's
# acceptance bench with it on. Any Hopper card (the card is recorded in gpu.txt).
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=.:tests/kernels
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
A=vpair+pscan+fmerge+evict
MMA_CASES=${CASES:-24} timeout ${CHECK_S:-170} python3 benchmarks/mma_attention_gpu.py --check --formats int8/32 \
  --variants $A+pdl+tma,$A+tma,$A+pdl+tma3 --check-variants $A+pdl+tma,$A+tma3 --out $OUT/check > $OUT/check.log 2>&1
echo "check rc=$?"; grep -i "check\|fail\|error" $OUT/check.log | grep -v "^{" | tail -8
timeout ${SWEEP_S:-230} python3 benchmarks/mma_attention_gpu.py --sweep --out $OUT/sweep --shapes ${SHAPES:-8:32768,32:32768,8:131072} \
  --block-ns 64 --layouts unit-major@64 --formats int8/32 --programs 2112 --stages 0 --maxnregs ${MAXNREGS:-0} \
  --variants $A+pdl+pre,$A+pdl+tma,$A+pdl+tma3 > $OUT/sweep.log 2>&1
echo "sweep rc=$?"
grep '"b"' $OUT/sweep.log | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['b'], r['t'], r['variant'], r['config'].split('maxnreg=')[1].split()[0], 'regs', r['regs'], 'tma', r.get('tma'), round(r['ms']*1e3,1), 'us', round(r['speedup_over_byte_ratio'],3), r.get('kernel_us'))"
if [ "${BENCH:-1}" = 1 ]; then
  CKVP_MMA_TMA=${TMA:-2} timeout 150 python3 -m ckvp_compile.bench.cli attention --key-space post_rope --heads 32:8 --batches 8 32 \
    --contexts 32768 131072 --formats int8/32:32 --cuda-graphs --latent-layout unit-major --page-size 64 \
    --json $OUT/attention-tma.json --out $OUT/attention-tma.md > $OUT/bench.log 2>&1
  echo "bench rc=$?"; grep "^| int8" $OUT/attention-tma.md
fi
