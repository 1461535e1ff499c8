"""``ckvp-bench decode --shape fixture``: greedy generation with the ckvp latent cache against dense, on a trained
model (default: the bundled fixture, ``models/tiny-mixtral-pystdlib``; byte-level, vocabulary 256).

Text: the model directory's ``eval_text.txt`` (held out from training). Its first ``--calib-windows`` windows of 256
bytes calibrate the bases (second moments collected once, :func:`~ckvp_compile.latent.collect_kv_moments`); the
``--prompts`` prompts of ``--prompt-len`` bytes are taken from the rest of the text, evenly spaced and each moved
forward to end just after a line break, so no prompt was seen by calibration. Per prompt, ``--new-tokens`` tokens are generated greedily (a prefill call, then
one decode call per token feeding back the argmax, as ``generate(do_sample=False)`` does; ``--prompt-batch`` prompts
at a time, as the rows of one batch) once with a dense
``StaticCache`` (eager) and once per KV ratio with a
:class:`~ckvp_compile.runtime.hf_cache.CKVPStaticCache` and the model's forward compiled with ``backend="ckvp"``
(inner compiler ``--compiler``). The ratio is in bytes against a bf16 dense cache at ``--budget-len`` slots of one
sequence, every byte of the store counted (latents in ``--latent-format``, scales, slot positions, the bases in
bf16), as ``examples/generate.py --kv-ratio`` does. Two agreements are reported: ``agreement``, the share of
the generated positions whose token equals dense's (free-running: after a first divergence the two continuations
differ, so one early flip costs most of the 64 tokens), and ``forced_agreement``, the share of positions where the
ckvp model's next-token argmax, given the prompt and dense's own previous tokens, equals dense's token (no
compounding); ``--latent-format planned`` takes rank and bits per (group, KV
head, K/V) from :func:`~ckvp_compile.latent.planner.plan_for_byte_ratio` instead of one uniform format, built exactly
as ``ckvp-bench fidelity``'s 'planned' allocations are (:func:`~ckvp_compile.bench.fidelity.config_bases`): options
'+rot', '+fp8' and '+measured' (the planner's errors measured as the KL to dense on the first ``--measure-windows``
calibration windows, :func:`~ckvp_compile.bench.fidelity.measured_errors_cache`; never on a prompt), blocks of the
bit plan from ``--planned-format mix/<block>[v<value block>][-f8]``. Reported per ratio: the share of generated positions
whose token equals dense (``agreement``), the mean length of the agreeing prefix (and per prompt, ``prefixes``), the
greedy tokens (``generated``), and the measured byte ratios. ``--baseline kivi:BITS:GROUP:RESIDUAL`` adds rows of
KIVI (arXiv:2402.02750; :mod:`ckvp_compile.bench.kivi`): the eager model over a dense cache fake-quantized as KIVI
stores it, its ratios computed from its format; ``--ratios`` with no value runs only dense, the floor and these.
``--key-space post_rope`` fits the key bases to the keys as cached, after RoPE
(:attr:`~ckvp_compile.latent.LatentBases.key_space`; '+measured' then measures in that space too); the JSON meta
records it and the report labels the rows 'post-RoPE keys'.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CKVPConfigError

__all__ = ["FixtureRow", "default_model_dir", "run_fixture"]


@dataclass
class FixtureRow:
    """Greedy agreement with dense at one KV byte ratio (``ratio_requested`` None = the dense reference)."""

    ratio_requested: float | None
    latent_format: str | None
    agreement: float
    prefix_mean: float
    tokens: int
    prompts: int
    ratio_measured_at_budget: float | None = None
    ratio_state_only: float | None = None
    budget_len: int | None = None
    k_ranks: list | None = None
    v_ranks: list | None = None
    wall_s: float | None = None
    status: str = "ok"
    error: str | None = None
    forced_agreement: float | None = None
    prefixes: list | None = None  # per prompt: the agreeing prefix (tokens equal to dense's before the first flip)
    forced_per_prompt: list | None = None  # per prompt: the share of positions agreeing along dense's tokens
    generated: list | None = None  # per prompt: the greedy tokens (dense row: dense's)
    planned_format: str | None = None  # 'planned' formats: the bit plan's blocks, mix/<block>[v<value block>]
    k_formats: list | None = None  # per group: the stored latent format of K (a planned row's bit plan)
    v_formats: list | None = None
    baseline: str | None = None  # a --baseline row (kivi:BITS:GROUP:RESIDUAL): a dense cache fake-quantized
    ratio_format: float | None = None  # a baseline's ratio from its format alone (residual left out)


#: Tokens the bundled fixture was trained on, measured: its next-byte loss on held-out text falls to 0.64 nats at
#: positions 384-512 and jumps to 2.6 at 512-1024 and 3.8 past 1024 (benchmarks/results/2026-12-06-fixture-context-cpu,
#: position_loss.py); its config's max_position_embeddings (4096) is RoPE's table, not what it learned. Past this
#: length dense generation itself is out of distribution (at 1024-token prompts, dense with its KV cache rounded to
#: bf16 agrees with dense on 84% of 64 greedy tokens).
FIXTURE_TRAINED_CONTEXT = 512


def default_model_dir() -> Path:
    """The bundled fixture: ``models/tiny-mixtral-pystdlib`` in the repository, else ``/work/shared/models/...``."""
    from .decode import REPO

    for d in (REPO / "models" / "tiny-mixtral-pystdlib", Path("/work/shared/models/tiny-mixtral-pystdlib")):
        if (d / "config.json").is_file():
            return d
    raise CKVPConfigError("the fixture model was not found in models/tiny-mixtral-pystdlib; pass --model DIR")


def _decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, cache: Any,
            feed: torch.Tensor | None = None) -> list[list[int]]:
    """Prefill ``prompt`` (B, P) long into ``cache`` (reset first; a cache of batch B), then decode: each step feeds
    every row's previous argmax (greedy, ``feed=None``) or ``feed[:, i]`` ((B, >= new_tokens - 1) long:
    teacher-forced along another continuation). Returns the ``new_tokens`` argmax tokens of each row. The same two
    calls (prefill of P tokens, decode of one) serve dense and ckvp, so a compiled forward compiles exactly two
    graphs. The rows are independent sequences at the same positions (the prompts have one length)."""
    from ..latent.capture import hf_step_kwargs

    if hasattr(cache, "store"):
        cache.reset()
    start = prompt.shape[1]
    with torch.no_grad():
        tok = model(**hf_step_kwargs(model, prompt, cache, 0)).logits[:, -1].argmax(-1)
        out = [tok]
        for i in range(new_tokens - 1):
            ids = (tok if feed is None else feed[:, i]).reshape(-1, 1)
            tok = model(**hf_step_kwargs(model, ids, cache, start + i)).logits[:, -1].argmax(-1)
            out.append(tok)
    return torch.stack(out, 1).tolist()


def _decode_batched(model: torch.nn.Module, prompts: list, new_tokens: int, make_cache: Any, batch: int,
                    feeds: list | None = None) -> list[list[int]]:
    """:func:`_decode` over ``prompts`` ((1, P) long each, one length) in batches of ``batch`` rows.
    ``make_cache()`` gives the cache of ``batch`` rows for each batch (a fresh one, or one reused: a ckvp cache is
    reset by :func:`_decode`); the last batch is padded with copies of its last prompt (shapes kept static: no
    recompilation), whose tokens are dropped. ``feeds``: per prompt, the tokens to
    teacher-force (dense's). Returns per prompt its ``new_tokens`` argmax tokens."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        chunk = list(range(i, min(i + batch, len(prompts))))
        rows = chunk + [chunk[-1]] * (batch - len(chunk))
        feed = None if feeds is None else torch.tensor([feeds[j] for j in rows], device=prompts[0].device)
        got = _decode(model, torch.cat([prompts[j] for j in rows]), new_tokens, make_cache(), feed)
        out.extend(got[:len(chunk)])
    return out


#: latent_format label of the noise-floor row (dense decode, KV cache rounded to bf16).
BF16_KV_FLOOR = "dense, bf16 KV"


def bf16_kv_cache(model: torch.nn.Module, max_len: int) -> Any:
    """A dense ``StaticCache`` whose writes are rounded to bf16 (and stored in the model's dtype): what a bf16
    deployment of the same model keeps, the smallest perturbation of the KV cache there is."""
    from ..latent.capture import make_static_cache

    cache = make_static_cache(model, max_len)
    update = cache.update

    def rounded(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return update(key_states.to(torch.bfloat16).to(key_states.dtype),
                      value_states.to(torch.bfloat16).to(value_states.dtype), *args, **kwargs)

    cache.update = rounded
    return cache


def _bf16_kv_floor(model: torch.nn.Module, prompts: list, dense: list, new_tokens: int, max_len: int,
                   batch: int) -> FixtureRow:
    """Greedy agreement of the dense decode with itself over a bf16-rounded KV cache: the fixture's numerical noise
    floor (a near-tie that flips under bf16 rounding flips under any compression too)."""
    return _dense_cache_row(model, prompts, dense, new_tokens, lambda: bf16_kv_cache(model, max_len), batch,
                            BF16_KV_FLOOR)


def _dense_cache_row(model: torch.nn.Module, prompts: list, dense: list, new_tokens: int, make_cache: Any,
                     batch: int, label: str, **fields: Any) -> FixtureRow:
    """Free-running and along-dense agreement of the eager model over ``make_cache()`` (a fresh dense cache whose
    contents are perturbed, one per decode) with dense's tokens ``dense``; ``fields`` go to the row as they are."""
    t = time.perf_counter()
    got = _decode_batched(model, prompts, new_tokens, make_cache, batch)
    forced = _decode_batched(model, prompts, new_tokens, make_cache, batch, feeds=dense)
    n_tok = sum(map(len, dense))
    forced_each = [sum(x == y for x, y in zip(d, g)) for d, g in zip(dense, forced)]
    return FixtureRow(None, label, sum(x == y for d, g in zip(dense, got) for x, y in zip(d, g)) / n_tok,
                      sum(map(_prefix, dense, got)) / len(prompts), n_tok, len(prompts),
                      wall_s=round(time.perf_counter() - t, 2), forced_agreement=sum(forced_each) / n_tok,
                      prefixes=list(map(_prefix, dense, got)),
                      forced_per_prompt=[n / len(d) for n, d in zip(forced_each, dense)], generated=got, **fields)


def _kivi_row(model: torch.nn.Module, prompts: list, dense: list, new_tokens: int, max_len: int, spec: str,
              budget_len: int, batch: int) -> FixtureRow:
    """The KIVI baseline ``spec`` (``kivi:BITS:GROUP:RESIDUAL``, :mod:`ckvp_compile.bench.kivi`): agreement over a
    fake-quantized dense cache; its ratios computed from the format, at ``budget_len`` tokens
    (``ratio_measured_at_budget``, as the ckvp rows count theirs), at the run's ``max_len`` (``ratio_state_only``)
    and without the residual (``ratio_format``)."""
    from .kivi import KIVIConfig, kivi_cache, kivi_ratio

    cfg = KIVIConfig.parse(spec)
    c = model.config
    hkv, d = c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    ratios = dict(ratio_measured_at_budget=round(kivi_ratio(cfg, budget_len, hkv, d), 3),  # first: checks groups
                  ratio_state_only=round(kivi_ratio(cfg, max_len, hkv, d), 3), ratio_format=round(cfg.format_ratio, 3))
    return _dense_cache_row(model, prompts, dense, new_tokens, lambda: kivi_cache(model, max_len, cfg), batch,
                            f"{cfg.label} (baseline)", baseline=cfg.spec, budget_len=budget_len, **ratios)


def _line_end(text: bytes, start: int, length: int) -> int:
    """Move a prompt start forward so that the prompt ``text[start:start + length]`` ends just after a line break
    (the continuation starts a new line); unchanged when no line break follows within 4 kB."""
    nl = text.find(b"\n", start + length - 1, start + length + 4096)
    return start if nl < 0 or nl + 1 > len(text) else nl + 1 - length


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_fixture(args: argparse.Namespace) -> int:
    """Run the fixture agreement benchmark; returns 0 when every ratio ran."""
    from transformers import AutoModelForCausalLM

    from ..latent import collect_kv_moments
    from ..latent.capture import make_static_cache
    from ..latent.budget import bases_for_byte_ratio, dense_kv_bytes, store_bytes
    from ..runtime.hf_cache import CKVPStaticCache
    from .decode import environment
    from .decode_models import DecomposedMoments
    from .decode_report import render_markdown
    from .fidelity import FidelityConfig, config_bases, measured_errors_cache

    t0 = time.perf_counter()
    model_dir = args.model or default_model_dir()
    dtype, kv_dtype = getattr(torch, args.fixture_dtype), torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True).to(args.device).eval()
    if model.config.vocab_size != 256:
        raise CKVPConfigError(f"{model_dir}: --shape fixture needs a byte-level model (vocab 256), got "
                              f"{model.config.vocab_size}")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and args.prompt_len + args.new_tokens > positions:
        raise CKVPConfigError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} is past the model's "
                              f"{positions} positions (max_position_embeddings); lower them")
    if not args.model and args.prompt_len + args.new_tokens > FIXTURE_TRAINED_CONTEXT:  # (the bundled fixture)
        print(f"warning: --prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} is past the "
              f"{FIXTURE_TRAINED_CONTEXT} tokens the fixture was trained on (FIXTURE_TRAINED_CONTEXT): dense "
              "generation is out of distribution there, and agreement measures near-ties", file=sys.stderr,
              flush=True)
    text = (model_dir / "eval_text.txt").read_bytes()
    calib_end = args.calib_windows * 256
    rest = len(text) - calib_end - args.prompt_len
    if rest < args.prompts:
        raise CKVPConfigError(f"eval_text.txt is too short for {args.calib_windows} calibration windows and "
                              f"{args.prompts} prompts of {args.prompt_len} bytes")
    samples = [torch.tensor([list(text[i:i + 256])]) for i in range(0, calib_end, 256)]
    starts = [_line_end(text, calib_end + (rest * i) // args.prompts, args.prompt_len) for i in range(args.prompts)]
    prompts = [torch.tensor([list(text[s:s + args.prompt_len])], device=args.device) for s in starts]
    max_len = args.prompt_len + args.new_tokens
    batch = min(args.prompt_batch, len(prompts))
    dense = _decode_batched(model, prompts, args.new_tokens, lambda: make_static_cache(model, max_len), batch)
    n_tok = sum(map(len, dense))
    rows = [FixtureRow(None, None, 1.0, float(args.new_tokens), n_tok, len(prompts), forced_agreement=1.0,
                       prefixes=[args.new_tokens] * len(prompts), forced_per_prompt=[1.0] * len(prompts),
                       generated=dense)]
    if dtype != torch.bfloat16:  # the noise floor: dense with its KV cache rounded to bf16, as a bf16 deployment
        rows.append(_bf16_kv_floor(model, prompts, dense, args.new_tokens, max_len, batch))
    for spec in getattr(args, "baselines", None) or ():  # eager over a fake-quantized dense cache (bench.kivi)
        r = _kivi_row(model, prompts, dense, args.new_tokens, max_len, spec, args.budget_len, batch)
        rows.append(r)
        print(f"baseline {r.latent_format}: agreement {r.agreement:.1%} (along the dense tokens "
              f"{r.forced_agreement:.1%}), ratio {r.ratio_format}x from the format, {r.ratio_measured_at_budget}x at "
              f"{args.budget_len} tokens, {r.ratio_state_only}x at {max_len}", flush=True)
    if args.ratios:  # the ckvp rows' calibration (a baseline-only run, --ratios with no value, skips it)
        moments = collect_kv_moments(model, samples, group_size=args.group_size, progress=False,
                                     key_space=getattr(args, "key_space", "pre_rope"))
        decomposed = DecomposedMoments.from_moments(moments)  # one eigh; the byte-ratio fit builds bases ~40 times
    fmt, *opts = args.latent_format.split("+")  # planned[+rot][+fp8][+measured]: ckvp-bench fidelity's allocations
    basis_dtype = torch.float8_e4m3fn if "fp8" in opts else kv_dtype
    # '+measured': the planner's block errors measured as KL to dense on the first --measure-windows calibration
    # windows (never a prompt), once, shared by every ratio (bench.fidelity.measured_errors_cache)
    measure_windows = (min(args.measure_windows or 8, args.calib_windows) if "measured" in opts and args.ratios
                       else None)
    measure_errors = None
    if measure_windows:
        measure_errors = measured_errors_cache(model, torch.cat(samples[:measure_windows]).to(args.device))
    planned_label = None
    for ratio in args.ratios:
        t = time.perf_counter()
        eager_forward = model.forward
        try:
            if fmt == "planned":  # rank and bits per (group, head, K/V) from the planner, stored as 'auto'
                cfg = FidelityConfig(args.group_size, ratio, args.latent_format, args.planned_format)
                built = config_bases(cfg, moments, batch_size=1, window=args.budget_len, latent_dtype=kv_dtype,
                                     dense_dtype=kv_dtype, measure_errors=measure_errors,
                                     recent_window=args.recent_window)
                if built is None:
                    raise CKVPConfigError(f"the planner cannot meet {ratio:g}x at --budget-len {args.budget_len} "
                                          f"(see the log above)")
                bases, _, planned_label, basis_dtype, _ = built
            else:
                bases = bases_for_byte_ratio(decomposed, ratio, fmt, batch_size=1, max_cache_len=args.budget_len,
                                             dense_dtype=kv_dtype, latent_dtype=kv_dtype,
                                             recent_window=args.recent_window,
                                             rank_block=getattr(args, "rank_block", None),
                                             max_key_rank=getattr(args, "max_key_rank", None))
            store_fmt = "auto" if fmt == "planned" else fmt
            def make(rows: int) -> Any:
                return CKVPStaticCache(model.config, bases, max_cache_len=max_len, max_batch_size=rows,
                                       device=args.device, dtype=dtype, latent_format=store_fmt, latent_dtype=kv_dtype,
                                       basis_dtype=basis_dtype, recent_window=args.recent_window,
                                       latent_layout=getattr(args, "latent_layout", "row-major"))

            cache = make(batch)
            torch._dynamo.reset()
            model.forward = torch.compile(model.forward, backend="ckvp", options={"compiler": args.compiler})
            got = _decode_batched(model, prompts, args.new_tokens, lambda: cache, batch)
            same = sum(x == y for d, g in zip(dense, got) for x, y in zip(d, g))
            forced = _decode_batched(model, prompts, args.new_tokens, lambda: cache, batch, feeds=dense)
            forced_each = [sum(x == y for x, y in zip(d, g)) for d, g in zip(dense, forced)]
            same_forced = sum(forced_each)
            # the state-only ratio of ONE sequence, as before --prompt-batch (the window's ring slots are shared
            # by a batch's rows, so a batch's store holds slightly fewer bytes a sequence)
            nb = (cache if batch == 1 else make(1)).store.nbytes()
            budget = (dense_kv_bytes(bases, 1, args.budget_len, kv_dtype)
                      / store_bytes(bases, 1, args.budget_len, store_fmt, store_fmt, kv_dtype,
                                    basis_dtype=basis_dtype, recent_window=args.recent_window))
            rows.append(FixtureRow(ratio, args.latent_format, same / n_tok, sum(map(_prefix, dense, got)) / len(prompts), n_tok,
                                   len(prompts), round(budget, 3), round(nb.ratio_vs(kv_dtype, with_bases=False), 3),
                                   args.budget_len, [list(r) for r in bases.k_ranks], [list(r) for r in bases.v_ranks],
                                   round(time.perf_counter() - t, 2), forced_agreement=same_forced / n_tok,
                                   prefixes=list(map(_prefix, dense, got)),
                                   forced_per_prompt=[n / len(d) for n, d in zip(forced_each, dense)], generated=got,
                                   planned_format=planned_label, k_formats=list(bases.k_formats),
                                   v_formats=list(bases.v_formats)))
        except Exception as e:  # noqa: BLE001  recorded; the other ratios still run
            rows.append(FixtureRow(ratio, args.latent_format, float("nan"), float("nan"), n_tok, len(prompts), status="error",
                                   error=f"{type(e).__name__}: {str(e)[:600]}"))
        finally:
            model.forward = eager_forward
            torch._dynamo.reset()
        r = rows[-1]
        print(f"ratio {ratio:g} ({fmt}): {r.status} agreement {r.agreement:.1%} (along the dense tokens "
              f"{(r.forced_agreement or float('nan')):.1%}), mean agreeing prefix "
              f"{r.prefix_mean:.1f}/{args.new_tokens}, measured {r.ratio_measured_at_budget}x at {args.budget_len} "
              f"slots (state only {r.ratio_state_only}x)" + (f" {r.error}" if r.error else ""), flush=True)
    env = environment(args.device, args.argv)
    env.update(model=str(model_dir.name), fixture_dtype=args.fixture_dtype, compiler=args.compiler,
               group_size=args.group_size, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
               calib_windows=args.calib_windows, prompt_starts=starts, prompt_batch=batch, recent_window=args.recent_window,
               measure_windows=measure_windows, planned_format=args.planned_format if fmt == "planned" else None,
               max_key_rank=getattr(args, "max_key_rank", None), key_space=getattr(args, "key_space", "pre_rope"),
               baselines=getattr(args, "baselines", None),
               wall_s=round(time.perf_counter() - t0, 1))
    data = {"kind": "fixture", "meta": env, "rows": [asdict(r) for r in rows]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(render_markdown([data], plots=None))
    return 0 if all(r.status == "ok" for r in rows) else 1
