"""The buffers live at a compiled step's peak, grouped by (size, JAX operation)
with their count: which arrays of the same kind are live there.

    python3 peak_by_op.py DUMP_DIR/module_0001.jit_step.sm_9.0a_gpu_after_optimizations

(the prefix of XLA's ``*-live-range.txt`` and ``.txt`` dumps, as written by
``benchmarks/peak_buffers.compile_with_dump``). Session 25 (RESULTS.md).
"""
import re,sys,collections
F=sys.argv[1]
lr=open(F+'-live-range.txt').read()
m=re.search(r"Live ranges at (\d+) \(peak\):\n(.*?)\n  \S", lr, re.S)
live=[(a,int(b)) for a,b in re.findall(r"^\s*(\S+): (\d+) bytes \(cum", m.group(2), re.M)]
hlo=open(F+'.txt').read()
cat=collections.Counter(); cnt=collections.Counter()
for name,b in live:
  base=name.split('{')[0]
  mm=re.search(r"%"+re.escape(base)+r" = ([^ ]+) .*?op_name=\"([^\"]*)\"", hlo)
  key=(mm.group(2) if mm else '?')
  key=re.sub(r'\d+','#',key)[:90]
  cat[(b,key)]+=b; cnt[(b,key)]+=1
for (b,k),v in sorted(cat.items(), key=lambda x:-x[1])[:25]:
  print(f"{v/2**30:7.3f} GiB  {cnt[(b,k)]:3d} x {b/2**20:8.1f} MiB  {k}")
