"""Time DecodeConfig variants of one fused latent decode attention call at real shapes, each checked against the
reference (H200 work between sessions: which knob moves a given layer shape).

    python3 benchmarks/config_sweep_gpu.py --out DIR --cases 32:8:8:32768:96,32:8:64:32768:96 \
        --configs 'default;default+{"block_n": 32};default+{"r_loop": true, "block_r": 32}' [--paired] \
        [--format int4/32]
    ncu ... python3 benchmarks/config_sweep_gpu.py --out DIR --cases 32:8:8:32768:96 --configs default --ncu

A case is heads:kv_heads:batch:context:rank[:u|:v|:p], the rank either one number (keys and values) or key/value
(e.g. ``64/128``: at the same bytes as 96/96, half the key rebuild), each of them one rank for every KV head or
ranks joined by ``_`` that the heads take in turn (``32_64``: unequal ranks within a layer, as calibrated plans
have), ``:u`` storing the latents unit-major (each byte
column of the rows contiguous over the slots: ``kernels.latent_layout``, as a store built with
``latent_layout="unit-major"`` holds them), ``:v`` the value latents alone so (``"row-major/unit-major"``), ``:p``
row-major rows padded as a store allocates them (``kernels.latent_layout.empty_latent``: 16-unit rows from 128
units on; without it the rows are packed, as before 2026-12-01's step-calls results);
head_dim 128; latents of
``ckvp_compile.bench.attention.make_inputs``. A config is ``default`` (the launcher's default for the case's group and
padded rank, with ``--paired`` as a compiled HF model declares its tables) or ``generic`` (``DecodeConfig()``),
optionally followed by ``+`` and a JSON object of DecodeConfig fields replaced over it. Each row: ms (median of
CUDA-graph replays, the device time a decode step under reduce-overhead sees; ``--launches``: median of
``do_bench`` over launches, which adds the launcher's host overhead), rel_err against ``latent_attention_ref``, and
the last launch's registers / spills. ``--rounds N`` times every config of a case N times, interleaved (round 1 of
all configs, then round 2, ...), so that drift and noise show as the spread between rounds. ``--ncu`` runs
each config twice without timing (profile the second launch). Writes DIR/config_sweep.json with the GPU, torch and
Triton versions and this command. ``python3 benchmarks/config_sweep_gpu.py --summarize DIR/config_sweep.json ...``
prints a markdown table of such files (median over rounds, ratios to each case's default), on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import latent_attention_gpu as lag  # noqa: E402

from ckvp_compile.bench.attention import make_inputs  # noqa: E402
from ckvp_compile.kernels import latent_attention_triton as lat_mod  # noqa: E402
from ckvp_compile.kernels.latent_format import parse_latent_format  # noqa: E402
from ckvp_compile.kernels.latent_layout import empty_latent, key_value_layouts, to_layout  # noqa: E402
from ckvp_compile.kernels.latent_attention_triton import (  # noqa: E402
    DecodeConfig,
    default_config,
    latent_attention_triton,
)


def parse_config(text: str, group: int, rank_pad: int, paired: bool, rank: int | None = None,
                 rank_v: int | None = None, table_free: bool = False, code_bits: int | None = None) -> DecodeConfig:
    """``default`` / ``generic`` [+ JSON of DecodeConfig fields] -> the DecodeConfig it names.

    Raises:
        KeyError: a name other than default / generic; json.JSONDecodeError: the part after ``+`` is not JSON;
        TypeError: a field DecodeConfig does not have.
    """
    name, _, extra = text.partition("+")
    base = {"default": lambda: default_config(group, rank_pad, paired=paired, rank=rank, rank_v=rank_v,
                                              table_free=table_free, code_bits=code_bits),
            "generic": lambda: dataclasses.replace(DecodeConfig(), paired_tables=paired)}[name.strip()]()
    return dataclasses.replace(base, **json.loads(extra)) if extra.strip() else base


def summarize(paths: list[str]) -> str:
    """A markdown table of config_sweep.json files: per case, each config's ms (median over rounds), its ratio to
    the case's 'default' row (below 1: faster; unit-major cases: to the row-major case's default when the file has
    it), rel_err, and registers (spilled registers) of the two-pass form's key pass and of the split kernel (the
    value pass, or the one pass); rows that failed show their error. No GPU needed."""
    lines = ["| case | config | ms | vs default | rounds (ms) | timing | rel err | regs (spilled): key pass / split "
             "kernel | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        with open(path) as fh:
            rows = json.load(fh)["rows"]
        groups: dict[tuple, list] = {}  # (case, config) -> its rows, one per round, in order
        for r in rows:
            case = f"{r['heads']} B{r['batch']} {r['context']} r{r['rank']}" + (
                f"/{r['rank_v']}" if r.get("rank_v", r["rank"]) != r["rank"] else "") + (
                f" {r['layout']}" if r.get("layout", "row-major") != "row-major" else "")
            groups.setdefault((case, r["config"]), []).append(r)
        med = {key: statistics.median(x["ms"] for x in rs if x.get("ms") is not None)
               for key, rs in groups.items() if any(x.get("ms") is not None for x in rs)}
        for (case, config), rs in groups.items():
            # unit-major rows against the row-major default of the same shape (the layout's effect), when present
            ms = med.get((case, config))
            b = med.get((re.sub(r" (row|unit)-major.*$", "", case), "default")) or med.get((case, "default"))
            ratio = f"{ms / b:.2f}" if ms and b else "-"
            errs = [x["rel_err"] for x in rs if x.get("rel_err") is not None]
            err = f"{max(errs):.1e}" if errs else "-"
            r = rs[-1]
            regs = f"{r.get('n_regs', '-')} ({r.get('n_spills', '-')})"
            if "scores_n_regs" in r:  # two-pass: the key pass (grouped or per head), then the value pass
                regs = f"{r['scores_n_regs']} ({r.get('scores_n_spills', '-')}) / " + regs
            over = bool(errs) and max(errs) > 1e-3
            note = (next((x["error"] for x in rs if x.get("error")), ""))[:80] + (" **over 1e-3**" if over else "")
            shown = f"{ms:.4g}" if ms is not None else "-"
            each = " / ".join(f"{x['ms']:.3g}" for x in rs if x.get("ms") is not None) if len(rs) > 1 else ""
            lines.append(f"| {case} | `{config}` | {shown} | {ratio} | {each} | {r.get('timing', 'launches')} | "
                         f"{err} | {regs} | {note} |")
    return "\n".join(lines)


def main() -> None:
    """Parse the command line, run every (case, config) and write DIR/config_sweep.json (see the module docstring);
    with ``--summarize FILE...``, print the markdown table of earlier runs instead (:func:`summarize`)."""
    if len(sys.argv) > 1 and sys.argv[1] == "--summarize":
        print(summarize(sys.argv[2:]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", required=True, help="comma-separated heads:kv_heads:batch:context:rank")
    ap.add_argument("--configs", default="default", help="';'-separated default|generic[+{JSON fields}]")
    ap.add_argument("--format", default="int4/32")
    ap.add_argument("--paired", action="store_true", help="tables declared paired (as in a compiled HF model)")
    ap.add_argument("--table-free", action="store_true",
                    help="calls without RoPE (post-RoPE key bases): rope form 'none', the default config's table_free")
    ap.add_argument("--ncu", action="store_true", help="two untimed launches per config, for Nsight Compute")
    ap.add_argument("--launches", action="store_true",
                    help="time launches (do_bench, host overhead included) instead of CUDA-graph replays")
    ap.add_argument("--rounds", type=int, default=1, help="time every config of a case this many times, interleaved")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "head_dim": lag.D, "format": a.format, "paired": a.paired, "table_free": a.table_free, "command": "python3 " + " ".join(sys.argv)}
    rows = []
    for case in a.cases.split(","):
        h, hkv, b, t, ranks, *flags = case.split(":")
        h, hkv, b, t = int(h), int(hkv), int(b), int(t)
        layout = {"u": "unit-major", "v": "row-major/unit-major", "p": "row-major padded"}.get(flags[0]) \
            if flags else "row-major"
        if flags not in ([], ["u"], ["v"], ["p"]):
            raise SystemExit(f"case {case!r}: the only flags after the rank are ':u' (unit-major latents), ':v' "
                             "(unit-major value latents, row-major keys) and ':p' (rows padded as a store pads them)")
        rank_text, _, rank_v_text = ranks.partition("/")
        k_list = [int(r) for r in rank_text.split("_")]  # 32_64: the KV heads' ranks in turn
        v_list = [int(r) for r in (rank_v_text or rank_text).split("_")]
        args = make_inputs(b, t, a.format, k_list, seed=11, heads=(h, hkv), head_dim=lag.D, group=lag.GROUP,
                           rank_v=v_list, rope="none" if a.table_free else "rotate_half")
        # the rows name a case's ranks as given (an int when the heads share one)
        rank = k_list[0] if len(k_list) == 1 else rank_text
        rank_v = v_list[0] if len(v_list) == 1 else (rank_v_text or rank_text)
        if layout == "row-major padded":  # the same rows, as the store allocates them (empty_latent)
            padded = []
            for lat in args[1:3]:
                x = empty_latent(lat.shape[:-1], lat.shape[-1], "row-major", lat.dtype, lat.device)
                x.copy_(lat)
                padded.append(x)
            args = (args[0], *padded, *args[3:])
        elif layout != "row-major":  # same values, each byte column contiguous over the slots (keys too, or not)
            k_layout, v_layout = key_value_layouts(layout)
            args = (args[0], to_layout(args[1], k_layout), to_layout(args[2], v_layout), *args[3:])
            # this run is the GPU check of strided latents: every row's rel_err against the reference
            lat_mod.STRIDED_LATENTS_GPU_CHECKED = True
        want = None if a.ncu else lag.ref_chunked(args, 2)
        rank_pad = max(16, 1 << (max(k_list) - 1).bit_length())
        for rnd, text in [(i, c) for i in range(max(1, a.rounds)) for c in a.configs.split(";")]:
            row = {"heads": f"{h}:{hkv}", "batch": b, "context": t, "rank": rank, "rank_v": rank_v, "config": text,
                   "round": rnd, "layout": layout}
            try:
                fmt = parse_latent_format(a.format)
                cfg = parse_config(text, h // hkv, rank_pad, a.paired, max(k_list), max(v_list), a.table_free,
                                   fmt.bits if fmt.quantized else None)  # as the launcher
                if a.ncu:  # two launches, the second one profiled
                    latent_attention_triton(*args, config=cfg)
                    latent_attention_triton(*args, config=cfg)
                    torch.cuda.synchronize()
                else:  # the error, median ms and kernel stats, as latent_attention_gpu.try_config measures them
                    row.update({k: v for k, v in lag.try_config(args, want, cfg, graph=not a.launches).items() if k != "config"})
            except Exception as e:  # noqa: BLE001 - reported, the others still run
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(a.out, "config_sweep.json"), "w") as fh:  # after every row: a cut run keeps them
                json.dump({"env": env, "rows": rows}, fh, indent=1)
        del args, want
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
