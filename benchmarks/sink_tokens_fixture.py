"""Experiment (CPU): keep the first S slots of every sequence exact, beside a dense recent window, on the fixture.

Attention sinks (StreamingLLM, Xiao et al., ICLR 2024) and IntactKV (Liu et al., 2024, arXiv:2403.01241) keep a
few early tokens' keys and values exact because they take a large share of the attention mass. This script
measures whether that helps issue 9's acceptance 5 (greedy agreement at 4x), without a new store feature: it
patches ``kernels.reference.window_append_ref`` so that the dense recent window's buffer of W entries holds
slots [0, S) in its first S entries and a ring of the last W - S slots in the rest. The window's W entries are
counted in the byte ratio as before, so a run with ``--recent-window W`` and ``SINKS=S`` has the bytes of one
with ``--recent-window W`` and ``SINKS=0``. CPU only: the patched reference is the op's CPU implementation
(a host-synchronising boolean mask: fine on CPU, not for CUDA graphs).

    SINKS=4 python benchmarks/sink_tokens_fixture.py decode --shape fixture --ratios 4 \\
        --latent-format planned+rot+fp8+measured --compiler aot_eager --device cpu --prompts 16 \\
        --recent-window 20 --json OUT.json

Results: benchmarks/results/2026-12-01-sink-tokens-fixture-cpu.
"""

from __future__ import annotations

import os
import sys

import torch

SINKS = int(os.environ.get("SINKS", "0"))


def sink_window_append(window_k: torch.Tensor, window_v: torch.Tensor, window_slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, slots: torch.Tensor) -> None:
    """``window_append_ref`` with entries [0, SINKS) reserved for slots [0, SINKS) and a ring of W - SINKS entries
    (entry SINKS + slot % (W - SINKS)) for the most recent other slots. Shapes as ``window_append_ref``."""
    total = window_k.shape[2]
    w = total - SINKS
    if SINKS == 0 or w < 1:
        return _ORIGINAL(window_k, window_v, window_slots, k, v, slots)
    sl = slots.long()
    n = sl.shape[0]
    idx = torch.arange(n, device=sl.device)
    keep = (sl < SINKS) | (idx >= n - min(w, n))  # sinks, and the call's last w tokens
    sel = sl[keep]
    entry = torch.where(sel < SINKS, sel, SINKS + torch.remainder(sel, w))
    window_k[:, :, entry] = k[:, :, keep].to(window_k.dtype)
    window_v[:, :, entry] = v[:, :, keep].to(window_v.dtype)
    window_slots[entry] = sel


if __name__ == "__main__":
    from ckvp_compile.bench.cli import main
    from ckvp_compile.kernels import reference as ref

    _ORIGINAL = ref.window_append_ref
    ref.window_append_ref = sink_window_append
    sys.exit(main())
