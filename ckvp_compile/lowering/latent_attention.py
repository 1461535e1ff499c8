"""Inductor lowering of the latent decode attention: the key pass as an autotuned ``TritonTemplate``.

On CUDA, ``ckvp::latent_attention`` is lowered to its two halves (:mod:`ckvp_compile.ops.latent_attention_parts`)::

    scores = ckvp_latent_scores(q, latent_k, basis_k_block, cos, sin, slot_pos, slots[, mask])   template | extern
    out    = ckvp::latent_attention_from_scores(scores, q, latent_v, basis_v_block, ...)          extern

and ``ckvp::latent_scores`` on its own gets the same template. The key pass is where the work is (every cached
key is rebuilt from its latent coordinates with the layer's basis block and rotated at its position), so that is
what Inductor autotunes: the template's choices are the configs of :data:`TEMPLATE_CONFIGS` (slots per tile,
rebuild chunk, warps, stages, CUDA-core or tensor-core scores), timed by ``autotune_select_algorithm`` with
``max_autotune`` (else the first config only), plus the extern ``ckvp::latent_scores`` (the plain Triton kernel
on CUDA) as a choice. One program of the template scores one tile of ``BLOCK_N`` slots for one (sequence, KV head,
query token); its body calls ``_tile_scores``, the ``@triton.jit`` helper of
:mod:`ckvp_compile.kernels.latent_attention_triton` that the plain kernels call too (one copy of the math).

When the template is not used (the reason is logged at DEBUG): a non-CUDA device (then ``latent_attention`` stays
one extern call: on CPU the reference, exactly as without this lowering), symbolic sizes, scores that would exceed
``MAX_SCORES_BYTES`` (the extern op then runs the two passes on slices of the batch, or the one-pass kernel for a
long prefill whose one sequence exceeds it), per-sequence (online)
bases, latent formats other than uniform ``int*`` / ``mxint*`` / ``float`` (``-f8`` ones too while
:data:`F8_META_TEMPLATE_GPU_CHECKED` is off), heads of unequal rank, or a mask that is not bool / float; these keep the op
as an extern call, which still runs the Triton kernels on CUDA (or the reference, for inputs they refuse).

Without max-autotune (one template config, nothing timed) ``ckvp::latent_attention`` also stays one extern call
where the plain kernel's default has a form the template lacks (:func:`plain_kernel_preferred`): one query head per
KV head (the rotated and grouped key passes) and GQA up to rank 128 (the one-pass kernel). On the H200 a
Qwen1.5-MoE-shaped decode step at batch 8, 32k whose plan gave 16 layers equal ranks took 34.5 ms with the
template's key pass in those layers against 22.1 ms with the plain kernel in every layer
(benchmarks/results/2026-12-01-rank-blocks-h200). With max-autotune the template's configs compete with the extern
``ckvp::latent_scores`` (the plain key pass, in its rotated / grouped forms where they apply), and the call runs in
two passes.

Registered by :func:`ckvp_compile.lowering.register_all`. Inductor internals through ``_compat`` only. Source: the
template / extern-choice pattern of ``torch/_inductor/kernel/mm.py`` and ``flex_attention.py`` (read in torch 2.13).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .. import _compat
from ..kernels import latent_attention_triton as lat
from ..kernels.latent_format import parse_latent_format
from .moe import _helper_source, _static_ints

logger = logging.getLogger(__name__)

__all__ = ["EXTERN_NAME", "TEMPLATE_CONFIGS", "TEMPLATE_NAME", "plain_kernel_preferred", "register", "template_refusal",
           "tuned_latent_attention", "tuned_latent_scores"]

_api = _compat.inductor_template_api()
aten = torch.ops.aten

#: The template's name (in Inductor's autotuning log and the generated kernel names).
TEMPLATE_NAME = "ckvp_latent_scores"
#: The extern choice's name in ``torch._inductor.select_algorithm.extern_kernels``.
EXTERN_NAME = "ckvp_latent_scores_extern"


@dataclass(frozen=True)
class ScoresConfig:
    """One template choice: slots per program, rebuild chunk, warps, stages, CUDA-core scores, the exact code-domain
    key rebuild (``DecodeConfig.key_codes``: chunks of one quantization block, where the format allows it) and a
    runtime loop over the rank chunks (``DecodeConfig.r_loop``)."""

    block_n: int
    block_r: int
    num_warps: int
    num_stages: int
    fma_scores: bool = False
    key_codes: bool = False
    r_loop: bool = False


#: Autotuning choices (the first is the one used without max-autotune: the key pass of the H200 run 5 winner).
TEMPLATE_CONFIGS = (
    ScoresConfig(64, 64, 4, 2), ScoresConfig(64, 64, 8, 2), ScoresConfig(128, 64, 8, 2), ScoresConfig(32, 64, 4, 2),
    ScoresConfig(64, 32, 4, 2), ScoresConfig(64, 64, 4, 1), ScoresConfig(64, 64, 4, 2, True),
    ScoresConfig(128, 32, 8, 1),
)

#: The fused kernel reads fp8 bases on the H200 (kernels.latent_attention_triton.FP8_BASES_GPU_CHECKED, run 7); this
#: template, compiled by Inductor, has not been run with them there yet: until then such calls stay extern calls.
FP8_BASES_TEMPLATE_GPU_CHECKED = False
#: ``-f8`` key latents (e4m3 block spans and mins, K_META8): the template reads them, equal to the reference under the
#: interpreter (tests/kernels/test_latent_attention_f8.py) and on the H200, chosen by Inductor's autotuning and within
#: 2.6e-4 of the reference (benchmarks/f8_meta_gpu.py, check 4; benchmarks/results/2026-12-05-f8-meta-h200/r1).
#: Both this and kernels.latent_attention_triton.F8_META_GPU_CHECKED must hold, else such calls stay extern calls.
F8_META_TEMPLATE_GPU_CHECKED = True

_HELPERS = (lat._tile_scores, lat._rebuild_chunk, lat._basis_rows, lat._latent_load, lat._latent_tile, lat._dot_split, lat._mm, lat._mm16, lat._fma_scores,
            lat._fma_scores_pair, lat._latent_codes, lat._mm_codes, lat._latent_raw_codes,
            lat._fp16_at, lat._scale_min, lat._rope_rows, lat._mask_tile, lat._additive_log2, lat._unpack_codes)

_SOURCE = r'''
{{def_kernel("Q", "LK", "BK", "COS", "SIN", "POS", "SLOTS", "MASK")}}
    t = tl.program_id(0)
    bh = tl.program_id(1)
    s = tl.program_id(2)
    b = bh // HKV
    h = bh % HKV
    gi = tl.arange(0, G_PAD)
    head_ok = gi < G
    q_row0 = Q + b.to(tl.int64) * {{stride("Q", 0)}} + s * {{stride("Q", 2)}} + (h * G) * {{stride("Q", 1)}}
    i1, i2, c1, c2, rot_ok, rest, rest_ok = _rope_rows(HALF_VAL, 2 * HALF_VAL, D, HALF, REST, ROPE)
    q_rows = q_row0 + gi * {{stride("Q", 1)}}
    q1 = tl.load(q_rows[:, None] + (i1 * {{stride("Q", 3)}})[None, :], mask=head_ok[:, None] & rot_ok[None, :],
                 other=0.0).to(tl.float32)
    q2 = tl.load(q_rows[:, None] + (i2 * {{stride("Q", 3)}})[None, :], mask=head_ok[:, None] & rot_ok[None, :],
                 other=0.0).to(tl.float32)
    q3 = tl.load(q_rows[:, None] + (rest * {{stride("Q", 3)}})[None, :], mask=head_ok[:, None] & rest_ok[None, :],
                 other=0.0).to(tl.float32)
    bk_head = BK + h * {{stride("BK", 0)}}
    mask_row = MASK + b.to(tl.int64) * M_SB + s * M_SS + (h * G + gi) * M_SH
    offs = t * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs < KV_LEN
    is_new = offs < 0
    for j0 in range(0, N_EXACT, 16):  # exact tokens' slots: scored later (ckvp::latent_attention_from_scores)
        sj = j0 + tl.arange(0, 16)
        sl = tl.load(SLOTS + sj, mask=sj < N_EXACT, other=-1)
        is_new = is_new | (tl.sum((offs[:, None] == sl[None, :]).to(tl.int32), axis=1) > 0)
    col_ok = row_ok & ~is_new
    lk_rows = LK + b.to(tl.int64) * {{stride("LK", 0)}} + offs.to(tl.int64) * {{stride("LK", 1)}}
    scores = _tile_scores(
        lk_rows, col_ok, bk_head, COS, SIN, POS, mask_row, q_row0, q1, q2, q3, 0.0, 0.0, 0.0, b, offs,
        col_ok, head_ok, h * K_HEAD_COLS, h * K_HEAD_BLOCKS, K_RANK, 0, K_SCALE_BASE, K_MIN_BASE, RK_MAX, QK_SCALE,
        G,
        i1, i2, c1, c2, rot_ok, rest, rest_ok,
        {{stride("LK", 2)}}, {{stride("BK", 1)}}, {{stride("BK", 2)}},
        {{stride("COS", 0)}}, {{stride("COS", 1)}}, {{stride("SIN", 0)}}, {{stride("SIN", 1)}},
        {{stride("POS", 0)}}, {{stride("POS", 1)}}, M_ST, {{stride("Q", 1)}}, {{stride("Q", 3)}},
        G_PAD, HALF, REST, HAS_ROT, HAS_REST, ROPE, RK_PAD, BLOCK_N, BLOCK_R, K_BITS, K_QBLOCK, MASK_KIND,
        Q_EXACT, ZK_EXACT, BK_EXACT, F32_DOT, K_BLOCKWISE, False, K_ALIGN, 1, False, K_MX,
        PAIRED_TABLE, FMA_SCORES, G_LOOP, False, KEY_CODES, False, R_LOOP, {{K_META8 | default(False)}})
    idx_m = ((bh * S_Q + s) * G + gi)[:, None]
    idx_n = offs[None, :]
    mask = head_ok[:, None] & row_ok[None, :]
    {{store_output(("idx_m", "idx_n"), "scores", "mask", val_shape=("G_PAD", "BLOCK_N"))}}
''' + "".join(_helper_source(fn) for fn in _HELPERS)


@_api.SymbolicGridFn
def scores_grid(rows, n, meta, *, cdiv):
    """(tiles of BLOCK_N slots, sequences x KV heads, query tokens)."""
    return (cdiv(n, meta["BLOCK_N"]), meta["BH"], meta["S_Q"])


scores_template = _api.TritonTemplate(name=TEMPLATE_NAME, grid=scores_grid, source=_SOURCE)


def _scores_tensors_first(q, latent_k, basis_k_block, cos_table, sin_table, slot_pos, slots, attn_mask, *,
                          k_offsets, rope_form, rotary_dim, scale, kv_len, k_fmt, has_mask):
    """``ckvp::latent_scores`` with its tensors first (extern choices bind tensors positionally), flattened to
    the template's (B*Hkv*S*G, kv_len) layout."""
    out = torch.ops.ckvp.latent_scores(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos,
                                       rope_form, rotary_dim, slots, attn_mask if has_mask else None, scale, kv_len,
                                       k_fmt)
    return out.view(-1, kv_len)


scores_extern = _api.ExternKernelChoice(_scores_tensors_first, name=EXTERN_NAME, has_out_variant=False)


def template_refusal(q: Any, latent_k: Any, basis_k_block: Any, k_offsets: Sequence[int], rope_form: str,
                     attn_mask: Any, kv_len: Any, k_fmt: str) -> str | None:
    """Why the key-pass template cannot serve these IR inputs (then the op stays an extern call), or None."""
    if q.get_device() is None or q.get_device().type != "cuda":
        return f"device {q.get_device()}"
    sizes = _static_ints(*q.get_size(), *latent_k.get_size(), *basis_k_block.get_size(), kv_len)
    if sizes is None:
        return "symbolic sizes"
    b, h, s = sizes[:3]
    if b * h * s * sizes[-1] * 4 > lat.MAX_SCORES_BYTES:
        return (f"batch {b} x {h} heads x {s} query tokens over {sizes[-1]} slots (the scores would take more than "
                f"{lat.MAX_SCORES_BYTES} bytes)")
    if len(basis_k_block.get_size()) != 3:
        return "per-sequence (online) bases"
    if (basis_k_block.get_dtype() not in (torch.float16, torch.bfloat16, torch.float32)
            and not (lat.FP8_BASES_GPU_CHECKED and FP8_BASES_TEMPLATE_GPU_CHECKED)):
        return (f"{basis_k_block.get_dtype()} bases (the template is not yet checked with them on a GPU: "
                "FP8_BASES_TEMPLATE_GPU_CHECKED; the extern kernel reads them)")
    f = parse_latent_format(k_fmt)
    if f.mixed or f.ternary or (f.quantized and f.bits not in (8, 4, 2)):
        return f"latent format {k_fmt!r}"
    if f.meta_f8 and not (lat.F8_META_GPU_CHECKED and F8_META_TEMPLATE_GPU_CHECKED):
        return (f"latent format {k_fmt!r} (-f8 block metadata: the template is not yet checked with it on a GPU, "
                "F8_META_TEMPLATE_GPU_CHECKED)")
    ranks = {int(b) - int(a) for a, b in zip(k_offsets, k_offsets[1:])}
    if len(ranks) != 1:
        return f"heads of unequal rank {sorted(ranks)}"
    if q.get_dtype() not in (torch.float16, torch.bfloat16, torch.float32):
        return f"q dtype {q.get_dtype()}"
    if attn_mask is not None and attn_mask.get_dtype() != torch.bool and not attn_mask.get_dtype().is_floating_point:
        return f"attn_mask dtype {attn_mask.get_dtype()}"
    if rope_form not in lat._ROPE_CODE:
        return f"rope_form {rope_form!r}"
    strides, lk_sizes = _static_ints(*latent_k.get_stride()), _static_ints(*latent_k.get_size())
    if strides is None or lk_sizes is None or any(
            n > 1 and st != want for n, st, want in zip(lk_sizes, strides, _contiguous_strides(lk_sizes))):
        # the template's inputs are made contiguous: a full copy per call
        return ("latent_k is not contiguous (unit-major, or row-major with padded rows: kernels.latent_layout): "
                "the plain kernel reads it at its strides, the template would copy it")
    return None


def _autotuning() -> bool:
    cfg = _api.config
    return bool(cfg.max_autotune or cfg.max_autotune_gemm)


def plain_kernel_preferred(heads: int, kv_heads: int, rank_max: int, table_free: bool = False,
                           rank_v: int | None = None, autotuned: bool = False,
                           code_bits: int | None = None, meta_f8: bool = False) -> str | None:
    """Why the plain kernel's default config should run the whole call instead of the template's first config when
    nothing is autotuned, or None. ``heads`` query heads over ``kv_heads`` KV heads, ``rank_max`` the widest key
    rank. The template has neither the rotated / grouped key passes nor the one pass over chunks of KV heads (one
    query head per KV head) nor the one-pass form (GQA up to rank 128), all measured faster than its rebuild in
    those cases on the H200
    (:func:`~ckvp_compile.kernels.latent_attention_triton.default_config`). Judged for RoPE tables declared paired,
    as the store declares those of the HF models whose graphs prove it: the lowering cannot see the declaration,
    which is made at run time; with tables not proven paired the plain kernel rotates only up to rank 32, and at
    ranks 33-128 it is not measured against the template. At GQA rank 12 an autotuned template was 4% faster than
    the one-pass kernel (benchmarks/results/2026-12-01-checks-h200); without autotuning the template's first config
    is not measured there. ``table_free``: the call reads no RoPE table (rope form 'none': post-RoPE key bases, or
    no RoPE); where the default then runs a table-free one-pass kernel (word, lane, absorbed or chunk pass;
    on the H200 0.37-0.43x the chunk pass's time at 16:16 heads (lane pass), faster than the two passes; 32:8 rank 32
    0.230 ms against 0.501 for the one-pass form), the plain kernel runs it, autotuned or not: the template has no
    such form (``autotuned``: only that reason counts, the template competing otherwise). ``rank_v``: the widest
    value rank (None: as the keys). ``code_bits``: the widest code of the latents' uniform ``int`` formats (None: not
    known), as ``default_config`` takes it. ``meta_f8``: a latent has ``-f8`` block metadata, which the chunk,
    absorbed, lane, word and MMA passes do not read (the plain kernel then runs its per-head kernels): those passes
    do not count. The decision is made when the graph is compiled, from ``CKVP_DECODE_CONFIG`` as it is then.

    Raises:
        ValueError: ``CKVP_DECODE_CONFIG`` is set but not a JSON object of DecodeConfig fields.
    Source: the H200 decode steps of benchmarks/results/2026-12-01-rank-blocks-h200."""
    g = heads // max(kv_heads, 1)
    cfg = lat.default_config(g, lat._np2(rank_max), paired=True, rank=rank_max, rank_v=rank_v, table_free=table_free,
                             code_bits=code_bits)
    if meta_f8:  # those passes' layouts refuse -f8 latents
        cfg = dataclasses.replace(cfg, words=False, lanes=0, absorbed=0, head_chunks=0, mma=False)
    if table_free and (cfg.words or cfg.lanes or cfg.absorbed or cfg.head_chunks):
        kind = "word" if cfg.words else "lane" if cfg.lanes else "absorbed" if cfg.absorbed else "chunk"
        if cfg.mma:  # the MMA pass where the latents' layout allows it (CUDA, unit-major at 8 bits)
            kind = f"MMA pass where the latents' layout allows, else its {kind}"
        return f"no RoPE tables, {g} query head(s) per KV head at rank {rank_max}: the plain kernel's {kind} pass"
    if autotuned:
        return None
    if g == 1 and cfg.head_chunks:
        return f"one query head per KV head at rank {rank_max}: the plain kernel's one pass over chunks of KV heads"
    if g == 1 and (cfg.rotate_basis or cfg.head_group):
        return ("one query head per KV head: the plain kernel's rotated / grouped key pass (rotated up to rank 128 "
                "with RoPE tables proven paired, else 32)")
    if not cfg.two_pass:
        return f"{g} query heads per KV head at rank {rank_max}: the plain kernel's one-pass form"
    return None


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(sizes):
        strides.append(acc)
        acc *= n
    return list(reversed(strides))


def _mask_meta(attn_mask: Any, b: int, h: int, s: int, kv_len: int) -> dict[str, int]:
    """Kind (0 none, 1 bool, 2 additive) and the (B, H, S, kv_len) strides of a contiguous mask (0 on broadcast
    dims)."""
    if attn_mask is None:
        return dict(MASK_KIND=0, M_SB=0, M_SH=0, M_SS=0, M_ST=0)
    sizes = [int(x) for x in attn_mask.get_size()]
    sizes = [1] * (4 - len(sizes)) + sizes
    strides = _contiguous_strides(sizes)
    st = [0 if n == 1 else m for n, m in zip(sizes, strides)]
    return dict(MASK_KIND=1 if attn_mask.get_dtype() == torch.bool else 2, M_SB=st[0], M_SH=st[1], M_SS=st[2],
                M_ST=st[3])


def _index_inputs(kv_len: int) -> dict[int, Any]:
    """input_gen_fns for autotuning: slot positions (input 5) all 0 and the exact tokens' slots (input 6) 0..N-1,
    those past ``kv_len`` marked unused (-1): valid indices for the RoPE tables and the context (random integers
    would index out of bounds)."""

    def positions(node: Any) -> torch.Tensor:
        return torch.zeros([int(x) for x in node.get_size()], dtype=node.get_dtype(), device=node.get_device())

    def slots(node: Any) -> torch.Tensor:
        i = torch.arange(int(node.get_size()[0]), dtype=node.get_dtype(), device=node.get_device())
        return torch.where(i < kv_len, i, -1)

    return {5: positions, 6: slots}


def tuned_latent_scores(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form,
                        rotary_dim, slots, attn_mask, scale, kv_len, k_fmt="float"):
    """Lowering of ``ckvp::latent_scores``: template choices (CUDA) and the extern op; (B, Hkv, S, G, kv_len) fp32.

    Args: the op's arguments as Inductor IR (tensors) and Python values. Returns: an IR node. Falls back to the
    whole op as one extern call when :func:`template_refusal` gives a reason.
    """
    args = (q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form, rotary_dim, slots,
            attn_mask, scale, kv_len, k_fmt)
    reason = template_refusal(q, latent_k, basis_k_block, k_offsets, rope_form, attn_mask, kv_len, k_fmt)
    if reason is not None:
        logger.debug("ckvp_latent_scores: extern op (%s)", reason)
        return _api.fallback_handler(torch.ops.ckvp.latent_scores.default, add_to_fallback_set=False)(*args)
    has_mask = attn_mask is not None
    ins = [q, latent_k, basis_k_block, cos_table, sin_table, slot_pos, slots, attn_mask if has_mask else q]
    ins = [_api.require_contiguous(x) for x in _api.realize_inputs(*ins)]
    q_, lk, bk = ins[0], ins[1], ins[2]
    b, h, s, d = (int(x) for x in q_.get_size())
    hkv = int(bk.get_size()[0])
    g = h // hkv
    rk_max = int(bk.get_size()[2])
    kv_len = int(kv_len)
    kf = parse_latent_format(k_fmt)
    rank = int(k_offsets[1]) - int(k_offsets[0])
    if kf.quantized:
        cb = kf.code_bytes(k_offsets)[0]
        nb = -(-rank // kf.block)
        scale_base = sum(kf.code_bytes(k_offsets))
        min_base = scale_base + kf.meta_bytes // 2 * kf.num_blocks(k_offsets)  # fp16 scales, or -f8 spans (1 byte)
    else:
        cb, nb, scale_base, min_base = rank, 0, 0, 0
    rope = lat._ROPE_CODE[rope_form]
    rd = 0 if rope == 0 else int(rotary_dim)
    half = rd // 2
    rk_pad = lat._np2(rk_max)
    layout = _api.FixedLayout(q_.get_device(), torch.float32, [b * hkv * s * g, kv_len], [kv_len, 1])
    extern = scores_extern.bind(ins, layout, k_offsets=list(k_offsets), rope_form=rope_form, rotary_dim=rotary_dim,
                                scale=scale, kv_len=kv_len, k_fmt=k_fmt, has_mask=has_mask)
    autotune = _autotuning()
    meta_common = dict(
        HKV=hkv, G=g, G_PAD=lat._np2(g), G_LOOP=lat._np2(g, 1), S_Q=s, N_EXACT=int(ins[6].get_size()[0]),
        BH=b * hkv, KV_LEN=kv_len, D=d,
        HALF_VAL=half, HALF=lat._np2(half), REST=lat._np2(d - rd), HAS_ROT=rope != 0, HAS_REST=d > rd, ROPE=rope,
        RK_MAX=rk_max, RK_PAD=rk_pad, QK_SCALE=float(scale) * math.log2(math.e), K_RANK=rank,
        K_HEAD_COLS=cb, K_HEAD_BLOCKS=nb, K_SCALE_BASE=scale_base, K_MIN_BASE=min_base, K_BITS=kf.bits,
        K_QBLOCK=max(kf.block, 1), K_MX=kf.pow2, K_META8=kf.meta_f8, Q_EXACT=q_.get_dtype() == torch.bfloat16,
        ZK_EXACT=(not kf.quantized and lk.get_dtype() == torch.bfloat16) or kf.pow2,
        BK_EXACT=bk.get_dtype() in lat.BASIS_BF16_EXACT, F32_DOT=False, K_ALIGN=lat._align([cb]),
        PAIRED_TABLE=False, **_mask_meta(attn_mask, b, h, s, kv_len))
    choices: list[Any] = []
    basis_probe = torch.empty(0, dtype=bk.get_dtype())
    for c in TEMPLATE_CONFIGS if autotune else TEMPLATE_CONFIGS[:1]:
        key_codes = lat._key_codes_ok(lat.DecodeConfig(key_codes=c.key_codes), kf, basis_probe, rk_pad)
        block_r = kf.block if key_codes else min(c.block_r, rk_pad)
        scores_template.maybe_append_choice(
            choices, input_nodes=ins, layout=layout, num_stages=c.num_stages, num_warps=c.num_warps,
            BLOCK_N=c.block_n, BLOCK_R=block_r, FMA_SCORES=c.fma_scores and g <= 8,
            K_BLOCKWISE=lat._blockwise(kf, block_r), KEY_CODES=key_codes, R_LOOP=(c.r_loop and rk_pad > block_r
                    and (not kf.quantized or block_r % max(kf.block, 1) == 0)),  # as the plain launcher
            **meta_common)
    if autotune or not choices:
        choices.append(extern)
    node = _api.autotune_select_algorithm(TEMPLATE_NAME, choices, ins, layout, input_gen_fns=_index_inputs(kv_len))
    return _api.lowerings[aten.view.default](node, [b, hkv, s, g, kv_len])


def _code_bits(k_fmt: str, v_fmt: str) -> int | None:
    """The widest code of two quantized latent formats (None unless both are quantized)."""
    kf, vf = parse_latent_format(k_fmt), parse_latent_format(v_fmt)
    return max(kf.bits, vf.bits) if kf.quantized and vf.quantized else None


def tuned_latent_attention(q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table,
                           sin_table, slot_pos, rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale, kv_len,
                           k_fmt="float", v_fmt="float", page_table=None):
    """Lowering of ``ckvp::latent_attention``: on CUDA the tuned key pass then the extern value pass; elsewhere
    (or when the template refuses, or for paged latents: the op's own kernel walks the page table) the whole op as
    one extern call."""
    reason = "paged latents" if page_table is not None else template_refusal(
        q, latent_k, basis_k_block, k_offsets, rope_form, attn_mask, kv_len, k_fmt)
    if reason is None and (not _autotuning() or rope_form == "none"):
        reason = plain_kernel_preferred(int(q.get_size()[1]), int(basis_k_block.get_size()[0]),
                                        int(basis_k_block.get_size()[2]), table_free=rope_form == "none",
                                        rank_v=int(basis_v_block.get_size()[-1]), autotuned=_autotuning(),
                                        code_bits=_code_bits(k_fmt, v_fmt),
                                        meta_f8=any(parse_latent_format(x).meta_f8 for x in (k_fmt, v_fmt)))
    if reason is not None:
        logger.debug("ckvp::latent_attention: one extern call (%s)", reason)
        return _api.fallback_handler(torch.ops.ckvp.latent_attention.default, add_to_fallback_set=False)(
            q, latent_k, latent_v, basis_k_block, basis_v_block, k_offsets, v_offsets, cos_table, sin_table, slot_pos,
            rope_form, rotary_dim, new_k, new_v, slots, attn_mask, scale, kv_len, k_fmt, v_fmt, page_table)
    scores = tuned_latent_scores(q, latent_k, basis_k_block, k_offsets, cos_table, sin_table, slot_pos, rope_form,
                                 rotary_dim, slots, attn_mask, scale, kv_len, k_fmt)
    return _api.fallback_handler(torch.ops.ckvp.latent_attention_from_scores.default, add_to_fallback_set=False)(
        scores, q, latent_v, basis_v_block, v_offsets, new_k, new_v, slots, attn_mask, scale, kv_len, v_fmt)


_REGISTERED: list[str] = []


def register() -> list[str]:
    """Register the lowerings of ``ckvp::latent_scores`` and ``ckvp::latent_attention`` (idempotent); return the
    op names."""
    if not _REGISTERED:
        for op, fn in ((torch.ops.ckvp.latent_scores.default, tuned_latent_scores),
                       (torch.ops.ckvp.latent_attention.default, tuned_latent_attention)):
            _api.register_lowering(op, type_promotion_kind=None)(fn)
            _REGISTERED.append(str(op.name()))
    return list(_REGISTERED)
