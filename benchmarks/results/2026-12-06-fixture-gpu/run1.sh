#!/usr/bin/env bash
# Issue 9's fixture agreement at 4x on the GPU, the best configuration as ../2026-12-05-f8-scales-cpu ran it on CPU:
# (B) 16 prompts of 1024 bytes (a context where the 4x counted at 4096 slots is nearer the state's own ratio), then
# (A) the same 16 prompts of 128 bytes as on CPU. One device call, repository root; RUN=N writes $OUT/rN.
# r1: every run failed in the measured planner (windows on the GPU, logits on the CPU; fixed in
# bench.fidelity._nll_and_argmax); r2: this script after the fix.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/r${RUN:-1}; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, triton, transformers, platform; print(torch.__version__, triton.__version__, transformers.__version__, platform.python_version())" >> $R/gpu.txt
cat $R/gpu.txt
C="python3 -m ckvp_compile.bench.cli decode --shape fixture --ratios 4 --latent-format planned+rot+fp8+measured --planned-format mix/32-f8 --compiler aot_eager --device cuda --recent-window 16 --group-size 1"
for spec in "B 16 1024" "A 16 128"; do
  set -- $spec
  timeout 280 $C --prompts $2 --prompt-len $3 --json $R/fixture_$1.json > $R/log_$1.txt 2>&1
  echo "$1 rc=$?"; grep -i "agreement\|error\|Traceback\|measured planner" $R/log_$1.txt | tail -5
done
