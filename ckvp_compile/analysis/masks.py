"""Read what an attention mask allows: today, whether it is a sliding window.

transformers builds masks inside the graph from positions (``masking_utils``): the causal part is
``kv_idx <= q_idx``, a sliding window adds ``kv_idx > q_idx - W``; hand-written code often uses ``tril`` /
``triu`` on a ones matrix, where a window shows up as a negative diagonal. Read-only; never raises.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .graph import arg, op_name, strip_views

_COMPARE_OPS = frozenset({"gt", "ge", "lt", "le"})


def sliding_window(mask_roots: list[fx.Node], max_depth: int = 48) -> int | None:
    """Return the window size when an attention mask encodes a sliding window, else None.

    Looks through everything the mask depends on for (1) a position comparison (``gt/ge/lt/le``) with one
    side offset by a non-zero constant (``kv_idx > q_idx - W``), next to at least one other comparison (the
    causal one), as transformers' ``sliding_window_causal_mask`` builds it; or (2) ``tril``/``triu`` with a
    negative diagonal.

    Args:
        mask_roots: the mask tensors fed to the attention (SDPA ``attn_mask``; added / masked_fill'ed masks).
    Returns:
        W (the constant offset) or None.
    """
    seen: set[fx.Node] = set()
    frontier = list(mask_roots)
    compares: list[fx.Node] = []
    window: int | None = None
    for _ in range(max_depth):
        nxt: list[fx.Node] = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            kind = op_name(n)
            if kind in _COMPARE_OPS:
                compares.append(n)
                for a in n.args[:2]:
                    w = _const_offset(a)
                    if w:
                        window = w
            elif kind in ("tril", "triu"):
                diag = arg(n, 1, "diagonal", 0)
                if isinstance(diag, int) and diag < 0:
                    return -diag
            nxt.extend(n.all_input_nodes)
        if not nxt:
            break
        frontier = nxt
    return window if window is not None and len(compares) >= 2 else None


def _const_offset(a: Any) -> int | None:
    """|c| when ``a`` is ``x - c`` or ``x + c`` (through views) with a non-zero integer constant c."""
    a = strip_views(a)
    if not isinstance(a, fx.Node) or op_name(a) not in ("sub", "add"):
        return None
    consts = [x for x in a.args if isinstance(x, int) and not isinstance(x, bool)]
    nodes = [x for x in a.args if isinstance(x, fx.Node)]
    if len(consts) == 1 and len(nodes) == 1 and consts[0] != 0:
        return abs(consts[0])
    return None
