"""Dense top-1 minus top-2 logit margins along dense's greedy continuations of the 16 fixture prompts (the prompts and
tokens of ../2026-12-02-fixture-groups-cpu): how close to a tie the positions are that a lossy cache can flip.
Run from the repository root: PYTHONPATH=. python benchmarks/results/2026-12-03-fixture-ratio-sweep-cpu/dense_margins.py"""
import json, torch, sys
from transformers import AutoModelForCausalLM
from ckvp_compile.bench.decode_fixture import default_model_dir
d = json.load(open('benchmarks/results/2026-12-02-fixture-groups-cpu/fixture_planned_rot_fp8_measured_4x_16p_w16_g1.json'))
starts = d['meta']['prompt_starts']; dense = d['rows'][0]['generated']
md = default_model_dir()
m = AutoModelForCausalLM.from_pretrained(md, dtype=torch.float32, local_files_only=True).eval()
text = (md / 'eval_text.txt').read_bytes()
allm = []
for i, s in enumerate(starts):
    ids = torch.tensor([list(text[s:s+128]) + dense[i]])
    with torch.no_grad():
        lg = m(ids).logits[0, 127:127+64]
    top = lg.topk(2, dim=-1).values
    mar = (top[:, 0] - top[:, 1])
    assert (lg.argmax(-1).tolist() == dense[i]), i
    allm.append(mar)
    srt = mar.sort().values[:3]
    print(i, 'min margins', [round(x, 3) for x in srt.tolist()], 'median', round(mar.median().item(), 2))
a = torch.cat(allm)
print('quantiles', [round(a.quantile(q).item(), 3) for q in (0.005, 0.01, 0.02, 0.05, 0.1, 0.5)])
print('logit std', lg.std().item())
