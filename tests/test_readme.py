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


def test_gpt_fast_snippet_runs():
    block = README.split("### A gpt-fast-style model")[1].split("```python")[1].split("```")[0]
    # Same code, with the cheap inner compiler: full Inductor on CPU would add ~40 s of C++ compilation.
    block = block.replace('backend="ckvp"', 'backend="ckvp", options={"compiler": "aot_eager"}')
    assert 'options={"compiler": "aot_eager"}' in block
    scope = {"torch": torch}
    exec(compile(block, "README gpt-fast snippet", "exec"), scope)
    assert scope["logits"].shape[:2] == (1, 1)
