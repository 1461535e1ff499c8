"""Run a test script under the Triton interpreter (``TRITON_INTERPRET=1``) in a child process.

The interpreter must be switched on before ``triton`` is imported, and a pytest process has usually imported it
already, so kernel tests run their checks as a script in a fresh interpreter process (no GPU visible) and assert
on its exit status and output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["run_under_triton_interpreter"]


def run_under_triton_interpreter(script: str | Path, timeout: float = 300, env: dict[str, str] | None = None,
                                 args: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python script`` with ``TRITON_INTERPRET=1``, no CUDA device and the repository on ``PYTHONPATH``.

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
    return subprocess.run([sys.executable, str(Path(script).resolve()), *(args or [])], env=full,
                          capture_output=True, text=True, timeout=timeout)
