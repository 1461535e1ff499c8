#!/usr/bin/env bash
# Post-RoPE key bases, Qwen1.5-MoE shape G = 1, batch 8, 32k: the decode step with the one-pass head-chunk kernel
# (latent_attention_chunks) forced at wider ranks through CKVP_DECODE_CONFIG, against the default config's
# two passes (benchmarks/results/2026-12-03-post-rope-h200/qwen-g1-post.json: 16.22 ms).
# Usage (device tool, repository root): bash benchmarks/post_rope_chunks_gpu.sh "$OUT/c" [CONFIG_JSON ...]
set -uo pipefail
OUT=${1:-out}
shift || true
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=('{"head_chunks": 128}' '{"head_chunks": 256}' '{"head_chunks": 128, "block_n_c": 64}')
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
status=0
for cfg in "${CONFIGS[@]}"; do
    tag=$(echo "$cfg" | tr -dc 'a-z0-9_')
    CKVP_DECODE_CONFIG="$cfg" ckvp-bench decode --shape qwen-moe-a2.7b --group-size 1 --key-space post_rope \
        --steps 20 --profile-steps 1 --budget-s 150 --json "$OUT/qwen-g1-post-$tag.json" \
        --cells ckvp-16:reduce-overhead@8@32768 > "$OUT/qwen-g1-post-$tag.log" 2>&1 || status=1
    echo "$cfg"; grep -i "warn\|error" "$OUT/qwen-g1-post-$tag.log" | grep -v "TensorFloat32\|Profiler" | head -5
    grep "ms/step" "$OUT/qwen-g1-post-$tag.log"
done
exit $status
