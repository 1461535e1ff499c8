import torch
from transformers import AutoModelForCausalLM
d='models/tiny-mixtral-pystdlib'
m=AutoModelForCausalLM.from_pretrained(d,dtype=torch.float32,local_files_only=True).eval()
t=open(d+'/eval_text.txt','rb').read()
ids=torch.tensor([list(t[i:i+2048]) for i in range(100000,100000+8*2048,2048)])
with torch.no_grad(): lg=m(input_ids=ids,use_cache=False).logits
nll=torch.nn.functional.cross_entropy(lg[:,:-1].reshape(-1,256),ids[:,1:].reshape(-1),reduction='none').view(8,-1)
for a,b in [(0,128),(128,256),(256,384),(384,512),(512,1024),(1024,2047)]:
    print(a,b, round(float(nll[:,a:b].mean()),3))
