#!/usr/bin/env bash
# End-to-end decode benchmark on one H200 (issue 9): the run plan, one step per device command.
#
#   bash benchmarks/decode_e2e_gpu.sh OUT_DIR STEP
#
# STEP (expected wall time on an H200, compile included; each step stops starting rows after its --budget-s):
#   qwen-4k       Qwen1.5-MoE-A2.7B shape, all 24 layers: inductor + ckvp-16, B=1, context 4k          (~2.5 min)
#   qwen-32k      the same at B=8, context 32k, then the largest batch that fits at 32k per system     (~6 min)
#   mixtral       Mixtral-8x7B shape, 8 of 32 layers computed (ballast stands in for the other 24 layers'
#                 weights and KV): inductor + ckvp-16, B=1 at 32k and 4k, then the largest batch that
#                 fits at 32k and at 4k                                                                 (~5 min)
#   qwen-more     Qwen: max-autotune and ckvp-4 / ckvp-8 rows at B=1 / 8, 4k / 32k, and eager         (~8 min)
#   fixture       greedy agreement on the trained fixture, ratios 4 / 8 / 16, Inductor inner compiler  (~2 min)
#
# Each step writes OUT_DIR/<step>.json (rewritten after every row) and OUT_DIR/<step>.md. Then, on any machine:
#   ckvp-bench decode --report benchmarks/results/*-decode*/*.json --markdown BENCHMARKS.md --plots benchmarks/plots
set -euo pipefail
out=${1:?usage: decode_e2e_gpu.sh OUT_DIR STEP}
step=${2:?usage: decode_e2e_gpu.sh OUT_DIR STEP}
mkdir -p "$out"
run() { python3 -m ckvp_compile.bench.cli decode "$@" --json "$out/$step.json" --out "$out/$step.md"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/$step.gpu.txt" || true
case "$step" in
  qwen-4k)
    run --shape qwen-moe-a2.7b --systems inductor ckvp-16 --batch 1 --context 4096 --steps 30 --budget-s 200 ;;
  qwen-32k)
    run --shape qwen-moe-a2.7b --systems inductor ckvp-16 --batch 8 max --context 32768 --steps 20 \
        --max-batch-tries 2 --budget-s 400 ;;
  mixtral)
    run --shape mixtral-8x7b --layers 8 --systems inductor ckvp-16 --batch 1 max --context 32768 4096 --steps 20 \
        --max-batch-tries 2 --budget-s 300 ;;
  qwen-more)
    run --shape qwen-moe-a2.7b --systems inductor-max-autotune ckvp-8 ckvp-4 eager --batch 1 8 --context 4096 32768 \
        --steps 20 --budget-s 480 ;;
  fixture)
    run --shape fixture --ratios 4 8 16 --compiler inductor --device cuda ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
