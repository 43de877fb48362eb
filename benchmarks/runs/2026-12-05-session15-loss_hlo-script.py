import sys; sys.path.insert(0, "/work/main/benchmarks")
import h200_aot; devices = h200_aot.setup()
import jax, jax.numpy as jnp, re
from mhar_jax.loss import lm_head_cross_entropy
from jax.sharding import SingleDeviceSharding
sh = SingleDeviceSharding(devices[0])
x = jax.ShapeDtypeStruct((32, 1024, 1280), jnp.bfloat16, sharding=sh)
h = jax.ShapeDtypeStruct((151936, 1280), jnp.bfloat16, sharding=sh)
t = jax.ShapeDtypeStruct((32, 1024), jnp.int32, sharding=sh)
f = jax.jit(jax.grad(lambda x, h, t: lm_head_cross_entropy(x, h, t)[0], argnums=(0, 1)))
c = f.lower(x, h, t).compile()
txt = c.as_text()
open("/tmp/s15/loss_hlo.txt", "w").write(txt)
ma = c.memory_analysis()
print("temp GiB", ma.temp_size_in_bytes / 2**30)
for l in txt.splitlines():
  if "custom_call_target=\"__cublas" in l or "cublas" in l and "custom-call" in l:
    print(l.strip()[:400])
