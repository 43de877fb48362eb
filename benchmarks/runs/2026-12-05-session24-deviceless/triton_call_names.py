import re, zlib, sys, collections, glob
def unesc(s):
  out=bytearray(); i=0
  while i<len(s):
    c=s[i]
    if c=='\\':
      n=s[i+1]
      if n in '01234567':
        j=i+1; k=j
        while k<len(s) and k<j+3 and s[k] in '01234567': k+=1
        out.append(int(s[j:k],8)); i=k; continue
      m={'n':10,'t':9,'r':13,'\\':92,'"':34,"'":39}
      out.append(m.get(n,ord(n))); i+=2; continue
    out.append(ord(c)); i+=1
  return bytes(out)
for n in sys.argv[1:]:
  f=glob.glob(f"{n}/*after_optimizations.txt")[0]
  cnt=collections.Counter()
  for line in open(f):
    if 'custom_call_target="triton_kernel_call"' not in line or 'custom-call(' not in line: continue
    m=re.search(r'backend_config="((?:[^"\\]|\\.)*)"',line)
    raw=zlib.decompress(unesc(m.group(1)))
    names=re.findall(rb'(?:[a-z_]+_kernel|_fwd[a-z_]*|_bwd[a-z_]*|[a-z_]+_grad[a-z_]*)',raw)
    nm=names[0].decode() if names else '?'
    cnt[nm]+=1
  print(n, sorted(cnt.items()))
