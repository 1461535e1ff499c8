#!/usr/bin/env bash
# The decode rows issue 9 asks for that earlier runs did not measure: eager and Inductor's default and
# max-autotune modes, batch 32, context 128k, ckvp at ratios 4 and 8 at batch 1, 4k, and the largest batch at 4k
# (2026-12-02). Rows are in priority order.
#
#   benchmarks/decode_matrix_gpu.sh qwen-dense|qwen-g1|mixtral|qwen-pool|mixtral-pool OUT_DIR [BUDGET_S]
#
# Each part is one process (one model build, one calibration); rows past BUDGET_S seconds (default 420) are not
# started and are recorded as skipped-budget. Run from the repository root on a CUDA machine.
set -euo pipefail
part=$1
out=$2
budget=${3:-420}
mkdir -p "$out"
bench() { python3 -m ckvp_compile.bench.cli decode --steps 20 --budget-s "$budget" "$@"; }
case $part in
qwen-dense)  # baselines, G = 4 (the default) for the ckvp rows
    bench --shape qwen-moe-a2.7b --json "$out/qwen_dense.json" --cells \
        eager@1@4096 eager@8@32768 inductor@8@32768 inductor-reduce-overhead@32@4096 \
        inductor-reduce-overhead@1@131072 inductor-max-autotune@1@4096 inductor-max-autotune@8@32768 \
        inductor-reduce-overhead@max@4096 ;;
qwen-g1)  # ckvp with one latent per layer (the faster setting at the same bytes)
    bench --shape qwen-moe-a2.7b --group-size 1 --json "$out/qwen_g1.json" --cells \
        ckvp-16:reduce-overhead@32@4096 ckvp-16:reduce-overhead@32@32768 ckvp-16:reduce-overhead@1@131072 \
        ckvp-4:reduce-overhead@1@4096 ckvp-8:reduce-overhead@1@4096 ckvp-16:reduce-overhead@max@4096 ;;
mixtral)  # 8 of 32 layers computed, the others' weights and KV held as ballast
    bench --shape mixtral-8x7b --layers 8 --json "$out/mixtral.json" --cells \
        eager@1@4096 eager@8@32768 inductor-reduce-overhead@32@4096 ckvp-16:reduce-overhead@32@4096 \
        inductor-reduce-overhead@1@131072 ckvp-16:reduce-overhead@1@131072 ckvp-4:reduce-overhead@1@4096 \
        ckvp-8:reduce-overhead@1@4096 inductor-max-autotune@1@4096 inductor-max-autotune@8@32768 ;;
qwen-pool)  # 2026-12-02, the store in a private memory pool (runtime.store._private_pool): the memory check's
    # smallest caches again, a same-run pair for check 1, and the largest batch at 4k of both systems
    bench --shape qwen-moe-a2.7b --group-size 1 --json "$out/qwen_pool.json" --cells \
        ckvp-8:reduce-overhead@1@4096 ckvp-4:reduce-overhead@1@4096 ckvp-16:reduce-overhead@8@32768 \
        inductor-reduce-overhead@8@32768 ckvp-16:reduce-overhead@max@4096 inductor-reduce-overhead@max@4096 ;;
mixtral-pool)  # as qwen-pool (default G = 4), then the max-autotune row at batch 8, 32k
    bench --shape mixtral-8x7b --layers 8 --json "$out/mixtral_pool.json" --cells \
        ckvp-8:reduce-overhead@1@4096 ckvp-4:reduce-overhead@1@4096 ckvp-16:reduce-overhead@8@32768 \
        ckvp-16:reduce-overhead@max@4096 inductor-reduce-overhead@max@4096 inductor-max-autotune@8@32768 ;;
*)
    echo "unknown part $part: qwen-dense, qwen-g1, mixtral, qwen-pool or mixtral-pool" >&2
    exit 2 ;;
esac
