#!/usr/bin/env bash
# One device call (repository root): this session's reliability fixes on the GPU image's torch 2.11 / transformers
# 5.17 (CPU tests, run there for those versions: the cache-misfit error's Dynamo reset, the graph break between a
# latent cache's write and its attention, the online-bases warning), then, on an H200 only, issue 5's early-tile sweep
# and acceptance bench (benchmarks/results/2026-12-06-early-tile/run9.sh, files under $OUT/r9).
set -u
export PYTHONUNBUFFERED=1
mkdir -p $OUT/r9
timeout 200 env PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests/reliability/test_cache_mismatch_recovery.py \
  tests/reliability/test_graph_break_in_attention.py tests/reliability/test_online_bases_later_calls.py \
  > $OUT/r9/tests.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/r9/tests.log
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash benchmarks/results/2026-12-06-early-tile/run9.sh
else
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "not an H200: the bench is skipped"
fi
