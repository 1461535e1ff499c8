"""The README stays true: its options table is CKVPConfig's, its commands are what CI runs, its snippets run."""

import pathlib
import re

import torch

from ckvp_compile import CKVPConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_options_table_matches_config():
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| `(.*?)` \| (.*?) \|$", README, re.M)
    expected = [(n, t.replace("|", "or").replace(" or ", " or "), d, doc) for n, t, d, doc in CKVPConfig.describe()]
    assert [r[0] for r in rows] == [e[0] for e in expected], "README options table is out of date"
    for row, exp in zip(rows, expected):
        assert row[2] == exp[2] and row[3] == exp[3], f"README row for {row[0]} differs from CKVPConfig"


def test_ci_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q torch==2.13.0 && pip install -q -e ".[test]"' in ci
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python examples/generate.py' in README
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in README
    assert "python -m pytest -q" in ci
    # the same workers in both (pytest-xdist, from the test extra): CI times what the README promises
    assert ('python -m pytest -q -n auto --maxprocesses 4 --dist worksteal\n' in README
            and "-n auto --maxprocesses 4 --dist worksteal " in ci)


def _snippet(heading: str) -> str:
    """The first ```python block after ``heading``."""
    return README.split(heading)[1].split("```python")[1].split("```")[0]


def _cheap(block: str, replacements: dict[str, str]) -> str:
    """``block`` with each replacement applied exactly once (a README edit that drops one fails here, not silently)."""
    for old, new in replacements.items():
        assert block.count(old) == 1, (old, block)
        block = block.replace(old, new)
    return block


def _run_snippet(block: str, name: str) -> dict:
    """Run ``block`` as a script; returns its globals."""
    scope: dict = {}
    exec(compile(block, name, "exec"), scope)
    return scope


def test_gpt_fast_snippet_runs():
    # Same code, with the cheap inner compiler: full Inductor on CPU would add ~40 s of C++ compilation.
    block = _cheap(_snippet("### A gpt-fast-style model"),
                   {'backend="ckvp"': 'backend="ckvp", options={"compiler": "aot_eager"}'})
    scope = _run_snippet(block, "README gpt-fast snippet")
    assert scope["logits"].shape[:2] == (1, 1)
    assert f"# {scope['logits'].shape}" in block  # the printed shape the README shows


def test_hf_generate_snippet_runs(capsys):
    """The README's Hugging Face ``generate()`` snippet: the string backend compiles the fixture's forward and
    greedy generation with a static cache decodes text (the cheap inner compiler: full Inductor on CPU would add
    about a minute of C++ compilation; fewer tokens)."""
    block = _cheap(_snippet("### Hugging Face `generate()`"), {
        '"models/tiny-mixtral-pystdlib"': repr(str(ROOT / "models" / "tiny-mixtral-pystdlib")),
        'backend="ckvp")': 'backend="ckvp", options={"compiler": "aot_eager"})',
        "max_new_tokens=32": "max_new_tokens=8",
    })
    scope = _run_snippet(block, "README generate() snippet")
    out, ids, model = scope["out"], scope["ids"], scope["model"]
    assert out.shape == (1, ids.shape[1] + 8)
    assert capsys.readouterr().out == bytes(out[0, ids.shape[1]:].tolist()).decode() + "\n"
    # the compiled forward generates what the eager one does (greedy, the same static cache)
    model.forward = type(model).forward.__get__(model)
    want = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static", disable_compile=True)
    assert torch.equal(out, want)


def test_latent_cache_recipe_runs(tmp_path, monkeypatch, capsys):
    """The README's CKVP recipe end to end: calibrate, save, a ``CKVPStaticCache``, the compiled forward under
    ``generate()``, and the printed byte ratio near the 4x asked (fewer calibration windows and tokens; the cheap
    inner compiler)."""
    monkeypatch.chdir(tmp_path)  # bases.safetensors lands here
    fixture = ROOT / "models" / "tiny-mixtral-pystdlib"
    block = _cheap(_snippet("### Latent KV cache (CKVP)"), {  # self-contained: copied alone, it runs
        '"models/tiny-mixtral-pystdlib"': repr(str(fixture)),
        '"models/tiny-mixtral-pystdlib/eval_text.txt"': repr(str(fixture / "eval_text.txt")),
        "16 * 256": "4 * 256",
        'backend="ckvp")': 'backend="ckvp", options={"compiler": "aot_eager"})',
        "max_new_tokens=64": "max_new_tokens=8",
    })
    scope = _run_snippet(block, "README latent recipe")
    assert (tmp_path / "bases.safetensors").is_file()
    assert scope["out"].shape[1] == scope["ids"].shape[1] + 8
    ratio = float(capsys.readouterr().out.strip().splitlines()[-1])
    assert 3.6 <= ratio <= 4.6, ratio  # "about 4.1 here"


def test_expert_offload_snippet_runs(capsys):
    """The README's expert-offload snippet, copied alone: offload in place with 2 of 4 experts resident, compile,
    generate, and print the offloader's statistics (the cheap inner compiler; fewer tokens)."""
    block = _cheap(_snippet("### Expert offload"), {
        '"models/tiny-mixtral-pystdlib"': repr(str(ROOT / "models" / "tiny-mixtral-pystdlib")),
        'offload_options={"margin": 1})': 'offload_options={"margin": 1}, options={"compiler": "aot_eager"})',
        "max_new_tokens=32": "max_new_tokens=4",
    })
    scope = _run_snippet(block, "README expert offload snippet")
    assert scope["out"].shape[1] == scope["ids"].shape[1] + 4
    stats = scope["ckvp_compile"].offloader_of(scope["model"]).stats().to_dict()
    assert stats["lookups"] > 0 and 0 <= stats["hit_rate"] <= 1
    assert "hit_rate" in capsys.readouterr().out


def test_equivalence_check_snippet_runs(capsys):
    """The README's check_equivalence snippet, copied alone (one example instead of four: each compiles)."""
    block = _cheap(_snippet("### Checking your own model"), {
        '"models/tiny-mixtral-pystdlib"': repr(str(ROOT / "models" / "tiny-mixtral-pystdlib")),
        "max_examples=4": "max_examples=1, max_prompt_len=4, max_decode_steps=1",
    })
    scope = _run_snippet(block, "README equivalence snippet")
    assert scope["report"].passed and scope["report"].examples == 1
    out = capsys.readouterr().out
    assert out.startswith("ckvp equivalence check, dense cache (exact): passed (1 example;")
