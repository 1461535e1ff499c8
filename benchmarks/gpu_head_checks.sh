#!/usr/bin/env bash
# Checks of a tree on the GPU machine, in one device call (about 6 minutes on the H200): both rewrites still apply
# to the bf16 graphs of the GPU's torch / transformers after analysis changes, and the main job runs on CUDA.
#   1. examples/generate.py (the README's main job) on the fixture, CUDA bf16: latent KV cache at 4x and the
#      expert GEMM rewrite, with the layers each rewrite took;
#   2. ckvp-bench decode rows (ckvp at ratio 16, reduce-overhead, with a profile): Qwen1.5-MoE shape G = 1 and
#      Mixtral-8x7B (8 of 32 layers), batch 1, context 4k: the latent kernels and moe_experts templates must be in
#      the profile and no ckvp warning printed;
#   3. benchmarks/moe_shared_expert_gpu_check.py: the shared-expert rewrite of a compiled Qwen2-MoE against eager.
# Usage (device tool, repository root): bash benchmarks/gpu_head_checks.sh "$OUT/d"
set -uo pipefail
OUT=${1:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
status=0
python3 examples/generate.py --device cuda --dtype bfloat16 > "$OUT/generate_cuda_bf16.txt" 2>&1 || status=1
grep -v "Loading weights" "$OUT/generate_cuda_bf16.txt" | tail -25
ckvp-bench decode --shape qwen-moe-a2.7b --group-size 1 --batch 1 --context 4096 --steps 20 --profile-steps 1 \
    --budget-s 120 --systems ckvp-16:reduce-overhead --json "$OUT/qwen-b1-4k-g1.json" > "$OUT/qwen.log" 2>&1 || status=1
ckvp-bench decode --shape mixtral-8x7b --layers 8 --batch 1 --context 4096 --steps 20 --profile-steps 1 \
    --budget-s 120 --systems ckvp-16:reduce-overhead --json "$OUT/mixtral-b1-4k.json" > "$OUT/mixtral.log" 2>&1 || status=1
for f in qwen mixtral; do echo "== $f"; grep -i "warn\|error" "$OUT/$f.log" | head -5; tail -3 "$OUT/$f.log"; done
python3 benchmarks/moe_shared_expert_gpu_check.py --out "$OUT" > "$OUT/shared_expert.log" 2>&1 || status=1
tail -8 "$OUT/shared_expert.log"
exit $status
