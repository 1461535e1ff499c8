#!/usr/bin/env bash
# One device call (repository root). On an H200: issue 5's sweep and acceptance bench (../2026-12-06-early-tile/run9.sh,
# files under $OUT/r9), then check_equivalence on CUDA in the time left; on another card, check_equivalence only.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
EQ_S=500
if grep -q H200 $OUT/gpu.txt; then
  mkdir -p $OUT/r9; bash benchmarks/results/2026-12-06-early-tile/run9.sh; EQ_S=190
fi
PYTHONPATH=. timeout $EQ_S python3 benchmarks/results/2026-12-06-prefill-bug/equivalence_gpu.py $OUT/equivalence_gpu.json 6 \
  > $OUT/equivalence.log 2>&1
echo "equivalence rc=$?"; grep -v "Warning\|warn(\|^ *$\|Online softmax\|split the reduction\|important use case\|softmax\.$" $OUT/equivalence.log | tail -30 | cut -c1-600
# the device returns at most 8 files
[ -d $OUT/r9 ] && (cd $OUT && tar czf r9.tgz r9 && rm -rf r9)
