"""ckvp-inspect and ``ckvp_compile.inspect`` driven the way users drive them, each case a report that once misled
(2026-12-07, a helper's attempt to break the tool): the model's state, the JSON against the text, the KV bytes of
refused layers, graph breaks, dtypes, output files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckvp_compile import CKVPConfigError
from ckvp_compile.inspection import inspect_model
from ckvp_compile.inspection.cli import main
from ckvp_compile.testing import GptFastConfig, GptFastMoE, build_hf_moe

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("latent", [None, {"kv_ratio": 2, "num_samples": 1, "sample_len": 8}])
def test_inspect_puts_a_gpt_fast_models_cache_setup_back(latent):
    """The user's caches (batch 4, 64 slots) were left as the inspection's (batch 1, 128): the next batch-4 call
    failed with a broadcast error."""
    torch.manual_seed(0)
    model = GptFastMoE(GptFastConfig(n_layer=2)).eval()
    model.setup_caches(4, 64)
    ids = torch.randint(0, 256, (4, 5))
    with torch.no_grad():
        before = model(ids, torch.arange(5))
    cache = model.layers[0].attention.kv_cache
    inspect_model(model, latent=latent)
    assert model.layers[0].attention.kv_cache is cache and (model.max_batch_size, model.max_seq_length) == (4, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(5)), before)


def test_json_decisions_are_the_ones_the_text_shows():
    """GELU experts: the plan meant to rewrite them, the expert GEMM pass left them (not SwiGLU). The text said
    'kept'; the JSON's plan still said rewrite=True. Now the JSON's decisions are the effective ones, and the plan's
    own are under 'planned_decisions'."""
    model = build_hf_moe("mixtral", hidden_act="gelu")
    report = inspect_model(model, options={"enable_expert_gemm": True}, decode=False)
    g = report.graphs[0]
    text_moe = [ln for ln in g.decision_lines() if ln.startswith("moe")]
    assert text_moe and all(": kept: the expert GEMM pass:" in ln for ln in text_moe), text_moe
    plan = json.loads(json.dumps(report.to_dict()))["graphs"][0]["plan"]
    moe = [d for d in plan["decisions"] if d["kind"] == "moe"]
    assert moe and not any(d["rewrite"] for d in moe), moe
    assert any(d["rewrite"] for d in plan["planned_decisions"] if d["kind"] == "moe")


def _sliding_window_model(layer_types):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=256, hidden_size=64, num_hidden_layers=len(layer_types),
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                               max_position_embeddings=512, sliding_window=4, use_sliding_window=True,
                               layer_types=layer_types, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_kv_bytes_name_the_refused_layers_instead_of_no_cache_write():
    """Sliding-window layers write a KV cache that stays dense: the line said 'no KV-cache write found' (all
    refused) or counted the other layers silently (some refused)."""
    every = inspect_model(_sliding_window_model(["sliding_attention"] * 2), decode=False).graphs[0]
    assert every.kv_bytes_line() == ("n/a (no attention site to count: the KV caches of layers [0-1] are left dense "
                                     "for the reasons under unsupported)")
    mixed = inspect_model(_sliding_window_model(["sliding_attention", "full_attention", "full_attention"]),
                          decode=False).graphs[0]
    dense = 2 * 2 * 16 * 4 * 2  # 2 counted layers x Hkv 2 x D 16 x (K + V) x fp32
    assert mixed.kv_bytes_line() == (f"{dense} -> {dense} (unchanged; counts the attention sites only: layer [0] "
                                     "left dense and not counted, see unsupported)")


def test_a_graph_break_between_layers_is_said_in_the_summary():
    """HF experts_implementation='eager' breaks the graph in every layer: the summary said '1 attention sites' and
    the KV bytes of one layer for a 2-layer model, with no word that it is one graph's share."""
    report = inspect_model(build_hf_moe("mixtral", num_layers=2, experts_implementation="eager"), decode=False)
    text = report.to_text()
    assert "note: the prefill was captured as" in text and "graphs with sites (graph breaks)" in text, text[:2000]


def test_cli_bf16_checkpoint_with_dtype_auto(tmp_path, capsys):
    """The CLI loads float32 by default (the README's numbers); --dtype auto inspects a bf16 checkpoint as stored:
    half the dense KV bytes."""
    model = build_hf_moe("mixtral", num_layers=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")

    def kv_line(*extra):
        assert main(["--model", str(tmp_path / "m"), "--no-decode", *extra]) == 0
        return next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("KV bytes/token"))

    fp32, auto = kv_line(), kv_line("--dtype", "auto")
    dense = int(fp32.split()[2])
    assert int(auto.split()[2]) * 2 == dense, (fp32, auto)


@pytest.mark.parametrize("args, needle", [
    (["--html", "{d}/r.out", "--json", "{d}/r.out"], "--html and --json name the same file"),
    (["--bases", "{d}/b.safetensors", "--html", "{d}/b.safetensors"], "--html and --bases name the same file"),
    (["--options", '{"expert_offload": 2}'], "cannot offload its experts before compiling"),
])
def test_cli_refuses_before_compiling(args, needle, tmp_path, capsys, no_compiling):
    """Two flags on one file overwrote one (the bases with HTML); expert_offload compiled first, then failed."""
    (tmp_path / "b.safetensors").write_bytes(b"x")
    assert main(["--model", "x", *[a.replace("{d}", str(tmp_path)) for a in args]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert (tmp_path / "b.safetensors").read_bytes() == b"x"


def test_latent_num_samples_must_be_an_int():
    model = build_hf_moe("mixtral", num_layers=1)
    with pytest.raises(CKVPConfigError, match="num_samples and sample_len must be ints"):
        inspect_model(model, latent={"kv_ratio": 2, "num_samples": 2.5})


def test_cli_a_reader_that_stops_early_does_not_cost_the_files(tmp_path):
    """`ckvp-inspect ... --json r.json | head -1` exited 2 on the broken pipe before writing the JSON."""
    model = build_hf_moe("mixtral", num_layers=1)
    model.save_pretrained(tmp_path / "m")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, "-m", "ckvp_compile.inspection", "--model", str(tmp_path / "m"),
                             "--no-decode", "--full", "--json", str(tmp_path / "r.json"), "--html",
                             str(tmp_path / "r.html")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"ckvp inspection of")
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    assert json.loads((tmp_path / "r.json").read_text())["graphs"] and (tmp_path / "r.html").stat().st_size > 0


def test_cli_a_checkpoint_with_its_own_code_is_refused_not_prompted(tmp_path, capsys):
    """transformers asked 'Do you wish to run the custom code? [y/N]' on stdout (into the report stream) and
    waited for a terminal; the CLI never runs a checkpoint's own code."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "custom", "auto_map": {"AutoConfig": "cfg.C", "AutoModelForCausalLM": "mod.M"}}))
    assert main(["--model", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "trust_remote_code=False" in out.err and "ckvp_compile.inspect(model)" in out.err
