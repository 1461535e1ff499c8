"""Calibrate cross-layer latent bases on sample text: collect pre-RoPE keys and values by graph structure, then
eigen-decompose their stacked second moments per layer group and KV head.

How keys and values are found (never by module names): the model's Dynamo graph for a static-cache prefill is
captured by a recording backend, :func:`ckvp_compile.analysis.analyze` finds each layer's attention site, and the
graph is executed with a recording ``torch.fx.Interpreter`` that keeps

* the pre-RoPE key, ``site.rope.k_in`` (or the key written to the cache, ``site.k_cache.value_node``, when the
  layer has no RoPE), brought to (B, Hkv, S, D): the permutation between RoPE's output and the tensor written to
  the cache is read off the graph (gpt-fast applies RoPE on (B, S, Hkv, D) and transposes afterwards; Hugging
  Face transposes first), with a fallback on matching dims to Hkv and D; times ``site.rope.k_scale`` where the
  model scales the rotated key by a factor constant along the head dim (Llama-4's weightless ``qk_norm``);
* the value written to the cache, ``site.v_cache.value_node``, (B, Hkv, S, D).

Per group g (layers from :func:`ckvp_compile.plan.make_layer_groups`) and KV head h the float64 sums
``sum_t x_t x_t^T`` of the stacked ``x_t`` in R^(G_g*D) are accumulated over all samples; :func:`calibrate` then
hands them to :func:`~.bases.build_latent_bases`.

Source: cross-layer SVD of grouped KV caches, xKV (Chang et al. 2025, arXiv:2503.18893); the uncentered second
moment's eigenvectors are the right singular vectors of the stacked token matrix xKV factorises. DESIGN.md,
"CKVP in numbers".
"""

from __future__ import annotations

import collections.abc
import contextlib
import logging
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx

from ..analysis import AttentionSite, GraphAnalysis, analyze
from ..analysis.attention_ops import weight_source
from ..analysis.graph import node_map, op_name, shape_of
from ..config import GROUP_SIZES, CKVPConfig
from ..errors import CKVPConfigError, CKVPError, CKVPWarning
from ..plan import make_layer_groups
from .bases import (BASES, LatentBases, build_latent_bases, check_target_ratio, key_space_error, model_fingerprint,
                    plain_module)
from .capture import is_gpt_fast, is_hf_causal_lm, kept_module_setup, prefill, uncompiled_forward
from .ranks import RANK_ALLOCATIONS, max_key_rank_error, rank_block_error

__all__ = ["KVMoments", "calibrate", "collect_kv_moments"]

logger = logging.getLogger(__name__)

#: (xk, xv) per group, each (Hkv, N, G_g*D) float64: one sample's stacked keys and values (N = B*S tokens).
StackedKV = list[tuple[torch.Tensor, torch.Tensor]]

_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "_unsafe_view"})
_DTYPE_OR_LAYOUT = frozenset({"contiguous", "clone", "to", "float", "half", "bfloat16", "type_as", "_to_copy",
                              "alias", "detach"})


@dataclass
class KVMoments:
    """Accumulated second moments of the stacked pre-RoPE keys and values, per layer group.

    Attributes:
        groups: layer indices per group. num_kv_heads (Hkv), head_dim (D), group_size (G).
        k, v: per group, (Hkv, G_g*D, G_g*D) float64, ``sum_t x_t x_t^T`` (not yet divided by ``num_tokens``).
        num_tokens: tokens summed over (B*S over all samples).
        model_fingerprint: :func:`~.bases.model_fingerprint` of the model.
    """

    groups: tuple[tuple[int, ...], ...]
    num_kv_heads: int
    head_dim: int
    group_size: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_tokens: int
    model_fingerprint: dict[str, Any]
    #: per layer: (H, D) mean squared query channels (post-RoPE; RoPE keeps each pair's energy), when found
    q_energy: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per layer: the output projection weight (hidden, H*D), when found
    w_o: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per layer: the RoPE form ('rotate_half', 'interleaved', 'complex'; 'none' without RoPE)
    rope_form: dict[int, str] = field(default_factory=dict)
    #: per layer: (Hkv,) mean normalised causal attention entropy (H_t / log(t+1), t >= 1) of each KV head's
    #: query heads, in [0, 1], when the post-RoPE queries and keys were found
    attn_entropy: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per layer: (Hkv,) mean over queries t >= 1 (and each KV head's query heads) of ``sum_{s<t} p_ts^2``, the
    #: attention weights' squared mass on the *cached* (earlier) tokens: 1 / (effective number of attended
    #: tokens) of the cached part. Independent per-token noise in the cached values reaches the attention
    #: output scaled by it (:mod:`~.attention_noise`). Measured where the post-RoPE queries and keys were found.
    attn_sumsq: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per group, (G_g, Hkv, G_g*D, G_g*D) float64: for each layer l of the group, the mean of ``y y^T`` of the
    #: stacked attended values ``y_t = sum_{s<t} p^l_ts x_s`` (layer l's attention weights applied to the group's
    #: stacked values of the cached tokens) over every query t >= 1 and query head of the KV head; empty when the
    #: attention was not measured in every layer of every group.
    v_attended: list[torch.Tensor] = field(default_factory=list)
    #: which keys ``k`` summed over: 'pre_rope' (default) or 'post_rope' (the keys as cached;
    #: :attr:`LatentBases.key_space`)
    key_space: str = "pre_rope"

    def head_entropy(self) -> list[torch.Tensor] | None:
        """Per group, (Hkv,) the mean of :attr:`attn_entropy` over the group's layers; None when any is missing."""
        if any(layer not in self.attn_entropy for layers in self.groups for layer in layers):
            return None
        return [torch.stack([self.attn_entropy[layer] for layer in layers]).mean(0) for layers in self.groups]

    def weights(self, kind: str) -> list[torch.Tensor]:
        """Per group, (Hkv, G_g*D, G_g*D) block-diagonal weights of the 'weighted' basis (module
        :mod:`~.weighting`): keys by the rotation-averaged query energy, values by ``W_o^T W_o``; a layer whose
        queries or output projection were not found gets the identity (plain PCA for its block)."""
        from .weighting import key_query_weight, value_output_weight

        hkv, d, out = self.num_kv_heads, self.head_dim, []
        for layers in self.groups:
            blocks = []
            for layer in layers:
                if kind == "k" and layer in self.q_energy and self.rope_form.get(layer, "none") != "none":
                    blocks.append(key_query_weight(self.q_energy[layer], hkv, self.rope_form[layer]))
                elif kind == "v" and layer in self.w_o:
                    w = self.w_o[layer]
                    blocks.append(value_output_weight(w, w.shape[1] // d, hkv))
                elif kind == "k" and self.key_space == "post_rope":
                    logger.warning("ckvp calibrate: layer %d: the weighted key basis is for pre-RoPE keys (it averages "
                                   "the query weighting over RoPE's rotations); post-RoPE keys get plain PCA there",
                                   layer)
                    blocks.append(torch.eye(d, dtype=torch.float64).expand(hkv, d, d))
                else:
                    logger.warning("ckvp calibrate: layer %d: no %s for the weighted %s basis; using plain PCA there",
                                   layer, "query" if kind == "k" else "output projection", kind.upper())
                    blocks.append(torch.eye(d, dtype=torch.float64).expand(hkv, d, d))
            out.append(torch.stack([torch.block_diag(*[b[h].cpu() for b in blocks]) for h in range(hkv)]))
        return out

    def bases(self, kv_ratio: float = 4.0, rank_allocation: str = "energy", basis: str = "pca",
              rank_block: int = 1, max_key_rank: int | None = None) -> LatentBases:
        """Build :class:`LatentBases` at ``kv_ratio`` (see :func:`calibrate`); cheap for ``basis='pca'``, so several
        ratios can share one collection ('weighted' runs a small manifold optimisation per unit). ``rank_block``:
        ranks in whole blocks of that many coordinates (:func:`~.ranks.allocate_ranks`); ``max_key_rank``: a cap
        on every key unit's rank (:func:`~.ranks.key_rank_caps`). Raises CKVPConfigError for an unknown basis or
        rank_allocation, a rank_block that is not an int >= 1, a bad max_key_rank, or a ratio out of range."""
        if basis not in BASES:
            raise CKVPConfigError(f"basis must be one of {list(BASES)}, got {basis!r}")
        weights = {}
        if basis == "weighted":
            weights = {"k_weights": self.weights("k"), "v_weights": self.weights("v")}
        return build_latent_bases(self.groups, self.k, self.v, self.num_tokens, num_kv_heads=self.num_kv_heads,
                                  head_dim=self.head_dim, group_size=self.group_size, target_ratio=kv_ratio,
                                  rank_allocation=rank_allocation, model_fingerprint=self.model_fingerprint,
                                  head_entropy=self.head_entropy(), rank_block=rank_block,
                                  max_key_rank=max_key_rank, key_space=self.key_space, **weights)

    def regroup(self, group_size: int) -> "KVMoments":
        """Return the moments for a smaller group size that divides this one, without recollecting.

        A group of G' layers inside a group of G is a diagonal block of the stacked second moment, so moments
        collected at G=8 give G=4, 2 and 1 (the same groups :func:`~ckvp_compile.plan.make_layer_groups` makes).

        Raises:
            CKVPConfigError: ``group_size`` does not divide :attr:`group_size`.
        """
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 \
                or self.group_size % group_size:
            raise CKVPConfigError(f"regroup needs a group size dividing {self.group_size} (the collected one), got "
                                  f"{group_size!r}; collect with a larger group_size instead")
        d, groups, k, v = self.head_dim, [], [], []
        for layers, mk, mv in zip(self.groups, self.k, self.v):
            for start in range(0, len(layers), group_size):
                part = layers[start:start + group_size]
                rows = slice(start * d, (start + len(part)) * d)
                groups.append(part)
                k.append(mk[:, rows, rows].clone())
                v.append(mv[:, rows, rows].clone())
        attended = []
        if self.v_attended:
            for mo in self.v_attended:
                n = mo.shape[0]
                for start in range(0, n, group_size):
                    rows = slice(start * d, min(start + group_size, n) * d)
                    attended.append(mo[start:start + group_size, :, rows, rows].clone())
        return KVMoments(groups=tuple(groups), num_kv_heads=self.num_kv_heads, head_dim=d, group_size=group_size,
                         k=k, v=v, num_tokens=self.num_tokens, model_fingerprint=self.model_fingerprint,
                         q_energy=self.q_energy, w_o=self.w_o, rope_form=self.rope_form,
                         attn_entropy=self.attn_entropy, attn_sumsq=self.attn_sumsq, v_attended=attended,
                         key_space=self.key_space)


def calibrate(model: torch.nn.Module, samples: Iterable[torch.Tensor], config: CKVPConfig | None = None, *,
              group_size: int | None = None, kv_ratio: float = 4.0, rank_allocation: str = "energy",
              basis: str = "pca", max_cache_len: int | None = None, progress: bool = True,
              latent_format: str | tuple[str, str] | None = None, batch_size: int = 1, cache_len: int = 4096,
              dense_dtype: torch.dtype = torch.bfloat16, latent_dtype: torch.dtype = torch.bfloat16,
              recent_window: int = 0, rank_block: int | None = None,
              max_key_rank: int | None = None, key_space: str = "pre_rope") -> LatentBases:
    """Fit cross-layer latent bases and per-head ranks for ``model`` on ``samples``.

    Args:
        model: a Hugging Face causal LM (driven with a ``StaticCache``) or a gpt-fast style model
            (``setup_caches`` + ``input_pos``), in eval mode; other models are called as ``model(ids)`` and must
            write a static KV cache themselves.
        samples: an iterable of (B, S) integer token-id tensors, or of 1-D (S,) ones (batch 1). Each distinct
            shape compiles once (Dynamo's recompile limit, 8 by default, bounds the distinct shapes).
        config: a :class:`~ckvp_compile.CKVPConfig`; its ``group_size`` is used unless ``group_size`` is given.
        group_size: G, layers per group (one of 1, 2, 4, 8); default ``config.group_size`` or 4.
        kv_ratio: rho >= 1, the target dense / latent elements per token; the measured ratio is >= rho. With
            ``latent_format``, the target dense / held *bytes* instead (see below).
        rank_allocation: 'energy' (maximise the retained energy fraction, summed over group, head, K/V),
            'entropy' (the same with each head's fractions weighted by its measured attention entropy: broad
            heads get more rank; needs the post-RoPE queries and keys, found by the analysis) or
            'uniform' (one rank everywhere).
        basis: 'pca' (top eigenvectors of the second moment) or 'weighted' (orthonormal bases minimising the
            query-weighted key error and the W_o-weighted value error, :mod:`~.weighting`; on the fixture at 4x
            G=4 with 'uniform' ranks it lowers the perplexity rise, see benchmarks/results).
        max_cache_len: static cache length; default each sample's S.
        progress: show a tqdm bar over the samples.
        latent_format: when given (``"float"``, ``"int8"``, ``"int4"``, ..., or a (K, V) pair such as
            ``("int4", "int8")``: the format the cache will store),
            ranks are fitted so that a cache of ``batch_size`` sequences x ``cache_len`` slots holds
            ``kv_ratio`` times fewer bytes than a dense ``dense_dtype`` cache, counting the latent rows, slot
            positions and the bases in ``latent_dtype``
            (:func:`~ckvp_compile.latent.budget.bases_for_byte_ratio`). Pass the same format to the cache.
        batch_size, cache_len, dense_dtype, latent_dtype: that cache (with ``latent_format``).
        recent_window: with ``latent_format``, the dense recent window the cache will keep
            (``CKVPStaticCache(recent_window=...)``): its bytes come off the budget first (an error without
            ``latent_format``).
        rank_block: keep ranks in whole blocks of this many coordinates (:func:`~.ranks.allocate_ranks`); default
            (None): the quantization block of a uniform quantized ``latent_format`` (aligned, whole-block heads:
            faster decode attention at the same bytes), else 1 (any rank).
        max_key_rank: None (default), or the most coordinates any key unit (layer group, KV head) keeps, the
            bytes going to values and other units instead: the decode attention's work grows with the key rank
            padded to a power of two, so e.g. 64 instead of 96 trades fidelity for speed at the same bytes
            (:func:`~.ranks.key_rank_caps`).
        key_space: 'pre_rope' (default): fit the key bases to the keys before RoPE (decode re-applies RoPE per
            cached token); 'post_rope': to the keys as the model caches them, after RoPE, so that decode scores
            them without RoPE (faster: no RoPE-table product; lossier at the same rank,
            :attr:`LatentBases.key_space`). Layers without RoPE are the same either way.
    Returns:
        :class:`LatentBases` with float32 bases on the model's device; ``save()`` them for the backend.
    Raises:
        CKVPConfigError: a model that is not a ``torch.nn.Module``; samples that are not an iterable of token-id
            tensors (one 1-D tensor included: pass ``[ids]``); bad group_size / kv_ratio / rank_allocation /
            rank_block / max_key_rank / key_space / max_cache_len / samples (kv_ratio's message names the
            achievable range), an unknown ``latent_format``
            (or not a (K, V) pair of names), batch_size / cache_len < 1, a non-float dense_dtype / latent_dtype
            (all checked before the first sample runs), no
            attention layer with a usable KV-cache write (the reason is given), an encoder-decoder model
            (``config.is_encoder_decoder``), weights not loaded (on the meta device), or a gpt-fast model whose
            caches are already latent phantoms (``use_latent_cache``; calibrate before it).
    Notes:
        A gpt-fast model's cache setup (``setup_caches`` of each sample's batch and length) is put back after:
        the same cache modules and buffers, ``max_batch_size`` and other attributes; what the prefills wrote into
        caches of an unchanged shape stays (:func:`~.capture.kept_module_setup`).
        Warns (:class:`~ckvp_compile.CKVPWarning`) for a sample longer than ``config.max_position_embeddings``.
        Runs the model in eval mode (no dropout or router jitter; each module's mode is put back after) and under
        ``torch.no_grad()``; a ``torch.compile(model)`` wrapper is calibrated through the module it holds.
        Resets Dynamo (``torch._dynamo.reset()``) before and after, so other compiled functions recompile on
        their next call. A ``model.forward`` already replaced by ``torch.compile(model.forward, ...)`` is set aside
        while the samples run (its original forward is traced) and put back after. Memory: one sample's K and V
        of every layer in float64, plus 2 * Hkv * (G*D)^2 float64 per group.
    Source: xKV (Chang et al. 2025, arXiv:2503.18893), cross-layer SVD; DESIGN.md "CKVP in numbers".
    """
    if config is not None and not isinstance(config, CKVPConfig):
        raise CKVPConfigError(f"config must be a CKVPConfig or None, got {type(config).__name__}")
    if group_size is None:
        group_size = config.group_size if config is not None else 4
    if rank_allocation not in RANK_ALLOCATIONS:
        raise CKVPConfigError(f"rank_allocation must be one of {list(RANK_ALLOCATIONS)}, got {rank_allocation!r}")
    if isinstance(kv_ratio, bool) or not isinstance(kv_ratio, (int, float)) or not kv_ratio >= 1:
        raise CKVPConfigError(f"kv_ratio must be a number >= 1 (dense / latent elements per token), got {kv_ratio!r}")
    if basis not in BASES:
        raise CKVPConfigError(f"basis must be one of {list(BASES)}, got {basis!r}")
    if rank_block is not None and rank_block_error(rank_block):
        raise CKVPConfigError(rank_block_error(rank_block))
    if max_key_rank_error(max_key_rank):
        raise CKVPConfigError(max_key_rank_error(max_key_rank))
    if key_space_error(key_space):
        raise CKVPConfigError(key_space_error(key_space))
    if recent_window and latent_format is None:
        raise CKVPConfigError("recent_window is counted in bytes: give latent_format too (the format the cache "
                              "will store), so that the ranks leave room for the window")
    _check_collect_args(group_size, max_cache_len)
    # the byte budget's arguments are checked before any sample runs (a typo must not cost a calibration run, nor
    # use up a one-shot iterable of samples)
    from .budget import check_budget_args, format_pair

    check_budget_args(batch_size, cache_len, dense_dtype, latent_dtype, len_name="cache_len")
    if latent_format is not None:
        format_pair(latent_format)

    def check_groups(groups: tuple[tuple[int, ...], ...], hkv: int, d: int) -> None:
        check_target_ratio(kv_ratio, sum(map(len, groups)) * hkv * d * 2, 2 * len(groups) * hkv)

    moments = _collect(model, samples, group_size=group_size, max_cache_len=max_cache_len, progress=progress,
                       on_sample=None, on_groups=check_groups, key_space=key_space)
    if latent_format is not None:
        from .budget import bases_for_byte_ratio

        return bases_for_byte_ratio(moments, kv_ratio, latent_format, batch_size=batch_size, max_cache_len=cache_len,
                                    rank_allocation=rank_allocation, basis=basis, dense_dtype=dense_dtype,
                                    latent_dtype=latent_dtype, recent_window=recent_window, rank_block=rank_block,
                                    max_key_rank=max_key_rank)
    return moments.bases(kv_ratio, rank_allocation, basis, rank_block=1 if rank_block is None else rank_block,
                         max_key_rank=max_key_rank)


def collect_kv_moments(model: torch.nn.Module, samples: Iterable[torch.Tensor], *, group_size: int = 4,
                       max_cache_len: int | None = None, progress: bool = True,
                       on_sample: Callable[[StackedKV], None] | None = None,
                       attended_values: bool = False, key_space: str = "pre_rope") -> KVMoments:
    """Collect the stacked second moments :func:`calibrate` uses, without choosing ranks.

    Args:
        model, samples, group_size, max_cache_len, progress: as for :func:`calibrate`.
        on_sample: called after each sample with its stacked keys and values, per group ``(xk, xv)``, each
            (Hkv, B*S, G_g*D) float64 (e.g. to measure reconstruction error on exactly these vectors).
        attended_values: also collect :attr:`KVMoments.v_attended` (the attended values' second moments, for
            :func:`~ckvp_compile.latent.attention_noise.value_error_scales` ``mode="output"``): an extra
            (B, H, S, S) @ (B, H, S, G_g*D) product and a float64 (G_g*D)^2 moment per layer and sample, so off
            by default.
        key_space: as for :func:`calibrate` (the keys summed over).
    Returns:
        :class:`KVMoments`; ``.bases(kv_ratio, rank_allocation)`` builds :class:`LatentBases` from it.
    Raises:
        CKVPConfigError: as for :func:`calibrate`.
    """
    if key_space_error(key_space):
        raise CKVPConfigError(key_space_error(key_space))
    return _collect(model, samples, group_size=group_size, max_cache_len=max_cache_len, progress=progress,
                    on_sample=on_sample, on_groups=None, attended_values=attended_values, key_space=key_space)


# ----------------------------------------------------------------------------------------------------------
# recording


@dataclass(frozen=True)
class _Probe:
    """What to keep from one graph node: ('k' | 'v', layer, permutation to (B, Hkv, S, D) or None),
    ('ks', layer, permutation): a factor applied after RoPE, multiplied into the layer's recorded key, or
    ('w', layer, None) for the layer's key-projection weight."""

    kind: str
    layer: int
    perm: tuple[int, ...] | None = None


class _RecordingInterpreter(fx.Interpreter):
    """Runs a Dynamo graph node by node and hands the values of the probed nodes to ``sink``."""

    def __init__(self, gm: fx.GraphModule, probes: dict[str, list[_Probe]],
                 sink: Callable[[_Probe, Any], None]) -> None:
        super().__init__(gm)
        self.probes, self.sink = probes, sink

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for probe in self.probes.get(n.name, ()):
            self.sink(probe, out)
        return out


class _RecordingBackend:
    """Dynamo backend: analyses each graph it receives and runs it with a :class:`_RecordingInterpreter`."""

    def __init__(self, key_space: str = "pre_rope") -> None:
        self.key_space = key_space
        self.analyses: list[GraphAnalysis] = []
        self.values: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        analysis = analyze(gm)
        self.analyses.append(analysis)
        nodes = node_map(gm.graph)
        probes: dict[str, list[_Probe]] = {}
        for s in analysis.attention:
            if s.k_cache is None or s.v_cache is None:
                continue
            if s.rope is not None and s.rope.k_in is not None and self.key_space == "pre_rope":
                k_node, perm = s.rope.k_in, _layout_perm(nodes[s.k_cache.value_node], s.rope.k_out)
                if s.rope.k_scale is not None:  # scaled after RoPE: the key CKVP projects is k_in * k_scale
                    perm = s.rope.k_in_perm  # (the walk above stops at the multiply; the analysis read it)
                    probes.setdefault(s.rope.k_scale, []).append(_Probe("ks", s.layer, perm))
                if perm is None:
                    logger.debug("ckvp calibrate: layer %d: key layout not read off the graph; matching dims", s.layer)
            else:
                k_node, perm = s.k_cache.value_node, (0, 1, 2, 3)
            probes.setdefault(k_node, []).append(_Probe("k", s.layer, perm))
            probes.setdefault(s.v_cache.value_node, []).append(_Probe("v", s.layer, (0, 1, 2, 3)))
            weight = _projection_weight(nodes.get(s.k_proj)) if s.k_proj is not None else None
            if weight is not None:
                probes.setdefault(weight, []).append(_Probe("w", s.layer))
            o_weight = _projection_weight(nodes.get(s.o_proj)) if s.o_proj is not None else None
            if o_weight is not None:
                probes.setdefault(o_weight, []).append(_Probe("o", s.layer))
            if s.rope is not None and s.rope.q_out is not None:
                probes.setdefault(s.rope.q_out, []).append(_Probe("q", s.layer))
                probes.setdefault(s.rope.q_out, []).append(_Probe("qa", s.layer))
                if s.rope.k_out is not None:
                    probes.setdefault(s.rope.k_out, []).append(_Probe("ka", s.layer))
        return _RecordingInterpreter(gm, probes, self._record).run

    def _record(self, probe: _Probe, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if probe.kind in ("w", "o"):
                self.values[(probe.kind, probe.layer)] = value.detach()
            elif probe.kind == "q":
                self.values[("q", probe.layer)] = value.detach().to(torch.float64).square()
            elif probe.kind == "ks":  # runs after the layer's pre-RoPE key (the factor depends on its rotation)
                self.values[("k", probe.layer)] = self.values[("k", probe.layer)] * _to_bhsd(value, probe)
            elif probe.kind in ("qa", "ka"):
                if not value.is_complex():  # the complex RoPE form's product: entropy not measured there
                    self.values[(probe.kind, probe.layer)] = value.detach().float()
            else:
                self.values[(probe.kind, probe.layer)] = _to_bhsd(value, probe)

    def sites(self) -> list[AttentionSite]:
        """Cache-carrying attention sites over every graph seen, one per layer (first seen), sorted by layer."""
        by_layer: dict[int, AttentionSite] = {}
        for a in self.analyses:
            for s in a.attention:
                if s.k_cache is not None and s.v_cache is not None:
                    by_layer.setdefault(s.layer, s)
        return [by_layer[k] for k in sorted(by_layer)]


def _projection_weight(proj: fx.Node | None) -> str | None:
    """Name of the weight placeholder a projection node multiplies by (None when not found)."""
    w = weight_source(proj)
    return None if w is None else w.name


def _layout_perm(value: fx.Node, k_out: str | None) -> tuple[int, ...] | None:
    """The permutation p with ``value == k_out.permute(p)``, read off the transposes / permutes between them.

    Walks back from the tensor written to the cache through transpose, permute, dtype/layout ops and reshapes
    of the trailing dims only (the complex form's ``flatten(3)`` of RoPE's (B, S, Hkv, D/2, 2) output) until
    RoPE's output ``k_out``. Returns None when the path holds anything else.
    """
    perm = [0, 1, 2, 3]
    node: Any = value
    for _ in range(32):
        if not isinstance(node, fx.Node):
            return None
        if node.name == k_out:
            return tuple(perm)
        name, src = op_name(node), (node.args[0] if node.args else None)
        if not isinstance(src, fx.Node):
            return None
        if name in ("transpose", "swapaxes"):
            a, b = (int(x) % 4 for x in node.args[1:3])
            t = [0, 1, 2, 3]
            t[a], t[b] = t[b], t[a]
        elif name == "permute":
            dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
            t = [int(x) % 4 for x in dims]
        elif name in _DTYPE_OR_LAYOUT or (name in _RESHAPES and _same_leading_dims(node, src)):
            t = [0, 1, 2, 3]
        else:
            return None
        perm = [t[p] for p in perm]
        node = src
    return None


def _same_leading_dims(a: fx.Node, b: fx.Node) -> bool:
    """True when ``a`` and ``b`` have rank >= 4 and the same first three dims (a reshape of trailing dims)."""
    sa, sb = shape_of(a), shape_of(b)
    return sa is not None and sb is not None and min(len(sa), len(sb)) >= 4 and sa[:3] == sb[:3]


def _to_bhsd(t: torch.Tensor, probe: _Probe) -> torch.Tensor:
    """(B, Hkv, S, D) float64 copy of a recorded key or value (Hkv, D checked later)."""
    if t.dim() == 4 and probe.perm is not None:
        t = t.permute(probe.perm)
    return t.detach().to(torch.float64)


def _normalise(t: torch.Tensor, hkv: int, d: int, layer: int, kind: str) -> torch.Tensor:
    """Check (B, Hkv, S, D); a (B, S, Hkv, D) tensor (layout not read off the graph) is transposed."""
    if t.dim() == 4 and t.shape[1] == hkv and t.shape[3] == d:
        return t
    if t.dim() == 4 and t.shape[2] == hkv and t.shape[3] == d:
        return t.transpose(1, 2)
    raise CKVPError(f"layer {layer}: the recorded {kind} has shape {tuple(t.shape)}, expected (B, {hkv}, S, {d}) "
                    f"or (B, S, {hkv}, {d}); this graph form is not supported by calibrate (e.g. values whose head "
                    f"dim differs from the keys'). Fix: use a dense cache for this model (HF's StaticCache or "
                    f"DynamicCache; backend='ckvp' still compiles it, without the latent rewrite)")


# ----------------------------------------------------------------------------------------------------------
# the sample loop


def _as_batch(sample: Any, device: torch.device) -> torch.Tensor:
    if isinstance(sample, torch.Tensor) and sample.dim() == 0:  # iterating one (S,) tensor yields its ids
        raise CKVPConfigError("each calibration sample must be a (B, S) or (S,) tensor of token ids, got a single "
                              "token id (a 0-d tensor): samples is one 1-D tensor, iterated id by id. Fix: pass a "
                              "list of samples, e.g. calibrate(model, [ids])")
    if not isinstance(sample, torch.Tensor) or sample.dtype.is_floating_point or sample.dtype.is_complex \
            or sample.dtype == torch.bool or sample.dim() not in (1, 2) or sample.numel() == 0:
        desc = f"{type(sample).__name__}" if not isinstance(sample, torch.Tensor) else \
            f"tensor {tuple(sample.shape)} {sample.dtype}"
        raise CKVPConfigError(f"each calibration sample must be a non-empty (B, S) or (S,) integer tensor of token "
                              f"ids, got {desc}")
    ids = sample if sample.dim() == 2 else sample[None]
    return ids.to(device=device, dtype=torch.long)


def _describe_samples(samples: Any) -> str:
    """A short description of a ``samples`` argument for an error message."""
    if isinstance(samples, torch.Tensor):
        return f"one tensor {tuple(samples.shape)} {samples.dtype}"
    return type(samples).__name__


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _no_site_error(model: torch.nn.Module, backend: _RecordingBackend) -> CKVPConfigError:
    reasons = [u.message() for a in backend.analyses for u in a.unsupported if u.kind != "unknown_experts_form"]
    attn = [s for a in backend.analyses for s in a.attention]
    if reasons:
        why = " ".join(dict.fromkeys(reasons))
    elif attn:
        layers = sorted({s.layer for s in attn})
        half = sorted({s.layer for s in attn if (s.k_cache is None) != (s.v_cache is None)})
        if half:  # the cache is written and read, but one of K / V reaches the attention through ops not followed
            which = sorted({"values" if s.v_cache is None else "keys" for s in attn if s.layer in half})
            why = (f"the attention of layers {half} reads the KV cache the model writes, but its "
                   f"{' and '.join(which)} reach the attention through ops the analysis does not follow from the "
                   "cache (e.g. a chunk, repeat or concatenation of the cached values, as DiffLlama's differential "
                   "attention does), so the latent cache could not rebuild what it reads. Fix: use a dense cache "
                   "(cache_implementation='static') for this model.")
        elif is_hf_causal_lm(model):
            impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
            fix = ("load the model with attn_implementation='sdpa' (or 'eager'), which writes the cache it is passed"
                   if impl not in ("sdpa", "eager") else
                   "check that each attention layer calls past_key_values.update(...) and attends over what it "
                   "returns (a patched or custom attention module that keeps its own cache cannot be rewritten)")
            why = (f"attention was found in layers {layers} but no KV-cache write: calibrate ran the prefill with a "
                   f"Hugging Face StaticCache (attention implementation {impl!r}), and no layer wrote its keys and "
                   f"values into it. Fix: {fix}.")
        elif is_gpt_fast(model):
            why = (f"attention was found in layers {layers} but no KV-cache write: calibrate ran the prefill with "
                   "the caches of setup_caches(), and no layer wrote its keys and values into them. Fix: each "
                   "attention must write its cache in place (kv_cache.update(input_pos, k, v)) and attend over the "
                   "tensors that update returns.")
        else:
            why = (f"attention was found in layers {layers} but no KV-cache write: calibrate drives a Hugging Face "
                   "causal LM (with a StaticCache) or a gpt-fast style model (setup_caches, then model(ids, "
                   f"input_pos)); {type(model).__name__} is neither, so it ran as model(input_ids), without a KV "
                   "cache. Fix: pass a Hugging Face causal LM or a gpt-fast style model (for a wrapper: the model "
                   "it wraps).")
    elif not backend.analyses:
        why = "Dynamo captured no graph (the model ran eagerly). Fix: make the forward traceable by torch.compile."
    else:
        why = "no attention (scaled_dot_product_attention or softmax(QK^T)V) was found in the captured graph(s)."
    return CKVPConfigError(f"calibrate: {type(model).__name__} has no attention layer with a usable KV cache, so "
                           f"there is nothing to calibrate: {why}")


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block every submodule of ``model`` is in eval mode (no dropout, no router jitter: a training-mode
    model would sample them into the bases); each module's own mode is put back after. Raises nothing."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _warn_past_max_positions(model: torch.nn.Module, length: int, warned: set[int]) -> None:
    """Warn (:class:`CKVPWarning`, once per length) when a sample is longer than the model's
    ``config.max_position_embeddings``: the model runs, but its keys there are out of the distribution it was
    trained on, and the bases would be fitted to them."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and length > limit and length not in warned:
        warned.add(length)
        warnings.warn(f"calibrate: a sample of {length} tokens is longer than the model's max_position_embeddings "
                      f"({limit}); its keys past that position are outside what the model was trained on and the "
                      f"bases will be fitted to them. Fix: use samples of at most {limit} tokens.", CKVPWarning,
                      stacklevel=4)


def _check_token_ids(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Raise :class:`CKVPConfigError` for a sample with token ids outside the model's embedding table."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise CKVPConfigError(f"a calibration sample holds token ids in [{int(ids.min())}, {int(ids.max())}], but the "
                              f"model embeds ids 0..{vocab - 1}. Fix: tokenize the samples with this model's "
                              "tokenizer")


def _check_collect_args(group_size: Any, max_cache_len: Any) -> None:
    """``group_size`` one of :data:`GROUP_SIZES` (an int: 4.0 is refused, as :class:`CKVPConfig` does) and
    ``max_cache_len`` None or an int >= 1; else :class:`CKVPConfigError` naming the fix."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise CKVPConfigError(f"group_size must be one of {list(GROUP_SIZES)} (an int), got {group_size!r}")
    if max_cache_len is not None and (isinstance(max_cache_len, bool) or not hasattr(max_cache_len, "__index__")
                                      or operator.index(max_cache_len) < 1):
        raise CKVPConfigError(f"max_cache_len must be an int >= 1 (the static cache's slots), or None (each sample's "
                              f"length), got {max_cache_len!r}")


def _collect(model: torch.nn.Module, samples: Iterable[torch.Tensor], *, group_size: int, max_cache_len: int | None,
             progress: bool, on_sample: Callable[[StackedKV], None] | None,
             on_groups: Callable[[tuple[tuple[int, ...], ...], int, int], None] | None,
             attended_values: bool = False, key_space: str = "pre_rope") -> KVMoments:
    from tqdm.auto import tqdm

    if not isinstance(model, torch.nn.Module):
        raise CKVPConfigError(f"calibrate: model must be a torch.nn.Module (a Hugging Face causal LM or a gpt-fast "
                              f"style model), got {type(model).__name__}")
    # iterable as Python's for loop sees it: __iter__, or the sequence protocol's __getitem__ (a map-style
    # torch.utils.data.Dataset has no __iter__)
    iterable = isinstance(samples, collections.abc.Iterable) or hasattr(type(samples), "__getitem__")
    if isinstance(samples, (str, bytes)) or (isinstance(samples, torch.Tensor) and samples.dim() < 2) \
            or not iterable:
        raise CKVPConfigError(f"calibrate: samples must be an iterable of (B, S) or (S,) integer tensors of token ids "
                              f"(e.g. a list), got {_describe_samples(samples)}. Fix: pass a list, e.g. "
                              "calibrate(model, [ids])")
    _check_collect_args(group_size, max_cache_len)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):  # else an IndexError in the cache write
        raise CKVPConfigError(
            f"calibrate: {type(model).__name__} is an encoder-decoder model (cross-attention over the encoder's "
            "output); the ckvp latent KV cache is for decoder-only causal LMs. Fix: use a dense cache for this "
            "model (its compiled graphs are left untouched)."
        )
    model = plain_module(model)  # calibration traces the model's own forward with a recording backend of its own
    latent = next((n for n, m in model.named_modules() if hasattr(m, "ckvp_store")), None) if is_gpt_fast(model) else None
    if latent is not None:
        raise CKVPConfigError(f"calibrate: the model's KV caches are ckvp latent-store phantoms ({latent or 'the model'} "
                              "was given them by use_latent_cache); they hold no dense keys and values, so the "
                              "calibration prefill would attend over nothing. Fix: calibrate before use_latent_cache, "
                              "or on a fresh instance of the model with dense caches (setup_caches)")
    meta = next((n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if meta is not None:
        raise CKVPConfigError(f"calibrate: the model's weights are not loaded ({meta} is on the meta device); "
                              "calibration runs the model on its samples. Fix: load the weights first (e.g. "
                              "from_pretrained(...) onto a real device, or model.to_empty(device=...) then "
                              "load_state_dict(...))")
    device = _device_of(model)
    backend = _RecordingBackend(key_space)
    state: dict[str, Any] = {}
    warned: set[int] = set()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend, dynamic=False)
        total = len(samples) if hasattr(samples, "__len__") else None  # type: ignore[arg-type]
        kept = kept_module_setup(model) if is_gpt_fast(model) else contextlib.nullcontext()  # its setup_caches
        with kept, torch.no_grad(), uncompiled_forward(model), _eval_mode(model):
            for sample in tqdm(samples, total=total, desc="ckvp calibrate", unit="sample", disable=not progress):
                ids = _as_batch(sample, device)
                _check_token_ids(model, ids)
                _warn_past_max_positions(model, ids.shape[1], warned)
                cache_len = ids.shape[1] if max_cache_len is None else max_cache_len
                if cache_len < ids.shape[1]:
                    raise CKVPConfigError(f"max_cache_len={max_cache_len} is shorter than a sample of S={ids.shape[1]}"
                                          " tokens; raise it or leave it None (each sample's length)")
                backend.values.clear()
                prefill(model, compiled, ids, cache_len)
                if not state:
                    state.update(_layout(model, backend, group_size, on_groups))
                stacked = _stack(backend, state, tuple(ids.shape))
                for g, (xk, xv) in enumerate(stacked):
                    state["k"][g] += xk.mT @ xk
                    state["v"][g] += xv.mT @ xv
                _accumulate_queries(backend, state)
                _accumulate_entropy(backend, state, stacked if attended_values else None)
                state["tokens"] += ids.numel()
                if on_sample is not None:
                    on_sample(stacked)
    finally:
        torch._dynamo.reset()
    if not state:
        raise CKVPConfigError("calibrate needs at least one sample (a (B, S) tensor of token ids), got none")
    q_energy = {layer: q / state["tokens"] for layer, q in state["q"].items()}
    entropy = {layer: s / n for layer, (s, n) in state["entropy"].items()}
    sumsq = {layer: s / n for layer, (s, n) in state["sumsq"].items()}
    attended = []
    if all(len(a) == len(layers) for a, layers in zip(state["attended"], state["groups"])):
        attended = [torch.stack([a[layer][0] / a[layer][1] for layer in layers])
                    for a, layers in zip(state["attended"], state["groups"])]
    return KVMoments(groups=state["groups"], num_kv_heads=state["hkv"], head_dim=state["d"], group_size=group_size,
                     k=state["k"], v=state["v"], num_tokens=state["tokens"], model_fingerprint=state["fingerprint"],
                     q_energy=q_energy, w_o=state["w_o"], rope_form=state["rope_form"], attn_entropy=entropy,
                     attn_sumsq=sumsq, v_attended=attended, key_space=key_space)


def _graphs_sharing_layer_numbers(analyses: list[GraphAnalysis]) -> int:
    """How many graphs hold cache-writing attention when a layer number repeats among them, else 0.

    Called on the graphs of calibrate's first prefill (one forward). Each graph's sites are numbered on their own;
    a graph whose module paths carry no layer index is numbered by position (``UNNUMBERED_NOTE``), so when a
    graph break splits the layers into one graph each (HF ``experts_implementation="eager"``, DBRX's and
    JetMoE's expert loops), every layer is "layer 0" and the per-layer key / value records overwrite each other.

    Args:
        analyses: the :class:`GraphAnalysis` of every graph the first prefill compiled, in order.
    Returns:
        The number of graphs with cache-writing attention sites when some layer number appears in two or more of
        them (a forward traced as several graphs); 0 otherwise.
    Raises:
        Nothing.
    """
    graphs_of: dict[int, set[int]] = {}
    holding = 0
    for i, a in enumerate(analyses):
        layers = {s.layer for s in a.attention if s.k_cache is not None and s.v_cache is not None}
        holding += bool(layers)
        for layer in layers:
            graphs_of.setdefault(layer, set()).add(i)
    return holding if any(len(g) > 1 for g in graphs_of.values()) else 0


def _split_graphs_error(model: torch.nn.Module, graphs: int) -> CKVPConfigError:
    """The error for a model whose attention layers torch.compile traced into ``graphs`` separate graphs."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    can_set = getattr(model, "_can_set_experts_implementation", None)  # False: experts with a loop of their own
    if impl == "eager" and callable(can_set) and can_set():
        fix = ("load the model with experts_implementation='grouped_mm' (or call "
               "model.set_experts_implementation('grouped_mm')), whose experts trace into one graph")
    else:
        fix = ("remove the graph break (TORCH_LOGS=graph_breaks shows where it is; a data-dependent loop over the "
               "experts is the usual one), or use a dense cache for this model")
    return CKVPConfigError(
        f"calibrate: {type(model).__name__}'s forward was traced as several graphs, with attention layers in "
        f"{graphs} of them (a graph break inside or between the layers), so its layers cannot be told apart and "
        "the ckvp latent cache, which needs every layer of a group in one graph, cannot be used. Fix: " + fix + ".")


def _layout(model: torch.nn.Module, backend: _RecordingBackend, group_size: int,
            on_groups: Callable[[tuple[tuple[int, ...], ...], int, int], None] | None) -> dict[str, Any]:
    """After the first sample: the layer groups, Hkv, D, the fingerprint, and zeroed moment accumulators."""
    split = _graphs_sharing_layer_numbers(backend.analyses)
    if split:
        raise _split_graphs_error(model, split)
    sites = [s for s in backend.sites() if ("k", s.layer) in backend.values and ("v", s.layer) in backend.values]
    groups = make_layer_groups(tuple(sites), group_size)
    if not groups:
        raise _no_site_error(model, backend)
    shapes = {(g.num_kv_heads, g.head_dim) for g in groups}
    if len(shapes) > 1:
        raise CKVPConfigError(f"NYI: calibrate needs one KV shape (Hkv, D) in every layer, got {sorted(shapes)} "
                              f"over groups {[g.layers for g in groups]}")
    hkv, d = shapes.pop()
    layer_groups = tuple(g.layers for g in groups)
    if on_groups is not None:
        on_groups(layer_groups, hkv, d)
    weight = backend.values.get(("w", layer_groups[0][0]))
    name = next((n for n, p in model.named_parameters() if weight is not None and
                 (p is weight or (p.data_ptr() == weight.data_ptr() and p.shape == weight.shape))), None)
    dev = backend.values[("k", layer_groups[0][0])].device
    by_layer = {s.layer: s for s in sites}
    w_o = {layer: backend.values[("o", layer)].detach().to("cpu", torch.float64) for layer in by_layer
           if ("o", layer) in backend.values and backend.values[("o", layer)].dim() == 2
           and backend.values[("o", layer)].shape[1] == by_layer[layer].num_heads * d}
    # (post-RoPE keys: no rotation left to average the query weighting over; the weighted basis uses PCA there)
    rope_form = {layer: (s.rope.form if s.rope is not None and not s.rope.partial and backend.key_space == "pre_rope"
                         else "none") for layer, s in by_layer.items()}
    heads = {layer: s.num_heads for layer, s in by_layer.items()}
    return {"groups": layer_groups, "hkv": hkv, "d": d, "tokens": 0, "w_o": w_o, "rope_form": rope_form,
            "heads": heads, "q": {}, "entropy": {}, "sumsq": {}, "attended": [{} for _ in layer_groups],
            "fingerprint": model_fingerprint(model, name),
            "k": [torch.zeros(hkv, len(g) * d, len(g) * d, dtype=torch.float64, device=dev) for g in layer_groups],
            "v": [torch.zeros(hkv, len(g) * d, len(g) * d, dtype=torch.float64, device=dev) for g in layer_groups]}


def _stack(backend: _RecordingBackend, state: dict[str, Any], shape: tuple[int, int]) -> StackedKV:
    """This sample's (xk, xv) per group, each (Hkv, B*S, G_g*D) float64, layer j in columns j*D:(j+1)*D."""
    hkv, d = state["hkv"], state["d"]
    out: StackedKV = []
    for layers in state["groups"]:
        pair = []
        for kind in ("k", "v"):
            missing = [layer for layer in layers if (kind, layer) not in backend.values]
            if missing:
                raise CKVPError(
                    f"calibrate: no {kind.upper()} was recorded for layers {missing} on a sample of shape {shape}: it "
                    "ran without a captured graph (Dynamo's recompile limit of distinct shapes was reached, or the "
                    "graph changed). Fix: give samples of one shape, e.g. windows of one length.")
            parts = [_normalise(backend.values[(kind, layer)], hkv, d, layer, kind) for layer in layers]
            x = torch.cat(parts, dim=-1)  # (B, Hkv, S, G_g*D)
            pair.append(x.permute(1, 0, 2, 3).reshape(hkv, -1, x.shape[-1]))
        out.append((pair[0], pair[1]))
    return out


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor | None:
    """(B, heads, S, D) from a (B, heads, S, D) or (B, S, heads, D) tensor; None for any other shape."""
    if x.dim() != 4:
        return None
    if x.shape[1] == heads:
        return x
    return x.transpose(1, 2) if x.shape[2] == heads else None


def _accumulate_entropy(backend: _RecordingBackend, state: dict[str, Any], stacked: StackedKV | None = None) -> None:
    """Add this sample's causal attention statistics per KV head and layer, from the post-RoPE queries and keys
    (the sample is one causal prefill from position 0, how :func:`calibrate` drives the model):

    * the entropy, normalised by log of the context (positions t >= 1), averaged over each KV head's query heads;
    * ``sum_{s<t} p_ts^2`` (the squared attention mass on earlier tokens, the ones a decode step reads from the
      cache: a query's own key and value are exact), averaged the same way (``state["sumsq"]``);
    * with ``stacked`` (this sample's per-group stacked keys and values, :func:`_stack`): ``sum y y^T`` of the
      attended stacked values ``y_t = sum_{s<t} p_ts x_s`` per layer (``state["attended"]``), over queries
      t >= 1 and the KV head's query heads; a layer whose attention is not measured leaves its group without.
    """
    d, hkv = state["d"], state["hkv"]
    group_of = {layer: g for g, layers in enumerate(state["groups"]) for layer in layers}
    for layer, h in state["heads"].items():
        q, k = backend.values.get(("qa", layer)), backend.values.get(("ka", layer))
        if q is None or k is None or h % hkv:
            continue
        q, k = _heads_first(q, h), _heads_first(k, hkv)
        if q is None or k is None or q.shape[-1] != d or k.shape[-1] != d or q.shape[2] != k.shape[2] or q.shape[2] < 2:
            continue
        b, _, s, _ = q.shape
        k = k.repeat_interleave(h // hkv, dim=1)
        scores = (q @ k.mT) * d ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        logp = torch.log_softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        p = logp.exp()
        ent = -(p * logp.masked_fill(~causal, 0.0)).sum(-1)[..., 1:]  # (B, H, S-1)
        norm = torch.log(torch.arange(2, s + 1, device=q.device, dtype=ent.dtype))
        per_kv = (ent / norm).mean(dim=(0, 2)).view(hkv, h // hkv).mean(1).double().cpu()
        total, n = state["entropy"].get(layer, (0, 0))
        state["entropy"][layer] = (total + per_kv, n + 1)
        cached = p.masked_fill(~causal.tril(-1), 0.0)  # (B, H, S, S): weights on earlier tokens only
        sq = cached.square().sum(-1)[..., 1:].double().mean(dim=(0, 2)).view(hkv, h // hkv).mean(1).cpu()
        total, n = state["sumsq"].get(layer, (0, 0))
        state["sumsq"][layer] = (total + sq, n + 1)
        g = group_of.get(layer)
        if stacked is None or g is None:
            continue
        xv = stacked[g][1]  # (Hkv, B*S, G_g*D) float64
        if xv.shape[1] != b * s:
            continue
        xv = xv.view(hkv, b, s, -1).transpose(0, 1).repeat_interleave(h // hkv, dim=1)  # (B, H, S, G_g*D)
        # (B, H, S-1, G_g*D): queries t >= 1, in the scores' dtype (no float64 copy of the (B, H, S, S) weights)
        y = (cached[..., 1:, :] @ xv.to(cached.dtype)).double()
        y = y.view(b, hkv, h // hkv, s - 1, -1).transpose(0, 1).reshape(hkv, b * (h // hkv) * (s - 1), -1)
        total, n = state["attended"][g].get(layer, (0, 0))
        state["attended"][g][layer] = (total + (y.mT @ y).cpu(), n + y.shape[1])


def _accumulate_queries(backend: _RecordingBackend, state: dict[str, Any]) -> None:
    """Add this sample's squared post-RoPE query channels, summed over tokens, per layer as (H, D) float64.

    The head axis is the one of size H among dims 1 and 2 of the (B, H, S, D) or (B, S, H, D) query (dim 1 when
    both are H); a query of another shape is skipped (its layer then falls back to plain PCA keys)."""
    d = state["d"]
    for layer, h in state["heads"].items():
        q = backend.values.get(("q", layer))
        if q is None or q.dim() != 4 or q.shape[-1] != d or h not in (q.shape[1], q.shape[2]):
            continue
        per_head = q.sum(dim=(0, 2)) if q.shape[1] == h else q.sum(dim=(0, 1))
        state["q"][layer] = state["q"].get(layer, 0) + per_head.cpu()
