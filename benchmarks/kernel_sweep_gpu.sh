#!/usr/bin/env bash
# The next H200 measurements for issue 9 (decode speed), each step within the device's 600 s per command.
#
#   bash benchmarks/kernel_sweep_gpu.sh OUT_DIR STEP
#
# STEP (expected wall time on an H200, compile included):
#   layout   the GPU checks of unit-major latents (kernels.latent_layout): latent_append_gpu.py (the fused append,
#            flag APPEND_STRIDED_GPU_CHECKED) and one call per (layer shape, layout), default config, CUDA-graph
#            replays in 2 interleaved rounds (config_sweep_gpu.py; case suffix ':u'), each checked against the
#            reference (flag STRIDED_LATENTS_GPU_CHECKED), at Qwen1.5-MoE's narrow (rank 8, 16, 32) and wide (96)
#            16:16 layers and Mixtral's 32:8 rank-96 layer, batch 8, 32k. Set the two flags in the tree if they
#            pass; the qwen / mixtral steps' unit-major rows run only then                              (~3 min)
#   qwen     Qwen1.5-MoE decode, all 24 layers, --group-size 1, batch 8, 32k: Inductor and ckvp-16 row-major, then
#            ckvp-16 with --latent-layout unit-major (rows "ckvp-16:reduce-overhead unit-major")       (~5 min)
#   mixtral  Mixtral-8x7B decode, 8 of 32 layers, batch 8, 32k: Inductor, ckvp-16 both layouts      (~3 min)
#   maxbatch the largest batch at 32k, ckvp-16 with the current defaults, both shapes ($LAYOUT: row-major
#            unless set)                                                                               (~5 min)
#   largebatch  knobs at batch 64 (fp16 rebuilds, warps), Mixtral's largest batch with the pick          (~3 min)
#   programs the key pass's grid size (target_programs) at Qwen's layer shapes, Qwen batch 8, 32k     (~8 min)
#   vlayout  the value latents alone unit-major: per call at Qwen's ranks, then Qwen batch 8, 32k     (~8 min)
#   rowpad   rows padded to 16 bytes: per call at three Qwen layers' unequal ranks, packed and padded, then Qwen
#            batch 8, 32k (Inductor, ckvp-16)                                                            (~5 min)
#   ncu      Nsight Compute of the default call at 16:16 ranks $RANKS (16 128), batch 8, 32k          (~1 min)
#   layers-2026-12-01  the 2026-12-01 per-call knob sweep that chose today's defaults (launch-timed then; now graph replays)
#
# Paired tables throughout (a compiled HF model declares them). Each step writes OUT_DIR/<step>*.json; a sweep's
# rows are in OUT_DIR/<step>-*/config_sweep.json (read them anywhere with config_sweep_gpu.py --summarize).
set -uo pipefail
out=${1:?usage: kernel_sweep_gpu.sh OUT_DIR STEP}
step=${2:?usage: kernel_sweep_gpu.sh OUT_DIR STEP}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/$step.gpu.txt" || true
# each sweep has its own time limit ($4 s; together within the device's 600 s per command); its JSON keeps the rows
# done when the limit cuts it
sweep() {
  timeout "$4" python3 benchmarks/config_sweep_gpu.py --paired --rounds 2 --out "$out/$step-$1" --cases "$2" --configs "$3"
}
decode() { python3 -m ckvp_compile.bench.cli decode "$@"; }
# unit-major decode rows only once the layout step's checks passed and their flags are set in the tree (until then
# CUDA would send those latents to the reference path)
checked() {
  python3 -c "import ckvp_compile.kernels.latent_attention_triton as a, ckvp_compile.kernels.latent_quant_triton as q
raise SystemExit(0 if a.STRIDED_LATENTS_GPU_CHECKED and q.APPEND_STRIDED_GPU_CHECKED else 1)" \
    || { echo "unit-major rows skipped: set STRIDED_LATENTS_GPU_CHECKED / APPEND_STRIDED_GPU_CHECKED after the layout step"; false; }
}
case "$step" in
  layout)
    # the GPU checks of unit-major latents: the fused append (its unit-major cases) and every sweep row's rel_err
    timeout 150 python3 benchmarks/latent_append_gpu.py --out "$out/layout-append" | tail -n 7
    sweep layout 16:16:8:32768:8,16:16:8:32768:8:u,16:16:8:32768:16,16:16:8:32768:16:u,16:16:8:32768:32,16:16:8:32768:32:u,16:16:8:32768:96,16:16:8:32768:96:u,32:8:8:32768:96,32:8:8:32768:96:u default 280
    # the verdict: LAYOUT_PASS written when the append's unit-major cases passed and every unit-major row ran with
    # the row-major row's error (same arithmetic, other strides) within 1e-3
    python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
ok = json.load(open(f"{out}/layout-append/latent_append.json"))["flags_passed"].get("APPEND_STRIDED_GPU_CHECKED", False)
rows = json.load(open(f"{out}/layout-layout/config_sweep.json"))["rows"]
key = lambda r: (r["heads"], r["rank"], r["rank_v"], r["round"])
rm = {key(r): r for r in rows if r["layout"] == "row-major"}
um = [r for r in rows if r["layout"] == "unit-major"]
for r in um:
    base = rm.get(key(r), {})
    good = "error" not in r and r.get("rel_err") is not None and r["rel_err"] <= 1e-3 \
        and r["rel_err"] <= 1.05 * base.get("rel_err", 1.0) + 1e-6
    print("unit-major", key(r), r.get("rel_err"), "row-major", base.get("rel_err"), "ok" if good else "FAILED")
    ok = ok and good
ok = ok and len(um) == 10
print("LAYOUT_PASS" if ok else "layout checks failed")
if ok:
    open(f"{out}/LAYOUT_PASS", "w").write("1\n")
PY
    ;;
  qwen)
    q=(--shape qwen-moe-a2.7b --group-size 1 --batch 8 --context 32768 --steps 20 --profile-steps 2 --budget-s 150)
    decode "${q[@]}" --systems inductor-reduce-overhead ckvp-16:reduce-overhead --json "$out/qwen-b8-32k.json"
    checked && decode "${q[@]}" --systems ckvp-16:reduce-overhead --latent-layout unit-major \
        --json "$out/qwen-b8-32k-um.json" ;;
  mixtral)
    m=(--shape mixtral-8x7b --layers 8 --batch 8 --context 32768 --steps 10 --budget-s 150)
    decode "${m[@]}" --systems inductor-reduce-overhead ckvp-16:reduce-overhead --json "$out/mixtral-b8-32k.json"
    checked && decode "${m[@]}" --systems ckvp-16:reduce-overhead --latent-layout unit-major \
        --json "$out/mixtral-b8-32k-um.json" ;;
  maxbatch)
    l=(--latent-layout "${LAYOUT:-row-major}" --systems ckvp-16:reduce-overhead --batch max --context 32768
       --max-batch-tries 2 --steps 10)
    timeout 330 python3 -m ckvp_compile.bench.cli decode --shape qwen-moe-a2.7b --group-size 1 "${l[@]}" \
        --json "$out/qwen-max.json"
    timeout 240 python3 -m ckvp_compile.bench.cli decode --shape mixtral-8x7b --layers 8 "${l[@]}" \
        --json "$out/mixtral-max.json" ;;
  largebatch)
    # the knobs at batch 64 (the largest batches' regime: many more programs than SMs), then Mixtral's largest batch at
    # 32k with the fastest config within 1e-3 when it beats the default by 3% (CKVP_DECODE_CONFIG: the picked fields)
    sweep lb 32:8:64:32768:96,16:16:64:32768:16,16:16:64:32768:32,16:16:64:32768:128 'default;default+{"key_fp16": true};default+{"rotate_fp16": true};default+{"num_warps": 8};default+{"key_split": false}' 400
    python3 - "$out" <<'PY' > "$out/lb-pick.txt"
import json, statistics, sys
rows = json.load(open(f"{sys.argv[1]}/largebatch-lb/config_sweep.json"))["rows"]
for heads in ("32:8", "16:16"):
    ms = {}
    for r in rows:
        if r["heads"] == heads and "error" not in r and r.get("ms") and (r.get("rel_err") or 1) <= 1e-3:
            ms.setdefault((r["rank"], r["config"]), []).append(r["ms"])
    tot = {}
    for (rank, cfg), v in ms.items():
        tot.setdefault(cfg, {})[rank] = statistics.median(v)
    ranks = set(tot.get("default", {}))
    full = {c: sum(t.values()) for c, t in tot.items() if set(t) == ranks}
    best = min(full, key=full.get)
    gain = full[best] / full["default"]
    fields = json.dumps(json.loads(best.partition("+")[2] or "{}"), separators=(",", ":"))
    print(heads, fields if gain < 0.97 and fields != "{}" else "default", round(gain, 3), best)
PY
    cat "$out/lb-pick.txt"
    pick=$(awk '$1=="32:8"{print $2}' "$out/lb-pick.txt")
    if [ -n "$pick" ] && [ "$pick" != default ]; then
      CKVP_DECODE_CONFIG="$pick" timeout 200 python3 -m ckvp_compile.bench.cli decode --shape mixtral-8x7b \
        --layers 8 --systems ckvp-16:reduce-overhead --batch max --context 32768 --max-batch-tries 2 --steps 10 \
        --json "$out/mixtral-max-picked.json"
    fi ;;
  programs)
    # the key pass's grid: target_programs (264 = 2 programs per SM, sized for the per-head pass's 137 registers)
    # against more, for Qwen1.5-MoE's layer shapes at batch 8 (and the narrow one at 64); then the Qwen decode step,
    # batch 8, 32k: Inductor, ckvp-16 default and ckvp-16 with the pick (CKVP_DECODE_CONFIG)
    sweep tp 16:16:8:32768:8,16:16:8:32768:16,16:16:8:32768:32,16:16:8:32768:128,16:16:64:32768:16 'default;default+{"target_programs": 528};default+{"target_programs": 792};default+{"target_programs": 1056}' 180
    python3 - "$out" <<'PY' > "$out/tp-pick.txt"
import json, statistics, sys
rows = json.load(open(f"{sys.argv[1]}/programs-tp/config_sweep.json"))["rows"]
weight = {8: 8, 16: 9, 32: 3, 128: 4}  # Qwen1.5-MoE's layers at ckvp-16, G = 1, by padded key rank
ms = {}
for r in rows:
    if r["batch"] == 8 and "error" not in r and r.get("ms") and (r.get("rel_err") or 1) <= 1e-3:
        ms.setdefault(r["config"], {}).setdefault(r["rank"], []).append(r["ms"])
tot = {c: sum(weight[k] * statistics.median(v) for k, v in d.items()) for c, d in ms.items() if len(d) == 4}
best = min(tot, key=tot.get)
gain = tot[best] / tot["default"]
fields = json.dumps(json.loads(best.partition("+")[2] or "{}"), separators=(",", ":"))
print(fields if gain < 0.97 and fields != "{}" else "default", round(gain, 3), best)
PY
    cat "$out/tp-pick.txt"
    pick=$(awk '{print $1}' "$out/tp-pick.txt")
    q=(--shape qwen-moe-a2.7b --group-size 1 --batch 8 --context 32768 --steps 20 --budget-s 150)
    timeout 200 python3 -m ckvp_compile.bench.cli decode "${q[@]}" --systems inductor-reduce-overhead \
        ckvp-16:reduce-overhead --json "$out/qwen-b8-32k.json"
    if [ -n "$pick" ] && [ "$pick" != default ]; then
      CKVP_DECODE_CONFIG="$pick" timeout 110 python3 -m ckvp_compile.bench.cli decode "${q[@]}" \
        --systems ckvp-16:reduce-overhead --json "$out/qwen-b8-32k-picked.json"
    fi ;;
  vlayout)
    # the value latents alone unit-major (the rank-16 value pass is L1-bound on row-major rows: 2026-12-01-grid-ncu-h200)
    # per call at Qwen's ranks, then the Qwen decode step, batch 8, 32k: Inductor, ckvp-16 row-major and
    # row-major/unit-major
    sweep vl 16:16:8:32768:8,16:16:8:32768:8:v,16:16:8:32768:16,16:16:8:32768:16:v,16:16:8:32768:32,16:16:8:32768:32:v,16:16:8:32768:128,16:16:8:32768:128:v default 150
    q=(--shape qwen-moe-a2.7b --group-size 1 --batch 8 --context 32768 --steps 20 --budget-s 150)
    timeout 200 python3 -m ckvp_compile.bench.cli decode "${q[@]}" --systems inductor-reduce-overhead \
        ckvp-16:reduce-overhead --json "$out/qwen-b8-32k.json"
    timeout 110 python3 -m ckvp_compile.bench.cli decode "${q[@]}" --systems ckvp-16:reduce-overhead \
        --latent-layout row-major/unit-major --json "$out/qwen-b8-32k-vum.json" ;;
  rowpad)
    # rows padded to 16 bytes (kernels.latent_layout.ROW_ALIGN): the ranks of Qwen1.5-MoE's layers 3, 4 and 9 at
    # batch 8, 32k (rows of 500/420, 312/308 and 152/168 bytes), packed and padded; then the decode step, whose
    # store now pads its rows (benchmarks/results/2026-12-01-step-calls-h200)
    sweep rowpad 16:16:8:32768:64_32_32_64_64_64_32_32_64_32_64_64_32_32_64_64/32_32_64_64_32_64_32_64_32_32_32_32_32_32_32_64,16:16:8:32768:64_32_32_64_64_64_32_32_64_32_64_64_32_32_64_64/32_32_64_64_32_64_32_64_32_32_32_32_32_32_32_64:p,16:16:8:32768:32_32_32_32_32_32_24_32_32_32_24_32_32_32_32_32/32_32_32_32_32_24_32_32_32_24_32_32_24_32_32_32,16:16:8:32768:32_32_32_32_32_32_24_32_32_32_24_32_32_32_32_32/32_32_32_32_32_24_32_32_32_24_32_32_24_32_32_32:p,16:16:8:32768:8_8_8_16_8_8_8_16_16_8_16_8_16_8_16_8/16_8_8_8_16_16_16_8_8_16_16_16_16_8_16_16,16:16:8:32768:8_8_8_16_8_8_8_16_16_8_16_8_16_8_16_8/16_8_8_8_16_16_16_8_8_16_16_16_16_8_16_16:p default 200
    q=(--shape qwen-moe-a2.7b --group-size 1 --batch 8 --context 32768 --steps 20 --budget-s 150)
    timeout 220 python3 -m ckvp_compile.bench.cli decode "${q[@]}" --systems inductor-reduce-overhead \
        ckvp-16:reduce-overhead --json "$out/qwen-b8-32k.json" ;;
  ncu)
    # Nsight Compute of one default call per rank (16: grouped key pass; 128: per-head rotated key pass) and its value
    # pass, batch 8, 32k: occupancy, registers, spills, throughputs (benchmarks/results/2026-12-01-grid-ncu-h200)
    for r in ${RANKS:-16 128}; do
      timeout 150 ncu --target-processes all -k regex:"_latent_scores_heads_kernel|_latent_attention_split_kernel" \
        --launch-count 3 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 benchmarks/config_sweep_gpu.py --paired --out "$out/ncu-n$r" --cases "16:16:8:32768:$r" \
        --configs default --ncu > "$out/ncu_r$r.txt" 2>&1
    done ;;
  layers-2026-12-01)
    sweep qwen-narrow 16:16:8:32768:8,16:16:8:32768:16 'default;default+{"block_n_v": 64};default+{"block_n_v": 128, "num_warps_v": 8};default+{"loop_stages_v": 3};default+{"block_n_v": 128, "num_warps_v": 8, "loop_stages_v": 3};default+{"head_group": 8};default+{"head_group": 16};default+{"loop_stages": 3}' 230
    sweep qwen-wide 16:16:8:32768:96,16:16:8:32768:64/128 'default;default+{"loop_stages_v": 2};default+{"loop_stages": 3};default+{"block_n_v": 64}' 130
    sweep mixtral 32:8:8:32768:96,32:8:8:32768:64/128,32:8:64:32768:96 'default;default+{"r_loop": true, "block_r": 32};default+{"block_n": 32, "r_loop": true, "block_r": 32};default+{"loop_stages": 3};default+{"r_loop": true, "block_r": 32, "loop_stages": 3};default+{"num_stages": 1};default+{"num_warps": 8, "r_loop": true, "block_r": 32}' 210 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
