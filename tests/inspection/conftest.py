"""Fixtures of the inspection tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_compiling(monkeypatch):
    """Make loading a model directory or compiling one fail: for checks that must refuse their arguments first."""
    from ckvp_compile.inspection import capture, report

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded or compiled before the arguments were checked")

    monkeypatch.setattr(capture, "load_model_dir", fail)
    monkeypatch.setattr(report, "inspect_model", fail)
