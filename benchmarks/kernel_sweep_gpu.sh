#!/usr/bin/env bash
# Which DecodeConfig knobs move the layers that dominate the decode step (issue 9 acceptance 1 and 2), on one H200.
#
#   bash benchmarks/kernel_sweep_gpu.sh OUT_DIR STEP
#
# STEP (expected wall time on an H200, compile included):
#   layers   one call per (layer shape, config), each checked against the reference (config_sweep_gpu.py):
#            Qwen1.5-MoE's narrow layers (16:16 heads, key/value rank 8 and 16: value-pass tiles and software
#            pipelining, key-pass head groups of 8 / 16), its wide layers (rank 96, and 64/128 at the same bytes),
#            Mixtral's layers (32:8, rank 96 and 64/128; the one-pass kernel's rank-chunk loop, 32-slot tiles,
#            pipelining) at batch 8 and 64, context 32k                                                 (~6 min)
#   qwen     Qwen1.5-MoE decode, all 24 layers, --group-size 1, batch 8, 32k: Inductor and ckvp-16 with the
#            default config, then ckvp-16 under CKVP_DECODE_CONFIG overrides (each row records its override) and
#            with key ranks capped at 64 (--max-key-rank: the bytes go to the values; rows "K<=64")
#                                                                                                      (~7 min)
#   mixtral  Mixtral-8x7B decode, 8 of 32 layers: ckvp-16 at batch 8, 32k, default, an override, and key ranks
#            capped at 64                                                                              (~6 min)
#
# Paired tables throughout (a compiled HF model declares them). Each step writes OUT_DIR/<step>*.json; the layer
# sweep's rows are in OUT_DIR/layers-*/config_sweep.json.
set -uo pipefail
out=${1:?usage: kernel_sweep_gpu.sh OUT_DIR STEP}
step=${2:?usage: kernel_sweep_gpu.sh OUT_DIR STEP}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/$step.gpu.txt" || true
# each sweep has its own time limit ($4 s; together within the device's 600 s per command); its JSON keeps the rows
# done when the limit cuts it
sweep() {
  timeout "$4" python3 benchmarks/config_sweep_gpu.py --paired --out "$out/layers-$1" --cases "$2" --configs "$3"
}
decode() { python3 -m ckvp_compile.bench.cli decode "$@"; }
case "$step" in
  layers)
    sweep qwen-narrow 16:16:8:32768:8,16:16:8:32768:16 'default;default+{"block_n_v": 64};default+{"block_n_v": 128, "num_warps_v": 8};default+{"loop_stages_v": 3};default+{"block_n_v": 128, "num_warps_v": 8, "loop_stages_v": 3};default+{"head_group": 8};default+{"head_group": 16};default+{"loop_stages": 3}' 230
    sweep qwen-wide 16:16:8:32768:96,16:16:8:32768:64/128 'default;default+{"loop_stages_v": 2};default+{"loop_stages": 3};default+{"block_n_v": 64}' 130
    sweep mixtral 32:8:8:32768:96,32:8:8:32768:64/128,32:8:64:32768:96 'default;default+{"r_loop": true, "block_r": 32};default+{"block_n": 32, "r_loop": true, "block_r": 32};default+{"loop_stages": 3};default+{"r_loop": true, "block_r": 32, "loop_stages": 3};default+{"num_stages": 1};default+{"num_warps": 8, "r_loop": true, "block_r": 32}' 210 ;;
  qwen)
    q=(--shape qwen-moe-a2.7b --group-size 1 --batch 8 --context 32768 --steps 20 --profile-steps 2 --budget-s 150)
    decode "${q[@]}" --systems inductor-reduce-overhead ckvp-16:reduce-overhead --json "$out/qwen-default.json"
    CKVP_DECODE_CONFIG='{"block_n_v": 128, "num_warps_v": 8}' decode "${q[@]}" --systems ckvp-16:reduce-overhead \
        --json "$out/qwen-bnv128.json"
    CKVP_DECODE_CONFIG='{"loop_stages_v": 3}' decode "${q[@]}" --systems ckvp-16:reduce-overhead \
        --json "$out/qwen-lsv3.json"
    decode "${q[@]}" --systems ckvp-16:reduce-overhead --max-key-rank 64 --json "$out/qwen-kcap64.json" ;;
  mixtral)
    m=(--shape mixtral-8x7b --layers 8 --batch 8 --context 32768 --steps 10 --budget-s 150)
    decode "${m[@]}" --systems inductor-reduce-overhead ckvp-16:reduce-overhead --json "$out/mixtral-default.json"
    CKVP_DECODE_CONFIG='{"r_loop": true, "block_r": 32}' decode "${m[@]}" --systems ckvp-16:reduce-overhead \
        --json "$out/mixtral-rloop32.json"
    decode "${m[@]}" --systems ckvp-16:reduce-overhead --max-key-rank 64 --json "$out/mixtral-kcap64.json" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
