#!/usr/bin/env bash
# CKVP on the GPU, in one device call: (1) teacher-forced fidelity of the fixture on CUDA (the same configs as
# the CPU run, so the CUDA path, Triton latent-attention kernel included, can be compared number for number);
# (2) device memory and greedy agreement of a compiled generate() at ratio 4 with int8 / int4 latents, batch 8
# and batch 1.  Usage (device tool, repository root): bash benchmarks/gpu_ckvp_check.sh "$OUT"
set -euo pipefail
OUT=${1:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, transformers.__version__)" | tee "$OUT/versions.txt"
python3 -m ckvp_compile.bench.fidelity --device cuda --group-sizes 1 4 --kv-ratios 4 --allocations uniform \
  --latent-formats int8 int4 --extra --no-progress --json "$OUT/fidelity_cuda.json" 2>&1 | grep -v Warning | tail -12
for fmt in int8 int4; do
  python3 benchmarks/ckvp_memory_gpu.py --out "$OUT" --dtype bfloat16 --ratios 4 --latent-format $fmt --batch 8 2>&1 | grep -v Warning | tail -4
done
python3 benchmarks/ckvp_memory_gpu.py --out "$OUT" --dtype bfloat16 --ratios 4 --latent-format int8 --batch 1 2>&1 | grep -v Warning | tail -4
python3 benchmarks/ckvp_memory_gpu.py --out "$OUT" --dtype float32 --ratios 1 4 --latent-format int8 --batch 1 2>&1 | grep -v Warning | tail -5
