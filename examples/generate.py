"""The main job: compile a real MoE model with ``backend="ckvp"`` and generate text.

    python examples/generate.py                      # the trained fixture model, CPU, Inductor
    python examples/generate.py --compiler aot_eager --max-new-tokens 32
    python examples/generate.py --model /path/to/hf-moe-checkpoint --device cuda --dtype bfloat16

Loads a Hugging Face MoE checkpoint (default: the tiny Mixtral trained on Python source that ships in
``models/``), generates greedily with a static KV cache, once eagerly and once with the model's forward
compiled by the ckvp backend, and prints both texts, whether they agree token for token, and timings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "tiny-mixtral-pystdlib"
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF model directory (default: the fixture)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="inner compiler after the ckvp rewrites (inductor: the real thing; aot_eager: fast compile)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    return p.parse_args(argv)


def load(model_dir: Path, device: str, dtype: torch.dtype):
    """Load model and an encode/decode pair; byte-level when the vocabulary has 256 entries."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").is_file():
        sys.exit(f"generate.py: error: {model_dir} is not a Hugging Face model directory (no config.json); "
                 "pass --model DIR")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device).eval()
    if model.config.vocab_size == 256:
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731  token id == byte value
        decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    else:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        encode, decode = tok.encode, tok.decode
    return model, encode, decode


def generate(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy generation with a static cache; returns the new token ids and the wall time in seconds."""
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            cache_implementation="static",
            disable_compile=True,  # we compile forward ourselves; stop generate() auto-compiling with Inductor
            pad_token_id=0,
        )
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model, encode, decode = load(args.model, args.device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model.name} ({type(model).__name__}, {n_params / 1e6:.1f} M parameters, "
          f"{model.config.num_hidden_layers} layers) on {args.device}, {args.dtype}")
    input_ids = torch.tensor([encode(args.prompt)], device=args.device)

    eager_ids, eager_s = generate(model, input_ids, args.max_new_tokens)

    eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend="ckvp", options={"compiler": args.compiler})
    ckvp_ids, first_s = generate(model, input_ids, args.max_new_tokens)  # includes compilation
    ckvp_ids_2, steady_s = generate(model, input_ids, args.max_new_tokens)
    model.forward = eager_forward

    agree = sum(a == b for a, b in zip(eager_ids, ckvp_ids))
    print("\n--- prompt " + "-" * 60 + f"\n{args.prompt}")
    print("--- ckvp generation " + "-" * 51 + f"\n{decode(ckvp_ids)}")
    print("-" * 71)
    print(f"token-for-token match with eager: {'yes' if eager_ids == ckvp_ids else 'NO'} "
          f"({agree}/{len(eager_ids)} tokens agree; second compiled run identical: {ckvp_ids == ckvp_ids_2})")
    n = len(ckvp_ids)
    print(f"eager:              {eager_s:7.2f} s  ({n / eager_s:7.1f} tokens/s)")
    print(f"ckvp first call:    {first_s:7.2f} s  (includes compilation with compiler={args.compiler!r})")
    print(f"ckvp steady state:  {steady_s:7.2f} s  ({n / steady_s:7.1f} tokens/s)")
    return 0 if eager_ids == ckvp_ids else 1


if __name__ == "__main__":
    sys.exit(main())
