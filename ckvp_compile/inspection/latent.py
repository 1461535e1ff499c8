"""Inspecting with a CKVP latent KV cache: the options, the bases, the caches, and the "latent KV" report section.

With :class:`LatentInspectOptions`, :func:`~ckvp_compile.inspection.inspect_model` drives the model with a ckvp
latent cache instead of a dense one (a :class:`~ckvp_compile.runtime.hf_cache.CKVPStaticCache` for a Hugging
Face model, :func:`~ckvp_compile.runtime.hf_cache.use_latent_cache` for a gpt-fast style one), so the
``LatentKVCachePass`` really rewrites the graphs, and the report gains a :class:`LatentReport`: per layer group
the layers, the rank of every KV head for K and V, the storage format and bytes per token of each, and the
totals measured on the store (:meth:`~ckvp_compile.runtime.store.LatentKVStore.nbytes`).

The bases come from a file (``bases=``) or from a quick calibration (``kv_ratio=``) on a few random-token
samples, or on windows of a text file (``text=``). Random tokens make a valid plan for inspection (ranks, bytes,
rewritten graph) but not bases to deploy: calibrate on real text for that (README, "Latent KV cache").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import CKVPConfigError

#: How a token enters the latent today (one at a time, paged store or not; the report's store keeps no recent
#: window):
#: printed as is.
PAGE = "1 token (every token projected at its group's last layer)"
WINDOW = ("the current call's tokens only (a cache built with recent_window=W also keeps the last W tokens' keys "
          "and values exact)")

#: Seed of the random calibration tokens (another stream than the inspection prompt's).
CALIBRATION_SEED = 1


@dataclass(frozen=True)
class LatentInspectOptions:
    """How to build the latent cache an inspection runs with. Give exactly one of ``kv_ratio`` and ``bases``.

    Attributes:
        kv_ratio: calibrate bases at this target ratio rho >= 1 (dense / latent elements per token) with
            :func:`ckvp_compile.latent.calibrate`.
        bases: a :class:`~ckvp_compile.latent.LatentBases`, or the path of a file written by its ``save()``
            (checked against the model).
        latent_format: storage of the key and value latents: ``"auto"`` (default: the bases' own per-group
            formats, e.g. a planner's ``mix/...`` bit plan, else ``"float"``), ``"float"``, ``"int8"``,
            ``"int4"``, ``"int2"``, optionally ``/block`` (e.g. ``"int4/64"``), or a (K, V) pair of them.
        latent_dtype: dtype of ``"float"`` latents and of the bases on the device (default: the model's dtype).
        rank_allocation: 'energy' or 'uniform' (calibration only).
        group_size: G, layers per group (calibration only; default the options' ``group_size``).
        text: calibration text file (windows of its token ids); default random token ids.
        num_samples: calibration samples. sample_len: tokens per sample (every sample has this length, so the
            calibration compiles once).
    Raises:
        CKVPConfigError: neither or both of kv_ratio / bases, kv_ratio < 1, an unknown format, rank allocation or
            group size, a text file or bases path that does not exist, num_samples or sample_len < 1.
    """

    kv_ratio: float | None = None
    bases: Any = None
    latent_format: str | tuple[str, str] = "auto"
    latent_dtype: torch.dtype | None = None
    rank_allocation: str = "energy"
    group_size: int | None = None
    text: str | Path | None = None
    num_samples: int = 4
    sample_len: int = 32

    def __post_init__(self) -> None:
        from ..config import GROUP_SIZES
        from ..kernels.latent_format import parse_latent_format
        from ..latent import RANK_ALLOCATIONS

        if (self.kv_ratio is None) == (self.bases is None):
            raise CKVPConfigError("a latent inspection needs exactly one of kv_ratio (calibrate bases now) and bases "
                                  f"(a LatentBases or its file), got kv_ratio={self.kv_ratio!r} and bases="
                                  f"{'given' if self.bases is not None else None}")
        if self.kv_ratio is not None and (isinstance(self.kv_ratio, bool) or not isinstance(self.kv_ratio, (int, float))
                                          or not self.kv_ratio >= 1):
            raise CKVPConfigError(f"kv_ratio must be a number >= 1 (dense / latent elements per token), got "
                                  f"{self.kv_ratio!r}")
        for fmt in format_pair(self.latent_format):
            if fmt == "auto":
                continue
            try:
                parse_latent_format(fmt)
            except ValueError as exc:
                raise CKVPConfigError(str(exc)) from None
        if self.rank_allocation not in RANK_ALLOCATIONS:
            raise CKVPConfigError(f"rank_allocation must be one of {list(RANK_ALLOCATIONS)}, got "
                                  f"{self.rank_allocation!r}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise CKVPConfigError(f"group_size must be one of {list(GROUP_SIZES)}, got {self.group_size!r}")
        if self.latent_dtype is not None and not (isinstance(self.latent_dtype, torch.dtype)
                                                  and self.latent_dtype.is_floating_point):
            raise CKVPConfigError(f"latent_dtype must be a float torch.dtype, got {self.latent_dtype!r}")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (self.num_samples, self.sample_len)):
            raise CKVPConfigError(f"num_samples and sample_len must be ints, got {self.num_samples!r} and "
                                  f"{self.sample_len!r}")
        if self.num_samples < 1 or self.sample_len < 1:
            raise CKVPConfigError(f"num_samples and sample_len must be >= 1, got {self.num_samples} and "
                                  f"{self.sample_len}")
        if self.text is not None and not Path(self.text).is_file():
            raise CKVPConfigError(f"calibration text {str(self.text)!r} is not a file; pass an existing text file "
                                  "or leave it out to calibrate on random tokens")
        if isinstance(self.bases, (str, Path)) and not Path(self.bases).is_file():
            raise CKVPConfigError(f"no latent bases file at {str(self.bases)!r}; create one with "
                                  "ckvp_compile.calibrate(model, samples).save(path), or pass kv_ratio instead")

    @classmethod
    def of(cls, value: "LatentInspectOptions | Mapping[str, Any] | None") -> "LatentInspectOptions | None":
        """Return ``value`` as options: ``None`` stays ``None``, a mapping gives its fields as keyword arguments.

        Raises:
            CKVPConfigError: an unknown field (the message lists the valid ones), or any check above.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise CKVPConfigError(f"latent must be a LatentInspectOptions, a dict of its fields or None, got "
                                  f"{type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise CKVPConfigError(f"unknown latent option(s) {unknown}; valid keys: {sorted(names)}")
        return cls(**value)


def format_pair(latent_format: str | Sequence[str]) -> tuple[str, str]:
    """Return the (K, V) latent formats of ``latent_format``: one name for both, ``"int8,int4"``, or a pair.

    Raises:
        CKVPConfigError: not a string or a pair of strings.
    """
    if isinstance(latent_format, str):
        parts = [p.strip() for p in latent_format.split(",")]
        if len(parts) == 1:
            return parts[0], parts[0]
        if len(parts) == 2:
            return parts[0], parts[1]
    elif isinstance(latent_format, (tuple, list)) and len(latent_format) == 2 and all(
            isinstance(f, str) for f in latent_format):
        return latent_format[0], latent_format[1]
    raise CKVPConfigError(f"latent_format must be a format name ('float', 'int8', 'int4', 'int2', optionally "
                          f"'/block') or a 'K,V' pair of them, got {latent_format!r}")


# ---------------------------------------------------------------------------------------------- bases


def calibration_samples(model: torch.nn.Module, opts: LatentInspectOptions) -> tuple[list[torch.Tensor], str]:
    """Return the calibration samples, (1, sample_len) int64 token ids on the model's device, and a description.

    Random ids (seed :data:`CALIBRATION_SEED`) without ``opts.text``; else consecutive windows of the text's ids
    (the file's raw bytes when the vocabulary has 256 entries, else its UTF-8 text through the tokenizer saved beside
    the model).

    Raises:
        CKVPConfigError: the text is too short for one window, not UTF-8 (for a tokenizer), or no tokenizer can be
        loaded for it.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    vocab = int(model.config.vocab_size)
    n, s = opts.num_samples, opts.sample_len
    if opts.text is None:
        gen = torch.Generator().manual_seed(CALIBRATION_SEED)
        samples = [torch.randint(0, vocab, (1, s), generator=gen).to(device) for _ in range(n)]
        return samples, f"{n} x {s} random tokens (seed {CALIBRATION_SEED})"
    ids = _encode(model, Path(opts.text), vocab)
    windows = [ids[i:i + s] for i in range(0, len(ids) - s + 1, s)][:n]
    if not windows:
        raise CKVPConfigError(f"calibration text {str(opts.text)!r} has {len(ids)} tokens, fewer than one sample "
                              f"of {s}; pass a text of at least {s} tokens, leave the text out (random tokens), or "
                              "lower LatentInspectOptions.sample_len")
    samples = [torch.tensor([w], dtype=torch.int64, device=device) for w in windows]
    return samples, f"{len(samples)} x {s} tokens of {Path(opts.text).name}"


def _encode(model: torch.nn.Module, path: Path, vocab: int) -> list[int]:
    """The file's token ids: its raw bytes for a 256-entry (byte-level) vocabulary, as the fixture's scripts read
    it, else its UTF-8 text through the model's tokenizer (CKVPConfigError when the file is not UTF-8)."""
    if vocab == 256:
        return list(path.read_bytes())
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CKVPConfigError(f"calibration text {str(path)!r} is not UTF-8 ({exc.reason} at byte {exc.start}); "
                              "pass a UTF-8 text file for this model's tokenizer") from None
    source = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError ... when there is none
        raise CKVPConfigError(f"cannot tokenize the calibration text: no tokenizer found for the model "
                              f"({type(exc).__name__}); calibrate on random tokens (leave the text out) or pass "
                              "bases") from None
    return list(tok.encode(text))


def resolve_bases(model: torch.nn.Module, opts: LatentInspectOptions, group_size: int) -> tuple[Any, str]:
    """Return the :class:`~ckvp_compile.latent.LatentBases` to inspect with, and where they came from.

    Args:
        model: the model (eval mode). opts: the latent options. group_size: G for calibration when
            ``opts.group_size`` is None.
    Raises:
        CKVPConfigError: a bases file that is not for this model (or not readable), or a kv_ratio the model cannot
            reach (the message names the range).
    """
    from ..latent import LatentBases, calibrate

    if isinstance(opts.bases, LatentBases):
        opts.bases.check_model(model)
        return opts.bases, "given LatentBases"
    if opts.bases is not None:
        return LatentBases.load(opts.bases, model=model), f"loaded from {Path(opts.bases).name}"
    samples, described = calibration_samples(model, opts)
    g = opts.group_size or group_size
    bases = calibrate(model, samples, group_size=g, kv_ratio=float(opts.kv_ratio),
                      rank_allocation=opts.rank_allocation, progress=False)
    return bases, (f"calibrated now: kv_ratio={opts.kv_ratio:g}, '{opts.rank_allocation}' ranks, G={g}, on "
                   f"{described}")


# ---------------------------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class LatentGroupRow:
    """One layer group of the latent store, as the report shows it.

    Attributes:
        index: group number. layers: its layer indices.
        k_ranks, v_ranks: rank of each KV head (Hkv entries), from the store's offsets.
        k_retained, v_retained: share of each head's calibration energy the rank keeps, in [0, 1].
        k_format, v_format: canonical storage formats ('float', 'int8/32' ...).
        k_bytes_per_token, v_bytes_per_token: bytes one token's K (V) latent row takes in the store: the format's
            row bytes plus the row-major rows' alignment padding (``LatentKVStore.latent_row_bytes``).
    """

    index: int
    layers: tuple[int, ...]
    k_ranks: tuple[int, ...]
    v_ranks: tuple[int, ...]
    k_retained: tuple[float, ...]
    v_retained: tuple[float, ...]
    k_format: str
    v_format: str
    k_bytes_per_token: int
    v_bytes_per_token: int

    #: Column titles of :meth:`cells`.
    HEADERS = ("group", "layers", "K ranks/head", "V ranks/head", "K kept %", "V kept %", "K format", "V format",
               "K B/token", "V B/token")

    def cells(self) -> tuple[str, ...]:
        """Return the row's cells as strings, in :attr:`HEADERS` order."""
        from .report import format_layers

        pct = lambda xs: ",".join(f"{100 * x:.1f}" for x in xs)  # noqa: E731
        return (str(self.index), format_layers(self.layers), ",".join(map(str, self.k_ranks)),
                ",".join(map(str, self.v_ranks)), pct(self.k_retained), pct(self.v_retained), self.k_format,
                self.v_format, str(self.k_bytes_per_token), str(self.v_bytes_per_token))


@dataclass(frozen=True)
class LatentReport:
    """The "latent KV" section: the latent store the inspection ran with, measured.

    Attributes:
        source: where the bases came from (a file, or the calibration run and its samples).
        num_kv_heads (Hkv), head_dim (D): of every group. target_ratio: the bases' requested element ratio.
        dtype: the model's KV dtype (dense cache, RoPE tables). latent_dtype: of 'float' latents and the bases.
        batch_size (B), max_cache_len (S_max): of the inspected store.
        groups: one :class:`LatentGroupRow` per group.
        dense_bytes_per_token: bytes one token of one sequence takes in the dense K and V caches of the covered
            layers (2 * L * Hkv * D * itemsize(dtype)).
        latent_bytes_per_token: bytes it takes in the store: every group's K and V rows plus the int32 slot
            position (4).
        store_bytes: :meth:`LatentKVStore.nbytes` as a dict (latent, slot_positions, bases, rope_tables,
            dense_equivalent, dense_elements), in bytes.
        ratio: dense / per-sequence state bytes, measured on the store. ratio_with_bases:
            ``StoreBytes.ratio_vs(dtype)``: the bases counted too, at this B and S_max.
            ratio_with_bases_latent_dtype: ``StoreBytes.ratio_vs(latent_dtype)``: the same against a dense cache
            in the latent dtype (what ``examples/generate.py`` reports for its bf16 store beside an fp32 model).
        bases: the :class:`~ckvp_compile.latent.LatentBases` themselves (``save()`` them to reuse); not in
            :meth:`to_dict`.
    """

    source: str
    num_kv_heads: int
    head_dim: int
    target_ratio: float
    dtype: str
    latent_dtype: str
    batch_size: int
    max_cache_len: int
    groups: tuple[LatentGroupRow, ...]
    dense_bytes_per_token: int
    latent_bytes_per_token: int
    store_bytes: dict[str, int]
    ratio: float
    ratio_with_bases: float
    bases: Any = dataclasses.field(default=None, repr=False, compare=False)
    ratio_with_bases_latent_dtype: float | None = None

    @classmethod
    def of(cls, store: Any, source: str) -> "LatentReport":
        """Describe a :class:`~ckvp_compile.runtime.store.LatentKVStore` (its bases, formats, and ``nbytes()``)."""
        from ..kernels.latent_format import parse_latent_format

        bases = store.bases
        rows = []
        for g, layers in enumerate(store.groups):
            ko, vo = store.k_offsets[g], store.v_offsets[g]
            kf, vf = parse_latent_format(store.k_formats[g]), parse_latent_format(store.v_formats[g])
            hs = range(store.num_kv_heads)
            rows.append(LatentGroupRow(
                g, tuple(layers),
                tuple(b - a for a, b in zip(ko, ko[1:])), tuple(b - a for a, b in zip(vo, vo[1:])),
                tuple(bases.retained_fraction(g, h, "k") for h in hs),
                tuple(bases.retained_fraction(g, h, "v") for h in hs),
                kf.name, vf.name, *store.latent_row_bytes(g),
            ))
        nb = store.nbytes()
        num_layers = sum(len(g) for g in store.groups)
        dense = 2 * num_layers * store.num_kv_heads * store.head_dim * torch.empty((), dtype=store.dtype).element_size()
        latent = sum(r.k_bytes_per_token + r.v_bytes_per_token for r in rows) + store.slot_pos.element_size()
        return cls(
            source=source, num_kv_heads=store.num_kv_heads, head_dim=store.head_dim,
            target_ratio=float(bases.target_ratio), dtype=_dtype_name(store.dtype),
            latent_dtype=_dtype_name(store.latent_dtype), batch_size=store.batch_size,
            max_cache_len=store.max_cache_len, groups=tuple(rows), dense_bytes_per_token=dense,
            latent_bytes_per_token=latent, store_bytes=dataclasses.asdict(nb), ratio=nb.ratio,
            ratio_with_bases=nb.ratio_vs(store.dtype), bases=bases,
            ratio_with_bases_latent_dtype=nb.ratio_vs(store.latent_dtype),
        )

    # ------------------------------------------------------------------ display lines
    def bytes_line(self) -> str:
        """Return 'KV bytes/token per sequence: dense D -> latent L (R x smaller)'; where the latent dtype is not the
        KV dtype (e.g. a bf16 store beside an fp32 model), also the ratio against a dense cache in the latent dtype."""
        d, lat = self.dense_bytes_per_token, self.latent_bytes_per_token
        also = ""
        if self.latent_dtype != self.dtype:
            d2 = d // getattr(torch, self.dtype).itemsize * getattr(torch, self.latent_dtype).itemsize
            also = f"; against a {self.latent_dtype} dense cache ({d2}) {d2 / lat:.2f}x"
        return (f"KV bytes/token per sequence: dense {d} ({self.dtype}) -> latent {lat} ({d / lat:.2f}x smaller"
                f"{also}; latent rows + 4-byte slot position)")

    def store_line(self) -> str:
        """Return the store's measured bytes (``nbytes()``) at its B and S_max, with both ratios."""
        b = self.store_bytes
        pages = b.get("page_table", 0)  # a paged store: its latents are the page pools, plus the page table
        paged = f" + page table {pages}" if pages else ""
        return (f"store at B={self.batch_size}, S_max={self.max_cache_len} (nbytes()): latents {b['latent']} + slot "
                f"positions {b['slot_positions']}{paged} = {b['latent'] + b['slot_positions'] + pages} B per-sequence "
                f"state vs dense {b['dense_equivalent']} B: ratio {self.ratio:.2f}x; bases {b['bases']} B and RoPE "
                f"tables {b['rope_tables']} B (model constants); with the bases counted {self.ratio_with_bases:.2f}x"
                + (f" ({self.ratio_with_bases_latent_dtype:.2f}x against a {self.latent_dtype} dense cache)"
                   if self.latent_dtype != self.dtype and self.ratio_with_bases_latent_dtype is not None else ""))

    def header_line(self) -> str:
        """Return the bases' source, shape and dtypes in one line."""
        return (f"bases: {self.source}; {len(self.groups)} group(s), Hkv={self.num_kv_heads}, D={self.head_dim}, "
                f"target ratio {self.target_ratio:g} (elements); KV dtype {self.dtype}, latent dtype "
                f"{self.latent_dtype}")

    def lines(self) -> list[str]:
        """Return the section's text lines after its table: bytes, store, page and window."""
        return [self.bytes_line(), self.store_line(), f"page: {PAGE}; recent dense window: {WINDOW}"]

    def to_dict(self) -> dict[str, Any]:
        """Return the section as JSON-serialisable data (rows as dicts, tuples as lists)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "bases"}
        out["groups"] = [dataclasses.asdict(r) for r in self.groups]
        out["store_bytes"] = dict(self.store_bytes)
        out["page"], out["window"] = PAGE, WINDOW
        return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
