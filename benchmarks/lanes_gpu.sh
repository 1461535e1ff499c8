#!/usr/bin/env bash
# The lane table-free kernel (kernels/latent_attention_lanes.py) on the H200, in two device calls:
#   part "calls" (about 6 minutes): DecodeConfig sweep of one call, table-free (post-RoPE key bases), Qwen1.5-MoE
#     (16:16) and Mixtral-8x7B (32:8) layer shapes at batch 8, 32k, int4/32 (cases: $CASES if set), lane configs
#     against the default, each row checked against the reference; then ckvp-bench attention --key-space post_rope
#     at 16:16 with the defaults (bandwidth, share of the copy bandwidth, speedup over dense SDPA);
#   part "step" (about 5 minutes): the Qwen1.5-MoE decode step, ckvp-16 G = 1 post-RoPE, batch 8 / 32k and
#     batch 1 / 4k, with Inductor (reduce-overhead) in the same process.
# Usage (device tool, repository root): bash benchmarks/lanes_gpu.sh "$OUT/l" calls|step [SWEEP_CONFIGS]
set -uo pipefail
OUT=${1:-out}
PART=${2:-calls}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
status=0
if [ "$PART" = calls ]; then
    L='"lanes": 16, "loop_stages_l": null'
    CONFIGS=${3:-"default;default+{$L, \"block_n_l\": 16};default+{$L, \"block_n_l\": 32};default+{$L, \"block_n_l\": 16, \"num_warps_l\": 2};default+{\"lanes\": 16, \"block_n_l\": 16, \"loop_stages_l\": 2};default+{\"lanes\": 8, \"block_n_l\": 16, \"loop_stages_l\": null};default+{$L, \"block_n_l\": 16, \"target_programs\": 528}"}
    CASES=${CASES:-16:16:8:32768:24_32/8:p,16:16:8:32768:16:p,16:16:8:32768:32:p,32:8:8:32768:32:p}
    timeout 360 python3 benchmarks/config_sweep_gpu.py --table-free --out "$OUT/sweep" --format int4/32 \
        --cases "$CASES" --configs "$CONFIGS" > "$OUT/sweep.log" 2>&1 || status=1
    python3 benchmarks/config_sweep_gpu.py --summarize "$OUT/sweep/config_sweep.json" | tee "$OUT/sweep.md"
    tail -3 "$OUT/sweep.log"
    timeout 150 ckvp-bench attention --key-space post_rope --heads 16:16 --batches 8 --contexts 32768 \
        --formats int4/32:32 int4/32:16 --cuda-graphs --budget-s 120 --json "$OUT/attention.json" \
        --out "$OUT/attention.md" > "$OUT/attention.log" 2>&1 || status=1
    tail -15 "$OUT/attention.md"
else
    ckvp-bench decode --shape qwen-moe-a2.7b --group-size 1 --key-space post_rope --steps 20 --profile-steps 2 \
        --budget-s 300 --json "$OUT/qwen-g1-post.json" --out "$OUT/qwen-g1-post.md" \
        --cells ckvp-16:reduce-overhead@8@32768 inductor-reduce-overhead@8@32768 ckvp-16:reduce-overhead@1@4096 \
                inductor-reduce-overhead@1@4096 > "$OUT/qwen-g1-post.log" 2>&1 || status=1
    grep -i "warn\|error" "$OUT/qwen-g1-post.log" | head -5; grep "ms/step" "$OUT/qwen-g1-post.log"
fi
exit $status
