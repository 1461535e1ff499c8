"""``ckvp-inspect``: compile a model directory with the ``ckvp`` backend and print what it found and rewrote.

    ckvp-inspect --model DIR [--html FILE] [--json FILE] [--options JSON] [--compiler aot_eager|eager|inductor]
                 [--no-decode] [--full] [--traceback] [--dtype float32|auto|bfloat16|float16]
                 [--kv-ratio R [--rank-allocation energy|uniform] [--group-size G] [--text FILE]
                  [--calibration-samples N] [--save-bases FILE] | --bases FILE] [--latent-format FMT]
                 [--latent-dtype bfloat16|float16|float32] [--max-cache-len N] [--prompt-len N]

With ``--kv-ratio`` (calibrate bases now, on a few random-token samples or windows of ``--text``) or ``--bases``
(a file from ``LatentBases.save``) the model runs with a ckvp latent KV cache, so the latent rewrite really
happens and the report shows the latent plan: groups, rank per KV head for K and V, formats and bytes per token.

Prints the text report on stdout; ``--html`` / ``--json`` also write the HTML page / the JSON data. Exit
status: 0 on success; 2 for a user mistake (bad arguments, a path that is not a loadable model, invalid
options, an unwritable output file), reported as one ``ckvp-inspect: error: ...`` line on stderr that names
the fix; 1 when compiling or running the model fails (one line, or the traceback with ``--traceback``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn, Sequence

PROG = "ckvp-inspect"
#: ``--latent-dtype`` choices (torch dtype names)
LATENT_DTYPES = ("bfloat16", "float16", "float32")


class _UsageError(Exception):
    """A user mistake on the command line: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (argparse prints the usage block too)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see {PROG} --help)")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``ckvp-inspect``."""
    p = _Parser(prog=PROG, description="Compile a Hugging Face MoE model with the ckvp backend and report the "
                "attention / KV-cache / MoE sites per layer, the plan, and the graph diffs of each rewrite.")
    p.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face model directory")
    p.add_argument("--html", metavar="FILE", help="also write the report as one self-contained HTML page")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--options", metavar="JSON", default="{}",
                   help="ckvp options as a JSON object, e.g. '{\"group_size\": 2}' (CKVPConfig fields)")
    p.add_argument("--compiler", choices=("aot_eager", "eager", "inductor"),
                   help="inner compiler (default: options' compiler, else aot_eager: records the post-grad "
                        "graph without code generation)")
    p.add_argument("--no-decode", action="store_true", help="compile the prefill only, no decode step")
    p.add_argument("--full", action="store_true",
                   help="print whole diffs (default: the first 40 lines each, each line cut to 240 characters)")
    p.add_argument("--max-cache-len", type=int, default=128, help="static cache length (default 128)")
    p.add_argument("--prompt-len", type=int, default=8, help="prefill length in tokens (default 8)")
    p.add_argument("--traceback", action="store_true", help="show the traceback when compiling fails")
    p.add_argument("--dtype", choices=("float32", "auto") + LATENT_DTYPES[:2], default="float32",
                   help="dtype the model is loaded in (default float32; 'auto': the checkpoint's own, e.g. bfloat16, "
                        "as it runs when deployed: the KV bytes and the experts' form can differ)")
    lat = p.add_argument_group("latent KV cache (inspect the CKVP rewrite itself)")
    src = lat.add_mutually_exclusive_group()
    src.add_argument("--kv-ratio", type=float, metavar="R",
                     help="calibrate latent bases now at this ratio (dense / latent elements per token, >= 1) and "
                          "inspect with a latent cache")
    src.add_argument("--bases", metavar="FILE", help="inspect with a latent cache of these bases (LatentBases.save)")
    lat.add_argument("--latent-format", metavar="FMT",
                     help="latent storage: auto (default: the bases' own formats, e.g. a planned bit plan, else "
                          "float), float, int8, int4 or int2, optionally /block (e.g. int4/64), or K,V (e.g. int8,int4)")
    lat.add_argument("--latent-dtype", choices=LATENT_DTYPES,
                     help="dtype of float latents and of the bases on the device (default: the model's, float32 "
                          "here); examples/generate.py keeps them in bfloat16, and the report then also counts "
                          "the dense cache in this dtype")
    lat.add_argument("--rank-allocation", choices=("energy", "uniform"),
                     help="with --kv-ratio: per-head ranks by retained energy (default) or one rank everywhere")
    lat.add_argument("--group-size", type=int, choices=(1, 2, 4, 8),
                     help="with --kv-ratio: layers per latent group G (default: the options' group_size, 4)")
    lat.add_argument("--text", metavar="FILE", help="with --kv-ratio: calibrate on windows of this text file "
                     "(default: random token ids, fine for inspecting, not for deploying)")
    lat.add_argument("--calibration-samples", type=int, metavar="N",
                     help="with --kv-ratio: calibration samples of 32 tokens (default 4)")
    lat.add_argument("--save-bases", metavar="FILE", help="with --kv-ratio: also save the calibrated bases")
    return p


def _latent(args: argparse.Namespace) -> Any:
    """Build the latent options from the command line, or None without --kv-ratio / --bases (raises _UsageError)."""
    from ..errors import CKVPConfigError
    from .latent import LatentInspectOptions

    calibration_only = [f for f, v in (("--rank-allocation", args.rank_allocation), ("--group-size", args.group_size),
                                       ("--text", args.text), ("--calibration-samples", args.calibration_samples),
                                       ("--save-bases", args.save_bases)) if v is not None]
    if args.kv_ratio is None and args.bases is None:
        given = calibration_only + [f for f, v in (("--latent-format", args.latent_format),
                                                   ("--latent-dtype", args.latent_dtype)) if v is not None]
        if given:
            raise _UsageError(f"{given[0]} needs a latent cache: add --kv-ratio R (calibrate now) or --bases FILE")
        return None
    if args.bases is not None and calibration_only:
        raise _UsageError(f"{calibration_only[0]} applies to calibration (--kv-ratio); the --bases file already fixes "
                          "the groups and ranks: drop it, or calibrate with --kv-ratio instead of --bases")
    if args.calibration_samples is not None and args.calibration_samples < 1:
        raise _UsageError(f"--calibration-samples must be >= 1, got {args.calibration_samples}")
    _check_writable(args.save_bases, "--save-bases")
    fields: dict[str, Any] = {"kv_ratio": args.kv_ratio, "bases": args.bases}
    if args.latent_format is not None:
        fields["latent_format"] = args.latent_format
    if args.latent_dtype is not None:
        import torch

        fields["latent_dtype"] = getattr(torch, args.latent_dtype)
    for name in ("rank_allocation", "group_size", "text"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.calibration_samples is not None:
        fields["num_samples"] = args.calibration_samples
    try:
        return LatentInspectOptions(**fields)
    except CKVPConfigError as exc:
        flag = {"kv_ratio": "--kv-ratio", "latent format": "--latent-format", "latent_format": "--latent-format",
                "calibration text": "--text", "no latent bases file": "--bases"}
        prefix = next((f for k, f in flag.items() if str(exc).startswith(k)), "")
        raise _UsageError(f"{prefix + ': ' if prefix else ''}{exc}") from None


def _options(args: argparse.Namespace) -> Any:
    """Parse and validate ``--options`` / ``--compiler`` into a CKVPConfig (raises _UsageError)."""
    from ..config import CKVPConfig
    from ..errors import CKVPConfigError, CKVPWarning

    try:
        opts = json.loads(args.options)
    except json.JSONDecodeError as exc:
        raise _UsageError(f"--options is not valid JSON ({exc.msg} at column {exc.colno}); pass a JSON object "
                          "such as '{\"group_size\": 2}'") from None
    if not isinstance(opts, dict):
        raise _UsageError(f"--options must be a JSON object of CKVPConfig fields, got {type(opts).__name__}")
    if args.compiler:
        opts["compiler"] = args.compiler
    if args.group_size is not None:  # the calibration's G is the plan's G too
        if opts.get("group_size", args.group_size) != args.group_size:
            raise _UsageError(f"--group-size {args.group_size} disagrees with --options group_size="
                              f"{opts['group_size']}; give one of them")
        opts["group_size"] = args.group_size
    opts.setdefault("compiler", "aot_eager")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CKVPWarning)
            config = CKVPConfig.from_options(opts)
    except CKVPConfigError as exc:
        raise _UsageError(f"invalid --options: {exc}") from None
    for w in caught:  # e.g. inductor patches ignored by the aot_eager inspection compiler: one line each
        if issubclass(w.category, CKVPWarning):
            print(f"{PROG}: warning: {_one_line(w.message)}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return config


def _check_writable(path: str | None, flag: str) -> None:
    """Refuse an output path that cannot be written, before anything is compiled (raises _UsageError)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        example = str(target / {"--html": "report.html", "--json": "report.json"}.get(flag, "bases.safetensors"))
        raise _UsageError(f"{flag} {path!r} is a directory; give a file name, e.g. {example!r}")
    parent = target.resolve().parent
    if not parent.exists():
        raise _UsageError(f"{flag} {path!r}: directory {str(parent)!r} does not exist; create it or pick another "
                          "path")
    if not parent.is_dir():
        raise _UsageError(f"{flag} {path!r}: {str(parent)!r} is not a directory; pick another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _UsageError(f"{flag} {path!r}: directory {str(parent)!r} is not writable; pick another path")
    if target.exists() and not os.access(target, os.W_OK):
        raise _UsageError(f"{flag} {path!r}: the file exists and is not writable; pick another path")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _quiet_transformers() -> None:
    """Silence transformers' weight-loading progress bar and info logs (stdout/stderr stay for the report)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - loading will say what is missing
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _check_distinct(args: argparse.Namespace) -> None:
    """Refuse two flags naming one file, where one of them is written (raises _UsageError): ``--html X --json X``
    kept only the JSON, and ``--html`` on the ``--bases`` file overwrote the bases."""
    outputs = [(f, v) for f, v in (("--html", args.html), ("--json", args.json), ("--save-bases", args.save_bases))
               if v is not None]
    inputs = [(f, v) for f, v in (("--bases", args.bases), ("--text", args.text)) if v is not None]
    seen: dict[Path, str] = {}
    for flag, path in outputs + inputs:
        key = Path(path).resolve()
        if key in seen:
            raise _UsageError(f"{seen[key]} and {flag} name the same file {path!r}; give each output its own path")
        seen[key] = flag


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    config = _options(args)
    if config.expert_offload:
        raise _UsageError("--options expert_offload: ckvp-inspect loads the model itself and cannot offload its "
                          "experts before compiling; inspect without it, or from Python on a model already offloaded "
                          "(ckvp_compile.offload_experts(model, resident=C), then ckvp_compile.inspect(model))")
    _check_writable(args.html, "--html")
    _check_writable(args.json, "--json")
    _check_distinct(args)
    latent = _latent(args)

    if args.prompt_len < 1:
        raise _UsageError(f"--prompt-len must be >= 1 (the prefill needs a token), got {args.prompt_len}")
    if args.prompt_len + (not args.no_decode) > args.max_cache_len:
        raise _UsageError(f"--prompt-len {args.prompt_len} (+1 decode step) does not fit --max-cache-len "
                          f"{args.max_cache_len}; raise --max-cache-len or lower --prompt-len (>= 1)")

    from ..errors import CKVPConfigError, CKVPModelLoadError
    from .capture import load_model_dir
    from .report import inspect_model

    _quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch/transformers noise; ckvp's own warnings are in the report
        try:
            model = load_model_dir(args.model, dtype=args.dtype)
        except CKVPModelLoadError as exc:
            raise _UsageError(str(exc)) from None
        try:
            report = inspect_model(model, options=config, decode=not args.no_decode,
                                   max_cache_len=args.max_cache_len, prompt_len=args.prompt_len, latent=latent)
        except CKVPConfigError as exc:  # bases of another model, an unreachable --kv-ratio, a short --text
            if latent is None:
                raise
            flag = "--bases" if args.bases is not None else "--kv-ratio"
            raise _UsageError(f"{flag}: {exc}") from None
    report.model = Path(args.model).resolve().name
    written = []
    try:  # the files first: a reader of stdout that stops early (| head) must not cost them
        if args.html:
            Path(args.html).write_text(report.to_html(), encoding="utf-8")
            written.append(args.html)
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_dict(), indent=1), encoding="utf-8")
            written.append(args.json)
        if args.save_bases and report.latent is not None:
            report.latent.bases.save(args.save_bases)
            written.append(args.save_bases)
    except OSError as exc:
        raise _UsageError(f"cannot write the report: {exc.strerror}: {exc.filename}") from None
    try:
        sys.stdout.write(report.to_text(full=args.full))
        for path in written:
            print(f"wrote {path}")
        sys.stdout.flush()
    except BrokenPipeError:  # stdout closed by its reader: the report is done, and the files are written
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckvp-inspect``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    Returns:
        The exit status: 0 success, 2 a user mistake (one line on stderr), 1 compiling or running failed.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except _UsageError as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if "--traceback" in argv:
            raise
        print(f"{PROG}: error: compiling or running the model failed: {type(exc).__name__}: {_one_line(exc)[:500]}"
              f" (rerun with --traceback for details)", file=sys.stderr)
        return 1
