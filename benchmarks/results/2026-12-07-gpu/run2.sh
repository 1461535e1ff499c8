#!/usr/bin/env bash
# One device call (repository root): the 'auto' expert GEMM default on the GPU image's torch 2.11 (its CPU tests,
# then check_equivalence on CUDA: equivalence_auto.py).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
[ "${TESTS_S:-100}" != 0 ] && timeout ${TESTS_S:-100} env PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests/passes/test_expert_gemm.py \
  -k "auto or option_off or grad_mode or grouped_mm or at_risk" tests/reliability/test_grouped_mm_experts_warning.py > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/tests.log
PYTHONPATH=. timeout ${EQ_S:-420} python3 benchmarks/results/2026-12-07-gpu/equivalence_auto.py $OUT/equivalence_auto.json ${EXAMPLES:-4} ${CASES:-0,1,2} \
  > $OUT/equivalence.log 2>&1
echo "equivalence rc=$?"; grep "^dense\|^latent\|^  compiled" $OUT/equivalence.log | tail -40 | cut -c1-900
