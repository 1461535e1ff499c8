"""Writing a ``ckvp-bench`` subcommand's result: the JSON file, the markdown report, and the report on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_result"]


def write_result(result: dict[str, Any], markdown: str, json_path: Path | None, out_path: Path | None) -> None:
    """Write ``result`` as indented JSON to ``json_path`` (values JSON cannot hold, e.g. dtypes, as their ``str``)
    and ``markdown`` to ``out_path`` (each skipped when None), then print ``markdown``.

    Raises:
        OSError: a path cannot be written (the subcommands check that its directory exists first).
    """
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1, default=str))
    if out_path is not None:
        out_path.write_text(markdown)
    print(markdown)
