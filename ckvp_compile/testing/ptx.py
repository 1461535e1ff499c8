"""Read the few PTX instructions of the int4 -> fp16 dequantization asm in Python, so that CPU tests check the asm
text itself (masks, shifts, constants) against the packed codes, not a re-statement of it.

Used by tests of :mod:`ckvp_compile.kernels.latent_attention_mma` and of the prototype it grew from
(benchmarks/mma_pass_proto.py), whose Gluon kernels cannot run on a CPU.
"""

from __future__ import annotations

import re

__all__ = ["run_asm", "run_dequant_asm"]


def run_dequant_asm(asm: str, word: int) -> list[float]:
    """Execute ``asm`` (an inline-asm body with one 32-bit input ``$8`` and eight 16-bit outputs ``$0..$7``) for
    one input word: :func:`run_asm` with those operands.

    Args:
        asm: the PTX text; word: the input, as an int (its low 32 bits are used).
    Returns:
        The 8 outputs as Python floats (each an fp16 value).
    Raises:
        What :func:`run_asm` raises.
    """
    return run_asm(asm, [word], 8)


def run_asm(asm: str, inputs: list[int], n_out: int, words: bool = False) -> list:
    """Execute ``asm`` (an inline-asm body with ``n_out`` 16-bit fp16 outputs ``$0 ..`` and 32-bit inputs
    ``$n_out ..``), reading the instructions the dequantization and packing asm use: ``mov.b32`` of an immediate or
    into a pair of halves, ``lop3.b32``, ``shr.u32``, ``add.s32`` (register or decimal immediate, modulo 2^32),
    ``prmt.b32`` (default mode, immediate or register selector) and ``sub.f16x2`` (fp16 subtraction, rounded as
    numpy's float16 rounds).

    Args:
        asm: the PTX text; inputs: the input words, as ints (their low 32 bits are used); n_out: the outputs;
        words: the outputs are 32-bit registers written by the instructions themselves (e.g. the byte transpose's
            ``prmt.b32 $0, ...``), returned as ints.
    Returns:
        The outputs as Python floats (each an fp16 value), or as ints (``words``).
    Raises:
        AssertionError: an instruction outside those (the reader would silently mis-evaluate it).
        KeyError: a register read before it is written.
    Source: the PTX ISA's definitions of these instructions (``lop3``'s truth table indexed by a, b, c bits;
    ``prmt``'s selector nibbles picking bytes 0..7 of {b, a}, the nibble's bit 3 replicating the sign).
    """
    import numpy as np

    regs: dict[str, int] = {f"${n_out + i}": w & 0xFFFFFFFF for i, w in enumerate(inputs)}
    out: dict[str, int] = {}

    def val(x: str) -> int:
        x = x.strip()
        return int(x, 16) & 0xFFFFFFFF if x.startswith("0x") else regs[x]

    for ins in (t.strip() for t in asm.replace("\n", " ").split(";")):
        ins = ins.strip("{} ").strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        if op == "mov.b32" and rest.lstrip().startswith("{"):
            halves, src = re.match(r"\{([^}]*)\}\s*,\s*(\S+)", rest).groups()
            lo, hi = (h.strip() for h in halves.split(","))
            out[lo], out[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "lop3.b32":
            a, b, c, lut = val(args[1]), val(args[2]), val(args[3]), int(args[4], 16)
            regs[args[0]] = sum(((lut >> (((a >> i) & 1) * 4 + ((b >> i) & 1) * 2 + ((c >> i) & 1))) & 1) << i
                                for i in range(32))
        elif op == "add.s32":
            regs[args[0]] = (val(args[1]) + (int(args[2]) if args[2].lstrip("-").isdigit() else val(args[2]))) \
                & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[args[0]] = val(args[1]) >> int(args[2])
        elif op == "prmt.b32":
            pool = (val(args[1]) | val(args[2]) << 32).to_bytes(8, "little")
            sel = val(args[3])
            res = 0
            for k in range(4):
                nib = (sel >> (4 * k)) & 0xF
                byte = pool[nib & 7]
                res |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * k)
            regs[args[0]] = res
        elif op == "sub.f16x2":
            x, y = val(args[1]), val(args[2])
            res = 0
            for k in (0, 16):
                hx = np.array([(x >> k) & 0xFFFF], dtype=np.uint16).view(np.float16)
                hy = np.array([(y >> k) & 0xFFFF], dtype=np.uint16).view(np.float16)
                res |= int((hx - hy).view(np.uint16)[0]) << k
            regs[args[0]] = res
        else:
            raise AssertionError(f"unexpected instruction {op}")
    if words:
        return [regs[f"${i}"] for i in range(n_out)]
    return [float(np.array([out[f"${i}"]], dtype=np.uint16).view(np.float16)[0]) for i in range(n_out)]
