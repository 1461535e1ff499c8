"""Writing a ``ckvp-bench`` subcommand's result: the JSON file, the markdown report, and the report on stdout."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["output_path_error", "run_env", "with_config_override", "write_result"]


def run_env(started: float, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What a GPU script's JSON records about its run: device name, torch and Triton versions, the exact command
    (``python3`` + ``argv``, default ``sys.argv``) and the wall time in seconds since ``started``
    (``time.time()``). Device ``"cpu"`` without CUDA."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton ships with torch on every supported machine
        triton_version = None
    command = with_config_override("python3 " + " ".join(sys.argv if argv is None else argv))
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "triton": triton_version, "command": command, "wall_s": round(time.time() - started, 1)}


def with_config_override(command: str) -> str:
    """``command`` prefixed with the kernel-config override (``CKVP_DECODE_CONFIG=...``) when one is set: it changes
    what a row measures, so it is part of the command. The variable is
    ``kernels.latent_attention_triton.CONFIG_ENV``, named here without importing Triton."""
    override = os.environ.get("CKVP_DECODE_CONFIG")
    return f"CKVP_DECODE_CONFIG={shlex.quote(override)} {command}" if override else command


def output_path_error(paths: dict[str, Path | str | None], make_dirs: bool = False) -> str | None:
    """Why the output files ``paths`` (flag -> path, None: not written) cannot be written, or None: a path that is
    a directory, two flags naming the same file, or (unless ``make_dirs``: the subcommand creates it) a missing
    directory. Checked before a run, so that a bad path does not cost the run. Returns the message for
    ``argparse``'s ``error`` (the flag, the path and the fix), or None; raises nothing."""
    seen: dict[Path, str] = {}
    for flag, path in paths.items():
        if path is None or str(path) == "":
            continue
        path = Path(path)
        if path.is_dir():
            return f"{flag} {str(path)!r} is a directory; give a file path"
        if not make_dirs and not path.resolve().parent.is_dir():
            return f"{flag} {str(path)!r}: the directory {str(path.parent)!r} does not exist (create it first)"
        key = path.resolve()
        if key in seen:
            return f"{seen[key]} and {flag} name the same file {str(path)!r}; give each its own path"
        seen[key] = flag
    return None


def write_result(result: dict[str, Any], markdown: str, json_path: Path | None, out_path: Path | None) -> None:
    """Write ``result`` as indented JSON to ``json_path`` (values JSON cannot hold, e.g. dtypes, as their ``str``)
    and ``markdown`` to ``out_path`` (each skipped when None), then print ``markdown``.

    Raises:
        OSError: a path cannot be written (the subcommands check the paths first, :func:`output_path_error`).
    """
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1, default=str))
    if out_path is not None:
        out_path.write_text(markdown)
    print(markdown)
