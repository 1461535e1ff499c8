#!/usr/bin/env bash
# The word pass (kernels/latent_attention_words.py) on the H200: DecodeConfig sweep of one table-free call (post-RoPE
# key bases) at batch 8, 32k, int4/32, Mixtral-8x7B's 32:8 heads at ranks 16-96 and one 16:16 case, word-pass tiles
# and warps against the default (absorbed / one-pass / lane pass), each row checked against the reference; then
# ckvp-bench attention 32:8 with the default and with the word pass (bandwidth, share of the copy bandwidth, speedup
# over dense SDPA). About 8 minutes.
# Usage (device tool, repository root): bash benchmarks/words_gpu.sh "$OUT/w" [SWEEP_CONFIGS]
set -uo pipefail
OUT=${1:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
status=0
W='"words": true'
CONFIGS=${2:-"default;default+{$W, \"block_n_w\": 16};default+{$W, \"block_n_w\": 32};default+{$W, \"block_n_w\": 64};default+{$W, \"block_n_w\": 16, \"num_warps_w\": 2};default+{$W, \"block_n_w\": 32, \"num_warps_w\": 8};default+{$W, \"block_n_w\": 16, \"loop_stages_w\": null}"}
CASES=${CASES:-32:8:8:32768:32:p,32:8:8:32768:16:p,32:8:8:32768:64/32:p,32:8:8:32768:96:p,16:16:8:32768:96/64:p}
timeout 330 python3 benchmarks/config_sweep_gpu.py --table-free --out "$OUT/sweep" --format int4/32 \
    --cases "$CASES" --configs "$CONFIGS" > "$OUT/sweep.log" 2>&1 || status=1
python3 benchmarks/config_sweep_gpu.py --summarize "$OUT/sweep/config_sweep.json" | tee "$OUT/sweep.md"
tail -3 "$OUT/sweep.log"
for tag in default words; do
    if [ $tag = words ]; then export CKVP_DECODE_CONFIG="{$W, \"block_n_w\": ${WORDS_BN:-16}}"; fi
    timeout 100 ckvp-bench attention --key-space post_rope --heads 32:8 --batches 8 --contexts 32768 \
        --formats int4/32:32 --cuda-graphs --budget-s 80 --json "$OUT/attention-$tag.json" \
        --out "$OUT/attention-$tag.md" > "$OUT/attention-$tag.log" 2>&1 || status=1
    tail -6 "$OUT/attention-$tag.md"
done
exit $status
