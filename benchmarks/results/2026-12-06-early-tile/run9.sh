#!/usr/bin/env bash
# r9 (one device call, repository root; meant for the H200): run6.sh with the pdlfold variant (r7) added to the
# batch 8, 32k sweep (two interleaved repeats), then issue 5's acceptance benchmark twice with the defaults.
A=vpair+pscan+fmerge+evict
V=$A,$A+pre,$A+pdl+pre,$A+pdl+pre+pdlfold
RUN=r9 VARIANTS=$V SWEEP_S=140 bash "$(dirname "$0")/run6.sh"
