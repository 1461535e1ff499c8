"""``ckvp-bench`` on bad arguments a user would give on a CPU machine: each is a one-line usage error (exit status 2)
before any run, never a traceback after one, and no output is silently overwritten."""

from __future__ import annotations

import json

import pytest
import torch

from ckvp_compile.bench.cli import main

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


def _usage_error(argv, capsys) -> str:
    """Run ``ckvp-bench argv``; assert a usage error (status 2, argparse's SystemExit or a returned 2) and return
    stderr's last line."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("sub", [["attention", "--tiny", "--device", "cpu"], ["moe", "--tiny"],
                                 ["decode", "--shape", "tiny"], ["fidelity"]])
def test_an_output_path_that_is_a_directory_is_refused_before_the_run(sub, tmp_path, capsys):
    flag = "--json"
    line = _usage_error(sub + [flag, str(tmp_path)], capsys)
    assert "is a directory" in line


@pytest.mark.parametrize("sub, second", [(["attention", "--tiny", "--device", "cpu"], "--out"),
                                         (["moe", "--tiny"], "--out"), (["decode", "--shape", "tiny"], "--out"),
                                         (["fidelity"], "--plot")])
def test_two_outputs_on_one_path_are_refused(sub, second, tmp_path, capsys):
    same = str(tmp_path / "r.txt")
    line = _usage_error(sub + ["--json", same, second, same], capsys)
    assert "same file" in line
    assert not (tmp_path / "r.txt").exists()


@pytest.mark.parametrize("sub", [["attention", "--tiny", "--device", "cpu"], ["moe", "--tiny"], ["fidelity"]])
def test_an_output_in_a_missing_directory_is_refused(sub, tmp_path, capsys):
    line = _usage_error(sub + ["--json", str(tmp_path / "no" / "r.json")], capsys)
    assert "does not exist" in line


@no_cuda
@pytest.mark.parametrize("sub", [["moe", "--tiny"], ["fidelity"]])
def test_device_cuda_without_cuda_says_so(sub, capsys):
    line = _usage_error(sub + ["--device", "cuda"], capsys)
    assert "CUDA is not available" in line and "cpu" in line


def test_moe_unknown_device_is_a_usage_error(capsys):
    assert "--device 'foo'" in _usage_error(["moe", "--tiny", "--device", "foo"], capsys)


def test_offload_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    line = _usage_error(["offload", "--recall-only", "--out", str(f)], capsys)
    assert "is a file" in line


@pytest.mark.parametrize("flag", ["--windows", "--window-len"])
@pytest.mark.parametrize("n", ["0", "-1"])
def test_offload_windows_below_one_are_refused(flag, n, tmp_path, capsys):
    line = _usage_error(["offload", "--recall-only", "--out", str(tmp_path / "o"), flag, n], capsys)
    assert f"{flag} must be >= 1" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["{bad", json.dumps({"settings": {}})])
def test_fidelity_from_json_of_another_file_is_a_usage_error(text, tmp_path, capsys):
    f = tmp_path / "r.json"
    f.write_text(text)
    assert "--from-json" in _usage_error(["fidelity", "--from-json", str(f)], capsys)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"meta": {}}'])
def test_decode_report_of_another_file_is_a_usage_error(text, tmp_path, capsys):
    """``decode --report`` on a file that is not a ``decode --json`` file ended in a JSONDecodeError / KeyError
    traceback half-way through the report; now a usage error naming the file, and no markdown written."""
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    md = tmp_path / "r.md"
    msg = _usage_error(["decode", "--report", str(bad), "--markdown", str(md)], capsys)
    assert "not a ckvp-bench decode --json file" in msg and not md.exists()
