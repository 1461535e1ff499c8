#!/usr/bin/env bash
# Foundation check on the GPU machine (torch 2.11 + CUDA, no network): the test suite on torch 2.11, the main
# job on CUDA in bf16 and fp32, and ckvp-inspect on the fixture model. Writes logs and a JSON summary to
# ${OUT:-out}/. Run from the repository root:  bash benchmarks/gpu_foundation_check.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; echo "install rc=$?"
python3 - > "$OUT/versions.json" <<'PY'
import json, torch, triton, transformers, subprocess
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                  "gpu": smi, "cuda": torch.version.cuda}))
PY
cat "$OUT/versions.json"
start=$(date +%s)
timeout 240 python3 -m pytest -q -n 8 -m "not slow" -p no:cacheprovider tests > "$OUT/pytest.log" 2>&1; echo "pytest rc=$? ($(( $(date +%s) - start )) s)"; tail -5 "$OUT/pytest.log"
timeout 180 python3 examples/generate.py --device cuda --dtype bfloat16 > "$OUT/generate_bf16.log" 2>&1; echo "generate bf16 rc=$?"; tail -6 "$OUT/generate_bf16.log"
timeout 90 python3 examples/generate.py --device cuda --dtype float32 --compiler aot_eager > "$OUT/generate_fp32.log" 2>&1; echo "generate fp32 aot_eager rc=$?"; tail -4 "$OUT/generate_fp32.log"
timeout 60 python3 -m ckvp_compile.inspection --model models/tiny-mixtral-pystdlib --html "$OUT/inspect.html" > "$OUT/inspect.txt" 2>&1; echo "inspect rc=$?"; head -30 "$OUT/inspect.txt"
