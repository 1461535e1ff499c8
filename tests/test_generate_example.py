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
    (["--budget-len", "0"], "--budget-len must be >= 1"),
    (["--recent-window", "-1"], "--recent-window must be >= 0"),
    (["--device", "tpu"], "use cpu, cuda or cuda:N"),
    (["--group-size", "3"], "invalid choice"),
])
def test_bad_option_values_fail_before_any_model_work(example, argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        example.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "generate.py: error:" in err and needle in err, err


@pytest.mark.parametrize("argv", [[], ["--kv-ratio", "4", "--latent-format", "int4/64", "--recent-window", "8"],
                                  ["--kv-ratio", "2", "--latent-format", "float"], ["--latent-format", "mxint4"]])
def test_good_option_values_reach_the_model(example, argv):
    with pytest.raises(example.Loaded):
        example.main(["--device", "cpu", *argv])
