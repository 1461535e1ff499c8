"""GPU smoke of the 2026-12-06 calibration / bases-file changes: calibrate a CUDA model (bf16) in training mode
(modes restored, same bases as eval), save, load for its fp16 copy (fingerprint samples on the GPU), the backend's
first-call weight check, a cache of the wrong dtype (the CKVPConfigError itself), and a compiled latent-cache
generation (CKVPStaticCache)."""
import json
import sys
import tempfile

import torch

from ckvp_compile import LatentBases, calibrate
from ckvp_compile.runtime.hf_cache import CKVPStaticCache
from ckvp_compile.testing import build_hf_moe

out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
dev = "cuda"
model = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, router_jitter_noise=0.5,
                     attention_dropout=0.5).to(dev, torch.bfloat16)
samples = [torch.randint(0, 256, (1, 32), device=dev, generator=torch.Generator(dev).manual_seed(i)) for i in range(2)]
want = calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False)
model.train()
got = calibrate(model, samples, group_size=2, kv_ratio=2.0, progress=False)
out["train_mode_restored"] = model.training
out["train_equals_eval"] = all(torch.equal(a, b) for a, b in zip(got.k_basis + got.v_basis, want.k_basis + want.v_basis))
model.eval()
path = tempfile.mktemp(suffix=".safetensors")
want.save(path)
fp16 = build_hf_moe("mixtral", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, router_jitter_noise=0.5,
                    attention_dropout=0.5).to(dev, torch.float16)
LatentBases.load(path, model=fp16)
want.check_weight(fp16.model.layers[0].self_attn.k_proj.weight, "model.layers.0.self_attn.k_proj.weight")
out["fp16_copy_accepted"] = True
ids = samples[0][:, :16]
model.forward = torch.compile(model.forward, backend="ckvp")
try:  # a cache of the default dtype (fp32) for a bf16 model: the CKVPConfigError naming the fix (torch 2.11 too)
    model.generate(ids, past_key_values=CKVPStaticCache(model.config, want, max_cache_len=48, max_batch_size=1, device=dev),
                   max_new_tokens=4, do_sample=False, disable_compile=True)
    out["dtype_misfit_error"] = None
except Exception as e:  # noqa: BLE001
    out["dtype_misfit_error"] = f"{type(e).__name__}: {str(e)[:160]}"
print(json.dumps(out), flush=True)
cache = CKVPStaticCache(model.config, want, max_cache_len=48, max_batch_size=1, dtype=torch.bfloat16,
                        device=dev)
gen = model.generate(ids, past_key_values=cache, max_new_tokens=16, do_sample=False, disable_compile=True)
out["generated_tokens"] = int(gen.shape[1] - ids.shape[1])
print(json.dumps(out))
ok = (out["train_mode_restored"] and out["train_equals_eval"] and out["generated_tokens"] == 16
      and str(out["dtype_misfit_error"]).startswith("CKVPConfigError"))
sys.exit(0 if ok else 1)
