#!/usr/bin/env bash
# The absorbed table-free kernel (kernels/latent_attention_absorbed.py) on the H200, in two device calls:
#   part "calls" (about 7 minutes): DecodeConfig sweep of one call, table-free (post-RoPE key bases), Qwen1.5-MoE
#     (16:16) and Mixtral-8x7B (32:8) layer shapes at batch 8, 32k, int4/32, against the chunk pass ("absorbed": 0),
#     each row checked against the reference; then ckvp-bench attention --key-space post_rope (32:8, batch 8 and
#     32, 32k), which reports bandwidth, its share of the copy bandwidth and the speedup over dense SDPA;
#   part "step" (about 5 minutes): the Qwen1.5-MoE decode step, ckvp-16 G = 1 post-RoPE, batch 8 / 32k and
#     batch 1 / 4k, with Inductor (reduce-overhead) in the same process.
# Usage (device tool, repository root): bash benchmarks/absorbed_gpu.sh "$OUT/a" calls|step [SWEEP_CONFIGS]
set -uo pipefail
OUT=${1:-out}
PART=${2:-calls}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
status=0
if [ "$PART" = calls ]; then
    CONFIGS=${3:-'default;default+{"absorbed": 0};default+{"block_n_a": 32};default+{"absorbed": 128};default+{"absorbed": 128, "block_n_a": 32};default+{"num_warps_a": 8, "block_n_a": 32}'}
    timeout 330 python3 benchmarks/config_sweep_gpu.py --table-free --out "$OUT/sweep" --format int4/32 \
        --cases 16:16:8:32768:16:p,16:16:8:32768:24_96/16_64:p,32:8:8:32768:32:p,32:8:8:32768:96:p \
        --configs "$CONFIGS" > "$OUT/sweep.log" 2>&1 || status=1
    python3 benchmarks/config_sweep_gpu.py --summarize "$OUT/sweep/config_sweep.json" | tee "$OUT/sweep.md"
    tail -3 "$OUT/sweep.log"
    timeout 240 ckvp-bench attention --key-space post_rope --heads 32:8 --batches 8 32 --contexts 32768 \
        --formats int4/32:32 int4/32:64 int8/32:32 --cuda-graphs --budget-s 200 \
        --json "$OUT/attention-32x8-post.json" --out "$OUT/attention-32x8-post.md" > "$OUT/attention.log" 2>&1 \
        || status=1
    tail -12 "$OUT/attention-32x8-post.md"; tail -3 "$OUT/attention.log"
else
    ckvp-bench decode --shape qwen-moe-a2.7b --group-size 1 --key-space post_rope --steps 20 --profile-steps 2 \
        --budget-s 300 --json "$OUT/qwen-g1-post.json" --out "$OUT/qwen-g1-post.md" \
        --cells ckvp-16:reduce-overhead@8@32768 inductor-reduce-overhead@8@32768 ckvp-16:reduce-overhead@1@4096 \
                inductor-reduce-overhead@1@4096 > "$OUT/qwen-g1-post.log" 2>&1 || status=1
    grep -i "warn\|error" "$OUT/qwen-g1-post.log" | head -5; grep "ms/step" "$OUT/qwen-g1-post.log"
fi
exit $status
