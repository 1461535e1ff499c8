"""CPU smoke test of ``ckvp-bench moe`` (ckvp_compile/bench/moe.py): the CLI runs end to end on tiny shapes (four
systems, Inductor on CPU), writes its JSON and markdown, every row is correct against the fp64 loop; no timing
assertions (timing is GPU-only). Bad arguments are usage errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from ckvp_compile.bench.cli import main


@pytest.mark.slow
def test_cli_runs_end_to_end_on_tiny_shapes(tmp_path):
    pytest.importorskip("triton")
    out_json, out_md = tmp_path / "moe.json", tmp_path / "moe.md"
    rc = main(["moe", "--tiny", "--device", "cpu", "--dtype", "float32", "--shapes", "qwen2_moe", "--batches", "1",
               "3", "--json", str(out_json), "--out", str(out_md)])
    assert rc == 0
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert {(r["batch"], r["system"]) for r in rows} == {(b, s) for b in (1, 3) for s in
                                                          ("ckvp", "inductor_grouped_mm", "batched_mm", "eager")}
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["rel_err"] <= 1e-5, r  # fp32 on CPU
        assert 1 <= r["experts_hit"] <= 12
    md = out_md.read_text()
    assert "| qwen2_moe | 3 | ckvp |" in md and "floor" in md and "ckvp-bench moe" in md


def test_time_budget_skips_rows_and_says_so(tmp_path):
    pytest.importorskip("triton")
    from ckvp_compile.bench.moe import run

    result = run(["olmoe"], [2], ["eager", "batched_mm"], __import__("torch").float32, "cpu", budget_s=0.0,
                 tiny=True, log=lambda s: None)
    assert all(r["skipped"].startswith("time budget") for r in result["rows"]), result["rows"]


@pytest.mark.parametrize("argv", [["moe", "--batches", "0"], ["moe", "--shapes", "gpt5"],
                                  ["moe", "--json", "/nonexistent-dir/x.json"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_cpu_without_tiny_is_a_usage_error(capsys):
    """On CPU the full shapes would run for minutes untimed: ``--device cpu`` needs ``--tiny`` (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["moe", "--device", "cpu"])
    assert exc.value.code == 2 and "--device cpu needs --tiny" in capsys.readouterr().err
