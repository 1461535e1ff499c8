"""examples/generate.py (the README's main job) checks every option value before any model work: a bad value is
a usage error (exit status 2) naming the valid values, not a failure after minutes of eager runs."""

import importlib.util

import pytest

from ckvp_compile.testing.models import FIXTURE_MODEL_DIR

ROOT = FIXTURE_MODEL_DIR.parents[1]


@pytest.fixture
def example(monkeypatch):
    """The example module, with ``load`` (the first model work) replaced by a sentinel that records the call."""
    spec = importlib.util.spec_from_file_location("generate_example", ROOT / "examples" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Loaded(Exception):
        pass

    def load(*a, **k):
        raise Loaded

    monkeypatch.setattr(mod, "load", load)
    mod.Loaded = Loaded
    return mod


@pytest.mark.parametrize("argv, needle", [
    (["--kv-ratio", "4", "--latent-format", "int5"], "'float', 'int8', 'int4' or 'int2'"),
    (["--latent-format", "int4/3"], "--latent-format: latent format 'int4/3': the block must be"),
    (["--kv-ratio", "0.5"], "--kv-ratio must be a finite number >= 1"),
    (["--kv-ratio", "nan"], "--kv-ratio must be a finite number >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt="], "--prompt must not be empty"),
    (["--budget-len", "0"], "--budget-len must be >= 1"),
    (["--recent-window", "-1"], "--recent-window must be >= 0"),
    (["--recent-window", "4096"], "--recent-window 4096 must be below --budget-len 4096"),
    (["--device", "tpu"], "use cpu, cuda or cuda:N"),
    (["--group-size", "3"], "invalid choice"),
    (["--dense", "--kv-ratio", "4"], "--dense keeps a dense cache and --kv-ratio asks for a latent one"),
    (["--expert-gemm", "maybe"], "invalid choice"),
])
def test_bad_option_values_fail_before_any_model_work(example, argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        example.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "generate.py: error:" in err and needle in err, err


@pytest.mark.parametrize("argv", [[], ["--kv-ratio", "4", "--latent-format", "int4/64", "--recent-window", "8"],
                                  ["--kv-ratio", "2", "--latent-format", "float"], ["--latent-format", "mxint4"],
                                  ["--dense", "--expert-gemm", "off"]])
def test_good_option_values_reach_the_model(example, argv):
    with pytest.raises(example.Loaded):
        example.main(["--device", "cpu", *argv])


def test_rewrite_summary_names_rewritten_layers_and_kept_reasons(example):
    """The summary the main job prints: rewritten layers as ranges over every graph, kept layers with reasons."""
    from types import SimpleNamespace as NS

    from ckvp_compile.plan import SiteDecision

    def graph(i, decisions, fell_back=""):
        return NS(index=i, plan=NS(decisions=tuple(decisions)), fell_back=fell_back)

    rec = NS(graphs=[
        graph(0, [SiteDecision("attention", layer, True, "latent group 0") for layer in (0, 1, 2, 5)]
              + [SiteDecision("moe", 0, False, "enable_expert_gemm is off: set enable_expert_gemm=True to rewrite")]),
        graph(1, [SiteDecision("attention", 3, False, "no KV-cache write found")]),
        graph(2, [SiteDecision("moe", 1, True, "rewrite")], fell_back="a pass failed"),
    ])
    text = example.rewrite_summary(rec)
    assert "latent KV attention (ckvp::latent_attention): layers 0-2, 5" in text
    assert "  kept: no KV-cache write found" in text
    assert "grouped GEMMs (ckvp::moe_experts): no layer" in text and "kept: enable_expert_gemm is off" in text
    assert "graph 2 compiled unchanged: a pass failed" in text
    # the backend's fix names its Python option; the example's line names its own flag
    assert "kept: enable_expert_gemm is off: pass --expert-gemm on (enable_expert_gemm=True) to rewrite" in text


def test_missing_calibration_text_names_both_fixes(example, tmp_path, capsys):
    """--kv-ratio on a model directory without eval_text.txt: the error says to add text or to pass --dense."""
    with pytest.raises(SystemExit) as exc:
        example.latent_cache(None, tmp_path, None, None, 64)
    msg = capsys.readouterr().err
    assert exc.value.code == 2 and msg.startswith("generate.py: error:"), msg
    assert "eval_text.txt does not exist" in msg and "put some text" in msg and "pass --dense" in msg, msg


def test_a_directory_without_config_is_a_usage_error(tmp_path, capsys):
    """--model on a folder without config.json: exit status 2 like every bad option (1 means a dense run that
    did not match eager), naming the fix."""
    spec = importlib.util.spec_from_file_location("generate_example_load", ROOT / "examples" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--model", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "is not a Hugging Face model directory" in err and "pass --model DIR" in err


def test_saved_bases_path_is_one_file_per_model_and_settings(example):
    """The bases behind the printed ckvp-inspect command: the same settings reuse one temporary file (runs do not
    pile up files), other settings get another."""
    args = example.parse_args(["--kv-ratio", "4"])
    first = example._bases_path(args)
    assert first == example._bases_path(args) and first.name.startswith("ckvp_generate_bases_")
    args.kv_ratio = 8.0
    assert example._bases_path(args) != first
