#!/usr/bin/env bash
# One device call: run session 49's r2 script (check, sweep, acceptance bench with the IMMA/FPAIR/VIMMA switches on
# and off) only when the card is an H200; on any other card print its name and stop (costs seconds, not minutes).
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name"
case "$name" in
  *H200*) RUN=${RUN:-h200} bash benchmarks/results/2026-12-07-session49/run2.sh ;;
  *) echo "not an H200: nothing run" ;;
esac
