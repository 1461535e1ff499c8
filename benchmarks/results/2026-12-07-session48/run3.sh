#!/usr/bin/env bash
# One device call (repository root): run2.sh after the fields moved into the TMA stages too (r4: six copies a tile;
# r5: four, the fields by 3-d boxes; needs commit c90ff17 or the uncommitted r4 state), with the register cap left to
# the compiler (MAXNREGS=0) unless set.
MAXNREGS=${MAXNREGS:-0} exec bash "$(dirname "$0")/run2.sh"
