"""The main job: compile a real MoE model with ``backend="ckvp"`` and generate text.

    python examples/generate.py                      # the trained fixture model, CPU, Inductor, both rewrites
    python examples/generate.py --dense              # HF's dense static cache: the compiled run must match eager
    python examples/generate.py --compiler aot_eager --max-new-tokens 32
    python examples/generate.py --model /path/to/hf-moe-checkpoint --device cuda --dtype bfloat16

Loads a Hugging Face MoE checkpoint (default: the tiny Mixtral trained on Python source that ships in
``models/``) and generates greedily, once eagerly over a dense static KV cache and once with the model's forward
compiled by the ckvp backend with both rewrites on: a CKVP latent KV cache calibrated for ``--kv-ratio`` (4x fewer
KV bytes than bf16 by default) and the routed experts as grouped GEMMs (``--expert-gemm off`` keeps the model's
own dispatch). It prints what the backend rewrote per layer, the compiled model's text (and the eager one where they
differ), their token agreement, the KV cache's bytes per token, and timings: eager and steady-state compiled times
are the best of two runs after a warm-up (CPU timings are indicative only; speed is measured on the GPU, see
BENCHMARKS.md). With ``--dense`` nothing is lossy, and the exit status is 1 unless the compiled text equals eager's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "tiny-mixtral-pystdlib"
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line: every option value is checked here, before any model work (a bad
    value exits with status 2 and a message naming the valid values)."""
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model directory (default: the fixture)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="inner compiler after the ckvp rewrites (inductor: the real thing; aot_eager: fast compile)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-ratio", type=float, default=None,
                   help="compress the KV cache into the CKVP latent at this byte ratio against a 16-bit dense "
                        "cache (calibrates on the model's eval_text.txt first; default 4)")
    p.add_argument("--dense", action="store_true",
                   help="keep HF's dense static cache (no calibration, no KV rewrite): the compiled run must then "
                        "match eager token for token")
    p.add_argument("--expert-gemm", default="on", choices=["on", "off"],
                   help="rewrite the routed experts into grouped GEMMs (ckvp option enable_expert_gemm; default on)")
    p.add_argument("--group-size", type=int, default=4, choices=[1, 2, 4, 8],
                   help="layers sharing one latent (with --kv-ratio; default 4)")
    p.add_argument("--latent-format", default="int8",
                   help="latent storage with --kv-ratio: float, int8 (default), int4, int2, optionally /block and -f8 "
                        "(e4m3 block scales), or mxint8 / mxint4 / tern (ckvp_compile.kernels.latent_format); "
                        "--kv-ratio then counts bytes (latents, scales, slot positions, bases) against a 16-bit "
                        "dense cache")
    p.add_argument("--budget-len", type=int, default=4096,
                   help="with --kv-ratio: the cache length (one sequence) the byte ratio is met at, bases counted "
                        "(default 4096; the bases are shared by all sequences and contexts, like weights)")
    p.add_argument("--recent-window", type=int, default=0,
                   help="with --kv-ratio: keep the last N tokens' keys and values exact beside the latent, their "
                        "bytes counted in the ratio (default 0: none)")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the option values argparse's types and choices do not (``p.error``: exit status 2), so that a bad
    value fails in a second, not after the eager runs and the calibration."""
    import math

    from ckvp_compile.kernels.latent_format import parse_latent_format

    try:
        torch.device(args.device)
    except (RuntimeError, ValueError):
        p.error(f"--device {args.device!r} is not a device: use cpu, cuda or cuda:N")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt:
        p.error("--prompt must not be empty: give at least one character of text to continue")
    if args.dense and args.kv_ratio is not None:
        p.error("--dense keeps a dense cache and --kv-ratio asks for a latent one: give one of them")
    if args.kv_ratio is None and not args.dense:
        args.kv_ratio = 4.0
    if args.kv_ratio is not None and not (math.isfinite(args.kv_ratio) and args.kv_ratio >= 1):
        p.error(f"--kv-ratio must be a finite number >= 1 (dense bytes / latent bytes, e.g. 4), got {args.kv_ratio}")
    try:
        parse_latent_format(args.latent_format)
    except ValueError as e:
        p.error(f"--latent-format: {e}")
    if args.budget_len < 1:
        p.error(f"--budget-len must be >= 1 (a cache length in tokens, e.g. 4096), got {args.budget_len}")
    if args.recent_window < 0:
        p.error(f"--recent-window must be >= 0 (tokens kept exact; 0: none), got {args.recent_window}")
    if args.kv_ratio is not None and args.recent_window >= args.budget_len:
        p.error(f"--recent-window {args.recent_window} must be below --budget-len {args.budget_len}: the window's "
                "exact tokens come out of the byte budget counted at that length")


def usage_error(msg: str) -> NoReturn:
    """Exit with status 2, as argparse does for a bad option (status 1 is a dense run that did not match eager)."""
    print(f"generate.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def load(model_dir: Path, device: str, dtype: torch.dtype):
    """Load model and an encode/decode pair; byte-level when the vocabulary has 256 entries."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").is_file():
        usage_error(f"{model_dir} is not a Hugging Face model directory (no config.json); pass --model DIR")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device).eval()
    if model.config.vocab_size == 256:
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731  token id == byte value
        decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    else:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        encode, decode = tok.encode, tok.decode
    return model, encode, decode


def latent_cache(model, model_dir: Path, encode, args, max_cache_len: int):
    """Calibrate CKVP bases on text beside the model (not the prompt) and build a latent cache: returns
    ``(cache, bases)``."""
    from ckvp_compile.latent import calibrate
    from ckvp_compile.runtime.hf_cache import CKVPStaticCache

    text_file = model_dir / "eval_text.txt"
    if not text_file.is_file():
        usage_error(f"--kv-ratio calibrates on the text beside the model, and {text_file} does not exist; put some "
                    "text the model should handle there (4096 tokens or more), or pass --dense to keep HF's dense "
                    "cache (no calibration)")
    ids = encode(text_file.read_text(encoding="utf-8", errors="replace")[-16 * 256:])
    samples = [torch.tensor([ids[i:i + 256]]) for i in range(0, len(ids) - 255, 256)][:16]
    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    kv_dtype = torch.bfloat16 if dtype == torch.float32 else dtype  # the dense cache a deployment would hold
    bases = calibrate(model, samples, group_size=args.group_size, kv_ratio=args.kv_ratio, progress=False,
                      latent_format=args.latent_format, cache_len=args.budget_len, dense_dtype=kv_dtype,
                      latent_dtype=kv_dtype, recent_window=args.recent_window)
    print(f"calibrated CKVP bases on {len(samples)} x 256 tokens in {time.perf_counter() - start:.1f} s")
    print(bases.summary())
    cache = CKVPStaticCache(model.config, bases, max_cache_len=max_cache_len, max_batch_size=1,
                            device=args.device, dtype=dtype, latent_format=args.latent_format, latent_dtype=kv_dtype,
                            recent_window=args.recent_window)
    return cache, bases


def _generate_takes_cache() -> bool:
    """Whether this transformers' generate() takes the cache as ``cache=`` (5.24 and later)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 24)


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, cache=None) -> tuple[list[int], float]:
    """Greedy generation with a static (or the given latent) cache; returns new token ids and wall seconds."""
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if cache is not None:
        cache.reset()
        # transformers 5.24 renamed generate()'s past_key_values to cache (the old name warns); 5.17 has the old one
        kwargs = {"cache" if _generate_takes_cache() else "past_key_values": cache}
    else:
        kwargs = {"cache_implementation": "static"}
    with torch.no_grad():
        out = model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            disable_compile=True,  # we compile forward ourselves; stop generate() auto-compiling with Inductor
            pad_token_id=0,
            **kwargs,
        )
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start


def _bases_path(args) -> Path:
    """Where a run saves its bases for the printed ckvp-inspect command: one file per model and latent settings in
    the temporary directory, replaced by each run with those settings (runs do not pile up files)."""
    key = repr((str(Path(args.model).resolve()), args.kv_ratio, args.latent_format, args.group_size, args.budget_len,
                args.recent_window, args.dtype))
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"ckvp_generate_bases_{digest}.safetensors"


def rewrite_summary(recorder) -> str:
    """One line per rewrite kind: the layers the backend rewrote and those it kept, with the reasons, over every
    graph it compiled (the prefill and the decode step are separate graphs; a layer counts as rewritten when some
    graph rewrote it)."""
    rewritten: dict[str, set[int]] = {"attention": set(), "moe": set()}
    kept: dict[str, dict[int, str]] = {"attention": {}, "moe": {}}
    for g in recorder.graphs:
        if g.fell_back:
            continue
        for d in g.plan.decisions:
            if d.rewrite:
                rewritten[d.kind].add(d.layer)
            else:
                kept[d.kind].setdefault(d.layer, d.reason)
    lines = ["--- what the backend did " + "-" * 46]
    for kind, what in (("attention", "latent KV attention (ckvp::latent_attention)"),
                       ("moe", "routed experts as grouped GEMMs (ckvp::moe_experts)")):
        done = sorted(rewritten[kind])
        lines.append(f"{what}: {'layers ' + _ranges(done) if done else 'no layer'}")
        reasons = {r for layer, r in kept[kind].items() if layer not in rewritten[kind]}
        # the backend names its Python option; here the flag that sets it
        flag = "pass --expert-gemm on (enable_expert_gemm=True)"
        lines += [f"  kept: {r}".replace("set enable_expert_gemm=True", flag) for r in sorted(reasons)]
    lines += [f"graph {g.index} compiled unchanged: {g.fell_back}" for g in recorder.graphs if g.fell_back]
    return "\n".join(lines)


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    out, start = [], None
    for i, layer in enumerate(layers):
        start = layer if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}-{layer}" if layer != start else f"{layer}")
            start = None
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the example; returns the exit status (1 when a dense-cache compiled run does not match eager)."""
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        usage_error("--device cuda, but this torch has no CUDA device; use --device cpu")
    dtype = getattr(torch, args.dtype)
    model, encode, decode = load(args.model, args.device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model.name} ({type(model).__name__}, {n_params / 1e6:.1f} M parameters, "
          f"{model.config.num_hidden_layers} layers) on {args.device}, {args.dtype}")
    input_ids = torch.tensor([encode(args.prompt)], device=args.device)

    generate(model, input_ids, args.max_new_tokens)  # warm-up: first-call setup is not generation speed
    (eager_ids, eager_s), (eager_ids_2, eager_s_2) = (generate(model, input_ids, args.max_new_tokens)
                                                      for _ in range(2))
    eager_s = min(eager_s, eager_s_2)

    cache = None
    if args.kv_ratio is not None:
        cache, bases = latent_cache(model, args.model, encode, args, input_ids.shape[1] + args.max_new_tokens)
    from ckvp_compile import CKVPBackend, CKVPConfig, CompileRecorder

    recorder = CompileRecorder()
    backend = CKVPBackend(CKVPConfig.from_options({"compiler": args.compiler,
                                                   "enable_expert_gemm": args.expert_gemm == "on"}),
                          recorder=recorder)
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend=backend)
    ckvp_ids, first_s = generate(model, input_ids, args.max_new_tokens, cache)  # includes compilation
    (ckvp_ids_2, steady_s), (ckvp_ids_3, steady_s_3) = (generate(model, input_ids, args.max_new_tokens, cache)
                                                        for _ in range(2))
    steady_s = min(steady_s, steady_s_3)
    model.forward = eager_forward

    agree = sum(a == b for a, b in zip(eager_ids, ckvp_ids))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dense_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    print("\n" + rewrite_summary(recorder))
    print("--- prompt " + "-" * 60 + f"\n{args.prompt}")
    print("--- ckvp generation " + "-" * 51 + f"\n{decode(ckvp_ids)}")
    if ckvp_ids != eager_ids:
        print("--- eager generation " + "-" * 50 + f"\n{decode(eager_ids)}")
    print("-" * 71)
    repeat = ckvp_ids == ckvp_ids_2 == ckvp_ids_3 and eager_ids == eager_ids_2
    if cache is None:
        print(f"token-for-token match with eager: {'yes' if eager_ids == ckvp_ids else 'NO'} "
              f"({agree}/{len(eager_ids)} tokens agree; repeated runs identical: {repeat})")
        print(f"KV cache: dense {str(dtype).removeprefix('torch.')}, {dense_per_token} bytes per token (--dense: "
              "HF's static cache stays dense; the KV "
              "rewrite needs a latent cache, which the default --kv-ratio 4 builds)")
    else:
        print(f"agreement with eager generation over a dense cache: {agree}/{len(eager_ids)} tokens "
              f"({100 * agree / len(eager_ids):.0f}%; the latent cache is lossy, so greedy generation may drift "
              f"once one token differs; repeated runs identical: {repeat})")
    if cache is not None:
        nb, store = cache.store.nbytes(), cache.store
        kv_dtype = store.latent_dtype
        dense_kv = dense_per_token // torch.empty((), dtype=dtype).element_size() * kv_dtype.itemsize
        per_token = nb.per_sequence_state / store.max_cache_len
        print(f"KV cache: CKVP latent ({store.k_format}), {per_token:.0f} bytes per token per sequence (dense "
              f"{str(kv_dtype).removeprefix('torch.')} {dense_kv}): {nb.ratio_vs(kv_dtype, with_bases=False):.2f}x "
              f"smaller per token without the bases; the bases ({nb.bases} bytes) and RoPE tables "
              f"({nb.rope_tables} bytes) are per model, like weights: the ranks were fitted for {args.kv_ratio:g}x "
              f"with them counted at {args.budget_len} slots (--budget-len); counted at this run's "
              f"{store.max_cache_len} slots they make the ratio {nb.ratio_vs(kv_dtype):.2f}x"
              + (", below 1: a cache this short is larger than dense" if nb.ratio_vs(kv_dtype) < 1 else ""))
    n = len(ckvp_ids)
    print(f"eager:              {eager_s:7.2f} s  ({n / eager_s:7.1f} tokens/s; best of 2 after a warm-up)")
    print(f"ckvp first call:    {first_s:7.2f} s  (includes compilation with compiler={args.compiler!r})")
    print(f"ckvp steady state:  {steady_s:7.2f} s  ({n / steady_s:7.1f} tokens/s; best of 2)")
    # the same bases (saved) and the same rewrites, so that the report shows this run's ranks, formats and sites
    inspect = f"ckvp-inspect --model {args.model}"
    if cache is not None:
        saved = _bases_path(args)
        fd, name = tempfile.mkstemp(prefix=saved.stem + "_", suffix=".tmp", dir=saved.parent)
        os.close(fd)
        try:
            bases.save(Path(name))
            os.replace(name, saved)  # atomic: a concurrent run with the same settings never reads half a file
        finally:
            if os.path.exists(name):
                os.remove(name)
        inspect += (f" --bases {saved} --latent-dtype {str(store.latent_dtype).removeprefix('torch.')}"
                    f" --max-cache-len {store.max_cache_len}")
    if args.expert_gemm == "on":
        inspect += """ --options '{"enable_expert_gemm": true}'"""
    print(f"what the backend found, rewrote or kept per layer, and why: {inspect}")
    if args.device == "cpu":
        print("(CPU timings are indicative only: a busy machine moves them, and on CPU the latent cache's ops run "
              "their PyTorch references; speed is measured on the GPU, see BENCHMARKS.md)")
    if cache is None:  # lossless: must match; a compressed cache is judged by its agreement
        return 0 if eager_ids == ckvp_ids else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
