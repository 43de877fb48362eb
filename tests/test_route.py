"""route() against a plain Python loop over sources and heads (values and grads)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhar_jax import kernels
from mhar_jax.kernels import reference


def loop_route(sources, query, scale, num_heads, eps=1e-6):
  """The DESIGN.md §1 formula, one source and one head at a time (float64 numpy)."""
  src = [np.asarray(s, np.float64) for s in sources]
  q, g = np.asarray(query, np.float64), np.asarray(scale, np.float64)
  d = src[0].shape[-1]
  c = d // num_heads
  out = np.zeros_like(src[0])
  for h in range(num_heads):
    sl = slice(h * c, (h + 1) * c)
    logits = np.stack([
        (1 / np.sqrt(np.mean(s**2, -1) + eps)) * np.sum(q[sl] * g[sl] * s[..., sl], -1)
        for s in src])
    w = np.exp(logits - logits.max(0))
    w /= w.sum(0)
    for i, s in enumerate(src):
      out[..., sl] += w[i][..., None] * s[..., sl]
  return out


def rand_inputs(key, s, shape, d, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(key, 3)
  scales = jnp.exp(jax.random.normal(k1, (s,) + (1,) * (len(shape) + 1)))
  sources = (jax.random.normal(k2, (s, *shape, d)) * scales).astype(dtype)
  q = jax.random.normal(k3, (d,)) * 0.5
  g = 1 + 0.3 * jax.random.normal(jax.random.fold_in(k3, 1), (d,))
  return sources, q, g


@pytest.mark.parametrize("s,shape,d,h", [(1, (3,), 8, 1), (5, (2, 3), 16, 4),
                                         (7, (4,), 24, 3), (4, (2, 5), 32, 32)])
def test_route_matches_loop(s, shape, d, h):
  sources, q, g = rand_inputs(jax.random.key(s * 7 + h), s, shape, d)
  want = loop_route(sources, q, g, h)
  got_stacked = kernels.route(sources, q, g, num_heads=h, impl="reference")
  got_list = kernels.route(list(sources), q, g, num_heads=h)
  chex.assert_shape(got_stacked, (*shape, d))
  np.testing.assert_allclose(got_stacked, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got_list, want, rtol=2e-5, atol=2e-5)


def naive_jnp_route(sources, q, g, h, eps=1e-6):
  """Autodiff-able loop version: the gradient oracle for the custom VJP."""
  d = sources[0].shape[-1]
  c = d // h
  outs = []
  r = [jax.lax.rsqrt(jnp.mean(s**2, -1) + eps) for s in sources]
  for hh in range(h):
    sl = slice(hh * c, (hh + 1) * c)
    lg = jnp.stack([r[i] * jnp.sum(q[sl] * g[sl] * s[..., sl], -1)
                    for i, s in enumerate(sources)])
    w = jax.nn.softmax(lg, 0)
    outs.append(sum(w[i][..., None] * s[..., sl] for i, s in enumerate(sources)))
  return jnp.concatenate(outs, -1)


@pytest.mark.parametrize("s,h", [(1, 2), (6, 1), (6, 4), (9, 8)])
def test_route_gradients(s, h):
  d = 16
  sources, q, g = rand_inputs(jax.random.key(100 + s + h), s, (2, 3), d)
  ct = jax.random.normal(jax.random.key(5), (2, 3, d))
  f_ref = lambda src, q, g: jnp.sum(kernels.route(list(src), q, g, num_heads=h) * ct)
  f_oracle = lambda src, q, g: jnp.sum(naive_jnp_route(list(src), q, g, h) * ct)
  got = jax.jit(jax.grad(f_ref, (0, 1, 2)))(sources, q, g)
  want = jax.jit(jax.grad(f_oracle, (0, 1, 2)))(sources, q, g)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_single_head_is_attnres_formula():
  sources, q, g = rand_inputs(jax.random.key(3), 5, (4,), 12)
  r = jax.lax.rsqrt(jnp.mean(sources**2, -1) + 1e-6)              # [S, N]
  logits = jnp.einsum("snd,d->sn", sources, q * g) * r
  w = jax.nn.softmax(logits, axis=0)
  want = jnp.einsum("sn,snd->nd", w, sources)
  got = kernels.route(sources, q, g, num_heads=1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("h", [1, 4])
def test_zero_query_gives_uniform_mean(h):
  sources, _, g = rand_inputs(jax.random.key(4), 6, (3,), 16)
  got = kernels.route(sources, jnp.zeros(16), g, num_heads=h)
  np.testing.assert_allclose(got, jnp.mean(sources, 0), rtol=1e-5, atol=1e-6)
  w = kernels.routing_weights(sources, jnp.zeros(16), g, num_heads=h)
  chex.assert_shape(w, (6, 3, h))
  np.testing.assert_allclose(w, 1 / 6, rtol=1e-6)


def test_perturbing_one_head_changes_only_its_channels():
  d, h = 32, 4
  sources, q, g = rand_inputs(jax.random.key(8), 5, (7,), d)
  base = kernels.route(sources, q, g, num_heads=h)
  c = d // h
  for head in range(h):
    q2 = q.at[head * c:(head + 1) * c].add(1.5)
    diff = jnp.abs(kernels.route(sources, q2, g, num_heads=h) - base)
    inside = diff[..., head * c:(head + 1) * c]
    outside = jnp.concatenate([diff[..., :head * c], diff[..., (head + 1) * c:]], -1)
    assert float(inside.max()) > 1e-3
    assert float(outside.max()) == 0.0


def test_bf16_dtype_and_accuracy():
  sources, q, g = rand_inputs(jax.random.key(9), 8, (4, 5), 64, jnp.bfloat16)
  got = kernels.route(list(sources), q, g, num_heads=8)
  assert got.dtype == jnp.bfloat16
  want = loop_route(sources.astype(jnp.float32), q, g, 8)
  err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
  assert err < 1e-2
  grads = jax.jit(jax.grad(lambda s: jnp.sum(kernels.route(s, q, g, num_heads=8)
                                     .astype(jnp.float32))))(list(sources))
  assert all(x.dtype == jnp.bfloat16 for x in grads)


def test_bad_arguments_raise():
  sources, q, g = rand_inputs(jax.random.key(1), 3, (2,), 12)
  with pytest.raises(ValueError, match="num_heads=5"):
    kernels.route(sources, q, g, num_heads=5)
  with pytest.raises(ValueError, match="query"):
    kernels.route(sources, q[:4], g, num_heads=1)
  with pytest.raises(ValueError, match="sources\\[1\\]"):
    kernels.route([sources[0], sources[1][:1]], q, g, num_heads=1)
  with pytest.raises(ValueError, match="impl='nope'"):
    kernels.route(sources, q, g, num_heads=1, impl="nope")
  with pytest.raises(ValueError, match="triton"):
    kernels.route(sources, q, g, num_heads=1, impl="triton")  # no GPU here


def test_reference_forward_saves_no_copy_of_sources():
  """The VJP residuals are the sources themselves plus [S, ..., H] statistics."""
  sources, q, g = rand_inputs(jax.random.key(2), 4, (3,), 8)
  src = list(sources)
  _, res = reference._route_fwd(tuple(src), q, g, 2, 1e-6)
  saved_sources, _, _, w, r, u, _ = res
  assert all(a is b for a, b in zip(saved_sources, src))
  chex.assert_shape([w, u], (4, 3, 2))
  chex.assert_shape(r, (4, 3))


def test_triton_unrolled_code_is_generated():
  """The unrolled per-source code of kernels/triton_route.py is what
  tools/gen_route_steps.py writes (edit the generator, not the blocks)."""
  import subprocess
  import sys
  from pathlib import Path
  root = Path(__file__).resolve().parent.parent
  res = subprocess.run([sys.executable, str(root / "tools/gen_route_steps.py"),
                        "--check"], capture_output=True, text=True)
  assert res.returncode == 0, res.stdout + res.stderr
