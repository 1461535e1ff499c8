"""Every torch-internal symbol the package relies on exists on the installed torch."""

import importlib

import pytest

from ckvp_compile import _compat


@pytest.mark.parametrize("module, symbol", _compat.REQUIRED_SYMBOLS)
def test_symbol_exists(module, symbol):
    assert hasattr(importlib.import_module(module), symbol), f"{module}.{symbol} missing on this torch"


def test_only_compat_imports_inductor_internals():
    import pathlib
    import re

    root = pathlib.Path(_compat.__file__).parent
    private = re.compile(r"^\s*(from|import)\s+torch\.(_inductor|_dynamo\.backends|_functorch)", re.M)
    offenders = [
        str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "_compat.py" and private.search(p.read_text())
    ]
    assert offenders == [], f"Inductor internals used outside _compat.py: {offenders}"


def test_surface_through_dynamo_keeps_type_and_message():
    from ckvp_compile.errors import CKVPConfigError

    err = _compat.surface_through_dynamo(CKVPConfigError("bad option x"))
    assert isinstance(err, CKVPConfigError) and isinstance(err, ValueError)
    assert str(err) == "bad option x"


def test_inductor_template_api_has_every_symbol_the_lowerings_use():
    api = _compat.inductor_template_api()
    for name in ("register_lowering", "lowerings", "fallback_handler", "TritonTemplate", "ExternKernelChoice",
                 "realize_inputs", "SymbolicGridFn", "use_triton_template", "FixedLayout", "V", "config",
                 "autotune_select_algorithm", "require_contiguous"):
        assert getattr(api, name) is not None, name
    assert isinstance(api.config.max_autotune, bool)
