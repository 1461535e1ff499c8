"""Cross-layer latent KV cache (CKVP): calibrated bases, ranks, and the calibration that fits them.

    bases = ckvp_compile.calibrate(model, samples, kv_ratio=4.0, group_size=4)
    bases.save("bases.safetensors")
    bases = LatentBases.load("bases.safetensors", model=model)

Modules:
    bases: :class:`LatentBases` (per layer group and KV head, orthonormal bases of the stacked pre-RoPE keys and
        of the values; ranks; spectra; save / load as one safetensors file) and :func:`build_latent_bases`.
    ranks: the rank budget and its allocation over (group, head, K/V), 'energy' or 'uniform'.
    calibrate: :func:`calibrate` and :func:`collect_kv_moments`, collecting keys and values by graph structure.
    capture: drives one static-cache prefill of a HF or gpt-fast model.
    online: :func:`online_bases`, ranks only; each sequence's bases are fitted at its prefill.
    budget: byte counts of a store, and ranks fitted to a byte ratio for a latent format.

See DESIGN.md, "CKVP in numbers". Source: xKV (Chang et al. 2025, arXiv:2503.18893), cross-layer SVD.
"""

from __future__ import annotations

from .bases import FORMAT_VERSION, LatentBases, build_latent_bases, model_fingerprint
from .calibrate import KVMoments, calibrate, collect_kv_moments
from .online import online_bases
from .ranks import RANK_ALLOCATIONS, allocate_ranks, rank_budget, rank_steps

__all__ = [
    "FORMAT_VERSION",
    "KVMoments",
    "LatentBases",
    "RANK_ALLOCATIONS",
    "allocate_ranks",
    "build_latent_bases",
    "calibrate",
    "collect_kv_moments",
    "model_fingerprint",
    "online_bases",
    "rank_budget",
    "rank_steps",
]
