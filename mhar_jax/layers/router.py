"""Routing modules: the depth router of AttnRes / MHAR and static Hyper-Connections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mhar_jax import kernels
from mhar_jax.layers.basic import Dtype, param
from mhar_jax.layers.sharding import constrain


class DepthRouter(nnx.Module):
  """One routing site: a learned softmax mixture of earlier sources.

  Owns a pseudo-query ``query [D]`` (zeros: starts as the uniform mean) and a
  key RMSNorm gain ``norm_scale [D]`` (ones). ``num_heads`` splits the
  channels into contiguous groups with one softmax over sources each
  (``num_heads=1`` is AttnRes). Call with a list of S arrays ``[..., D]`` (or
  ``[S, ..., D]``); returns ``[..., D]`` in the sources' dtype.
  """

  def __init__(self, dim: int, num_heads: int = 1, *, eps: float = 1e-6,
               impl: str | None = None, param_dtype: Dtype = jnp.float32,
               rngs: nnx.Rngs | None = None):
    if num_heads < 1 or dim % num_heads:
      raise ValueError(
          f"model.routing_heads={num_heads} must be >= 1 and divide"
          f" model.d_model={dim}.")
    kernels.resolve_impl(impl)  # fails early on an unknown impl
    self.num_heads, self.eps, self.impl = num_heads, eps, impl
    self.query = param(rngs, nnx.initializers.zeros, (dim,), ("norm",),
                       param_dtype)
    self.norm_scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",),
                            param_dtype)

  def __call__(self, sources: kernels.Sources) -> jax.Array:
    return kernels.route(sources, self.query[...], self.norm_scale[...],
                         num_heads=self.num_heads, eps=self.eps,
                         impl=self.impl)

  def weights(self, sources: kernels.Sources) -> jax.Array:
    """The routing weights ``[S, ..., H]`` (float32) this site would use."""
    return kernels.routing_weights(sources, self.query[...],
                                   self.norm_scale[...],
                                   num_heads=self.num_heads, eps=self.eps)


class HyperConnection(nnx.Module):
  """Static Hyper-Connections (Zhu et al. 2024) around one sublayer, n streams.

  The residual state is ``h [B, T, n, D]``. With the sublayer ``f``::

      x     = sum_k width[k] * h[:, :, k]              (the sublayer's input)
      y     = f(x)
      h'[m] = sum_k mix[m, k] * h[k] + depth[m] * y

  Initialisation for sublayer ``index``: ``width`` one-hot at ``index mod n``,
  ``mix`` the identity, ``depth`` ones, which makes the model equal to the
  pre-norm baseline at step 0 when the streams start as copies of the
  embedding and are summed before the final norm.
  """

  def __init__(self, num_streams: int, index: int, *,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs
    n = num_streams
    self.width = nnx.Param(
        jax.nn.one_hot(index % n, n, dtype=param_dtype))
    self.mix = nnx.Param(jnp.eye(n, dtype=param_dtype))
    self.depth = nnx.Param(jnp.ones((n,), param_dtype))

  def read(self, h: jax.Array) -> jax.Array:
    """``[B, T, n, D] -> [B, T, D]``: the sublayer's input."""
    return jnp.einsum("k,btkd->btd", self.width[...].astype(h.dtype), h)

  def write(self, h: jax.Array, y: jax.Array) -> jax.Array:
    """New streams ``[B, T, n, D]`` from the old ones and the output ``y``."""
    h = (jnp.einsum("mk,btkd->btmd", self.mix[...].astype(h.dtype), h)
         + self.depth[...].astype(h.dtype)[:, None] * y[:, :, None, :])
    return constrain(h, ("activation_batch", "activation_length",
                         "activation_streams", "activation_embed"))


def block_boundaries(num_sublayers: int, num_blocks: int) -> list[int]:
  """Block index of each sublayer: ``num_blocks`` near-equal runs, in order."""
  if not 1 <= num_blocks <= num_sublayers:
    raise ValueError(
        f"model.num_blocks={num_blocks} must be between 1 and the number of"
        f" sublayers (2 * num_layers = {num_sublayers}).")
  return [j * num_blocks // num_sublayers for j in range(num_sublayers)]


def mean_entropy(weights: jax.Array) -> jax.Array:
  """Mean entropy (nats) over tokens and heads of ``[S, ..., H]`` weights."""
  w = jnp.clip(weights, 1e-30, 1.0)
  return jnp.mean(-jnp.sum(w * jnp.log(w), axis=0))


__all__ = ["DepthRouter", "HyperConnection", "block_boundaries", "mean_entropy"]
