"""GPU check of the ckvp MoE Inductor lowering (ckvp_compile/lowering/moe.py): templates autotuned and emitted.

    python benchmarks/moe_lowering_gpu_check.py --out DIR [--budget-s 150]

1. A compiled HF Mixtral model (tiny, 1 layer, fp32 and bf16) with ``backend="ckvp"``,
   ``options={"enable_expert_gemm": True, "mode": "max-autotune-no-cudagraphs"}``: for each of the two GEMMs
   Inductor's output code must contain the ckvp grouped-GEMM template (its tile helper ``_ckvp_gate_up_tile`` /
   ``_ckvp_down_tile``) or, where an extern choice won the autotuning, its call (``*_extern`` or, bf16 only, the
   ``torch._grouped_mm`` choice ``*_grouped_mm``); logits against eager (fp32 <= 1e-3, bf16 <= 5e-2 rel).
2. One Mixtral-8x7B-shaped layer's experts (``ckvp::moe_experts``, bf16, batch 1 and 512) compiled with
   max-autotune: the autotuning must have timed the template configs, the extern and the ``torch._grouped_mm``
   choice (Inductor's feedback saver records every choice with its time) and the output must match the fp64
   loop (rel <= 1e-2). Each row records the winner of each GEMM (``winners``: the template config or the extern
   name; ``winner_kinds``: template / extern / grouped_mm) and the best time of each kind in us (``best_us``).

Writes DIR/check.json and DIR/check.md (GPU, versions, command, per check: pass/fail, kernels seen, the choices
timed with their times). Exit status 1 when a check fails. Expected runtime on an H200: about 1-2 minutes.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import torch

MARKERS = ("_ckvp_gate_up_tile", "_ckvp_down_tile")
EXTERNS = ("ckvp_moe_gate_up_extern", "ckvp_moe_down_extern")
GROUPED_MM = ("ckvp_moe_gate_up_grouped_mm", "ckvp_moe_down_grouped_mm")


def _kind(choice: str) -> str:
    """template / extern / grouped_mm, from a feedback timing key (a template's key is its config description)."""
    return "grouped_mm" if choice in GROUPED_MM else "extern" if choice in EXTERNS else "template"


def _feedback(store: list) -> None:
    """Record every autotuning Inductor does (choice name -> ms) through its feedback saver, when it has one."""
    try:
        from torch._inductor.select_algorithm import add_feedback_saver
    except ImportError:
        return

    def saver(timings, name, input_nodes, choices, profiled_time_fn=None, *args, **kwargs):
        store.append(dict(name=name, timings={str(getattr(c, "description", "") or c.name): float(t)
                                              for c, t in timings.items()}))

    add_feedback_saver(saver)


def check_model(dtype: torch.dtype) -> dict:
    from torch._inductor.utils import run_and_get_code

    from ckvp_compile.testing import build_hf_moe

    torch._dynamo.reset()
    model = build_hf_moe("mixtral", num_layers=1, hidden=128, num_heads=4, head_dim=32, num_experts=8, ffn=96,
                         dtype=dtype).cuda()
    ids = torch.randint(0, 256, (2, 9), device="cuda")
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits.float()
        compiled = torch.compile(model, backend="ckvp",
                                 options={"enable_expert_gemm": True, "mode": "max-autotune-no-cudagraphs"})
        out, codes = run_and_get_code(lambda: compiled(ids, use_cache=False).logits.float())
    code = "\n".join(codes)
    templates = [m for m in MARKERS if m in code]
    externs = [m for m in EXTERNS + GROUPED_MM if m in code]
    err = float((out - eager).norm() / eager.norm())
    bound = 1e-3 if dtype == torch.float32 else 5e-2
    # each GEMM is exactly one of: its template kernel, its extern call, its grouped_mm call
    per_gemm = [sum(m in code for m in (MARKERS[k], EXTERNS[k], GROUPED_MM[k])) for k in (0, 1)]
    ok = per_gemm == [1, 1] and err <= bound and "moe_align" in code
    return dict(check=f"hf_mixtral_{str(dtype).split('.')[-1]}", ok=ok, templates_in_code=templates,
                externs_in_code=externs, rel_err=err, bound=bound,
                launched=sorted(set(re.findall(r"(\w+)\.run\(", code))))


def check_mixtral_layer(batch: int, feedback: list) -> dict:
    from ckvp_compile.kernels.moe_reference import moe_experts_loop_ref

    torch._dynamo.reset()
    dm, i, e, a = 4096, 14336, 8, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(e, 2 * i, dm, device="cuda", generator=g) / dm ** 0.5).to(torch.bfloat16)
    down = (torch.randn(e, dm, i, device="cuda", generator=g) / i ** 0.5).to(torch.bfloat16)
    x = torch.randn(batch, dm, device="cuda", generator=g).to(torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(batch, e, device="cuda", generator=g), -1), a, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    before = len(feedback)
    fn = torch.compile(lambda h, k, wt: torch.ops.ckvp.moe_experts(h, k, wt, gate_up[:, :i], gate_up[:, i:], down),
                       mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
    t0 = time.perf_counter()
    out = fn(x, ids, w)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    ref = moe_experts_loop_ref(x, ids, w, gate_up[:, :i], gate_up[:, i:], down).double()
    err = float((out.double() - ref).norm() / ref.norm())
    tuned = [f for f in feedback[before:] if f["name"].startswith("ckvp_moe")]
    names = {f["name"] for f in tuned}
    timed = {c for f in tuned for c in f["timings"]}
    ok = err <= 1e-2 and (not feedback or ({"ckvp_moe_gate_up", "ckvp_moe_down"} <= names
                                           and set(EXTERNS + GROUPED_MM) <= timed))
    winners = {f["name"]: min(f["timings"], key=f["timings"].get) for f in tuned}
    best_us: dict = {}
    for f in tuned:
        for choice, ms in f["timings"].items():
            slot = best_us.setdefault(f["name"], {})
            slot[_kind(choice)] = round(min(slot.get(_kind(choice), float("inf")), ms * 1e3), 1)
    return dict(check=f"mixtral_layer_b{batch}", ok=ok, rel_err=err, compile_s=round(compile_s, 1),
                autotuned=tuned, winners=winners, winner_kinds={k: _kind(v) for k, v in winners.items()},
                best_us=best_us, feedback_saver=bool(feedback) or "none recorded")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=150.0, help="skip the remaining checks after this many s")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    import ckvp_compile
    from ckvp_compile.lowering import register_all

    register_all()
    versions = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    transformers=transformers.__version__, ckvp_compile=ckvp_compile.__version__,
                    python=platform.python_version(), cuda=torch.version.cuda)
    print(versions, flush=True)
    feedback: list = []
    _feedback(feedback)
    start = time.perf_counter()
    results = []
    checks = [lambda: check_model(torch.float32), lambda: check_model(torch.bfloat16),
              lambda: check_mixtral_layer(1, feedback), lambda: check_mixtral_layer(512, feedback)]
    for k, check in enumerate(checks):
        if time.perf_counter() - start > args.budget_s:
            results.append(dict(check=f"#{k}", ok=False, skipped="time budget spent"))
            continue
        try:
            results.append(check())
        except Exception as exc:  # noqa: BLE001 - report every check
            results.append(dict(check=f"#{k}", ok=False, error=f"{type(exc).__name__}: {exc}"[:500],
                                traceback=traceback.format_exc()[-3000:]))
        print(json.dumps(results[-1])[:2000], flush=True)
    command = "python " + " ".join(sys.argv)
    (args.out / "check.json").write_text(json.dumps(dict(versions=versions, command=command, results=results),
                                                    indent=1))
    lines = ["# ckvp MoE lowering: GPU check", "", f"Command: `{command}`  ", f"Versions: {versions}", "",
             "| check | ok | details |", "| --- | --- | --- |"]
    for r in results:
        details = {k: v for k, v in r.items() if k not in ("check", "ok", "autotuned", "traceback")}
        lines.append(f"| {r['check']} | {r['ok']} | {json.dumps(details)[:600]} |")
    (args.out / "check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
