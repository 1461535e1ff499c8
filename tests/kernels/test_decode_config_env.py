"""CKVP_DECODE_CONFIG: a JSON override of the latent attention's default launch configuration."""

import pytest

pytest.importorskip("triton")

from ckvp_compile.kernels import latent_attention_triton as lat  # noqa: E402


def test_override_applies_over_each_default(monkeypatch):
    monkeypatch.delenv(lat.CONFIG_ENV, raising=False)
    g1, g4 = lat.default_config(1, 256), lat.default_config(4, 256)
    assert g1.hoist_basis and g1.fma_values and not g4.hoist_basis
    monkeypatch.setenv(lat.CONFIG_ENV, '{"num_stages": 1, "block_n_v": 64, "split": null}')
    for base, got in ((g1, lat.default_config(1, 256)), (g4, lat.default_config(4, 256))):
        assert (got.num_stages, got.block_n_v) == (1, 64)
        assert got.hoist_basis == base.hoist_basis and got.fma_values == base.fma_values  # the rest kept


@pytest.mark.parametrize("text, match", [('{"bogus": 1}', "unknown DecodeConfig field"), ("num_stages=1", "not JSON"),
                                         ("[1, 2]", "unknown DecodeConfig field"),
                                         ('{"num_warps": "8"}', "takes int"), ('{"two_pass": 1}', "takes bool"),
                                         ('{"num_stages": null}', "takes int")])
def test_bad_override_names_the_fix(monkeypatch, text, match):
    monkeypatch.setenv(lat.CONFIG_ENV, text)
    with pytest.raises(ValueError, match=match) as e:
        lat.default_config(4, 256)
    assert lat.CONFIG_ENV in str(e.value)


def test_bench_command_records_the_override(monkeypatch):
    from ckvp_compile.bench.output import run_env

    monkeypatch.setenv(lat.CONFIG_ENV, '{"num_stages": 1}')
    assert run_env(0.0, ["x.py"])["command"].startswith("CKVP_DECODE_CONFIG=")
    from ckvp_compile.bench.decode import environment

    assert environment("cpu", ["--shape", "tiny"])["command"] == (
        """CKVP_DECODE_CONFIG='{"num_stages": 1}' ckvp-bench decode --shape tiny""")
    monkeypatch.delenv(lat.CONFIG_ENV)
    assert run_env(0.0, ["x.py"])["command"] == "python3 x.py"
    assert environment("cpu", ["--shape", "tiny"])["command"] == "ckvp-bench decode --shape tiny"
