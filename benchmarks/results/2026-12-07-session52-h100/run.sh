#!/usr/bin/env bash
# Session 52's device call (repository root): session 51's script, unchanged, with its results under $OUT/${RUN:-r1}.
# See ../2026-12-07-session51-h200/run.sh for what it runs (issue 5's acceptance bench with the defaults, twice;
# PAIRS / CHECK / EX options).
RUN=${RUN:-r1} exec bash "$(dirname "$0")/../2026-12-07-session51-h200/run.sh" "$@"
