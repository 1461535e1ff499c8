#!/usr/bin/env bash
# Decode speed with post-RoPE key bases (LatentBases.key_space = 'post_rope') against the default pre-RoPE bases and
# Inductor, in one device call (about 8 minutes on the H200): issue 9's rows for the Qwen1.5-MoE shape.
#   1. G = 1: ckvp-16 post-RoPE at batch 8 / 32k and batch 1 / 4k, with Inductor (reduce-overhead) in the same
#      process, and a profile of the batch-8 step;
#   2. G = 4 (the default group size): ckvp-16 post-RoPE at batch 8 / 32k.
# Usage (device tool, repository root): bash benchmarks/post_rope_gpu.sh "$OUT/p"
set -uo pipefail
OUT=${1:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
status=0
ckvp-bench decode --shape qwen-moe-a2.7b --group-size 1 --key-space post_rope --steps 20 --profile-steps 2 \
    --budget-s 300 --json "$OUT/qwen-g1-post.json" --out "$OUT/qwen-g1-post.md" \
    --cells ckvp-16:reduce-overhead@8@32768 inductor-reduce-overhead@8@32768 ckvp-16:reduce-overhead@1@4096 \
            inductor-reduce-overhead@1@4096 > "$OUT/qwen-g1-post.log" 2>&1 || status=1
grep -i "warn\|error" "$OUT/qwen-g1-post.log" | head -5; grep "ms/step" "$OUT/qwen-g1-post.log"
ckvp-bench decode --shape qwen-moe-a2.7b --key-space post_rope --steps 20 --profile-steps 1 --budget-s 150 \
    --json "$OUT/qwen-g4-post.json" --out "$OUT/qwen-g4-post.md" --cells ckvp-16:reduce-overhead@8@32768 \
    > "$OUT/qwen-g4-post.log" 2>&1 || status=1
grep -i "warn\|error" "$OUT/qwen-g4-post.log" | head -5; grep "ms/step" "$OUT/qwen-g4-post.log"
exit $status
