"""Spike: key bases that commute with RoPE, so that decode attention never rebuilds keys (measured on the fixture).

Why: the fused decode kernel rebuilds each cached key from its latent (2 * D * r FLOP per token and head) because
RoPE's rotation depends on the token's position, so the query cannot be absorbed into a real basis P as the
value side is (issue 5: compute-bound by construction). A RoPE pair (x_a, x_b) rotates as the complex number
c = x_a + i x_b times e^{i theta t}. If each key latent coordinate is a *complex* combination of one frequency's
pairs across the group's layers, c_{l,j} ~ sum_k v_{l,j,k} z_{j,k} (z complex), RoPE commutes with the basis:
RoPE_t(k_l) is rebuilt from e^{i theta_j t} z_{j,k}. The store can then hold rotated latents (RoPE applied once,
at write time), and a query is absorbed once per step, q'_{j,k} = sum_l conj(v_{l,j,k}) q_{l,j}, so that a score
is Re(q' . z~_t): 2r FLOP per token and head, like MLA's absorbed decode, memory-bound instead of compute-bound.

What this measures: the price in fidelity. Per (group, KV head), the complex basis is the top eigenvectors of
each frequency's Hermitian second moment E[c c^H] (G x G, from the same calibration moments as the real PCA),
ranked across frequencies by eigenvalue, with as many real dimensions (2 per complex one) as the real PCA basis
at the same byte ratio. It is written as an orthonormal *real* basis of the same (J-invariant) subspace, so the
existing latent cache and rewrite evaluate it unchanged: keys projected on that subspace, values as before.
Prints the captured key energy of both and the perplexity change against dense on held-out windows.

    python3 benchmarks/rope_commuting_bases_cpu.py --ratios 4 8 --eval-windows 32 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch


def complex_key_basis(moment: torch.Tensor, group_layers: int, head_dim: int, rank: int) -> tuple[torch.Tensor, float]:
    """A real orthonormal (n, rank) basis of a RoPE-commuting subspace for one (group, KV head), rotate_half pairs.

    Args:
        moment: (n, n) float64, E[x x^T] of the stacked pre-RoPE keys x (n = G * D; layer l's channels at l*D..).
        group_layers: G. head_dim: D (even). rank: real dimensions wanted (even: rank // 2 complex directions).
    Returns:
        (basis (n, rank) float64 with columns in pairs [u, J u], the key energy it captures / the total).
    """
    d2 = head_dim // 2
    g = group_layers
    eig = []  # (lambda, frequency j, complex eigenvector (G,))
    for j in range(d2):
        a = torch.tensor([l * head_dim + j for l in range(g)])
        b = a + d2
        maa, mbb = moment[a][:, a], moment[b][:, b]
        mba, mab = moment[b][:, a], moment[a][:, b]
        herm = torch.complex(maa + mbb, mba - mab)  # E[c c^H], c_l = x_a + i x_b
        lam, vec = torch.linalg.eigh(herm)
        for k in range(g):
            eig.append((float(lam[k]), j, vec[:, k]))
    eig.sort(key=lambda e: -e[0])
    n = g * head_dim
    cols = []
    for lam, j, v in eig[:rank // 2]:
        u1 = torch.zeros(n, dtype=torch.float64)
        u2 = torch.zeros(n, dtype=torch.float64)
        for l in range(g):
            a, b = l * head_dim + j, l * head_dim + j + d2
            u1[a], u1[b] = v[l].real, v[l].imag  # Re(conj(v) . c)
            u2[a], u2[b] = -v[l].imag, v[l].real  # Im(conj(v) . c)
        cols += [u1, u2]
    basis = torch.stack(cols, 1) if cols else torch.zeros(n, 0, dtype=torch.float64)
    total = float(torch.trace(moment))
    captured = float(torch.einsum("ir,ij,jr->", basis, moment, basis))
    return basis, captured / total


def real_energy(moment: torch.Tensor, basis: torch.Tensor, rank: int) -> float:
    p = basis[:, :rank].double()
    return float(torch.einsum("ir,ij,jr->", p, moment, p)) / float(torch.trace(moment))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from ckvp_compile import CKVPBackend, CKVPConfig
    from ckvp_compile.bench.fidelity import (DEFAULT_MODEL_DIR, _batches_exact, ckvp_stats, dense_stats,
                                             load_token_ids, split_windows)
    from ckvp_compile.latent import collect_kv_moments
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache

    torch.manual_seed(0)
    model_dir = DEFAULT_MODEL_DIR
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert model.config.rope_parameters.get("rope_type", "default") == "default"
    windows = split_windows(load_token_ids(f"{model_dir}/eval_text.txt", model, model_dir, None), args.window)
    calib = windows[:args.calib_windows]
    evals = windows[args.calib_windows:args.calib_windows + args.eval_windows]
    t0 = time.perf_counter()
    dense = dense_stats(model, evals, args.batch, False)
    moments = collect_kv_moments(model, _batches_exact(calib, args.batch), group_size=args.group_size, progress=False)
    print(f"dense ppl {dense.stats.perplexity:.5f}; moments ({time.perf_counter() - t0:.0f} s)", flush=True)
    d = moments.head_dim
    rows = []
    for ratio in args.ratios:
        real = moments.bases(ratio, "energy")
        k_basis, k_ranks, energy = [], [], []
        for g, layers in enumerate(real.groups):
            rs = [max(2, 2 * (r // 2)) for r in real.k_ranks[g]]  # complex directions come in real pairs
            hb = torch.zeros_like(real.k_basis[g])
            for h, r in enumerate(rs):
                m = moments.k[g][h].double() / moments.num_tokens
                p, e_c = complex_key_basis(m, len(layers), d, r)
                hb[h, :, :r] = p.float()
                energy.append({"group": g, "head": h, "rank_real": real.k_ranks[g][h], "rank_complex_real_dims": r,
                               "energy_real": real_energy(m, real.k_basis[g][h], real.k_ranks[g][h]),
                               "energy_complex": e_c})
            k_basis.append(hb[:, :, :max(rs)].contiguous())
            k_ranks.append(tuple(rs))
        rope = dataclasses.replace(real, k_basis=tuple(k_basis), k_ranks=tuple(k_ranks))
        for name, bases in (("real PCA", real), ("RoPE-commuting (complex)", rope)):
            torch._dynamo.reset()
            cache = CKVPStaticCache(model.config, bases, max_cache_len=args.window, max_batch_size=args.batch,
                                    device="cpu", dtype=torch.float32, latent_format="float",
                                    latent_dtype=torch.bfloat16)
            step = torch.compile(model, backend=CKVPBackend(CKVPConfig(compiler="aot_eager",
                                                                       group_size=args.group_size)), fullgraph=True)
            t1 = time.perf_counter()
            stats, _ = ckvp_stats(model, step, cache, evals, dense, args.chunk, False, name, False)
            row = {"ratio": ratio, "basis": name, "ppl": stats.perplexity,
                   "ppl_change_pct": 100 * (stats.perplexity / dense.stats.perplexity - 1),
                   "top1_agreement_pct": 100 * float(stats.agree.sum()) / stats.tokens,
                   "k_ranks": [list(r) for r in bases.k_ranks], "v_ranks": [list(r) for r in bases.v_ranks],
                   "seconds": round(time.perf_counter() - t1, 1)}
            if name.startswith("RoPE"):
                row["key_energy"] = energy
            rows.append(row)
            er = sum(e["energy_real"] for e in energy) / len(energy)
            ec = sum(e["energy_complex"] for e in energy) / len(energy)
            print(f"{ratio:g}x {name}: ppl {row['ppl']:.5f} ({row['ppl_change_pct']:+.3f}%), top-1 "
                  f"{row['top1_agreement_pct']:.2f}%; mean key energy real {er:.4f} complex {ec:.4f} "
                  f"({row['seconds']} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 " + " ".join(sys.argv), "dense_ppl": dense.stats.perplexity,
                       "eval_windows": args.eval_windows, "window": args.window, "group_size": args.group_size,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
