#!/usr/bin/env bash
# The unit-major MMA pass's switches on the H200, two device calls (repository root):
#   bash run.sh check   correctness (random cases, each drawing a switch set; CHECK_VARIANTS on int8 cases
#                       with an unmapped page below the context, ring and CUDA-graph replays included; the
#                       large cases and the staged ring as before), ~9 min;
#   bash run.sh sweep   whole-call timings of each set in 64-slot int8 pages at batch 8 / 32, 32k / 128k, ~5 min.
# Switches (ckvp_compile/kernels/latent_attention_mma.py, latent_attention_triton.py): pscan = unmapped pages to
# the masked loop; vpair = 8-bit value slot pairs from one word; pdl = programmatic dependent launch of fold -> pass
# -> merge; fmerge = the merge in fp32 multiply-adds, one warp a query head (latent_attention_triton). Their
# *_GPU_CHECKED flags stay False until this passes.
set -u
export PYTHONPATH=.:tests/kernels PYTHONUNBUFFERED=1
R=$OUT/r1
mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
V=${VARIANTS:-base,pscan,vpair+pscan,pscan+fmerge,vpair+pscan+fmerge,vpair+pscan+pdl+fmerge}
if [ "${1:-check}" = check ]; then
MMA_CASES=${MMA_CASES:-24} timeout ${CHECK_S:-560} python3 benchmarks/mma_attention_gpu.py --check --out $R \
    --formats int8/32,int4/32 --variants $V --check-variants ${CHECK_VARIANTS:-pscan,vpair+pscan+pdl+fmerge} \
    > $R/check.log 2>&1
echo check rc=$?; grep -c "^ok" $R/check.log; grep "^BAD" $R/check.log | head -5; tail -1 $R/check.log
exit 0
fi
timeout ${SWEEP_S:-560} python3 benchmarks/mma_attention_gpu.py --sweep --out $R/sweep --block-ns 64 \
    --layouts unit-major@64 --formats int8/32 --programs ${PROGRAMS:-1536,2112} --maxnregs ${MAXNREGS:-0} \
    --stages 0 --variants $V > $R/sweep.log 2>&1
echo sweep rc=$?
python3 $(dirname $0)/sweep_rows.py $R/sweep/sweep.json
