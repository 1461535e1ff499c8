"""``ckvp-bench``: the benchmark command line.

    ckvp-bench fidelity --model DIR --text FILE --kv-ratio 4 8 16 [--window 512] [--calib-windows N]
        [--eval-windows N] [--json OUT] [--plot OUT.png] [--tokenizer bytes|DIR] ...

Subcommands:
    fidelity: perplexity, top-1 agreement and KL of the CKVP latent cache against the dense model
        (:mod:`ckvp_compile.bench.fidelity`; ``ckvp-bench fidelity --help``).
    offload: expert offload, prefetch vs on-demand vs all-resident, and next-layer prediction recall
        (:mod:`ckvp_compile.bench.offload`; ``ckvp-bench offload --help``).
    moe: one MoE layer (Mixtral / Qwen2-MoE / OLMoE shapes): ckvp vs Inductor max-autotune grouped_mm vs HF
        batched_mm vs HF eager (:mod:`ckvp_compile.bench.moe`; CUDA).
    decode: end-to-end decode steps of random-weight Mixtral-8x7B / Qwen-MoE models and the fixture's greedy
        agreement (:mod:`ckvp_compile.bench.decode`; ``--report`` writes BENCHMARKS.md).
    attention: one layer's fused latent decode attention (Mixtral-8x7B 32:8 heads by default) at several batches
        and contexts against dense bf16 SDPA / FlexAttention under torch.compile: time, bytes read, share of the
        copy bandwidth, speedup (:mod:`ckvp_compile.bench.attention`; CUDA; ``--tiny --device cpu`` smoke test).

The kernel-level GPU scripts live in ``benchmarks/`` (``latent_attention_gpu.py``: the sweeps and diagnostics
behind ``ckvp-bench attention``, ``latent_quant_gpu.py``,
``latent_attention_lowering_gpu.py``, ``reliability_gpu.py``) and run on a CUDA machine from the repository.
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]

_SUBCOMMANDS = {"fidelity": "ckvp_compile.bench.fidelity", "decode": "ckvp_compile.bench.decode",
                "offload": "ckvp_compile.bench.offload", "moe": "ckvp_compile.bench.moe",
                "attention": "ckvp_compile.bench.attention"}
#: One line per subcommand for ``ckvp-bench --help`` (the module docstring has the longer form).
_SUMMARY = {"fidelity": "perplexity, top-1 agreement and KL of the latent KV cache against the dense model",
            "decode": "end-to-end decode steps (Mixtral / Qwen-MoE shapes, fixture agreement); --report writes "
                      "BENCHMARKS.md",
            "offload": "expert offload: prefetch vs on-demand vs all-resident, next-layer prediction recall",
            "moe": "one MoE layer: ckvp grouped GEMMs vs Inductor and HF implementations (CUDA)",
            "attention": "one layer's fused latent decode attention vs dense SDPA / FlexAttention (CUDA)"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckvp-bench <subcommand> [args]``; returns the exit status (2 for a usage error)."""
    import importlib

    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: ckvp-bench {" + ",".join(_SUBCOMMANDS) + "} [args]  (ckvp-bench SUBCOMMAND --help)\n"
    if args and args[0] in ("-h", "--help"):
        sys.stdout.write(usage + "\nsubcommands:\n" + "".join(f"  {name:<10} {what}\n" for name, what in _SUMMARY.items()))
        return 0
    if not args or args[0] not in _SUBCOMMANDS:
        bad = f"ckvp-bench: error: unknown subcommand {args[0]!r}\n" if args else ""
        sys.stderr.write(bad + usage)
        return 2
    return importlib.import_module(_SUBCOMMANDS[args[0]]).main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
