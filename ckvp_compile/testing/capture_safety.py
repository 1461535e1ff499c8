"""Find the Python-level torch calls that cannot run while a CUDA graph is captured, on any device (CPU included).

A CUDA-graph recording (``torch.compile(mode="reduce-overhead")``, CUDA-graph trees) runs every extern op's Python
launcher again while the stream captures. These calls break the capture (or leave memory in the graph's pool):

* **host sync**: ``.item()``, ``bool(t)`` / ``int(t)`` / ``float(t)``, ``.tolist()``, ``.cpu()`` / ``.numpy()``,
  ``torch.equal``, ``nonzero`` / ``argwhere`` / ``masked_select`` / ``unique`` / ``bincount``, boolean-mask
  indexing (``t[mask]``, ``t[mask] = v``: a ``nonzero`` inside), ``repeat_interleave`` with tensor repeats and no
  ``output_size``;
* **host data**: ``torch.tensor`` / ``torch.as_tensor`` / ``torch.from_numpy`` / ``torch.asarray`` (a copy from
  pageable host memory when the target is a GPU);
* **transfer**: ``.to(device)`` / ``.to(other_tensor)`` / ``.cuda()`` / ``.cpu()`` (a device copy).

:class:`CaptureHazards` is a ``TorchFunctionMode`` that records each such call made from a chosen package
(default ``ckvp_compile``: calls made by torch itself or by Triton's interpreter are not ours and are skipped),
with the calling file and line. A launcher that is capture-safe records nothing on its second call (the first may
build and cache its tables). It sees Python-level calls only: what a C++ kernel does inside (cuBLAS, a CUDA
kernel's own syncs) is checked on the GPU by ``benchmarks/cudagraph_capture_gpu.py``. Do not wrap a
``torch.compile``'d callable in it (Dynamo guards on the mode stack and would recompile): wrap the op's Python
implementation instead.

Source: the list of unsupported operations in the CUDA programming guide, "CUDA Graphs: Prohibited and Unhandled
Operations", and PyTorch's ``torch.cuda.set_sync_debug_mode`` documentation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CaptureHazards", "Hazard"]

_SYNC = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "equal", "nonzero", "argwhere",
         "masked_select", "unique", "unique_consecutive", "bincount", "numpy", "allclose", "is_nonzero",
         "_local_scalar_dense"}
_HOST_DATA = {"tensor", "as_tensor", "from_numpy", "asarray"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_", "_index_put_impl_"}
_PACKAGE = Path(__file__).resolve().parents[1]
_SKIP = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve()))


@dataclass(frozen=True)
class Hazard:
    """One capture-unsafe call: ``kind`` ('host sync', 'host data', 'transfer'), the torch function's name, why,
    the caller's ``file:line`` and the calling Python function's name."""

    kind: str
    name: str
    why: str
    where: str
    function: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.name} ({self.why}) at {self.where} in {self.function}"


def _has_mask(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_has_mask(i) for i in index)
    return False


def _is_device(x: Any) -> bool:
    if isinstance(x, torch.device):
        return True
    if isinstance(x, str):
        try:
            torch.device(x)
        except RuntimeError:
            return False
        return True
    return isinstance(x, int) and not isinstance(x, bool)


def _classify(name: str, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(kind, why) when the call cannot run under capture, else None."""
    if name in _SYNC:
        return "host sync", "reads a device value on the host"
    if name in _HOST_DATA:
        return "host data", "copies host data into a new tensor"
    if name in ("cuda", "cpu"):
        return "transfer", f".{name}() copies between devices"
    if name == "to":
        targets = list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]
        if any(_is_device(a) or isinstance(a, torch.Tensor) for a in targets if a is not None):
            return "transfer", ".to(device) copies between devices"
        return None
    if name in _INDEXING:
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        if _has_mask(index):
            return "host sync", "boolean-mask indexing runs nonzero"
        return None
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "host sync", "tensor repeats without output_size"
    return None


class CaptureHazards(TorchFunctionMode):
    """Record capture-unsafe torch calls made from ``package`` while the mode is active.

    Args:
        package: directory whose code is checked (default: the ``ckvp_compile`` package); calls whose nearest
            caller outside torch is elsewhere (tests, Triton's interpreter) are not recorded.
        allow: ``"file.py:function"`` entries whose calls are not recorded: host-only branches that a CPU run takes
            and a CUDA run does not (e.g. ``"latent_format.py:quantize_latent_ref"``, whose value check runs for
            host tensors only); keep the list short and say why at the call.
    Attributes:
        hazards: the :class:`Hazard` list, in call order.
    Example::

        with CaptureHazards() as rec:
            launcher(*args)
        assert not rec.hazards, "\\n".join(map(str, rec.hazards))
    """

    def __init__(self, package: str | Path | None = None, allow: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.package = str(Path(package).resolve()) if package is not None else str(_PACKAGE)
        self.allow = frozenset(allow)
        self.hazards: list[Hazard] = []

    def _caller(self) -> tuple[str, str] | None:
        """(file:line, function) of the nearest caller outside torch and this module, when it is in the package
        and not allowed."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self.package):
            return None
        code = frame.f_code
        if f"{Path(code.co_filename).name}:{code.co_name}" in self.allow:
            return None
        return f"{code.co_filename}:{frame.f_lineno}", code.co_name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        hit = _classify(name, args, kwargs)
        if hit is not None:
            caller = self._caller()
            if caller is not None:
                self.hazards.append(Hazard(hit[0], name, hit[1], *caller))
        return func(*args, **kwargs)
