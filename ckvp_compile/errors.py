"""Error and warning types of ckvp_compile.

Every error a user can cause derives from :class:`CKVPError` and also from the builtin type that callers
already catch (``ValueError``, ``NotImplementedError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class CKVPError(Exception):
    """Base class of every error raised by ckvp_compile."""


class CKVPConfigError(CKVPError, ValueError):
    """An option name, type or value is invalid. The message names the valid keys or range."""


class CKVPShapeError(CKVPError, ValueError):
    """A tensor has a shape, dtype or device the operation does not accept."""


class UnsupportedGraphError(CKVPError, NotImplementedError):
    """A graph pattern cannot be rewritten (raised only with ``strict=True``; otherwise a warning)."""


class CKVPModelLoadError(CKVPError, ValueError):
    """A model directory cannot be found or loaded."""


class CKVPWarning(UserWarning):
    """Base class of ckvp_compile warnings."""


class UnsupportedPatternWarning(CKVPWarning):
    """A site was found that the rewrites cannot use; it was left untouched. The message says why and the fix."""
