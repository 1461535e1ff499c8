"""The MMA pass (ckvp_compile/kernels/latent_attention_mma.py) on the GPU: numerics against the reference, then
whole-call timings against the word pass and dense SDPA.

``--check``: random cases through ``latent_attention_triton`` with ``DecodeConfig(mma=True)`` (GQA 2, 4, 8; 1-8 KV
heads; lengths that are and are not whole tiles; exact tokens at random slots; 1-2 query tokens; paged latents with
scattered and unmapped pages; padded rows; bf16 / fp16 / fp32 queries; tiny value scales; large queries; fixed and
default splits; 64- and 128-slot tiles), each against ``latent_attention_ref`` (fp32) and required to have run the
MMA kernel; then batch 8 at 32k and 128k (Mixtral-8x7B's 32:8 heads, int4/32 rank 32, post-RoPE keys) against the
chunked reference. ``--formats int8/32,int4/32``: both formats (8-bit cases unit-major, the pass's only layout for
them). Unit-major cases draw the kernel's cp.async ring (``stages_m`` 0, 2, 4), and :func:`stages_identity` requires
the ring's outputs to equal the register path's bit for bit. Exit 1 if any relative error exceeds 1e-3 or an output
differs.

``--sweep``: CUDA-graph replay of one whole call (query fold, MMA pass, merge) per (batch, context, tile, program
target), with the default config (the word pass) and dense SDPA in the same run; JSON rows to ``--out``. A layout
``unit-major@64`` puts the latents in a pool of 64-slot pages (``bench.attention.paged_latents``); ``--stages 0,2,4``
sweeps the unit-major kernel's cp.async ring.

``--variants base,pscan,vpair+pscan``: the unit-major kernel's switches (``VPAIR``, ``PSCAN`` of
latent_attention_mma, ``pdl``: latent_attention_triton's programmatic dependent launch, ``fmerge``: its merge in fp32
multiply-adds; through their environment variables): the check draws one per random case, the sweep times each;
``--check-variants`` runs sets on int8 cases with an unmapped page below the context (:func:`variants_check`). ``MMA_CASES=N``: random check cases (80);
``MMA_LARGE=0``: skip the check's large cases (switches off there) and the ring's identity check.

Usage (device tool, repository root): ``PYTHONPATH=. python3 benchmarks/mma_attention_gpu.py --check --sweep --out
$OUT/mma``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

TOL = 1e-3

#: The unit-major kernel's switches (ckvp_compile/kernels/latent_attention_mma.py), by the names ``--variants`` takes
#: (joined by ``+``; ``base``: all off): 8-bit value pairs from one word, the page scan, programmatic dependent
#: launch of fold -> pass -> merge (latent_attention_triton.PDL_GPU_CHECKED), the merge in fp32 multiply-adds one warp
#: a query head (latent_attention_triton.FMA_MERGE_GPU_CHECKED), the unit-major pass's own query fold and split merge
#: (latent_attention_mma.FOLD_GPU_CHECKED, MERGE_GPU_CHECKED; the merge in the pass replaces fmerge's launch).
VARIANT_ENV = {"vpair": "CKVP_MMA_VPAIR", "pscan": "CKVP_MMA_PAGE_SCAN", "pdl": "CKVP_PDL", "fmerge": "CKVP_FMA_MERGE",
               "fold": "CKVP_MMA_FOLD", "merge": "CKVP_MMA_MERGE", "pdlfold": "CKVP_PDL_FOLD", "imma": "CKVP_MMA_IMMA",
               "fpair": "CKVP_MMA_FIELD_PAIRS", "vimma": "CKVP_MMA_VIMMA"}


#: The latent loads' cache hint (``CKVP_MMA_HINT``, latent_attention_mma.load_hint), by variant part.
HINT_VALUES = {"evict": "1", "cg": "2"}
#: The first tile prefetched into L2 before the query (``CKVP_MMA_EARLY``, latent_attention_mma.early_tile): ``pre``;
#: without it 0.
EARLY_VALUES = {"pre": "1"}


def set_variant(name: str) -> None:
    """Set the environment the launcher reads on every call for variant ``name`` (e.g. ``vpair+pscan``; a load
    hint part sets ``CKVP_MMA_HINT``, ``pre`` sets ``CKVP_MMA_EARLY``; none of a kind sets it to 0). Raises
    ValueError for an unknown part."""
    on = set(name.split("+")) - {"base"}
    os.environ["CKVP_MMA_HINT"] = next((HINT_VALUES[p] for p in on if p in HINT_VALUES), "0")
    os.environ["CKVP_MMA_EARLY"] = next((EARLY_VALUES[p] for p in on if p in EARLY_VALUES), "0")
    on -= set(HINT_VALUES) | set(EARLY_VALUES)
    unknown = on - set(VARIANT_ENV)
    if unknown:
        raise ValueError(f"unknown variant parts {sorted(unknown)}; known: {sorted(VARIANT_ENV)}, one of "
                         f"{sorted(HINT_VALUES)}, {sorted(EARLY_VALUES)}, or base")
    for part, env in VARIANT_ENV.items():
        os.environ[env] = "1" if part in on else "0"


def variants_check(variants: list[str]) -> list[dict]:
    """Each variant against the fp32 reference on int8/32 unit-major latents (GQA 2, 4, 8; a static cache, and 64-
    and 128-slot pages with a page below the context unmapped, which the reference reads as zero rows, through the
    register path and the cp.async ring (``stages_m`` 0 and 2); splits of 1, 3 and many tiles; the new token exact,
    as ``make_inputs`` makes it), fp32 queries: relative error <= 1e-3, and the MMA kernel ran. A variant with
    ``pdl`` is also captured in a CUDA graph and replayed three times: each replay must equal the eager output bit
    for bit (programmatic launches in a graph keep their order)."""
    from ckvp_compile.bench.attention import make_inputs, paged_latents, ref_chunked, rel_err
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, latent_attention_triton
    from ckvp_compile.kernels.latent_layout import to_layout

    rows = []
    # (heads, context, page, split, batch): batch 20 x 8 KV heads = 160 rows, past the SM count: the merge's output
    # is not split over D there
    for heads, t, page, split, batch in (((32, 8), 8192, 64, None, 2), ((16, 8), 4224, 128, 3, 2),
                                         ((64, 8), 1024, 64, 1, 2), ((32, 8), 8192, 0, None, 2),
                                         ((16, 8), 640, 0, 1, 2), ((64, 8), 2048, 64, 64, 2),
                                         ((32, 8), 1024, 64, None, 20)):
        args = make_inputs(batch, t, "int8/32", 32, seed=13, heads=heads, rope="none")
        args = (args[0].float(),) + tuple(args[1:])
        kw, hole = {}, None
        if page:
            hole = (t // page) // 2  # sequence 1's middle page: unmapped, read as zero rows
            lk, lv = args[1].clone(), args[2].clone()
            lk[1, hole * page:(hole + 1) * page] = 0
            lv[1, hole * page:(hole + 1) * page] = 0
            want = ref_chunked((args[0], lk, lv) + tuple(args[3:]), 2)
            pargs, table = paged_latents(args, page, "unit-major")
            table = table.clone()
            table[1, hole] = -1
            kw["page_table"] = table
        else:
            want = ref_chunked(args, 2)
            pargs = (args[0], to_layout(args[1], "unit-major"), to_layout(args[2], "unit-major")) + tuple(args[3:])
        for v, stages in [(v_, s_) for v_ in variants for s_ in ((0, 2) if page else (0,))]:
            set_variant(v)
            cfg = DecodeConfig(mma=True, split=split, stages_m=stages)
            lat._LAST_LAUNCH.clear()
            out = latent_attention_triton(*pargs, config=cfg, **kw)
            parts = set(v.split("+"))
            r = dict(variant=v, stages=stages, batch=batch, heads=list(heads), t=t, page=page, hole=hole, split=split,
                     ran_mma=bool(lat._LAST_LAUNCH.get("mma")), pdl=bool(lat._LAST_LAUNCH.get("pdl")),
                     fma_merge=bool(lat._LAST_LAUNCH.get("fma_merge")),
                     mma_fold=bool(lat._LAST_LAUNCH.get("mma_fold")), mma_merge=bool(lat._LAST_LAUNCH.get("mma_merge")),
                     mma_imma=bool(lat._LAST_LAUNCH.get("mma_imma")),
                     rel_err=rel_err(out, want), finite=bool(torch.isfinite(out).all()))
            in_pass = bool(parts & {"fold", "merge"})
            r["ok"] = (r["ran_mma"] and r["finite"] and r["rel_err"] <= TOL
                       and r["pdl"] == ("pdl" in parts and not in_pass)
                       and r["fma_merge"] == ("fmerge" in parts and "merge" not in parts)
                       and r["mma_fold"] == ("fold" in parts) and r["mma_merge"] == ("merge" in parts)
                       and r["mma_imma"] == ("imma" in parts and "fold" not in parts))
            if parts & {"pdl", "merge"}:  # captured and replayed: the same bits as the eager call
                graph, s_ = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                s_.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s_):
                    latent_attention_triton(*pargs, config=cfg, **kw)  # (warm-up outside the capture)
                torch.cuda.current_stream().wait_stream(s_)
                with torch.cuda.graph(graph):
                    g_out = latent_attention_triton(*pargs, config=cfg, **kw)
                same = []
                for _ in range(3):
                    g_out.fill_(float("nan"))
                    graph.replay()
                    torch.cuda.synchronize()
                    same.append(bool(torch.equal(g_out, out)))
                r["graph_replays_equal"] = same
                r["ok"] = r["ok"] and all(same)
                del graph, g_out
            rows.append(r)
            print(("ok  " if r["ok"] else "BAD ") + "variant " + json.dumps(r), flush=True)
        del args, pargs, want
        torch.cuda.empty_cache()
    set_variant("base")
    return rows


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def check_cases(n: int, seed: int = 0, formats: tuple[str, ...] = ("int4/32",)) -> list[dict]:
    """Random small cases (the keys of tests/kernels/test_latent_attention_triton.py's ``_inputs``); 8-bit formats
    only in unit-major latents (the only layout the pass reads them in)."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        hkv = rng.choice((1, 2, 3, 8))
        kv_len = rng.choice((1, 5, 63, 64, 65, 127, 128, 129, 300, 1000, 2049, 4096, 5000))
        page = rng.choice((0, 0, 64, 128, 256))
        ratio = rng.choice((2, 4, 8))
        block_n = 64 if ratio == 8 else rng.choice((64, 128))  # (G = 8 takes 64-slot tiles only)
        if page and page % block_n:
            page = 256
        extra = rng.choice((0, 0, 3, 64, 200))
        if not page and kv_len + extra < block_n:
            extra = block_n - kv_len + rng.choice((0, 5))
        fmt = rng.choice(formats) if len(formats) > 1 else formats[0]  # (one format: the earlier runs' draws)
        layout = rng.choice(("row-major", "padded", "unit-major", "unit-major"))
        if fmt.startswith("int8"):
            layout = "unit-major"
        if layout == "unit-major" and not page:  # byte columns of a multiple of 64 slots
            extra += -(kv_len + extra) % 64
        cases.append(dict(
            seed=1000 * seed + i, b=rng.choice((1, 2, 3)), hkv=hkv, ratio=ratio,
            d=rng.choice((64, 128)), kv_len=kv_len, s=rng.choice((1, 1, 1, 2)), extra=extra, rk=[32] * hkv,
            rv=[32] * hkv, kfmt=fmt, vfmt=fmt, rope="none", rd=0, mask=None, mask_shape="bhsk",
            mask_p=0.0, dtype=rng.choice((torch.bfloat16, torch.bfloat16, torch.float16, torch.float32)),
            pos_dtype=torch.int32, win=rng.choice((0, 0, 3, 17)), unused=rng.choice((0, 0, 1)), page=page,
            layout=layout, q_scale=rng.choice((1.0, 1.0, 30.0)),
            v_size=rng.choice((1.0, 1.0, 1e-3)), block_n=block_n,
            split=rng.choice((None, None, 1, 3, 7)), programs=rng.choice((1536, 64)), maxnreg=rng.choice((None, None, 128)),
            stages=rng.choice((0, 2, 4)) if layout == "unit-major" else 0,
            split_d=rng.choice((None, None, True, False))))
    return cases


def stages_identity() -> list[dict]:
    """The unit-major kernel's cp.async ring (``stages_m`` 2, 4) must give bit-identical outputs to its register
    path (0): the same words reach the same arithmetic. Over int4 / int8, G = 2, 4, 8, a static cache and 64-slot
    pages with one page below the context unmapped (-1: that tile zeroed in both), and splits of 1, 2, 3 and many
    tiles (``split`` fixes the split count; 1: every tile in one program)."""
    from ckvp_compile.bench.attention import make_inputs, paged_latents
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, latent_attention_triton
    from ckvp_compile.kernels.latent_layout import to_layout

    rows = []
    for fmt, heads, t, page, split in (("int8/32", (32, 8), 8192, 64, None), ("int8/32", (32, 8), 8192, 0, 3),
                                       ("int4/32", (16, 8), 4096, 64, 2), ("int4/32", (64, 8), 4096, 0, None),
                                       ("int8/32", (16, 8), 640, 64, 1), ("int8/32", (64, 8), 192, 64, 64),
                                       ("int4/32", (32, 8), 1088, 0, 5)):
        args = make_inputs(2, t, fmt, 32, seed=11, heads=heads, rope="none")
        kw = {}
        if page:
            args, table = paged_latents(args, page, "unit-major")
            table = table.clone()
            table[1, table.shape[1] // 2] = -1  # an unmapped page below the context
            kw["page_table"] = table
        else:
            args = (args[0], to_layout(args[1], "unit-major"), to_layout(args[2], "unit-major")) + tuple(args[3:])
        outs = {}
        for stages in (0, 2, 4):
            lat._LAST_LAUNCH.clear()
            outs[stages] = latent_attention_triton(*args, config=DecodeConfig(mma=True, split=split, stages_m=stages),
                                                   **kw)
            assert lat._LAST_LAUNCH.get("mma"), (fmt, heads, t, page, split)
        r = dict(format=fmt, heads=list(heads), t=t, page=page, split=split, n_split=lat._LAST_LAUNCH.get("n_split"),
                 identical=all(torch.equal(outs[0], outs[k]) for k in (2, 4)),
                 finite=bool(torch.isfinite(outs[0]).all()))
        rows.append(r)
        print(("ok  " if r["identical"] else "BAD ") + "stages " + json.dumps(r), flush=True)
    return rows


def run_check(out_dir: str | None, formats: tuple[str, ...] = ("int4/32",),
              variants: tuple[str, ...] = ("base",), check_variants: tuple[str, ...] = ()) -> bool:
    from test_latent_attention_triton import _expected, _inputs, _paged

    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, latent_attention_triton
    from ckvp_compile.kernels.latent_layout import padded_units, to_layout

    def laid_out(t, layout):
        if layout != "padded":
            return to_layout(t, layout)
        w = t.shape[-1]
        z = torch.zeros(*t.shape[:-1], padded_units(w, min_width=0) + 16, dtype=t.dtype, device=t.device)
        return z[..., :w].copy_(t)

    rows, ok = [], True
    vrng = random.Random(99)  # (its own draws: the cases stay those of earlier runs)
    for p in check_cases(int(os.environ.get("MMA_CASES", "80")), formats=formats):
        p["variant"] = vrng.choice(variants)
        set_variant(p["variant"])
        cfg = DecodeConfig(mma=True, block_n_m=p["block_n"], split=p["split"], programs_m=p["programs"],
                           maxnreg_m=p["maxnreg"], stages_m=p["stages"],
                           **({} if p["split_d"] is None else {"reduce_split_d": p["split_d"]}))
        args = _inputs(p)
        want = _expected(args).float()
        a = list(_cuda(args))
        kw = {}
        if p["page"]:
            lk, lv, table = _paged(p, args)
            a[1], a[2], kw["page_table"] = laid_out(lk, p["layout"]).cuda(), laid_out(lv, p["layout"]).cuda(), table.cuda()
        else:
            a[1], a[2] = laid_out(a[1], p["layout"]), laid_out(a[2], p["layout"])
        lat._LAST_LAUNCH.clear()
        out = latent_attention_triton(*a, config=cfg, **kw).float().cpu()
        ran = bool(lat._LAST_LAUNCH.get("mma"))
        n_split = lat._LAST_LAUNCH.get("n_split")
        fma_merge = bool(lat._LAST_LAUNCH.get("fma_merge"))  # (before the per-head call below resets it)
        err = float((out - want).norm() / want.norm().clamp_min(1e-6))
        finite = bool(torch.isfinite(out).all())
        # bf16 / fp16 outputs: the output's own rounding puts every kernel near or past 1e-3; there the pass must be
        # as close as the per-head kernels (within 10%) and within 4e-3, as tests/kernels' interpreter tests require
        other = latent_attention_triton(*a, config=DecodeConfig(num_warps=1, min_tiles=1, target_programs=8),
                                        **kw).float().cpu()
        err_other = float((other - want).norm() / want.norm().clamp_min(1e-6))
        good = ran and finite and (err <= TOL or (p["dtype"] != torch.float32 and err <= min(4e-3, 1.1 * err_other)))
        ok &= good
        row = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in p.items()}
        row.update(rel_err=err, rel_err_per_head=err_other, ran_mma=ran, finite=finite, n_split=n_split,
                   fma_merge=fma_merge)
        rows.append(row)
        print(("ok  " if good else "BAD ") + json.dumps(row), flush=True)
    var_rows = variants_check(list(check_variants)) if check_variants else []
    ok &= all(r["ok"] for r in var_rows)
    big = []
    set_variant("base")  # (the large cases as in earlier runs; the variants get their own cases above)
    from ckvp_compile.bench.attention import make_inputs, ref_chunked, rel_err

    large = ((8, 32768), (8, 131072), (32, 32768)) if os.environ.get("MMA_LARGE", "1") == "1" else ()
    for (b, t), fmt in [(bt, f) for f in formats for bt in large]:
        args = make_inputs(b, t, fmt, 32, seed=7, heads=(32, 8), rope="none")
        args32 = (args[0].float(),) + args[1:]  # fp32 queries: fp32 outputs, no output rounding in the error
        want, want32 = ref_chunked(args, 2), ref_chunked(args32, 2)
        words = latent_attention_triton(*args, config=DecodeConfig(words=True, block_n_w=64))
        err_words = rel_err(words, want)
        del words
        from ckvp_compile.kernels.latent_layout import to_layout

        lays = ((64, "unit-major", 0), (64, "unit-major", 2))  # (stages: the unit-major kernel's cp.async ring)
        if not fmt.startswith("int8"):
            lays = ((64, "row-major", 0), (128, "row-major", 0)) + lays
        for bn, lay, stages in lays:
            cfg = DecodeConfig(mma=True, block_n_m=bn, stages_m=stages)
            a_, a32 = args, args32
            if lay != "row-major":
                lk, lv = to_layout(args[1], lay), to_layout(args[2], lay)
                a_, a32 = (args[0], lk, lv) + tuple(args[3:]), (args32[0], lk, lv) + tuple(args32[3:])
            lat._LAST_LAUNCH.clear()
            err32 = rel_err(latent_attention_triton(*a32, config=cfg), want32)
            ran = bool(lat._LAST_LAUNCH.get("mma"))
            err = rel_err(latent_attention_triton(*a_, config=cfg), want)
            del a_, a32
            good = ran and err32 <= TOL and err <= max(TOL, 1.1 * err_words)
            ok &= good
            r = dict(b=b, t=t, format=fmt, block_n=bn, layout=lay, stages=stages, rel_err_fp32_out=err32,
                     rel_err_bf16_out=err,
                     rel_err_words_bf16_out=err_words,
                     ran_mma=ran, n_split=lat._LAST_LAUNCH.get("n_split"))
            big.append(r)
            print(("ok  " if good else "BAD ") + json.dumps(r), flush=True)
        del args, args32, want, want32
        torch.cuda.empty_cache()
    set_variant("base")
    same = stages_identity() if large else []
    ok &= all(r["identical"] for r in same)
    if out_dir:
        with open(os.path.join(out_dir, "check.json"), "w") as f:
            json.dump(dict(ok=ok, tol=TOL, small=rows, large=big, stages_identity=same, variants=var_rows,
                           **_versions()), f, indent=1)
    print("check", "PASSED" if ok else "FAILED", flush=True)
    return ok


def _versions() -> dict:
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command=" ".join(sys.argv))


def run_sweep(out_dir: str | None, shapes: list[tuple[int, int]], block_ns: list[int], programs: list[int],
              maxnregs: list[int | None], layouts: list[str], split_d: list[bool | None] = (None,),
              merges: list[bool | None] = (None,), fmt: str = "int4/32", stages: list[int] = (0,),
              variants: list[str] = ("base",)) -> None:
    from ckvp_compile.bench.attention import (LAST_TIMING, copy_bandwidth, dense_times, graph_bench, kernel_bytes,
                                              kernel_times, make_inputs, paged_latents)
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, default_config, latent_attention_triton

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for b, t in shapes:
        args = make_inputs(b, t, fmt, 32, seed=3, heads=(32, 8), rope="none")
        q = args[0]
        k = torch.randn(b, 8, t, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        dense = dense_times(q, k, v)
        del k, v
        torch.cuda.empty_cache()
        dense_ms = min(x for key, x in dense.items() if key.endswith("_ms"))
        dense_bytes = 2 * b * 8 * t * 128 * 2
        configs = [("default", default_config(4, 32, table_free=True))]
        for bn in block_ns:
            for pr in programs:
                for mr, sg in [(mr, sg) for mr in maxnregs for sg in stages]:
                    for lay in layouts:
                        if lay.startswith("unit-major") and bn != 64:  # (64-slot tiles only)
                            continue
                        if sg and not lay.startswith("unit-major"):  # (the unit-major kernel's ring)
                            continue
                        for sd in split_d:  # None: the default (the launcher's choice for the MMA pass)
                            for one in merges:
                                configs.append((f"mma bn={bn} programs={pr} maxnreg={mr} stages={sg} split_d={sd} "
                                                f"one_pass={one} {lay}",
                                                DecodeConfig(mma=True, block_n_m=bn, programs_m=pr, maxnreg_m=mr,
                                                             stages_m=sg, one_pass_merge=one,
                                                             **({} if sd is None else {"reduce_split_d": sd}))))
        um_args = None
        if "unit-major" in layouts:  # ("<layout>@<P>": page pools of P slots, bench.attention.paged_latents)
            from ckvp_compile.kernels.latent_layout import to_layout

            um_args = (args[0], to_layout(args[1], "unit-major"), to_layout(args[2], "unit-major")) + tuple(args[3:])
        paged = {lay: paged_latents(args, int(lay.split("@")[1]), lay.split("@")[0]) for lay in layouts if "@" in lay}
        runs = [(n_, c_, v_) for n_, c_ in configs for v_ in (variants if n_ != "default" else ["base"])]
        for name, cfg, variant in runs:
            set_variant(variant)
            kw = {}
            args_c = um_args if name.endswith("unit-major") else args
            if "@" in name.split()[-1]:
                args_c, kw["page_table"] = paged[name.split()[-1]]
            try:
                lat._LAST_LAUNCH.clear()
                latent_attention_triton(*args_c, config=cfg, **kw)
                ran = {key: bool(lat._LAST_LAUNCH.get(key)) for key in ("mma", "words")}
                n_split = lat._LAST_LAUNCH.get("n_split")
                kern = lat._LAST_LAUNCH.get("mma_kernel") or lat._LAST_LAUNCH.get("words_kernel")
                regs = getattr(kern, "n_regs", None)
                ms = graph_bench(lambda: latent_attention_triton(*args_c, config=cfg, **kw))
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{b}x{t} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            nb = kernel_bytes(args, n_split, 32)  # (the static rows: a pool holds the same bytes)
            row = dict(b=b, t=t, format=fmt, config=name, variant=variant, ms=ms, timing=LAST_TIMING.get("how"),
                       n_split=n_split, regs=regs, **ran,
                       bytes_latent=nb["latent"], bytes_total=nb["total"],
                       copy_share=nb["total"] / (ms * 1e-3) / bw, dense_ms=dense_ms, dense=dense,
                       speedup=dense_ms / ms, byte_ratio=dense_bytes / nb["latent"])
            row["speedup_over_byte_ratio"] = row["speedup"] / row["byte_ratio"]
            try:  # device time of each launch of the call (query fold, pass, merge), torch.profiler
                row["kernel_us"] = kernel_times(lambda: latent_attention_triton(*args_c, config=cfg, **kw))
            except Exception as e:  # noqa: BLE001 - the profiler is optional here
                row["kernel_us"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "dense"}), flush=True)
        del args, um_args, paged
        torch.cuda.empty_cache()
    if out_dir:
        with open(os.path.join(out_dir, "sweep.json"), "w") as f:
            json.dump(dict(copy_Bps=bw, rows=rows, **_versions()), f, indent=1)


def run_profile(shape: tuple[int, int], layout: str, calls: int = 3, fmt: str = "int4/32", stages: int = 0) -> None:
    """``calls`` eager calls of the MMA config at one (batch, context), for Nsight Compute (``-k`` picks the kernel,
    ``--launch-skip`` the call): no CUDA graphs, no dense baseline."""
    from ckvp_compile.bench.attention import make_inputs
    from ckvp_compile.kernels import latent_attention_triton as lat
    from ckvp_compile.kernels.latent_attention_triton import DecodeConfig, latent_attention_triton
    from ckvp_compile.kernels.latent_layout import to_layout

    from ckvp_compile.bench.attention import paged_latents

    b, t = shape
    args = make_inputs(b, t, fmt, 32, seed=3, heads=(32, 8), rope="none")
    kw = {}
    if "@" in layout:
        args, kw["page_table"] = paged_latents(args, int(layout.split("@")[1]), layout.split("@")[0])
    elif layout != "row-major":
        args = (args[0], to_layout(args[1], layout), to_layout(args[2], layout)) + tuple(args[3:])
    cfg = DecodeConfig(mma=True, block_n_m=64, stages_m=stages)
    for _ in range(calls):
        latent_attention_triton(*args, config=cfg, **kw)
    torch.cuda.synchronize()
    print("profile", b, t, layout, {k: v for k, v in lat._LAST_LAUNCH.items() if isinstance(v, (int, bool, str))},
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="8:32768,8:131072,32:32768,32:131072")
    ap.add_argument("--block-ns", default="64,128")
    ap.add_argument("--programs", default="3072")
    ap.add_argument("--maxnregs", default="0", help="DecodeConfig.maxnreg_m values (0: None, the compiler's choice)")
    ap.add_argument("--layouts", default="row-major,unit-major",
                    help="latent layouts of the MMA rows; LAYOUT@P: page pools of P slots (sweep only)")
    ap.add_argument("--stages", default="0", help="DecodeConfig.stages_m values (unit-major layouts; 0: registers)")
    ap.add_argument("--split-d", default="-", help="DecodeConfig.reduce_split_d values (1 / 0 / -: the default)")
    ap.add_argument("--merges", default="-", help="DecodeConfig.one_pass_merge values (1 / 0 / -: the default)")
    ap.add_argument("--formats", default="int4/32,int8/32",
                    help="latent formats: --check draws from all, --sweep / --profile take the first (int8/32: "
                         "unit-major latents only)")
    ap.add_argument("--profile", default=None, metavar="B:T", help="three eager calls at one shape, for ncu")
    ap.add_argument("--variants", default="base",
                    help="comma-separated unit-major kernel switches, each a '+'-joined subset of "
                         f"{sorted(VARIANT_ENV)} (plus at most one load hint of {sorted(HINT_VALUES)}, and the first "
                         f"tile's L2 prefetch {sorted(EARLY_VALUES)}) or base: "
                         "--check draws one per random case; --sweep times each")
    ap.add_argument("--check-variants", default="",
                    help="comma-separated switch sets that --check also runs on int8 cases with an unmapped page "
                         "below the context, through the register path and the cp.async ring (pdl: CUDA-graph "
                         "replays too)")
    a = ap.parse_args()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    ok = True
    if a.check:
        ok = run_check(a.out, tuple(a.formats.split(",")), tuple(a.variants.split(",")),
                       tuple(v for v in a.check_variants.split(",") if v))
    if a.profile:
        run_profile(tuple(map(int, a.profile.split(":"))), a.layouts.split(",")[-1], fmt=a.formats.split(",")[0],
                    stages=int(a.stages.split(",")[0]))
    if a.sweep:
        run_sweep(a.out, [tuple(map(int, s.split(":"))) for s in a.shapes.split(",")],
                  [int(x) for x in a.block_ns.split(",")], [int(x) for x in a.programs.split(",")],
                  [int(x) or None for x in a.maxnregs.split(",")], a.layouts.split(","),
                  [None if x == "-" else bool(int(x)) for x in a.split_d.split(",")],
                  [None if x == "-" else bool(int(x)) for x in a.merges.split(",")], a.formats.split(",")[0],
                  [int(x) for x in a.stages.split(",")], a.variants.split(","))
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
