"""Models and KV caches for the end-to-end decode benchmark (:mod:`ckvp_compile.bench.decode`).

Shapes (``SHAPES``), each a Hugging Face config built in code, never downloaded:

==================  =========================================================================================
``mixtral-8x7b``    MixtralForCausalLM: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, 8 experts top-2,
                    FFN 14336, vocab 32000 (46.7 B parameters, 93 GB in bf16); dense KV 128 KiB per token
``qwen-moe-a2.7b``  Qwen2MoeForCausalLM: 24 layers, hidden 2048, 16 heads / 16 KV heads of 128, 60 experts top-4,
                    expert FFN 1408, shared expert 5632, vocab 151936 (14.3 B parameters, 28.6 GB in bf16);
                    dense KV 192 KiB (196,608 bytes) per token
``tiny``            a 4-layer Mixtral of hidden 64 (CPU smoke runs of the harness)
==================  =========================================================================================

:func:`build_random_model` creates the model on the ``meta`` device, allocates its storage directly on the target
device (``to_empty``) and fills it there with random values (normal(0, ``initializer_range``) matrices, unit norm
weights, zero biases), so a 93 GB model never passes through host memory. Non-persistent buffers (RoPE
``inv_freq``) are recomputed by building the owning module again from the config.

:func:`dense_cache` / :func:`latent_cache` allocate a transformers ``StaticCache`` or a
:class:`~ckvp_compile.runtime.hf_cache.CKVPStaticCache` and :func:`fill_cache_` fills the first ``context`` slots
of every sequence with random K/V (dense) or random latents quantized in the store's own format (latent), and
sets the cache's length counter: decode steps then attend over ``context`` cached tokens without a prefill over
them. The values are random, so only time and memory mean anything in such runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import CKVPConfigError

__all__ = ["SHAPES", "build_random_model", "dense_cache", "dense_kv_bytes_per_token", "fill_cache_", "fill_rope_tables_",
           "kv_bytes_held", "latent_cache", "synthetic_moments", "DecomposedMoments",
           "make_config", "random_bases", "weight_bytes"]

_ROPE_1E6 = {"rope_type": "default", "rope_theta": 1e6}

#: shape name -> (transformers model_type, config fields). Field names valid in transformers 5.17 and 5.24.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-8x7b": ("mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, rms_norm_eps=1e-5, rope_parameters=_ROPE_1E6)),
    "qwen-moe-a2.7b": ("qwen2_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                                         num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                         moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                         num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                                         decoder_sparse_step=1, rms_norm_eps=1e-6, rope_parameters=_ROPE_1E6)),
    "tiny": ("mixtral", dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                             num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
}


def make_config(shape: str, layers: int | None = None, max_positions: int = 0) -> Any:
    """Return the transformers config of ``shape`` (see :data:`SHAPES`).

    Args:
        shape: a key of :data:`SHAPES`.
        layers: keep only the first ``layers`` decoder layers (None: all).
        max_positions: raise ``max_position_embeddings`` to at least this many positions.
    Raises:
        CKVPConfigError: unknown shape, or ``layers`` outside 1..the shape's layer count.
    """
    if shape not in SHAPES:
        raise CKVPConfigError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    from transformers import AutoConfig

    model_type, fields = SHAPES[shape]
    full = fields["num_hidden_layers"]
    if layers is not None and not 1 <= layers <= full:
        raise CKVPConfigError(f"--layers must be in 1..{full} for {shape}, got {layers}")
    cfg = AutoConfig.for_model(model_type, **{**fields, "num_hidden_layers": layers or full})
    cfg.max_position_embeddings = max(int(getattr(cfg, "max_position_embeddings", 0) or 0), int(max_positions))
    return cfg


def build_random_model(config: Any, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0) -> torch.nn.Module:
    """Build ``AutoModelForCausalLM.from_config(config)`` with random weights created on ``device``.

    Args:
        config: a transformers config (:func:`make_config`).
        device: where the weights live; nothing of their size is allocated elsewhere.
        dtype: parameter dtype (buffers keep the dtype the model gives them).
        seed: seed of the on-device generator.
    Returns:
        The model in eval mode, ``attn_implementation="sdpa"``.
    Raises:
        CKVPConfigError: a module holds a buffer that cannot be recomputed from the config.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=gen)
            elif name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:  # RMSNorm scales
                p.fill_(1.0)
            else:
                p.zero_()
        _restore_buffers(model, config, device)
    return model.eval()


def _restore_buffers(model: torch.nn.Module, config: Any, device: torch.device | str) -> None:
    """Recompute every module's own buffers (uninitialised after ``to_empty``) by building it again on the CPU."""
    for name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        try:
            with torch.device("cpu"):
                fresh = type(module)(config=config)
        except Exception as e:  # noqa: BLE001  any failure means we cannot trust the buffers
            raise CKVPConfigError(f"cannot recompute the buffers {sorted(own)} of {name} ({type(module).__name__}) "
                                  f"after to_empty: {type(e).__name__}: {e}") from None
        fresh_bufs = dict(fresh.named_buffers(recurse=False))
        for bname, buf in own.items():
            if bname not in fresh_bufs:
                raise CKVPConfigError(f"{name}.{bname}: not recreated by {type(module).__name__}(config=...)")
            buf.copy_(fresh_bufs[bname].to(buf.dtype))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, Hkv, D) of a config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads or config.num_attention_heads, head_dim


def dense_kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Dense K and V bytes of one token of one sequence: 2 x layers x Hkv x D x itemsize."""
    layers, hkv, d = _kv_shape(config)
    return 2 * layers * hkv * d * torch.empty((), dtype=dtype).element_size()


def dense_cache(config: Any, batch: int, max_cache_len: int, device: torch.device | str, dtype: torch.dtype) -> Any:
    """A transformers ``StaticCache`` of ``batch`` x ``max_cache_len`` slots, allocated now (zeros) on ``device``."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    _, hkv, d = _kv_shape(config)
    probe = torch.empty(batch, hkv, 0, d, device=device, dtype=dtype)
    for layer in cache.layers:  # allocate now (transformers allocates lazily at the first update)
        layer.lazy_initialization(probe, probe)
    return cache


def latent_cache(config: Any, bases: Any, batch: int, max_cache_len: int, device: torch.device | str,
                 dtype: torch.dtype, latent_format: str, recent_window: int = 0,
                 latent_layout: str = "row-major", page_size: int = 0) -> Any:
    """A :class:`~ckvp_compile.runtime.hf_cache.CKVPStaticCache` (latents in ``latent_layout``, in pools of
    ``page_size``-slot pages when > 0, bases and the dense recent window of ``recent_window`` tokens in ``dtype``).
    Raises what the cache raises for a bad page size (CKVPConfigError)."""
    from ..runtime.hf_cache import CKVPStaticCache

    return CKVPStaticCache(config, bases, max_cache_len=max_cache_len, max_batch_size=batch, device=device,
                           dtype=dtype, latent_format=latent_format, latent_dtype=dtype, recent_window=recent_window,
                           latent_layout=latent_layout, page_size=page_size)


def fill_cache_(cache: Any, context: int, seed: int = 0) -> None:
    """Make ``cache`` hold ``context`` random tokens per sequence, as if a prefill of that length had run.

    Dense: K and V slots ``[0, context)`` ~ N(0, 1). Latent: the store's latent rows of those slots are random
    N(0, 1) latents, quantized in the store's format (one random block of up to 1024 rows, repeated),
    ``slot_pos`` holds each slot's position, and a dense recent window's ring holds random keys and values of the
    last slots (a paged store first maps the pages of slots ``[0, context)`` of every sequence). Then every layer's
    length counter (transformers >= 5.2x ``cumulative_length``) is set to ``context``; older versions take the
    position from ``cache_position``.

    Raises:
        CKVPConfigError: ``context`` exceeds the cache length.
    """
    from ..kernels.latent_format import parse_latent_format, quantize_latent_ref

    store = getattr(cache, "store", None)
    slots = store.max_cache_len if store is not None else cache.layers[0].keys.shape[2]
    if not 0 <= context <= slots:
        raise CKVPConfigError(f"context {context} does not fit a cache of {slots} slots")
    with torch.no_grad():
        if store is None:
            gen = torch.Generator(device=cache.layers[0].keys.device).manual_seed(seed)
            for layer in cache.layers:
                layer.keys[:, :, :context].normal_(generator=gen)
                layer.values[:, :, :context].normal_(generator=gen)
        else:
            gen = torch.Generator(device=store.device).manual_seed(seed)
            page = store.page_size
            if page:  # a paged store: map the context's pages, then write them through the page table
                store.ensure_mapped(context)
            for g in range(len(store.groups)):
                for t, fmt, offsets in ((store.latent_k[g], store.k_formats[g], store.k_offsets[g]),
                                        (store.latent_v[g], store.v_formats[g], store.v_offsets[g])):
                    f = parse_latent_format(fmt)
                    n = min(1024, max(context, 1))
                    z = torch.randn(n, offsets[-1], generator=gen, device=store.device)
                    rows = quantize_latent_ref(z, offsets, f) if f.quantized else z.to(t.dtype)
                    reps = math.ceil(context / n)
                    rows = rows.repeat(reps, 1)[:context]
                    if not page:
                        t[:, :context] = rows
                    elif context:  # (pages, P, W) into every sequence's pages; the last page's tail zero
                        pages = -(-context // page)
                        full = torch.cat((rows, rows.new_zeros(pages * page - context, rows.shape[1])))
                        t[store.page_table[:, :pages].long()] = full.view(pages, page, -1)
            store.slot_pos[:, :context] = torch.arange(context, device=store.device, dtype=store.slot_pos.dtype)
            w = store.recent_window
            if w and context:  # the ring holds the last min(W, context) slots, each at entry slot % W
                last = torch.arange(max(0, context - w), context, device=store.device)
                for layer in store.window_k:
                    store.window_k[layer].normal_(generator=gen)
                    store.window_v[layer].normal_(generator=gen)
                    store.window_slots[layer].fill_(-1)
                    store.window_slots[layer][last % w] = last
        for layer in cache.layers:
            counter = getattr(layer, "cumulative_length", None)
            if isinstance(counter, torch.Tensor):
                counter.fill_(context)


def fill_rope_tables_(model: torch.nn.Module, cache: Any) -> bool:
    """Write the model's own RoPE cos / sin for every position into a latent store's tables (allocated by the
    backend at compile time), so the random latents' keys get real rotations. Returns False when there is nothing
    to fill (dense cache, no tables yet, or a table width other than the model's rotary width)."""
    store = getattr(cache, "store", None)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if store is None or store.rope_cos is None or rotary is None:
        return False
    p, w = store.rope_cos.shape
    with torch.no_grad():
        pos = torch.arange(p, device=store.device)[None]
        cos, sin = rotary(store.rope_cos[None, :1], pos)
        if cos.shape[-1] != w:
            return False
        store.rope_cos.copy_(cos[0].to(store.rope_cos.dtype))
        store.rope_sin.copy_(sin[0].to(store.rope_sin.dtype))
    return True


def kv_bytes_held(cache: Any) -> int:
    """Bytes of the tensors that hold the cache's KV state: dense K and V, or every byte of the latent store
    (latents, or a paged store's whole page pools and its page table, slot positions, the recent window, bases;
    not the RoPE tables, a cache of the model's cos / sin)."""
    store = getattr(cache, "store", None)
    if store is None:
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    nb = store.nbytes()
    return nb.per_sequence_state + (0 if nb.online_bases else nb.bases)


def random_bases(model: torch.nn.Module, group_size: int, seed: int = 0, samples: int = 2, tokens: int = 256,
                 key_space: str = "pre_rope") -> Any:
    """Collect KV moments (:func:`~ckvp_compile.latent.collect_kv_moments`) on ``samples`` sequences of ``tokens``
    uniformly random token ids: the calibration of a random-weight model, whose bases matter only for their
    ranks (time and memory), not for fidelity. ``key_space``: the keys the moments sum over
    (:attr:`~ckvp_compile.latent.LatentBases.key_space`)."""
    from ..latent import collect_kv_moments

    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = [torch.randint(0, vocab, (1, tokens), generator=gen) for _ in range(samples)]
    return collect_kv_moments(model, ids, group_size=group_size, progress=False, key_space=key_space)


class DecomposedMoments:
    """KV moments eigen-decomposed once, with :meth:`KVMoments.bases` 's interface (PCA bases, 'energy' or 'uniform'
    ranks), so that :func:`~ckvp_compile.latent.budget.bases_for_byte_ratio`, which builds bases about 40 times
    while it bisects the ranks, does not eigen-decompose the moments each time (minutes for 24 layers of 16 KV
    heads of 512 x 512). The bases are assembled as :func:`~ckvp_compile.latent.build_latent_bases` assembles them
    (leading eigenvectors, columns beyond each head's rank zeroed).

    Args:
        groups, num_kv_heads, head_dim, group_size, model_fingerprint, num_tokens: as in ``KVMoments``.
        k, v: per group, ``(eigenvalues (Hkv, N) descending >= 0, eigenvectors (Hkv, N, N))``.
        key_space: the keys ``k`` describes, as ``KVMoments.key_space``.
    """

    def __init__(self, groups: tuple[tuple[int, ...], ...], num_kv_heads: int, head_dim: int, group_size: int,
                 k: list[tuple[torch.Tensor, torch.Tensor]], v: list[tuple[torch.Tensor, torch.Tensor]],
                 model_fingerprint: dict[str, Any], num_tokens: int = 1, key_space: str = "pre_rope"):
        self.groups, self.num_kv_heads, self.head_dim, self.group_size = groups, num_kv_heads, head_dim, group_size
        self.k, self.v, self.model_fingerprint, self.num_tokens = k, v, model_fingerprint, num_tokens
        self.key_space = key_space

    @classmethod
    def from_moments(cls, m: Any) -> "DecomposedMoments":
        """Eigen-decompose a :class:`~ckvp_compile.latent.KVMoments` (one ``eigh`` per group and K/V)."""
        def dec(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            evals, evecs = torch.linalg.eigh(x / m.num_tokens)
            return evals.flip(-1).clamp_min(0), evecs.flip(-1)

        return cls(m.groups, m.num_kv_heads, m.head_dim, m.group_size, [dec(x) for x in m.k], [dec(x) for x in m.v],
                   m.model_fingerprint, m.num_tokens, getattr(m, "key_space", "pre_rope"))

    def bases(self, kv_ratio: float = 4.0, rank_allocation: str = "energy", basis: str = "pca",
              rank_block: int = 1, max_key_rank: int | None = None) -> Any:
        """:class:`~ckvp_compile.latent.LatentBases` at ``kv_ratio`` (elements), as ``KVMoments.bases``.

        Raises:
            CKVPConfigError: a basis other than 'pca', an allocation other than 'energy' / 'uniform', or a ratio
                out of range.
        """
        from ..latent import LatentBases, allocate_ranks, rank_budget
        from ..latent.ranks import key_rank_caps
        from ..latent.bases import check_target_ratio

        if basis != "pca" or rank_allocation not in ("energy", "uniform"):
            raise CKVPConfigError(f"DecomposedMoments builds 'pca' bases with 'energy' or 'uniform' ranks, got "
                                  f"{basis!r} / {rank_allocation!r}")
        hkv, ng = self.num_kv_heads, len(self.groups)
        dense = sum(len(g) for g in self.groups) * hkv * self.head_dim * 2
        check_target_ratio(kv_ratio, dense, 2 * ng * hkv)
        spectra = [d[0][h] for d in (*self.k, *self.v) for h in range(hkv)]
        max_ranks, budget = key_rank_caps(spectra, ng * hkv, max_key_rank, rank_budget(dense, kv_ratio), rank_block)
        flat = iter(allocate_ranks(spectra, budget, rank_allocation, rank_block=rank_block, max_ranks=max_ranks))
        out: dict[str, Any] = {}
        for kind, dec in (("k", self.k), ("v", self.v)):
            ranks = [tuple(next(flat) for _ in range(hkv)) for _ in self.groups]
            bases = []
            for (_, evecs), rs in zip(dec, ranks):
                b = evecs[:, :, :max(rs)].clone()
                for h, r in enumerate(rs):
                    b[h, :, r:] = 0
                bases.append(b.float())
            out.update({f"{kind}_basis": tuple(bases), f"{kind}_ranks": tuple(ranks),
                        f"{kind}_eigenvalues": tuple(e for e, _ in dec)})
        return LatentBases(groups=self.groups, num_kv_heads=hkv, head_dim=self.head_dim, group_size=self.group_size,
                           target_ratio=float(kv_ratio), rank_allocation=rank_allocation,
                           model_fingerprint=dict(self.model_fingerprint), num_tokens=int(self.num_tokens),
                           max_key_rank=max_key_rank, key_space=self.key_space, **out)


def synthetic_moments(model: torch.nn.Module, group_size: int, seed: int = 0, decay: float = 1.0) -> DecomposedMoments:
    """Moments with a known spectrum instead of calibration: per group of ``group_size`` consecutive layers and KV
    head, eigenvectors a random orthogonal (G*D x G*D) matrix and eigenvalues ``(i + 1) ** -decay``. Ranks fitted
    to a byte ratio from these depend on the spectrum only, which is what a speed or memory run of a random-weight
    model needs (and costs no model pass); never use them for fidelity.

    Returns:
        :class:`DecomposedMoments` (float64, on the CPU).
    """
    from ..latent import model_fingerprint

    layers, hkv, d = _kv_shape(model.config)
    groups = tuple(tuple(range(i, min(i + group_size, layers))) for i in range(0, layers, group_size))
    gen = torch.Generator().manual_seed(seed)

    def dec(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, _ = torch.linalg.qr(torch.randn(hkv, n, n, generator=gen, dtype=torch.float64))
        return (torch.arange(1, n + 1, dtype=torch.float64) ** -decay).expand(hkv, n).clone(), q

    return DecomposedMoments(groups, hkv, d, group_size, [dec(len(g) * d) for g in groups],
                             [dec(len(g) * d) for g in groups], model_fingerprint(model))
