"""Pure-jnp routing: the specification every fast path is compared against.

Multi-head depth routing (DESIGN.md §1). For S sources ``s_i`` of width D, a
pseudo-query ``q`` and an RMSNorm gain ``g`` (both ``[D]``), and H heads of
``D/H`` contiguous channels::

    r_i        = rsqrt(mean_c s_{i,c}^2 + eps)                  (over all D channels)
    logit[i,h] = r_i * sum_{c in head h} q_c g_c s_{i,c}
    w[i,h]     = softmax_i(logit[., h])
    out[c]     = sum_i w[i, head(c)] * s_{i,c}

``H = 1`` is Attention Residuals. Norms, logits, softmax and accumulation run in
float32; the output has the sources' dtype.

Memory: the forward saves only the sources themselves (which the caller keeps
alive anyway), the per-source ``r`` and the weights ``w`` (``[S, ..., H]``), so a
model that calls :func:`route` at every site with a growing list of sources pays
one copy of the history, not one per site. The backward is written out by hand
(``jax.custom_vjp``) so that this holds whatever XLA decides to fuse. The
forward stacks the sources into one ``[S, ..., D]`` temporary (freed after the
site; O(1) operations per site, so deep models compile faster) at the price
of traffic the GPU kernels do not pay. The backward works source by source
and is tied to the incoming cotangent, because a stacked backward lets XLA
keep every site's stacked gradients alive at once (measured: quadratic
temporaries).

All contractions are einsums over a ``(..., H, D/H)`` view, so with heads
divisible by a mesh's model axis each head's softmax is local to a shard and
only the sum of squares inside ``r`` crosses it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Union

import jax
import jax.numpy as jnp

Sources = Union[jax.Array, Sequence[jax.Array]]


def as_source_list(sources: Sources) -> list[jax.Array]:
  """Returns the sources as a list of S arrays ``[..., D]``.

  Accepts an array with the source axis first (``[S, ..., D]``) or a sequence
  of arrays of equal shape and dtype.
  """
  if isinstance(sources, (list, tuple)):
    if not sources:
      raise ValueError("route: sources is empty; pass at least one source.")
    first = sources[0]
    for i, s in enumerate(sources):
      if s.shape != first.shape or s.dtype != first.dtype:
        raise ValueError(
            f"route: sources[{i}] has shape {s.shape} and dtype {s.dtype}, but"
            f" sources[0] has {first.shape} and {first.dtype}; all sources"
            " must match.")
    return list(sources)
  if sources.ndim < 2:
    raise ValueError(
        f"route: sources of shape {sources.shape} must be [S, ..., D].")
  return [sources[i] for i in range(sources.shape[0])]


def check_route_args(sources: list[jax.Array], query, norm_scale,
                     num_heads: int) -> int:
  """Validates shapes; returns the width D."""
  d = sources[0].shape[-1]
  if query.shape != (d,) or norm_scale.shape != (d,):
    raise ValueError(
        f"route: query {query.shape} and norm_scale {norm_scale.shape} must"
        f" both be ({d},), the sources' width.")
  if num_heads < 1 or d % num_heads:
    raise ValueError(
        f"route: num_heads={num_heads} must be >= 1 and divide the width"
        f" D={d}.")
  return d


def _heads(x: jax.Array, num_heads: int) -> jax.Array:
  """``[..., D] -> [..., H, D/H]`` in float32."""
  return x.astype(jnp.float32).reshape(*x.shape[:-1], num_heads, -1)


def inv_rms(s: jax.Array, eps: float) -> jax.Array:
  """``[..., D] -> [...]``: ``rsqrt(mean(s^2) + eps)`` in float32."""
  s = s.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(s * s, axis=-1) + eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """``[..., D] -> [..., D]``: ``x * rsqrt(mean(x^2) + eps) * scale``,
  float32 math, ``x``'s dtype out."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _weights(st, query, norm_scale, num_heads, eps):
  """``st [S, ..., D]`` -> ``(w [S, ..., H], r [S, ...], u [S, ..., H], t [H, C])``."""
  t = (query.astype(jnp.float32) * norm_scale.astype(jnp.float32)).reshape(
      num_heads, -1)
  r = inv_rms(st, eps)
  u = jnp.einsum("s...hc,hc->s...h", _heads(st, num_heads), t)
  w = jax.nn.softmax(r[..., None] * u, axis=0)
  return w, r, u, t


def _mix(st, w, num_heads):
  """``sum_i w[i, ..., head(c)] * s_i[..., c]`` in float32, ``[..., D]``."""
  out = jnp.einsum("s...h,s...hc->...hc", w, _heads(st, num_heads))
  return out.reshape(st.shape[1:])


def routing_weights(sources: Sources, query: jax.Array, norm_scale: jax.Array,
                    *, num_heads: int, eps: float = 1e-6) -> jax.Array:
  """The softmax routing weights ``[S, ..., H]`` (float32) of :func:`route`."""
  sources = as_source_list(sources)
  check_route_args(sources, query, norm_scale, num_heads)
  return _weights(jnp.stack(sources), query, norm_scale, num_heads, eps)[0]


def route(sources: Sources, query: jax.Array, norm_scale: jax.Array, *,
          num_heads: int, eps: float = 1e-6) -> jax.Array:
  """Multi-head depth routing, pure jnp (see the module docstring).

  Args:
    sources: ``[S, ..., D]`` or a sequence of S arrays ``[..., D]``.
    query: ``[D]`` pseudo-query of the routing site.
    norm_scale: ``[D]`` RMSNorm gain applied to the keys.
    num_heads: H, dividing D. 1 is AttnRes.
    eps: RMSNorm epsilon.

  Returns:
    ``[..., D]`` in the sources' dtype.
  """
  sources = as_source_list(sources)
  check_route_args(sources, query, norm_scale, num_heads)
  return _route(tuple(sources), query, norm_scale, num_heads, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _route(sources, query, norm_scale, num_heads, eps):
  st = jnp.stack(sources)
  w, _, _, _ = _weights(st, query, norm_scale, num_heads, eps)
  return _mix(st, w, num_heads).astype(st.dtype)


def _route_fwd(sources, query, norm_scale, num_heads, eps):
  st = jnp.stack(sources)
  w, r, u, t = _weights(st, query, norm_scale, num_heads, eps)
  out = _mix(st, w, num_heads).astype(st.dtype)
  return out, (sources, query, norm_scale, w, r, u, t)


def _route_bwd(num_heads, eps, res, g):
  del eps
  sources, query, norm_scale, w, r, u, t = res
  sources, g = jax.lax.optimization_barrier((tuple(sources), g))
  d = sources[0].shape[-1]
  g = _heads(g, num_heads)
  dw = jnp.stack([jnp.einsum("...hc,...hc->...h", g, _heads(s, num_heads))
                  for s in sources])
  dlogit = w * (dw - jnp.sum(w * dw, axis=0, keepdims=True))
  du = dlogit * r[..., None]
  dr = jnp.sum(dlogit * u, axis=-1)
  dt = jnp.zeros_like(t)
  dsources = []
  for s, wi, dui, dri, ri in zip(sources, w, du, dr, r):
    sh = _heads(s, num_heads)
    dt = dt + jnp.einsum("...h,...hc->hc", dui, sh)
    ds = (jnp.einsum("...h,...hc->...hc", wi, g)
          + jnp.einsum("...h,hc->...hc", dui, t)
          - (dri * ri**3 / d)[..., None, None] * sh)
    dsources.append(ds.reshape(s.shape).astype(s.dtype))
  dt = dt.reshape(d)
  dquery = (dt * norm_scale.astype(jnp.float32)).astype(query.dtype)
  dscale = (dt * query.astype(jnp.float32)).astype(norm_scale.dtype)
  return tuple(dsources), dquery, dscale


_route.defvjp(_route_fwd, _route_bwd)
