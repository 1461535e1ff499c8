"""Run a test script under the Triton interpreter (``TRITON_INTERPRET=1``) in a child process.

The interpreter must be switched on before ``triton`` is imported, and a pytest process has usually imported it
already, so kernel tests run their checks as a script in a fresh interpreter process (no GPU visible) and assert
on its exit status and output.

The child process first applies :func:`skip_repeated_language_patches` (a third of the interpreter's time on these
kernels, which call many ``@triton.jit`` helpers per tile), unless ``CKVP_INTERPRETER_FAST=0``.
"""

from __future__ import annotations

import inspect
import os
import runpy
import subprocess
import sys
from pathlib import Path

__all__ = ["run_under_triton_interpreter", "skip_repeated_language_patches"]

FAST_ENV = "CKVP_INTERPRETER_FAST"


def skip_repeated_language_patches() -> bool:
    """Make the Triton interpreter patch ``triton.language`` once per kernel launch, not once per helper call.

    The interpreter (``triton.runtime.interpreter``, Triton 3.x) swaps ``triton.language``'s builtins for host
    implementations when a kernel launches and restores them when it returns; but every call of a ``@triton.jit``
    helper inside the kernel patches again (``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.core``,
    ``tl.math`` and ``tl.tensor``), which finds them already patched and changes nothing, at about 0.5 ms a call.
    This skips a helper's patch when the modules it sees (``tl`` / ``tl.core`` in its globals) were already patched
    in the current launch; every kernel launch, and any helper seeing a module not yet patched, runs the
    interpreter's own patch. What the kernels compute is unchanged (the kernel tests compare with references).

    Returns:
        True if installed; False where the interpreter lacks the private functions this relies on (another Triton
        version: the interpreter then runs as shipped, only slower).
    Source: triton/runtime/interpreter.py (``GridExecutor.__call__``, ``InterpretedFunction.__call__``).
    """
    from triton.runtime import interpreter as it

    import triton.language as tl

    if not (callable(getattr(it, "_patch_lang", None)) and hasattr(it, "_LangPatchScope")):
        return False
    if getattr(it._patch_lang, "_ckvp_fast", False):
        return True
    patch = it._patch_lang
    launches: list[frozenset[int]] = []  # per launch not yet restored: the language modules patched in it
    seen: dict = {}

    def languages(fn) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                 if inspect.ismodule(v) and (v is tl or v is tl.core))
        return seen[fn]

    def patch_once(fn):
        mine = languages(fn)
        if launches:  # a helper called inside a kernel
            if mine <= launches[-1]:
                return it._LangPatchScope()  # already patched in this launch; nothing to restore
            scope = patch(fn)  # (the interpreter never restores a helper's scope, so these stay patched)
            launches[-1] = launches[-1] | mine
            return scope
        scope = patch(fn)  # a kernel launch: restored when the launch returns
        launches.append(mine)
        restore = scope.restore

        def restore_and_pop():
            try:
                restore()
            finally:
                launches.pop()

        scope.restore = restore_and_pop
        return scope

    patch_once._ckvp_fast = True
    it._patch_lang = patch_once
    return True


def _run_script() -> None:
    """The child process's entry: ``python -c ... script args``; runs ``script`` as ``__main__`` as ``python script``
    would (its folder first on ``sys.path``), after :func:`skip_repeated_language_patches`."""
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    if os.environ.get(FAST_ENV, "1") != "0":
        skip_repeated_language_patches()
    runpy.run_path(script, run_name="__main__")


def run_under_triton_interpreter(script: str | Path, timeout: float = 300, env: dict[str, str] | None = None,
                                 args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python script`` with ``TRITON_INTERPRET=1``, no CUDA device and the repository on ``PYTHONPATH`` (the
    interpreter sped up by :func:`skip_repeated_language_patches` unless ``CKVP_INTERPRETER_FAST=0``).

    Args:
        script: the test file to run as ``__main__``.
        timeout: seconds before ``subprocess.TimeoutExpired`` is raised.
        env: extra environment variables.
        args: command-line arguments for the script (none by default).
    Returns:
        The completed process (text ``stdout`` / ``stderr``, ``returncode``), for the caller to assert on.
    """
    root = Path(__file__).resolve().parents[2]
    full = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **(env or {}))
    full["PYTHONPATH"] = str(root) + os.pathsep + full.get("PYTHONPATH", "")
    entry = "from ckvp_compile.testing.interpreter import _run_script; _run_script()"
    return subprocess.run([sys.executable, "-c", entry, str(Path(script).resolve()), *(args or [])], env=full,
                          capture_output=True, text=True, timeout=timeout)
