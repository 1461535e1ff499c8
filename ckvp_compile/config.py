"""Typed, validated options of the ``ckvp`` backend.

``torch.compile(model, backend="ckvp", options={...})`` hands the ``options`` dict to the backend
untouched (torch validates nothing for custom backends); :meth:`CKVPConfig.from_options` maps every key
onto a field of :class:`CKVPConfig` and rejects unknown keys and bad values with a
:class:`~ckvp_compile.errors.CKVPConfigError` (a ``ValueError``) that names the valid keys or range.

Inductor settings pass through unchanged under the ``"inductor"`` key, e.g.
``options={"inductor": {"max_autotune": True}}``; ``mode=`` (or the ``"mode"`` option, since torch refuses
``mode`` and ``options`` together) selects Inductor's preset for that mode. Each ``inductor`` key must be a
``torch._inductor.config`` option (nested ones dotted, ``"triton.cudagraphs"``) and its value must have the
type of the option's default and be JSON-like (None, bool, int, float, str, and lists / dicts of them): the
options are hashed into Inductor's cache key (:meth:`CKVPConfig.compute_hash`), and an object's ``repr``
(with its address) would make that hash differ from run to run. With ``compiler='aot_eager'`` or ``'eager'``
Inductor never runs, so ``inductor`` patches (and a ``mode``) are ignored, with a :class:`CKVPWarning`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import hashlib
import json
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from .errors import CKVPConfigError, CKVPWarning

CONFIG_VERSION = 1

#: Inductor modes ``torch.compile(mode=...)`` accepts.
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

#: Inner compilers: what runs the graph after the ckvp rewrites.
COMPILERS = ("inductor", "aot_eager", "eager")

#: Layer-group sizes the cross-layer latent supports (DESIGN.md: G = 1, 2, 4, 8).
GROUP_SIZES = (1, 2, 4, 8)


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"doc": text, **extra}


@dataclass(frozen=True, kw_only=True)
class CKVPConfig:
    """Every option of the ``ckvp`` backend, typed and validated.

    Build it from the ``options=`` dict with :meth:`from_options`, or directly as keyword arguments.
    The field list, with each field's documentation, is also available as :meth:`describe`.

    Raises:
        CKVPConfigError: an unknown key, a wrong type, or a value out of range; the message names
            the valid keys or the valid range.
    """

    compiler: Literal["inductor", "aot_eager", "eager"] = field(
        default="inductor",
        metadata=_doc(
            "Inner compiler run after the ckvp rewrites: 'inductor' (full Inductor, Triton on GPU, C++ on "
            "CPU), 'aot_eager' (AOTAutograd + Inductor decompositions + the post-grad ckvp passes, run "
            "eagerly: cheap to compile, for tests), 'eager' (the rewritten Dynamo graph, run as is)."
        ),
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = field(
        default="default",
        metadata=_doc("Inductor mode preset, as torch.compile(mode=...). Only used with compiler='inductor'."),
    )
    inductor: Mapping[str, Any] = field(
        default_factory=dict,
        metadata=_doc(
            "Inductor config patches passed through unchanged (torch._inductor.config names, e.g. "
            "{'max_autotune': True}; checked: known name, the default's type, JSON-like value). Applied after "
            "the mode preset; ignored, with a warning, unless compiler='inductor'."
        ),
    )
    group_size: int = field(
        default=4,
        metadata=_doc("Adjacent attention layers that share one latent KV cache (G): 1, 2, 4 or 8. With a latent cache "
                      "the bases decide (calibrate(..., group_size=G)); this option then plays no part.",
                      choices=GROUP_SIZES),
    )
    enable_latent_kv: bool = field(
        default=True,
        metadata=_doc(
            "Rewrite the KV caches that are ckvp latent caches (CKVPStaticCache, use_latent_cache) into the "
            "cross-layer latent store. Dense caches are never rewritten. False refuses a latent cache with an error."
        ),
    )
    enable_expert_gemm: bool | Literal["auto"] = field(
        default="auto",
        metadata=_doc(
            "Rewrite each MoE layer's routed experts (any form the analysis reports) into one "
            "ckvp::moe_experts call: device-side routing and Triton grouped GEMMs on CUDA, the PyTorch "
            "reference elsewhere. 'auto': on in graphs whose inputs are on CUDA and that run without gradients "
            "(faster than the experts' own code, and it avoids the wrong results torch 2.11's Inductor gives for "
            "transformers' grouped_mm experts: README, 'Status'), off elsewhere (on CPU the op is the reference, "
            "no faster). True: in every inference graph. False: never. Sites it cannot fully read are left "
            "untouched with a warning."
        ),
    )
    expert_offload: int = field(
        default=0,
        metadata=_doc(
            "Experts kept resident on the device per MoE layer (C, 1..E), the rest in pinned host memory, with "
            "next-layer prefetch; 0: no offload. A backend only sees the graph Dynamo traced with the weights where "
            "they are, so offload before compiling: ckvp_compile.compile(model, expert_offload=C), or "
            "ckvp_compile.offload_experts(model, resident=C) then torch.compile. With C set, the backend checks that "
            "every MoE layer of each graph is offloaded with C resident and raises CKVPConfigError otherwise.",
            hint="0 for no offload, or the number of experts kept resident per MoE layer, 1..E",
        ),
    )
    strict: bool = field(
        default=False,
        metadata=_doc(
            "Raise UnsupportedGraphError for a site the rewrites cannot use, instead of warning and leaving "
            "it untouched."
        ),
    )
    warn_unsupported: bool = field(
        default=True,
        metadata=_doc("Emit an UnsupportedPatternWarning (reason and fix) for each unusable site found."),
    )

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            try:
                _check_type(f.name, getattr(self, f.name), hints[f.name])
            except CKVPConfigError as exc:
                if "hint" not in f.metadata:
                    raise
                raise CKVPConfigError(f"{exc} ({f.metadata['hint']})") from None
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise CKVPConfigError(
                    f"option {f.name!r} must be one of {list(choices)}, got {getattr(self, f.name)!r}"
                )
        if self.expert_offload < 0:
            raise CKVPConfigError(
                f"option 'expert_offload' must be 0 (no offload) or the number of experts kept resident per MoE "
                f"layer, 1..E (E: the model's experts per layer), got {self.expert_offload}"
            )
        # A mapping is mutable: freeze a private copy so compute_hash() stays valid.
        object.__setattr__(self, "inductor", dict(self.inductor))
        for key in self.inductor:
            if not isinstance(key, str):
                raise CKVPConfigError(f"'inductor' option keys must be strings, got {key!r}")
        if self.inductor:
            _check_inductor_patches(self.inductor)
        if self.compiler != "inductor":
            ignored = ([f"inductor={dict(self.inductor)!r}"] if self.inductor else []) + (
                [f"mode={self.mode!r}"] if self.mode != "default" else [])
            if ignored:
                warnings.warn(
                    f"ckvp: compiler={self.compiler!r} does not run Inductor, so {' and '.join(ignored)} "
                    f"{'is' if len(ignored) == 1 else 'are'} ignored (Inductor options apply only with "
                    "compiler='inductor').", CKVPWarning, stacklevel=3)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, *, mode: str | None = None) -> "CKVPConfig":
        """Build a config from ``torch.compile``'s ``options=`` dict and ``mode=`` string.

        Args:
            options: keys are :class:`CKVPConfig` field names; ``None`` means all defaults.
            mode: ``torch.compile``'s mode; ``None`` or "default" leaves ``options["mode"]`` in charge.
        Returns:
            A validated, frozen :class:`CKVPConfig`.
        Raises:
            CKVPConfigError: ``options`` is not a mapping, has an unknown key (the message lists the valid
                keys), a value of the wrong type or out of range, or ``mode`` conflicts with ``options["mode"]``.
        """
        if options is None:
            options = {}
        if isinstance(options, CKVPConfig):
            options = options.to_dict(include_version=False)
        if not isinstance(options, Mapping):
            raise CKVPConfigError(f"options must be a dict of CKVPConfig fields, got {type(options).__name__}")
        if "version" in options:  # what to_dict() adds by default: a record, not an option
            options = {k: v for k, v in options.items() if k != "version"}
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in options if k not in valid)
        if unknown:
            raise CKVPConfigError(
                f"unknown ckvp option(s) {unknown}; valid keys are {valid}. "
                "Inductor settings go under the 'inductor' key, e.g. options={'inductor': {'max_autotune': True}}."
            )
        kwargs = dict(options)
        if mode not in (None, "default"):
            if kwargs.get("mode", mode) != mode:
                raise CKVPConfigError(f"mode={mode!r} conflicts with options['mode']={kwargs['mode']!r}; give one")
            kwargs["mode"] = mode
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "CKVPConfig":
        """Return a copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self, *, include_version: bool = True) -> dict[str, Any]:
        """Return the options as a JSON-serialisable dict (with a ``version`` key unless told not to)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["inductor"] = dict(self.inductor)
        if include_version:
            out["version"] = CONFIG_VERSION
        return out

    def compute_hash(self) -> str:
        """Return a stable sha256 hex digest of every option; part of the pass manager's cache ``uuid()``.

        Raises:
            CKVPConfigError: an ``inductor`` value is not JSON-like (it has no stable serialisation; the
                constructor already refuses such values, so this only happens if one was mutated in place).
        """
        for key, value in self.inductor.items():
            _check_json_like(key, value)
        blob = json.dumps(self.to_dict(), sort_keys=True, allow_nan=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def describe(cls) -> list[tuple[str, str, str, str]]:
        """Return ``(name, type, default, doc)`` for every option, for the README table and error messages."""
        rows = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((f.name, _type_name(hints[f.name]), repr(default), f.metadata.get("doc", "")))
        return rows


#: Inductor option default type -> (accepted value types, the name used in messages).
_INDUCTOR_VALUE_TYPES: tuple[tuple[type, tuple[type, ...], str], ...] = (
    (bool, (bool,), "a bool"),
    (int, (int,), "an int"),
    (float, (int, float), "a number"),
    (str, (str,), "a str"),
    (list, (list, tuple), "a list"),
    (tuple, (list, tuple), "a list or tuple"),
    (dict, (collections.abc.Mapping,), "a dict"),
)


def _check_inductor_patches(patches: Mapping[str, Any]) -> None:
    """Check each Inductor patch: a known ``torch._inductor.config`` name, a value of the default's type, JSON-like.

    The default's type decides (bool, int, float: int or float, str, list / tuple, dict); None is accepted
    where the default is None or the option is declared ``X | None``; options whose default is None or an
    object accept any JSON-like value.
    """
    from . import _compat

    defaults = _compat.inductor_config_defaults()
    for key, value in patches.items():
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.7)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise CKVPConfigError(
                f"unknown Inductor option {key!r} under 'inductor'.{hint} Valid names are the options of "
                "torch._inductor.config (nested ones dotted, e.g. 'triton.cudagraphs'; list them with "
                "torch._inductor.config.get_config_copy())."
            )
        default = defaults[key]
        if value is None:
            if default is not None and not _compat.inductor_config_accepts_none(key):
                raise CKVPConfigError(f"Inductor option {key!r} does not accept None (default {default!r})")
        elif default is not None:
            for default_type, accepted, name in _INDUCTOR_VALUE_TYPES:
                if type(default) is default_type:  # exact: bool is not an int here
                    bad_bool = isinstance(value, bool) and bool not in accepted
                    if bad_bool or not isinstance(value, accepted):
                        raise CKVPConfigError(
                            f"Inductor option {key!r} must be {name} (its default is {default!r}), "
                            f"got {type(value).__name__} {value!r}"
                        )
                    break
        _check_json_like(key, value)


def _check_json_like(key: str, value: Any) -> None:
    """Raise CKVPConfigError when ``value`` (of Inductor option ``key``) has no stable JSON form."""
    try:
        json.dumps(value, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CKVPConfigError(
            f"Inductor option {key!r} has a value that is not JSON-like ({type(value).__name__}: {exc}); ckvp "
            "hashes the options into Inductor's cache key and only hashes None, bool, int, float, str and "
            "lists / dicts of them (an object's repr holds its address and would change every run)."
        ) from None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_type(name: str, value: Any, tp: Any) -> None:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. bool | Literal["auto"]: any one arm
        for arm in typing.get_args(tp):
            try:
                _check_type(name, value, arm)
                return
            except CKVPConfigError:
                pass
        raise CKVPConfigError(f"option {name!r} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if not any(type(value) is type(a) and value == a for a in allowed):  # (not `in`: an array == 'auto' passes)
            raise CKVPConfigError(f"option {name!r} must be one of {list(allowed)}, got {value!r}")
        return
    if tp is bool:
        if not isinstance(value, bool):
            raise CKVPConfigError(f"option {name!r} must be a bool, got {value!r}")
        return
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise CKVPConfigError(f"option {name!r} must be an int, got {value!r}")
        return
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CKVPConfigError(f"option {name!r} must be a number, got {value!r}")
        return
    if origin in (collections.abc.Mapping, dict) or tp is dict:
        if not isinstance(value, Mapping):
            raise CKVPConfigError(f"option {name!r} must be a dict, got {type(value).__name__}")
        return
    raise AssertionError(f"unhandled option type {tp!r} for {name!r}")  # internal: a new field type
