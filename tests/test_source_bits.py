"""benchmarks/source_bits.py: the 8-bit read of a source it trains with."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import source_bits  # noqa: E402

from mhar_jax import kernels  # noqa: E402


def test_read_8bit_rounds_each_token_at_its_own_scale():
  # tokens whose RMS differ by 1e4: each is rounded relative to its own
  s = jax.random.normal(jax.random.key(0), (3, 256)) * jnp.array(
      [[1e-2], [1.0], [1e2]])
  q = source_bits.read_8bit(s, 1e-6)
  x, err = np.asarray(s), np.abs(np.asarray(q - s))
  rms = np.sqrt(np.mean(x ** 2, -1, keepdims=True))
  # e4m3: 3 mantissa bits (half a step 2^-4 of the value), subnormal steps
  # of 2^-9 of the RMS
  assert np.all(err <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * rms)
  assert np.mean(err / rms) > 1e-3          # it does round
  # q * r lies on e4m3's grid (up to float32's rounding of / r * r)
  r = jax.lax.rsqrt(jnp.mean(s * s, -1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(
      q * r, (q * r).astype(jnp.float8_e4m3fn).astype(jnp.float32),
      rtol=1e-6)
  # gradients pass straight through
  g = jax.grad(lambda x: jnp.sum(source_bits.read_8bit(x, 1e-6) * s))(s)
  np.testing.assert_array_equal(g, s)


def test_patch_routes_rounded_sources_and_restores():
  ks = jax.random.split(jax.random.key(1), 3)
  src = [jax.random.normal(k, (4, 64)) for k in ks]
  q = jax.random.normal(jax.random.key(2), (64,))
  g = jnp.ones((64,))
  before = kernels.route(src, q, g, num_heads=4)
  restore = source_bits.patch_routing()
  try:
    got = kernels.route(src, q, g, num_heads=4)
  finally:
    restore()
  want = kernels.route([source_bits.read_8bit(s, 1e-6) for s in src], q, g,
                       num_heads=4)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert not np.allclose(got, before, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(kernels.route(src, q, g, num_heads=4), before)
