"""The CKVP fidelity benchmark on a tiny random model: the CLI end to end (calibrate, compile with the ckvp
backend, teacher-forced chunks through the latent store, JSON), full rank equals dense, 4x really stores 4x less."""

from __future__ import annotations

import json

import torch

from ckvp_compile.bench.cli import main as bench_cli
from ckvp_compile.bench.fidelity import _batches, split_windows
from ckvp_compile.testing import build_hf_moe

WINDOW = 32


def test_windows_and_padded_batches():
    ids = torch.arange(100)
    w = split_windows(ids, WINDOW)
    assert w.shape == (3, WINDOW) and torch.equal(w[1], torch.arange(32, 64))
    batches = _batches(w, 2)
    assert [(b.shape, real) for b, real in batches] == [((2, WINDOW), 2), ((2, WINDOW), 1)]
    assert torch.equal(batches[1][0][1], w[2])  # padded with a copy of the last window


def test_cli_full_rank_equals_dense_and_ratio_4_shrinks(tmp_path, capsys):
    model = build_hf_moe("mixtral", num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16)
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    text = tmp_path / "text.bin"
    text.write_bytes(bytes(torch.randint(0, 256, (3 * WINDOW,), generator=g).tolist()))
    out = tmp_path / "results.json"
    rc = bench_cli(["fidelity", "--model", str(tmp_path / "model"), "--text", str(text), "--window", str(WINDOW),
               "--calib-windows", "2", "--eval-windows", "1", "--chunk", "8", "--batch", "1", "--tokenizer", "bytes",
               "--group-sizes", "2", "--kv-ratio", "1", "4", "--extra", "uniform:2:4:int8", "--json", str(out), "--no-progress",
               "--latent-dtype", "float32", "--dense-dtype", "float32", "--rank-block", "1"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["settings"]["eval_window_indices"] == [2, 2] and data["settings"]["rank_block"] == 1
    full, four, four_int8 = data["results"]
    assert (full["kv_ratio"], four["kv_ratio"]) == (1.0, 4.0)
    # full rank: the latent store is exact, so the compiled chunked run equals the dense full forward
    assert abs(full["ckvp_ppl"] / full["dense_ppl"] - 1) < 1e-4, full
    assert full["top1_agreement_pct"] > 99.0 and full["kl_to_dense"] < 1e-6
    assert four["kl_to_dense"] > full["kl_to_dense"]
    assert full["reset_check_max_abs_diff"] == 0.0  # the first config evaluates a window twice
    assert four["measured_ratio"] >= 4 / 1.1, four
    assert four["latent_bytes"] + four["slot_position_bytes"] <= four["dense_bytes"] / 4 * 1.1
    # int8 latents: every byte counted (codes, fp16 block scales and minimums, slot positions, fp32 bases)
    assert four_int8["latent_format"] == "int8/32" and four_int8["measured_ratio"] >= 4, four_int8
    assert four_int8["elements_ratio"] < four["elements_ratio"]  # the same bytes buy more rank
    for r in (full, four, four_int8):
        assert r["graphs_compiled"] >= 1 and r["layers_rewritten"] == 4
    assert "| 2 | energy | float |" in capsys.readouterr().out
    assert data["complete"] is True


def test_results_are_handed_over_after_each_config(monkeypatch):
    """``on_result`` gets the results so far after every config (the CLI saves --json from it, so a run stopped
    part-way keeps what it measured)."""
    from ckvp_compile.bench import fidelity

    model = build_hf_moe("mixtral", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16)
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, model.config.vocab_size, (3, WINDOW), generator=g)
    seen = []
    configs = [fidelity.FidelityConfig(2, 1.0, "energy", "float"), fidelity.FidelityConfig(2, 4.0, "energy", "float")]
    results = fidelity.run_fidelity(model, windows[:2], windows[2:], configs, chunk=8, batch_size=1, progress=False,
                                    latent_dtype=torch.float32, dense_dtype=torch.float32,
                                    on_result=lambda done: seen.append([r.kv_ratio for r in done]))
    assert seen == [[1.0], [1.0, 4.0]] and [r.kv_ratio for r in results] == [1.0, 4.0]


def test_cli_key_space_reaches_the_calibration(tmp_path):
    """--key-space post_rope: the JSON records it (settings and rows) and the key bases span the keys as cached:
    at 4x on the same windows, other key energies and other numbers than the pre-RoPE default, the same values."""
    import pytest

    model = build_hf_moe("mixtral", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16)
    model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(1)
    text = tmp_path / "text.bin"
    text.write_bytes(bytes(torch.randint(0, 256, (3 * WINDOW,), generator=g).tolist()))
    common = ["fidelity", "--model", str(tmp_path / "model"), "--text", str(text), "--window", str(WINDOW),
              "--calib-windows", "2", "--eval-windows", "1", "--chunk", "8", "--batch", "1", "--tokenizer", "bytes",
              "--group-sizes", "2", "--kv-ratio", "4", "--extra", "--no-progress", "--latent-dtype", "float32",
              "--dense-dtype", "float32", "--rank-block", "1", "--reset-check", "none"]
    post, pre = tmp_path / "post.json", tmp_path / "pre.json"
    assert bench_cli(common + ["--key-space", "post_rope", "--json", str(post)]) == 0
    assert bench_cli(common + ["--json", str(pre)]) == 0
    post_data, pre_data = json.loads(post.read_text()), json.loads(pre.read_text())
    assert post_data["settings"]["key_space"] == "post_rope" and pre_data["settings"]["key_space"] == "pre_rope"
    (four,), (pre_four,) = post_data["results"], pre_data["results"]
    assert four["key_space"] == "post_rope" and pre_four["key_space"] == "pre_rope"
    assert 0 < four["k_energy_retained"] < 1 and 0 < pre_four["k_energy_retained"] < 1
    assert four["k_energy_retained"] != pre_four["k_energy_retained"]
    if four["v_ranks"] == pre_four["v_ranks"]:  # the values' moments do not depend on the key space
        assert four["v_energy_retained"] == pytest.approx(pre_four["v_energy_retained"], rel=1e-12)
    assert four["ckvp_ppl"] != pre_four["ckvp_ppl"] and four["kl_to_dense"] != pre_four["kl_to_dense"]
    assert four["graphs_compiled"] >= 1 and four["layers_rewritten"] == 2
    with pytest.raises(SystemExit):
        bench_cli(["fidelity", "--key-space", "after"])


def test_bench_cli_usage_errors():
    assert bench_cli([]) == 2 and bench_cli(["nope"]) == 2 and bench_cli(["--help"]) == 0


def test_fidelity_names_the_bad_window_count(capsys):
    """A calibration window count below 1 is reported as such, not as a --measure-windows range error."""
    import pytest

    for n in ("0", "-3"):
        with pytest.raises(SystemExit) as exc:
            bench_cli(["fidelity", "--calib-windows", n])
        assert exc.value.code == 2
        assert f"--calib-windows must be >= 1, got {n}" in capsys.readouterr().err


def test_plot_draws_the_results_and_the_goals(tmp_path):
    """plot_results writes a PNG with one line per (G, allocation, format) and the 4x / 8x / 16x goal bars."""
    import pytest

    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from ckvp_compile.bench import fidelity

    rows = [fidelity.FidelityResult(group_size=4, rank_allocation="uniform", kv_ratio=r, measured_ratio=r * 1.01,
                                    elements_ratio=r, latent_bytes=1, slot_position_bytes=1, dense_bytes=1,
                                    bases_bytes=1, rope_table_bytes=1, batch_size=1, dense_ppl=3.0,
                                    ckvp_ppl=3.0 * (1 + r / 400), ppl_change_pct=r / 4, top1_agreement_pct=95.0,
                                    kl_to_dense=0.01, reset_check_max_abs_diff=None, graphs_compiled=1,
                                    layers_rewritten=4, latent_format="int4/32")
            for r in (4.0, 8.0)]
    drawn = []
    real_plot = plt.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return real_plot(self, *args, **kwargs)

    plt.Axes.plot = spy
    try:
        assert fidelity.plot_results(rows, tmp_path / "p.png", "title")
    finally:
        plt.Axes.plot = real_plot
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert "CKVP G=4, uniform, int4/32" in drawn and drawn.count(None) == len(fidelity.GOALS) - 1
