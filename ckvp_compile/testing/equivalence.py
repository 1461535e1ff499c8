"""Property-based equivalence tests of the ``ckvp`` backend on your own model: compiled against eager.

    from ckvp_compile.testing import check_equivalence

    check_equivalence(model, options={"enable_expert_gemm": True}).raise_if_failed()   # dense cache: exact
    check_equivalence(model, bases=bases, max_logit_error=1.0).raise_if_failed()        # latent cache: a bound

Hypothesis (MacIver et al., JOSS 2019) draws the batch size, the prompt length, the prompt's tokens and the number
of decode steps. Each example runs a static-cache prefill and greedy decode steps twice: on the eager model over a
dense cache (the reference), and on ``torch.compile(model, backend="ckvp", options=...)`` over a dense cache, or,
with ``bases``, over a :class:`~ckvp_compile.runtime.hf_cache.CKVPStaticCache` of those bases. The compiled run is
fed the reference's greedy tokens (teacher forcing), so one near-tie cannot make the two runs part. Every call's
logits are compared: with a dense cache the backend promises the eager result, so within the logits dtype's
tolerance (``torch.testing.assert_close``'s defaults, or ``rtol`` / ``atol``); with a latent cache, a lossy
compression, within ``max_logit_error`` (absolute, in logits). A 16-bit model's eager run is itself rounded: where a
router's top-k sits on a near-tie, one bfloat16 rounding can pick another expert and move a token's logits by
0.5 or more (benchmarks/results/2026-12-07-gpu: the fixture in bf16, eager against float32, plain Inductor and ckvp
alike). So with a dense cache, a 16-bit call outside the tolerance is judged once more against the model upcast to
float32 on the same tokens (``float32_referee``): it passes when each token's compiled logits are within the
tolerance of the eager ones or of the float32 model's, and the report counts it (a failure names whether the
inner compiler alone, without ckvp, computes the failing token the same way). A failing example (a mismatch, or
an error raised by the compiled run) is shrunk by Hypothesis to the smallest one it finds (fewest sequences,
shortest prompt, fewest steps) and reported with its prompt.

Every example compiles afresh (``torch._dynamo.reset()`` first): a latent cache's compiled graphs are specific to
its batch size, and a check must not reuse what an earlier example compiled. The model itself is not changed
(``model.forward`` stays as it was; the compiled module wraps it). Hypothesis' example database is off and its
other storage (a cache of constants read from source files) goes to a temporary directory unless
``HYPOTHESIS_STORAGE_DIRECTORY`` names one, so nothing is written to the working directory; the run is
reproducible for a given ``seed``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from ..errors import CKVPConfigError, CKVPError
from ..latent.bases import plain_module
from ..latent.calibrate import _eval_mode
from ..latent.capture import kept_module_setup, make_static_cache, uncompiled_forward
from .decoding import prefill_decode_logits

__all__ = ["EquivalenceError", "EquivalenceFailure", "EquivalenceReport", "check_equivalence"]


class EquivalenceError(CKVPError, AssertionError):
    """:meth:`EquivalenceReport.raise_if_failed` on a failed check; the message is the report's text."""


@dataclass(frozen=True)
class EquivalenceFailure:
    """The smallest failing example Hypothesis found.

    Attributes:
        batch: B, sequences in the batch. prompt: the (B, S) prompt token ids, as lists. decode_steps: N.
        call: which call failed: 0 the prefill, i >= 1 the i-th decode step (None: the run raised before any
            logits came back).
        max_abs_error: the largest |compiled - eager| logit difference of that call (nan when it raised).
        message: what failed: the tolerance exceeded, or the exception's type and text.
    """

    batch: int
    prompt: list[list[int]]
    decode_steps: int
    call: int | None
    max_abs_error: float
    message: str


@dataclass
class EquivalenceReport:
    """The outcome of :func:`check_equivalence`.

    Attributes:
        passed: every example agreed.
        examples: examples run (Hypothesis' generation and shrinking phases together).
        max_abs_error: the largest |compiled - eager| logit difference over the agreeing examples.
        mode: ``"dense cache (exact)"`` or ``"latent cache (bound 0.5)"``-style text.
        failure: the smallest failing example, or None.
        settings: the arguments of the check.
        refereed: calls outside the tolerance of the 16-bit eager logits whose every token was within it of the
            eager logits or of the float32 model's (``float32_referee``); their differences are left out of
            ``max_abs_error``. refereed_max_abs_error: the largest |compiled - float32| logit difference of those.
    """

    passed: bool
    examples: int
    max_abs_error: float
    mode: str
    failure: EquivalenceFailure | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    refereed: int = 0
    refereed_max_abs_error: float = 0.0

    def to_text(self) -> str:
        """Return the report as a few lines of text."""
        head = (f"ckvp equivalence check, {self.mode}: {'passed' if self.passed else 'FAILED'} "
                f"({self.examples} example{'' if self.examples == 1 else 's'}; largest |logit difference| of the "
                f"agreeing ones {self.max_abs_error:.3g})")
        if self.refereed:
            head += (f"; {self.refereed} call{'' if self.refereed == 1 else 's'} outside the tolerance of the 16-bit "
                     "eager logits matched the float32 model at the tokens where eager did not (the eager run's own "
                     f"rounding, e.g. a router near-tie; largest |compiled - float32| "
                     f"{self.refereed_max_abs_error:.3g})")
        if self.failure is None:
            return head
        f = self.failure
        where = "before any logits" if f.call is None else ("at the prefill" if f.call == 0 else
                                                            f"at decode step {f.call}")
        return (f"{head}\nsmallest failing example: batch {f.batch}, prompt length {len(f.prompt[0])}, "
                f"{f.decode_steps} decode step(s), {where}: {f.message}\nprompt token ids: {f.prompt}")

    __str__ = to_text

    def raise_if_failed(self) -> "EquivalenceReport":
        """Return the report when it passed; raise :class:`EquivalenceError` (its text) otherwise."""
        if not self.passed:
            raise EquivalenceError(self.to_text())
        return self


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise CKVPConfigError("check_equivalence: the model's config has no vocab_size; pass vocab_size=")
    return vocab


def _first_param(model: torch.nn.Module) -> torch.Tensor:
    p = next(iter(model.parameters()), None)
    if p is None:
        raise CKVPConfigError("check_equivalence: the model has no parameters; pass a causal LM")
    return p


@contextlib.contextmanager
def _hypothesis_home_in_a_temporary_directory() -> Iterator[None]:
    """Point Hypothesis' storage (its cache of constants found in the source of the modules it runs: a
    ``.hypothesis/constants`` folder, written even with the example database off) at a temporary directory for the
    duration, unless the user chose one (``HYPOTHESIS_STORAGE_DIRECTORY``); restore the previous setting after.
    Hypothesis' storage home is one global of ``hypothesis.configuration``, read on each access."""
    from hypothesis import configuration

    if os.getenv("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    before = getattr(configuration, "__hypothesis_home_directory", None)
    with tempfile.TemporaryDirectory(prefix="ckvp-hypothesis-") as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(before)


def _check_args(model: Any, options: Any, bases: Any, max_examples: Any, max_batch: Any, max_prompt_len: Any,
                max_decode_steps: Any, max_logit_error: Any, rtol: Any = None, atol: Any = None,
                latent_format: Any = "auto", shrink: Any = True, float32_referee: Any = True) -> None:
    if not isinstance(model, torch.nn.Module):
        raise CKVPConfigError(f"check_equivalence: model must be a torch.nn.Module (a Hugging Face causal LM or a "
                              f"gpt-fast-style model), got {type(model).__name__}")
    if options is not None and not isinstance(options, Mapping):
        raise CKVPConfigError(f"check_equivalence: options must be a dict of ckvp options, got "
                              f"{type(options).__name__}")
    for name, value, low in (("max_examples", max_examples, 1), ("max_batch", max_batch, 1),
                             ("max_prompt_len", max_prompt_len, 1), ("max_decode_steps", max_decode_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CKVPConfigError(f"check_equivalence: {name} must be an int >= {low}, got {value!r}")
    for name, value in (("shrink", shrink), ("float32_referee", float32_referee)):
        if not isinstance(value, bool):
            raise CKVPConfigError(f"check_equivalence: {name} must be True or False, got {value!r}")
    for name, value in (("rtol", rtol), ("atol", atol)):
        # numbers.Real: numpy scalars too (np.finfo(np.float32).eps is an np.float32), as assert_close takes them
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not 0 <= value < math.inf):
            raise CKVPConfigError(f"check_equivalence: {name} must be None or a finite number >= 0, got {value!r}")
    if (rtol is None) != (atol is None):
        raise CKVPConfigError("check_equivalence: give both rtol and atol (as torch.testing.assert_close takes them), "
                              "or neither for the logits dtype's default tolerance")
    if bases is not None and rtol is not None:
        raise CKVPConfigError("check_equivalence: rtol / atol are the dense cache's tolerance; with bases (a lossy "
                              "latent cache) the check is bounded by max_logit_error alone: drop rtol / atol")
    if bases is None and not (isinstance(latent_format, str) and latent_format == "auto"):
        raise CKVPConfigError(f"check_equivalence: latent_format={latent_format!r} is the latent cache's format, but "
                              "no bases were given (a dense cache); pass bases= to check a latent cache")
    if bases is None and max_logit_error is not None:
        raise CKVPConfigError("check_equivalence: max_logit_error bounds a latent cache's error; with a dense cache "
                              "(bases=None) the check is exact: pass rtol / atol to loosen it instead")
    if bases is not None:
        bound = max_logit_error
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < math.inf:
            raise CKVPConfigError(f"check_equivalence: with bases (a lossy latent cache) pass max_logit_error, a "
                                  f"finite bound > 0 on |compiled - eager| logits, got {max_logit_error!r}")
        if hasattr(model, "setup_caches"):
            raise CKVPConfigError("check_equivalence: a gpt-fast-style model's latent cache (use_latent_cache) is not "
                                  "checked here yet; check its dense cache (bases=None), or a Hugging Face model's "
                                  "latent cache")
        from ..latent.bases import LatentBases

        if not isinstance(bases, LatentBases):
            raise CKVPConfigError(f"check_equivalence: bases must be the LatentBases of this model, got "
                                  f"{type(bases).__name__}. Fix: bases = ckvp_compile.calibrate(model, samples, ...), "
                                  "or LatentBases.load(path, model=model) for a saved file")
        if bases.model_fingerprint.get("k_weight_sha256"):  # bases built by hand (no hash) are checked by shape only
            bases.check_model(model, source="check_equivalence: the bases")


def _check_latent_cache(model: torch.nn.Module, bases: Any, latent_format: Any, length: int, device: torch.device,
                        dtype: torch.dtype) -> None:
    """Build one latent cache of ``bases`` for ``model`` (batch 1, ``length`` slots), as every example will: bases of
    another layer count or KV shape, or a bad ``latent_format``, raise :class:`CKVPConfigError` here, before any
    example, instead of failing every example (and being reported as a mismatch of the compiled model)."""
    from ..runtime.hf_cache import CKVPStaticCache

    try:
        CKVPStaticCache(model.config, bases, max_cache_len=length, max_batch_size=1, device=device, dtype=dtype,
                        latent_format=latent_format)
    except CKVPConfigError as exc:
        raise CKVPConfigError(f"check_equivalence: no latent cache of these bases fits the model: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise CKVPConfigError(f"check_equivalence: no latent cache of these bases fits the model "
                              f"(latent_format={latent_format!r}): {type(exc).__name__}: {exc}") from None


def check_equivalence(model: torch.nn.Module, *, options: Mapping[str, Any] | None = None, bases: Any = None,
                      latent_format: str | tuple[str, str] = "auto", max_logit_error: float | None = None,
                      rtol: float | None = None, atol: float | None = None, max_examples: int = 8,
                      max_batch: int = 2, max_prompt_len: int = 16, max_decode_steps: int = 4, seed: int = 0,
                      shrink: bool = True, float32_referee: bool = True) -> EquivalenceReport:
    """Check, on random prompts, that ``torch.compile(model, backend="ckvp", options=...)`` computes what the eager
    model computes (see the module docstring).

    Args:
        model: a Hugging Face causal LM (``transformers`` 5.x, static cache) or a gpt-fast-style model (with
            ``setup_caches(max_batch_size, max_seq_length)``; dense cache only), on its device. It runs in eval
            mode (no dropout or router jitter, which would differ between the eager and compiled runs); each
            module's mode is put back after. A model already compiled (``torch.compile(model)``, or its
            ``forward`` replaced by ``torch.compile(model.forward, ...)`` as in the README's recipe) is checked
            through its own uncompiled forward on both sides (else the eager reference would run the compiled
            forward and the check would compare it with itself); the compiled forward is put back after.
        options: ckvp options for the compiled model (``CKVPConfig`` keys), e.g. ``{"enable_expert_gemm": True}``
            or ``{"compiler": "aot_eager"}`` (fast to compile; runs the rewritten graph op by op).
        bases: :class:`~ckvp_compile.latent.LatentBases` of this model: the compiled run uses a latent cache of
            them (``CKVPStaticCache(..., latent_format=latent_format)``, the model's dtype); needs max_logit_error.
            Checked before the first example: bases with a fingerprint must match the model
            (:meth:`~ckvp_compile.latent.LatentBases.check_model`), and one latent cache of them is built.
        latent_format: the latent cache's storage format (as for ``CKVPStaticCache``); only with ``bases``.
        max_logit_error: with ``bases``: the largest allowed |compiled - eager| logit difference at any call.
        rtol, atol: with a dense cache: the tolerance, both or neither (finite, >= 0). Default:
            ``torch.testing.assert_close``'s for float32
            (rtol 1.3e-6, atol 1e-5); for a 16-bit model, its rtol (1.6e-2 bfloat16, 1e-3 float16) and an atol of
            2 units in the last place of the call's largest finite eager logit (``2 * finfo.eps * max|logits|``): a
            reordered sum, as any compiler's fused or grouped GEMM, moves 16-bit logits by about one such unit
            (0.04 measured on the fixture in bf16 with the expert rewrite on an H100,
            benchmarks/results/2026-12-06-session-gpu).
        max_examples: examples Hypothesis generates (each compiles once; shrinking a failure runs more).
        max_batch (B), max_prompt_len (S), max_decode_steps (N): upper bounds of the drawn sizes (B, S >= 1,
            N >= 0); the caches hold S + N tokens.
        seed: Hypothesis' seed (the same seed draws the same examples).
        shrink: shrink a failure to a smaller example (off: report the first failure found); a bool.
        float32_referee (a bool): with a dense cache and a 16-bit model: a call outside the tolerance passes when each
            token's compiled logits (a row of V, all finite) are within the tolerance of the eager ones or of the
            logits of the model upcast to float32 (a deep copy, made at the first such call: twice the model's
            memory) run eagerly on the same tokens, with atol from the largest finite logit of the reference: the
            compiled run took the float32 model's branch where 16-bit eager rounding took another. A referee that
            cannot run (no memory, a 16-bit-only kernel) is named in the failure. A call it does not excuse fails,
            and the failure says whether ``torch.compile`` with the inner compiler alone (no ckvp; compiled only
            then) gives the failing token's logits too: the inner compiler's own arithmetic, not ckvp's rewrites.
            Off: the 16-bit eager logits are the only reference.
    Returns:
        An :class:`EquivalenceReport`; ``.raise_if_failed()`` raises :class:`EquivalenceError` on a failure. Each
        example calls ``torch._dynamo.reset()``, so other compiled functions of the process recompile on their next
        call; a gpt-fast-style model gets its cache setup back (the same cache buffers and ``max_batch_size``;
        caches of a drawn shape equal to theirs hold what the examples wrote).
    Raises:
        CKVPConfigError: a bad argument (the message names the fix): among them bases that are not
            :class:`~ckvp_compile.latent.LatentBases`, bases of another model or shape, an unknown latent_format,
            rtol / atol or latent_format without their cache kind, a non-bool shrink / float32_referee;
            ImportError: Hypothesis is not installed
            (``pip install hypothesis``, or the ``test`` extra).
    Source: property-based testing with Hypothesis (MacIver et al., "Hypothesis: A new approach to property-based
        testing", JOSS 2019); the same check as this package's own tests (tests/e2e/test_equivalence.py).
    """
    model = plain_module(model)  # torch.compile(model): check the module it wraps
    _check_args(model, options, bases, max_examples, max_batch, max_prompt_len, max_decode_steps, max_logit_error,
                rtol, atol, latent_format, shrink, float32_referee)
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis import strategies as st
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError("check_equivalence needs Hypothesis: pip install hypothesis (or ckvp-compile[test])") from exc
    from ..config import CKVPConfig

    opts = dict(options or {})
    CKVPConfig.from_options(opts)  # a bad option: CKVPConfigError now, not inside the first compile
    vocab = _vocab_size(model)
    param = _first_param(model)
    device, dtype = param.device, param.dtype
    gpt_fast = hasattr(model, "setup_caches")
    if bases is not None:
        _check_latent_cache(model, bases, latent_format, max_prompt_len + max_decode_steps, device, dtype)
    mode = ("dense cache (exact)" if bases is None else f"latent cache (bound {max_logit_error:g})")
    state: dict[str, Any] = {"examples": 0, "max_err": 0.0, "failure": None, "refereed": 0, "refereed_err": 0.0,
                             "fp32": None}
    refereed = float32_referee and bases is None and dtype in (torch.bfloat16, torch.float16)
    dense_16bit_inner_check = refereed and CKVPConfig.from_options(opts).compiler != "eager"

    def new_cache(b: int, length: int, latent: bool) -> Any:
        if gpt_fast:  # prefill_decode_logits calls its setup_caches
            return None
        if latent:
            from ..runtime.hf_cache import CKVPStaticCache

            return CKVPStaticCache(model.config, bases, max_cache_len=length, max_batch_size=b, device=device,
                                   dtype=dtype, latent_format=latent_format)
        return make_static_cache(model, length)

    def tolerance(want: torch.Tensor) -> dict[str, float]:
        if rtol is not None or atol is not None:
            return {"rtol": rtol or 0.0, "atol": atol or 0.0}
        if dtype in (torch.bfloat16, torch.float16):  # atol from the largest finite logit (an overflow is no scale)
            finite = want[torch.isfinite(want)]
            top = finite.abs().max().item() if finite.numel() else 0.0
            return {"rtol": 1.6e-2 if dtype == torch.bfloat16 else 1e-3, "atol": 2 * torch.finfo(dtype).eps * top}
        return {}

    def close(got: torch.Tensor, want: torch.Tensor) -> str | None:
        if bases is not None:
            err = (got - want).abs().max().item()
            return None if err <= max_logit_error else (
                f"|logit difference| {err:.4g} > max_logit_error {max_logit_error:g}")
        try:
            torch.testing.assert_close(got.to(dtype), want.to(dtype), **tolerance(want))
        except AssertionError as exc:
            return " ".join(str(exc).split())
        return None

    def float32_logits(ids: torch.Tensor, n: int, fed: list[torch.Tensor]) -> list[torch.Tensor]:
        if state["fp32"] is None:
            state["fp32"] = copy.deepcopy(model).float()
        ref = state["fp32"]
        length = ids.shape[1] + n
        cache = None if gpt_fast else make_static_cache(ref, length)
        return [x.float() for x in prefill_decode_logits(ref, ids, n, max_cache_len=length, tokens=fed, cache=cache)]

    def within(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """(..., V) -> (...): each token's logits within the tolerance of ``want``'s (finite ones only; called for
        16-bit models, whose :func:`tolerance` always gives rtol and atol)."""
        kw = tolerance(want)
        ok = (got - want).abs() <= kw["atol"] + kw["rtol"] * want.abs()
        return (ok & torch.isfinite(got) & torch.isfinite(want)).all(-1)

    def referee(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor) -> tuple[str, tuple[int, ...]] | None:
        """None when every token's compiled logits are within the tolerance of the eager ones or of the float32
        model's (the eager run's own rounding, e.g. another expert picked at a router near-tie), else why not and
        the first such token (batch row, position)."""
        bad = ~(within(got, want) | within(got, ref))
        if not bad.any():
            return None
        where = tuple(bad.nonzero()[0].tolist())
        err = (got[where] - ref[where]).abs()
        err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
        v = int(err.argmax())
        return (f"float32 referee: token {where} is outside the tolerance of both the eager and the float32 logits; "
                f"at logit {v}: compiled {got[where][v].item():.4g}, eager {want[where][v].item():.4g}, float32 "
                f"{ref[where][v].item():.4g}"), where

    def inner_compiler_note(ids: torch.Tensor, n: int, fed: list[torch.Tensor], call: int, got: torch.Tensor,
                            where: tuple[int, ...]) -> str:
        """After the referee fails: the same token under torch.compile with the inner compiler alone (no ckvp), to
        tell the inner compiler's own 16-bit arithmetic (e.g. a router near-tie its fused kernels resolve the other
        way) from ckvp's rewrites. A diagnostic only: the check still fails."""
        name = CKVPConfig.from_options(opts).compiler
        try:
            torch._dynamo.reset()
            plain = torch.compile(model, backend=name)
            alone = prefill_decode_logits(model, ids, n, compile_fn=lambda m: plain, max_cache_len=ids.shape[1] + n,
                                          tokens=fed, cache=new_cache(ids.shape[0], ids.shape[1] + n,
                                                                      latent=False))[call].float()
        except Exception as exc:  # noqa: BLE001 - a diagnostic: say why it is missing, never raise
            return f"; torch.compile(backend={name!r}) without ckvp could not run: {type(exc).__name__}"
        finally:
            torch._dynamo.reset()
        same = bool(within(got[where], alone[where]))
        return (f"; torch.compile(backend={name!r}) without ckvp gives, at that token, logits "
                + ("within the tolerance of ckvp's: the difference is the inner compiler's own arithmetic, not "
                   "ckvp's rewrites" + (" (check with options={'compiler': 'aot_eager'})" if name == "inductor" else "")
                   if same else
                   f"{(got[where] - alone[where]).abs().max().item():.4g} away from ckvp's"))

    @given(data=st.data(), b=st.integers(1, max_batch), s=st.integers(1, max_prompt_len),
           n=st.integers(0, max_decode_steps))
    def example(data: Any, b: int, s: int, n: int) -> None:
        state["examples"] += 1
        prompt = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=s, max_size=s), min_size=b,
                                    max_size=b), label="prompt")
        ids = torch.tensor(prompt, dtype=torch.long, device=device)
        want = [x.float() for x in prefill_decode_logits(model, ids, n, max_cache_len=s + n,
                                                         cache=new_cache(b, s + n, latent=False))]
        fed = [w[:, -1].argmax(dim=-1, keepdim=True) for w in want[:-1]]
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ckvp", options=opts)
        failure = None
        try:
            got = [x.float() for x in prefill_decode_logits(
                model, ids, n, compile_fn=lambda m: compiled, max_cache_len=s + n, tokens=fed,
                cache=new_cache(b, s + n, latent=bases is not None))]
        except Exception as exc:  # noqa: BLE001 - any error of the compiled run is the finding
            failure = EquivalenceFailure(b, prompt, n, None, float("nan"), f"{type(exc).__name__}: {exc}")
        else:
            errs = [(g - w).abs().max().item() for g, w in zip(got, want)]
            ref32: list[torch.Tensor] | None = None
            excused = []
            for call, (g, w) in enumerate(zip(got, want)):
                why = close(g, w)
                if why is not None and refereed:
                    note = None
                    try:
                        ref32 = ref32 if ref32 is not None else float32_logits(ids, n, fed)
                    except Exception as exc:  # noqa: BLE001 - no memory, a 16-bit-only kernel: report, don't crash
                        state["fp32"] = None
                        text = " ".join(str(exc).split())[:200]
                        note = f"the float32 referee could not run: {type(exc).__name__}: {text}"
                    else:
                        verdict = referee(g, w, ref32[call])
                        if verdict is None:
                            excused.append(call)
                            continue
                        note, where = verdict
                        if dense_16bit_inner_check:
                            note += inner_compiler_note(ids, n, fed, call, g, where)
                    why += f" ({note})"
                if why is not None:
                    failure = EquivalenceFailure(b, prompt, n, call, errs[call], why)
                    break
            if failure is None:
                state["refereed"] += len(excused)
                if excused:
                    state["refereed_err"] = max([state["refereed_err"]] + [(got[c] - ref32[c]).abs().max().item()
                                                                           for c in excused])
                kept = [e for call, e in enumerate(errs) if call not in excused]
                state["max_err"] = max([state["max_err"]] + kept)
        finally:
            torch._dynamo.reset()
        if failure is not None:
            state["failure"] = failure  # Hypothesis replays the smallest failing example last
            raise AssertionError(failure.message)

    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    run = settings(max_examples=max_examples, deadline=None, database=None, phases=phases, print_blob=False,
                   verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck))(hypothesis_seed(seed)(example))
    kept = kept_module_setup(model) if gpt_fast else contextlib.nullcontext()  # its setup_caches, put back after
    try:  # eval mode: dropout / router jitter in training mode would differ between the runs, not the compiler
        with kept, _eval_mode(model), uncompiled_forward(model), _hypothesis_home_in_a_temporary_directory():
            run()
    except Exception:  # the failure (AssertionError, or Hypothesis' Flaky* when a replay passed) is in state
        if state["failure"] is None:
            raise
    finally:
        state["fp32"] = None  # the float32 copy, if one was made
    failure = state["failure"]
    return EquivalenceReport(passed=failure is None, examples=state["examples"], max_abs_error=state["max_err"],
                             mode=mode, failure=failure,
                             settings=dict(options=opts, max_examples=max_examples, max_batch=max_batch,
                                           max_prompt_len=max_prompt_len, max_decode_steps=max_decode_steps,
                                           seed=seed, latent_format=latent_format, float32_referee=float32_referee),
                             refereed=state["refereed"], refereed_max_abs_error=state["refereed_err"])
