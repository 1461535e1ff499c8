"""The latent KV store: the device tensors that replace a model's dense KV cache under CKVP.

One store serves one cache (one batch of sequences) of one model. It holds, per layer group g of the
:class:`~ckvp_compile.latent.LatentBases`:

==================  ====================================  =================================================
tensor              shape                                 meaning
==================  ====================================  =================================================
``latent_k[g]``     (B, S_max, sum_h rK[g][h])            packed key latents, head h in columns
                                                          ``k_offsets[g][h]:k_offsets[g][h+1]``; uint8
                                                          (B, S_max, row_bytes) in a quantized
                                                          ``k_format`` (``kernels/latent_format.py``)
``latent_v[g]``     (B, S_max, sum_h rV[g][h])            packed value latents (``v_format``); both are page
                                                          pools (N_pages + 1, P, row width) when paged
``basis_k[g]``      (Hkv, G*D, max_h rK[g][h])            orthonormal bases (zero columns beyond a rank);
                                                          (B, Hkv, G*D, ...) per sequence for online bases
``basis_v[g]``      (Hkv, G*D, max_h rV[g][h])
==================  ====================================  =================================================

and, shared by all groups, ``slot_pos`` (B, S_max) int32 (the RoPE position of each cache slot of each
sequence) and the RoPE tables ``rope_cos`` / ``rope_sin`` (P_max, W), the model's own cos / sin at each
position, filled as positions are first written (a function of the position only: model state, like vLLM's
``cos_sin_cache``).

The model keeps seeing its usual dense cache tensors, but they are *phantoms*: (B, Hkv, S_max, D) views with
all strides 0 over one NaN element, so they take no memory. The ckvp backend finds the store of a graph
through the phantoms it receives as inputs (:func:`lookup_phantom`), removes the graph's writes into them, and
reads the store instead. Anything else that touches a phantom fails loudly: an in-place write raises
"unsupported operation: more than one element of the written-to tensor refers to a single memory location",
and a read yields NaN, never plausible numbers; the cache classes in :mod:`ckvp_compile.runtime.hf_cache`
raise a :class:`CKVPError` before either can happen in eager code.

With ``recent_window=W > 0`` the store also keeps, per layer l, the exact (dense) keys and values of the W most
recent tokens in a ring: ``window_k[l]`` / ``window_v[l]`` (B, Hkv, W, D) in ``latent_dtype`` (post-RoPE keys)
and ``window_slots[l]`` (W,) int64, the cache slot each ring entry holds (entry ``slot % W``; -1 = empty). Attention
reads those tokens exactly and only older ones from the latent: the recent tokens, which carry most of the
attention mass of a decode step, lose nothing to compression (the "dense recent window" of KIVI, arXiv:2402.02750,
and of xKV's serving setup), for ``2 * L * Hkv * W * D`` extra elements per sequence, independent of the context.

With ``page_size=P > 0`` the latents are *paged* (vLLM's PagedAttention layout, Kwon et al., SOSP 2023):
``latent_k[g]`` / ``latent_v[g]`` are page pools (N_pages + 1, P, W), the last page a trash page that takes writes
to unmapped slots and is never read as data, and ``page_table`` (B, S_max / P) int32 maps logical page j of
sequence b (its slots ``j*P .. j*P+P-1``) to a physical page, -1 when unmapped. Pages are mapped on demand by a
host-side allocator (:meth:`LatentKVStore.ensure_mapped`, :meth:`LatentKVStore.release`; the backend maps the
pages of each call's slots before running it), so a pool smaller than B x S_max / P pages serves sequences of
different lengths, and a finished sequence's pages go back to the pool. Slot positions, bases, RoPE tables and
the recent window are not paged.

Memory accounting (:meth:`LatentKVStore.nbytes`) separates per-sequence state (latents, slot positions),
which is what the KV compression ratio counts, from model constants (bases, RoPE tables), which do not grow
with batch or context and are reported beside it. On CUDA the store's tensors come from a private memory pool
(``torch.cuda.MemPool``), so the device bytes they take are their own bytes, not the caching allocator's rounding
into holes of the model's pool (:func:`_private_pool`).
"""

from __future__ import annotations

import contextlib
import heapq
import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CKVPConfigError, CKVPError, CKVPShapeError
from ..kernels.device_cache import prepare_device_tables
from ..kernels.latent_attention_triton import declare_paired_tables
from ..kernels.latent_format import parse_latent_format
from ..kernels.latent_layout import empty_latent, held_units_per_row, key_value_layouts

_PHANTOMS: dict[int, tuple[weakref.ref, int, str]] = {}
_COMPILED_SIZES: set[tuple[int, int]] = set()  # (max_batch_size, max_cache_len) of stores a latent rewrite bound


def note_compiled_size(store: Any) -> None:
    """Record that a latent rewrite compiled a graph for a store of this ``(batch_size, max_cache_len)``; read by
    :func:`uncompiled_size_reason` to explain an eager call of a cache of another size. Raises nothing."""
    _COMPILED_SIZES.add((int(store.batch_size), int(store.max_cache_len)))


def uncompiled_size_reason(store: Any) -> str:
    """A sentence for the eager-call error of ``store``'s cache when no graph was compiled for its size while
    graphs of other sizes were: the usual cause is Dynamo's recompile limit (each cache size compiles its own
    prefill and decode graphs). Empty when the size was compiled, or when fewer sizes were compiled than the limit
    allows (two graphs a size), so a genuine graph break keeps the generic message. Raises nothing."""
    size = (int(store.batch_size), int(store.max_cache_len))
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    if size in _COMPILED_SIZES or not isinstance(limit, int) or 2 * len(_COMPILED_SIZES) < limit:
        return ""
    seen = ", ".join(f"({b}, {s})" for b, s in sorted(_COMPILED_SIZES)[:6]) + (", ..." if len(_COMPILED_SIZES) > 6 else "")
    return (f"No graph was compiled for this cache's size (max_batch_size={size[0]}, max_cache_len={size[1]}), "
            f"while {len(_COMPILED_SIZES)} other sizes (batch, slots) were: {seen}. Each cache size compiles its own "
            f"prefill and decode graphs, and past torch._dynamo.config.recompile_limit ({limit}) Dynamo runs the "
            "model eagerly. Fix: build one cache for the largest batch and longest request and reuse it "
            "(cache.reset() between requests; a static cache serves any shorter request), or raise "
            "torch._dynamo.config.recompile_limit, or call torch._dynamo.reset(). ")


@dataclass(frozen=True)
class StoreBytes:
    """Bytes held by a :class:`LatentKVStore`.

    Attributes:
        latent: key and value latents (per sequence; their storage, row padding included). slot_positions:
        ``slot_pos`` (per sequence).
        bases: the bases on the device (model constant). rope_tables: cos / sin tables (model constant).
        dense_equivalent: what the model's dense K and V caches of the same B and S_max would take.
        dense_elements: their element count (for :meth:`ratio_vs` another dense dtype).
        online_bases: the bases are per sequence (fitted at each prefill), so they are per-sequence state.
        residual: ALR-KVD residual rows (per sequence; 0 without a residual).
        window: the dense recent window's keys, values and ring slots (per sequence; 0 without a window).
        page_table: the page table of a paged store (per sequence; 0 when not paged). ``latent`` is then the
            page pools' real bytes, every page of the pool (mapped or not) and the trash page.
    """

    latent: int
    slot_positions: int
    bases: int
    rope_tables: int
    dense_equivalent: int
    dense_elements: int = 0
    online_bases: bool = False
    residual: int = 0
    window: int = 0
    page_table: int = 0

    @property
    def per_sequence_state(self) -> int:
        """Bytes that scale with the batch (and context): latents (a paged store's pools), ALR-KVD residuals, the
        dense recent window, slot positions and the page table, plus the bases when they are online (per
        sequence)."""
        return (self.latent + self.residual + self.window + self.slot_positions + self.page_table
                + (self.bases if self.online_bases else 0))

    @property
    def ratio(self) -> float:
        """Dense KV bytes over per-sequence latent-state bytes (the KV compression ratio)."""
        return self.dense_equivalent / max(1, self.per_sequence_state)

    def ratio_vs(self, dense_dtype: torch.dtype, with_bases: bool = True, with_rope_tables: bool = False) -> float:
        """The KV compression ratio against a dense cache of the same B and S_max stored in ``dense_dtype``
        (e.g. the checkpoint's bf16 when the model computes in fp32).

        The denominator is the per-sequence state plus, by default, the bases (every byte of the store that
        replaces K/V; the bases are shared by the B sequences, so they weigh less at larger B and S_max) and,
        optionally, the RoPE tables (a cache of the model's own cos / sin per position)."""
        size = torch.empty((), dtype=dense_dtype).element_size()
        held = self.per_sequence_state + (self.bases if with_bases and not self.online_bases else 0)
        held += self.rope_tables if with_rope_tables else 0
        return self.dense_elements * size / max(1, held)


#: Why a latent store, and a cache holding one, refuses ``copy.deepcopy``, and the fix.
COPY_REFUSED = ("a ckvp latent KV cache cannot be copied (copy.deepcopy): the compiled graphs find its latent store by "
                "the addresses of its tensors, which a copy does not have. Fix: to reuse a prompt, build a new cache "
                "with the same arguments and prefill the prompt into it")


class LatentKVStore:
    """Device tensors of the cross-layer latent KV cache of one cache (B sequences, S_max slots).

    Args:
        bases: the :class:`~ckvp_compile.latent.LatentBases` (groups, ranks, bases).
        batch_size: B. max_cache_len: S_max.
        device, dtype: where the store lives and the model's KV dtype (RoPE tables, phantoms).
        k_format, v_format: storage format of the key / value latents: ``"auto"`` (default: the bases'
            recorded formats, ``LatentBases.k_formats``, else ``"float"``), ``"float"``, a quantized one
            (``"int8"``, ``"int4"``, ``"int2"`` with an optional ``/block``, ``"tern"``) or a ``mix/...`` bit plan
            (see :mod:`ckvp_compile.kernels.latent_format`); one for every group or a sequence with one per group.
        latent_dtype: float dtype of ``"float"`` latents and of the bases on the device (default ``dtype``;
            e.g. bf16 for an fp32 model, so that what is stored is what a bf16 deployment stores).
        basis_dtype: float dtype of the bases on the device when it differs from ``latent_dtype`` (default
            None: ``latent_dtype``). ``torch.float8_e4m3fn`` halves the bases' bytes (a 3-bit mantissa: on the
            fixture about 0.2% of each unit's energy); the ops compute with ``basis.float()``, and the fused CUDA
            attention kernel reads fp8 bases directly (exact in bf16; checked on the H200,
            ``kernels.latent_attention_triton.FP8_BASES_GPU_CHECKED``).
        residual_format: '' (none) or a quantized format (e.g. ``"int2/64"``) for the ALR-KVD residual of keys
            and values (:mod:`ckvp_compile.kernels.residual`): ``resid_k[g]`` / ``resid_v[g]`` (B, S_max, W) uint8.
            The rewrite then attends through reconstruct + SDPA (the fused attention kernel has no residual).
        recent_window: W, the number of most recent tokens per sequence whose keys and values are kept exact
            (dense, in ``latent_dtype``: what a bf16 deployment keeps) beside the latent (default 0: none); see the
            module docstring. Costs ``2 * layers * Hkv * W * D`` elements per sequence.
        page_size: P, slots per page of a paged store (default 0: not paged, one contiguous (B, S_max, W) latent
            per group). With P > 0 the latents are page pools (num_pages + 1, P, W) and ``page_table``
            (B, S_max / P) int32 maps each sequence's logical pages to them (see the module docstring); pages are
            mapped on demand (:meth:`ensure_mapped`, which the backend calls before each compiled call) and freed
            by :meth:`release` / :meth:`reset`.
        num_pages: physical pages in each pool, the trash page not counted, in [1, B * S_max / P] (default, and
            only with page_size > 0: B * S_max / P, every slot of every sequence mappable). Fewer pages hold less
            memory; running out raises when the pages are mapped.
        latent_layout: how ``latent_k[g]`` / ``latent_v[g]`` lie in memory (:mod:`ckvp_compile.kernels.latent_layout`):
            ``"row-major"`` (default: each slot's row contiguous) or ``"unit-major"`` (each byte column contiguous
            over a sequence's slots, or a page's), or ``"KEYS/VALUES"`` for each its own (e.g.
            ``"row-major/unit-major"``): the same logical tensors and results. Unit-major latents cost the fused
            kernels more on the H200 (1.14-1.94x per call, benchmarks/results/2026-12-01-largebatch-h200): an option,
            not the default.
    Raises:
        CKVPConfigError: batch_size or max_cache_len < 1, an unknown format, a non-float latent_dtype or
            basis_dtype, recent_window outside [0, max_cache_len); page_size < 0 or not dividing max_cache_len,
            num_pages outside [1, B * S_max / P] or given without page_size, or paging with a residual_format or
            online bases (not supported yet); a latent_layout not in ``kernels.latent_layout.STORE_LAYOUTS``.
    """

    def __init__(self, bases: Any, batch_size: int, max_cache_len: int, device: torch.device | str,
                 dtype: torch.dtype, k_format: str = "auto", v_format: str = "auto",
                 latent_dtype: torch.dtype | None = None, basis_dtype: torch.dtype | None = None,
                 residual_format: str = "", recent_window: int = 0, page_size: int = 0,
                 num_pages: int | None = None, latent_layout: str = "row-major"):
        try:
            sizes = (operator.index(batch_size), operator.index(max_cache_len))
        except TypeError:
            sizes = (0, 0)
        if min(sizes) < 1 or isinstance(batch_size, bool):
            raise CKVPConfigError(f"batch_size and max_cache_len must be >= 1 and ints, got {batch_size!r}, "
                                  f"{max_cache_len!r}")
        batch_size, max_cache_len = sizes
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise CKVPConfigError(f"device={str(device)!r}, but this torch build sees no CUDA device "
                                  f"(torch {torch.__version__}). Fix: device='cpu', or run where a CUDA GPU is "
                                  "visible")
        if isinstance(recent_window, bool) or not isinstance(recent_window, int) \
                or not 0 <= recent_window < max_cache_len:
            raise CKVPConfigError(f"recent_window must be an int in [0, max_cache_len = {max_cache_len}), got "
                                  f"{recent_window!r}; it counts the most recent tokens kept dense (0: none)")
        try:
            k_layout, v_layout = key_value_layouts(latent_layout)
        except ValueError as e:
            raise CKVPConfigError(str(e)) from None
        num_pages = _check_paging(page_size, num_pages, batch_size, max_cache_len, residual_format,
                                  bool(getattr(bases, "online", False)))
        ngroups = len(bases.groups)
        try:
            kfs = _group_formats(k_format, getattr(bases, "k_formats", ()), ngroups)
            vfs = _group_formats(v_format, getattr(bases, "v_formats", ()), ngroups)
        except ValueError as e:
            raise CKVPConfigError(str(e)) from None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CKVPConfigError(f"dtype must be a floating torch.dtype, the model's K/V dtype (e.g. torch.float32 "
                                  f"or torch.bfloat16), got {dtype!r}")
        latent_dtype = latent_dtype or dtype
        if not isinstance(latent_dtype, torch.dtype) or not latent_dtype.is_floating_point:
            raise CKVPConfigError(f"latent_dtype must be a floating torch.dtype (the dtype of 'float' latents and, by "
                                  f"default, of the bases), got {latent_dtype!r}; for integer latents choose the "
                                  "latent format instead (CKVPStaticCache(latent_format='int8'), or the store's "
                                  "k_format / v_format)")
        basis_dtype = basis_dtype or latent_dtype
        if not isinstance(basis_dtype, torch.dtype) or not basis_dtype.is_floating_point:
            raise CKVPConfigError(f"basis_dtype must be a floating torch.dtype (e.g. torch.bfloat16 or "
                                  f"torch.float8_e4m3fn), got {basis_dtype!r}")
        self.bases = bases
        self.batch_size, self.max_cache_len = batch_size, max_cache_len
        self.device, self.dtype = torch.device(device), dtype
        self.k_formats, self.v_formats = [f.name for f in kfs], [f.name for f in vfs]
        self.latent_dtype, self.basis_dtype = latent_dtype, basis_dtype
        self.num_kv_heads, self.head_dim = bases.num_kv_heads, bases.head_dim
        self.groups: tuple[tuple[int, ...], ...] = tuple(tuple(g) for g in bases.groups)
        self.k_offsets = [_offsets(r) for r in bases.k_ranks]
        self.v_offsets = [_offsets(r) for r in bases.v_ranks]
        b, s = batch_size, max_cache_len
        #: P (0: not paged) and the pools' physical pages (None when not paged; the trash page not counted)
        self.page_size, self.num_pages = page_size, num_pages
        rows = (b, s) if not page_size else (num_pages + 1, page_size)  # a paged pool's last page: the trash page
        #: the strides of the latents (kernels.latent_layout.STORE_LAYOUTS: both, or "KEYS/VALUES")
        self.latent_layout = latent_layout
        # the store's state comes from a private memory pool (see _private_pool); the kernels' index tables below,
        # cached beyond this store, do not
        with _private_pool(self.device) as pool:
            try:
                self.latent_k = [empty_latent(rows, f.row_width(o), k_layout, f.storage_dtype(latent_dtype),
                                              self.device) for f, o in zip(kfs, self.k_offsets)]
                self.latent_v = [empty_latent(rows, f.row_width(o), v_layout, f.storage_dtype(latent_dtype),
                                              self.device) for f, o in zip(vfs, self.v_offsets)]
            except ValueError as e:  # a bit plan for other ranks
                raise CKVPConfigError(f"{e}; plan the formats for these bases (ckvp_compile.latent.planner)") from None
            self.residual_format, self.resid_k, self.resid_v = "", [], []
            if residual_format:
                from ..kernels.residual import residual_offsets

                try:
                    rf = parse_latent_format(residual_format)
                except ValueError as e:
                    raise CKVPConfigError(f"residual_format: {e}") from None
                if not rf.quantized:
                    raise CKVPConfigError(f"residual_format must be a quantized format such as 'int2/64', got "
                                          f"{residual_format!r}")
                self.residual_format = rf.name
                widths = [rf.row_width(residual_offsets(len(g), self.num_kv_heads, self.head_dim)) for g in self.groups]
                self.resid_k = [torch.zeros(b, s, w, device=self.device, dtype=torch.uint8) for w in widths]
                self.resid_v = [torch.zeros(b, s, w, device=self.device, dtype=torch.uint8) for w in widths]
            self.online = bool(getattr(bases, "online", False))
            if self.online:  # per-sequence bases, fitted at each sequence's prefill (ckvp::online_basis_fit)
                self.basis_k = [torch.zeros(b, *p.shape, device=self.device, dtype=basis_dtype) for p in bases.k_basis]
                self.basis_v = [torch.zeros(b, *p.shape, device=self.device, dtype=basis_dtype) for p in bases.v_basis]
            else:
                self.basis_k = [p.to(self.device, basis_dtype).contiguous() for p in bases.k_basis]
                self.basis_v = [p.to(self.device, basis_dtype).contiguous() for p in bases.v_basis]
            #: host-side: whether the online bases were fitted by a prefill since the last reset (no device sync)
            self.online_fitted = False
            #: host-side: whether a later multi-token call was warned about (backend.ONLINE_BASES_NOT_REFITTED)
            self.online_refit_warned = False
            self.slot_pos = torch.zeros(b, s, device=self.device, dtype=torch.int32)
            self.recent_window = recent_window
            #: per layer: the dense recent window's ring (see the module docstring); empty dicts without a window
            self.window_k: dict[int, torch.Tensor] = {}
            self.window_v: dict[int, torch.Tensor] = {}
            self.window_slots: dict[int, torch.Tensor] = {}
            if recent_window:
                for layer in (layer for g in self.groups for layer in g):
                    shape = (b, self.num_kv_heads, recent_window, self.head_dim)
                    self.window_k[layer] = torch.zeros(shape, device=self.device, dtype=latent_dtype)
                    self.window_v[layer] = torch.zeros(shape, device=self.device, dtype=latent_dtype)
                    self.window_slots[layer] = torch.full((recent_window,), -1, device=self.device, dtype=torch.int64)
            self.rope_cos: torch.Tensor | None = None
            self.rope_sin: torch.Tensor | None = None
            #: whether every graph writing the RoPE tables builds them with one angle per rotated pair (None: no writer
            #: yet); see :meth:`note_rope_writer`
            self.rope_paired: bool | None = None
            self._phantoms: dict[tuple[int, str], torch.Tensor] = {}
            #: a paged store's (B, S_max / P) int32 page table on the device (-1: unmapped); None when not paged
            self.page_table: torch.Tensor | None = None
            if page_size:
                self.page_table = torch.full((b, s // page_size), -1, device=self.device, dtype=torch.int32)
        #: the private CUDA memory pool the tensors above were allocated from (None off CUDA); see _private_pool
        self.mem_pool = pool
        if page_size:
            # the allocator, host-side only (no device sync): the table's host copy, the free physical pages (a
            # min-heap: the lowest free page first, deterministic) and each sequence's count of mapped pages
            self._host_table = torch.full((b, s // page_size), -1, dtype=torch.int32)
            self._free = list(range(num_pages))
            self._mapped = [0] * b
        for offs, fmts, bases_ in ((self.k_offsets, self.k_formats, self.basis_k),
                                   (self.v_offsets, self.v_formats, self.basis_v)):
            for o, f, p in zip(offs, fmts, bases_):  # the kernels' index tables, outside any CUDA-graph pool
                prepare_device_tables(o, f, p.shape[-1], self.device)
        if self.residual_format:  # the residual rows' quantizer tables too (ckvp::residual_append, reconstruct)
            for g in self.groups:
                prepare_device_tables(residual_offsets(len(g), self.num_kv_heads, self.head_dim),
                                      self.residual_format, self.head_dim, self.device)

    # ------------------------------------------------------------------ layout
    @property
    def k_format(self) -> str:
        """The key latents' format when every group has the same one, else the groups' formats joined by ';'."""
        return self.k_formats[0] if len(set(self.k_formats)) == 1 else ";".join(self.k_formats)

    @property
    def v_format(self) -> str:
        """As :attr:`k_format`, for the value latents."""
        return self.v_formats[0] if len(set(self.v_formats)) == 1 else ";".join(self.v_formats)

    def layout(self) -> tuple:
        """What a graph compiled for this store bakes in: B, S_max, groups, offsets, formats, dtypes, the paging
        (page size and pool pages: the pools' shapes), the latents' layout (their strides) and the bases' key space
        (a pre-RoPE graph re-applies RoPE to the rebuilt keys, a post-RoPE one does not)."""
        return (self.batch_size, self.max_cache_len, self.groups, tuple(map(tuple, self.k_offsets)),
                tuple(map(tuple, self.v_offsets)), tuple(self.k_formats), tuple(self.v_formats), self.latent_dtype,
                self.dtype,
                str(self.device), self.online, self.basis_dtype, self.residual_format, self.recent_window,
                self.page_size, self.num_pages, getattr(getattr(self, "bases", None), "key_space", "pre_rope"),
                self.latent_layout)

    def group_of(self, layer: int) -> tuple[int, int]:
        """Return (group index, position of ``layer`` within its group). Raises KeyError when not covered."""
        for g, layers in enumerate(self.groups):
            if layer in layers:
                return g, layers.index(layer)
        raise KeyError(layer)

    def phantom(self, layer: int, kind: str) -> torch.Tensor:
        """Return the zero-memory (B, Hkv, S_max, D) stand-in for layer ``layer``'s dense K or V cache.

        The same tensor object is returned on every call, and it is registered so the backend can map it
        back to this store (:func:`lookup_phantom`).
        """
        key = (layer, kind)
        if key not in self._phantoms:
            self.group_of(layer)
            cell = torch.full((1,), float("nan"), device=self.device, dtype=self.dtype)
            t = cell.expand(self.batch_size, self.num_kv_heads, self.max_cache_len, self.head_dim)
            self._phantoms[key] = t
            _PHANTOMS[t.data_ptr()] = (weakref.ref(self), layer, kind)
        return self._phantoms[key]

    def ensure_rope_tables(self, width: int, num_positions: int | None = None) -> None:
        """Allocate the (P_max, W) cos / sin tables once W is known (the rewrite knows it from the graph)."""
        p = num_positions or self.max_cache_len
        if self.rope_cos is None or self.rope_cos.shape != (p, width):
            if self.rope_cos is not None:
                declare_paired_tables(self.rope_cos, self.rope_sin, False)
            self.rope_cos = torch.zeros(p, width, device=self.device, dtype=self.dtype)
            self.rope_sin = torch.zeros(p, width, device=self.device, dtype=self.dtype)
            if self.rope_paired:
                declare_paired_tables(self.rope_cos, self.rope_sin)

    def note_rope_writer(self, paired: bool) -> None:
        """Record one more compiled graph that writes the RoPE tables, and whether the graph proves its tables paired
        (one angle per rotated pair, :attr:`~ckvp_compile.analysis.sites.RopeSite.tables_paired`). While every writer
        is proven, the tables are declared paired to the decode attention kernel, which then reads half of each
        (:func:`~ckvp_compile.kernels.latent_attention_triton.declare_paired_tables`).

        Raises:
            CKVPConfigError: an unproven writer arrives after the tables were declared paired (kernels launched or
                captured in CUDA graphs before may assume pairing); the declaration is withdrawn first.
        """
        was = self.rope_paired
        self.rope_paired = paired if was is None else (was and paired)
        if self.rope_cos is not None:
            declare_paired_tables(self.rope_cos, self.rope_sin, bool(self.rope_paired))
        if was and not paired:
            raise CKVPConfigError(
                "a compiled graph writes RoPE tables that the backend cannot prove hold one angle per rotated pair "
                "into a KV store whose tables earlier graphs read as paired; call torch._dynamo.reset() and build a "
                "new cache (the tables are now treated as unpaired)")

    def __deepcopy__(self, memo: dict) -> "LatentKVStore":
        """Refused: raises CKVPConfigError naming the fix (a new cache, prefilled again); the compiled graphs find a
        store by its tensors' addresses, which a copy would not have."""
        raise CKVPConfigError(COPY_REFUSED)

    def reset(self) -> None:
        """Forget every sequence (a new ``generate()`` call): zero latents and slot positions (and online bases),
        empty the recent window, unmap every page of a paged store, in place."""
        for t in (*self.latent_k, *self.latent_v, *self.resid_k, *self.resid_v, self.slot_pos,
                  *self.window_k.values(), *self.window_v.values()):
            t.zero_()
        for t in self.window_slots.values():
            t.fill_(-1)
        if self.online:
            for t in (*self.basis_k, *self.basis_v):
                t.zero_()
            self.online_fitted = False
        if self.page_table is not None:
            self._unmap_all()
            self.page_table.fill_(-1)

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder the B sequences in place (beam search): sequence i takes sequence ``index[i]``'s latents, slot
        positions, recent window (and online bases).

        A paged store reads ``index`` on the host (one device sync), copies the mapped pages of the sources
        (a transient copy of at most the mapped pages) and maps each sequence's pages afresh.

        Raises:
            CKVPShapeError: (paged) ``index`` is not B sequence indices in [0, B).
            CKVPConfigError: (paged) the reordered sequences need more pages than the pool has (beams duplicating
                long sequences); nothing is changed.
        """
        idx = index.to(self.device, torch.long)
        per_sequence = [*self.resid_k, *self.resid_v, self.slot_pos, *self.window_k.values(), *self.window_v.values()]
        if self.page_table is None:
            per_sequence += [*self.latent_k, *self.latent_v]
        else:
            self._reorder_pages(index)
        if self.online:
            per_sequence += [*self.basis_k, *self.basis_v]
        for t in per_sequence:
            t.copy_(t.index_select(0, idx))

    # ------------------------------------------------------------------ paging (host-side allocator)
    @property
    def mapped_pages(self) -> int:
        """Physical pages mapped to some sequence (0 when not paged)."""
        return sum(self._mapped) if self.page_table is not None else 0

    @property
    def free_pages(self) -> int:
        """Physical pages free to map (``num_pages - mapped_pages``; 0 when not paged)."""
        return len(self._free) if self.page_table is not None else 0

    @property
    def host_page_table(self) -> torch.Tensor | None:
        """A copy of the allocator's host view of ``page_table``: (B, S_max / P) int32 on the CPU, -1 unmapped
        (None when not paged). Equal to the device table after every allocator call."""
        return None if self.page_table is None else self._host_table.clone()

    def ensure_mapped(self, length: int, sequences: Any = None) -> int:
        """Map pages so that slots [0, ``length``) of ``sequences`` are mapped (a no-op when not paged).

        Each sequence's logical pages are mapped in order, to the lowest free physical pages; then the changed
        rows of ``page_table`` go to the device in one host-to-device copy (from pageable host memory: CUDA waits
        for the stream's earlier work first, a sync the backend's slot read has already paid). The backend calls
        this before each compiled call with the call's highest slot + 1.

        Args:
            length: slots per sequence to map, 0 <= length <= S_max.
            sequences: sequence indices in [0, B) (default: all B).
        Returns:
            The number of pages newly mapped.
        Raises:
            CKVPShapeError: ``length`` > S_max (a context longer than the cache) or a sequence outside [0, B).
            CKVPConfigError: the pool has too few free pages; the message names the num_pages that would do.
                The table is left as it was.
            CKVPError: called while a CUDA graph is being captured (the copy cannot be captured).
        """
        if self.page_table is None:
            return 0
        if not 0 <= length <= self.max_cache_len:
            raise CKVPShapeError(f"cannot map slots [0, {length}) of a cache of {self.max_cache_len} slots: the "
                                 f"context is longer than the cache. Build it with CKVPStaticCache(max_cache_len=...) "
                                 f"at least as long as prompt + new tokens, or call cache.reset() before a new "
                                 f"sequence")
        seqs = self._sequences(sequences)
        need = -(-length // self.page_size)
        missing = {b: need - self._mapped[b] for b in seqs if self._mapped[b] < need}
        total = sum(missing.values())
        if total > len(self._free):
            raise CKVPConfigError(
                f"out of latent pages: {self.mapped_pages} of {self.num_pages} mapped, and slots [0, {length}) of "
                f"{len(missing)} sequence(s) need {total} more; pass num_pages >= {self.mapped_pages + total} for "
                f"this call (a whole run needs batch x ceil(longest prompt + new tokens / page_size) pages; every "
                f"slot of every sequence: {self.batch_size * (self.max_cache_len // self.page_size)}), or a smaller "
                f"batch / max_cache_len, or release() finished sequences. A cache with another num_pages is another "
                f"layout for a compiled model: call torch._dynamo.reset() (or compile again) before using it")
        if not missing:
            return 0
        for b, n in missing.items():
            for j in range(self._mapped[b], self._mapped[b] + n):
                self._host_table[b, j] = heapq.heappop(self._free)
            self._mapped[b] += n
        self._upload(min(missing), max(missing) + 1)
        return total

    def release(self, sequence: int) -> int:
        """Unmap every page of ``sequence`` back to the free list (a finished sequence frees its memory; a no-op
        when not paged). Its latent rows are not cleared: a page is written before it is read again. Its slots
        must be mapped again (:meth:`ensure_mapped`; the backend does it) before it is attended.

        Args:
            sequence: index in [0, B).
        Returns:
            The number of pages freed.
        Raises:
            CKVPShapeError: ``sequence`` outside [0, B).
            CKVPError: called while a CUDA graph is being captured.
        """
        if self.page_table is None:
            return 0
        (b,) = self._sequences([sequence])
        n = self._mapped[b]
        if n:
            for page in self._host_table[b, :n].tolist():
                heapq.heappush(self._free, page)
            self._host_table[b] = -1
            self._mapped[b] = 0
            self._upload(b, b + 1)
        return n

    def _sequences(self, sequences: Any) -> list[int]:
        if sequences is None:
            return list(range(self.batch_size))
        out = [int(b) for b in sequences]
        bad = [b for b in out if not 0 <= b < self.batch_size]
        if bad:
            raise CKVPShapeError(f"sequence(s) {bad} outside [0, B = {self.batch_size}) of this latent store")
        return list(dict.fromkeys(out))

    def _unmap_all(self) -> None:
        """Host side only: every page free, every table entry -1."""
        self._host_table.fill_(-1)
        self._free = list(range(self.num_pages))
        self._mapped = [0] * self.batch_size

    def _upload(self, lo: int, hi: int) -> None:
        """Copy rows [lo, hi) of the host table to the device table: one copy from pageable host memory (CUDA
        synchronises the stream before staging it; in stream order, so no kernel reads a half-written table)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CKVPError("ckvp: latent pages cannot be mapped while a CUDA graph is being captured (a host-to-"
                            "device copy); map them before the call (LatentKVStore.ensure_mapped), as the backend does")
        self.page_table[lo:hi].copy_(self._host_table[lo:hi], non_blocking=True)

    def _reorder_pages(self, index: torch.Tensor) -> None:
        """The paged part of :meth:`reorder`: sequence i gets fresh pages holding sequence ``index[i]``'s."""
        src = [int(i) for i in index.reshape(-1).tolist()]  # beam search: one host read per reorder
        if len(src) != self.batch_size or any(not 0 <= i < self.batch_size for i in src):
            raise CKVPShapeError(f"reorder takes B = {self.batch_size} sequence indices in [0, B), got {src}")
        counts = [self._mapped[i] for i in src]
        if sum(counts) > self.num_pages:
            raise CKVPConfigError(f"out of latent pages: the reordered sequences need {sum(counts)} pages, the pool "
                                  f"has {self.num_pages}; pass num_pages >= {sum(counts)}")
        old = [p for i, c in zip(src, counts) for p in self._host_table[i, :c].tolist()]
        saved = []
        if old:
            pages = torch.tensor(old, device=self.device)
            saved = [pool.index_select(0, pages) for pool in (*self.latent_k, *self.latent_v)]
        self._unmap_all()
        new = []
        for b, c in enumerate(counts):
            for j in range(c):
                self._host_table[b, j] = page = heapq.heappop(self._free)
                new.append(page)
            self._mapped[b] = c
        if old:
            pages = torch.tensor(new, device=self.device)
            for pool, rows in zip((*self.latent_k, *self.latent_v), saved):
                pool.index_copy_(0, pages, rows)
        self._upload(0, self.batch_size)

    # ------------------------------------------------------------------ accounting
    def latent_row_bytes(self, g: int) -> tuple[int, int]:
        """(key, value) bytes one slot of group ``g`` holds in the latents' storage: the formats' row bytes, plus
        the row-major rows' alignment padding (:func:`~ckvp_compile.kernels.latent_layout.empty_latent`)."""
        return tuple(held_units_per_row(t) * t.element_size() for t in (self.latent_k[g], self.latent_v[g]))

    def nbytes(self) -> StoreBytes:
        """Bytes held, split into per-sequence state and model constants; see :class:`StoreBytes`."""

        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        def held(ts):  # latents: their storage, the rows' alignment padding included (empty_latent)
            return sum(t.untyped_storage().nbytes() for t in ts if t is not None)

        layers = sum(len(g) for g in self.groups)
        dense = 2 * layers * self.batch_size * self.num_kv_heads * self.max_cache_len * self.head_dim
        return StoreBytes(
            latent=held(self.latent_k) + held(self.latent_v),
            slot_positions=size([self.slot_pos]),
            bases=size(self.basis_k) + size(self.basis_v),
            rope_tables=size([self.rope_cos, self.rope_sin]),
            dense_equivalent=dense * torch.empty((), dtype=self.dtype).element_size(),
            dense_elements=dense, online_bases=self.online, residual=size(self.resid_k) + size(self.resid_v),
            window=size(self.window_k.values()) + size(self.window_v.values()) + size(self.window_slots.values()),
            page_table=size([self.page_table]),
        )


@contextlib.contextmanager
def _private_pool(device: torch.device):
    """Route this thread's CUDA allocations to a new private memory pool (``torch.cuda.MemPool``) for the duration;
    yields the pool (None off CUDA, where nothing changes).

    Why: PyTorch's caching allocator places a tensor in the best-fitting free block of its pool and splits a large
    block only when more than 1 MiB would remain (``kSmallSize``, ``should_split`` in
    c10/cuda/CUDACachingAllocator.cpp); a tensor that lands in a free block up to 1 MiB larger holds all of it, and
    ``torch.cuda.memory_allocated`` counts it. The general pool is full of such holes once a model is loaded, so a
    store built there, one tensor per layer group and kind, held 1-16 MiB beyond its tensors' bytes (2.3 MiB on a
    15.8 MiB Mixtral store: 7.1x for 8x; benchmarks/results/2026-12-02-decode-matrix-h200). In a pool of its own the
    store's tensors fill fresh segments one after the other. The pool's memory returns to the device once the store's
    tensors are freed and the pool object is gone (then ``torch.cuda.empty_cache()``), as for CUDA-graph pools.

    One allocation carved into views (vLLM-style) was tried first and dropped: graph inputs with storage offsets
    broke Inductor's functional clone of a store write (``as_strided`` with the absolute offset applied to the
    view's own pointer: an illegal address on the H200, 2026-12-02), and views of one storage in different dtypes
    look overlapping to AOTAutograd's alias check.
    """
    if device.type != "cuda" or not hasattr(torch.cuda, "MemPool"):
        yield None
        return
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device if device.index is not None else torch.cuda.current_device()):
        yield pool


def _check_paging(page_size: Any, num_pages: Any, batch_size: int, max_cache_len: int, residual_format: str,
                  online: bool) -> int | None:
    """Validate a store's paging arguments; return its pool's physical pages (None when not paged)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 0:
        raise CKVPConfigError(f"page_size must be an int >= 0 (slots per latent page; 0: not paged), got {page_size!r}")
    if not page_size:
        if num_pages is not None:
            raise CKVPConfigError(f"num_pages={num_pages!r} needs a paged store: pass page_size > 0 (e.g. 16) too")
        return None
    if max_cache_len % page_size:
        multiple = -(-max_cache_len // page_size) * page_size
        raise CKVPConfigError(f"page_size={page_size} does not divide max_cache_len={max_cache_len}; pass a "
                              f"max_cache_len that is a multiple of it (e.g. {multiple}) or a page_size dividing "
                              f"{max_cache_len}")
    if residual_format:
        raise CKVPConfigError(f"a paged store (page_size={page_size}) with an ALR-KVD residual (residual_format="
                              f"{residual_format!r}) is not supported yet; pass page_size=0 or residual_format=''")
    if online:
        raise CKVPConfigError(f"a paged store (page_size={page_size}) with online bases is not supported yet; pass "
                              f"page_size=0 or calibrated bases (ckvp_compile.calibrate)")
    if num_pages is None:
        return batch_size * (max_cache_len // page_size)
    most = batch_size * (max_cache_len // page_size)
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or not 1 <= num_pages <= most:
        raise CKVPConfigError(f"num_pages must be an int in [1, {most}] (physical latent pages of {page_size} slots; "
                              f"B * max_cache_len / page_size = {most} maps every slot of every sequence, the "
                              f"default, and more could never be mapped), got {num_pages!r}")
    return num_pages


def _group_formats(fmt: Any, planned: Any, ngroups: int) -> list:
    """One parsed format per group from a name, a per-group sequence, or 'auto' (the bases' plan, else float)."""
    if isinstance(fmt, str) and fmt == "auto":
        fmt = list(planned) if planned else "float"
    if isinstance(fmt, str):
        return [parse_latent_format(fmt)] * ngroups
    fmts = list(fmt)
    if len(fmts) != ngroups:
        raise ValueError(f"{len(fmts)} latent formats given for {ngroups} layer groups; give one per group")
    return [parse_latent_format(f) for f in fmts]


def _offsets(ranks) -> list[int]:
    out = [0]
    for r in ranks:
        out.append(out[-1] + int(r))
    return out


def lookup_phantom(t: Any) -> tuple[LatentKVStore, int, str] | None:
    """Return ``(store, layer, 'k' | 'v')`` when ``t`` is a phantom cache tensor of a live store, else None."""
    if not isinstance(t, torch.Tensor) or any(s != 0 for s in t.stride()) or t.numel() == 0:
        return None
    hit = _PHANTOMS.get(t.data_ptr())
    if hit is None:
        return None
    store = hit[0]()
    if store is None:
        del _PHANTOMS[t.data_ptr()]
        return None
    return store, hit[1], hit[2]
