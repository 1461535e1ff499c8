"""GPU check of the ``-f8`` latent formats (one e4m3 span and one e4m3 minimum byte per block, kernels/latent_format.py)
in every Triton path that reads or writes them. It decides the flags that keep CUDA on the reference for ``-f8``:

* ``kernels.latent_quant_triton.F8_GPU_CHECKED`` (quantize / dequantize kernels, fused append): checks 1 and 2;
* ``kernels.latent_attention_triton.F8_META_GPU_CHECKED`` (decode attention kernels): check 3;
* ``lowering.latent_attention.F8_META_TEMPLATE_GPU_CHECKED`` (Inductor's key-pass template): checks 3 and 4.

The script sets each flag True while it runs (restored after) and checks against the PyTorch references:

1. ``quant``: ``quantize_latent_triton`` bytes == ``quantize_latent_ref`` and ``dequantize_latent_triton`` ==
   ``dequantize_latent_ref`` bit for bit (on the reference's rows and on random rows, e4m3 NaN bytes included),
   for int8/32-f8, int4/32-f8, int2/16-f8, int4/64-f8 and two mix/32-f8 plans, 16k-64k rows of rank 64-256 (the
   head splits of latent_quant_gpu.py), magnitudes 1e-2..50 (per row / per coordinate); and blocks e4m3 cannot hold
   (span 600, minimum -460): equal metadata bytes (0x7F), NaN decodes in exactly those rows, in both.
2. ``append``: the CUDA ``ckvp::latent_append`` on -f8 int4 / int8 / mix formats over latent_append_gpu.py's CASES,
   with its pass rule: >= 99% of coordinates bit-equal to ``latent_append_ref``, none more than one code step apart
   (the step read from the stored span: ``span / levels``), RMS error vs an fp64 projection within 1% of the
   reference math's, other rows untouched; and a Triton path (fused, or the unfused quantizer) ran.
3. ``attention``: ``latent_attention_triton`` and ``ckvp::latent_attention`` (must dispatch to it) on -f8 K / V
   (int4/32-f8, int8/32-f8, a mix/32-f8 plan), Mixtral 32:8 heads, head_dim 128, ranks 64 and 32, batch 1 and 8,
   contexts 4k and 32k, static and paged (page 64) latents: relative error vs ``latent_attention_ref`` <= 1e-3
   (``--tiny``: 2e-3, the tests' bound for the fp16 key rebuild: at 8 heads x 32 channels the bf16 outputs' rounding
   does not average out, as for fp16-metadata formats); reports the kernel passes that ran (``_LAST_LAUNCH``) and,
   informative only, median ms (CUDA events) against the same shapes in the fp16-metadata format.
4. ``template`` (CUDA only): the op in a graph compiled by Inductor (32:8, rank 256, int4/32-f8, batch 8, 4k): by
   default the template must be chosen (its kernel in the output code) and correct, and not chosen with its flag
   off; under max-autotune-no-cudagraphs whichever kernel wins must be correct.

Writes ``--json`` (env, flag verdicts, every row) and ``--out`` (markdown: GPU, versions, the command, PASS / FAIL and
the largest errors per check); exits 1 when a correctness check fails or is skipped by ``--budget-s``::

    PYTHONPATH=. python benchmarks/f8_meta_gpu.py --json $OUT/f8.json --out $OUT/f8.md [--checks quant,append,...]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/f8_meta_gpu.py --tiny --json f8.json --out f8.md  # CPU dry run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckvp_compile.bench.attention import make_inputs, paged_latents, ref_chunked, rel_err  # noqa: E402
from ckvp_compile.bench.output import run_env, write_result  # noqa: E402
from ckvp_compile.kernels import latent_attention_triton as lat  # noqa: E402
from ckvp_compile.kernels import latent_format as lf  # noqa: E402
from ckvp_compile.kernels import latent_quant_triton as lq  # noqa: E402
from ckvp_compile.kernels import reference as ref  # noqa: E402
from ckvp_compile.kernels.latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref  # noqa
from ckvp_compile.lowering import latent_attention as lowering  # noqa: E402
from latent_append_gpu import CASES, _plan, _written_order  # noqa: E402
from latent_quant_gpu import SHAPES, _mix_plan, _offsets  # noqa: E402

QUANT_FORMATS = ("int8/32-f8", "int4/32-f8", "int2/16-f8", "int4/64-f8", "mix 8/4/2", "mix 8/2")
HEADS, HEAD_DIM, TOL = (32, 8), 128, 1e-3


@contextlib.contextmanager
def patched(*items):
    """Set ``(module, name, value)`` attributes for the block, restoring the old values after."""
    saved = [(m, n, getattr(m, n)) for m, n, _ in items]
    for m, n, v in items:
        setattr(m, n, v)
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal fp32 tensors, a NaN equal to any NaN (payloads differ between x86 and CUDA)."""
    return a.shape == b.shape and bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def f8(fmt: str) -> str:
    """``fmt`` (int or mix) with ``-f8`` block metadata."""
    return fmt.replace(":", "-f8:", 1) if fmt.startswith("mix") else fmt + "-f8"


def steps(rows: torch.Tensor, off: list, fmt: str) -> torch.Tensor:
    """(..., R_tot) code step of each coordinate as stored: (decode with every code at its top - decode with every
    code 0) / levels, i.e. the block's ``span * fp32(1 / levels)`` (``-f8``) or fp16 scale."""
    f = parse_latent_format(fmt)
    n_code = sum(f.code_bytes(off))
    lo, hi = rows.clone(), rows.clone()
    lo[..., :n_code], hi[..., :n_code] = 0, 255
    levels = torch.cat([torch.full((c,), (1 << b) - 1.0) for _, c, b, _ in f.pieces(off)]).to(rows.device)
    return (dequantize_latent_ref(hi, off, fmt) - dequantize_latent_ref(lo, off, fmt)) / levels


def run_row(rows: list, row: dict, body) -> None:
    """``body(row)`` fills ``row`` (and its ``pass``); an exception is recorded as a failure; the row is kept."""
    try:
        body(row)
    except Exception as e:  # noqa: BLE001 - reported; the other rows still run
        row.update({"error": str(e) if isinstance(e, TimeoutError) else repr(e)[:400], "pass": False})
    rows.append(row)
    print(row, flush=True)


def event_ms(fn, n: int = 50) -> float:
    """Median ms of ``fn()`` over ``n`` calls, each between two CUDA events (after 5 warm-up calls)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n + 5)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev[5:])


def check_quant(dev, tiny: bool, gen) -> list[dict]:
    rows = []
    kinds = ("per-coordinate magnitude", "per-row magnitude")
    shapes = [(n.split(" ", 2)[2], b * s, r, kinds) for n, b, s, r in SHAPES]  # B8 x 4096: 32k rows
    shapes = [("tiny " + sh[0], 6, sh[2], kinds[i:i + 1]) for i, sh in enumerate(shapes[1:])] if tiny else \
        [("2x128", 65536, (128, 128), kinds)] + shapes + [("2x32", 16384, (32, 32), kinds)]
    for name, n, ranks, kinds in shapes:
        off = _offsets(ranks)
        plans = {"mix 8/4/2": f8(_mix_plan(ranks)), "mix 8/2": "mix/32-f8:" + ",".join(
            f"8x{r // 2}+2x{r - r // 2}" for r in ranks)}
        for label, fmt in ((k, plans.get(k, k)) for k in QUANT_FORMATS):
            for kind in kinds:
                mag_shape = (n, 1) if kind.startswith("per-row") else (n, off[-1])
                mag = 10 ** (torch.rand(mag_shape, generator=gen, device=dev) * (numpy.log10(50) + 2) - 2)
                z = (torch.randn(n, off[-1], generator=gen, device=dev) * mag).clamp(-190, 190)
                row = {"check": "quant", "format": label, "plan": fmt, "shape": f"{n} rows, {name}", "data": kind}

                def body(row, fmt=fmt, z=z, off=off):
                    f = parse_latent_format(fmt)
                    want, got = quantize_latent_ref(z, off, fmt), lq.quantize_latent_triton(z, off, fmt)
                    row["quantize_bytes_differing"] = int((want != got).sum())
                    row["dequantize_equal"] = same(dequantize_latent_ref(want, off, fmt),
                                                   lq.dequantize_latent_triton(want, off, fmt))
                    rnd = torch.randint(0, 256, want.shape, generator=gen, device=dev, dtype=torch.uint8)
                    row["dequantize_random_rows_equal"] = same(dequantize_latent_ref(rnd, off, fmt),
                                                               lq.dequantize_latent_triton(rnd, off, fmt))
                    row["max_roundtrip_err_in_steps"] = float(
                        ((dequantize_latent_ref(want, off, fmt) - z).abs() / steps(want, off, fmt).clamp_min(1e-30))
                        .amax())
                    # blocks e4m3 cannot hold (what a GPU does not check; on the host the value check is lifted)
                    zb = z[:4].clone()
                    zb[0, :4] = torch.tensor([-300.0, 300.0, 1.0, 2.0])  # span 600 > 448
                    zb[1, 8:12] = -460.0  # min below -448
                    host = [] if dev.type == "cuda" else [(lf, "F8_MAX", float("inf")), (lq, "F8_MAX", float("inf"))]
                    with patched(*host), numpy.errstate(invalid="ignore"):
                        wb, gb = quantize_latent_ref(zb, off, fmt), lq.quantize_latent_triton(zb, off, fmt)
                        dw, dg = dequantize_latent_ref(wb, off, fmt), lq.dequantize_latent_triton(gb, off, fmt)
                    nc = sum(f.code_bytes(off))
                    nan_rows = dw.isnan().any(-1).tolist()
                    row["out_of_range_ok"] = bool(torch.equal(wb[:, nc:], gb[:, nc:]) and same(dw, dg)
                                                  and nan_rows == [True, True, False, False])
                    row["pass"] = (row["quantize_bytes_differing"] == 0 and row["dequantize_equal"]
                                   and row["dequantize_random_rows_equal"] and row["out_of_range_ok"])
                run_row(rows, row, body)
    return rows


def check_append(dev, tiny: bool) -> list[dict]:
    """latent_append_gpu.py's cases and pass rule for -f8 formats, through the CUDA kernel of ckvp::latent_append."""
    from ckvp_compile.kernels.latent_layout import to_layout
    from ckvp_compile.ops.latent_attention_cuda import latent_append_cuda

    append = torch.ops.ckvp.latent_append if dev.type == "cuda" else latent_append_cuda  # CPU: its kernel function
    g = torch.Generator(device=dev).manual_seed(0)
    hkv, s_max, lo, hi = (3, 64, 5, 40) if tiny else (16, 4096, 60, 111)  # as latent_append_gpu.py (--small)
    ranks = [int(r) for r in torch.randint(lo, hi, (hkv,), generator=torch.Generator().manual_seed(1))]
    firsts = {c[-1]: c for c in reversed(CASES)}.values()  # --tiny: the first case of each input kind, smaller
    cases = [(lb, b, min(s, 8), min(gd, 64), xdt, bk, min(pg, 8), fl) for lb, b, s, gd, xdt, bk, pg, fl in firsts] \
        if tiny else CASES
    off, r_max = _offsets(ranks), max(ranks)
    paths: list = []
    wrap = lambda name, fn: lambda *a: paths.append(name) or fn(*a)  # noqa: E731
    rows = []
    with patched((lq, "latent_append_triton", wrap("fused", lq.latent_append_triton)),
                 (lq, "quantize_latent_triton", wrap("triton quantizer", lq.quantize_latent_triton))):
        for label, b, s, gd, xdt, bkind, page, flag in cases:
            lead = (b,) if bkind == "online" else ()
            basis = torch.linalg.qr(torch.randn(*lead, hkv, gd, r_max, device=dev, generator=g)).Q
            for h, r in enumerate(ranks):
                basis[..., h, :, r:] = 0.0
            basis = basis.to({"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "fp32": torch.float32}.get(
                bkind, torch.bfloat16))
            x = (torch.randn(b, hkv, s, gd, device=dev, generator=g) * 8).to(xdt)  # latents of std 8 (|z| < 192)
            slots = torch.randperm(s_max, device=dev, generator=g)[:s]
            table = torch.randperm(b * s_max // page, device=dev, generator=g).int().reshape(b, -1) if page else None
            for fmt in ("int4/32-f8", "int8/32-f8", f8(_plan(ranks))):
                width = parse_latent_format(fmt).row_width(off)
                row = {"check": "append", "case": label, "batch": b, "tokens": s, "gd": gd, "x": str(xdt),
                       "basis": str(basis.dtype), "page": page, "kind_flag": flag,
                       "format": fmt if not fmt.startswith("mix") else "mix/32-f8 (8x r/4 + 4x rest)"}

                def body(row, fmt=fmt, width=width):
                    want = torch.full((b * s_max // page + 1, page, width) if page else (b, s_max, width), 7,
                                      dtype=torch.uint8, device=dev)
                    ref.latent_append_ref(want, x, basis, off, slots, fmt, table)
                    got = torch.full_like(want, 7)
                    got = to_layout(got, "unit-major") if flag == "APPEND_STRIDED_GPU_CHECKED" else got
                    paths.clear()
                    append(got, x, basis, off, slots, fmt, table)
                    row["path"] = "+".join(sorted(set(paths))) or "reference"
                    flat = lambda t: t.reshape(-1, width)  # noqa: E731
                    written = (flat(want) != 7).any(-1)
                    row["others_untouched"] = bool(torch.equal(flat(got)[~written], flat(want)[~written]))
                    rw, rg = flat(want)[written], flat(got)[written]
                    dw, dg = dequantize_latent_ref(rw, off, fmt), dequantize_latent_ref(rg, off, fmt)
                    row["bit_equal_fraction"] = float((dw == dg).float().mean())
                    step = torch.maximum(steps(rw, off, fmt), steps(rg, off, fmt)).clamp_min(1e-30)
                    row["max_diff_steps"] = float(((dg - dw).abs() / step).amax())
                    bb = basis.double() if basis.dim() == 4 else basis.double()[None].expand(b, *basis.shape)
                    y = torch.einsum("bhsg,bhgr->bhsr", x.double(), bb)
                    y = torch.cat([y[:, h, :, :r] for h, r in enumerate(ranks)], -1).reshape(b * s, off[-1])
                    y = y[_written_order(want, table, slots, b, s, page, width)]
                    row["rms_err_ref"] = (dw.double() - y).pow(2).mean().sqrt().item()
                    row["rms_err_op"] = (dg.double() - y).pow(2).mean().sqrt().item()
                    row["pass"] = (row["path"] != "reference" and row["others_untouched"]
                                   and row["bit_equal_fraction"] >= 0.99 and row["max_diff_steps"] <= 1.0 + 1e-3
                                   and row["rms_err_op"] <= row["rms_err_ref"] * 1.01 + 1e-9)
                run_row(rows, row, body)
    return rows


def _passes() -> str:
    """Which decode kernels the last launch ran (``_LAST_LAUNCH``)."""
    ll = lat._LAST_LAUNCH
    if not ll:
        return "reference (no Triton launch)"
    fast = [k for k in ("mma_kernel", "words_kernel", "lanes_kernel", "absorbed_kernel", "chunks") if k in ll]
    name = fast[0] if fast else "one-pass per-head" if "scores" not in ll else "two-pass, " + (
        f"grouped key pass ({ll['head_group']} heads)" if ll.get("head_group") else "per-head")
    return name + ("" if "reduce" in ll else ", fused merge")


def _mix_attn(rank: int, hkv: int) -> str:
    """A mix/32-f8 plan the decode kernels read (pieces on block boundaries, one per width): 8/4 and 4/2 bits."""
    heads = [((8, 4) if h % 2 == 0 else (4, 2)) for h in range(hkv)]
    return "mix/32-f8:" + ",".join(f"{a}x{rank // 2}+{b}x{rank - rank // 2}" if rank % 64 == 0 else f"{a}x{rank}"
                                   for a, b in heads)


def check_attention(dev, tiny: bool, deadline: float) -> list[dict]:
    from ckvp_compile.ops.latent_attention_cuda import latent_attention_cuda

    op = torch.ops.ckvp.latent_attention if dev.type == "cuda" else latent_attention_cuda
    heads, d = ((8, 2), 32) if tiny else (HEADS, HEAD_DIM)
    (b1, b8), (t4, t32), page = ((1, 2), (48, 64), 16) if tiny else ((1, 8), (4096, 32768), 64)
    grid = [(64, b, t, 0) for b in (b1, b8) for t in (t4, t32) if not tiny or b * t in (b1 * t4, b8 * t32)]
    grid += [(32, b8, t32, 0), (64, b8, t32, page), (64, b1, t4, page)]
    # the tests' bound for the fp16 key rebuild: at tiny shapes the bf16 outputs' rounding does not average out
    tol = 2e-3 if tiny else TOL
    rows = []
    for rank, b, t, pg in grid:
        for fmt in ("int4/32-f8", "int8/32-f8", _mix_attn(rank, heads[1])):
            row = {"check": "attention", "format": fmt if "mix" not in fmt else "mix/32-f8 (8/4, 4/2 per head)",
                   "rank": rank, "batch": b, "context": t, "page": pg, "tol": tol}

            def body(row, fmt=fmt, rank=rank, b=b, t=t, pg=pg):
                if time.time() > deadline:
                    raise TimeoutError("skipped (time budget)")
                mk = lambda fm: make_inputs(b, t, fm, rank, seed=b * 7 + t, dev=str(dev), heads=heads,  # noqa: E731
                                            head_dim=d, group=4)
                args = mk(fmt)
                want = ref_chunked(args, 4)
                args, table = paged_latents(args, pg) if pg else (args, None)
                lat._LAST_LAUNCH.clear()
                out = lat.latent_attention_triton(*args, page_table=table)
                row["kernel_passes"], row["key_fp16"] = _passes(), lat._LAST_LAUNCH.get("key_fp16")
                row["rel_err"] = rel_err(out, want)
                lat._LAST_LAUNCH.clear()
                op_out = op(*args, page_table=table)
                row["op_ran_triton"] = bool(lat._LAST_LAUNCH)
                row["op_rel_err"] = rel_err(op_out, want)
                row["pass"] = row["rel_err"] <= tol and row["op_rel_err"] <= tol and row["op_ran_triton"]
                del want, out, op_out
                if dev.type == "cuda":  # informative: vs the same shapes with fp16 block metadata
                    a16 = mk(fmt.replace("-f8", ""))
                    a16, t16 = paged_latents(a16, pg) if pg else (a16, None)
                    row["ms_f8"] = event_ms(lambda: lat.latent_attention_triton(*args, page_table=table))
                    row["ms_fp16_meta"] = event_ms(lambda: lat.latent_attention_triton(*a16, page_table=t16))
                    row["ratio_f8_over_fp16"] = row["ms_f8"] / row["ms_fp16_meta"]
                    lat._LAST_LAUNCH.clear()
                    lat.latent_attention_triton(*a16, page_table=t16)
                    row["fp16_meta_passes"] = _passes()

            run_row(rows, row, body)
            torch.cuda.empty_cache() if dev.type == "cuda" else None
    return rows


def check_template(dev) -> list[dict]:
    """Inductor's key-pass template on -f8 keys (op graph of latent_attention_lowering_gpu.py)."""
    if dev.type != "cuda":
        return [{"check": "template", "case": "all", "pass": None, "error": "skipped: the template is CUDA only"}]
    from torch._inductor.utils import run_and_get_code

    from ckvp_compile.lowering import register_all as register_lowerings
    from latent_attention_lowering_gpu import _template_kernels

    register_lowerings()
    b, t, fmt, rank = 8, 4096, "int4/32-f8", 256  # rank > 128: the template, not the one-pass kernel, by default
    args = make_inputs(b, t, fmt, rank, seed=3, dev=str(dev), heads=HEADS, head_dim=HEAD_DIM, group=4)
    want = ref_chunked(args, 4)
    (q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, _, sc, kv, kf, vf) = args

    def f(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl):
        return torch.ops.ckvp.latent_attention(q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, None, sc,
                                               kv, kf, vf)

    rows = []
    for case, mode, flag in (("default, flag on", None, True), ("default, flag off (control)", None, False),
                             ("max-autotune, flag on", "max-autotune-no-cudagraphs", True)):
        row = {"check": "template", "case": case, "format": fmt, "rank": rank, "batch": b, "context": t}

        def body(row, mode=mode, flag=flag):
            # no compile cache: the lowering reads the flag, which no cache key holds
            with patched((lowering, "F8_META_TEMPLATE_GPU_CHECKED", flag)), \
                    torch._inductor.config.patch(force_disable_caches=True):
                torch._dynamo.reset()
                comp = torch.compile(f, backend="inductor", mode=mode, fullgraph=True)
                out, codes = run_and_get_code(lambda: comp(q, lk, lv, bk, bv, cos, sin, sp, nk, nv, sl))
            code = "\n".join(codes)
            row.update(template_kernels=_template_kernels(code), rel_err=rel_err(out, want),
                       extern_in_code=lowering.EXTERN_NAME in code)
            # by default the template must run exactly when the flag is on; autotuned, whatever won must be right
            row["pass"] = row["rel_err"] <= TOL and (mode is not None or bool(row["template_kernels"]) == flag)
        run_row(rows, row, body)
    torch._dynamo.reset()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1: a dry run)")
    ap.add_argument("--checks", default="quant,append,attention,template")
    ap.add_argument("--budget-s", type=float, default=540.0, help="attention rows after this are skipped (FAIL)")
    a = ap.parse_args(argv)
    t0 = time.time()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not (a.tiny and os.environ.get("TRITON_INTERPRET") == "1"):
        ap.error("on CPU run with --tiny under TRITON_INTERPRET=1")
    from ckvp_compile.ops import register_all

    register_all()
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []
    runs = {"quant": lambda: check_quant(dev, a.tiny, gen), "append": lambda: check_append(dev, a.tiny),
            "attention": lambda: check_attention(dev, a.tiny, t0 + a.budget_s), "template": lambda: check_template(dev)}
    seconds = {}
    with patched((lq, "F8_GPU_CHECKED", True), (lat, "F8_META_GPU_CHECKED", True),
                 (lowering, "F8_META_TEMPLATE_GPU_CHECKED", True)):
        for name in a.checks.split(","):
            t1 = time.time()
            rows += runs[name]() if time.time() < t0 + a.budget_s else [
                {"check": name, "pass": False, "error": "skipped (time budget)"}]
            seconds[name] = round(time.time() - t1, 1)

    def verdict(*kinds):  # False: a row failed; None: not all run (skipped, or a check not asked for)
        sel = [r for r in rows if r["check"] in kinds]
        skipped = [r["pass"] is None or str(r.get("error", "")).startswith("skipped") for r in sel]
        if any(r["pass"] is False and not sk for r, sk in zip(sel, skipped)):
            return False
        return None if any(skipped) or {r["check"] for r in sel} != set(kinds) else True

    decide = {"latent_quant_triton.F8_GPU_CHECKED": verdict("quant", "append"),
              "latent_attention_triton.F8_META_GPU_CHECKED": verdict("attention"),
              "lowering.latent_attention.F8_META_TEMPLATE_GPU_CHECKED": verdict("attention", "template")}
    ok = all(r["pass"] is not False for r in rows)
    env = dict(run_env(t0, argv=None if argv is None else [sys.argv[0], *argv]), seconds_per_check=seconds,
               device="cpu (TRITON_INTERPRET=1, --tiny)" if dev.type == "cpu" else torch.cuda.get_device_name())
    md = [f"# -f8 latent formats: Triton vs reference ({env['device']})", "", f"    {env['command']}", "",
          f"torch {env['torch']}, triton {env['triton']}, {env['wall_s']} s ({seconds}). All correctness checks pass: "
          f"**{ok}**.", "", "| flag | verdict |", "|---|---|"]
    md += [f"| {k} | {'set True' if v else 'keep False' if v is False else 'not decided (not run)'} |"
           for k, v in decide.items()]
    cols = {"quant": ("format", "shape", "data", "quantize_bytes_differing", "dequantize_equal",
                      "dequantize_random_rows_equal", "out_of_range_ok", "max_roundtrip_err_in_steps"),
            "append": ("case", "format", "batch", "tokens", "basis", "path", "bit_equal_fraction", "max_diff_steps",
                       "rms_err_ref", "rms_err_op"),
            "attention": ("format", "rank", "batch", "context", "page", "kernel_passes", "key_fp16", "rel_err",
                          "op_rel_err", "ms_f8", "ms_fp16_meta", "ratio_f8_over_fp16", "fp16_meta_passes"),
            "template": ("case", "template_kernels", "extern_in_code", "rel_err")}
    for kind, keys in cols.items():
        sel = [r for r in rows if r["check"] == kind]
        worst = {k: max((r[k] for r in sel if isinstance(r.get(k), float)), default=None) for k in
                 ("max_roundtrip_err_in_steps", "max_diff_steps", "rel_err", "op_rel_err")}
        cell = lambda v: f"{v:.3g}" if isinstance(v, float) else "-" if v is None else str(v)  # noqa: E731
        md += ["", f"## {kind}: {sum(r['pass'] is True for r in sel)}/{len(sel)} PASS" + "".join(
            f"; max {k} {v:.3g}" for k, v in worst.items() if v is not None), "", "| " + " | ".join(keys) + " | result |",
               "|" + "---|" * (len(keys) + 1)] * bool(sel)
        md += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " | " + {True: "PASS", False: "FAIL", None: "SKIP"}[
            r["pass"]] + (f": {r['error']}" if r.get("error") else "") + " |" for r in sel]
    write_result({"env": env, "flags": decide, "all_pass": ok, "rows": rows}, "\n".join(md) + "\n", a.json, a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
