"""Fusion kernels of two XLA dumps of the train step, by kind, JAX operation and shape: counts in the first
less the second (>= 20 shown). python3 THIS MHAR_DUMP_DIR BASELINE_DUMP_DIR"""
import re,collections,sys
def load(d):
  T=open(d+'/module_0001.jit_step.thunk_sequence_after_thunk_passes.txt').read().splitlines()
  import glob
  H=open(glob.glob(d+'/*after_optimizations.txt')[0]).read()
  insts={}
  for line in H.splitlines():
    m=re.match(r'\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\(',line)
    if m: insts[m.group(1)]=line
  c=collections.Counter()
  for l in T:
    m=re.search(r'\] ((?:input|loop)_[a-z_]*fusion(?:_\d+)?) grid',l)
    if not m: continue
    hn=re.sub(r'_(\d+)$',r'.\1',m.group(1))
    line=insts.get(hn,'')
    op=re.search(r'op_name="([^"]+)"',line)
    shape=re.match(r'\s*(?:ROOT )?%[\w.\-]+ = (\S+)',line)
    fam=re.sub(r'_\d+$','',m.group(1))
    o=op.group(1) if op else '?'
    o=re.sub(r'jit\(step\)/','',o)
    c[(fam, o[:70], re.sub(r'\{.*','',shape.group(1))[:40] if shape else '?')]+=1
  return c
# argv: the MHAR dump directory, the baseline's (peak_buffers.compile_with_dump)
a=load(sys.argv[1]); b=load(sys.argv[2])
keys=sorted(set(a)|set(b), key=lambda k: -(a[k]-b[k]))
for k in keys:
  if a[k]-b[k]>=20: print(f"{a[k]-b[k]:+5d} {a[k]:5d} {b[k]:5d}", k)
print('total', sum(a.values()), sum(b.values()))
