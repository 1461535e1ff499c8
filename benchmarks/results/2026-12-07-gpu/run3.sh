#!/usr/bin/env bash
# One device call (repository root), for the H200: issue 5's sweep and acceptance bench
# (../2026-12-06-early-tile/run9.sh), files packed into $OUT/r9.tgz; on another card it prints the card and stops.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
grep -q H200 $OUT/gpu.txt || { echo "not an H200: nothing run"; exit 0; }
mkdir -p $OUT/r9 && bash benchmarks/results/2026-12-06-early-tile/run9.sh
(cd $OUT && tar czf r9.tgz r9 && rm -rf r9)
