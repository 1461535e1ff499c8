nvidia-smi -L; python -c "import torch,triton;print(torch.__version__,triton.__version__)"; python - <<'P'
import sys,torch,dataclasses as dc
sys.path[:0]=['tests/kernels','.']
import test_latent_attention_triton as T
from ckvp_compile.kernels import latent_attention_triton as L
from ckvp_compile.kernels import reference as R
C=L.DecodeConfig(block_r=16,split=3,hoist_basis=True,fma_scores=True,fma_values=True,target_programs=1,min_tiles=1)
B=dict(seed=1,b=2,hkv=5,ratio=1,d=32,kv_len=37,s=1,extra=3,rk=[12,5,9,16,3],rv=[4,9,7,7,7],kfmt="int4/32",vfmt="int8/32",rope="rotate_half",rd=16,mask=None,mask_shape="bhsk",mask_p=0.3,dtype=torch.float32,pos_dtype=torch.int32)
cs=[{},dict(kfmt="int2/16"),dict(kfmt="int8/32",rope="complex",rd=32),dict(kfmt="float",dtype=torch.bfloat16),dict(kfmt="float",rope="interleaved",mask="add"),dict(kfmt="int2/4",rk=[1,2,3,4,0]),dict(rk=[0,5,0,16,0],mask="bool",mask_shape="b1sk",s=2,win=5),dict(paired=True,dtype=torch.bfloat16,rd=32,kv_len=300,b=3)]
for odd in (0,1):
 for c in cs:
  p=dict(B,**c)
  a=[t.cuda() if torch.is_tensor(t) else t for t in T._inputs(p)]
  if odd:
   x=a[1];f=torch.zeros(x.numel()+1,dtype=x.dtype,device='cuda');f[1:]=x.reshape(-1);a[1]=f[1:].view(x.shape)
  w=R.latent_attention_ref(*a)
  for hg in (2,4,0):
   for bn,nw in ((16,1),(64,4)):
    try:
     o=L.latent_attention_triton(*a,config=dc.replace(C,head_group=hg,block_n=bn,num_warps=nw,paired_tables=bool(p.get('paired'))))
     e=f"{float((o.float()-w.float()).norm()/w.float().norm()):.2e}"
    except Exception as ex: e=repr(ex)[:150]
    print(odd,c,hg,bn,L._LAST_LAUNCH.get('head_group'),e,flush=True)
P
