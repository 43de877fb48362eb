"""Deviceless check of the PTX cache against the real jax-triton and Triton:
lower a route's forward and backward for sm_90 (benchmarks/h200_aot.py), then
again with jax-triton's compile replaced by one that fails, reading every
kernel from the disk cache; the two lowered modules must be equal. With
jax-triton's dump directory set the cache must stand aside. From the
repository root, in the deviceless venv:
python benchmarks/runs/2026-12-07-session42-deviceless/lower_from_cache.py"""
import os, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../.."))
import h200_aot; devs = h200_aot.setup()
import jax, jax.numpy as jnp
import jax_triton as jt
from mhar_jax.kernels import triton_route as tr, ptx_cache
d = tempfile.mkdtemp()
srcs = [jax.ShapeDtypeStruct((301, 1280), jnp.bfloat16)] * 5
q = jax.ShapeDtypeStruct((1280,), jnp.float32)
def both(x, qq, g, dy):
  out, vjp = jax.vjp(lambda *a: tr.route(*a, num_heads=8), x, qq, g)
  return out, vjp(dy)
def lower():
  jt.triton_lib._COMPILED_KERNEL_CACHE.clear(); jax.clear_caches()
  return jax.jit(both).trace(srcs, q, q, srcs[0]).lower(lowering_platforms=("cuda",)).as_text()
jax.config.update("jax_compilation_cache_dir", d)
a = lower()
n = sorted(os.listdir(os.path.join(d, ptx_cache.SUBDIR)))
def must_not(*args): raise AssertionError("compiled")
jt.triton_lib.compile_ttir_inplace = tr._ptx_cached(must_not)
b = lower()
print("entries", len(n), "same text", a == b, len(a))
jt.triton_lib._JAX_TRITON_DUMP_DIR = tempfile.mkdtemp()
try:
  lower(); print("dump dir: cache bypassed? NO (lowered without compiling)")
except AssertionError as e:
  print("dump dir set: cache bypassed (compile attempted):", e)
