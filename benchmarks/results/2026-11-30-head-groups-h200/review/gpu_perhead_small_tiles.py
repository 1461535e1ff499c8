# Run ON A CUDA GPU (no TRITON_INTERPRET), from the repo root:  python /tmp/review/gpu_perhead_small_tiles.py
# Pre-existing (not the grouped kernel): the PER-HEAD key pass (_latent_attention_split_kernel, PHASE 1; head_group=0)
# gives wrong scores on the H200 (Triton 3.6, torch 2.11) for int4/int2 key latents whenever block_n < 64 or
# num_warps < 4; DecodeConfig() and the default config are right. The grouped kernel is right at all of them.
import sys, torch, dataclasses as dc
sys.path[:0] = ['tests/kernels', '.']
import test_latent_attention_triton as T
from ckvp_compile.kernels import latent_attention_triton as L
from ckvp_compile.kernels import reference as R
B = dict(seed=1, b=2, hkv=5, ratio=1, d=32, kv_len=37, s=1, extra=3, rk=[12, 5, 9, 16, 3], rv=[4, 9, 7, 7, 7],
         kfmt="int4/32", vfmt="int8/32", rope="rotate_half", rd=16, mask=None, mask_shape="bhsk", mask_p=0.3,
         dtype=torch.float32, pos_dtype=torch.int32)
a = [t.cuda() if torch.is_tensor(t) else t for t in T._inputs(B)]
q, lk, lv, bk, bv, ko, vo, cos, sin, sp, rf, rd, nk, nv, sl, mk, sc_, kv, kf, vf = a
sw = R.latent_scores_ref(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc_, kv, kf); fin = torch.isfinite(sw)
for nm, c in (("DecodeConfig()", L.DecodeConfig()), ("num_warps=1", L.DecodeConfig(num_warps=1)),
              ("block_n=16", L.DecodeConfig(block_n=16)),
              ("block_n=16 head_group=2 (grouped)", L.DecodeConfig(block_n=16, head_group=2, target_programs=1))):
    s = L.latent_scores_triton(q, lk, bk, ko, cos, sin, sp, rf, rd, sl, mk, sc_, kv, kf, config=c)
    print(nm, "ran head_group", L._LAST_LAUNCH.get("head_group"), "max abs score err",
          f"{float((s[fin] - sw[fin]).abs().max()):.2e}")
