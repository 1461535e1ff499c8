"""The inspection tool: the ckvp-inspect CLI on the fixture model, its errors, the diff machinery, the renderers."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import ckvp_compile
from ckvp_compile import CKVPConfig, make_plan
from ckvp_compile.analysis.sites import (
    AttentionSite,
    CacheWriteSite,
    GraphAnalysis,
    MoESite,
    RopeSite,
    SharedExpertSite,
    UnsupportedSite,
)
from ckvp_compile.inspection import GraphReport, InspectionReport, LayerRow, inspect_model
from ckvp_compile.inspection.cli import main
from ckvp_compile.passes import CKVPPass
from ckvp_compile.testing.models import FIXTURE_MODEL_DIR

REPO_ROOT = Path(ckvp_compile.__file__).absolute().parents[1]

# ---------------------------------------------------------------------------------------------- helpers

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _WellFormed(HTMLParser):
    """Checks that every non-void tag is closed in order; counts tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: Counter[str] = Counter()
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] += 1
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'} at {self.getpos()}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def check_html(page: str) -> _WellFormed:
    """Parse ``page``; assert balanced tags, the main structure, and no external resources or scripts."""
    p = _WellFormed()
    p.feed(page)
    p.close()
    assert not p.errors, p.errors[:5]
    assert not p.stack, f"unclosed tags: {p.stack}"
    assert page.lstrip().lower().startswith("<!doctype html>")
    for tag in ("html", "head", "body", "style", "title", "h1"):
        assert p.tags[tag] >= 1, tag
    assert p.tags["script"] == 0 and p.tags["link"] == 0 and p.tags["img"] == 0
    assert "http://" not in page and "https://" not in page
    return p


def table_header_index(lines: list[str]) -> int:
    """Index of the first text line whose cells are the layer table's column titles."""
    return next(i for i, ln in enumerate(lines) if tuple(c.strip() for c in ln.split("|")) == LayerRow.HEADERS)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "ckvp_compile.inspection", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckvp-inspect: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------- the CLI


def test_cli_on_fixture_model(tmp_path):
    html_path, json_path = tmp_path / "out.html", tmp_path / "out.json"
    proc = run_cli("--model", str(FIXTURE_MODEL_DIR), "--html", str(html_path), "--json", str(json_path),
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "model summary: 8 attention sites, 8 MoE sites, 2 groups: [0-3] [4-7]" in text
    assert "groups: [0-3] [4-7]" in text
    assert "=== graph 0 (prefill)" in text and "(decode)" in text
    lines = text.splitlines()
    header = table_header_index(lines)
    rows = lines[header + 2: header + 10]
    assert [r.split("|")[0].strip() for r in rows] == [str(i) for i in range(8)]
    assert all("sdpa" in r and "4/2/64" in r and "index_copy_" in r and "4/2" in r for r in rows), rows
    assert all("rotate_half d=64 paired" in r for r in rows), rows  # HF's cat((freqs, freqs)) tables, proven
    assert "KV bytes/token: 8192 -> 8192 (unchanged)" in text  # 8 layers * 2 Hkv * 64 D * (4 + 4) bytes fp32

    page = html_path.read_text()
    parsed = check_html(page)
    assert 'class="layers"' in page and "<th>H/Hkv/D</th>" in page and "<th>experts form</th>" in page
    assert "8 attention sites, 8 MoE sites, 2 groups: [0-3] [4-7]" in "".join(parsed.text)
    assert parsed.tags["tr"] >= 1 + 8  # header + one row per layer

    data = json.loads(json_path.read_text())
    assert data["summary"]["num_attention_sites"] == 8 and data["summary"]["num_moe_sites"] == 8
    assert data["summary"]["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g["phase"] for g in data["graphs"]][:1] == ["prefill"]


def test_cli_bad_path(tmp_path):
    proc = run_cli("--model", str(tmp_path / "no-such-model"), cwd=tmp_path)
    assert_one_line_error(proc, "does not exist", "no-such-model")


def test_cli_directory_without_model(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli("--model", str(tmp_path / "empty"), cwd=tmp_path)
    assert_one_line_error(proc, "config.json")


def test_cli_bad_option(tmp_path):
    proc = run_cli("--model", str(FIXTURE_MODEL_DIR), "--options", '{"bogus_option": 1}', cwd=tmp_path)
    assert_one_line_error(proc, "bogus_option", "valid keys")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--options", "{not json"], "not valid JSON"),
        (["--options", "[1, 2]"], "JSON object"),
        (["--options", '{"group_size": 3}'], "group_size"),
        (["--options", '{"inductor": {"max_autotun": true}}'], "Did you mean 'max_autotune'"),
        (["--options", '{"inductor": {"max_autotune": 1}}'], "must be a bool"),
        (["--compiler", "tvm"], "invalid choice"),
        (["--html", "/no/such/dir/out.html"], "does not exist"),
        (["--prompt-len", "128"], "--max-cache-len"),
    ],
)
def test_cli_usage_errors_in_process(args, needle, capsys):
    assert main(["--model", str(FIXTURE_MODEL_DIR), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ckvp-inspect: error: ") and needle in err[0], err


def test_cli_output_paths_checked_before_compiling(tmp_path, capsys, monkeypatch, no_compiling):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        (["--html", str(tmp_path)], "is a directory"),
        (["--json", str(tmp_path)], "is a directory"),
        (["--json", str(a_file / "out.json")], "is not a directory"),
        (["--html", str(tmp_path / "missing" / "out.html")], "does not exist"),
    ]
    for args, needle in cases:
        assert main(["--model", str(FIXTURE_MODEL_DIR), *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ckvp-inspect: error: ") and needle in err[0], (args, err)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # an unwritable directory (tests may run as root)
    assert main(["--model", str(FIXTURE_MODEL_DIR), "--html", str(tmp_path / "out.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not writable" in err[0], err


def test_cli_warns_in_one_line_when_inductor_options_are_ignored(capsys, monkeypatch):
    from ckvp_compile.errors import CKVPModelLoadError
    from ckvp_compile.inspection import capture

    def not_loadable(path, dtype="float32"):
        raise CKVPModelLoadError("stop here")

    monkeypatch.setattr(capture, "load_model_dir", not_loadable)
    assert main(["--model", "x", "--options", '{"inductor": {"max_autotune": true}}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("ckvp-inspect: warning: ") and "ignored" in err[0], err
    assert "compiler='aot_eager'" in err[0] and err[1] == "ckvp-inspect: error: stop here"


def test_cli_unloadable_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "not-a-real-architecture"}')
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot load a causal LM" in err[0], err
    not_dir = tmp_path / "file.txt"
    not_dir.write_text("x")
    assert main(["--model", str(not_dir)]) == 2
    assert "not a model directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the diff machinery


class SinToCosPass(CKVPPass):
    """Test pass ('torch' stage): ``x.sin()`` -> ``torch.cos(x)``."""

    name = "sin_to_cos"
    stage = "torch"

    def apply(self, graph):
        n_rewritten = 0
        for node in list(graph.nodes):
            if node.op == "call_method" and node.target == "sin":
                with graph.inserting_before(node):
                    new = graph.call_function(torch.cos, node.args, node.kwargs)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
                n_rewritten += 1
        return n_rewritten


class DoubleNegPass(CKVPPass):
    """Test pass ('post_grad' stage): insert ``neg(neg(.))`` after the ``aten.cos`` node (a no-op numerically)."""

    name = "double_neg"
    stage = "post_grad"

    def apply(self, graph):
        for node in graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.cos.default:
                with graph.inserting_after(node):
                    first = graph.call_function(torch.ops.aten.neg.default, (node,))
                with graph.inserting_after(first):
                    second = graph.call_function(torch.ops.aten.neg.default, (first,))
                node.replace_all_uses_with(second)
                first.args = (node,)
                return 1
        return 0


class SinModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).sin() + 1


def test_diff_shows_rewrites_and_replaced_counts():
    model = SinModel()
    x = torch.randn(2, 4)
    expected = model(x)
    report = inspect_model(model, (x,), extra_passes=[SinToCosPass(), DoubleNegPass()])
    assert [g.phase for g in report.graphs] == ["call"]
    g = report.graphs[0]
    dynamo, post_grad = g.diffs
    assert dynamo.changed and (dynamo.added, dynamo.removed) == (2, 2)
    assert any(ln.startswith("-") and ".sin()" in ln for ln in dynamo.lines)
    assert any(ln.startswith("+") and "torch.cos(" in ln for ln in dynamo.lines)
    assert post_grad.changed and post_grad.added == 3 and post_grad.removed == 1
    assert sum(ln.startswith("+") and "aten.neg.default" in ln for ln in post_grad.lines) == 2
    assert g.replaced == {"sin": 1}
    assert [(r.name, r.stage, r.matched) for r in g.pass_results] == [("sin_to_cos", "torch", 1),
                                                                     ("double_neg", "post_grad", 1)]

    text = report.to_text()
    assert "replaced nodes: sin x1" in text and "+2 -2 lines" in text and "+3 -1 lines" in text
    assert "sin_to_cos (torch): 1 site(s) rewritten" in text
    page = report.to_html()
    check_html(page)
    assert '<span class="add">+    cos = torch.cos(linear)' in page
    assert '<span class="del">-    sin = linear.sin()' in page
    json.dumps(report.to_dict())

    torch.testing.assert_close(model(x), expected)  # still runs eagerly, unchanged


def test_inspect_a_model_whose_forward_is_already_compiled():
    """model.forward = torch.compile(model.forward, ...) before inspection: the graph is still captured and
    rewritten in the report, and the user's compiled forward is back in place afterwards."""
    model = SinModel()
    x = torch.randn(2, 4)
    compiled = torch.compile(model.forward, backend="eager")
    model.forward = compiled
    report = inspect_model(model, (x,), extra_passes=[SinToCosPass()])
    assert [g.phase for g in report.graphs] == ["call"] and report.graphs[0].replaced == {"sin": 1}
    assert model.forward is compiled


def test_text_diffs_truncate_unless_full():
    class ManySin(torch.nn.Module):
        def forward(self, x):
            for _ in range(60):
                x = x.sin()
            return x

    report = inspect_model(ManySin(), (torch.randn(3),), options={"compiler": "eager"},
                           extra_passes=[SinToCosPass()])
    short, full = report.to_text(), report.to_text(full=True)
    assert "more diff lines" in short and "more diff lines" not in full
    assert full.count("torch.cos(") == 60 and short.count("torch.cos(") < 60
    assert "not recorded" in short  # compiler='eager' has no post-grad graph


def test_hf_model_inspection_leaves_model_usable():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURE_MODEL_DIR, dtype=torch.float32,
                                                 local_files_only=True).eval()
    ids = torch.arange(1, 6)[None]
    with torch.no_grad():
        before = model(ids).logits
    report = ckvp_compile.inspect(model, decode=False, prompt_len=4, max_cache_len=16)
    assert report.graphs and {g.phase for g in report.graphs} == {"prefill"}
    assert report.num_attention_sites == 8 and report.num_moe_sites == 8
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)


def test_inspect_model_argument_errors():
    with pytest.raises(ValueError, match="example_inputs"):
        inspect_model(SinModel())
    with pytest.raises(ckvp_compile.CKVPConfigError, match="valid keys"):
        inspect_model(SinModel(), (torch.randn(1, 4),), options={"nope": 1})
    with pytest.raises(ckvp_compile.CKVPModelLoadError, match="does not exist"):
        inspect_model("/no/such/model/dir")


# ---------------------------------------------------------------------------------------------- the renderers


def _synthetic_report(config: CKVPConfig | None = None) -> InspectionReport:
    """A report built from hand-made sites (independent of the detectors): 3 layers, one unsupported pattern;
    planned under ``config`` (default ``CKVPConfig(group_size=2)``)."""
    config = config or CKVPConfig(group_size=2)

    def attn(layer: int, partial: bool = False) -> AttentionSite:
        cache = lambda kind: CacheWriteSite(kind, "index_copy_", f"w{kind}{layer}", f"c{kind}{layer}",  # noqa: E731
                                            "graph", f"v{kind}{layer}", "pos", (1, 2, 64, 16), itemsize=2)
        rope = RopeSite("rotate_half", 8 if partial else 16, partial, "q", "k", "kin")
        return AttentionSite(layer, f"model.layers.{layer}.self_attn", "sdpa", f"sdpa{layer}", "q", "k", "v", "o",
                             4, 2, 16, 2, "repeat_kv", rope, cache("k"), cache("v"))

    def moe(layer: int, shared: bool) -> MoESite:
        se = SharedExpertSite(("su",), "sd", "sg", "add") if shared else None
        return MoESite(layer, f"model.layers.{layer}.mlp", "router", "softmax", "sm", "topk", 8, 2, True, True,
                       "batched_mm", ("bmm",), ("w",), 32, 64, se, "out")

    analysis = GraphAnalysis(
        attention=(attn(0), attn(1), attn(2, partial=True)),
        moe=(moe(0, False), moe(1, True)),
        unsupported=(UnsupportedSite("sliding_window", 2, "a <b>sliding</b> window & mask was found.",
                                     "set sliding_window=None."),),
        num_nodes=123,
    )
    plan = make_plan(analysis, config)
    graph = GraphReport(0, analysis, plan, "def f():\n    return x < 1\n", "def f():\n    return x < 2\n", phase="prefill")
    return InspectionReport("synthetic <model>", config, [graph], ["ckvp: a <warning>"], 0.5)


def test_text_report_table_and_summary():
    report = _synthetic_report()
    assert (report.num_attention_sites, report.num_moe_sites) == (3, 2)
    text = report.to_text()
    assert "model summary: 3 attention sites, 2 MoE sites, 2 groups: [0-1] [2]" in text
    lines = text.splitlines()
    header = table_header_index(lines)
    assert set(lines[header + 1]) == {"-", "+"}
    row0, row1, row2 = (ln.split("|") for ln in lines[header + 2: header + 5])
    assert [c.strip() for c in row0] == ["0", "sdpa", "4/2/16 GQA 2 (repeat_kv)", "rotate_half d=16", "index_copy_",
                                         "softmax then top-k, renorm", "8/2", "batched_mm"]
    assert "+shared (gated)" in row1[5]
    assert row2[3].strip() == "rotate_half d=8 partial" and row2[5].strip() == "-"
    assert "KV bytes/token: 384 -> 384 (unchanged)" in text  # 3 layers * 2 Hkv * 16 D * (2 + 2) bytes
    assert "layer 2 [sliding_window]: a <b>sliding</b> window & mask was found. Fix: set sliding_window=None." in text
    assert "attention [0-1]: kept: dense cache: give the model a ckvp latent cache" in text
    assert "attention [2]: kept: an unsupported attention pattern" in text
    assert "+1 -1 lines" in text and "not recorded" in text


def test_decisions_name_the_option_of_a_rewrite_that_is_off():
    """Every site left as written because its feature is off has a decision saying so, with the option that turns
    it on: dense-cache attention with enable_latent_kv off, MoE with enable_expert_gemm off; a site
    kept for another reason keeps that reason."""
    report = _synthetic_report(CKVPConfig(group_size=2, enable_latent_kv=False, enable_expert_gemm=False))
    lines = report.graphs[0].decision_lines()
    assert ("attention [0-1]: kept: enable_latent_kv is off: set enable_latent_kv=True and give the model a ckvp "
            "latent cache") in "\n".join(lines), lines
    assert any(ln.startswith("attention [2]: kept: an unsupported attention pattern") for ln in lines), lines
    assert any(ln.startswith("moe [0-1]: kept: enable_expert_gemm is off: set enable_expert_gemm=True") for ln in lines)
    assert len(lines) == 3, lines  # one folded line per (kind, verdict, reason): every site has a decision
    text = report.to_text()
    assert all(ln in text for ln in lines)
    decisions = report.to_dict()["graphs"][0]["plan"]["decisions"]
    assert sorted((d["kind"], d["layer"]) for d in decisions) == [("attention", 0), ("attention", 1),
                                                                  ("attention", 2), ("moe", 0), ("moe", 1)]
    # the latent rewrite on (the default): the dense-cache reason says how to get a latent cache, not the option
    lines = _synthetic_report().graphs[0].decision_lines()
    assert any(ln.startswith("attention [0-1]: kept: dense cache: give the model a ckvp latent cache") for ln in lines)
    assert not any("enable_latent_kv" in ln for ln in lines), lines


def test_html_report_escapes_everything():
    report = _synthetic_report()
    page = report.to_html()
    parsed = check_html(page)
    assert "<b>" not in page and "&lt;b&gt;sliding&lt;/b&gt; window &amp; mask" in page
    assert "synthetic &lt;model&gt;" in page and "ckvp: a &lt;warning&gt;" in page
    assert '<span class="add">+    return x &lt; 2</span>' in page
    assert parsed.tags["tr"] == 1 + 3 + 1 + 1  # layer table header + 3 rows, unsupported header + 1 row
    json.dumps(report.to_dict())


def test_reports_print_the_analysis_notes():
    """A graph whose sites have no numbered module path carries a note; text, HTML and JSON all show it."""
    import dataclasses

    from ckvp_compile.analysis import UNNUMBERED_NOTE

    report = _synthetic_report()
    g = report.graphs[0]
    g.analysis = dataclasses.replace(g.analysis, notes=(UNNUMBERED_NOTE,))
    text = report.to_text()
    assert f"note: {UNNUMBERED_NOTE}" in text.splitlines()
    assert text.index("note: ") < text.index("\ngroups: ")
    assert f"note: {UNNUMBERED_NOTE}" in "".join(check_html(report.to_html()).text)
    assert json.loads(json.dumps(report.to_dict()))["graphs"][0]["analysis"]["notes"] == [UNNUMBERED_NOTE]
    assert "note:" not in _synthetic_report().to_text()


# ---------------------------------------------------------------------------------------------- latent KV cache


@pytest.fixture(scope="module")
def tiny_latent(tmp_path_factory):
    """A tiny 4-layer Mixtral saved as a model directory, and bases calibrated for it (G=2, ratio 4), saved too."""
    from ckvp_compile.inspection.latent import LatentInspectOptions, calibration_samples
    from ckvp_compile.latent import calibrate
    from ckvp_compile.testing import build_hf_moe

    root = tmp_path_factory.mktemp("tiny_latent")
    model = build_hf_moe("mixtral", num_layers=4)
    model.save_pretrained(root / "model")
    samples, _ = calibration_samples(model, LatentInspectOptions(kv_ratio=4, num_samples=2))
    bases = calibrate(model, samples, group_size=2, kv_ratio=4, progress=False)
    bases.save(root / "bases.safetensors")
    return root / "model", root / "bases.safetensors", model, bases


def test_calibration_text_is_read_as_bytes_for_a_byte_vocabulary(tmp_path):
    """A byte-level model (256 ids) calibrates on the file's raw bytes, as the fixture's scripts read it (invalid
    UTF-8 kept, not replaced by U+FFFD's three bytes); a tokenizer model refuses a file that is not UTF-8."""
    import types

    from ckvp_compile.errors import CKVPConfigError
    from ckvp_compile.inspection.latent import LatentInspectOptions, calibration_samples

    raw = bytes(range(256)) * 2  # every byte value, invalid UTF-8 included
    path = tmp_path / "bytes.txt"
    path.write_bytes(raw)
    model = torch.nn.Linear(1, 1)
    model.config = types.SimpleNamespace(vocab_size=256)
    samples, _ = calibration_samples(model, LatentInspectOptions(kv_ratio=4, text=str(path), num_samples=16))
    assert torch.cat(samples, 1)[0].tolist() == list(raw)
    model.config = types.SimpleNamespace(vocab_size=1000, _name_or_path="")
    with pytest.raises(CKVPConfigError, match="is not UTF-8"):
        calibration_samples(model, LatentInspectOptions(kv_ratio=4, text=str(path)))


def _latent_table(text: str) -> list[list[str]]:
    """Rows of the text report's latent-group table, as stripped cells."""
    from ckvp_compile.inspection.latent import LatentGroupRow

    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines)
                  if tuple(c.strip() for c in ln.split("|")) == LatentGroupRow.HEADERS)
    rows = []
    for ln in lines[header + 2:]:
        cells = [c.strip() for c in ln.split("|")]
        if len(cells) != len(LatentGroupRow.HEADERS):
            break
        rows.append(cells)
    return rows


def test_cli_kv_ratio_shows_the_latent_plan(tiny_latent, tmp_path, capsys):
    from ckvp_compile.latent import LatentBases
    from ckvp_compile.runtime.store import LatentKVStore

    model_dir = tiny_latent[0]
    html_path, json_path, bases_path = tmp_path / "r.html", tmp_path / "r.json", tmp_path / "b.safetensors"
    assert main(["--model", str(model_dir), "--kv-ratio", "4", "--group-size", "2", "--calibration-samples", "2",
                 "--html", str(html_path), "--json", str(json_path), "--save-bases", str(bases_path)]) == 0
    text = capsys.readouterr().out
    bases = LatentBases.load(bases_path)
    assert bases.groups == ((0, 1), (2, 3)) and bases.target_ratio == 4

    # the groups and the rank of every KV head for K and V are the calibrated bases'
    assert "latent KV (CKVP store the model ran with):" in text
    rows = _latent_table(text)
    assert [r[:4] for r in rows] == [[str(g), f"{a}-{b}", ",".join(map(str, bases.k_ranks[g])),
                                      ",".join(map(str, bases.v_ranks[g]))] for g, (a, b) in enumerate(bases.groups)]
    assert all(r[6] == r[7] == "float" for r in rows)
    assert "groups: [0-1] [2-3] (latent cache in groups #0, #1)" in text
    assert "page: 1 token (every token projected at its group's last layer); recent dense window: the current " \
           "call's tokens only" in text

    # the bytes are what a store of these bases holds (nbytes()), per token and in total
    store = LatentKVStore(bases, 1, 128, "cpu", torch.float32)  # ckvp-inspect's default --max-cache-len
    store.ensure_rope_tables(bases.head_dim)  # (S_max, D) cos and sin, allocated by the rewrite (rotate-half)
    nb = store.nbytes()
    per_token = nb.per_sequence_state // 128
    # 4 L * 2 Hkv * 16 D * 2 * 4 B; latents in the model's dtype: no second ratio
    assert f"KV bytes/token per sequence: dense 1024 (float32) -> latent {per_token} ({1024 / per_token:.2f}x " \
           "smaller; latent rows" in text
    assert (f"latents {nb.latent} + slot positions {nb.slot_positions} = {nb.per_sequence_state} B per-sequence "
            f"state vs dense {nb.dense_equivalent} B: ratio {nb.ratio:.2f}x; bases {nb.bases} B") in text
    assert f"KV bytes/token: 1024 -> {per_token} ({1024 / per_token:.2f}x smaller" in text

    # the rewrite ran on both graphs: cache writes removed, latent ops in the after-graph, shown per pass
    data = json.loads(json_path.read_text())
    assert [g["phase"] for g in data["graphs"]] == ["prefill", "decode"]
    for g in data["graphs"]:
        assert g["latent_groups"] == [0, 1] and g["replaced"]["index_copy_"] == 8
        assert "torch.ops.ckvp.latent_append" in g["code"]["dynamo_after"]
        assert "torch.ops.ckvp.latent_append" not in g["code"]["dynamo_before"]
        assert g["added_ckvp_ops"]["torch"]["ckvp.latent_append"] == 4  # K and V of 2 groups
        assert g["kv_bytes_per_token"]["latent"] == per_token
    assert sum("latent_kv_cache (torch): 4 site(s) rewritten" in ln and "index_copy_ x8" in ln
               and "added ckvp.latent_append x4" in ln for ln in text.splitlines()) == 2
    latent = data["latent"]
    assert latent["store_bytes"] == dataclasses.asdict(nb) and latent["latent_bytes_per_token"] == per_token
    assert [g["k_ranks"] for g in latent["groups"]] == [list(r) for r in bases.k_ranks]
    assert [g["v_ranks"] for g in latent["groups"]] == [list(r) for r in bases.v_ranks]

    page = html_path.read_text()
    parsed = check_html(page)
    assert 'class="latent"' in page and "<th>K ranks/head</th>" in page
    assert f"dense 1024 (float32) -&gt; latent {per_token}" in page and "recent dense window" in "".join(parsed.text)


def test_cli_latent_dtype_counts_against_that_dense_cache(tiny_latent, capsys):
    """--latent-dtype bfloat16 (examples/generate.py's store beside an fp32 model): bf16 bases, and the bytes and
    ratios also against a bf16 dense cache, as generate.py prints them (StoreBytes.ratio_vs(bfloat16))."""
    from ckvp_compile.runtime.store import LatentKVStore

    model_dir, bases_path, _, bases = tiny_latent
    assert main(["--model", str(model_dir), "--bases", str(bases_path), "--latent-dtype", "bfloat16",
                 "--max-cache-len", "16", "--prompt-len", "4", "--no-decode"]) == 0
    text = capsys.readouterr().out
    store = LatentKVStore(bases, 1, 16, "cpu", torch.float32, latent_dtype=torch.bfloat16)
    store.ensure_rope_tables(bases.head_dim)
    nb = store.nbytes()
    per_token = nb.per_sequence_state // 16
    assert "KV dtype float32, latent dtype bfloat16" in text
    assert (f"dense 1024 (float32) -> latent {per_token} ({1024 / per_token:.2f}x smaller; against a bfloat16 dense "
            f"cache (512) {512 / per_token:.2f}x;") in text
    fp32_bases = LatentKVStore(bases, 1, 16, "cpu", torch.float32).nbytes().bases
    assert f"bases {nb.bases} B" in text and nb.bases == fp32_bases // 2
    assert (f"with the bases counted {nb.ratio_vs(torch.float32):.2f}x ({nb.ratio_vs(torch.bfloat16):.2f}x against a "
            "bfloat16 dense cache)") in text


def test_latent_format_changes_the_bytes(tiny_latent):
    from ckvp_compile.kernels.latent_format import parse_latent_format
    from ckvp_compile.runtime.store import LatentKVStore

    _, _, model, bases = tiny_latent
    reports = {fmt: inspect_model(model, latent={"bases": bases, "latent_format": fmt}, decode=False,
                                  prompt_len=4, max_cache_len=16) for fmt in ("float", "int8")}
    f, q = reports["float"].latent, reports["int8"].latent
    assert q.latent_bytes_per_token < f.latent_bytes_per_token
    for fmt, rep in (("float", f), ("int8/32", q)):
        nb = LatentKVStore(bases, 1, 16, "cpu", torch.float32, fmt, fmt).nbytes()
        assert rep.store_bytes["latent"] == nb.latent and rep.latent_bytes_per_token == nb.per_sequence_state // 16
        for row in rep.groups:
            offsets = [0] + list(torch.tensor(row.k_ranks).cumsum(0).tolist())
            assert row.k_format == fmt and row.k_bytes_per_token == parse_latent_format(fmt).bytes_per_token(offsets, 4)
    assert reports["int8"].graphs[0].kv_bytes_per_token_latent == q.latent_bytes_per_token
    assert "int8/32" in reports["int8"].to_text()
    with torch.no_grad():  # the HF model is untouched: it still runs eagerly with a dense cache
        model(torch.arange(1, 5)[None])


def test_planned_bases_show_their_bit_plan(tiny_latent):
    """Bases from the planner carry per-group ``mix/...`` formats: the default ``latent_format="auto"`` stores them
    so, and the report prints the plan (formats and bytes per group)."""
    from ckvp_compile.inspection.latent import calibration_samples, LatentInspectOptions
    from ckvp_compile.latent import collect_kv_moments
    from ckvp_compile.latent.planner import plan_for_byte_ratio

    _, _, model, _ = tiny_latent
    samples, _ = calibration_samples(model, LatentInspectOptions(kv_ratio=4, num_samples=2))
    full = collect_kv_moments(model, samples, group_size=2, progress=False).bases(1.0, "uniform")
    planned = plan_for_byte_ratio(full, 4.0, max_cache_len=4096, dense_dtype=torch.float32, latent_dtype=torch.float32)
    assert all(f.startswith("mix/") for f in planned.k_formats + planned.v_formats)
    report = inspect_model(model, latent={"bases": planned}, decode=False, prompt_len=4, max_cache_len=16)
    assert [r.k_format for r in report.latent.groups] == list(planned.k_formats)
    assert [r.v_format for r in report.latent.groups] == list(planned.v_formats)
    text = report.to_text()
    assert all(f in text for f in planned.k_formats)
    float_report = inspect_model(model, latent={"bases": planned, "latent_format": "float"}, decode=False,
                                 prompt_len=4, max_cache_len=16)
    assert all(r.k_format == "float" for r in float_report.latent.groups)


def test_latent_inspection_of_a_gpt_fast_model_restores_its_caches():
    from ckvp_compile.runtime.store import lookup_phantom
    from ckvp_compile.testing import GptFastConfig, GptFastMoE

    model = GptFastMoE(GptFastConfig(n_layer=2)).eval()
    model.setup_caches(1, 16)
    dense = [(m.k_cache, m.v_cache) for m in model.modules() if hasattr(m, "k_cache")]
    report = inspect_model(model, latent={"kv_ratio": 2, "group_size": 2, "num_samples": 1, "sample_len": 8},
                           decode=False, prompt_len=4, max_cache_len=16)
    assert [r.layers for r in report.latent.groups] == [(0, 1)]
    g = report.graphs[0]
    assert g.plan.latent_groups == (0,) and g.added_ckvp_ops("torch")["ckvp.latent_append"] == 2
    after = [t for m in model.modules() if hasattr(m, "k_cache") for t in (m.k_cache, m.v_cache)]
    assert len(after) == len(dense) * 2 == 4  # dense buffers again (calibration may have re-allocated them)
    assert all(lookup_phantom(t) is None and 0 not in t.stride() and t.shape[2] == 16 for t in after)
    assert not any(hasattr(m, "ckvp_store") for m in model.modules())
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]]), torch.arange(3))).all()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--kv-ratio", "0.5"], "--kv-ratio: kv_ratio must be a number >= 1"),
        (["--kv-ratio", "2", "--bases", "b.safetensors"], "not allowed with argument"),
        (["--kv-ratio", "2", "--latent-format", "int3"], "--latent-format: latent format must be 'float'"),
        (["--latent-format", "int8"], "--latent-format needs a latent cache: add --kv-ratio R"),
        (["--latent-dtype", "bfloat16"], "--latent-dtype needs a latent cache: add --kv-ratio R"),
        (["--kv-ratio", "2", "--latent-dtype", "int8"], "invalid choice"),
        (["--group-size", "2"], "--group-size needs a latent cache"),
        (["--kv-ratio", "2", "--group-size", "3"], "invalid choice"),
        (["--kv-ratio", "2", "--rank-allocation", "best"], "invalid choice"),
        (["--kv-ratio", "2", "--group-size", "2", "--options", '{"group_size": 4}'], "disagrees"),
        (["--kv-ratio", "2", "--calibration-samples", "0"], "--calibration-samples must be >= 1"),
        (["--kv-ratio", "2", "--text", "/no/such/text.txt"], "--text: calibration text"),
        (["--bases", "/no/such/bases.safetensors"], "--bases: no latent bases file"),
        (["--kv-ratio", "2", "--save-bases", "/no/such/dir/b.safetensors"], "does not exist"),
        (["--kv-ratio", "2", "--save-bases", "/"], "is a directory; give a file name, e.g. '/bases.safetensors'"),
    ],
)
def test_cli_latent_usage_errors(args, needle, capsys, no_compiling):
    assert main(["--model", str(FIXTURE_MODEL_DIR), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ckvp-inspect: error: ") and needle in err[0], err


def test_cli_latent_errors_found_on_the_model(tiny_latent, tmp_path, capsys):
    """Errors only the model can reveal: bases of another model, a ratio it cannot reach; one line, status 2."""
    from ckvp_compile.testing import build_hf_moe

    other = tmp_path / "other"
    build_hf_moe("mixtral", num_layers=2).save_pretrained(other)
    capsys.readouterr()  # drop save_pretrained's progress bar
    for args, needle in ((["--model", str(other), "--bases", str(tiny_latent[1])], "calibrated on another model"),
                         (["--model", str(tiny_latent[0]), "--kv-ratio", "1000", "--calibration-samples", "1"],
                          "--kv-ratio: ")):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ckvp-inspect: error: ") and needle in err[0], err


def test_pass_notes_and_added_ops_are_shown_per_pass():
    from ckvp_compile.passes import PassResult

    report = _synthetic_report()
    g = report.graphs[0]
    g.dynamo_before = "def f(x):\n    return x\n"
    g.dynamo_after = "def f(x):\n    y = torch.ops.ckvp.latent_append.default(x)\n    return y\n"
    g.pass_results = [PassResult("latent_kv_cache", "torch", 2, "", 1.0, (("index_copy_", 4),),
                                 ((0, "hand-written attention"), (1, "hand-written attention")))]
    text = report.to_text()
    assert ("latent_kv_cache (torch): 2 site(s) rewritten in 1.0 ms; replaced index_copy_ x4; added "
            "ckvp.latent_append x1") in text
    assert "latent_kv_cache note, layers [0-1]: hand-written attention" in text
    assert "latent_kv_cache note, layers [0-1]: hand-written attention" in "".join(check_html(report.to_html()).text)


def test_text_diff_cuts_long_lines_unless_full():
    """A graph's forward(...) signature is one diff line of many kilobytes: the text view cuts it to TEXT_DIFF_WIDTH
    characters and says how many more there are; ``full`` shows it whole (found by a new-user trial: the report's
    first lines flooded the terminal)."""
    from ckvp_compile.inspection.render import TEXT_DIFF_WIDTH, _diff_text
    from ckvp_compile.inspection.report import GraphDiff

    long = "def forward(self, " + ", ".join(f"arg{i}_1" for i in range(2000)) + "):"
    d = GraphDiff.of("dynamo", "torch graph", "x = 1\n", long + "\nx = 2\n")
    short, full = _diff_text(d, full=False), _diff_text(d, full=True)
    cut = [ln for ln in short if "more characters)" in ln]
    assert len(cut) == 1 and len(cut[0]) < TEXT_DIFF_WIDTH + 60
    assert f"({len('+' + long) - TEXT_DIFF_WIDTH} more characters)" in cut[0]
    assert any(ln.strip() == "+" + long for ln in full)
