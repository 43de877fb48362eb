"""Debug: lead9 of test_triton_stack_matches_reference (d=64, H=4, n=18,
groups of 16) per leaf on the GPU, matmuls at 'highest' as in conftest;
variants: default, LOWP off in sites_kernel, LOWP off in every group kernel, f32."""
import sys
import numpy as np, jax, jax.numpy as jnp
jax.config.update("jax_default_matmul_precision", "highest")
from mhar_jax.kernels import triton_stack
from mhar_jax.kernels.stack import routed_stack
tr = triton_stack.tr
lead, d, heads, n, blocks = (2, 37), 64, 4, 18, None
def sublayer(j, p, x, consts):
  y = jnp.tanh(x.astype(jnp.float32) @ p["w"].astype(jnp.float32) + p["b"])
  return (y * (1.0 + 0.1 * j) * consts).astype(x.dtype)
def rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64); b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  if not np.isfinite(a).all(): return 99.0
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
def grads(h, params, queries, gains, cot, impl, sg):
  def f(h, params, queries, gains):
    out = routed_stack(h, params, sublayer, queries, gains, jnp.asarray(1.3, jnp.float32), num_heads=heads, impl=impl, blocks=blocks, site_group=sg)
    return jnp.sum(out.astype(jnp.float32) * cot), out
  return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))(h, params, queries, gains)
orig = tr._launch
def no_lowp(names):
  def launch(kernel, *a, **k):
    if kernel.__name__ in names and "LOWP" in k:
      k = dict(k, LOWP=False)
    return orig(kernel, *a, **k)
  return launch
cache = {}
for name, dtype, kernels in (("bf16", jnp.bfloat16, ()), ("bf16 LOWP off: sites_kernel", jnp.bfloat16, ("sites_kernel",)),
                             ("bf16 LOWP off: every group kernel", jnp.bfloat16, ("sites_kernel", "sources_kernel", "query_gain_grad_kernel")),
                             ("f32", jnp.float32, ())):
  tr._launch = no_lowp(kernels) if kernels else orig
  ks = jax.random.split(jax.random.key(d + n), 6)
  h = (jax.random.normal(ks[0], (*lead, d)) * 2 + 0.5).astype(dtype)
  params = tuple({"w": jax.random.normal(k, (d, d)) / np.sqrt(d), "b": 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (d,))} for k in jax.random.split(ks[1], n))
  queries = 0.5 * jax.random.normal(ks[2], (n + 1, d)) / np.sqrt(d / heads)
  gains = 1 + 0.3 * jax.random.normal(ks[3], (n + 1, d))
  cot = jax.random.normal(ks[4], lead + (d,))
  got = grads(h, params, queries, gains, cot, "triton", 16)
  if dtype not in cache:
    cache[dtype] = (grads(h, params, queries, gains, cot, "reference", 0),
                    grads(h.astype(jnp.float32), params, queries, gains, cot, "reference", 0))
  want, exact = cache[dtype]
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(got)[0]]
  rows = [(nm, rel(a, c), rel(b, c), rel(a, b)) for nm, a, b, c in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(exact))]
  ref = max(r[2] for r in rows)
  bad = [r for r in rows if r[1] > max(1e-2, 1.5 * ref)] if dtype == jnp.bfloat16 else [r for r in rows if r[3] > 1e-5]
  print(f"== {name}: worst got-exact {max(r[1] for r in rows):.2e}, want-exact {ref:.2e}, got-want {max(r[3] for r in rows):.2e}; bad {len(bad)}", flush=True)
  for r in sorted(rows, key=lambda r: -r[1])[:5]:
    print(f"  {r[0]:32s} got-exact {r[1]:.2e} want-exact {r[2]:.2e} got-want {r[3]:.2e}", flush=True)
