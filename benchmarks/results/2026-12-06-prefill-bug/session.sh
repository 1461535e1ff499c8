#!/usr/bin/env bash
# One device call (repository root): the batched-prefill probe (bug_probe.py, files under $OUT/probe), then on an
# H200 only issue 5's early-tile sweep and one acceptance bench (run6.sh via run9.sh's variants, $OUT/r9). Every
# file is packed into $OUT/all.tgz at the end (the device returns at most 8 files).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=. timeout ${PROBE_S:-270} python3 benchmarks/results/2026-12-06-prefill-bug/bug_probe.py $OUT/probe \
  > $OUT/probe.log 2>&1
echo "probe rc=$?"; grep -v "Warning\|warn(" $OUT/probe.log | cut -c1-1500 | tail -30
if grep -q H200 $OUT/gpu.txt; then
  A=vpair+pscan+fmerge+evict
  V=$A,$A+pre,$A+pdl+pre,$A+pdl+pre+pdlfold
  RUN=r9 VARIANTS=$V SWEEP_S=140 BENCH_RUNS=1 bash benchmarks/results/2026-12-06-early-tile/run6.sh
fi
cd $OUT && tar czf all.tgz --exclude=all.tgz . && find . -type f ! -name all.tgz -delete; ls -la $OUT
