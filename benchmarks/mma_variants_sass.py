"""Static SASS of the unit-major MMA pass's switches, compiled for sm_90a without a GPU.

For each (GQA ratio, code bits, page size, switch set) it compiles ``_mma_unit_kernel`` (``latent_attention_mma
.compile_for_sm90``, lane loads on) and reads, through the running Triton's bundled ``ptxas`` / ``cuobjdump``:
registers, spill bytes, the instructions of the unmasked tile loop (:func:`ckvp_compile.testing.sm90.tile_loop`: one
64-slot tile's work) and their mix (byte/field conversion: PRMT, LOP3, HADD2; register moves: IMAD.MOV; selects:
FSEL). Static counts, not timings: they say which switches shorten the loop and what ptxas does with the registers;
only benchmarks/mma_attention_gpu.py ``--variants`` times them. Run it under the Triton the GPU machine has (3.6:
its ptxas allocates differently from 3.9's).

Usage: ``PYTHONPATH=. python benchmarks/mma_variants_sass.py --json F --out F.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("base", "pscan", "vpair", "vpair+pscan", "pscan+pdl")
CASES = ((4, 8, 64), (2, 8, 64), (8, 8, 64), (4, 8, 0), (4, 4, 64), (8, 4, 64))


def measure(g: int, bits: int, page: int, variant: str, maxnreg: int | None = None) -> dict:
    """One compile's static numbers (see the module docstring)."""
    from ckvp_compile.kernels.latent_attention_mma import compile_for_sm90
    from ckvp_compile.testing.sm90 import ptxas_stats, tile_loop

    on = set(variant.split("+")) - {"base"}
    k = compile_for_sm90(g, g, page, unit_major=True, bits=bits, lanes=True, vpair="vpair" in on,
                         pscan="pscan" in on, pdl="pdl" in on, maxnreg=maxnreg)
    st = ptxas_stats(k.asm["ptx"])
    loop = tile_loop(st["sass"]) if st["sass"] else []
    ops: dict = {}
    for t in loop:
        op = t.split()[1] if t.startswith("@") else t.split()[0]
        ops[op] = ops.get(op, 0) + 1
    return dict(g=g, bits=bits, page=page, variant=variant, maxnreg=maxnreg, registers=st["registers"],
                spill_store_bytes=st["spill_store_bytes"], spill_load_bytes=st["spill_load_bytes"],
                loop=len(loop), conversion=sum(ops.get(o, 0) for o in ("PRMT", "LOP3.LUT", "HADD2", "HADD2.F32")),
                moves=ops.get("IMAD.MOV.U32", 0), fsel=ops.get("FSEL", 0), hmma=ops.get("HMMA.16816.F32", 0),
                local_loads=sum(v for o, v in ops.items() if o.startswith("LDL")), ops=ops)


def main() -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="markdown table")
    a = ap.parse_args()
    rows = []
    for g, bits, page in CASES:
        for v in VARIANTS:
            if bits == 4 and "vpair" in v:
                continue  # (8-bit switches)
            rows.append(measure(g, bits, page, v))
            r = rows[-1]
            print(g, bits, page, v, r["loop"], r["registers"], r["spill_store_bytes"], flush=True)
    rows.append(measure(2, 8, 64, "vpair+pscan", maxnreg=128))
    meta = dict(triton=triton.__version__, target="sm_90a", command=" ".join(sys.argv))
    if a.json:
        a.json.write_text(json.dumps(dict(rows=rows, **meta), indent=1))
    if a.out:
        lines = [f"Triton {meta['triton']} (its ptxas), sm_90a, `{meta['command']}`", "",
                 "| G | bits | page | switches | maxnreg | tile-loop SASS | registers | spills (B) | conversion | "
                 "IMAD.MOV | FSEL | LDL |", "| " + " | ".join(["---"] * 12) + " |"]
        for r in rows:
            lines.append(f"| {r['g']} | {r['bits']} | {r['page'] or 'static'} | {r['variant']} | "
                         f"{r['maxnreg'] or '-'} | {r['loop']} | {r['registers']} | {r['spill_store_bytes'] or 0} | "
                         f"{r['conversion']} | {r['moves']} | {r['fsel']} | {r['local_loads']} |")
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
