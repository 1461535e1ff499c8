"""Cross-layer latent bases: per layer group and KV head, an orthonormal basis of the stacked pre-RoPE keys
and one of the stacked values, with the ranks kept and the spectra they were chosen from.

Notation (DESIGN.md, "CKVP in numbers"): group g holds G_g adjacent layers l0..l0+G_g-1 (G_g = G except maybe
the last group); for KV head h and token t, ``x_t = [k(l0,h,t); ...; k(l0+G_g-1,h,t)]`` in R^(G_g*D), layer j
of the group in rows ``j*D:(j+1)*D``. The basis P(g,h) holds the top-r eigenvectors of the uncentered second
moment ``C = sum_t x_t x_t^T / n`` (eigenvalues descending); the latent is ``z_t = P^T x_t`` in R^r and layer
j's key is rebuilt from its row block, ``P[j*D:(j+1)*D] z_t``. Values likewise (no RoPE). On the calibration
data the mean squared error ``E||x - P P^T x||^2`` equals the sum of the discarded eigenvalues.

:class:`LatentBases` stores, per group g (tensors on one device):

=====================  =====================  ======================================================
field                  shape, dtype           meaning
=====================  =====================  ======================================================
``k_basis[g]``         (Hkv, G_g*D, Rmax_g)   key bases; head h uses columns ``:k_ranks[g][h]``, the
                       float32 (or ``to``)    rest are zero. Rmax_g = max over heads of the rank.
``k_ranks[g]``         tuple of Hkv ints      rank kept per head, 1..G_g*D
``k_eigenvalues[g]``   (Hkv, G_g*D) float64   all eigenvalues of C, descending, >= 0
``v_*``                as ``k_*``             values
=====================  =====================  ======================================================

Files: :meth:`LatentBases.save` writes ONE safetensors file, the tensors above as ``k_basis.<g>`` ... plus JSON
metadata (``format``, ``format_version``, groups, ranks, fingerprint) in the safetensors metadata dict.

Source: cross-layer SVD of grouped KV caches, xKV (Chang et al. 2025, arXiv:2503.18893), here fitted once on
calibration text as DESIGN.md describes (xKV also fits per sequence at prefill).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import torch

from ..errors import CKVPConfigError, CKVPShapeError
from .weighting import weighted_projection_basis
from .ranks import (
    RANK_ALLOCATIONS,
    allocate_ranks,
    key_rank_caps,
    max_key_rank_error,
    rank_block_error,
    rank_budget,
    retained_fraction,
)

__all__ = ["BASES", "FORMAT_NAME", "FORMAT_VERSION", "KEY_SPACES", "LatentBases", "build_latent_bases",
           "check_target_ratio", "fingerprint_weights_match", "key_space_error", "model_fingerprint"]

Kind = Literal["k", "v"]
#: ``format`` entry of a saved file's metadata.
FORMAT_NAME = "ckvp-latent-bases"
#: Version of the file layout; :meth:`LatentBases.load` reads this version only.
FORMAT_VERSION = 1
#: Valid values of ``basis``: 'pca' (top eigenvectors of the second moment) or 'weighted' (:mod:`.weighting`).
BASES: tuple[str, ...] = ("pca", "weighted")
#: Valid values of ``key_space``: which keys the key bases span (see :class:`LatentBases`).
KEY_SPACES: tuple[str, ...] = ("pre_rope", "post_rope")
_RECALIBRATE = "re-run ckvp_compile.calibrate(model, samples) for this model and save() the result"

# (fingerprint key, config attribute names tried in order: Hugging Face, then gpt-fast)
_CONFIG_FIELDS = (
    ("num_layers", ("num_hidden_layers", "n_layer", "n_layers")),
    ("hidden", ("hidden_size", "dim", "d_model")),
    ("num_heads", ("num_attention_heads", "n_head", "n_heads")),
    ("num_kv_heads", ("num_key_value_heads", "n_local_heads", "n_kv_heads")),
    ("head_dim", ("head_dim",)),
)


@dataclass(frozen=True, eq=False)
class LatentBases:
    """Calibrated cross-layer latent bases and ranks of one model (see the module docstring for the layout).

    Attributes:
        groups: layer indices of each group, ascending and consecutive; the last may be shorter than G.
        num_kv_heads (Hkv), head_dim (D), group_size (G): shared by every group.
        target_ratio: the requested dense / latent ratio (rho); rank_allocation: 'energy' or 'uniform'.
        k_basis, v_basis, k_ranks, v_ranks, k_eigenvalues, v_eigenvalues: per group, see the module table.
        model_fingerprint: what identifies the calibrated model (:func:`model_fingerprint`).
        num_tokens: calibration tokens the second moments were averaged over.
        k_formats, v_formats: per group, the latent storage format planned for it
            (:mod:`~ckvp_compile.latent.planner`, e.g. a ``mix/...`` bit plan); empty when none was planned. A
            cache built with ``latent_format="auto"`` uses them.
        online: True for online bases (:func:`~ckvp_compile.latent.online_bases`): only the ranks are fixed
            here; each sequence's bases are fitted at its prefill from its own keys and values, and the
            tensors held here are zero placeholders.
    Raises:
        CKVPShapeError: a tensor's shape disagrees with the groups, Hkv, D or ranks.
    """

    groups: tuple[tuple[int, ...], ...]
    num_kv_heads: int
    head_dim: int
    group_size: int
    target_ratio: float
    rank_allocation: str
    k_basis: tuple[torch.Tensor, ...]
    v_basis: tuple[torch.Tensor, ...]
    k_ranks: tuple[tuple[int, ...], ...]
    v_ranks: tuple[tuple[int, ...], ...]
    k_eigenvalues: tuple[torch.Tensor, ...]
    v_eigenvalues: tuple[torch.Tensor, ...]
    model_fingerprint: dict[str, Any]
    num_tokens: int
    online: bool = False
    k_formats: tuple[str, ...] = ()
    v_formats: tuple[str, ...] = ()
    #: '' (the columns are the principal components) or ``"hadamard/<block>"``: each head's kept columns were
    #: rotated in blocks of ``block`` (:mod:`~ckvp_compile.latent.rotation`; same subspace, equal-variance
    #: coordinates per quantization block). A record for inspection: every consumer just uses the columns.
    rotation: str = ""
    #: None, or the cap the key ranks were allocated under (``max_key_rank``; the bytes went to the other units).
    #: A record for inspection: every consumer just uses the ranks.
    max_key_rank: int | None = None
    #: Which keys the key bases span. 'pre_rope' (default): the keys before RoPE; decode re-applies RoPE at each
    #: cached token's position, tile by tile (DESIGN.md, "CKVP in numbers"). 'post_rope': the keys as the model
    #: caches them, after RoPE; decode treats the layer like a model without RoPE, so the scores are absorbed
    #: into the latent like the values (r multiply-adds per cached token and head instead of a RoPE-table
    #: product), at a fidelity cost: RoPE spreads each pair's energy, so post-RoPE keys need more rank (Loki,
    #: Singhania et al. 2024, arXiv:2406.02542, measured the post-RoPE key spectra).
    key_space: str = "pre_rope"

    def __post_init__(self) -> None:
        if key_space_error(self.key_space):
            raise CKVPConfigError(key_space_error(self.key_space))
        hkv, d = self.num_kv_heads, self.head_dim
        for kind in ("k", "v"):
            bases, ranks, eigs = self.basis(kind), self.ranks(kind), self.eigenvalues(kind)
            if not len(bases) == len(ranks) == len(eigs) == len(self.groups):
                raise CKVPShapeError(f"{kind}: need one basis, rank tuple and spectrum per group "
                                     f"({len(self.groups)}), got {len(bases)}, {len(ranks)}, {len(eigs)}")
            for g, layers in enumerate(self.groups):
                n = len(layers) * d
                rmax = max(ranks[g], default=0)
                if len(ranks[g]) != hkv or not all(1 <= r <= n for r in ranks[g]):
                    raise CKVPShapeError(f"{kind}_ranks[{g}] must be {hkv} ints in 1..{n}, got {ranks[g]}")
                if tuple(bases[g].shape) != (hkv, n, rmax) or tuple(eigs[g].shape) != (hkv, n):
                    raise CKVPShapeError(
                        f"{kind}_basis[{g}] must be {(hkv, n, rmax)} and {kind}_eigenvalues[{g}] {(hkv, n)}, got "
                        f"{tuple(bases[g].shape)} and {tuple(eigs[g].shape)}")

    # ------------------------------------------------------------------ accessors
    def basis(self, kind: Kind) -> tuple[torch.Tensor, ...]:
        """``k_basis`` or ``v_basis``."""
        return self.k_basis if kind == "k" else self.v_basis

    def ranks(self, kind: Kind) -> tuple[tuple[int, ...], ...]:
        """``k_ranks`` or ``v_ranks``."""
        return self.k_ranks if kind == "k" else self.v_ranks

    def eigenvalues(self, kind: Kind) -> tuple[torch.Tensor, ...]:
        """``k_eigenvalues`` or ``v_eigenvalues``."""
        return self.k_eigenvalues if kind == "k" else self.v_eigenvalues

    @property
    def num_layers(self) -> int:
        """Layers covered by the groups (L)."""
        return sum(len(layers) for layers in self.groups)

    def layer_block(self, g: int, j: int, kind: Kind) -> torch.Tensor:
        """Return layer j's rows of group g's basis: (Hkv, D, Rmax_g), a view of ``{kind}_basis[g]``.

        Layer ``groups[g][j]``'s key (value) of head h is rebuilt as ``layer_block(g, j, kind)[h] @ z`` from the
        latent ``z`` (zero beyond the head's rank).
        """
        if not 0 <= j < len(self.groups[g]):
            raise IndexError(f"group {g} has layers 0..{len(self.groups[g]) - 1}, got j={j}")
        d = self.head_dim
        return self.basis(kind)[g][:, j * d:(j + 1) * d, :]

    def latent_elements_per_token(self) -> int:
        """Latent elements stored per token: the sum of every rank, K and V, over groups and heads."""
        return sum(sum(r) for r in self.k_ranks) + sum(sum(r) for r in self.v_ranks)

    def dense_elements_per_token(self) -> int:
        """Elements the dense cache stores per token for the same layers: L * Hkv * D * 2."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2

    def ratio(self) -> float:
        """Measured compression ratio dense / latent (>= ``target_ratio``; no quantization counted)."""
        return self.dense_elements_per_token() / self.latent_elements_per_token()

    def discarded_energy(self, g: int, h: int, kind: Kind) -> float:
        """Sum of the discarded eigenvalues of (group g, head h): the mean squared error ``E||x - P P^T x||^2``
        per calibration token, in the units of the keys (values) squared."""
        return float(self.eigenvalues(kind)[g][h, self.ranks(kind)[g][h]:].sum())

    def retained_fraction(self, g: int, h: int, kind: Kind) -> float:
        """Kept share of (group g, head h)'s energy, ``sum(lambda[:r]) / sum(lambda)``, in [0, 1]."""
        return retained_fraction(self.eigenvalues(kind)[g][h], self.ranks(kind)[g][h])

    # ------------------------------------------------------------------ conversion
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "LatentBases":
        """Return a copy with the bases on ``device`` in ``dtype`` (eigenvalues move but stay float64).

        Args:
            device: target device, or None (keep). dtype: a floating ``torch.dtype`` for the bases, or None (keep).
        Raises:
            CKVPConfigError: ``dtype`` is not a floating torch.dtype (an integer copy of an orthonormal basis rounds
                almost every entry to 0, and such a file is refused at load).
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise CKVPConfigError(f"LatentBases.to: dtype must be a floating torch.dtype (e.g. torch.bfloat16), got "
                                  f"{dtype!r}")
        return dataclasses.replace(
            self,
            k_basis=tuple(b.to(device=device, dtype=dtype) for b in self.k_basis),
            v_basis=tuple(b.to(device=device, dtype=dtype) for b in self.v_basis),
            k_eigenvalues=tuple(e.to(device=device) for e in self.k_eigenvalues),
            v_eigenvalues=tuple(e.to(device=device) for e in self.v_eigenvalues),
        )

    def _metadata(self) -> dict[str, Any]:
        return {
            "groups": [list(layers) for layers in self.groups], "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "group_size": self.group_size, "target_ratio": self.target_ratio,
            "rank_allocation": self.rank_allocation, "k_ranks": [list(r) for r in self.k_ranks],
            "v_ranks": [list(r) for r in self.v_ranks], "model_fingerprint": self.model_fingerprint,
            "num_tokens": self.num_tokens, "online": self.online, "k_formats": list(self.k_formats),
            "v_formats": list(self.v_formats), "rotation": self.rotation, "max_key_rank": self.max_key_rank,
            "key_space": self.key_space,
        }

    def save(self, path: str | Path) -> None:
        """Write the bases to ONE safetensors file (tensors + JSON metadata, ``format_version``).

        The metadata also holds ``tensors_sha256``, a hash of every tensor's name, dtype, shape and bytes, and
        ``meta_sha256``, a hash of the JSON metadata (groups, ranks, formats, key space, fingerprint), which
        :meth:`load` checks (safetensors itself has no checksum: a damaged byte would load silently).

        Args:
            path: file to write (overwritten); parent directories must exist.
        Raises:
            CKVPConfigError: ``path`` is not a str or ``os.PathLike``, is an existing directory, or its parent
                directory does not exist (the message names the fix).
        """
        from safetensors.torch import save_file

        path = _bases_path(path, "save")
        if path.is_dir():
            raise CKVPConfigError(f"LatentBases.save: {str(path)!r} is a directory; give a file path inside it, e.g. "
                                  f"{str(path / 'bases.safetensors')!r}")
        if not path.parent.is_dir():
            raise CKVPConfigError(f"LatentBases.save: the directory {str(path.parent)!r} of {str(path)!r} does not "
                                  f"exist; create it first (Path({str(path.parent)!r}).mkdir(parents=True))")
        tensors: dict[str, torch.Tensor] = {}
        for kind in ("k", "v"):
            for g in range(len(self.groups)):
                tensors[f"{kind}_basis.{g}"] = self.basis(kind)[g].detach().cpu().contiguous()
                tensors[f"{kind}_eigenvalues.{g}"] = self.eigenvalues(kind)[g].detach().cpu().contiguous()
        text = json.dumps(self._metadata())
        meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "meta": text,
                _CHECKSUM_KEY: _tensors_sha256(tensors), _META_CHECKSUM_KEY: hashlib.sha256(text.encode()).hexdigest()}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module | None = None) -> "LatentBases":
        """Read bases written by :meth:`save` (on CPU), optionally checking that they belong to ``model``.

        Args:
            path: the safetensors file.
            model: when given, its :func:`model_fingerprint` must equal the stored one.
        Returns:
            The :class:`LatentBases`, tensors on CPU in the dtypes saved.
        Raises:
            CKVPConfigError: ``path`` is not a str or ``os.PathLike``; the file is missing, not a safetensors file,
                not a ckvp bases file, of another format version, or inconsistent (shapes, ranks, metadata, bases
                that are not finite or not orthonormal, eigenvalues that are negative or not descending, tensors
                or metadata whose bytes differ from the ``tensors_sha256`` / ``meta_sha256`` saved with them); or
                ``model`` is not the
                calibrated model (the message names both models and says to re-run calibrate).
        """
        from safetensors import safe_open

        path = _bases_path(path, "load")
        if not path.is_file():
            raise CKVPConfigError(f"no latent bases file at {str(path)!r}; create one with "
                                  "ckvp_compile.calibrate(model, samples).save(path)")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                header = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise CKVPConfigError(f"{str(path)!r} is not a readable safetensors file ({type(exc).__name__}: "
                                  f"{exc}); {_RECALIBRATE}") from None
        if header.get("format") != FORMAT_NAME:
            raise CKVPConfigError(f"{str(path)!r} is a safetensors file but not ckvp latent bases (metadata format="
                                  f"{header.get('format')!r}, expected {FORMAT_NAME!r}); {_RECALIBRATE}")
        if header.get("format_version") != str(FORMAT_VERSION):
            raise CKVPConfigError(f"{str(path)!r} has latent bases format version {header.get('format_version')!r};"
                                  f" this ckvp_compile reads version {FORMAT_VERSION}; {_RECALIBRATE}")
        try:
            meta = json.loads(header["meta"])
            n = len(meta["groups"])
            flat = [int(x) for layers in meta["groups"] for x in layers]
            if flat != list(range(len(flat))) or not all(meta["groups"]):
                raise ValueError(f"groups {meta['groups']} are not consecutive layers 0..L-1 in ascending order")
            bases = cls(
                groups=tuple(tuple(int(x) for x in layers) for layers in meta["groups"]),
                num_kv_heads=int(meta["num_kv_heads"]), head_dim=int(meta["head_dim"]),
                group_size=int(meta["group_size"]), target_ratio=float(meta["target_ratio"]),
                rank_allocation=str(meta["rank_allocation"]),
                k_basis=tuple(tensors[f"k_basis.{g}"] for g in range(n)),
                v_basis=tuple(tensors[f"v_basis.{g}"] for g in range(n)),
                k_ranks=tuple(tuple(int(r) for r in rs) for rs in meta["k_ranks"]),
                v_ranks=tuple(tuple(int(r) for r in rs) for rs in meta["v_ranks"]),
                k_eigenvalues=tuple(tensors[f"k_eigenvalues.{g}"] for g in range(n)),
                v_eigenvalues=tuple(tensors[f"v_eigenvalues.{g}"] for g in range(n)),
                model_fingerprint=dict(meta["model_fingerprint"]), num_tokens=int(meta["num_tokens"]),
                online=meta.get("online", False) in (True, "true", "True", 1), k_formats=tuple(meta.get("k_formats", ())),
                v_formats=tuple(meta.get("v_formats", ())), rotation=str(meta.get("rotation", "")),
                max_key_rank=None if meta.get("max_key_rank") is None else int(meta["max_key_rank"]),
                key_space=str(meta.get("key_space", "pre_rope")),
            )
            # the hash covers the tensors save() wrote: another tool may have added tensors of its own
            used = {k: tensors[k] for kind in ("k", "v") for g in range(n)
                    for k in (f"{kind}_basis.{g}", f"{kind}_eigenvalues.{g}")}
            why = _corrupt_values(bases, meta) or _meta_checksum_error(header) or _checksum_error(used, header)
            if why:
                raise ValueError(why)
        except (KeyError, TypeError, ValueError) as exc:  # CKVPShapeError is a ValueError
            raise CKVPConfigError(f"{str(path)!r} holds corrupt ckvp latent bases ({type(exc).__name__}: {exc}); "
                                  f"{_RECALIBRATE}") from None
        if model is not None:
            bases.check_model(model, source=str(path))
        return bases

    def check_model(self, model: torch.nn.Module, *, source: str = "these latent bases") -> None:
        """Raise unless ``model``'s :func:`model_fingerprint` equals the calibrated model's.

        Raises:
            CKVPConfigError: naming both models, the fields that differ, and the fix (re-run calibrate); or
                ``model`` is not a ``torch.nn.Module``.
        """
        if not isinstance(model, torch.nn.Module):
            raise CKVPConfigError(f"{source}: model must be the torch.nn.Module the bases are for (e.g. "
                                  f"LatentBases.load(path, model=model)), got {type(model).__name__}")
        stored = self.model_fingerprint
        actual = model_fingerprint(model, stored.get("k_weight"))
        diff = [k for k in sorted(set(stored) | set(actual))
                if k not in (*_HASH_KEYS, _SAMPLE_KEY, _LAYERS_KEY) and stored.get(k) != actual.get(k)]
        if not fingerprint_weights_match(stored, actual):
            diff.append(_HASH_KEYS[0])
        layers = _layers_mismatch(stored, actual)
        if diff or layers:
            detail = "; ".join([f"{k}: calibrated {stored.get(k)!r}, model {actual.get(k)!r}" for k in diff]
                               + ([f"key projection {layers}"] if layers else []))
            raise CKVPConfigError(
                f"{source} were calibrated on another model: {_describe(stored)}, but the model is "
                f"{_describe(actual)} ({detail}); {_RECALIBRATE}")

    def check_weight(self, weight: Any, path: str | None, *, source: str = "these latent bases") -> None:
        """Raise unless ``weight`` is the key projection weight these bases were calibrated with (same shape and
        values rounded to bf16, or to fp16 then bf16: :func:`fingerprint_weights_match`). The backend calls it at
        the first call of a compiled graph on each cache, with the graph's input that the fingerprinted layer's key
        projection multiplies by: bases kept in memory and handed to a cache for another model of the same shape
        (another checkpoint, a fine-tune) would otherwise run without error at a lower fidelity than calibrated.

        Args:
            weight: the graph input (any dtype / device; a non-tensor or non-float one is not checked).
            path: its attribute path below the compiled module (``model.layers.0.self_attn.k_proj.weight``), or
                None. Nothing is checked when it does not name the fingerprint's ``k_weight`` (a suffix of either
                counts: the compiled root may be the model or a module inside or around it), when the fingerprint
                has no hash (bases built by hand), or for online bases (fitted to each prompt).
        Raises:
            CKVPConfigError: the hashes differ; names both and the fix (re-run calibrate, or, to use these bases
                anyway, ``bases.model_fingerprint["k_weight_sha256"] = None``).
        """
        fp = self.model_fingerprint
        name, sha = fp.get("k_weight"), fp.get("k_weight_sha256")
        if self.online or not name or not sha or not path:
            return
        if not (path == name or path.endswith("." + name) or name.endswith("." + path)):
            return
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.is_meta:
            return
        actual = _weight_sha256(weight)
        wide = _weight_sha256(weight.to(torch.float16)) if _wide_float(weight) else None
        if not fingerprint_weights_match(fp, {_HASH_KEYS[0]: actual, _HASH_KEYS[1]: wide,
                                             _SAMPLE_KEY: _weight_sample(weight)}):
            raise CKVPConfigError(
                f"{source} were calibrated on another model: the key projection {name} they were fitted with has "
                f"sha256 {sha[:12]} (shape and values rounded to bf16), this model's {path} has {actual[:12]} "
                f"({_describe(fp)}). Another checkpoint of the same shape gets bases that do not fit its keys: "
                f"{_RECALIBRATE}; to use these bases anyway, set bases.model_fingerprint['k_weight_sha256'] = None.")

    # ------------------------------------------------------------------ report
    def summary(self) -> str:
        """Return a text table: group, layers, ranks per head (K / V), retained energy per head (%)."""
        head = (f"LatentBases: {self.num_layers} layers in {len(self.groups)} groups of <= {self.group_size}, "
                f"Hkv={self.num_kv_heads}, D={self.head_dim}; {self.dense_elements_per_token()} -> "
                f"{self.latent_elements_per_token()} elements per token ({self.ratio():.3f}x fewer elements, element "
                f"target {self.target_ratio:g}; a byte ratio also counts the latent format's bits and scales, "
                f"LatentKVStore.nbytes(); '{self.rank_allocation}' allocation"
                + (f", key ranks capped at {self.max_key_rank}" if self.max_key_rank else "")
                + f"); {self.num_tokens} calibration tokens")
        rows = [("group", "layers", "K ranks", "V ranks", "K retained %", "V retained %")]
        for g, layers in enumerate(self.groups):
            hs = range(self.num_kv_heads)
            rows.append((
                str(g), f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0]),
                ",".join(map(str, self.k_ranks[g])), ",".join(map(str, self.v_ranks[g])),
                ",".join(f"{100 * self.retained_fraction(g, h, 'k'):.1f}" for h in hs),
                ",".join(f"{100 * self.retained_fraction(g, h, 'v'):.1f}" for h in hs),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([head] + lines)

    def __repr__(self) -> str:
        return (f"LatentBases(groups={len(self.groups)}, layers={self.num_layers}, Hkv={self.num_kv_heads}, "
                f"D={self.head_dim}, ratio={self.ratio():.3f}, target_ratio={self.target_ratio:g}, "
                f"rank_allocation={self.rank_allocation!r}"
                + (f", key_space={self.key_space!r})" if self.key_space != "pre_rope" else ")"))


#: How far a loaded basis's kept columns may be from orthonormal (max |P_r^T P_r - I|): an fp8 copy of an exact
#: basis stays within about 0.01 (its rounding errors average out over a column), a rescaled or foreign one does not.
ORTHONORMAL_TOL = 0.05


def _corrupt_values(bases: "LatentBases", meta: dict[str, Any]) -> str | None:
    """What makes loaded ``bases`` unusable beyond their shapes (checked by ``__post_init__``), or None: ranks that are
    not JSON ints, metadata numbers out of range, bases or spectra that are not finite floats, and (except online
    bases, zero placeholders) kept basis columns that are not orthonormal within :data:`ORTHONORMAL_TOL`."""
    for kind in ("k", "v"):
        if not all(type(r) is int for rs in meta[f"{kind}_ranks"] for r in rs):
            return f"{kind}_ranks {meta[f'{kind}_ranks']} are not all ints"
    if type(meta["group_size"]) is not int or not max(map(len, bases.groups)) <= bases.group_size:
        return f"group_size {meta['group_size']!r} is not an int >= every group's {max(map(len, bases.groups))} layers"
    if not (bases.target_ratio == bases.target_ratio and 0 < bases.target_ratio < float("inf")):
        return f"target_ratio {bases.target_ratio} is not a positive number"
    if bases.num_tokens < 0 or (bases.max_key_rank is not None and bases.max_key_rank < 1):
        return f"num_tokens {bases.num_tokens} < 0 or max_key_rank {bases.max_key_rank} < 1"
    from ..kernels.latent_format import parse_latent_format

    for kind in ("k", "v"):
        fmts = meta.get(f"{kind}_formats", [])
        if not isinstance(fmts, list) or len(fmts) not in (0, len(bases.groups)):
            return f"{kind}_formats {fmts!r} is not a list of one format per group ({len(bases.groups)}) or empty"
        for f in fmts:
            try:
                parse_latent_format(f)
            except (ValueError, TypeError) as exc:
                return f"{kind}_formats: {exc}"
    for kind in ("k", "v"):
        for g, (p, e, ranks) in enumerate(zip(bases.basis(kind), bases.eigenvalues(kind), bases.ranks(kind))):
            for name, t in ((f"{kind}_basis.{g}", p), (f"{kind}_eigenvalues.{g}", e)):
                if not t.is_floating_point() or not bool(torch.isfinite(t.float()).all()):
                    return f"{name} is not a finite float tensor (dtype {t.dtype})"
            ev = e.double()
            if bool((ev < 0).any()) or bool((ev[:, 1:] > ev[:, :-1] * (1 + 1e-9) + 1e-300).any()):
                return f"{kind}_eigenvalues.{g} are not >= 0 and descending per head (a second moment's spectrum)"
            if bases.online:
                continue
            for h, r in enumerate(ranks):
                cols = p[h, :, :r].double()
                err = float((cols.mT @ cols - torch.eye(r, dtype=torch.float64)).abs().max())
                if err > ORTHONORMAL_TOL:
                    return (f"the {r} kept columns of {kind}_basis.{g}, head {h}, are not orthonormal "
                            f"(max |P^T P - I| = {err:.3g} > {ORTHONORMAL_TOL})")
    return None


#: Metadata key of the tensors' hash written by :meth:`LatentBases.save` (files saved before it have none).
_CHECKSUM_KEY = "tensors_sha256"


def _tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor of a bases file, in name order: its name, dtype, shape and raw bytes (any dtype,
    bf16 and float8 included, read as bytes). Raises nothing for CPU tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


#: Metadata key of the JSON metadata's hash written by :meth:`LatentBases.save` (files saved before it have none).
_META_CHECKSUM_KEY = "meta_sha256"


def _meta_checksum_error(header: dict[str, str]) -> str | None:
    """Why a bases file's JSON metadata does not match the ``meta_sha256`` saved with it, or None (equal, or a file
    saved before the hash existed): the ranks, formats and key space there are read as they are, so an edited
    byte would load other bases silently."""
    want = header.get(_META_CHECKSUM_KEY)
    if want is None:
        return None
    got = hashlib.sha256(str(header.get("meta", "")).encode()).hexdigest()
    if got != want:
        return (f"the metadata's sha256 {got[:12]} differs from the {str(want)[:12]} saved with it: the file's "
                f"groups, ranks, formats or key space were damaged or edited after save(). A file edited on purpose "
                f"loads, with every other check, once its {_META_CHECKSUM_KEY!r} metadata entry is removed")
    return None


def _checksum_error(tensors: dict[str, torch.Tensor], header: dict[str, str]) -> str | None:
    """Why the tensors read from a bases file do not match the ``tensors_sha256`` saved with them, or None (equal,
    or a file saved before the hash existed)."""
    want = header.get(_CHECKSUM_KEY)
    if want is None:
        return None
    got = _tensors_sha256(tensors)
    if got != want:
        return (f"the tensors' sha256 {got[:12]} differs from the {str(want)[:12]} saved with them: the file was "
                f"damaged or edited after save(). A file converted on purpose (e.g. its tensors cast by another "
                f"tool) loads, with every other check, once its {_CHECKSUM_KEY!r} metadata entry is removed; "
                f"LatentBases.load(path).to(dtype=...).save(new_path) converts one and keeps the hash")
    return None


def _bases_path(path: Any, what: str) -> Path:
    """``path`` as a :class:`Path`; :class:`CKVPConfigError` naming the fix unless it is a str or ``os.PathLike``
    of a str (``what``: 'save' or 'load', for the message)."""
    import os

    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise CKVPConfigError(f"LatentBases.{what}: path must be a file path (a str or pathlib.Path, e.g. "
                              f"'bases.safetensors'), got {path!r}")
    return Path(path)


def _describe(fp: dict[str, Any]) -> str:
    sha = fp.get("k_weight_sha256") or "?"
    return (f"{fp.get('architecture')} (L={fp.get('num_layers')}, hidden={fp.get('hidden')}, "
            f"H={fp.get('num_heads')}, Hkv={fp.get('num_kv_heads')}, D={fp.get('head_dim')}, "
            f"{fp.get('k_weight')} sha256 {sha[:12]})")


_HASH_KEYS = ("k_weight_sha256", "k_weight_sha256_fp16")
_SAMPLE_KEY = "k_weight_sample"
_LAYERS_KEY = "layer_k_samples"
#: Values of each later layer's key projection kept in :func:`model_fingerprint`.
LAYER_SAMPLE_VALUES = 8
#: Values of the fingerprinted weight kept in :func:`model_fingerprint` (at evenly spaced flat positions).
SAMPLE_VALUES = 64


def fingerprint_weights_match(stored: dict[str, Any], actual: dict[str, Any]) -> bool:
    """Whether two :func:`model_fingerprint` results hold the same key projection weight up to a 16-bit rounding:
    equal ``k_weight_sha256`` (None on both sides included), a hash in common between the two (the fp32 model and
    its fp16 copy), or, where both keep ``k_weight_sample``, the same shape and every sampled value within 2^-8 of
    the other (relative): the bf16 and fp16 copies of one checkpoint, whose roundings differ (fingerprints saved
    before these fields existed have only the first hash). A fine-tune that moved no sampled value by 0.4% also
    matches; its keys are as close to the calibrated ones."""
    if stored.get(_HASH_KEYS[0]) == actual.get(_HASH_KEYS[0]):
        return True
    mine = {stored.get(k) for k in _HASH_KEYS} - {None}
    theirs = {actual.get(k) for k in _HASH_KEYS} - {None}
    if mine & theirs:
        return True
    a, b = stored.get(_SAMPLE_KEY), actual.get(_SAMPLE_KEY)
    try:
        if not a or not b or list(a["shape"]) != list(b["shape"]) or len(a["values"]) != len(b["values"]):
            return False
        return _samples_close(a["values"], b["values"])
    except (KeyError, TypeError):  # a malformed record matches nothing
        return False


def _samples_close(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two lists of sampled weight values are the same up to a 16-bit rounding: equal lengths and every
    pair within 2^-8 of the other (relative)."""
    return len(a) == len(b) and all(abs(x - y) <= 2.0 ** -8 * max(abs(x), abs(y)) + 2.0 ** -24 for x, y in zip(a, b))


def _weight_sample(w: torch.Tensor) -> dict[str, Any]:
    """``{"shape": [...], "values": [...]}``: :data:`SAMPLE_VALUES` values of ``w`` (as floats) at evenly spaced
    positions of its flattened form."""
    flat = w.detach().reshape(-1)
    idx = torch.linspace(0, max(flat.numel() - 1, 0), min(SAMPLE_VALUES, flat.numel())).long().to(flat.device)
    return {"shape": list(w.shape), "values": [float(v) for v in flat[idx].double().cpu()]}


def _wide_float(w: Any) -> bool:
    return isinstance(w, torch.Tensor) and w.is_floating_point() and w.element_size() > 2


def _weight_sha256(w: torch.Tensor) -> str:
    """sha256 of a weight's shape and its values rounded to bf16 (so fp32 and bf16 copies agree; an fp32 weight's
    fp16 copy rounds otherwise: :func:`model_fingerprint` hashes that rounding too)."""
    t = w.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    h = hashlib.sha256(str(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def plain_module(model: Any) -> Any:
    """``model`` itself, or the module a ``torch.compile(module)`` wrapper (``OptimizedModule``, which keeps it as
    ``_orig_mod``) holds. Raises nothing."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(model, torch.nn.Module) and isinstance(inner, torch.nn.Module) else model


def _config_field(cfg: Any, name: str) -> Any:
    """``cfg.name``, or None when absent or not one value for the whole model (transformers' heterogeneous
    configs, e.g. Gemma-4's per-layer ``head_dim``, raise ``AmbiguousGlobalPerLayerAttributeError``, a
    ``RuntimeError``, on global access). Raises nothing."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - any refusal of the global value means: no single value
        return None


def model_fingerprint(model: torch.nn.Module, k_weight: str | None = None) -> dict[str, Any]:
    """Return what identifies ``model`` for :meth:`LatentBases.load`: shape fields and one weight's hash.

    Args:
        model: a HF causal LM, a gpt-fast style model, or any ``nn.Module`` (a ``torch.compile`` wrapper of one:
            the module it holds).
        k_weight: parameter name of the first attention layer's key projection (found by calibrate from the
            graph); None or absent from the model: the first parameter of rank >= 2 is hashed instead.
    Returns:
        JSON-serialisable dict: ``architecture`` (class name), ``num_layers``, ``hidden``, ``num_heads``,
        ``num_kv_heads``, ``head_dim`` (from ``model.config``, HF or gpt-fast names; None when absent),
        ``k_weight`` (the parameter hashed), ``k_weight_sha256`` (its shape and values rounded to bf16, so the
        same model in bf16 / fp32 or on another device matches) and ``k_weight_sha256_fp16`` (for a weight wider
        than 16 bits: the same after a rounding to fp16, so the model cast to fp16 matches too; else None),
        ``k_weight_sample`` (its shape and :data:`SAMPLE_VALUES` of its values: the bf16 and fp16 copies of one
        checkpoint hash differently), ``layer_k_samples`` (:data:`LAYER_SAMPLE_VALUES` values of each later
        layer's key projection, by name; None where ``k_weight`` has no layer index 0).
        :func:`fingerprint_weights_match` compares two fingerprints' first weights, :meth:`LatentBases.check_model`
        also the later layers' samples (a fingerprint saved before they existed: the first weight only).
    """
    model = plain_module(model)
    cfg = getattr(model, "config", None)
    if cfg is not None and callable(getattr(cfg, "get_text_config", None)):
        cfg = cfg.get_text_config()
    fp: dict[str, Any] = {"architecture": type(model).__name__}
    for key, names in _CONFIG_FIELDS:
        value = next((v for v in (_config_field(cfg, n) for n in names) if isinstance(v, int)), None)
        fp[key] = value
    if fp["head_dim"] is None and fp["hidden"] and fp["num_heads"]:
        fp["head_dim"] = fp["hidden"] // fp["num_heads"]
    params = dict(model.named_parameters())
    if k_weight is None or k_weight not in params:
        k_weight = next((n for n, p in params.items() if p.dim() >= 2), k_weight)
    fp["k_weight"] = k_weight
    w = params.get(k_weight) if k_weight is not None else None
    fp["k_weight_sha256"] = _weight_sha256(w) if w is not None else None
    # a weight wider than 16 bits also as fp16 would have it: fp32 -> fp16 -> bf16 differs from fp32 -> bf16 in ~6%
    # of the values (double rounding), so without it the model cast to fp16 would not match its own bases
    fp["k_weight_sha256_fp16"] = _weight_sha256(w.to(torch.float16)) if _wide_float(w) else None
    fp[_SAMPLE_KEY] = _weight_sample(w) if isinstance(w, torch.Tensor) and w.is_floating_point() else None
    fp[_LAYERS_KEY] = _layer_samples(params, k_weight)
    return fp


def _layer_samples(params: dict[str, torch.Tensor], k_weight: str | None) -> dict[str, list[float]] | None:
    """:data:`LAYER_SAMPLE_VALUES` values of every later layer's key projection, found by the layer index in the
    fingerprinted name (``layers.0.`` -> ``layers.1.``, ...): the bases depend on every layer, and a model that
    shares layer 0 with the calibrated one (a fine-tune that froze it) must not match. None when the name holds
    no layer index 0."""
    if not k_weight or not re.search(r"\.0\.", "." + k_weight):
        return None
    out = {}
    for i in itertools.count(1):
        name = re.sub(r"(^|\.)0\.", rf"\g<1>{i}.", k_weight, count=1)
        w = params.get(name)
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.is_meta:
            break
        flat = w.detach().reshape(-1)
        idx = torch.linspace(0, max(flat.numel() - 1, 0), min(LAYER_SAMPLE_VALUES, flat.numel())).long()
        out[name] = [float(v) for v in flat[idx.to(flat.device)].double().cpu()]
    return out


def _layers_mismatch(stored: dict[str, Any], actual: dict[str, Any]) -> str | None:
    """The first later layer whose key projection differs between two fingerprints (its sampled values more than
    2^-8 apart, relative, as :func:`fingerprint_weights_match`; a layer on one side only), or None (the same, or a
    fingerprint saved before the samples existed)."""
    a, b = stored.get(_LAYERS_KEY), actual.get(_LAYERS_KEY)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x is None or y is None:
            return f"{name} is in the {'model' if x is None else 'calibrated model'} only"
        if not _samples_close(x, y):
            return f"{name} has other values"
    return None


def check_target_ratio(target_ratio: float, dense_elements: int, num_units: int) -> None:
    """Raise unless ``1 <= target_ratio <= dense_elements / num_units`` (at least rank 1 per unit).

    Args:
        target_ratio: rho requested. dense_elements: L*Hkv*D*2. num_units: groups * Hkv * 2.
    Raises:
        CKVPConfigError: naming the achievable range.
    """
    top = dense_elements / num_units
    ok = isinstance(target_ratio, (int, float)) and not isinstance(target_ratio, bool)
    if not ok or not 1 <= target_ratio <= top:
        raise CKVPConfigError(
            f"kv_ratio must be a number in [1, {top:g}] for this model ({dense_elements} dense KV elements per token,"
            f" {num_units} (group, KV head, K/V) latents of rank >= 1), got {target_ratio!r}")


def _eigh_desc(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decompose symmetric (Hkv, N, N) float64 matrices; eigenvalues descending (clamped >= 0),
    eigenvector signs fixed so each vector's largest-magnitude entry is positive (deterministic output)."""
    evals, evecs = torch.linalg.eigh(moment)
    evals, evecs = evals.flip(-1).clamp_min(0), evecs.flip(-1)
    idx = evecs.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(evecs, -2, idx))
    return evals, evecs * torch.where(sign == 0, torch.ones_like(sign), sign)


def build_latent_bases(groups: Sequence[Sequence[int]], k_moments: Sequence[torch.Tensor],
                       v_moments: Sequence[torch.Tensor], num_tokens: int, *, num_kv_heads: int, head_dim: int,
                       group_size: int, target_ratio: float, rank_allocation: str,
                       model_fingerprint: dict[str, Any], k_weights: Sequence[torch.Tensor] | None = None,
                       v_weights: Sequence[torch.Tensor] | None = None,
                       head_entropy: Sequence[torch.Tensor] | None = None, rank_block: int = 1,
                       max_key_rank: int | None = None, key_space: str = "pre_rope") -> LatentBases:
    """Eigen-decompose per-group second moments, allocate ranks under the budget, and assemble the bases.

    Args:
        groups: layer indices per group. k_moments, v_moments: per group, (Hkv, G_g*D, G_g*D) float64, the sum
            of ``x x^T`` over ``num_tokens`` calibration tokens (divided by it here).
        num_tokens: n > 0. num_kv_heads, head_dim, group_size: Hkv, D, G.
        target_ratio: rho; the budget is ``floor(L*Hkv*D*2 / rho)`` latent elements per token.
        rank_allocation: 'energy' or 'uniform' (:func:`~.ranks.allocate_ranks`).
        model_fingerprint: stored as is.
        k_weights, v_weights: per group, (Hkv, G_g*D, G_g*D) symmetric PSD weights S; when given, the ranks are
            still allocated from the plain spectra, then each unit's basis is the orthonormal P minimising
            ``tr(S (I - PP^T) C (I - PP^T))`` (:func:`~.weighting.weighted_projection_basis`) instead of PCA.
            The stored eigenvalues stay those of C.
        head_entropy: per group, (Hkv,) mean normalised attention entropy of each KV head's query heads over the
            group's layers, in [0, 1]; needed by ``rank_allocation='entropy'`` (K and V of a head share it).
        rank_block: ranks in whole blocks of this many coordinates (:func:`~.ranks.allocate_ranks`); 1: any.
        max_key_rank: None, or the most coordinates a key unit (group, KV head) keeps; the budget goes to the
            other units instead (:func:`~.ranks.key_rank_caps`: decode speed for fidelity at the same bytes).
        key_space: 'pre_rope' or 'post_rope', the keys ``k_moments`` were summed over
            (:attr:`LatentBases.key_space`).
    Returns:
        :class:`LatentBases`, bases float32 on the moments' device.
    Raises:
        CKVPConfigError: unknown rank_allocation or key_space, a rank_block that is not an int >= 1, a
            max_key_rank that is not None or an int >= 1, or target_ratio out of the achievable range.
    """
    if rank_allocation not in RANK_ALLOCATIONS:
        raise CKVPConfigError(f"rank_allocation must be one of {list(RANK_ALLOCATIONS)}, got {rank_allocation!r}")
    if rank_block_error(rank_block):
        raise CKVPConfigError(rank_block_error(rank_block))
    if max_key_rank_error(max_key_rank):
        raise CKVPConfigError(max_key_rank_error(max_key_rank))
    if key_space_error(key_space):
        raise CKVPConfigError(key_space_error(key_space))
    dense = sum(len(layers) for layers in groups) * num_kv_heads * head_dim * 2
    check_target_ratio(target_ratio, dense, 2 * len(groups) * num_kv_heads)
    decomposed = {kind: [_eigh_desc(m / num_tokens) for m in moments]
                  for kind, moments in (("k", k_moments), ("v", v_moments))}
    spectra = [decomposed[kind][g][0][h] for kind in ("k", "v") for g in range(len(groups))
               for h in range(num_kv_heads)]
    weights_u = None
    if rank_allocation == "entropy":
        if head_entropy is None:
            raise CKVPConfigError("rank_allocation='entropy' needs the attention entropy of every head, which "
                                  "calibration measures where it finds the queries; use 'energy' for this model")
        weights_u = [max(float(head_entropy[g][h]), 1e-3) for _ in ("k", "v") for g in range(len(groups))
                     for h in range(num_kv_heads)]
    max_ranks, budget = key_rank_caps(spectra, len(groups) * num_kv_heads, max_key_rank,
                                      rank_budget(dense, target_ratio), rank_block)
    flat = iter(allocate_ranks(spectra, budget, rank_allocation,  # type: ignore[arg-type]
                               weights_u, rank_block=rank_block, max_ranks=max_ranks))
    out: dict[str, Any] = {}
    for kind in ("k", "v"):
        ranks = [tuple(next(flat) for _ in range(num_kv_heads)) for _ in groups]
        bases = []
        weights = k_weights if kind == "k" else v_weights
        for g, ((evals, evecs), rs) in enumerate(zip(decomposed[kind], ranks)):
            basis = evecs[:, :, :max(rs)].clone()  # (Hkv, G_g*D, Rmax_g)
            for h, r in enumerate(rs):
                if weights is not None:
                    c = (k_moments if kind == "k" else v_moments)[g][h] / num_tokens
                    basis[h, :, :r] = weighted_projection_basis(c, weights[g][h].to(c), r)
                basis[h, :, r:] = 0
            bases.append(basis.float())
        out[f"{kind}_basis"] = tuple(bases)
        out[f"{kind}_ranks"] = tuple(ranks)
        out[f"{kind}_eigenvalues"] = tuple(evals for evals, _ in decomposed[kind])
    return LatentBases(groups=tuple(tuple(int(x) for x in layers) for layers in groups), num_kv_heads=num_kv_heads,
                       head_dim=head_dim, group_size=group_size, target_ratio=float(target_ratio),
                       rank_allocation=rank_allocation, model_fingerprint=dict(model_fingerprint),
                       num_tokens=int(num_tokens), max_key_rank=max_key_rank, key_space=key_space, **out)


def key_space_error(key_space: object) -> str:
    """'' when ``key_space`` is one of :data:`KEY_SPACES`, else the error message (naming the valid values)."""
    if isinstance(key_space, str) and key_space in KEY_SPACES:
        return ""
    return (f"key_space must be one of {list(KEY_SPACES)} ('pre_rope': RoPE re-applied at decode, the default; "
            f"'post_rope': keys compressed as cached, faster decode at more rank), got {key_space!r}")
