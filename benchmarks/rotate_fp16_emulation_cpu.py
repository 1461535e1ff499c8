"""How much output error ``DecodeConfig.rotate_fp16`` adds, emulated in fp64 on CPU (no GPU needed).

The rotated key pass scores slot t of a head as ``sum_n z[t, n] * sum_j (cos[t, j] Ea[j, n] + sin[t, j] Eb[j, n])``
with the query folded into the basis (``Ea = P1 q1 + P2 q2``, ``Eb = P1 q2 - P2 q1``, paired tables; see
``_rotated_coefficients``). The default rounds Ea, Eb to bf16 hi + lo parts; ``rotate_fp16`` rounds them once to
fp16. This script computes one decode step's attention output of every head in fp64 with exact, hi + lo and fp16
coefficients (everything else exact) on ``ckvp-bench attention``'s inputs (``make_inputs``: keys of std ~1,
q ~ N(0, 1), scale 1/sqrt(D)) and prints the relative error (Frobenius) of each against the exact one.

    python3 benchmarks/rotate_fp16_emulation_cpu.py [--heads 16:16] [--cases 12:4096,104:32768]

The error scales with the logits: these inputs have logits of order 1; larger ones (an interpreter case with
head_dim 32 and bf16 inputs) reached 1.4e-3 (tests/kernels/test_latent_attention_triton.py).
"""

from __future__ import annotations

import argparse

import torch

from ckvp_compile.bench.attention import make_inputs
from ckvp_compile.kernels.latent_format import dequantize_latent_ref


def errors(rank: int, t: int, heads: tuple[int, int], fmt: str = "int4/32", seed: int = 1) -> dict:
    """Relative output errors ``{"hilo": ..., "fp16": ...}`` of one step (batch 1, ``t`` slots, rotate_half)."""
    q, lk, lv, bk, bv, ko, vo, cos, sin = make_inputs(1, t, fmt, rank, seed=seed, dev="cpu", heads=heads)[:9]
    h, hkv = heads
    d = q.shape[-1]
    zk = dequantize_latent_ref(lk, ko, fmt).double()[0]
    zv = dequantize_latent_ref(lv, vo, fmt).double()[0]
    cos_h, sin_h = cos.double()[:, : d // 2], sin.double()[:, : d // 2]  # paired tables: one angle per pair

    def hilo(e: torch.Tensor) -> torch.Tensor:
        hi = e.float().bfloat16()
        return hi.double() + (e.float() - hi.float()).bfloat16().double()

    outs = {"exact": [], "hilo": [], "fp16": []}
    for hh in range(h):
        kv = hh // (h // hkv)
        p, qq = bk[kv].double(), q[0, hh, 0].double()
        p1, p2, q1, q2 = p[: d // 2], p[d // 2:], qq[: d // 2, None], qq[d // 2:, None]
        ea, eb = p1 * q1 + p2 * q2, p1 * q2 - p2 * q1
        z = zk[:, kv * rank:(kv + 1) * rank]
        v = zv[:, kv * rank:(kv + 1) * rank] @ bv[kv].double().T

        def out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            s = (z * (cos_h @ a + sin_h @ b)).sum(1) * d**-0.5
            return torch.softmax(s, 0) @ v

        outs["exact"].append(out(ea, eb))
        outs["hilo"].append(out(hilo(ea), hilo(eb)))
        outs["fp16"].append(out(ea.float().half().double(), eb.float().half().double()))
    ex = torch.stack(outs["exact"])
    return {k: float((torch.stack(outs[k]) - ex).norm() / ex.norm()) for k in ("hilo", "fp16")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16:16")
    ap.add_argument("--cases", default="12:4096,12:32768,32:32768,104:4096,104:32768", help="rank:slots,...")
    a = ap.parse_args()
    heads = tuple(int(x) for x in a.heads.split(":"))
    print("| rank | slots | hi + lo (default) | fp16 (rotate_fp16) |\n| --- | --- | --- | --- |")
    for case in a.cases.split(","):
        rank, t = (int(x) for x in case.split(":"))
        e = errors(rank, t, heads)
        print(f"| {rank} | {t} | {e['hilo']:.2e} | {e['fp16']:.2e} |", flush=True)


if __name__ == "__main__":
    main()
