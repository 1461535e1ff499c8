#!/usr/bin/env bash
# One device call (repository root): probe 2 (bug_probe2.py), then check_equivalence on CUDA after the fix.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=. timeout 200 python3 benchmarks/results/2026-12-06-prefill-bug/bug_probe2.py $OUT > $OUT/probe2.log 2>&1
echo "probe2 rc=$?"; grep -E "^(bmm|rotary|plain|repeat|experts|moe_block|experts implementation)" $OUT/probe2.log | cut -c1-1800
PYTHONPATH=. timeout 160 python3 benchmarks/results/2026-12-06-prefill-bug/equivalence_gpu.py $OUT/equivalence_gpu.json 6 \
  > $OUT/equivalence.log 2>&1
echo "equivalence rc=$?"; grep -v "Warning\|warn(\|^ *$" $OUT/equivalence.log | tail -30 | cut -c1-600
