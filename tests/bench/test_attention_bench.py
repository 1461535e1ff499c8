"""CPU smoke test of ``ckvp-bench attention`` (ckvp_compile/bench/attention.py).

The CLI runs end to end on tiny shapes in a child process under the Triton interpreter (``TRITON_INTERPRET=1``
must be set before ``triton`` is imported, which importing ``ckvp_compile`` does; see
ckvp_compile/testing/interpreter.py): every row's kernel output is within 1e-3 of the reference, its byte counts
are positive, and nothing is timed on CPU. In this process (no interpreter): the rows run the reference only and
say so; rows past the time budget or beyond the free memory are recorded as skipped; bad arguments are usage
errors (exit 2). Not marked slow: no Inductor compile (the whole file takes about 15 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckvp_compile.bench.cli import main

ROOT = Path(__file__).resolve().parents[2]
TIMING_KEYS = ("ms", "GBps", "copy_share", "dense_best_ms", "speedup", "sdpa_eager_ms", "sdpa_compiled_ms")


def test_cli_runs_the_kernel_under_the_interpreter_on_tiny_shapes(tmp_path):
    pytest.importorskip("triton")
    out_json, out_md = tmp_path / "attention.json", tmp_path / "attention.md"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "ckvp_compile.bench.cli", "attention", "--tiny", "--device", "cpu", "--batches",
           "1", "2", "--contexts", "72", "--formats", "int4/32:32", "float:24", "mxint4/32:16", "--json",
           str(out_json), "--out", str(out_md)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out_json.read_text())
    assert result["versions"]["triton_interpreter"] is True and result["copy_bandwidth_GBps"] == 0
    assert result["heads"] == "4:2" and result["head_dim"] == 32
    rows = result["rows"]
    assert [(r["batch"], r["context"], r["format"], r["rank"]) for r in rows] == [
        (b, 72, f, r) for b in (1, 2) for f, r in (("int4/32", 32), ("float", 24), ("mxint4/32", 16))]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["kernel"] == "triton interpreter" and r["timing"] == "none on CPU", r
        assert r["rel_err"] <= 1e-3, r
        assert 0 < r["bytes_latent"] < r["bytes_total"] and r["dense_bytes"] == 2 * r["batch"] * 2 * 72 * 32 * 2, r
        assert r["byte_ratio"] == pytest.approx(r["dense_bytes"] / r["bytes_latent"]) and r["n_split"] >= 1
        assert not any(k in r for k in TIMING_KEYS), r  # no timing on CPU
    int4 = next(r for r in rows if r["format"] == "int4/32" and r["batch"] == 2)
    fl = next(r for r in rows if r["format"] == "float" and r["batch"] == 2)
    assert int4["bytes_latent"] == 2 * 2 * 72 * (2 * 32 // 2 + 2 * 4)  # two heads of 16 code bytes + 1 block each
    assert fl["bytes_latent"] == 2 * 2 * 72 * 2 * 24 * 2  # bf16
    md = out_md.read_text()
    assert md.startswith("# ckvp-bench attention") and "ckvp-bench attention --tiny --device cpu" in md
    assert "| format | rank | B | T | rel err | ms |" in md and "| int4/32 | 32 | 2 | 72 |" in md
    assert md.count("triton interpreter; none on CPU") == 6 and "copy bandwidth not measured (CPU)" in md


def test_cli_post_rope_key_space_runs_the_absorbed_kernel_without_tables(tmp_path):
    """--key-space post_rope: calls without RoPE (no table or position bytes counted), the absorbed kernel for GQA
    int latents up to rank 32 (the default config's choice), within 1e-3 of the reference."""
    pytest.importorskip("triton")
    out_json, out_md = tmp_path / "attention.json", tmp_path / "attention.md"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "ckvp_compile.bench.cli", "attention", "--tiny", "--device", "cpu", "--batches",
           "2", "--contexts", "72", "--formats", "int4/32:16", "int8/32:24", "float:24", "--key-space", "post_rope",
           "--json", str(out_json), "--out", str(out_md)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out_json.read_text())
    assert result["key_space"] == "post_rope" and "post_rope key bases" in out_md.read_text()
    rows = {r["format"]: r for r in result["rows"]}
    for fmt, r in rows.items():
        assert "error" not in r and r["key_space"] == "post_rope" and r["rel_err"] <= 1e-3, r
        assert r["config"]["absorbed"] == 64, r  # the table-free GQA default (float latents then use the others)
    for fmt in ("int4/32", "int8/32"):  # the absorbed pass ran: one pass, no scores written
        assert rows[fmt]["absorbed_heads"] > 0 and rows[fmt]["two_pass"] is False, rows[fmt]
    assert rows["float"].get("absorbed_heads", 0) == 0  # float latents: the other kernels
    # bytes: latent rows + bases + q / new tokens / output + the split workspaces; no table or position bytes
    r = rows["int4/32"]
    q_bytes = 2 * 4 * 32 * 2
    basis = 2 * 2 * 32 * 16 * 2
    ws = 2 * 2 * 2 * r["n_split"] * 2 * (16 + 2) * 4
    assert r["bytes_total"] == r["bytes_latent"] + basis + 2 * q_bytes + 2 * (2 * 2 * 32 * 2) + ws, r


def test_cli_page_size_runs_paged_unit_major_latents(tmp_path):
    """--page-size 8 --latent-layout unit-major: the latents in unit-major page pools at a random page order (as
    CKVPStaticCache(page_size=8, latent_layout="unit-major") holds them) give the static unit-major row's error
    exactly (the same kernel output), within the bf16 output's rounding of the reference; the report names the
    pages."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    results = {}
    for page in (0, 8):
        out_json, out_md = tmp_path / f"attention{page}.json", tmp_path / f"attention{page}.md"
        cmd = [sys.executable, "-m", "ckvp_compile.bench.cli", "attention", "--tiny", "--device", "cpu", "--batches",
               "2", "--contexts", "72", "--formats", "int4/32:32", "--key-space", "post_rope", "--latent-layout",
               "unit-major", "--page-size", str(page), "--json", str(out_json), "--out", str(out_md)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        results[page] = json.loads(out_json.read_text())
        assert results[page]["page_size"] == page and results[page]["latent_layout"] == "unit-major"
    assert "unit-major latents in pools of 8-slot pages" in (tmp_path / "attention8.md").read_text()
    (static,), (paged,) = results[0]["rows"], results[8]["rows"]
    assert "error" not in paged and paged["page_size"] == 8, paged
    assert paged["rel_err"] == static["rel_err"] <= 2e-3, (paged, static)  # bf16 outputs: about 2^-10 each


@pytest.mark.parametrize("layout", ["row-major", "unit-major"])
def test_paged_latents_hold_the_static_rows(layout):
    """Every (sequence, slot) row of the pools, looked up through the page table, is the static row; each sequence's
    pages are distinct pool pages; the pools are in the asked layout with one spare page."""
    from ckvp_compile.bench.attention import make_inputs, paged_latents
    from ckvp_compile.kernels.latent_layout import layout_of

    args = make_inputs(2, 32, "int4/32", 16, seed=3, dev="cpu", heads=(4, 2), head_dim=32, rope="none")
    paged, table = paged_latents(args, 8, layout, seed=5)
    assert table.shape == (2, 4) and table.dtype == torch.int32 and len(set(table.flatten().tolist())) == 8
    for static, pool in ((args[1], paged[1]), (args[2], paged[2])):
        assert pool.shape == (2 * 32 // 8 + 1, 8, static.shape[-1]) and layout_of(pool) == layout
        rows = pool[table.long()].reshape(2, 32, -1)
        assert torch.equal(rows, static)
    assert paged[0] is args[0] and paged[3:] == args[3:]
    with pytest.raises(ValueError, match="divide the context"):
        paged_latents(args, 12, layout)


def test_cpu_without_interpreter_runs_the_reference_only_and_says_so(tmp_path):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("needs a CPU-only process without the interpreter")
    out_json, out_md = tmp_path / "a.json", tmp_path / "a.md"
    rc = main(["attention", "--tiny", "--device", "cpu", "--batches", "2", "--contexts", "40", "--formats",
               "int8/32:32", "--json", str(out_json), "--out", str(out_md)])
    assert rc == 0
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["kernel"].startswith("not run: CPU without the Triton interpreter") and "rel_err" not in row, row
    assert row["bytes_total"] > row["bytes_latent"] > 0 and not any(k in row for k in TIMING_KEYS)
    assert "not run: CPU without the Triton interpreter" in out_md.read_text()


def test_budget_and_memory_skips_are_recorded():
    pytest.importorskip("triton")
    from ckvp_compile.bench.attention import run

    kw = dict(heads=(4, 2), head_dim=32, device="cpu", log=lambda s: None)
    rows = run([("int4/32", 32)], [1, 2], [40], budget_s=0.0, **kw)["rows"]
    assert len(rows) == 2 and all(r["skipped"].startswith("time budget") for r in rows), rows
    rows = run([("int4/32", 32)], [1], [40], mem_fraction=0.0, **kw)["rows"]
    assert rows[0]["skipped"].startswith("memory: needs about"), rows


@pytest.mark.parametrize("argv", [
    ["attention", "--heads", "32:5"], ["attention", "--heads", "8"], ["attention", "--formats", "int4/32"],
    ["attention", "--formats", "int5:32"], ["attention", "--formats", "tern/32:64"],
    ["attention", "--tiny", "--formats", "int4/32:999"], ["attention", "--batches", "0"],
    ["attention", "--contexts", "0"], ["attention", "--device", "tpu"],
    ["attention", "--device", "cpu", "--json", "/nonexistent-dir/x.json"],
    ["attention", "--tiny", "--contexts", "72", "--page-size", "64"], ["attention", "--page-size", "-1"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("extra", [[], ["--batches", "1", "--contexts", "40", "--heads", "4:2"]])
def test_cpu_without_tiny_is_refused_before_any_work(extra, monkeypatch, capsys):
    """On CPU the full Mixtral shapes would run the reference for minutes in GBs: a usage error naming the fix,
    before anything runs (explicit small shapes too: they apply under --tiny)."""
    import ckvp_compile.bench.attention as attention

    def no_run(*a, **k):
        raise AssertionError("run() was reached: the CPU run without --tiny was not refused")

    monkeypatch.setattr(attention, "run", no_run)
    with pytest.raises(SystemExit) as exc:
        main(["attention", "--device", "cpu", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device cpu needs --tiny" in err and "--device cuda on a GPU machine" in err, err


def test_markdown_reports_the_speedup_over_the_byte_ratio():
    """The report's row carries speedup / byte ratio (acceptance 2's measure), from the row's own numbers; '-' where
    no dense baseline ran."""
    from ckvp_compile.bench.attention import to_markdown

    base = dict(format="int8/32", rank=32, batch=8, context=32768, rel_err=7e-5, ms=0.046, bytes_total=153.5e6,
                GBps=3321.0, copy_share=0.781, byte_ratio=7.11)
    timed = dict(base, dense_best="sdpa_eager", dense_best_ms=0.2365, speedup=0.2365 / 0.046,
                 speedup_over_byte_ratio=0.2365 / 0.046 / 7.11)
    result = dict(versions={"gpu": "test"}, copy_bandwidth_GBps=4250.0, heads="32:8", head_dim=128, group=4,
                  elapsed_s=1.0, rows=[timed, dict(base, context=131072)])
    md = to_markdown(result, "ckvp-bench attention")
    assert "| of byte ratio | note |" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| int8/32")]
    assert rows[0].split(" | ")[-2] == "0.723" and rows[1].split(" | ")[-2] == "-"
