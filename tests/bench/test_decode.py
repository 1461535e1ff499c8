"""``ckvp-bench decode`` on the CPU: system names, random models built on a device, caches filled as if prefilled,
the CLI end to end on a tiny random model and on the fixture (tiny settings), and the report it renders.

Nothing here measures speed (timing lives in the GPU runs); rows are checked for what they hold: status, bytes,
ratios, agreement, and the tokens a decode step writes."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckvp_compile.bench.cli import main as bench_cli
from ckvp_compile.bench.decode import parse_cell, parse_system
from ckvp_compile.bench.decode_models import (build_random_model, dense_cache, dense_kv_bytes_per_token, fill_cache_,
                                              kv_bytes_held, latent_cache, make_config, random_bases,
                                              synthetic_moments)
from ckvp_compile.errors import CKVPConfigError
from ckvp_compile.latent.capture import hf_step_kwargs


def test_parse_system():
    assert parse_system("eager").kind == "eager"
    assert parse_system("inductor").mode == "default"
    assert parse_system("inductor-max-autotune").mode == "max-autotune"
    assert parse_system("inductor:reduce-overhead").mode == "reduce-overhead"
    s = parse_system("ckvp-16:max-autotune")
    assert (s.kind, s.ratio, s.mode) == ("ckvp", 16.0, "max-autotune")
    for bad in ("ckvp", "ckvp-0.5", "inductor-max-autotune:default", "eager:max-autotune", "dense", "ckvp-4:fast"):
        with pytest.raises(ValueError, match="unknown system"):
            parse_system(bad)


def test_parse_cell():
    assert parse_cell("ckvp-16:reduce-overhead@8@32768") == ("ckvp-16:reduce-overhead", 8, 32768)
    assert parse_cell("eager@max@4096") == ("eager", "max", 4096)
    for bad in ("eager@8", "eager@0@16", "eager@8@0", "eager@x@16", "eager@8@16@1", "eager@-1@16"):
        with pytest.raises(ValueError, match="SYSTEM@BATCH@CONTEXT"):
            parse_cell(bad)


def test_cli_cells_run_exactly_the_listed_rows(tmp_path):
    """--cells runs the listed (system, batch, context) rows in order, not the grid; a bad cell is a usage error."""
    out = tmp_path / "cells.json"
    rc = bench_cli(["decode", "--shape", "tiny", "--cells", "ckvp-4@1@16", "eager@2@8", "--steps", "1", "--warmup",
                    "1", "--compiler", "eager", "--device", "cpu", "--bases", "synthetic", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["system"], r["batch"], r["context"], r["status"]) for r in data["rows"]] == [
        ("ckvp-4", 1, 16, "ok"), ("eager", 2, 8, "ok")]
    settings_ = data["meta"]["settings"]
    assert settings_["cells"] == ["ckvp-4@1@16", "eager@2@8"] and settings_["contexts"] == [16, 8]
    assert bench_cli(["decode", "--shape", "tiny", "--cells", "eager@2"]) == 2
    assert bench_cli(["decode", "--shape", "tiny", "--cells", "fast@2@8"]) == 2


def test_shapes_match_the_issue():
    """Config fields the physics of issue 9 rests on (built on meta: nothing allocated)."""
    from transformers import AutoModelForCausalLM

    q = make_config("qwen-moe-a2.7b", max_positions=40000)
    assert dense_kv_bytes_per_token(q, torch.bfloat16) == 196608 and q.max_position_embeddings >= 40000
    m = make_config("mixtral-8x7b", layers=8)
    assert m.num_hidden_layers == 8 and dense_kv_bytes_per_token(make_config("mixtral-8x7b"), torch.bfloat16) == 131072
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(q, dtype=torch.bfloat16).parameters())
    assert 14.0e9 < n < 14.6e9  # Qwen1.5-MoE-A2.7B: 14.3 B parameters
    with pytest.raises(CKVPConfigError, match="--layers must be in 1..32"):
        make_config("mixtral-8x7b", layers=33)
    with pytest.raises(CKVPConfigError, match="unknown shape"):
        make_config("llama")


def test_random_model_buffers_and_filled_dense_cache():
    """Weights are made in place on the device; RoPE buffers equal a normally built model's; a cache filled with C
    random tokens is written at slot C by the next decode step, and attended: other filled values, other logits."""
    from transformers import AutoModelForCausalLM

    cfg = make_config("tiny", max_positions=64)
    model = build_random_model(cfg, "cpu", torch.float32, seed=1)
    ref = AutoModelForCausalLM.from_config(cfg)
    for (name, b), (_, b_ref) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, b_ref), name
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    ids = torch.tensor([[3], [7]])
    logits = []
    for seed in (0, 1):
        cache = dense_cache(cfg, 2, 40, "cpu", torch.float32)
        fill_cache_(cache, 20, seed=seed)
        assert kv_bytes_held(cache) == 2 * 40 * dense_kv_bytes_per_token(cfg, torch.float32)
        with torch.no_grad():
            logits.append(model(**hf_step_kwargs(model, ids, cache, 20)).logits)
        keys = cache.layers[0].keys
        assert bool(keys[:, :, 20].abs().sum() > 0) and bool((keys[:, :, 21:] == 0).all())
    assert not torch.allclose(logits[0], logits[1])
    with pytest.raises(CKVPConfigError, match="does not fit"):
        fill_cache_(dense_cache(cfg, 1, 8, "cpu", torch.float32), 9)


def test_filled_latent_cache_decode_step():
    """Random quantized latents in the store's own format; one compiled ckvp step writes slot C at position C.
    Bases calibrated on the random model's activations have the groups of the synthetic ones."""
    from ckvp_compile.latent.budget import bases_for_byte_ratio

    cfg = make_config("tiny", max_positions=64)
    model = build_random_model(cfg, "cpu", torch.float32)
    moments = random_bases(model, 4, samples=1, tokens=16)
    synthetic = synthetic_moments(model, 4)
    assert synthetic.groups == moments.groups == ((0, 1, 2, 3),)
    assert [vecs.shape for _, vecs in synthetic.k] == [m.shape for m in moments.k] == [(2, 64, 64)]
    bases = bases_for_byte_ratio(moments, 4.0, "int4", batch_size=2, max_cache_len=40, dense_dtype=torch.float32,
                                 latent_dtype=torch.float32)
    cache = latent_cache(cfg, bases, 2, 40, "cpu", torch.float32, "int4")
    fill_cache_(cache, 20)
    store = cache.store
    assert torch.equal(store.slot_pos[0, :20], torch.arange(20, dtype=torch.int32))
    assert bool(store.latent_k[0][:, :20].ne(0).any()) and bool((store.latent_k[0][:, 20:] == 0).all())
    assert 4.0 <= 2 * 40 * dense_kv_bytes_per_token(cfg, torch.float32) / kv_bytes_held(cache) < 4.4
    step = torch.compile(model.forward, backend="ckvp", options={"compiler": "eager"})
    torch._dynamo.reset()
    with torch.no_grad():
        out = step(**hf_step_kwargs(model, torch.tensor([[3], [7]]), cache, 20)).logits
    torch._dynamo.reset()
    assert bool(torch.isfinite(out).all())
    assert int(store.slot_pos[0, 20]) == 20 and bool(store.latent_k[0][:, 20].ne(0).any())


def test_cli_tiny_fixture_and_report(tmp_path):
    """The CLI on a tiny random model (eager and ckvp-4 rows, a budget-skipped row), on the fixture (tiny settings),
    then --report renders both into markdown and PNGs."""
    speed, fixture = tmp_path / "tiny.json", tmp_path / "fixture.json"
    rc = bench_cli(["decode", "--shape", "tiny", "--systems", "eager", "ckvp-4", "--batch", "2", "--context", "16",
                    "--steps", "2", "--warmup", "1", "--compiler", "eager", "--device", "cpu", "--bases", "synthetic",
                    "--json", str(speed), "--out", str(tmp_path / "tiny.md")])
    assert rc == 0
    rows = json.loads(speed.read_text())["rows"]
    assert [(r["system"], r["status"]) for r in rows] == [("eager", "ok"), ("ckvp-4", "ok")], rows
    assert rows[0]["kv_ratio_measured"] == 1.0 and 4.0 <= rows[1]["kv_ratio_measured"] < 4.4
    assert rows[1]["ranks"]["group_size"] == 4 and rows[1]["ms_median"] > 0 and rows[1]["steps"] == 2
    rc = bench_cli(["decode", "--shape", "fixture", "--ratios", "4", "--prompts", "1", "--new-tokens", "4",
                    "--prompt-len", "16", "--calib-windows", "1", "--compiler", "eager", "--device", "cpu",
                    "--json", str(fixture)])
    assert rc == 0
    dense, floor, four = json.loads(fixture.read_text())["rows"]
    assert dense["agreement"] == 1.0 and four["status"] == "ok", four
    # the noise floor: dense over a bf16-rounded KV cache (the fixture runs in fp32), labelled, no ratio
    assert floor["latent_format"] == "dense, bf16 KV" and floor["ratio_requested"] is None
    assert 0.0 <= floor["agreement"] <= 1.0 and floor["tokens"] == 4
    assert 0.0 <= four["agreement"] <= 1.0 and 0.0 <= four["forced_agreement"] <= 1.0
    assert four["ratio_measured_at_budget"] >= 4.0 and four["tokens"] == 4
    md = tmp_path / "B.md"
    assert bench_cli(["decode", "--report", str(speed), str(fixture), "--markdown", str(md), "--plots",
                      str(tmp_path / "plots")]) == 0
    text = md.read_text()
    assert "| ckvp-4 | 2 | 16 |" in text and "## Fidelity: greedy generation on the trained fixture" in text
    assert "5. Fixture, greedy 4 tokens x 1 prompts at 4x" in text and "dense with its KV cache rounded to bf16" in text
    assert (tmp_path / "plots" / "decode_ms_tiny.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "decode_fidelity.png").stat().st_size > 1000
    # a run with another --group-size keeps its own ckvp rows, labelled, beside the default's
    data = json.loads(speed.read_text())
    assert data["meta"]["settings"]["group_size"] == 4
    data["meta"]["settings"]["group_size"] = 1
    g1 = tmp_path / "tiny_g1.json"
    g1.write_text(json.dumps(data))
    assert bench_cli(["decode", "--report", str(speed), str(g1), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| ckvp-4 | 2 | 16 |" in text and "| ckvp-4 G=1 | 2 | 16 |" in text and text.count("| eager | 2 | 16 |") == 1
    # a fixture run with another group size is labelled too (its latent rows only)
    fx = json.loads(fixture.read_text())
    assert fx["meta"]["calib_windows"] == 1 and fx["meta"]["key_space"] == "pre_rope"
    fx["meta"].update(calib_windows=16, prompt_len=128)  # the defaults: not labelled
    fixture.write_text(json.dumps(fx))
    fx["meta"]["group_size"] = 1
    fx_g1 = tmp_path / "fixture_g1.json"
    fx_g1.write_text(json.dumps(fx))
    # ... and so is one with other calibration windows, which also take its prompts from other text
    fx["meta"].update(group_size=4, calib_windows=64)
    fx_c64 = tmp_path / "fixture_c64.json"
    fx_c64.write_text(json.dumps(fx))
    # ... and one with post-RoPE key bases (--key-space post_rope)
    fx["meta"].update(calib_windows=16, key_space="post_rope")
    fx_post = tmp_path / "fixture_post.json"
    fx_post.write_text(json.dumps(fx))
    # ... and one with longer prompts: all its rows, the dense floor's too (agreement depends on the context)
    fx["meta"].update(key_space="pre_rope", prompt_len=448)
    fx_448 = tmp_path / "fixture_448.json"
    fx_448.write_text(json.dumps(fx))
    # ... and one whose model computed in bfloat16 (--fixture-dtype bfloat16): its dense rows too
    fx["meta"].update(prompt_len=128, fixture_dtype="bfloat16")
    fx_bf16 = tmp_path / "fixture_bf16.json"
    fx_bf16.write_text(json.dumps(fx))
    assert bench_cli(["decode", "--report", str(fixture), str(fx_g1), str(fx_c64), str(fx_post), str(fx_448),
                      str(fx_bf16), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| 4x | int4, G=1 |" in text and "| 4x | int4 |" in text and "| dense | dense, bf16 KV |" in text
    assert "| 4x | int4, 64 calibration windows (other prompts) |" in text and "| 4x | int4, post-RoPE keys |" in text
    assert "| 4x | int4, 448-token prompts |" in text and "| dense | dense, bf16 KV, 448-token prompts |" in text
    assert "| 4x | int4, bf16 model |" in text and "| dense | dense, bf16 KV, bf16 model |" in text


def test_fixture_prompts_batched_equal_one_at_a_time(tmp_path):
    """--prompt-batch: 3 prompts decoded as rows of batches of 2 (the last batch padded with a copy) give every row
    (dense, the bf16-KV floor, a KIVI baseline and ckvp at 4x; greedy and teacher-forced) the tokens that decoding
    them one at a time gives, and the same one-sequence ratios; the meta records the batch."""
    runs = {}
    for batch in (1, 2):
        out = tmp_path / f"b{batch}.json"
        assert bench_cli(["decode", "--shape", "fixture", "--ratios", "4", "--prompts", "3", "--new-tokens", "6",
                          "--prompt-len", "24", "--calib-windows", "1", "--compiler", "eager", "--device", "cpu",
                          "--baseline", "kivi:2:32:16", "--prompt-batch", str(batch), "--json", str(out)]) == 0
        runs[batch] = json.loads(out.read_text())
    assert [runs[b]["meta"]["prompt_batch"] for b in (1, 2)] == [1, 2]
    one, two = runs[1]["rows"], runs[2]["rows"]
    assert len(one) == len(two) == 4 and all(r["status"] == "ok" for r in one + two)
    for a, b in zip(one, two):
        assert len(a["generated"]) == 3 and all(len(g) == 6 for g in a["generated"])
        assert a["generated"] == b["generated"], (a["latent_format"], a["generated"], b["generated"])
        assert a["forced_per_prompt"] == b["forced_per_prompt"] and a["agreement"] == b["agreement"]
        assert a["ratio_state_only"] == b["ratio_state_only"]  # one sequence's bytes, whatever the batch
    assert bench_cli(["decode", "--shape", "fixture", "--prompt-batch", "0"]) == 2


def test_fixture_planned_rotated_fp8_bases(tmp_path):
    """--latent-format planned+rot+fp8 (tiny settings): the bases are stored in fp8 and counted at 1 byte, so the
    same 4x budget is met, and the row records the full format name."""
    out = tmp_path / "fixture.json"
    rc = bench_cli(["decode", "--shape", "fixture", "--ratios", "4", "--prompts", "1", "--new-tokens", "3",
                    "--prompt-len", "16", "--calib-windows", "1", "--compiler", "eager", "--device", "cpu",
                    "--latent-format", "planned+rot+fp8", "--json", str(out)])
    assert rc == 0
    four = next(r for r in json.loads(out.read_text())["rows"] if r["ratio_requested"] == 4.0)
    assert four["status"] == "ok" and four["latent_format"] == "planned+rot+fp8", four
    assert four["ratio_measured_at_budget"] >= 4.0


def test_fixture_planned_measured_bases(tmp_path, monkeypatch):
    """--latent-format planned+rot+fp8+measured --planned-format mix/32v64 on a tiny byte-level model: the planner's
    errors are measured (bench.fidelity.measured_errors_cache) once, on the first --measure-windows calibration
    windows only (never a prompt), with the key and value blocks asked for, and the row records the bit plan."""
    from pathlib import Path

    import ckvp_compile.bench.fidelity as fidelity
    from ckvp_compile.testing import build_hf_moe

    model_dir = tmp_path / "tiny"
    build_hf_moe("mixtral", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16).save_pretrained(model_dir)
    text = (Path(__file__).resolve().parents[2] / "models" / "tiny-mixtral-pystdlib" / "eval_text.txt").read_bytes()
    (model_dir / "eval_text.txt").write_bytes(text[:2048])
    real, seen = fidelity.measured_errors_cache, []

    def spy(model, windows, **kwargs):
        measure = real(model, windows, **kwargs)

        def measure_errors(*args):
            seen.append((windows.clone(), args[2:4]))
            return measure(*args)

        return measure_errors

    monkeypatch.setattr(fidelity, "measured_errors_cache", spy)
    out = tmp_path / "fixture.json"
    rc = bench_cli(["decode", "--shape", "fixture", "--model", str(model_dir), "--ratios", "2", "--prompts", "1",
                    "--new-tokens", "3", "--prompt-len", "16", "--calib-windows", "2", "--measure-windows", "1",
                    "--compiler", "eager", "--device", "cpu", "--latent-format", "planned+rot+fp8+measured",
                    "--planned-format", "mix/32v64", "--json", str(out)])
    assert rc == 0
    assert len(seen) == 1, "'+measured' did not measure the planner's errors"
    windows, blocks = seen[0]
    assert windows.tolist() == [list(text[:256])] and blocks == (32, 64)
    data = json.loads(out.read_text())
    dense, two = data["rows"][0], data["rows"][-1]  # between them: the bf16-KV noise floor (fp32 fixture)
    assert two["status"] == "ok" and two["latent_format"] == "planned+rot+fp8+measured", two
    assert two["planned_format"] == "mix/32v64" and data["meta"]["measure_windows"] == 1
    assert two["ratio_measured_at_budget"] >= 2.0 and len(two["prefixes"]) == 1 == len(two["generated"])
    assert dense["generated"][0][:two["prefixes"][0]] == two["generated"][0][:two["prefixes"][0]]


def test_fixture_post_rope_keys_planned_measured(tmp_path, monkeypatch):
    """--key-space post_rope on the fixture path (tiny byte-level model, planned+rot+fp8+measured): the calibration
    and the '+measured' planner's meter get post-RoPE key bases, the meta records it, and the row decodes."""
    from pathlib import Path

    import ckvp_compile.latent as latent
    from ckvp_compile.testing import build_hf_moe

    model_dir = tmp_path / "tiny"
    build_hf_moe("mixtral", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16).save_pretrained(model_dir)
    text = (Path(__file__).resolve().parents[2] / "models" / "tiny-mixtral-pystdlib" / "eval_text.txt").read_bytes()
    (model_dir / "eval_text.txt").write_bytes(text[:2048])
    real, spaces = latent.collect_kv_moments, []

    def spy(*args, **kwargs):
        m = real(*args, **kwargs)
        spaces.append(m.key_space)
        return m

    monkeypatch.setattr(latent, "collect_kv_moments", spy)
    out = tmp_path / "fixture.json"
    rc = bench_cli(["decode", "--shape", "fixture", "--model", str(model_dir), "--ratios", "2", "--prompts", "1",
                    "--new-tokens", "3", "--prompt-len", "16", "--calib-windows", "2", "--measure-windows", "1",
                    "--compiler", "eager", "--device", "cpu", "--latent-format", "planned+rot+fp8+measured",
                    "--key-space", "post_rope", "--json", str(out)])
    assert rc == 0 and spaces == ["post_rope"]
    data = json.loads(out.read_text())
    two = data["rows"][-1]
    assert data["meta"]["key_space"] == "post_rope" and two["status"] == "ok", two
    assert two["ratio_measured_at_budget"] >= 2.0 and 0.0 <= two["forced_agreement"] <= 1.0


def test_usage_errors(capsys):
    assert bench_cli(["decode", "--shape", "fixture", "--latent-format", "planned+alr"]) == 2
    assert "+rot, +fp8 and +measured" in capsys.readouterr().err
    assert bench_cli(["decode", "--shape", "fixture", "--latent-format", "planned", "--planned-format", "32v64"]) == 2
    assert "mix/<block>v<value block>" in capsys.readouterr().err
    assert bench_cli(["decode", "--shape", "fixture", "--latent-format", "int4", "--planned-format", "mix/32"]) == 2
    assert bench_cli(["decode", "--shape", "fixture", "--latent-format", "planned+rot", "--measure-windows", "2"]) == 2
    assert "planned+measured" in capsys.readouterr().err
    assert bench_cli(["decode", "--shape", "fixture", "--latent-format", "planned+measured", "--calib-windows", "4",
                      "--measure-windows", "5"]) == 2
    capsys.readouterr()
    assert bench_cli(["decode", "--shape", "fixture", "--latent-format", "planned+measured", "--calib-windows", "0",
                      "--measure-windows", "1"]) == 2
    assert "--calib-windows must be >= 1, got 0" in capsys.readouterr().err
    assert bench_cli(["decode", "--shape", "tiny", "--systems", "dense"]) == 2
    assert "unknown system 'dense'" in capsys.readouterr().err
    assert bench_cli(["decode", "--report", "x.json"]) == 2
    assert bench_cli(["decode", "--shape", "tiny", "--batch", "0"]) == 2
    assert bench_cli(["decode"]) == 2


@settings(max_examples=15, deadline=None)
@given(hkv=st.integers(1, 3), d=st.sampled_from([4, 8]), layers=st.integers(1, 5), g=st.sampled_from([1, 2, 4]),
       ratio=st.floats(1.0, 12.0), allocation=st.sampled_from(["energy", "uniform"]), seed=st.integers(0, 99))
def test_decomposed_moments_build_the_library_bases(hkv, d, layers, g, ratio, allocation, seed):
    """DecomposedMoments.bases (one eigh, reused while bases_for_byte_ratio bisects) gives KVMoments.bases' ranks and
    the same basis columns up to sign, on random moments."""
    from ckvp_compile.bench.decode_models import DecomposedMoments
    from ckvp_compile.latent import KVMoments

    gen = torch.Generator().manual_seed(seed)
    groups = tuple(tuple(range(i, min(i + g, layers))) for i in range(0, layers, g))

    def psd(n):
        x = torch.randn(hkv, n, 3 * n, generator=gen, dtype=torch.float64)
        return x @ x.mT

    ref = KVMoments(groups=groups, num_kv_heads=hkv, head_dim=d, group_size=g, k=[psd(len(l) * d) for l in groups],
                    v=[psd(len(l) * d) for l in groups], num_tokens=7, model_fingerprint={})
    top = layers * d / len(groups)
    ratio = min(ratio, top)
    want, got = ref.bases(ratio, allocation), DecomposedMoments.from_moments(ref).bases(ratio, allocation)
    assert (got.k_ranks, got.v_ranks) == (want.k_ranks, want.v_ranks)
    for a, b in zip((*want.k_basis, *want.v_basis), (*got.k_basis, *got.v_basis)):
        assert torch.allclose(a.abs(), b.abs(), atol=1e-5)


def test_cli_recent_window_rows(tmp_path):
    """--recent-window: ckvp rows named '<system> wN', the ring filled with the last slots, its bytes counted (the
    measured ratio still meets the requested one), and the step runs; on the fixture the ratio at the budget length
    counts the window too."""
    from ckvp_compile.latent.budget import bases_for_byte_ratio

    speed, fixture = tmp_path / "tiny.json", tmp_path / "fixture.json"
    assert bench_cli(["decode", "--shape", "tiny", "--systems", "ckvp-4", "--batch", "2", "--context", "32",
                      "--steps", "2", "--warmup", "1", "--compiler", "eager", "--device", "cpu", "--bases",
                      "synthetic", "--recent-window", "2", "--json", str(speed)]) == 0
    (row,) = json.loads(speed.read_text())["rows"]
    assert row["system"] == "ckvp-4 w2" and row["status"] == "ok" and 4.0 <= row["kv_ratio_measured"] < 4.4, row
    cfg = make_config("tiny", max_positions=64)
    model = build_random_model(cfg, "cpu", torch.float32)
    bases = bases_for_byte_ratio(synthetic_moments(model, 4), 4.0, "int4", batch_size=2, max_cache_len=40,
                                 dense_dtype=torch.float32, latent_dtype=torch.float32, recent_window=2)
    cache = latent_cache(cfg, bases, 2, 40, "cpu", torch.float32, "int4", recent_window=2)
    fill_cache_(cache, 21)
    assert cache.store.window_slots[0].tolist() == [20, 19]  # entry slot % 2
    assert 4.0 <= 2 * 40 * dense_kv_bytes_per_token(cfg, torch.float32) / kv_bytes_held(cache) < 4.4
    assert bench_cli(["decode", "--shape", "fixture", "--ratios", "4", "--prompts", "1", "--new-tokens", "4",
                      "--prompt-len", "16", "--calib-windows", "1", "--compiler", "eager", "--device", "cpu",
                      "--recent-window", "8", "--json", str(fixture)]) == 0
    meta, (dense, floor, four) = json.loads(fixture.read_text())["meta"], json.loads(fixture.read_text())["rows"]
    assert floor["latent_format"] == "dense, bf16 KV"
    assert meta["recent_window"] == 8 and four["status"] == "ok" and four["ratio_measured_at_budget"] >= 4.0, four


def test_cli_page_size_rows(tmp_path):
    """--page-size P: ckvp rows named '<system> <layout> pP' over latents in pools of P-slot pages (each row's cache
    length rounded up to whole pages), the byte ratio met but for the pool's trash page, and the step run; the
    setting recorded; a negative size, or one with the fixture's greedy check, is a usage error."""
    out = tmp_path / "paged.json"
    assert bench_cli(["decode", "--shape", "tiny", "--systems", "eager", "ckvp-4", "--batch", "2", "--context", "32",
                      "--steps", "2", "--warmup", "1", "--compiler", "eager", "--device", "cpu", "--bases",
                      "synthetic", "--latent-layout", "unit-major", "--page-size", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    eager, row = data["rows"]
    assert eager["system"] == "eager" and eager["max_cache_len"] == 32 + 1 + 2 + 1, eager  # dense rows are not paged
    assert row["system"] == "ckvp-4 unit-major p8" and row["status"] == "ok", row
    # 36 slots -> 5 pages of 8 a sequence, ranks planned for the 36 slots used (as unpaged); measured against dense at
    # 40 slots with the pool's trash page (one of 2 * 5 + 1 pages) held too: within 10% of the asked 4x
    assert row["max_cache_len"] == 40 and 3.6 <= row["kv_ratio_measured"] < 4.4, row
    assert data["meta"]["settings"]["page_size"] == 8
    for argv in (["--shape", "tiny", "--page-size", "-8"], ["--shape", "fixture", "--page-size", "64"],
                 ["--shape", "tiny", "--context", "32", "--page-size", "64"]):
        assert bench_cli(["decode", *argv, "--device", "cpu"]) == 2


def test_cli_key_rank_cap_rows(tmp_path):
    """--max-key-rank R: ckvp rows named '<system> K<=R', every key rank at most R, the byte ratio still met (the
    bytes went to the values), the setting recorded; a bad cap, or one with a planned bit plan, is a usage error."""
    out = tmp_path / "cap.json"
    assert bench_cli(["decode", "--shape", "tiny", "--systems", "ckvp-4", "--batch", "2", "--context", "32",
                      "--steps", "2", "--warmup", "1", "--compiler", "eager", "--device", "cpu", "--bases",
                      "synthetic", "--max-key-rank", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["system"] == "ckvp-4 K<=8" and row["status"] == "ok" and 4.0 <= row["kv_ratio_measured"] < 4.4, row
    assert max(r for rs in row["ranks"]["k"] for r in rs) <= 8 < max(r for rs in row["ranks"]["v"] for r in rs)
    assert data["meta"]["settings"]["max_key_rank"] == 8
    for argv in (["--shape", "tiny", "--max-key-rank", "0"],  # refused before any model is built
                 ["--shape", "fixture", "--latent-format", "planned", "--max-key-rank", "64"]):
        assert bench_cli(["decode", *argv, "--device", "cpu"]) == 2


def test_cli_post_rope_key_rows(tmp_path, monkeypatch):
    """--key-space post_rope: ckvp rows named '<system> post-RoPE' (other systems keep their names), the caches they
    decode hold post-RoPE bases (synthetic, and calibrated on the random model through random_bases), the setting is
    recorded in the JSON; the default records 'pre_rope' and leaves the names alone; a bad value is a usage error."""
    import ckvp_compile.bench.decode_models as decode_models
    from ckvp_compile.bench.decode_models import DecomposedMoments

    real, spaces = decode_models.latent_cache, []

    def spy(cfg, bases, *args, **kwargs):
        spaces.append(bases.key_space)
        return real(cfg, bases, *args, **kwargs)

    monkeypatch.setattr(decode_models, "latent_cache", spy)
    for key_space, name in (("post_rope", "ckvp-4 post-RoPE"), ("pre_rope", "ckvp-4")):
        out = tmp_path / f"{key_space}.json"
        spaces.clear()
        assert bench_cli(["decode", "--shape", "tiny", "--cells", "ckvp-4@1@16", "eager@1@16", "--steps", "1",
                          "--warmup", "1", "--compiler", "eager", "--device", "cpu", "--bases", "synthetic",
                          "--key-space", key_space, "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        assert [(r["system"], r["status"]) for r in data["rows"]] == [(name, "ok"), ("eager", "ok")], data["rows"]
        assert data["meta"]["settings"]["key_space"] == key_space
        assert spaces and set(spaces) == {key_space}
    assert bench_cli(["decode", "--shape", "tiny", "--key-space", "after_rope", "--device", "cpu"]) == 2
    model = build_random_model(make_config("tiny", max_positions=64), "cpu", torch.float32)
    moments = random_bases(model, 4, samples=1, tokens=16, key_space="post_rope")
    assert moments.key_space == "post_rope"
    assert DecomposedMoments.from_moments(moments).bases(4.0).key_space == "post_rope"


def test_kernel_sequence_keeps_one_step_of_attention_kernels_in_launch_order():
    """kernel_sequence: the matching device kernels of the first of N steps, by start time, [name, us] each; host
    events, other kernels and unreadable events are skipped."""
    from types import SimpleNamespace

    from ckvp_compile.bench.decode import kernel_sequence

    class Range:
        def __init__(self, start, us):
            self.start, self.us = start, us

        def elapsed_us(self):
            return self.us

    def ev(name, start, us, dev="DeviceType.CUDA"):
        return SimpleNamespace(name=name, device_type=dev, time_range=Range(start, us))

    events = [ev("_latent_scores_heads_kernel", 30, 5.0), ev("_latent_attention_split_kernel", 10, 7.5),
              ev("aten::mm", 5, 1.0, "DeviceType.CPU"), ev("nvjet_gemm", 12, 3.0), object(),
              ev("_latent_attention_split_kernel", 110, 7.0), ev("_latent_scores_heads_kernel", 130, 5.5)]
    assert kernel_sequence(events, 2) == [["_latent_attention_split_kernel", 7.5], ["_latent_scores_heads_kernel", 5.0]]
    assert kernel_sequence([], 2) == []


def test_acceptance_names_the_defaults_when_the_best_row_uses_another_group_size_or_key_space():
    from ckvp_compile.bench.decode_report import _acceptance

    def row(system, kind, tok_s, batch, ratio=None):
        return dict(system=system, kind=kind, shape="mixtral-8x7b", layers=8, layers_full=32, batch=batch,
                    context=32768, max_batch=True, status="ok", ms_median=batch / tok_s * 1e3, tokens_per_s=tok_s,
                    kv_ratio_requested=ratio, kv_bytes_allocated=None, peak_bytes=None)

    rows = [row("inductor-reduce-overhead", "inductor", 290.0, 10), row("ckvp-16 G=1", "ckvp", 1585.0, 195, 16.0),
            row("ckvp-16", "ckvp", 923.0, 195, 16.0)]
    line = next(x for x in _acceptance(rows, []) if x.startswith("2. mixtral"))
    assert "ckvp-16 G=1 1585 tok/s" in line and "5.47x" in line and "**met**" in line
    assert "non-default latent group size" in line and "post-RoPE" not in line
    assert "with the defaults (G = 4, pre-RoPE keys): 923 tok/s (B=195), 3.18x" in line
    # the default's own row best: no note
    line = next(x for x in _acceptance(rows[::2], []) if x.startswith("2. mixtral"))
    assert "3.18x" in line and "**not met**" in line and "non-default" not in line
    # check 1 (Qwen, B=8, 32k, all layers) likewise
    q = [dict(r, shape="qwen-moe-a2.7b", layers=24, layers_full=24, batch=8, max_batch=False) for r in rows]
    q[0]["ms_median"], q[1]["ms_median"], q[2]["ms_median"] = 18.0, 14.0, 70.0
    line = next(x for x in _acceptance(q, []) if x.startswith("1. Qwen"))
    assert "ckvp-16 G=1 14.00 ms" in line and "0.78x" in line
    assert "with the defaults (G = 4, pre-RoPE keys): 70.00 ms, 3.89x" in line
    # a post-RoPE row (key bases of the cached keys) is named as such, and its G = 4 row is not the default's
    q += [dict(q[1], system="ckvp-16 post-RoPE G=1", ms_median=12.0), dict(q[2], system="ckvp-16 post-RoPE",
                                                                             ms_median=29.0)]
    line = next(x for x in _acceptance(q, []) if x.startswith("1. Qwen"))
    assert "ckvp-16 post-RoPE G=1 12.00 ms" in line and "0.67x" in line
    assert "non-default latent group size and post-RoPE key bases" in line and "70.00 ms, 3.89x" in line


def test_acceptance_memory_check_names_its_worst_row():
    """Check 4 names the row furthest from its requested ratio and the device bytes allocated beside the cache's
    own tensors (per-layout tables and the like, which weigh only in small caches)."""
    from ckvp_compile.bench.decode_report import _acceptance

    def row(ratio_measured, allocated, held, batch):
        return dict(system="ckvp-8", kind="ckvp", shape="mixtral-8x7b", layers=8, layers_full=32, batch=batch,
                    context=4096, max_batch=False, status="ok", ms_median=1.0, tokens_per_s=1.0,
                    kv_ratio_requested=8.0, kv_ratio_measured=ratio_measured, kv_bytes_allocated=allocated,
                    kv_bytes_held=held, peak_bytes=None)

    line = next(x for x in _acceptance([row(7.98, 2**30, 2**30 - 2**20, 64), row(7.0, 18 * 2**20, 16 * 2**20, 1)],
                                       []) if x.startswith("4. "))
    assert "worst deviation 12.5%" in line and "**not met**" in line and "B=1 C=4096, 7.00x for 8x" in line
    assert "18.0 MiB on the device of which 2.0 MiB is allocated beside the cache's own tensors (16.0 MiB)" in line
    line = next(x for x in _acceptance([row(7.98, 2**30, 2**30 - 2**20, 64)], []) if x.startswith("4. "))
    assert "worst deviation 0.2%" in line and "**met**" in line


def test_fixture_trained_context_is_where_its_loss_jumps():
    """FIXTURE_TRAINED_CONTEXT is a measured property of the bundled model: its next-byte loss on held-out text is
    low up to that position and far higher past it (the fixture bench warns beyond it)."""
    from transformers import AutoModelForCausalLM

    from ckvp_compile.bench.decode_fixture import FIXTURE_TRAINED_CONTEXT, default_model_dir

    d = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, local_files_only=True).eval()
    text = (d / "eval_text.txt").read_bytes()
    n = 2 * FIXTURE_TRAINED_CONTEXT
    ids = torch.tensor([list(text[i:i + n]) for i in range(100_000, 100_000 + 4 * n, n)])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1),
                                            reduction="none").view(ids.shape[0], -1)
    inside = float(nll[:, FIXTURE_TRAINED_CONTEXT // 2:FIXTURE_TRAINED_CONTEXT - 1].mean())
    past = float(nll[:, FIXTURE_TRAINED_CONTEXT + 16:].mean())
    assert inside < 1.0 and past > 2 * inside, (inside, past)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=2, max_size=12), st.integers(0, 3))
def test_agreement_interval_brackets_the_resampled_shares(agree, seed):
    """agreement_interval: prompts of 8 tokens, the first ``a`` of each agreeing; the interval lies in [0, 1], low
    <= high, between the lowest and highest prompt share, the same for the same seed; all agreeing -> (1, 1)."""
    from ckvp_compile.bench.decode_report import agreement_interval

    dense = [[1] * 8 for _ in agree]
    gen = [[1] * a + [2] * (8 - a) for a in agree]
    lo, hi = agreement_interval(dense, gen, seed=seed)
    assert min(agree) / 8 <= lo <= hi <= max(agree) / 8
    assert agreement_interval(dense, gen, seed=seed) == (lo, hi)
    if len(set(agree)) > 1:  # prompts that differ: the resampled shares spread
        assert lo < hi
    assert agreement_interval(dense, dense) == (1.0, 1.0)
    assert agreement_interval(dense[:1], gen[:1]) is None
    with pytest.raises(ValueError, match="differ"):
        agreement_interval(dense, gen[:-1])
    with pytest.raises(ValueError, match="level"):
        agreement_interval(dense, gen, level=1.0)


def test_report_kivi_reference_uses_the_check_rows_prompts(tmp_path):
    """Acceptance line 5's KIVI reference reads the baseline rows on the ckvp row's own prompts (the same prompt
    starts), not those of another run; without such rows it names the prompt set it used. The CLI draws the fidelity
    plot from such files (KIVI points, a single-ratio configuration)."""
    from dataclasses import asdict

    from ckvp_compile.bench.decode_fixture import FixtureRow
    from ckvp_compile.bench.decode_report import render_markdown

    def run(starts, kivi_agreement, ckvp):
        n = len(starts)
        dense = [[1] * 4] * n
        rows = [FixtureRow(None, None, 1.0, 4.0, 4 * n, n, generated=dense)]
        if kivi_agreement is not None:
            rows.append(FixtureRow(None, "KIVI-3 g32 r16 (baseline)", kivi_agreement, 2.0, 4 * n, n, baseline="kivi:3:32:16",
                                   ratio_format=4.0, generated=dense))
        if ckvp:
            rows.append(FixtureRow(4.0, "planned", 0.8, 3.0, 4 * n, n, 4.0, 3.1, 4096, generated=dense))
        meta = {"prompt_starts": starts, "prompt_len": 128, "new_tokens": 4, "command": "x", "date": "d"}
        return {"kind": "fixture", "meta": meta, "rows": [asdict(r) for r in rows]}

    small, big = list(range(0, 64, 4)), list(range(64))
    md = render_markdown([run(small, 0.7, False), run(big, 0.6, True)], plots=None)
    line = next(l for l in md.splitlines() if l.startswith("5. Fixture"))
    assert "KIVI on the same prompts: at 4x (its format) 60.0%" in line and "64 prompts" in line, line
    md = render_markdown([run(small, 0.7, False), run(big, None, True)], plots=None)
    line = next(l for l in md.splitlines() if l.startswith("5. Fixture"))
    assert "KIVI on 16 prompts (not the row's): at 4x (its format) 70.0%" in line, line
    files = []
    for i, d in enumerate((run(small, 0.7, False), run(big, 0.6, True))):
        files.append(tmp_path / f"f{i}.json")
        files[-1].write_text(json.dumps(d))
    assert bench_cli(["decode", "--report", *map(str, files), "--markdown", str(tmp_path / "B.md"), "--plots",
                      str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "decode_fidelity.png").stat().st_size > 10_000
