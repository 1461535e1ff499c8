"""``ckvp-bench offload``: the CPU recall / policy part end to end on the fixture, and the usage errors."""

from __future__ import annotations

import json

import torch

from ckvp_compile.bench.cli import main as bench_cli


def test_recall_only_writes_json_and_markdown(tmp_path):
    out = tmp_path / "res"
    assert bench_cli(["offload", "--recall-only", "--out", str(out), "--windows", "2", "--window-len", "32"]) == 0
    result = json.loads((out / "offload.json").read_text())
    rec = result["recall"]
    assert rec["tokens"] == 64 and rec["experts"] == 4 and rec["top_k"] == 2
    full = [r["recall"] for r in rec["recall"] if r["margin"] == 2]
    assert full and all(r == 1.0 for r in full)  # top-(A+2) of 4 experts covers every expert
    assert all(0.0 <= r["recall"] <= 1.0 for r in rec["recall"])
    for row in rec["policy"]:
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert abs(row["copies_per_token"] - row["demand_per_token"] - row["prefetch_per_token"]) < 1e-9
    md = (out / "offload.md").read_text()
    assert "Prediction recall" in md and "--recall-only" in md


def test_usage_errors(tmp_path, capsys):
    assert bench_cli(["offload", "--recall-only", "--skip-recall", "--out", str(tmp_path)]) == 2
    if not torch.cuda.is_available():
        assert bench_cli(["offload", "--out", str(tmp_path)]) == 2
        assert "needs CUDA" in capsys.readouterr().err
