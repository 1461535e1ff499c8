"""Quantization block layout of the latents, measured offline: per-token blocks (the product) against per-channel
blocks over groups of tokens (KIVI's layout for keys), at the same bits and the same bytes.

    python -m ckvp_compile.bench.fidelity_layout --configs uniform:4:8:int4 planned+rot+fp8:4:8:mix/32 \\
        --json layout.json

KIVI (Liu et al. 2024, arXiv:2402.02750) quantizes *keys per channel* (one scale and minimum per channel over a
group of tokens: key outliers sit in fixed channels) and *values per token*. The latent store quantizes every
latent row per token (blocks of ``block`` coordinates of one token, :mod:`ckvp_compile.kernels.latent_format`):
a token is final when written, with no full-precision window of recent tokens. Per-channel blocks need the
group's tokens before they can be quantized (KIVI keeps a full-precision residual of up to ``--tokens`` recent
tokens for that), so the store does not implement them; this module measures what they would give.

What is measured, per config (the bench's ``allocation:G:ratio:format``, fitted exactly as
:func:`~ckvp_compile.bench.fidelity.run_fidelity` fits it) and per layout of K and V:

1. The dense model's pre-RoPE keys and values of the evaluation windows (hooks on each layer's ``k_proj`` and
   ``v_proj``, checked against what calibration records as the pre-RoPE key and the cached value; a model where
   they differ is refused).
2. Latents ``z = x P`` per (group, KV head), quantized in the layout and the config's bits (mix plans: each
   coordinate keeps its planned bits), dequantized with the reference (:func:`quantize_latent_ref` /
   :func:`dequantize_latent_ref`), reconstructed ``x^ = z^ P^T`` with the bases in the store's dtype.
   Layouts: ``token`` (the store's format), ``channel`` (each latent coordinate in blocks of ``--tokens``
   consecutive tokens, asymmetric fp16 scale and minimum per block: the same bits and, when the format's block
   equals ``--tokens`` and ranks are multiples of it, the same bytes), ``float`` (unquantized latents:
   truncation only) and ``dense`` (the original K or V).
3. Relative reconstruction error of K and V (``sum ||x^ - x||^2 / sum ||x||^2`` over layers and tokens), and
   the relative error of every layer's attention output (``o_proj``'s input) in the evaluation below.
4. Perplexity, top-1 agreement and KL to dense through an eager evaluation with the bench's chunk semantics:
   each window is one forward in which a query of chunk ``c`` (``--chunk`` tokens) attends to the tokens of its
   own chunk exactly and to earlier tokens through their reconstructed K (RoPE applied at their positions) and
   V. Unlike the compiled bench, the earlier tokens' K and V are the *dense* model's (not recomputed from the
   perturbed forward), so errors do not compound through the cache; the ``token`` rows, next to the bench's
   numbers for the same config, show how close the two paths are.

Bytes per token (latent codes + block metadata, per sequence of the window) are reported per layout.

The same eager evaluation, with one (group, KV head, K/V) unit compressed at a time on calibration windows, is
the error measurement of the fidelity bench's '+measured' planner (:func:`unit_kl_meter`). The ``float`` and
``dense`` layouts split a config's loss into truncation and quantization of keys and of values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .fidelity import (DEFAULT_MODEL_DIR, FidelityConfig, _batches, _collect_moments, _nll_and_argmax, config_bases,
                       dense_stats, load_token_ids, split_windows)

__all__ = ["LAYOUTS", "LayoutResult", "capture_kv", "main", "quantize_channels", "reconstruct", "run_layouts",
           "unit_kl_meter"]

#: Layouts of a kind's latents (module docstring).
LAYOUTS = ("token", "channel", "float", "dense")


@dataclass
class LayoutResult:
    """One row: a config with one layout for K and one for V."""

    config: str
    k_layout: str
    v_layout: str
    k_format: str  # the config's formats (group 0)
    v_format: str
    tokens_per_channel_block: int
    k_rel_err: float  # sum ||k^ - k||^2 / sum ||k||^2 over layers, heads and tokens (pre-RoPE)
    v_rel_err: float
    attn_out_rel_err: float  # the same for the attention outputs (o_proj inputs), summed over layers
    k_bytes_per_token: float  # latent codes + block scales / minimums, per token of a window
    v_bytes_per_token: float
    dense_ppl: float
    ppl: float
    ppl_change_pct: float
    top1_agreement_pct: float
    kl_to_dense: float


# --------------------------------------------------------------------------------------------------- capturing


@contextlib.contextmanager
def _hooks(model: torch.nn.Module, fn_k: Any, fn_v: Any, fn_o: Any = None) -> Iterator[None]:
    """Forward hooks on each decoder layer's attention ``k_proj`` / ``v_proj`` outputs and ``o_proj`` input."""
    handles = []
    for i, layer in enumerate(_layers(model)):
        attn = layer.self_attn
        handles.append(attn.k_proj.register_forward_hook(lambda _m, _i, out, i=i: fn_k(i, out)))
        handles.append(attn.v_proj.register_forward_hook(lambda _m, _i, out, i=i: fn_v(i, out)))
        if fn_o is not None:
            handles.append(attn.o_proj.register_forward_pre_hook(lambda _m, args, i=i: fn_o(i, args[0])))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(getattr(m, "self_attn", None), "k_proj") for m in layers):
        raise SystemExit("fidelity_layout: the model has no model.layers[i].self_attn.{k,v,o}_proj (a Llama-style "
                         "Hugging Face attention); this offline measurement supports those models only")
    return layers


def capture_kv(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> dict[int, tuple[torch.Tensor, ...]]:
    """Dense pre-RoPE keys and values of every layer: ``{layer: (K, V)}``, each (N, Hkv, S, D) float32 on CPU."""
    cfg = model.config.get_text_config()
    hkv, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    store: dict[int, tuple[list, list]] = {}

    def keep(kind: int) -> Any:
        def fn(i: int, out: torch.Tensor) -> None:
            b, s, _ = out.shape
            store.setdefault(i, ([], []))[kind].append(out.detach().float().view(b, s, hkv, d).transpose(1, 2).cpu())
        return fn

    device = next(model.parameters()).device
    with torch.no_grad(), _hooks(model, keep(0), keep(1)):
        for batch, real in _batches(windows, batch_size):
            model(input_ids=batch.to(device), use_cache=False)
            for i in store:  # drop the padded copies
                for lst in store[i]:
                    lst[-1] = lst[-1][:real]
    return {i: (torch.cat(k), torch.cat(v)) for i, (k, v) in sorted(store.items())}


def _check_against_calibration(model: torch.nn.Module, windows: torch.Tensor, kv: dict, moments: Any) -> None:
    """Refuse a model whose k_proj / v_proj outputs are not what calibration records (e.g. q/k norms)."""
    from ..latent import collect_kv_moments

    seen = []
    collect_kv_moments(model, [windows[:1]], group_size=moments.group_size, progress=False,
                       on_sample=lambda stacked: seen.append(stacked))
    for (xk, xv), layers in zip(seen[0], moments.groups):
        for kind, x in ((0, xk), (1, xv)):
            ours = torch.cat([kv[layer][kind][:1] for layer in layers], -1)  # (1, Hkv, S, G*D)
            ref = x.view(ours.shape[1], 1, ours.shape[2], -1).transpose(0, 1).float()
            if not torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())):
                raise SystemExit(f"fidelity_layout: layer group {layers}: the k_proj / v_proj outputs are not the "
                                 "pre-RoPE keys / values calibration records (a q/k norm or another form); this "
                                 "offline measurement supports plain Llama-style attention only")


# ------------------------------------------------------------------------------------------------ quantizing


def quantize_channels(z: torch.Tensor, offsets: Sequence[int], fmt: Any, tokens: int) -> torch.Tensor:
    """Quantize and dequantize latent rows per *channel*: every latent coordinate in blocks of ``tokens``
    consecutive tokens, with the bits the format gives that coordinate (asymmetric, fp16 scale and minimum per
    block, the reference rounding of :func:`~ckvp_compile.kernels.latent_format.quantize_latent_ref`).

    Args:
        z: (N, S, R_tot) float latents (S a multiple of ``tokens``). offsets: Hkv+1 ints.
        fmt: a uniform int or mix format (its bits per coordinate are kept; its block is not used).
        tokens: tokens per block.
    Returns:
        (N, S, R_tot) float32 dequantized latents.
    Raises:
        ValueError: S not a multiple of ``tokens``, or a format that is not uniform int / mix.
    """
    from ..kernels.latent_format import dequantize_latent_ref, parse_latent_format, quantize_latent_ref

    f = parse_latent_format(fmt)
    if not f.quantized or f.ternary or f.pow2:
        raise ValueError(f"quantize_channels needs an int or mix format, got {f.name!r}")
    n, s, _ = z.shape
    if s % tokens:
        raise ValueError(f"the window ({s} tokens) must be a multiple of the channel block ({tokens} tokens)")
    out = torch.empty_like(z, dtype=torch.float32)
    for col, count, bits, _ in f.pieces(offsets):
        x = z[..., col:col + count].float().reshape(n, s // tokens, tokens, count).transpose(-1, -2)
        q = f"int{bits}/{tokens}"
        rows = dequantize_latent_ref(quantize_latent_ref(x.contiguous(), [0, tokens], q), [0, tokens], q)
        out[..., col:col + count] = rows.transpose(-1, -2).reshape(n, s, count)
    return out


def _layout_bytes(fmt: Any, offsets: Sequence[int], layout: str, tokens: int, float_itemsize: int) -> float:
    """Latent bytes per token of one group and kind in a layout (codes + per-block metadata)."""
    from ..kernels.latent_format import parse_latent_format

    f = parse_latent_format(fmt)
    if layout == "dense":
        return float("nan")
    if layout == "float":
        return float(offsets[-1] * float_itemsize)
    if layout == "token":
        return float(f.row_width(offsets))
    return sum(count * bits / 8 + 4 * count / tokens for _, count, bits, _ in f.pieces(offsets))


def reconstruct(bases: Any, kv: dict, layouts: tuple[str, str], basis_dtype: torch.dtype, tokens: int,
                float_dtype: torch.dtype = torch.bfloat16) -> tuple[dict[int, list[torch.Tensor]], list[float]]:
    """Reconstructed K and V of every layer in the given layouts (module docstring, step 2).

    Args:
        bases: the config's :class:`~ckvp_compile.latent.LatentBases` (formats in ``k_formats`` / ``v_formats``).
        kv: :func:`capture_kv`'s output. layouts: (K layout, V layout), each one of :data:`LAYOUTS`.
        basis_dtype: the store's basis dtype (the bases are rounded to it). tokens: the channel block.
        float_dtype: the dtype of ``float`` latents.
    Returns:
        ``{layer: [K^, V^]}`` (N, Hkv, S, D) float32, and the latent bytes per token of K and V.
    """
    from ..kernels.latent_format import dequantize_latent_ref, quantize_latent_ref

    d = bases.head_dim
    out = {layer: [None, None] for layers in bases.groups for layer in layers}
    nbytes = [0.0, 0.0]
    for kind_i, kind in enumerate(("k", "v")):
        layout = layouts[kind_i]
        for g, layers in enumerate(bases.groups):
            x = torch.cat([kv[layer][kind_i] for layer in layers], -1)  # (N, Hkv, S, G*D)
            if layout == "dense":
                rec = x
            else:
                p = bases.basis(kind)[g].to(basis_dtype).float().cpu()  # (Hkv, G*D, R_max)
                ranks = bases.ranks(kind)[g]
                offsets = [0]
                for r in ranks:
                    offsets.append(offsets[-1] + int(r))
                z = torch.cat([x[:, h] @ p[h, :, :r] for h, r in enumerate(ranks)], -1)  # (N, S, R_tot)
                fmt = getattr(bases, f"{kind}_formats")[g]
                nbytes[kind_i] += _layout_bytes(fmt, offsets, layout, tokens, float_dtype.itemsize)
                if layout == "float":
                    zq = z.to(float_dtype).float()
                elif layout == "token":
                    zq = dequantize_latent_ref(quantize_latent_ref(z, offsets, fmt), offsets, fmt)
                else:
                    zq = quantize_channels(z, offsets, fmt, tokens)
                rec = torch.stack([zq[..., a:b] @ p[h, :, :b - a].T for h, (a, b) in
                                   enumerate(zip(offsets, offsets[1:]))], 1)  # (N, Hkv, S, G*D)
            for j, layer in enumerate(layers):
                out[layer][kind_i] = rec[..., j * d:(j + 1) * d]
    return out, nbytes


# ------------------------------------------------------------------------------------------------- evaluating


_ATTN_NAME = "ckvp_fidelity_layout"


class _ChunkedAttention:
    """An attention implementation (transformers ``AttentionInterface``) for :func:`_evaluate`: a query of
    chunk c attends to its own chunk's keys and values exactly (causally) and to earlier tokens through the
    reconstructed ones (``self.rec[layer] = (K^ post-RoPE, V^)`` for the current batch)."""

    def __init__(self, chunk: int) -> None:
        self.chunk, self.rec = chunk, {}

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, scaling: float, dropout: float = 0.0, **kwargs: Any) -> tuple:
        k_rec, v_rec = self.rec[module.layer_idx]
        rep = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        kr, vr = k_rec.to(key).repeat_interleave(rep, 1), v_rec.to(value).repeat_interleave(rep, 1)
        s = query.shape[2]
        pos = torch.arange(s, device=query.device)
        same = (pos[:, None] // self.chunk == pos[None, :] // self.chunk) & (pos[None, :] <= pos[:, None])
        past = pos[None, :] < (pos[:, None] // self.chunk) * self.chunk
        exact = (query @ k.mT) * scaling
        recon = (query @ kr.mT) * scaling
        scores = torch.where(same, exact, torch.where(past, recon, float("-inf")))
        p = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out = (p * same) @ v + (p * past) @ vr
        return out.transpose(1, 2).contiguous(), None


def _rope(model: torch.nn.Module, k: torch.Tensor) -> torch.Tensor:
    """Apply the model's RoPE (Llama form, ``rotate_half``) to pre-RoPE keys (N, Hkv, S, D) at positions 0..S-1."""
    import importlib

    s = k.shape[2]
    pos = torch.arange(s)[None]
    cos, sin = model.model.rotary_emb(k.transpose(1, 2).reshape(k.shape[0], s, -1), pos)
    mod = importlib.import_module(type(model).__module__)
    _, out = mod.apply_rotary_pos_emb(k, k, cos, sin)
    return out


def _evaluate(model: torch.nn.Module, windows: torch.Tensor, dense: Any, rec: dict, chunk: int, batch_size: int,
              dense_out: list[torch.Tensor] | None, post_rope: bool = False) -> tuple[Any, float, list[torch.Tensor]]:
    """Evaluate the windows with the chunked attention over reconstructed K / V (module docstring, step 4).
    ``post_rope``: the keys of ``rec`` are after RoPE already (post-RoPE key bases), else RoPE is applied here.
    Returns (EvalStats, attention-output relative error vs ``dense_out``, this pass's attention outputs)."""
    from transformers import AttentionInterface

    from .fidelity import EvalStats

    attn = _ChunkedAttention(chunk)
    AttentionInterface.register(_ATTN_NAME, attn)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_ATTN_NAME)
    outs: dict[int, list[torch.Tensor]] = {}
    nlls, agree, kls = [], [], []
    try:
        with torch.no_grad(), _hooks(model, lambda i, o: None, lambda i, o: None,
                                     lambda i, o: outs.setdefault(i, []).append(o.detach().float().cpu())):
            for bi, (batch, real) in enumerate(_batches(windows, batch_size)):
                lo = bi * batch_size
                idx = torch.arange(lo, lo + batch_size).clamp(max=windows.shape[0] - 1)
                attn.rec = {layer: (k[idx] if post_rope else _rope(model, k[idx]), v[idx])
                            for layer, (k, v) in rec.items()}
                logits = model(input_ids=batch.to(next(model.parameters()).device), use_cache=False).logits
                nll, pred, lp = _nll_and_argmax(logits.float().cpu(), batch)
                ref = dense.logp[lo:lo + real].double()
                nlls.append(nll[:real])
                agree.append((pred[:real] == dense.pred[lo:lo + real]).sum(-1))
                kls.append((ref.exp() * (ref - lp[:real])).sum((-1, -2)))
                for i in outs:
                    outs[i][-1] = outs[i][-1][:real]
    finally:
        model.set_attn_implementation(previous)
    n, w = windows.shape
    stats = EvalStats(torch.cat(nlls), n * (w - 1), torch.cat(agree), torch.cat(kls))
    mine = [torch.cat(outs[i]) for i in sorted(outs)]
    err = float("nan")
    if dense_out is not None:
        err = sum(float((a - b).square().sum()) for a, b in zip(mine, dense_out)) / \
            sum(float(b.square().sum()) for b in dense_out)
    return stats, err, mine


def unit_kl_meter(model: torch.nn.Module, windows: torch.Tensor, bases: Any, *, basis_dtype: torch.dtype,
                  rotate: bool, chunk: int = 16, batch_size: int = 4, meta_f8: bool = False) -> Any:
    """A ``measure`` for :func:`~ckvp_compile.latent.planner.measured_block_errors`: the KL divergence to the
    dense model (nats per predicted token) of ``windows`` (calibration windows: never the evaluated ones) when
    only one (kind, group, KV head) unit of the full-rank ``bases`` is compressed, through the eager chunked
    evaluation of this module (step 4 of the module docstring).

    The unit's first ``rank`` principal components (rotated per ``block`` when ``rotate``, then rounded to
    ``basis_dtype`` as the store keeps them) carry its latent; the listed blocks are quantized per token with the
    reference quantizer (``int<bits>/<block>``, ``-f8`` with ``meta_f8``), the others exact; every other unit is dense. Results are cached.
    Bases of the keys as cached (``bases.key_space == 'post_rope'``) compress the keys after RoPE.

    Raises:
        SystemExit: the model is not a Llama-style attention (see :func:`capture_kv`).
    """
    from ..kernels.latent_format import dequantize_latent_ref, quantize_latent_ref
    from ..latent.rotation import rotate_basis_blocks

    dense = dense_stats(model, windows, batch_size)
    kv = capture_kv(model, windows, batch_size)
    post_rope = getattr(bases, "key_space", "pre_rope") == "post_rope"
    if post_rope:  # the key bases span the keys as cached: project (and rebuild) the keys after RoPE
        kv = {layer: (_rope(model, k), v) for layer, (k, v) in kv.items()}
    d = bases.head_dim
    cache: dict[tuple, float] = {}

    def measure(kind: str, g: int, h: int, rank: int, quant: dict[int, int], block: int) -> float:
        key = (kind, g, h, rank, tuple(sorted(quant.items())), block)
        if key in cache:
            return cache[key]
        ki = 0 if kind == "k" else 1
        layers = bases.groups[g]
        x = torch.cat([kv[layer][ki][:, h] for layer in layers], -1)  # (N, S, G*D)
        y = torch.zeros_like(x)
        if rank > 0:
            p = bases.basis(kind)[g][h, :, :rank].detach().cpu().double()
            if rotate:
                p = rotate_basis_blocks(p[None], [rank], block)[0]
            p = p.to(basis_dtype).float()
            z = x @ p
            for i, bits in quant.items():
                cols = slice(i * block, min((i + 1) * block, rank))
                n = cols.stop - cols.start
                fmt = f"int{bits}/{block}" + ("-f8" if meta_f8 else "")
                z[..., cols] = dequantize_latent_ref(quantize_latent_ref(z[..., cols].contiguous(), [0, n], fmt),
                                                     [0, n], fmt)
            y = z @ p.T
        rec = {layer: list(pair) for layer, pair in kv.items()}
        for j, layer in enumerate(layers):
            t = rec[layer][ki].clone()
            t[:, h] = y[..., j * d:(j + 1) * d]
            rec[layer][ki] = t
        stats, _, _ = _evaluate(model, windows, dense, rec, chunk, batch_size, None, post_rope)
        cache[key] = float(stats.kl.sum()) / stats.tokens
        return cache[key]

    return measure


def _rel(rec: dict, kv: dict, kind: int) -> float:
    return (sum(float((rec[i][kind] - kv[i][kind]).square().sum()) for i in kv)
            / sum(float(kv[i][kind].square().sum()) for i in kv))


def run_layouts(model: torch.nn.Module, calib: torch.Tensor, evals: torch.Tensor, configs: Sequence[FidelityConfig],
                layouts: Sequence[tuple[str, str]], *, tokens: int = 32, chunk: int = 16, batch_size: int = 4,
                log: Any = None, measure_windows: int = 8) -> list[LayoutResult]:
    """Measure every config in every (K layout, V layout) (module docstring). One row per pair.
    ``measure_windows``: the first calibration windows a '+measured' config's planner measures on."""
    from .fidelity import measured_errors_cache

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    measure_errors = measured_errors_cache(model, calib[:measure_windows], chunk=chunk, batch_size=batch_size, log=log)
    window = evals.shape[1]
    dense = dense_stats(model, evals, batch_size)
    kv = capture_kv(model, evals, batch_size)
    moments = _collect_moments(model, calib, sorted({c.group_size for c in configs}), batch_size, False,
                               attended_values=any("avgout" in c.rank_allocation.split("+") for c in configs))
    _check_against_calibration(model, evals, kv, moments[max(moments)])
    exact = {layer: (k, v) for layer, (k, v) in kv.items()}
    base_stats, _, dense_out = _evaluate(model, evals, dense, exact, chunk, batch_size, None)
    if abs(base_stats.perplexity / dense.stats.perplexity - 1) > 1e-4:
        raise RuntimeError(f"the chunked evaluation with dense K / V gives perplexity {base_stats.perplexity:.5f}, "
                           f"the dense model {dense.stats.perplexity:.5f}: the attention replacement is wrong")
    results = []
    for cfg in configs:
        built = config_bases(cfg, moments[cfg.group_size], batch_size=batch_size, window=window, log=log,
                             measure_errors=measure_errors)
        if built is None:
            continue
        bases, _, label, basis_dtype, _ = built
        name = f"{cfg.rank_allocation}:{cfg.group_size}:{cfg.kv_ratio:g}:{label}"
        for lk, lv in layouts:
            t0 = time.perf_counter()
            rec, nbytes = reconstruct(bases, kv, (lk, lv), basis_dtype, tokens)
            stats, out_err, _ = _evaluate(model, evals, dense, rec, chunk, batch_size, dense_out)
            ppl = stats.perplexity
            results.append(LayoutResult(
                config=name, k_layout=lk, v_layout=lv, k_format=bases.k_formats[0], v_format=bases.v_formats[0],
                tokens_per_channel_block=tokens, k_rel_err=_rel(rec, kv, 0), v_rel_err=_rel(rec, kv, 1),
                attn_out_rel_err=out_err, k_bytes_per_token=nbytes[0], v_bytes_per_token=nbytes[1],
                dense_ppl=dense.stats.perplexity, ppl=ppl, ppl_change_pct=100 * (ppl / dense.stats.perplexity - 1),
                top1_agreement_pct=100 * float(stats.agree.sum()) / stats.tokens,
                kl_to_dense=float(stats.kl.sum()) / stats.tokens))
            r = results[-1]
            log(f"{name} K {lk} / V {lv}: K err {r.k_rel_err:.4f}, V err {r.v_rel_err:.4f}, attn out err "
                f"{r.attn_out_rel_err:.4f}, ppl {ppl:.5f} ({r.ppl_change_pct:+.3f}%), KL {r.kl_to_dense:.5f} "
                f"({time.perf_counter() - t0:.1f} s)")
    return results


def markdown_table(results: Sequence[LayoutResult]) -> str:
    """The results as a markdown table."""
    rows = ["| config | K layout | V layout | K / V latent bytes per token | K rel. error | V rel. error "
            "| attention-output rel. error | ppl change | top-1 agree | KL (nats/token) |", "|" + "---|" * 10]
    for r in results:
        def b(x: float) -> str:
            return "-" if math.isnan(x) else f"{x:.1f}"
        rows.append(f"| {r.config} | {r.k_layout} | {r.v_layout} | {b(r.k_bytes_per_token)} / {b(r.v_bytes_per_token)} "
                    f"| {r.k_rel_err:.4f} | {r.v_rel_err:.4f} | {r.attn_out_rel_err:.4f} | {r.ppl_change_pct:+.3f}% "
                    f"| {r.top1_agreement_pct:.2f}% | {r.kl_to_dense:.5f} |")
    return "\n".join(rows)


def _layout_pair(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("/")
    if not sep or k not in LAYOUTS or v not in LAYOUTS:
        raise argparse.ArgumentTypeError(f"expected <K layout>/<V layout> from {list(LAYOUTS)} (e.g. channel/token), "
                                         f"got {text!r}")
    return k, v


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckvp_compile.bench.fidelity_layout``: the module's comparison on the fixture model (``--help``);
    returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m ckvp_compile.bench.fidelity_layout", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--text", default=None, help="default: <model>/eval_text.txt")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-windows", type=int, default=16)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="tokens per per-channel block (default 32)")
    p.add_argument("--configs", type=FidelityConfig.parse, nargs="+", required=True,
                   help="allocation:G:ratio:format, as the fidelity bench's --extra")
    p.add_argument("--layouts", type=_layout_pair, nargs="+",
                   default=[("token", "token"), ("channel", "token"), ("token", "channel"), ("channel", "channel")],
                   help="K/V layout pairs from token, channel, float, dense (default: the four token/channel pairs)")
    p.add_argument("--measure-windows", type=int, default=8,
                   help="calibration windows a '+measured' config's planner measures on (default 8)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.calib_windows < 1:
        p.error(f"--calib-windows must be >= 1, got {args.calib_windows}")
    if not 1 <= args.measure_windows <= args.calib_windows:
        p.error(f"--measure-windows must be in 1..--calib-windows ({args.calib_windows})")
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model_dir = Path(args.model)
    text = Path(args.text) if args.text else model_dir / "eval_text.txt"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True).eval()
    windows = split_windows(load_token_ids(text, model, model_dir), args.window)
    need = args.calib_windows + args.eval_windows
    if windows.shape[0] < need:
        raise SystemExit(f"{text} has {windows.shape[0]} windows of {args.window} tokens; {need} are needed")
    results = run_layouts(model, windows[:args.calib_windows], windows[args.calib_windows:need], args.configs,
                          args.layouts, tokens=args.tokens, chunk=args.chunk, batch_size=args.batch,
                          measure_windows=args.measure_windows)
    print(markdown_table(results))
    if args.json:
        settings = {"command": "python -m ckvp_compile.bench.fidelity_layout " + " ".join(sys.argv[1:] if argv is None
                                                                                         else argv),
                    "window": args.window, "calib_windows": args.calib_windows, "eval_windows": args.eval_windows,
                    "chunk": args.chunk, "batch": args.batch, "tokens": args.tokens,
                    "measure_windows": args.measure_windows, "torch": torch.__version__,
                    "seconds": round(time.perf_counter() - t0, 1)}
        Path(args.json).write_text(json.dumps({"settings": settings, "results": [asdict(r) for r in results]},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
